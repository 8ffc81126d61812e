//! The heavy operations of the forward pass behind one trait, so that the model code is one path for every
//! backend: the CPU implementation here runs the pure-Rust kernels of [`crate::cpu`]; a CUDA backend
//! implements the same trait with the device kernels. Cheap per-row work (RMSNorm, RoPE, routing, SiLU)
//! stays in the model code.

use half::bf16;

use crate::cpu::mla::{self, MlaOutput, PagedCache};
use crate::cpu::moe_int4::{self, Routing};
use crate::error::Result;
use crate::model::layers::{Linear, RoutedExperts};

/// The operations a backend provides. Each must give a row's result independently of the other rows in
/// the call (batch invariance, DESIGN.md §4.5).
pub trait Ops: Sync {
    /// `x [T, in]` through a bf16 linear layer: `[T, out]`.
    fn linear(&self, w: &Linear, x: &[f32]) -> Result<Vec<f32>>;

    /// Absorbed MLA attention of `q [T, heads, 576]`, row t over slots `0 .. seq_len[t]` of its block table.
    fn attention(&self, q: &[bf16], heads: usize, cache: &PagedCache, seq_len: &[i32], scale: f32)
        -> Result<MlaOutput>;

    /// Routed INT4 experts of `x [T, H]` for a routing of the same tokens: `[T, H]`.
    fn routed_experts(&self, x: &[bf16], routing: &Routing, experts: &RoutedExperts) -> Result<Vec<f32>>;
}

/// The CPU backend.
#[derive(Clone, Copy, Debug, Default)]
pub struct CpuOps;

impl Ops for CpuOps {
    fn linear(&self, w: &Linear, x: &[f32]) -> Result<Vec<f32>> {
        w.forward_cpu(x)
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

    fn routed_experts(&self, x: &[bf16], routing: &Routing, experts: &RoutedExperts) -> Result<Vec<f32>> {
        moe_int4::moe_int4(x, routing, &experts.view())
    }
}

#[cfg(feature = "cuda")]
pub use cuda_backend::CudaOps;

#[cfg(feature = "cuda")]
mod cuda_backend {
    use std::collections::hash_map::Entry;
    use std::collections::HashMap;
    use std::sync::{Mutex, PoisonError};

    use half::bf16;

    use super::Ops;
    use crate::cpu::mla::{MlaOutput, PagedCache};
    use crate::cpu::moe_int4::Routing;
    use crate::cuda::gemm_bf16::DeviceWeight;
    use crate::cuda::moe_int4::DeviceExperts;
    use crate::cuda::Gpu;
    use crate::error::Result;
    use crate::model::layers::{Linear, RoutedExperts, WeightId};

    /// The CUDA backend: the fixed-order bf16 GEMM, the MLA kernels and the INT4 MoE kernels. Each weight
    /// is uploaded on first use and kept on the device; activations and the KV cache travel with each
    /// call (host in, host out), which keeps one model code path for both backends at the cost of
    /// transfers that a device-resident step would not make.
    pub struct CudaOps {
        gpu: Gpu,
        linears: Mutex<HashMap<WeightId, DeviceWeight>>,
        experts: Mutex<HashMap<WeightId, DeviceExperts>>,
    }

    impl CudaOps {
        /// A backend on `gpu`.
        pub fn new(gpu: Gpu) -> Self {
            CudaOps { gpu, linears: Mutex::default(), experts: Mutex::default() }
        }

        /// The device it runs on.
        pub fn gpu(&self) -> &Gpu {
            &self.gpu
        }
    }

    impl Ops for CudaOps {
        fn linear(&self, w: &Linear, x: &[f32]) -> Result<Vec<f32>> {
            let mut cache = self.linears.lock().unwrap_or_else(PoisonError::into_inner);
            let dev = match cache.entry(w.id()) {
                Entry::Occupied(e) => e.into_mut(),
                Entry::Vacant(e) => {
                    e.insert(DeviceWeight::upload(&self.gpu, w.weight(), 1, w.out_features(), w.in_features())?)
                }
            };
            self.gpu.gemm_bf16_on(dev, x)
        }

        fn attention(
            &self,
            q: &[bf16],
            heads: usize,
            cache: &PagedCache,
            seq_len: &[i32],
            scale: f32,
        ) -> Result<MlaOutput> {
            self.gpu.mla_decode(q, heads, cache, seq_len, scale)
        }

        fn routed_experts(&self, x: &[bf16], routing: &Routing, experts: &RoutedExperts) -> Result<Vec<f32>> {
            let mut cache = self.experts.lock().unwrap_or_else(PoisonError::into_inner);
            let dev = match cache.entry(experts.id()) {
                Entry::Occupied(e) => e.into_mut(),
                Entry::Vacant(e) => e.insert(DeviceExperts::upload(&self.gpu, &experts.view())?),
            };
            self.gpu.moe_int4_on(x, routing, dev)
        }
    }
}
