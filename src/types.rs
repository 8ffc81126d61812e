//! Host-side inputs and outputs shared by the CPU and CUDA backends, with their shape checks.

use half::bf16;

use crate::error::{check_len, Error, Result};
use crate::{MAX_BUDGET, MAX_DEPTH, MAX_VOCAB};

/// A logits array on the host, f32 or bf16, row-major.
#[derive(Clone, Copy, Debug)]
pub enum Logits<'a> {
    /// 32-bit floats.
    F32(&'a [f32]),
    /// bfloat16 values, widened exactly to f32 by every kernel.
    Bf16(&'a [bf16]),
}

impl Logits<'_> {
    /// Number of elements.
    pub fn len(&self) -> usize {
        match self {
            Logits::F32(x) => x.len(),
            Logits::Bf16(x) => x.len(),
        }
    }

    /// True when there are no elements.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Element `i` as f32.
    #[inline]
    pub fn get(&self, i: usize) -> f32 {
        match self {
            Logits::F32(x) => x[i],
            Logits::Bf16(x) => x[i].to_f32(),
        }
    }

    /// "f32" or "bf16".
    pub fn dtype(&self) -> &'static str {
        match self {
            Logits::F32(_) => "f32",
            Logits::Bf16(_) => "bf16",
        }
    }
}

/// Checks a vocabulary size against [`MAX_VOCAB`].
pub fn check_vocab(vocab: usize) -> Result<()> {
    if vocab == 0 || vocab >= MAX_VOCAB {
        return Err(Error::param("vocab", vocab, format!("must be in 1..{MAX_VOCAB}")));
    }
    Ok(())
}

/// K = min(budget, vocab), optionally capped by `k_max` (which makes the tree approximate).
pub fn top_k_for(budget: usize, vocab: usize, k_max: Option<usize>) -> usize {
    budget.min(vocab).min(k_max.unwrap_or(usize::MAX))
}

/// Top-K over the vocabulary per (request, draft position): `[bs, L, K]` ids and log-probs, `[bs, L]` lse.
#[derive(Clone, Debug, PartialEq)]
pub struct TopK {
    /// Requests.
    pub bs: usize,
    /// Draft positions per request (L).
    pub depth: usize,
    /// Candidates kept per position.
    pub k: usize,
    /// Token ids, value descending then id ascending.
    pub ids: Vec<i32>,
    /// `logit - lse` for each id.
    pub logp: Vec<f32>,
    /// logsumexp of each row.
    pub lse: Vec<f32>,
}

/// The shape of a draft tree batch.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct TreeShape {
    /// Requests.
    pub bs: usize,
    /// Draft positions L, the deepest a node can be.
    pub depth: usize,
    /// Node budget B (draft nodes, root excluded).
    pub budget: usize,
}

impl TreeShape {
    /// Validates the budget and depth limits.
    pub fn new(bs: usize, depth: usize, budget: usize) -> Result<Self> {
        let shape = TreeShape { bs, depth, budget };
        shape.validate()?;
        Ok(shape)
    }

    /// Checks the limits again (the fields are public, so a shape may not have come from [`TreeShape::new`]).
    pub fn validate(&self) -> Result<()> {
        let TreeShape { bs, depth, budget } = *self;
        if bs == 0 {
            return Err(Error::param("bs", bs, "need at least one request"));
        }
        if budget == 0 || budget > MAX_BUDGET {
            return Err(Error::param("budget", budget, format!("tree budget must be in 1..={MAX_BUDGET}")));
        }
        if depth == 0 || depth > MAX_DEPTH {
            return Err(Error::param("depth", depth, format!("draft depth L must be in 1..={MAX_DEPTH}")));
        }
        Ok(())
    }

    /// Rows per request, N = B + 1 (the root is row 0).
    pub fn rows(&self) -> usize {
        self.budget + 1
    }

    /// 32-bit words per visibility row, W = ceil(N / 32).
    pub fn words(&self) -> usize {
        self.rows().div_ceil(32)
    }
}

