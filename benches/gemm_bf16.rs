//! The fixed-order bf16 GEMM of the dense projections (kernels/gemm_bf16.cu) at Kimi-K2 shapes, for the
//! row counts of decode, tree-verify and batched-verify steps. Ids are `gemm_bf16/<row>/n<N>_k<K>_t<T>`:
//! - shapes: q_a (N 1536, K 7168), q_b (N 12288, K 1536: 64 heads of 192), kv_a (N 576, K 7168),
//!   o_proj (N 7168, K 8192: 64 heads of 128 values), the shared expert's gate and up stacked
//!   (N 4096, K 7168) and its down (N 7168, K 2048), the first layer's dense MLP gate and up stacked
//!   (N 36864, K 7168) and its down (N 7168, K 18432), and the lm_head (N 163840, K 7168);
//! - T 1, 8, 16, 33, 65, 130, 520, 2080: decodes at bs 1 and 8, trees of 16-65 rows, 8 and 32 trees of
//!   65 rows;
//! - rows `gpu` (the whole call: x split into bf16 hi and lo, the GEMM, the split-K reduce where the plan
//!   splits), `cublas_bf16` (cuBLAS with bf16 x and y and f32 accumulation, the baseline a user would
//!   otherwise pick: one rounding of x instead of two halves, and a kernel chosen by T, so not batch
//!   invariant) and `cpu` (the Rust reference, at the two smallest shapes and T 1 and 8);
//! - `gemm_bf16_tiles/<tile>/n<N>_k<K>_t<T>`: the whole call with each tile shape forced, at T 17-520,
//!   what the plan's choice of tile by T is read against.
//!
//! benches/report.py turns the rows into GB/s (the weight bytes, N · K bf16, over the time) against the
//! device-to-device copy of the same run, and TFLOP/s (2 · N · K · T) against the mma.sync rate it is
//! given (benches/microbench/mma_rate.cu, run beside).

mod common;

use common::criterion;
use criterion::{BenchmarkId, Criterion};
use half::bf16;
use kdtree_engine::cpu::gemm_bf16::gemm_bf16;

/// (N, K) of the projections.
const SHAPES: [(usize, usize); 9] = [
    (1536, 7168),
    (12_288, 1536),
    (576, 7168),
    (7168, 8192),
    (4096, 7168),
    (7168, 2048),
    (36_864, 7168),
    (7168, 18_432),
    (163_840, 7168),
];
/// The CPU reference runs where N · K is at most this, at these row counts.
const CPU_MAX_WEIGHTS: usize = 12_288 * 1536;
const CPU_TOKENS: [usize; 2] = [1, 8];

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
        for t in CPU_TOKENS {
            let x = host_x(t * k);
            group.bench_function(BenchmarkId::new("cpu", id(n, k, t)), |b| b.iter(|| gemm_bf16(&w, n, k, &x).unwrap()));
        }
    }
    group.finish();
}

#[cfg(feature = "cuda")]
mod gpu {
    use cudarc::cublas::{sys::cublasOperation_t, CudaBlas, Gemm, GemmConfig};
    use kdtree_engine::cuda::gemm_bf16::{tile_names, DeviceWeight, GemmPlan, Strides};
    use kdtree_engine::cuda::Gpu;

    use super::*;
    use crate::common::gpu::{bench_copy, open, time};

    const TOKENS: [usize; 8] = [1, 8, 16, 33, 65, 130, 520, 2080];
    const TILE_TOKENS: [usize; 7] = [17, 33, 65, 130, 192, 260, 520];

    pub fn bench(c: &mut Criterion) {
        let Some(gpu) = open() else { return };
        bench_copy(c, &gpu, "gemm_bf16");
        let blas = CudaBlas::new(gpu.stream().clone()).expect("cuBLAS");
        let mut group = c.benchmark_group("gemm_bf16");
        for (n, k) in SHAPES {
            // Zeros: the timing does not depend on the values, and generating 2.3 GB on the host would.
            let weights = gpu.zeros::<bf16>(n * k).unwrap();
            let w = DeviceWeight::from_device(weights.clone(), 1, n, k).unwrap();
            for t in TOKENS {
                bench_kernel(&mut group, &gpu, &w, t);
                bench_cublas(&mut group, &gpu, &blas, &weights, (n, k, t));
            }
        }
        group.finish();
        bench_tiles(c, &gpu);
    }

