//! Greedy accept (DESIGN.md §4.2): the target's argmax at every valid tree row, then the walk from the
//! root along children whose token matches.

use rayon::prelude::*;

use super::composite_key;
use crate::error::{check_len, Error, Result};
use crate::types::{check_target_logits, Acceptance, DraftTree, Logits};

/// Argmax of one row, ties to the smaller index; NaN is an error.
pub fn row_argmax(row: impl Iterator<Item = f32>) -> std::result::Result<i32, &'static str> {
    let mut best = 0u64;
    for (i, v) in row.enumerate() {
        if v.is_nan() {
            return Err("NaN logit");
        }
        best = best.max(composite_key(v, i as u32));
    }
    Ok(!(best as u32) as i32)
}

/// Walks one request's tree (already checked): returns the accepted rows after the root and the bonus token.
pub(crate) fn walk(tree: &DraftTree, b: usize, argmax: &[i32]) -> (Vec<usize>, i32) {
    let base = b * tree.shape.rows();
    let n_rows = tree.shape.rows();
    let mut path = Vec::new();
    let mut cur = 0usize;
    while path.len() < tree.shape.depth {
        let want = argmax[base + cur];
        let mut child = tree.first_child[base + cur];
        let mut next = None;
        // The step bound keeps a malformed sibling list from looping.
        for _ in 0..n_rows {
            if child <= 0 || child as usize >= n_rows {
                break;
            }
            if tree.node_token[base + child as usize] == want {
                next = Some(child as usize);
                break;
            }
            child = tree.next_sibling[base + child as usize];
        }
        let Some(c) = next else { break };
        path.push(c);
        cur = c;
    }
    (path, argmax[base + cur])
}

/// Greedy acceptance given the target's argmax `[bs, N]` (padding rows are ignored).
pub fn accept_from_argmax(tree: &DraftTree, argmax: &[i32]) -> Result<Acceptance> {
    tree.check()?;
    let s = tree.shape;
    check_len("target_argmax", argmax.len(), &[("bs", s.bs), ("N", s.rows())])?;
    let width = s.depth + 1;
    let mut out = Acceptance {
        bs: s.bs,
        depth: s.depth,
        target_argmax: argmax.to_vec(),
        accept_len: vec![0; s.bs],
        accept_rows: vec![-1; s.bs * width],
        emitted: vec![-1; s.bs * width],
    };
    for b in 0..s.bs {
        let (path, bonus) = walk(tree, b, argmax);
        out.accept_len[b] = path.len() as i32;
        out.accept_rows[b * width] = 0;
        for (j, &row) in path.iter().enumerate() {
            out.accept_rows[b * width + j + 1] = row as i32;
            out.emitted[b * width + j] = tree.node_token[b * s.rows() + row];
        }
        out.emitted[b * width + path.len()] = bonus;
    }
    Ok(out)
}

/// Argmax of every valid row of `target_logits [bs, N, V]` (-1 for padding rows), then the walk.
pub fn greedy_accept(tree: &DraftTree, target_logits: Logits, vocab: usize) -> Result<Acceptance> {
    check_target_logits(tree, target_logits.len(), vocab)?;
    let s = tree.shape;
    let n_rows = s.rows();
    let argmax: Vec<i32> = (0..s.bs * n_rows)
        .into_par_iter()
        .map(|r| {
            let (b, i) = (r / n_rows, r % n_rows);
            if i as i32 > tree.num_nodes[b] {
                return Ok(-1);
            }
            row_argmax((0..vocab).map(|v| target_logits.get(r * vocab + v))).map_err(|problem| Error::Logits {
                name: "target_logits",
                row: b,
                problem,
            })
        })
        .collect::<Result<_>>()?;
    accept_from_argmax(tree, &argmax)
}