/// Largest K (candidates per depth) a tree build takes: ranks are packed in 12 bits on the device.
pub const MAX_TREE_K: usize = 4095;

/// Checks the tree-build inputs, by length: `[bs, L, K]` top ids and log-probs, `[bs]` root tokens and
/// prefix lengths, K in `1..=MAX_TREE_K`, and the shape's limits.
pub fn check_tree_inputs(
    shape: TreeShape,
    k: usize,
    top_ids: usize,
    top_logp: usize,
    root_token: usize,
    seq_len: usize,
) -> Result<()> {
    shape.validate()?;
    if k == 0 || k > MAX_TREE_K {
        return Err(Error::param("k", k, format!("candidates per depth must be in 1..={MAX_TREE_K}")));
    }
    let dims = [("bs", shape.bs), ("L", shape.depth), ("K", k)];
    check_len("top_ids", top_ids, &dims)?;
    check_len("top_logp", top_logp, &dims)?;
    check_len("root_token", root_token, &dims[..1])?;
    check_len("seq_len", seq_len, &dims[..1])
}

/// Checks host prefix lengths: `0 <= seq_len` and `seq_len + depth` (a node's position) fits in i32.
pub fn check_seq_len(seq_len: &[i32], depth: usize) -> Result<()> {
    match seq_len.iter().position(|&s| s < 0 || s as i64 + depth as i64 > i32::MAX as i64) {
        Some(b) => {
            Err(Error::param("seq_len", seq_len[b], format!("request {b}: must be >= 0 with seq_len + L in i32")))
        }
        None => Ok(()),
    }
}

/// Checks host tree-build log-probs: NaN and +inf are errors (a +inf score makes the sums NaN, whose order
/// differs between platforms); -inf is a zero-probability candidate. Reports the request.
pub fn check_top_logp(top_logp: &[f32], per_request: usize) -> Result<()> {
    match top_logp.iter().position(|v| v.is_nan() || *v == f32::INFINITY) {
        Some(i) => {
            let problem = if top_logp[i].is_nan() { "NaN log-prob" } else { "+inf log-prob" };
            Err(Error::Logits { name: "top_logp", row: i / per_request.max(1), problem })
        }
        None => Ok(()),
    }
}

/// Checks greedy-accept inputs: the tree, the vocabulary, and `[bs, N, V]` target logits.
pub fn check_target_logits(tree: &DraftTree, len: usize, vocab: usize) -> Result<()> {
    tree.check()?;
    check_vocab(vocab)?;
    let s = tree.shape;
    check_len("target_logits", len, &[("bs", s.bs), ("N", s.rows()), ("V", vocab)])
}

/// Checks the lengths of a tree batch's arrays against its shape (host and device trees alike): `[bs]`
/// num_nodes, the `[bs, N]` arrays in [`DraftTree`]'s field order, `[bs, N, W]` visibility.
pub fn check_tree_lengths(shape: TreeShape, num_nodes: usize, per_row: [usize; 6], visibility: usize) -> Result<()> {
    let rows = [("bs", shape.bs), ("N", shape.rows())];
    check_len("num_nodes", num_nodes, &rows[..1])?;
    let names = ["node_token", "node_depth", "parent", "first_child", "next_sibling", "position"];
    for (name, len) in names.into_iter().zip(per_row) {
        check_len(name, len, &rows)?;
    }
    check_len("visibility", visibility, &[("bs", shape.bs), ("N", shape.rows()), ("W", shape.words())])
}

/// A batch of draft trees (DESIGN.md §4.1 step 3). Rows past `num_nodes[b]` are padding: -1, and 0 in
/// `visibility`.
#[derive(Clone, Debug, PartialEq)]
pub struct DraftTree {
    /// The batch shape.
    pub shape: TreeShape,
    /// Draft nodes per request (root excluded): rows `0..=num_nodes[b]` are valid.
    pub num_nodes: Vec<i32>,
    /// `[bs, N]` token of each row; row 0 is the root (bonus) token.
    pub node_token: Vec<i32>,
    /// `[bs, N]` depth, root 0.
    pub node_depth: Vec<i32>,
    /// `[bs, N]` parent row, root -1; always smaller than the row.
    pub parent: Vec<i32>,
    /// `[bs, N]` first child row or -1.
    pub first_child: Vec<i32>,
    /// `[bs, N]` next sibling row (row order) or -1.
    pub next_sibling: Vec<i32>,
    /// `[bs, N]` position = seq_len + depth.
    pub position: Vec<i32>,
    /// `[bs, N, W]` bit j of row i set iff row j is row i or one of its ancestors.
    pub visibility: Vec<u32>,
}

