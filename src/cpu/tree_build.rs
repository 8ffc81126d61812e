//! DDTree best-first tree build (DESIGN.md §4.1, paper Algorithm 1), exact to the contract in
//! `reference/README.md`: every score is one f32 addition, ties go to the candidate pushed first.

use std::cmp::Reverse;
use std::collections::BinaryHeap;

use rayon::prelude::*;

use super::order_key;
use crate::error::Result;
use crate::types::{check_seq_len, check_top_logp, check_tree_inputs, DraftTree, TreeShape};

/// A frontier candidate: (parent row, depth, rank) with its score.
#[derive(Clone, Copy, Debug)]
struct Candidate {
    logw: f32,
    parent: usize,
    depth: usize,
    rank: usize,
}

/// The best-first frontier: the heap holds keys (larger logw first, then the smaller push number);
/// candidates live in `pushed`, indexed by their push number.
#[derive(Default)]
struct Frontier {
    heap: BinaryHeap<(u32, Reverse<u32>)>,
    pushed: Vec<Candidate>,
}

impl Frontier {
    fn push(&mut self, logw: f32, parent: usize, depth: usize, rank: usize) {
        let seq = self.pushed.len() as u32;
        self.heap.push((order_key(logw), Reverse(seq)));
        self.pushed.push(Candidate { logw, parent, depth, rank });
    }

    fn pop(&mut self) -> Option<Candidate> {
        self.heap.pop().map(|(_, Reverse(seq))| self.pushed[seq as usize])
    }
}

/// Per-request inputs: `[L, K]` top ids and log-probs, the root token and the prefix length.
pub(crate) struct TreeInput<'a> {
    /// `[L, K]` token ids per depth, best first.
    pub(crate) top_ids: &'a [i32],
    /// `[L, K]` log-probs matching `top_ids`.
    pub(crate) top_logp: &'a [f32],
    /// Token of row 0 (the bonus token of the last step).
    pub(crate) root_token: i32,
    /// Tokens already in the cache; positions are `seq_len + depth`.
    pub(crate) seq_len: i32,
}

/// Builds the trees of a batch from `top_ids` / `top_logp [bs, L, K]`.
pub fn build_trees(
    shape: TreeShape,
    k: usize,
    top_ids: &[i32],
    top_logp: &[f32],
    root_token: &[i32],
    seq_len: &[i32],
) -> Result<DraftTree> {
    check_tree_inputs(shape, k, top_ids.len(), top_logp.len(), root_token.len(), seq_len.len())?;
    let (bs, depth, n) = (shape.bs, shape.depth, shape.rows());
    check_top_logp(top_logp, depth * k)?;
    check_seq_len(seq_len, depth)?;
    let words = shape.words();
    let mut tree = DraftTree {
        shape,
        num_nodes: vec![0; bs],
        node_token: vec![-1; bs * n],
        node_depth: vec![-1; bs * n],
        parent: vec![-1; bs * n],
        first_child: vec![-1; bs * n],
        next_sibling: vec![-1; bs * n],
        position: vec![-1; bs * n],
        visibility: vec![0; bs * n * words],
    };
    let lk = depth * k;
    let per_request: Vec<DraftTree> = (0..bs)
        .into_par_iter()
        .map(|b| {
            let input = TreeInput {
                top_ids: &top_ids[b * lk..(b + 1) * lk],
                top_logp: &top_logp[b * lk..(b + 1) * lk],
                root_token: root_token[b],
                seq_len: seq_len[b],
            };
            build_one(&input, depth, k, shape.budget)
        })
        .collect();
    for (b, one) in per_request.into_iter().enumerate() {
        let rows = b * n..(b + 1) * n;
        tree.num_nodes[b] = one.num_nodes[0];
        tree.node_token[rows.clone()].copy_from_slice(&one.node_token);
        tree.node_depth[rows.clone()].copy_from_slice(&one.node_depth);
        tree.parent[rows.clone()].copy_from_slice(&one.parent);
        tree.first_child[rows.clone()].copy_from_slice(&one.first_child);
        tree.next_sibling[rows.clone()].copy_from_slice(&one.next_sibling);
        tree.position[rows].copy_from_slice(&one.position);
        tree.visibility[b * n * words..(b + 1) * n * words].copy_from_slice(&one.visibility);
    }
    Ok(tree)
}

/// One request's tree (a `DraftTree` with bs = 1), from validated inputs.
pub(crate) fn build_one(input: &TreeInput, depth: usize, k: usize, budget: usize) -> DraftTree {
    let n_rows = budget + 1;
    let words = n_rows.div_ceil(32);
    let logp = |d: usize, r: usize| input.top_logp[(d - 1) * k + r];

    let mut node_logw = vec![0.0f32; n_rows];
    let mut node_token = vec![-1; n_rows];
    let mut node_depth = vec![-1; n_rows];
    let mut parent = vec![-1; n_rows];
    let mut first_child = vec![-1; n_rows];
    let mut next_sibling = vec![-1; n_rows];
    let mut last_child = vec![-1i32; n_rows];
    let mut visibility = vec![0u32; n_rows * words];
    node_token[0] = input.root_token;
    node_depth[0] = 0;
    visibility[0] = 1;

    let mut frontier = Frontier::default();
    frontier.push(0.0 + logp(1, 0), 0, 1, 0);

    let mut n = 0;
    while n < budget {
        let Some(Candidate { logw, parent: p, depth: d, rank: r, .. }) = frontier.pop() else { break };
        n += 1;
        node_logw[n] = logw;
        node_token[n] = input.top_ids[(d - 1) * k + r];
        node_depth[n] = d as i32;
        parent[n] = p as i32;
        if last_child[p] < 0 {
            first_child[p] = n as i32;
        } else {
            next_sibling[last_child[p] as usize] = n as i32;
        }
        last_child[p] = n as i32;
        let (row, par) = (n * words, p * words);
        for w in 0..words {
            visibility[row + w] = visibility[par + w];
        }
        visibility[row + n / 32] |= 1 << (n % 32);
        if r + 1 < k {
            frontier.push(node_logw[p] + logp(d, r + 1), p, d, r + 1);
        }
        if d < depth {
            frontier.push(logw + logp(d + 1, 0), n, d + 1, 0);
        }
    }
    let position = (0..n_rows).map(|i| if i <= n { input.seq_len + node_depth[i] } else { -1 }).collect();
    DraftTree {
        shape: TreeShape { bs: 1, depth, budget },
        num_nodes: vec![n as i32],
        node_token,
        node_depth,
        parent,
        first_child,
        next_sibling,
        position,
        visibility,
    }
}
