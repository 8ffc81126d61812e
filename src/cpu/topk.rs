//! Top-K with logsumexp over the vocabulary: the exact contract of `reference/README.md`.
//!
//! The logsumexp is built so that every implementation gets the same bits: a fixed chunking of the row,
//! a deterministic exp made of single rounded f32 operations and FMAs ([`expd`]), exact fixed-point sums
//! inside a chunk, and a float64 combine across chunks in chunk order.

use rayon::prelude::*;

use super::composite_key;
use crate::error::{check_len, Error, Result};
use crate::types::{check_vocab, Logits, TopK};

/// Values per logsumexp chunk.
pub const LSE_CHUNK: usize = 8192;
/// Fixed-point scale of the chunk sums, 2^44.
const FIXED_SCALE: f32 = 17_592_186_044_416.0;

/// exp(d) for d <= 0 from single rounded f32 operations and fused multiply-adds (within 3 ulp of exp),
/// 0 below -31 and for NaN; NaN for d > 0, outside its domain.
#[inline(always)]
pub fn expd(d: f32) -> f32 {
    const LOG2E: f32 = f32::from_bits(0x3FB8_AA3B);
    const LN2: f32 = f32::from_bits(0x3F31_7218);
    const C5: f32 = f32::from_bits(0x3C07_D41A);
    const C: [u32; 5] = [0x3D2B_9D2A, 0x3E2A_AD35, 0x3EFF_FEE3, 0x3F7F_FFFB, 0x3F80_0000];
    if d.is_nan() || d < -31.0 {
        return 0.0;
    }
    if d > 0.0 {
        return f32::NAN;
    }
    // The f64 product of two f32 values is exact, so this is rint of the exact product.
    let k = (f64::from(d) * f64::from(LOG2E)).round_ties_even() as f32;
    let r = (-k).mul_add(LN2, d);
    let mut p = C5;
    for c in C {
        p = p.mul_add(r, f32::from_bits(c));
    }
    p * f32::from_bits(((k as i32 + 127) as u32) << 23)
}

/// floor(expd(v - m) * 2^44), the exact fixed-point term of a chunk sum.
#[inline(always)]
fn lse_term(v: f32, m: f32) -> u64 {
    if v == f32::NEG_INFINITY {
        return 0;
    }
    (expd(v - m) * FIXED_SCALE) as u64
}

/// The exact fixed-point sum of a chunk whose maximum is `m`.
fn chunk_sum(chunk: &[f32], m: f32) -> u64 {
    #[cfg(target_arch = "x86_64")]
    if std::arch::is_x86_feature_detected!("fma") && std::arch::is_x86_feature_detected!("sse4.1") {
        // SAFETY: the CPU has the FMA and SSE4.1 instructions (checked just above).
        return unsafe { chunk_sum_fma(chunk, m) };
    }
    chunk_sum_portable(chunk, m)
}

/// [`chunk_sum`] compiled with the FMA and SSE4.1 instructions: `mul_add` and `round_ties_even` are then
/// one instruction each instead of calls to libm's `fmaf` and `rint`, which made the CPU reference several
/// times slower. Both compute the same correctly rounded results, so the bits are the same.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "fma,sse4.1")]
fn chunk_sum_fma(chunk: &[f32], m: f32) -> u64 {
    chunk_sum_portable(chunk, m)
}

#[inline(always)]
fn chunk_sum_portable(chunk: &[f32], m: f32) -> u64 {
    chunk.iter().map(|&v| lse_term(v, m)).sum()
}