impl DraftTree {
    /// Checks every array's length against the shape.
    pub fn check(&self) -> Result<()> {
        let s = self.shape;
        s.validate()?;
        check_tree_lengths(
            s,
            self.num_nodes.len(),
            [
                self.node_token.len(),
                self.node_depth.len(),
                self.parent.len(),
                self.first_child.len(),
                self.next_sibling.len(),
                self.position.len(),
            ],
            self.visibility.len(),
        )?;
        if let Some(b) = self.num_nodes.iter().position(|&n| n < 0 || n as usize > s.budget) {
            return Err(Error::param(
                "num_nodes",
                self.num_nodes[b],
                format!("request {b}: must be in 0..={}", s.budget),
            ));
        }
        let n_rows = s.rows() as i32;
        for (name, links) in [("first_child", &self.first_child), ("next_sibling", &self.next_sibling)] {
            if let Some(i) = links.iter().position(|&c| c < -1 || c >= n_rows) {
                return Err(Error::Index { name, detail: format!("entry {i} is {}, outside -1..{n_rows}", links[i]) });
            }
        }
        Ok(())
    }

    /// Row range of request `b` in the `[bs, N]` arrays.
    pub fn request_rows(&self, b: usize) -> std::ops::Range<usize> {
        let n = self.shape.rows();
        b * n..(b + 1) * n
    }

    /// The trees of a smaller `budget`: the first `budget + 1` rows of each, links past them cut. A
    /// best-first build adds nodes in decreasing path probability, so these are the trees a build of
    /// that budget makes (ENGINE.md §7: one build serves every smaller budget).
    pub fn first_rows(&self, budget: usize) -> Result<DraftTree> {
        let s = self.shape;
        if budget == 0 || budget > s.budget {
            return Err(Error::param("budget", budget, format!("must be in 1..={} (the built tree's)", s.budget)));
        }
        let shape = TreeShape::new(s.bs, s.depth, budget)?;
        let (n, words, keep_rows, keep_words) = (s.rows(), s.words(), shape.rows(), shape.words());
        let cut = |v: i32| if v >= keep_rows as i32 { -1 } else { v };
        let mut t = DraftTree {
            shape,
            num_nodes: self.num_nodes.iter().map(|&m| m.min(budget as i32)).collect(),
            node_token: Vec::new(),
            node_depth: Vec::new(),
            parent: Vec::new(),
            first_child: Vec::new(),
            next_sibling: Vec::new(),
            position: Vec::new(),
            visibility: Vec::new(),
        };
        let last_word = if keep_rows % 32 == 0 { u32::MAX } else { (1u32 << (keep_rows % 32)) - 1 };
        for b in 0..s.bs {
            let rows = b * n..b * n + keep_rows;
            t.node_token.extend_from_slice(&self.node_token[rows.clone()]);
            t.node_depth.extend_from_slice(&self.node_depth[rows.clone()]);
            t.parent.extend_from_slice(&self.parent[rows.clone()]);
            t.position.extend_from_slice(&self.position[rows.clone()]);
            t.first_child.extend(self.first_child[rows.clone()].iter().map(|&v| cut(v)));
            t.next_sibling.extend(self.next_sibling[rows.clone()].iter().map(|&v| cut(v)));
            for r in rows {
                let bits = &self.visibility[r * words..r * words + keep_words];
                t.visibility.extend_from_slice(&bits[..keep_words - 1]);
                t.visibility.push(bits[keep_words - 1] & last_word);
            }
        }
        Ok(t)
    }
}

