//! KV compaction after acceptance (DESIGN.md §4.2): the accepted tree rows move to the slots right after
//! the prefix, in every layer, as if all sources were read before any destination is written.

use half::bf16;

use crate::error::{Error, Result};
use crate::types::KvLayout;

/// Validated (source, destination) element offsets of every move of one request (block table `table`)
/// in layer 0; other layers add `layer * layer_stride`.
fn moves(
    layout: &KvLayout,
    table: &[i32],
    seq_len: i32,
    accepted: i32,
    path: &[i32],
    n_rows: usize,
) -> Result<Vec<(usize, usize)>> {
    if accepted < 0 || accepted as usize >= path.len() {
        return Err(Error::param("accept_len", accepted, format!("must be in 0..{}", path.len())));
    }
    if seq_len < 0 {
        return Err(Error::param("seq_len", seq_len, "must be >= 0"));
    }
    (1..=accepted as usize)
        .map(|j| {
            let row = path[j];
            if row < j as i32 || row as usize >= n_rows {
                return Err(Error::Index {
                    name: "accept_rows",
                    detail: format!("step {j} has row {row}; a root path's row j lies in {j}..{n_rows}"),
                });
            }
            let src = layout.slot_offset(table, 0, seq_len as usize + row as usize)?;
            let dst = layout.slot_offset(table, 0, seq_len as usize + j)?;
            Ok((src, dst))
        })
        .collect()
}

/// Compacts `cache` in place for every request and layer. `accept_rows` is `[bs, L+1]` as returned by
/// greedy accept; `n_rows` is the tree's N (rows written after the prefix).
#[allow(clippy::too_many_arguments)]
pub fn kv_compact(
    cache: &mut [bf16],
    layout: &KvLayout,
    block_table: &[i32],
    seq_len: &[i32],
    accept_len: &[i32],
    accept_rows: &[i32],
    depth: usize,
    n_rows: usize,
) -> Result<()> {
    let bs = seq_len.len();
    layout.check_compact_inputs(bs, cache.len(), block_table.len(), accept_len.len(), accept_rows.len(), depth)?;
    let layer_stride = layout.num_pages * layout.page_size * layout.row_elems;
    let d = layout.row_elems;
    // Every request is validated before any row moves, so an error leaves the cache untouched.
    let plans = (0..bs)
        .map(|b| {
            let table = &block_table[b * layout.pages_per_req..(b + 1) * layout.pages_per_req];
            let path = &accept_rows[b * (depth + 1)..(b + 1) * (depth + 1)];
            moves(layout, table, seq_len[b], accept_len[b], path, n_rows)
        })
        .collect::<Result<Vec<_>>>()?;
    for plan in &plans {
        for layer in 0..layout.layers {
            let base = layer * layer_stride;
            let staged: Vec<bf16> =
                plan.iter().flat_map(|&(src, _)| &cache[base + src..base + src + d]).copied().collect();
            for (j, &(_, dst)) in plan.iter().enumerate() {
                cache[base + dst..base + dst + d].copy_from_slice(&staged[j * d..(j + 1) * d]);
            }
        }
    }
    Ok(())
}
