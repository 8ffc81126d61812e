//! Mixture-of-experts with INT4 experts (DESIGN.md §4.4): routing, alignment by expert, the gate/up GEMM
//! with SiLU, and the down GEMM with the routing-weighted combine. The weights are in the compressed-tensors
//! `pack-quantized` layout of Kimi-K2 checkpoints; the exact definition is in `reference/README.md`.
//!
//! Each (token, slot) pair is computed on its own with a fixed reduction order and the combine sums the
//! slots in order, so a token's output does not depend on the other tokens of the batch.

use half::bf16;
use rayon::prelude::*;

use crate::error::{check_len, Error, Result};

/// Input elements per quantization group (one bf16 scale each).
pub const GROUP: usize = 32;
/// INT4 values per packed i32.
pub const PACK: usize = 8;

/// A `[rows, cols]` INT4 matrix in the `pack-quantized` layout: `packed [rows, cols/8]` i32 (low nibble
/// first, stored as q + 8) and `scale [rows, cols/32]` bf16.
#[derive(Clone, Copy, Debug)]
pub struct Int4Matrix<'a> {
    /// Packed values.
    pub packed: &'a [i32],
    /// Group scales.
    pub scale: &'a [bf16],
    /// Rows (output features).
    pub rows: usize,
    /// Columns (input features), a multiple of 32.
    pub cols: usize,
}

impl Int4Matrix<'_> {
    /// Checks the column count and both arrays' lengths, naming the matrix.
    pub fn check(&self, name: &'static str) -> Result<()> {
        if self.cols == 0 || !self.cols.is_multiple_of(GROUP) {
            return Err(Error::param(
                name,
                self.cols,
                format!("input features must be a positive multiple of {GROUP}"),
            ));
        }
        check_len(name, self.packed.len(), &[("rows", self.rows), ("cols/8", self.cols / PACK)])?;
        check_len("scale", self.scale.len(), &[("rows", self.rows), ("cols/32", self.cols / GROUP)])
    }

    /// Row `r` dequantized: `(nibble - 8) * scale`.
    pub fn dequant_row(&self, r: usize, out: &mut [f32]) {
        let packed = &self.packed[r * self.cols / PACK..(r + 1) * self.cols / PACK];
        let scales = &self.scale[r * self.cols / GROUP..(r + 1) * self.cols / GROUP];
        for (c, v) in out.iter_mut().enumerate().take(self.cols) {
            let nibble = (packed[c / PACK] as u32 >> (4 * (c % PACK))) & 0xF;
            *v = (nibble as f32 - 8.0) * scales[c / GROUP].to_f32();
        }
    }
}

/// Owned INT4 weights produced by [`quantize`].
#[derive(Clone, Debug, PartialEq)]
pub struct Int4Owned {
    /// `[rows, cols/8]` packed values.
    pub packed: Vec<i32>,
    /// `[rows, cols/32]` scales.
    pub scale: Vec<bf16>,
}

/// One layer's routed experts in host memory, owned: the arrays an [`Experts`] view borrows.
#[derive(Clone, Debug, PartialEq)]
pub struct OwnedExperts {
    /// Number of experts E.
    pub count: usize,
    /// Hidden size H.
    pub hidden: usize,
    /// Intermediate size I.
    pub inter: usize,
    /// `[E * 2I, H]`: each expert's gate rows then up rows.
    pub w13: Int4Owned,
    /// `[E * H, I]`: each expert's down rows.
    pub w2: Int4Owned,
}

