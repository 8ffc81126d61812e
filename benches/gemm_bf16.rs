//! The fixed-order bf16 GEMM of the dense projections (kernels/gemm_bf16.cu) at Kimi-K2 shapes, for the
//! few tokens of a decode or tree-verify step, where streaming the weights is the cost. Ids are
//! `gemm_bf16/<backend>/n<N>_k<K>_t<T>` for
//! - o_proj (N 7168, K 8192: 64 heads of 128 values), q_b (N 12288, K 1536: 64 heads of 192),
//!   the first layer's dense MLP gate and up stacked (N 36864, K 7168) and the lm_head (N 163840, K 7168);
//! - T 1, 8 and 65 (a decode at bs 1 and 8, a tree of 65 rows).
//!
//! GB/s counts the weight bytes (N · K bf16) over the time of the whole run (x split into bf16 hi and lo,
//! the GEMM, the split-K reduce where the plan splits), the figure compared with the device-to-device
//! copy of the same run. The CPU reference runs at the o_proj and q_b shapes only (the larger ones take
//! seconds a call).

mod common;

use common::criterion;
use criterion::{BenchmarkId, Criterion};
use half::bf16;
use kdtree_engine::cpu::gemm_bf16::gemm_bf16;

/// (N, K) of the projections.
const SHAPES: [(usize, usize); 4] = [(7168, 8192), (12_288, 1536), (36_864, 7168), (163_840, 7168)];
const TOKENS: [usize; 3] = [1, 8, 65];
/// The CPU reference runs where N · K is at most this.
const CPU_MAX_WEIGHTS: usize = 7168 * 8192;

fn id(n: usize, k: usize, t: usize) -> String {
    format!("n{n}_k{k}_t{t}")
}

/// Activations in [-1, 1): the timing does not depend on the values.
fn host_x(n: usize) -> Vec<f32> {
    (0..n).map(|i| ((i * 2_654_435_761) % 2001) as f32 / 1000.0 - 1.0).collect()
}

fn bench_cpu(c: &mut Criterion) {
    let mut group = c.benchmark_group("gemm_bf16");
    group.sampling_mode(criterion::SamplingMode::Flat);
    for (n, k) in SHAPES.into_iter().filter(|&(n, k)| n * k <= CPU_MAX_WEIGHTS) {
        let w: Vec<bf16> = (0..n * k).map(|i| bf16::from_f32(((i % 255) as f32 - 127.0) / 128.0)).collect();
        for t in TOKENS {
            let x = host_x(t * k);
            group.bench_function(BenchmarkId::new("cpu", id(n, k, t)), |b| b.iter(|| gemm_bf16(&w, n, k, &x).unwrap()));
        }
    }
    group.finish();
}

#[cfg(feature = "cuda")]
fn bench_gpu(c: &mut Criterion) {
    use kdtree_engine::cuda::gemm_bf16::{DeviceWeight, GemmPlan, Strides};

    use crate::common::gpu::{bench_copy, open, time};

    let Some(gpu) = open() else { return };
    bench_copy(c, &gpu, "gemm_bf16");
    let mut group = c.benchmark_group("gemm_bf16");
    for (n, k) in SHAPES {
        // Zeros: the timing does not depend on the values, and generating 2.3 GB on the host would.
        let w = DeviceWeight::from_device(gpu.zeros::<bf16>(n * k).unwrap(), 1, n, k).unwrap();
        for t in TOKENS {
            let mut plan = GemmPlan::new(&gpu, t, &[&w]).unwrap();
            let x = gpu.upload(&host_x(t * k)).unwrap();
            let mut y = gpu.zeros::<f32>(t * n).unwrap();
            let (xs, ys) = (Strides::dense(k), Strides::dense(n));
            // One run outside the capture, so that every buffer the plan needs exists before it.
            plan.run(&gpu, &w, &x.as_view(), xs, t, &mut y.as_view_mut(), ys).unwrap();
            group.bench_function(BenchmarkId::new("gpu", id(n, k, t)), |b| {
                b.iter_custom(|iters| {
                    time(&gpu, iters, || plan.run(&gpu, &w, &x.as_view(), xs, t, &mut y.as_view_mut(), ys).unwrap())
                })
            });
        }
    }
    group.finish();
}

fn bench(c: &mut Criterion) {
    bench_cpu(c);
    #[cfg(feature = "cuda")]
    bench_gpu(c);
}

criterion::criterion_group! { name = benches; config = criterion(); targets = bench }
criterion::criterion_main!(benches);
