//! The dense bf16 projection `y = x · Wᵀ` (weights bf16 `[N, K]`, activations float32): the reference of
//! kernels/gemm_bf16.cu and the CPU backend's linear layer.
//!
//! Every output element is one dot product summed in float32 in input order, so a row's result does not
//! depend on the other rows. The CUDA kernel sums in another fixed order (and splits x into two bf16
//! halves), so the two agree to a tolerance, each being batch invariant on its own.

use half::bf16;
use rayon::prelude::*;

use crate::error::{check_len, Error, Result};

/// Output elements per parallel work item.
const CHUNK: usize = 64;

/// `Σ x[i] · w[i]` in float32, in index order.
pub fn dot(x: &[f32], w: &[bf16]) -> f32 {
    x.iter().zip(w).fold(0.0f32, |acc, (a, b)| acc + a * b.to_f32())
}

/// `x [T, k] · w[n, k]ᵀ`: `[T, n]` float32.
pub fn gemm_bf16(w: &[bf16], n: usize, k: usize, x: &[f32]) -> Result<Vec<f32>> {
    check_len("w", w.len(), &[("N", n), ("K", k)])?;
    if k == 0 || !x.len().is_multiple_of(k) {
        return Err(Error::shape("x", format!("[T, K={k}]"), k, x.len()));
    }
    let tokens = x.len() / k;
    let mut y = vec![0f32; tokens * n];
    y.par_chunks_mut(CHUNK).enumerate().for_each(|(c, chunk)| {
        for (j, v) in chunk.iter_mut().enumerate() {
            let (t, r) = ((c * CHUNK + j) / n, (c * CHUNK + j) % n);
            *v = dot(&x[t * k..(t + 1) * k], &w[r * k..(r + 1) * k]);
        }
    });
    Ok(y)
}