impl OwnedExperts {
    /// The borrowed view the MoE kernels take.
    pub fn view(&self) -> Experts<'_> {
        let (e, h, i) = (self.count, self.hidden, self.inter);
        Experts {
            count: e,
            hidden: h,
            inter: i,
            w13: Int4Matrix { packed: &self.w13.packed, scale: &self.w13.scale, rows: e * 2 * i, cols: h },
            w2: Int4Matrix { packed: &self.w2.packed, scale: &self.w2.scale, rows: e * h, cols: i },
        }
    }

    /// Experts `range` alone (an expert-parallel share), numbered from 0.
    pub fn range(&self, range: std::ops::Range<usize>) -> Result<OwnedExperts> {
        if range.is_empty() || range.end > self.count {
            return Err(Error::param(
                "experts",
                format!("{range:?}"),
                format!("must be a non-empty part of 0..{}", self.count),
            ));
        }
        let part = |m: &Int4Owned, per_expert: usize| Int4Owned {
            packed: m.packed[range.start * per_expert / PACK..range.end * per_expert / PACK].to_vec(),
            scale: m.scale[range.start * per_expert / GROUP..range.end * per_expert / GROUP].to_vec(),
        };
        let per_expert = 2 * self.inter * self.hidden;
        Ok(OwnedExperts {
            count: range.len(),
            hidden: self.hidden,
            inter: self.inter,
            w13: part(&self.w13, per_expert),
            w2: part(&self.w2, self.hidden * self.inter),
        })
    }
}

/// Quantizes a `[rows, cols]` bf16 matrix to the `pack-quantized` layout: per group of 32, `scale =
/// bf16(max|w| / 7)` (1 for an all-zero group), `q = clip(round_half_even(w / scale), -8, 7)`.
pub fn quantize(w: &[bf16], rows: usize, cols: usize) -> Result<Int4Owned> {
    if cols == 0 || !cols.is_multiple_of(GROUP) {
        return Err(Error::param("cols", cols, format!("must be a positive multiple of {GROUP}")));
    }
    check_len("w", w.len(), &[("rows", rows), ("cols", cols)])?;
    let mut out = Int4Owned { packed: vec![0; rows * cols / PACK], scale: vec![bf16::ZERO; rows * cols / GROUP] };
    for (g, group) in w.chunks(GROUP).enumerate() {
        let amax = group.iter().map(|v| v.to_f32().abs()).fold(0.0f32, f32::max);
        let scale = if amax == 0.0 { bf16::ONE } else { bf16::from_f32(amax / 7.0) };
        out.scale[g] = scale;
        for (i, v) in group.iter().enumerate() {
            let q = (v.to_f32() / scale.to_f32()).round_ties_even().clamp(-8.0, 7.0) as i32;
            let c = g * GROUP + i;
            out.packed[c / PACK] |= (((q + 8) as u32) << (4 * (c % PACK))) as i32;
        }
    }
    Ok(out)
}

/// Rows per tile of the `int4-tiled` layout (one MMA m16 tile).
pub const TILE_ROWS: usize = 16;
/// Groups per chunk of the `int4-tiled` layout (128 inputs).
pub const CHUNK_GROUPS: usize = 4;

/// Lengths `(packed words, scales)` of a `[rows, cols]` matrix in the `int4-tiled` layout: the groups are
/// padded to whole chunks of 4.
pub fn tiled_len(rows: usize, cols: usize) -> (usize, usize) {
    let chunks = (cols / GROUP).div_ceil(CHUNK_GROUPS);
    let tiles = rows / TILE_ROWS * chunks;
    (tiles * 256, tiles * 64)
}