    /// `gemm_bf16_tiles/<tile>/n<N>_k<K>_t<T>`: each tile shape forced ([`GemmPlan::force_tile`]) at the
    /// row counts of one to eight trees of 17 to 65 rows, the data `tile_for`'s choice is read against.
    fn bench_tiles(c: &mut Criterion, gpu: &Gpu) {
        let mut group = c.benchmark_group("gemm_bf16_tiles");
        for (n, k) in SHAPES {
            let w = DeviceWeight::from_device(gpu.zeros::<bf16>(n * k).unwrap(), 1, n, k).unwrap();
            for t in TILE_TOKENS {
                for (tile, name) in tile_names().iter().enumerate() {
                    let label = name.trim_start_matches("gemm_bf16_");
                    bench_plan(&mut group, gpu, &w, t, Some(tile), label);
                }
            }
        }
        group.finish();
    }

    fn bench_kernel(
        group: &mut criterion::BenchmarkGroup<criterion::measurement::WallTime>,
        gpu: &Gpu,
        w: &DeviceWeight,
        t: usize,
    ) {
        bench_plan(group, gpu, w, t, None, "gpu");
    }

    /// The whole call at `t` tokens with the plan's own tile choice (`tile` None) or a forced one.
    fn bench_plan(
        group: &mut criterion::BenchmarkGroup<criterion::measurement::WallTime>,
        gpu: &Gpu,
        w: &DeviceWeight,
        t: usize,
        tile: Option<usize>,
        row: &str,
    ) {
        let (n, k) = (w.out_features(), w.in_features());
        let mut plan = GemmPlan::new(gpu, t, &[w]).unwrap();
        plan.force_tile(tile).unwrap();
        let x = gpu.upload(&host_x(t * k)).unwrap();
        let mut y = gpu.zeros::<f32>(t * n).unwrap();
        let (xs, ys) = (Strides::dense(k), Strides::dense(n));
        // One run outside the capture, so that every buffer the plan needs exists before it.
        plan.run(gpu, w, &x.as_view(), xs, t, &mut y.as_view_mut(), ys).unwrap();
        group.bench_function(BenchmarkId::new(row, id(n, k, t)), |b| {
            b.iter_custom(|iters| {
                time(gpu, iters, || plan.run(gpu, w, &x.as_view(), xs, t, &mut y.as_view_mut(), ys).unwrap())
            })
        });
    }

    /// y [T, N] = x [T, K] · Wᵀ with W [N, K] row-major: in cuBLAS's column-major terms C [N, T] = Wᵀᵀ · x.
    fn bench_cublas(
        group: &mut criterion::BenchmarkGroup<criterion::measurement::WallTime>,
        gpu: &Gpu,
        blas: &CudaBlas,
        w: &cudarc::driver::CudaSlice<bf16>,
        (n, k, t): (usize, usize, usize),
    ) {
        let x: Vec<bf16> = host_x(t * k).into_iter().map(bf16::from_f32).collect();
        let x = gpu.upload(&x).unwrap();
        let mut y = gpu.zeros::<bf16>(t * n).unwrap();
        let cfg = GemmConfig {
            transa: cublasOperation_t::CUBLAS_OP_T,
            transb: cublasOperation_t::CUBLAS_OP_N,
            m: n as i32,
            n: t as i32,
            k: k as i32,
            alpha: bf16::ONE,
            lda: k as i32,
            ldb: k as i32,
            beta: bf16::ZERO,
            ldc: n as i32,
        };
        // SAFETY: the operands hold N·K, T·K and T·N elements, as the configuration reads and writes.
        let mut run = || unsafe { blas.gemm(cfg, w, &x, &mut y) }.expect("cuBLAS gemm");
        run();
        group.bench_function(BenchmarkId::new("cublas_bf16", id(n, k, t)), |b| {
            b.iter_custom(|iters| time(gpu, iters, &mut run))
        });
    }
}

fn bench(c: &mut Criterion) {
    bench_cpu(c);
    #[cfg(feature = "cuda")]
    gpu::bench(c);
}

criterion::criterion_group! { name = benches; config = criterion(); targets = bench }
criterion::criterion_main!(benches);
