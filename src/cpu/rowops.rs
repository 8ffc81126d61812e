//! The per-row operations of the forward pass between the GEMMs, attention and MoE: embedding gather,
//! RMSNorm, SiLU·mul, the MLA query rows (latent query to bf16, rotary part rotated) and cache rows
//! (latent normed, rotary key rotated, written into its page slot), residual add, bf16 conversion,
//! row gather and argmax. kernels/rowops.cu computes the same bits; `reference/rowops_fixtures.py` is the
//! independent numpy reference.
//!
//! The contract (every implementation, bit for bit):
//! - Each output row depends on its input row alone, so every op is batch invariant.
//! - No fused multiply-add: every product and every sum is one rounded f32 operation.
//! - RMSNorm of a row of `d` values: element `e` goes to lane `(e / 4) % 32`; each lane sums the squares
//!   of its elements in increasing `e`; the 32 lane sums are combined by five butterfly steps, s = 16,
//!   8, 4, 2, 1, each replacing lane l's sum by `sum[l] + sum[l ^ s]`; the total is lane 0's. Then
//!   `inv = 1 / sqrt(total / d + eps)` and `y = w · (x · inv)` (IEEE division and square root).
//! - SiLU(g) = g · σ(g) with σ from the deterministic [`expd`]: `1 / (1 + expd(-g))` for g ≥ 0 and
//!   `expd(g) / (1 + expd(g))` for g < 0 (expd is 0 below -31, so σ is exactly 1 or 0 there).
//! - RoPE on a 64-value rotary part with the step's per-row tables `cos[32]`, `sin[32]` (already times
//!   the YaRN attention factor, computed once on the host): pair i is `(x[2i], x[2i+1])` when
//!   interleaved, else `(x[i], x[i+32])`; `out[i] = a·cos[i] − b·sin[i]`, `out[i+32] = b·cos[i] + a·sin[i]`.
//! - bf16 conversion rounds to nearest, ties to even.
//! - argmax: the lowest index of the largest value, where NaN counts as larger than every number (so a
//!   NaN row is not hidden behind a finite token).

use half::bf16;

use crate::cpu::mla::{LATENT, ROPE, ROW};
use crate::cpu::topk::expd;
use crate::error::{check_len, Error, Result};

/// Values per row of the step's rotary tables: 32 cosines then 32 sines.
pub const ROPE_TABLE: usize = ROPE;
/// Lanes of the RMSNorm reduction order.
const LANES: usize = 32;

/// Sum of squares of `x` in the contract's lane order.
pub fn sum_squares(x: &[f32]) -> f32 {
    let mut lanes = [0f32; LANES];
    for (e, v) in x.iter().enumerate() {
        lanes[(e / 4) % LANES] += v * v;
    }
    let mut s = LANES / 2;
    while s > 0 {
        let prev = lanes;
        for (l, lane) in lanes.iter_mut().enumerate() {
            *lane = prev[l] + prev[l ^ s];
        }
        s /= 2;
    }
    lanes[0]
}

/// RMSNorm of one row into `out`.
pub fn rmsnorm_row(x: &[f32], w: &[f32], eps: f32, out: &mut [f32]) {
    let inv = 1.0 / (sum_squares(x) / x.len() as f32 + eps).sqrt();
    for ((o, v), w) in out.iter_mut().zip(x).zip(w) {
        *o = w * (v * inv);
    }
}

/// RMSNorm of every row of `x [rows, w.len()]`.
pub fn rmsnorm(x: &[f32], w: &[f32], eps: f32, out: &mut [f32]) -> Result<()> {
    let d = w.len();
    if d == 0 {
        return Err(Error::param("rmsnorm weight", 0, "must have at least one value"));
    }
    if !x.len().is_multiple_of(d) {
        return Err(Error::shape("x", format!("[rows, {d}]"), x.len().next_multiple_of(d), x.len()));
    }
    check_len("out", out.len(), &[("rows", x.len() / d), ("d", d)])?;
    for (row, o) in x.chunks(d).zip(out.chunks_mut(d)) {
        rmsnorm_row(row, w, eps, o);
    }
    Ok(())
}