/// Repacks a `pack-quantized` matrix into the `int4-tiled` order, in which each (16-row tile, chunk of 4
/// groups) is one contiguous image of what a warp stages in shared memory (reference/README.md, "INT4
/// tiled layout"). Rows must be a multiple of 16; groups past the last are zeros.
///
/// With `G = cols / 32` and `C = ceil(G / 4)`, for tile `t` (rows `16t ..`), chunk `q`, lane `l` (`r = l /
/// 4`, `c = l % 4`), half `h` and group `j` of the chunk, `packed[(t*C + q)*256 + h*128 + l*4 + j]` is packed
/// word `c` of group `4q + j` of row `16t + r + 8h`, and `scale[(t*C + q)*64 + i*8 + h*4 + j]` is the scale
/// of row `16t + i + 8h`, group `4q + j`. Inside a tiled word the nibbles are interleaved
/// ([`interleave_nibbles`]): nibble `j` holds input `2j` and nibble `4 + j` input `2j + 1`, so each
/// bf16 pair the kernel cuts from the word holds two consecutive inputs, as the activations come.
pub fn tile(m: &Int4Matrix) -> Result<Int4Owned> {
    check_tileable(m.rows)?;
    m.check("packed")?;
    let (words, scales) = tiled_len(m.rows, m.cols);
    let mut out = Int4Owned { packed: vec![0; words], scale: vec![bf16::ZERO; scales] };
    for_each_tiled_word(m.rows, m.cols / GROUP, |tiled, native| {
        out.packed[tiled] = interleave_nibbles(m.packed[native]);
    });
    for_each_tiled_scale(m.rows, m.cols / GROUP, |tiled, native| out.scale[tiled] = m.scale[native]);
    Ok(out)
}

/// Inverse of [`tile`]: `packed` and `scale` in the tiled order of a `[rows, cols]` matrix, back to the
/// checkpoint's `pack-quantized` order.
pub fn untile(packed: &[i32], scale: &[bf16], rows: usize, cols: usize) -> Result<Int4Owned> {
    check_tileable(rows)?;
    if cols == 0 || !cols.is_multiple_of(GROUP) {
        return Err(Error::param("cols", cols, format!("must be a positive multiple of {GROUP}")));
    }
    let (words, scales) = tiled_len(rows, cols);
    check_len("packed (tiled)", packed.len(), &[("words", words)])?;
    check_len("scale (tiled)", scale.len(), &[("scales", scales)])?;
    let mut out = Int4Owned { packed: vec![0; rows * cols / PACK], scale: vec![bf16::ZERO; rows * cols / GROUP] };
    for_each_tiled_word(rows, cols / GROUP, |tiled, native| out.packed[native] = deinterleave_nibbles(packed[tiled]));
    for_each_tiled_scale(rows, cols / GROUP, |tiled, native| out.scale[native] = scale[tiled]);
    Ok(out)
}

/// A packed word's eight values (input `i` in nibble `i`) reordered for the tiled layout: input `2j` to
/// nibble `j` and input `2j + 1` to nibble `4 + j`, so the nibble pairs `(j, 4 + j)` are input pairs.
pub fn interleave_nibbles(word: i32) -> i32 {
    let w = word as u32;
    let out = (0..PACK).fold(0u32, |acc, i| acc | (((w >> (4 * i)) & 0xF) << (4 * nibble_slot(i))));
    out as i32
}

/// Inverse of [`interleave_nibbles`].
pub fn deinterleave_nibbles(word: i32) -> i32 {
    let w = word as u32;
    let out = (0..PACK).fold(0u32, |acc, i| acc | (((w >> (4 * nibble_slot(i))) & 0xF) << (4 * i)));
    out as i32
}

/// The tiled nibble of input `i` of a packed word.
fn nibble_slot(i: usize) -> usize {
    i / 2 + (i % 2) * 4
}

fn check_tileable(rows: usize) -> Result<()> {
    if rows.is_multiple_of(TILE_ROWS) {
        return Ok(());
    }
    Err(Error::param("rows", rows, format!("the tiled INT4 layout needs a multiple of {TILE_ROWS} rows")))
}

/// Calls `f(tiled index, native index)` for every packed word of a real group.
fn for_each_tiled_word(rows: usize, groups: usize, mut f: impl FnMut(usize, usize)) {
    let chunks = groups.div_ceil(CHUNK_GROUPS);
    for t in 0..rows / TILE_ROWS {
        for q in 0..chunks {
            for (h, lane, j) in index_triples(2, 32, CHUNK_GROUPS) {
                let g = q * CHUNK_GROUPS + j;
                if g < groups {
                    let row = t * TILE_ROWS + lane / 4 + 8 * h;
                    f((t * chunks + q) * 256 + h * 128 + lane * 4 + j, row * groups * 4 + g * 4 + lane % 4);
                }
            }
        }
    }
}