/// Validates one row (finite or -inf values, at least one finite) and returns its logsumexp.
pub fn row_lse(row: &[f32]) -> std::result::Result<f32, &'static str> {
    if row.iter().any(|v| v.is_nan()) {
        return Err("NaN logit");
    }
    if row.contains(&f32::INFINITY) {
        return Err("+inf logit");
    }
    let chunks: Vec<(f32, u64)> = row
        .chunks(LSE_CHUNK)
        .map(|c| {
            let m = c.iter().copied().fold(f32::NEG_INFINITY, f32::max);
            (m, chunk_sum(c, m))
        })
        .collect();
    let big = chunks.iter().map(|c| c.0).fold(f32::NEG_INFINITY, f32::max);
    if big == f32::NEG_INFINITY {
        return Err("no finite logit in the row");
    }
    let total: f64 = chunks.iter().filter(|c| c.1 != 0).fold(0.0, |acc, &(m, s)| acc + s as f64 * expd(m - big) as f64);
    Ok((big as f64 + (total * 2f64.powi(-44)).ln()) as f32)
}

/// Writes the K best indices of `row` (value descending, index ascending) and their `value - lse`.
fn select_row(row: &[f32], lse: f32, ids: &mut [i32], logp: &mut [f32]) {
    let k = ids.len();
    let mut keys: Vec<u64> = row.iter().enumerate().map(|(i, &v)| composite_key(v, i as u32)).collect();
    if k < keys.len() {
        keys.select_nth_unstable_by(k - 1, |a, b| b.cmp(a));
        keys.truncate(k);
    }
    keys.sort_unstable_by(|a, b| b.cmp(a));
    for (j, key) in keys.iter().enumerate() {
        let id = !(*key as u32);
        ids[j] = id as i32;
        logp[j] = row[id as usize] - lse;
    }
}

/// Top-K with logsumexp of `logits [bs, depth, vocab]`, K = `k` (use [`crate::types::top_k_for`]).
pub fn topk_logsumexp(logits: Logits, bs: usize, depth: usize, vocab: usize, k: usize) -> Result<TopK> {
    check_vocab(vocab)?;
    if k == 0 || k > vocab {
        return Err(Error::param("k", k, format!("must be in 1..={vocab} (the vocabulary)")));
    }
    check_len("logits", logits.len(), &[("bs", bs), ("L", depth), ("V", vocab)])?;
    let rows = bs * depth;
    let mut out = TopK { bs, depth, k, ids: vec![0; rows * k], logp: vec![0.0; rows * k], lse: vec![0.0; rows] };
    out.ids.par_chunks_mut(k).zip(out.logp.par_chunks_mut(k)).zip(out.lse.par_iter_mut()).enumerate().try_for_each(
        |(r, ((ids, logp), lse))| {
            let row: Vec<f32> = (0..vocab).map(|i| logits.get(r * vocab + i) + 0.0).collect();
            *lse = row_lse(&row).map_err(|problem| Error::Logits { name: "draft_logits", row: r, problem })?;
            select_row(&row, *lse, ids, logp);
            Ok(())
        },
    )?;
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The dispatched chunk sum (FMA instructions where the CPU has them) gives the bits of the portable
    /// one (libm's `fmaf` and `rint`), term by term and summed, over values from the maximum down past
    /// the -31 cut-off, with -inf entries.
    #[test]
    fn chunk_sum_is_the_same_with_and_without_fma() {
        let mut state = 0x9E37_79B9_7F4A_7C15u64;
        let mut next = || {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            state
        };
        for _ in 0..50 {
            let m = (next() >> 40) as f32 / 16_777_216.0 * 60.0 - 30.0;
            let chunk: Vec<f32> = (0..LSE_CHUNK)
                .map(|i| match i % 97 {
                    0 => f32::NEG_INFINITY,
                    1 => m,
                    _ => m - (next() >> 40) as f32 / 16_777_216.0 * 40.0,
                })
                .collect();
            assert_eq!(chunk_sum(&chunk, m), chunk_sum_portable(&chunk, m), "max {m}");
            for &v in chunk.iter().take(200) {
                assert_eq!(chunk_sum(&[v], m), lse_term(v, m), "value {v}, max {m}");
            }
        }
    }
}
