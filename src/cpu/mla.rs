//! MLA absorbed attention over a paged latent KV cache (DESIGN.md §4.3): `mla_decode` (one query row per
//! request) and `tree_verify` (N rows per request at the tree's positions, masked by the visibility
//! bitmask of the tree build). The exact definition is in `reference/README.md`.
//!
//! Every (request, row, head) walks its logical sequence of visible cache rows (the prefix, then its
//! visible tree rows in row order) in chunks of [`SPLIT`] rows and combines the chunks in order, the
//! schedule the CUDA kernels follow too. So a row's result depends only on its own logical sequence: it
//! is the same alone or in any batch, and a tree row equals `mla_decode` over the same sequence.

use half::bf16;
use rayon::prelude::*;

use crate::error::{check_len, Error, Result};
use crate::types::KvLayout;

/// Latent (c_kv / q_latent) width.
pub const LATENT: usize = 512;
/// Rotary (k_pe / q_pe) width.
pub const ROPE: usize = 64;
/// Elements of a query or cache row, `[latent | rope]`.
pub const ROW: usize = LATENT + ROPE;
/// Visible rows per chunk of a row's logical sequence.
pub const SPLIT: usize = 256;
/// Head counts the kernels support (Kimi-K2 has 64; 8 per GPU at TP 8, 4 at TP 16). Below 8 a tile
/// holds fewer valid rows than its 16, as it does for a short tree's tail.
pub const SUPPORTED_HEADS: [usize; 8] = [1, 2, 4, 8, 16, 32, 64, 128];

/// One layer's paged latent cache: `[num_pages, page_size, 576]` bf16, and `[bs, pages_per_req]` block
/// tables.
#[derive(Clone, Copy, Debug)]
pub struct PagedCache<'a> {
    /// The cache rows.
    pub rows: &'a [bf16],
    /// Page geometry (`layers` 1, `row_elems` 576).
    pub layout: KvLayout,
    /// `[bs, pages_per_req]` page ids.
    pub block_table: &'a [i32],
}

/// Attention outputs: `o` `[.., heads, 512]` and `lse` `[.., heads]` (natural log of the scaled scores).
#[derive(Clone, Debug, PartialEq)]
pub struct MlaOutput {
    /// Latent outputs.
    pub o: Vec<f32>,
    /// logsumexp of each row and head; -inf when nothing is visible.
    pub lse: Vec<f32>,
}

/// `mla_decode`: `q [bs, H, 576]`, request b attends to its slots `0 .. seq_len[b]` (at least one).
pub fn mla_decode(
    q: &[bf16],
    heads: usize,
    cache: &PagedCache,
    seq_len: &[i32],
    softmax_scale: f32,
) -> Result<MlaOutput> {
    check_decode_inputs(q, heads, cache, seq_len, softmax_scale)?;
    attend_all(q, seq_len.len(), 1, heads, cache, softmax_scale, |b, _row| (0..seq_len[b] as usize).collect())
}

/// `tree_verify`: `q [bs, N, H, 576]`; row i of request b attends to the prefix `0 .. seq_len[b]` and to
/// the tree rows set in its `visibility [bs, N, W]` row, which sit at slots `seq_len[b] + j`.
pub fn tree_verify(
    q: &[bf16],
    n_rows: usize,
    heads: usize,
    cache: &PagedCache,
    seq_len: &[i32],
    visibility: &[u32],
    softmax_scale: f32,
) -> Result<MlaOutput> {
    check_tree_inputs(q, n_rows, heads, cache, seq_len, visibility, softmax_scale)?;
    let (bs, words) = (seq_len.len(), n_rows.div_ceil(32));
    attend_all(q, bs, n_rows, heads, cache, softmax_scale, |b, row| {
        let prefix = seq_len[b] as usize;
        let bits = &visibility[(b * n_rows + row) * words..(b * n_rows + row + 1) * words];
        let tree = (0..n_rows).filter(|&j| bits[j / 32] >> (j % 32) & 1 == 1).map(|j| prefix + j);
        (0..prefix).chain(tree).collect()
    })
}