/// σ(g) of the contract.
pub fn sigmoid(g: f32) -> f32 {
    if g >= 0.0 {
        1.0 / (1.0 + expd(-g))
    } else {
        let e = expd(g);
        e / (1.0 + e)
    }
}

/// `out[t][j] = SiLU(gu[t][j]) · gu[t][inter + j]` for `gu [rows, 2·inter]` (gate then up).
pub fn silu_mul(gu: &[f32], inter: usize, out: &mut [f32]) -> Result<()> {
    if inter == 0 || !gu.len().is_multiple_of(2 * inter) {
        return Err(Error::shape("gate_up", format!("[rows, 2 * {inter}]"), 2 * inter, gu.len()));
    }
    check_len("out", out.len(), &[("rows", gu.len() / (2 * inter)), ("inter", inter)])?;
    for (row, o) in gu.chunks(2 * inter).zip(out.chunks_mut(inter)) {
        let (gate, up) = row.split_at(inter);
        for ((o, &g), &u) in o.iter_mut().zip(gate).zip(up) {
            *o = g * sigmoid(g) * u;
        }
    }
    Ok(())
}

/// Rotates one 64-value rotary part with one row of the rotary table.
pub fn rope_row(x: &[f32], table: &[f32], interleave: bool, out: &mut [f32]) {
    let half = ROPE / 2;
    let (cos, sin) = table.split_at(half);
    for i in 0..half {
        let (a, b) = if interleave { (x[2 * i], x[2 * i + 1]) } else { (x[i], x[i + half]) };
        out[i] = a * cos[i] - b * sin[i];
        out[i + half] = b * cos[i] + a * sin[i];
    }
}

/// Shapes of [`q_rows`]: heads, and the no-rotary and rotary query widths of a head.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct QueryShape {
    /// Attention heads.
    pub heads: usize,
    /// `qk_nope_head_dim`.
    pub nope: usize,
}

/// The attention's query rows `out [T, heads, 576]` bf16: per (token, head) the absorbed latent query
/// `q_latent [T, heads, 512]` then the rotated rotary part of `q [T, heads, nope + 64]`.
pub fn q_rows(
    q_latent: &[f32],
    q: &[f32],
    shape: QueryShape,
    table: &[f32],
    interleave: bool,
    out: &mut [bf16],
) -> Result<()> {
    let QueryShape { heads, nope } = shape;
    let rows = table.len() / ROPE_TABLE;
    check_len("rope table", table.len(), &[("T", rows), ("64", ROPE_TABLE)])?;
    check_len("q_latent", q_latent.len(), &[("T", rows), ("heads", heads), ("512", LATENT)])?;
    check_len("q", q.len(), &[("T", rows), ("heads", heads), ("nope + 64", nope + ROPE)])?;
    check_len("out", out.len(), &[("T", rows), ("heads", heads), ("576", ROW)])?;
    let mut rot = [0f32; ROPE];
    for (r, o) in out.chunks_mut(ROW).enumerate() {
        let t = r / heads;
        let latent = &q_latent[r * LATENT..(r + 1) * LATENT];
        let pe = &q[r * (nope + ROPE) + nope..(r + 1) * (nope + ROPE)];
        rope_row(pe, &table[t * ROPE_TABLE..(t + 1) * ROPE_TABLE], interleave, &mut rot);
        for (o, &v) in o.iter_mut().zip(latent.iter().chain(&rot)) {
            *o = bf16::from_f32(v);
        }
    }
    Ok(())
}