/// Calls `f(tiled index, native index)` for every scale of a real group.
fn for_each_tiled_scale(rows: usize, groups: usize, mut f: impl FnMut(usize, usize)) {
    let chunks = groups.div_ceil(CHUNK_GROUPS);
    for t in 0..rows / TILE_ROWS {
        for q in 0..chunks {
            for (i, h, j) in index_triples(8, 2, CHUNK_GROUPS) {
                let g = q * CHUNK_GROUPS + j;
                if g < groups {
                    let row = t * TILE_ROWS + i + 8 * h;
                    f((t * chunks + q) * 64 + i * 8 + h * 4 + j, row * groups + g);
                }
            }
        }
    }
}

/// Every `(a, b, c)` with `a < na`, `b < nb`, `c < nc`, in row-major order.
fn index_triples(na: usize, nb: usize, nc: usize) -> impl Iterator<Item = (usize, usize, usize)> {
    (0..na).flat_map(move |a| (0..nb).flat_map(move |b| (0..nc).map(move |c| (a, b, c))))
}

/// Routing of a batch: chosen experts best first, their weights, and the pairs grouped by expert.
#[derive(Clone, Debug, PartialEq)]
pub struct Routing {
    /// Experts per token (k).
    pub k: usize,
    /// `[T, k]` chosen experts.
    pub topk_ids: Vec<i32>,
    /// `[T, k]` weights: the chosen sigmoid scores renormalized, times the routed scaling factor.
    pub topk_weights: Vec<f32>,
    /// `[E+1]` start of each expert's pairs in `sorted_pairs`.
    pub expert_offsets: Vec<i32>,
    /// `[T*k]` pairs `t * k + slot`, grouped by expert, each group in increasing pair order.
    pub sorted_pairs: Vec<i32>,
}

/// DeepSeek-V3 / Kimi-K2 routing from `router_logits [T, E]` and the correction `bias [E]` (float64
/// sigmoid; choice by score + bias, ties to the smaller expert id; weights `s / Σs · scaling` from the
/// unbiased scores, summed in slot order, with the config's float64 `routed_scaling_factor`).
pub fn route(router_logits: &[f32], bias: &[f32], experts: usize, k: usize, scaling: f64) -> Result<Routing> {
    if experts == 0 || k == 0 || k > experts {
        return Err(Error::param("k", k, format!("top-k must be in 1..={experts} (the experts)")));
    }
    if !router_logits.len().is_multiple_of(experts) {
        return Err(Error::shape("router_logits", format!("[T, E={experts}]"), experts, router_logits.len()));
    }
    check_len("bias", bias.len(), &[("E", experts)])?;
    if let Some(i) = router_logits.iter().chain(bias).position(|v| !v.is_finite()) {
        return Err(Error::Logits { name: "router_logits / bias", row: i / experts, problem: "non-finite value" });
    }
    let tokens = router_logits.len() / experts;
    let mut topk_ids = vec![0i32; tokens * k];
    let mut topk_weights = vec![0f32; tokens * k];
    for t in 0..tokens {
        let s: Vec<f64> =
            router_logits[t * experts..(t + 1) * experts].iter().map(|&x| 1.0 / (1.0 + (-(x as f64)).exp())).collect();
        let mut order: Vec<usize> = (0..experts).collect();
        // Largest score + bias first; the stable sort keeps the smaller id first among ties.
        order.sort_by(|&a, &b| (s[b] + bias[b] as f64).total_cmp(&(s[a] + bias[a] as f64)));
        let chosen = &order[..k];
        let sum: f64 = chosen.iter().map(|&e| s[e]).sum();
        for (slot, &e) in chosen.iter().enumerate() {
            topk_ids[t * k + slot] = e as i32;
            topk_weights[t * k + slot] = (s[e] / sum * scaling) as f32;
        }
    }
    let (expert_offsets, sorted_pairs) = align(&topk_ids, experts);
    Ok(Routing { k, topk_ids, topk_weights, expert_offsets, sorted_pairs })
}

