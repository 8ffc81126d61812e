//! The heavy operations of the forward pass behind one trait, so that the model code is one path for every
//! backend: the CPU implementation here runs the pure-Rust kernels of [`crate::cpu`]; a CUDA backend
//! implements the same trait with the device kernels. Cheap per-row work (RMSNorm, RoPE, routing, SiLU)
//! stays in the model code.

use half::bf16;

use crate::cpu::mla::{self, MlaOutput, PagedCache};
use crate::cpu::moe_int4::{self, Experts, Routing};
use crate::error::{check_len, Result};
use crate::model::layers::Linear;

/// The operations a backend provides. Each must give a row's result independently of the other rows in
/// the call (batch invariance, DESIGN.md §4.5).
pub trait Ops: Sync {
    /// `x [T, in]` through a bf16 linear layer: `[T, out]`.
    fn linear(&self, w: &Linear, x: &[f32]) -> Result<Vec<f32>>;

    /// Absorbed MLA attention of `q [T, heads, 576]`, row t over slots `0 .. seq_len[t]` of its block table.
    fn attention(&self, q: &[bf16], heads: usize, cache: &PagedCache, seq_len: &[i32], scale: f32)
        -> Result<MlaOutput>;

    /// Routed INT4 experts of `x [T, H]` for a routing of the same tokens: `[T, H]`.
    fn routed_experts(&self, x: &[bf16], routing: &Routing, experts: &Experts) -> Result<Vec<f32>>;
}

/// The CPU backend.
#[derive(Clone, Copy, Debug, Default)]
pub struct CpuOps;

impl Ops for CpuOps {
    fn linear(&self, w: &Linear, x: &[f32]) -> Result<Vec<f32>> {
        let tokens = x.len() / w.in_features().max(1);
        check_len("x", x.len(), &[("T", tokens), ("in", w.in_features())])?;
        Ok(w.forward_cpu(x))
    }

    fn attention(
        &self,
        q: &[bf16],
        heads: usize,
        cache: &PagedCache,
        seq_len: &[i32],
        scale: f32,
    ) -> Result<MlaOutput> {
        mla::mla_decode(q, heads, cache, seq_len, scale)
    }

    fn routed_experts(&self, x: &[bf16], routing: &Routing, experts: &Experts) -> Result<Vec<f32>> {
        moe_int4::moe_int4(x, routing, experts)
    }
}