/// Every check of [`mla_decode`]'s inputs (shared with the CUDA host entry point).
pub(crate) fn check_decode_inputs(
    q: &[bf16],
    heads: usize,
    cache: &PagedCache,
    seq_len: &[i32],
    softmax_scale: f32,
) -> Result<()> {
    let bs = seq_len.len();
    check_shapes(q.len(), bs, 1, heads, &cache.layout, cache.rows.len(), cache.block_table.len(), softmax_scale)?;
    if let Some(b) = seq_len.iter().position(|&s| s < 1) {
        return Err(Error::param("seq_len", seq_len[b], format!("request {b}: a decode needs at least one row")));
    }
    check_pages(cache, seq_len, 0)
}

/// Every check of [`tree_verify`]'s inputs (shared with the CUDA host entry point).
pub(crate) fn check_tree_inputs(
    q: &[bf16],
    n_rows: usize,
    heads: usize,
    cache: &PagedCache,
    seq_len: &[i32],
    visibility: &[u32],
    softmax_scale: f32,
) -> Result<()> {
    let bs = seq_len.len();
    check_shapes(q.len(), bs, n_rows, heads, &cache.layout, cache.rows.len(), cache.block_table.len(), softmax_scale)?;
    check_visibility_len(visibility.len(), bs, n_rows)?;
    check_pages(cache, seq_len, n_rows)
}

/// `visibility` must be `[bs, N, ceil(N / 32)]`.
pub(crate) fn check_visibility_len(len: usize, bs: usize, n_rows: usize) -> Result<()> {
    check_len("visibility", len, &[("bs", bs), ("N", n_rows), ("W", n_rows.div_ceil(32))])
}

/// Head count, scale, cache layout and the lengths of `q [bs, N, H, 576]`, the cache and the block
/// tables: everything that does not need the values of `seq_len` or of the block tables.
#[allow(clippy::too_many_arguments)]
pub(crate) fn check_shapes(
    q_len: usize,
    bs: usize,
    n_rows: usize,
    heads: usize,
    l: &KvLayout,
    cache_len: usize,
    table_len: usize,
    softmax_scale: f32,
) -> Result<()> {
    if !SUPPORTED_HEADS.contains(&heads) {
        return Err(Error::param("heads", heads, format!("supported head counts are {SUPPORTED_HEADS:?}")));
    }
    if !(softmax_scale.is_finite() && softmax_scale > 0.0) {
        return Err(Error::param("softmax_scale", softmax_scale, "must be finite and > 0"));
    }
    if l.layers != 1 || l.row_elems != ROW || l.page_size == 0 || l.pages_per_req == 0 {
        return Err(Error::param(
            "cache layout",
            format!("{l:?}"),
            format!("one layer of {ROW}-element rows, page_size and pages_per_req >= 1"),
        ));
    }
    check_len("q", q_len, &[("bs", bs), ("N", n_rows), ("H", heads), ("row", ROW)])?;
    check_len("cache", cache_len, &[("pages", l.num_pages), ("page_size", l.page_size), ("row", ROW)])?;
    check_len("block_table", table_len, &[("bs", bs), ("pages_per_req", l.pages_per_req)])
}

/// Each request's prefix plus `extra` tree rows must fit its paged slots, on pages that exist.
fn check_pages(cache: &PagedCache, seq_len: &[i32], extra: usize) -> Result<()> {
    let l = cache.layout;
    let capacity = l.pages_per_req * l.page_size;
    if let Some(b) = seq_len.iter().position(|&s| s < 0 || s as usize + extra > capacity) {
        return Err(Error::param(
            "seq_len",
            seq_len[b],
            format!("request {b}: prefix + {extra} tree rows must fit its {capacity} paged slots"),
        ));
    }
    for (b, (table, &seq)) in cache.block_table.chunks(l.pages_per_req).zip(seq_len).enumerate() {
        let used = (seq as usize + extra).div_ceil(l.page_size);
        if let Some(&page) = table[..used].iter().find(|&&p| p < 0 || p as usize >= l.num_pages) {
            return Err(Error::Index {
                name: "block_table",
                detail: format!("request {b} maps page id {page}, outside 0..{}", l.num_pages),
            });
        }
    }
    Ok(())
}