/// The result of greedy acceptance (DESIGN.md §4.2).
#[derive(Clone, Debug, PartialEq)]
pub struct Acceptance {
    /// Requests.
    pub bs: usize,
    /// Draft positions L; the path arrays have L + 1 columns.
    pub depth: usize,
    /// `[bs, N]` target argmax per valid row, -1 for padding rows when computed from logits (as given
    /// when the argmax was the input).
    pub target_argmax: Vec<i32>,
    /// `[bs]` accepted draft nodes (root excluded).
    pub accept_len: Vec<i32>,
    /// `[bs, L+1]` accepted rows: 0, then the path; -1 padding.
    pub accept_rows: Vec<i32>,
    /// `[bs, L+1]` accepted draft tokens then the bonus token; -1 padding.
    pub emitted: Vec<i32>,
}

/// Layout of a paged KV cache: `[layers, num_pages, page_size, row_elems]` bf16, and per-request block
/// tables of `pages_per_req` page ids.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct KvLayout {
    /// Layers in the cache tensor.
    pub layers: usize,
    /// Pages per layer.
    pub num_pages: usize,
    /// Slots per page.
    pub page_size: usize,
    /// Elements per slot (576 for MLA's `[c_kv 512 | k_pe 64]`).
    pub row_elems: usize,
    /// Block-table entries per request.
    pub pages_per_req: usize,
}

impl KvLayout {
    /// Checks the compaction inputs of `bs` requests against this layout, by length: the cache,
    /// `[bs, pages_per_req]` block tables, `[bs]` accepted counts, `[bs, L+1]` accepted rows.
    pub fn check_compact_inputs(
        &self,
        bs: usize,
        cache: usize,
        block_table: usize,
        accept_len: usize,
        accept_rows: usize,
        depth: usize,
    ) -> Result<()> {
        for (name, v) in [
            ("layers", self.layers),
            ("num_pages", self.num_pages),
            ("page_size", self.page_size),
            ("row_elems", self.row_elems),
            ("pages_per_req", self.pages_per_req),
        ] {
            if v == 0 {
                return Err(Error::param(name, v, "the KV layout needs every dimension >= 1"));
            }
        }
        if depth == 0 || depth > MAX_DEPTH {
            return Err(Error::param("depth", depth, format!("must be in 1..={MAX_DEPTH}")));
        }
        let elems = [self.layers, self.num_pages, self.page_size, self.row_elems]
            .iter()
            .try_fold(1usize, |acc, &d| acc.checked_mul(d))
            .ok_or_else(|| Error::param("KvLayout", format!("{self:?}"), "element count overflows usize"))?;
        check_len("cache", cache, &[("elems", elems)])?;
        check_len("block_table", block_table, &[("bs", bs), ("pages_per_req", self.pages_per_req)])?;
        check_len("accept_len", accept_len, &[("bs", bs)])?;
        check_len("accept_rows", accept_rows, &[("bs", bs), ("L+1", depth + 1)])
    }

    /// Total cache elements.
    pub fn elems(&self) -> usize {
        self.layers * self.num_pages * self.page_size * self.row_elems
    }

    /// Element offset of `slot` of a request whose block table is `table`, in `layer`.
    pub fn slot_offset(&self, table: &[i32], layer: usize, slot: usize) -> Result<usize> {
        if layer >= self.layers || self.page_size == 0 {
            return Err(Error::param("layer", layer, format!("must be < {} with page_size >= 1", self.layers)));
        }
        let idx = slot / self.page_size;
        let page = *table.get(idx).ok_or_else(|| Error::Index {
            name: "block_table",
            detail: format!("slot {slot} needs page entry {idx}, table has {}", table.len()),
        })?;
        if page < 0 || page as usize >= self.num_pages {
            return Err(Error::Index {
                name: "block_table",
                detail: format!("page id {page} outside 0..{}", self.num_pages),
            });
        }
        Ok(((layer * self.num_pages + page as usize) * self.page_size + slot % self.page_size) * self.row_elems)
    }
}