/// Groups the pairs by expert (a counting sort, stable in pair order).
fn align(topk_ids: &[i32], experts: usize) -> (Vec<i32>, Vec<i32>) {
    let mut offsets = vec![0i32; experts + 1];
    for &e in topk_ids {
        offsets[e as usize + 1] += 1;
    }
    for e in 0..experts {
        offsets[e + 1] += offsets[e];
    }
    let mut next = offsets.clone();
    let mut pairs = vec![0i32; topk_ids.len()];
    for (p, &e) in topk_ids.iter().enumerate() {
        pairs[next[e as usize] as usize] = p as i32;
        next[e as usize] += 1;
    }
    (offsets, pairs)
}

/// The experts of one layer: `w13 [E * 2I, H]` (gate rows then up rows per expert) and `w2 [E * H, I]`.
#[derive(Clone, Copy, Debug)]
pub struct Experts<'a> {
    /// Number of experts E.
    pub count: usize,
    /// Hidden size H.
    pub hidden: usize,
    /// Expert intermediate size I.
    pub inter: usize,
    /// Gate and up projections.
    pub w13: Int4Matrix<'a>,
    /// Down projection.
    pub w2: Int4Matrix<'a>,
}

impl Experts<'_> {
    /// Checks the sizes (multiples of 32) and both matrices' shapes and lengths, naming the culprit.
    pub fn check(&self) -> Result<()> {
        for (name, v) in [("hidden", self.hidden), ("inter", self.inter)] {
            if v == 0 || !v.is_multiple_of(GROUP) {
                return Err(Error::param(name, v, format!("must be a positive multiple of {GROUP}")));
            }
        }
        if self.w13.rows != self.count * 2 * self.inter || self.w13.cols != self.hidden {
            return Err(Error::param("w13", format!("[{}, {}]", self.w13.rows, self.w13.cols), "must be [E * 2I, H]"));
        }
        if self.w2.rows != self.count * self.hidden || self.w2.cols != self.inter {
            return Err(Error::param("w2", format!("[{}, {}]", self.w2.rows, self.w2.cols), "must be [E * H, I]"));
        }
        self.w13.check("w13_packed")?;
        self.w2.check("w2_packed")
    }
}

/// The routed-experts output `out [T, H]` (f32) of `x [T, H]` bf16 for a routing of the same tokens.
pub fn moe_int4(x: &[bf16], routing: &Routing, experts: &Experts) -> Result<Vec<f32>> {
    if let Some(p) = routing.topk_ids.iter().position(|&e| e < 0 || e as usize >= experts.count) {
        return Err(Error::Index {
            name: "topk_ids",
            detail: format!("pair {p} names expert {}, outside 0..{}", routing.topk_ids[p], experts.count),
        });
    }
    moe_int4_share(x, routing, experts, 0)
}

/// Which of a layer's routed experts a set of experts holds: experts `first ..` of the `total` the
/// router chooses among (all of them unless the layer is split over expert-parallel ranks: `first` 0,
/// `total` their count).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ExpertShare {
    /// The first expert held.
    pub first: usize,
    /// The experts the router chooses among.
    pub total: usize,
}

impl ExpertShare {
    /// An error naming the share unless `held` experts from `first` lie within the `total`.
    pub fn check(&self, held: usize) -> Result<()> {
        if held == 0 || self.first + held > self.total {
            return Err(Error::param(
                "expert share",
                format!("{}..{}", self.first, self.first + held),
                format!("must be a non-empty range within the router's {} experts", self.total),
            ));
        }
        Ok(())
    }
}