/// Runs every (request, row) in parallel; `slots(b, row)` lists the row's logical sequence.
#[allow(clippy::too_many_arguments)]
fn attend_all(
    q: &[bf16],
    bs: usize,
    n_rows: usize,
    heads: usize,
    cache: &PagedCache,
    softmax_scale: f32,
    slots: impl Fn(usize, usize) -> Vec<usize> + Sync,
) -> Result<MlaOutput> {
    let mut out = MlaOutput { o: vec![0.0; bs * n_rows * heads * LATENT], lse: vec![0.0; bs * n_rows * heads] };
    out.o.par_chunks_mut(heads * LATENT).zip(out.lse.par_chunks_mut(heads)).enumerate().try_for_each(
        |(r, (o, lse))| {
            let (b, row) = (r / n_rows, r % n_rows);
            let table = &cache.block_table[b * cache.layout.pages_per_req..(b + 1) * cache.layout.pages_per_req];
            let offsets = slots(b, row)
                .into_iter()
                .map(|s| cache.layout.slot_offset(table, 0, s))
                .collect::<Result<Vec<usize>>>()?;
            for h in 0..heads {
                let q_row = &q[(r * heads + h) * ROW..(r * heads + h + 1) * ROW];
                lse[h] = attend(q_row, cache.rows, &offsets, softmax_scale, &mut o[h * LATENT..(h + 1) * LATENT]);
            }
            Ok(())
        },
    )?;
    Ok(out)
}

/// One chunk's partial result: max score, sum of exp(score - max), and the unnormalized output.
struct Partial {
    max: f32,
    sum: f32,
    o: Vec<f32>,
}

/// Attention of one query row over the cache rows at `offsets`, chunk by chunk; writes `o`, returns lse.
fn attend(q: &[bf16], cache: &[bf16], offsets: &[usize], scale: f32, o: &mut [f32]) -> f32 {
    o.fill(0.0);
    if offsets.is_empty() {
        return f32::NEG_INFINITY;
    }
    let q: Vec<f32> = q.iter().map(|x| x.to_f32()).collect();
    let partials: Vec<Partial> = offsets.chunks(SPLIT).map(|chunk| attend_chunk(&q, cache, chunk, scale)).collect();
    let max = partials.iter().map(|p| p.max).fold(f32::NEG_INFINITY, f32::max);
    let mut total = 0.0f32;
    for p in &partials {
        let w = (p.max - max).exp();
        total += p.sum * w;
        for (acc, v) in o.iter_mut().zip(&p.o) {
            *acc += v * w;
        }
    }
    o.iter_mut().for_each(|v| *v /= total);
    max + total.ln()
}

fn attend_chunk(q: &[f32], cache: &[bf16], chunk: &[usize], scale: f32) -> Partial {
    let scores: Vec<f32> = chunk
        .iter()
        .map(|&off| q.iter().zip(&cache[off..off + ROW]).map(|(a, k)| a * k.to_f32()).sum::<f32>() * scale)
        .collect();
    let max = scores.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    let mut sum = 0.0f32;
    let mut o = vec![0.0f32; LATENT];
    for (&off, &s) in chunk.iter().zip(&scores) {
        let p = (s - max).exp();
        sum += p;
        for (acc, v) in o.iter_mut().zip(&cache[off..off + LATENT]) {
            *acc += p * v.to_f32();
        }
    }
    Partial { max, sum, o }
}