/// The cache rows of a step's tokens: from `kv [T, 576]` (`kv_a_proj_with_mqa`'s output), the latent
/// `kv[.., ..512]` through RMSNorm (`norm_w`, `eps`) and the rotary key `kv[.., 512..]` rotated, as one
/// bf16 row written at cache row `slot[t]` of `cache [rows, 576]` (page · page_size + offset).
pub fn kv_rows(
    kv: &[f32],
    norm_w: &[f32],
    eps: f32,
    table: &[f32],
    interleave: bool,
    slot: &[i32],
    cache: &mut [bf16],
) -> Result<()> {
    let rows = slot.len();
    check_len("kv", kv.len(), &[("T", rows), ("576", ROW)])?;
    check_len("kv_a_layernorm weight", norm_w.len(), &[("512", LATENT)])?;
    check_len("rope table", table.len(), &[("T", rows), ("64", ROPE_TABLE)])?;
    let cache_rows = cache.len() / ROW;
    let mut row = [0f32; ROW];
    for (t, &s) in slot.iter().enumerate() {
        if s < 0 || s as usize >= cache_rows {
            return Err(Error::Index {
                name: "slot",
                detail: format!("token {t}: cache row {s} is outside 0..{cache_rows}"),
            });
        }
        let src = &kv[t * ROW..(t + 1) * ROW];
        let (latent, rotated) = row.split_at_mut(LATENT);
        rmsnorm_row(&src[..LATENT], norm_w, eps, latent);
        rope_row(&src[LATENT..], &table[t * ROPE_TABLE..(t + 1) * ROPE_TABLE], interleave, rotated);
        let dst = &mut cache[s as usize * ROW..(s as usize + 1) * ROW];
        dst.iter_mut().zip(&row).for_each(|(d, &v)| *d = bf16::from_f32(v));
    }
    Ok(())
}

/// Rows `ids` of the bf16 `table [vocab, hidden]` as f32 `out [ids.len(), hidden]`.
pub fn embed(table: &[bf16], hidden: usize, ids: &[i32], out: &mut [f32]) -> Result<()> {
    if hidden == 0 || !table.len().is_multiple_of(hidden) {
        return Err(Error::shape("embedding", format!("[vocab, {hidden}]"), hidden, table.len()));
    }
    let vocab = table.len() / hidden;
    check_len("out", out.len(), &[("T", ids.len()), ("hidden", hidden)])?;
    for (t, (&id, o)) in ids.iter().zip(out.chunks_mut(hidden)).enumerate() {
        if id < 0 || id as usize >= vocab {
            return Err(Error::Index {
                name: "tokens",
                detail: format!("token {t}: id {id} is outside the vocabulary 0..{vocab}"),
            });
        }
        let row = &table[id as usize * hidden..(id as usize + 1) * hidden];
        o.iter_mut().zip(row).for_each(|(o, v)| *o = v.to_f32());
    }
    Ok(())
}

/// `x += y`, elementwise.
pub fn add(x: &mut [f32], y: &[f32]) -> Result<()> {
    check_len("y", y.len(), &[("x", x.len())])?;
    x.iter_mut().zip(y).for_each(|(a, b)| *a += b);
    Ok(())
}

/// `x` rounded to bf16.
pub fn to_bf16(x: &[f32], out: &mut [bf16]) -> Result<()> {
    check_len("out", out.len(), &[("x", x.len())])?;
    out.iter_mut().zip(x).for_each(|(o, &v)| *o = bf16::from_f32(v));
    Ok(())
}

/// Rows `idx` of `x [rows, dim]` into `out [idx.len(), dim]`.
pub fn gather(x: &[f32], dim: usize, idx: &[i32], out: &mut [f32]) -> Result<()> {
    let rows = x.len().checked_div(dim).unwrap_or(0);
    check_len("out", out.len(), &[("R", idx.len()), ("dim", dim)])?;
    for (r, (&i, o)) in idx.iter().zip(out.chunks_mut(dim.max(1))).enumerate() {
        if i < 0 || i as usize >= rows {
            return Err(Error::Index { name: "rows", detail: format!("entry {r}: row {i} is outside 0..{rows}") });
        }
        o.copy_from_slice(&x[i as usize * dim..(i as usize + 1) * dim]);
    }
    Ok(())
}

/// The argmax of each row of `x [rows, vocab]` (the contract's order: NaN above every number, the lowest
/// index among equals).
pub fn argmax(x: &[f32], vocab: usize, out: &mut [i32]) -> Result<()> {
    if vocab == 0 || vocab > i32::MAX as usize {
        return Err(Error::param("vocab", vocab, "must be in 1..=i32::MAX"));
    }
    check_len("x", x.len(), &[("rows", out.len()), ("vocab", vocab)])?;
    for (row, o) in x.chunks(vocab).zip(out.iter_mut()) {
        let mut best = 0;
        for (i, &v) in row.iter().enumerate().skip(1) {
            let b = row[best];
            if (v.is_nan() && !b.is_nan()) || v > b {
                best = i;
            }
        }
        *o = best as i32;
    }
    Ok(())
}