/// The part of [`moe_int4`]'s output that experts `first .. first + experts.count` of a routing over more
/// experts give (an expert-parallel share): the pairs routed to other experts are left out of each
/// token's sum, which otherwise runs in slot order as in [`moe_int4`]. With `first` 0 and every pair in
/// range it is [`moe_int4`].
pub fn moe_int4_share(x: &[bf16], routing: &Routing, experts: &Experts, first: usize) -> Result<Vec<f32>> {
    experts.check()?;
    let (h, i, k) = (experts.hidden, experts.inter, routing.k);
    if !x.len().is_multiple_of(h) {
        return Err(Error::shape("x", format!("[T, H={h}]"), h, x.len()));
    }
    let tokens = x.len() / h;
    check_len("topk_ids", routing.topk_ids.len(), &[("T", tokens), ("k", k)])?;
    check_len("topk_weights", routing.topk_weights.len(), &[("T", tokens), ("k", k)])?;
    let local = |p: usize| {
        let e = routing.topk_ids[p] as i64 - first as i64;
        (0..experts.count as i64).contains(&e).then_some(e as usize)
    };
    // Every local pair's expert output, computed expert by expert so each expert is dequantized once.
    let mut y = vec![0f32; tokens * k * h];
    let per_expert: Vec<Vec<(usize, Vec<f32>)>> = (0..experts.count)
        .into_par_iter()
        .map(|e| {
            let pairs: Vec<usize> = (0..tokens * k).filter(|&p| local(p) == Some(e)).collect();
            if pairs.is_empty() {
                return vec![];
            }
            let w13 = dequant_rows(&experts.w13, e * 2 * i, 2 * i);
            let w2 = dequant_rows(&experts.w2, e * h, h);
            pairs.into_iter().map(|p| (p, expert_forward(&x[(p / k) * h..(p / k + 1) * h], &w13, &w2, h, i))).collect()
        })
        .collect();
    for (p, out) in per_expert.into_iter().flatten() {
        y[p * h..(p + 1) * h].copy_from_slice(&out);
    }
    let mut out = vec![0f32; tokens * h];
    for t in 0..tokens {
        for p in (t * k..(t + 1) * k).filter(|&p| local(p).is_some()) {
            let w = routing.topk_weights[p];
            for (o, v) in out[t * h..(t + 1) * h].iter_mut().zip(&y[p * h..(p + 1) * h]) {
                *o += w * v;
            }
        }
    }
    Ok(out)
}

fn dequant_rows(m: &Int4Matrix, first: usize, count: usize) -> Vec<f32> {
    let mut out = vec![0f32; count * m.cols];
    for (r, row) in out.chunks_mut(m.cols).enumerate() {
        m.dequant_row(first + r, row);
    }
    out
}

/// One token through one expert: `h = bf16(silu(x·gateᵀ) * (x·upᵀ))`, then `h · downᵀ`.
fn expert_forward(x: &[bf16], w13: &[f32], w2: &[f32], hidden: usize, inter: usize) -> Vec<f32> {
    let x: Vec<f32> = x.iter().map(|v| v.to_f32()).collect();
    let dot = |a: &[f32], b: &[f32]| a.iter().zip(b).map(|(p, q)| p * q).sum::<f32>();
    let act: Vec<f32> = (0..inter)
        .map(|j| {
            let g = dot(&x, &w13[j * hidden..(j + 1) * hidden]);
            let u = dot(&x, &w13[(inter + j) * hidden..(inter + j + 1) * hidden]);
            bf16::from_f32(g / (1.0 + (-g).exp()) * u).to_f32()
        })
        .collect();
    (0..hidden).map(|r| dot(&act, &w2[r * inter..(r + 1) * inter])).collect()
}
