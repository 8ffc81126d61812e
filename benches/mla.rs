//! MLA absorbed attention (Kimi-K2 latent 512 + rope 64, page size 64). Ids:
//! - `mla/gpu_decode/h<H>_bs<bs>_s<prefix>`: `mla_decode` for H 8, 16, 64, bs 1..64, prefix 1024..65536
//!   (shapes whose cache passes 20 GB are skipped);
//! - `mla/gpu_tree/n65_h8_bs<bs>_s4096` and, beside it, `mla/gpu_decode65/n65_h8_bs<bs>_s4096`: 65
//!   separate decodes over the same prefix, what verifying the tree row by row would cost;
//! - `mla/cpu_decode/...`, `mla/cpu_tree/...`: the CPU reference at a few small shapes;
//! - `mla_ceiling/cublas_bf16/m8192`: an 8192³ cuBLAS bf16 GEMM (f32 accumulate), the mma ceiling, next
//!   to `copy/d2d/mla`, the bandwidth ceiling; benches/report.py turns both into roofline fractions.
//!
//! Not here yet: the unfused cuBLAS baseline (per-head GEMMs around a softmax kernel).

mod common;

use common::criterion;
use criterion::{BenchmarkId, Criterion};
use half::bf16;
use kdtree_engine::cpu::mla::{mla_decode, tree_verify, PagedCache, ROW};
use kdtree_engine::KvLayout;

const PAGE: usize = 64;
const SCALE: f32 = 0.130_860_8;

/// A heap-shaped tree: row i's parent is (i - 1) / 2, so the deepest rows see 7 tree rows.
fn heap_visibility(bs: usize, n: usize) -> Vec<u32> {
    let w = n.div_ceil(32);
    let mut vis = vec![0u32; bs * n * w];
    for b in 0..bs {
        for i in 0..n {
            let mut j = i;
            loop {
                vis[(b * n + i) * w + j / 32] |= 1 << (j % 32);
                if j == 0 {
                    break;
                }
                j = (j - 1) / 2;
            }
        }
    }
    vis
}

fn layout(bs: usize, slots: usize) -> KvLayout {
    let pages_per_req = slots.div_ceil(PAGE);
    KvLayout { layers: 1, num_pages: bs * pages_per_req, page_size: PAGE, row_elems: ROW, pages_per_req }
}

fn host_bf16(n: usize) -> Vec<bf16> {
    (0..n).map(|i| bf16::from_f32(((i * 2_654_435_761) % 2001) as f32 / 1000.0 - 1.0)).collect()
}

fn bench_cpu(c: &mut Criterion) {
    let mut group = c.benchmark_group("mla");
    group.sampling_mode(criterion::SamplingMode::Flat);
    for (heads, bs, prefix) in [(8usize, 1usize, 1024usize), (8, 8, 1024), (64, 1, 1024)] {
        let l = layout(bs, prefix);
        let (rows, table, q) = (
            host_bf16(l.num_pages * PAGE * ROW),
            (0..l.num_pages as i32).collect::<Vec<_>>(),
            host_bf16(bs * heads * ROW),
        );
        let cache = PagedCache { rows: &rows, layout: l, block_table: &table };
        let seq = vec![prefix as i32; bs];
        group.bench_function(BenchmarkId::new("cpu_decode", format!("h{heads}_bs{bs}_s{prefix}")), |b| {
            b.iter(|| mla_decode(&q, heads, &cache, &seq, SCALE).unwrap())
        });
    }
    let (heads, bs, prefix, n) = (8usize, 1usize, 1024usize, 17usize);
    let l = layout(bs, prefix + n);
    let (rows, table, q) = (
        host_bf16(l.num_pages * PAGE * ROW),
        (0..l.num_pages as i32).collect::<Vec<_>>(),
        host_bf16(bs * n * heads * ROW),
    );
    let cache = PagedCache { rows: &rows, layout: l, block_table: &table };
    let (seq, vis) = (vec![prefix as i32; bs], heap_visibility(bs, n));
    group.bench_function(BenchmarkId::new("cpu_tree", format!("n{n}_h{heads}_bs{bs}_s{prefix}")), |b| {
        b.iter(|| tree_verify(&q, n, heads, &cache, &seq, &vis, SCALE).unwrap())
    });
    group.finish();
}

#[cfg(feature = "cuda")]
mod gpu_rows {
    use super::*;
    use common::gpu::{time, time_direct};
    use cudarc::cublas::{sys::cublasOperation_t, CudaBlas, Gemm, GemmConfig};
    use kdtree_engine::cuda::mla::{DeviceCache, DeviceMlaOutput, MlaPlan};
    use kdtree_engine::cuda::Gpu;

    /// Tree rows of the tree-verify rows (budget 64).
    const TREE_ROWS: usize = 65;
    const TREE_PREFIX: usize = 4096;
    /// Cache bytes above which a decode shape is skipped.
    const MAX_CACHE_BYTES: usize = 20 << 30;

    /// The mma ceiling: C = A·B, 8192³ bf16 with f32 accumulate, through cuBLAS.
    pub fn bench_gemm(c: &mut Criterion, gpu: &Gpu) {
        const M: usize = 8192;
        let blas = CudaBlas::new(gpu.stream().clone()).expect("cuBLAS");
        let (a, b) = (gpu.zeros::<bf16>(M * M).unwrap(), gpu.zeros::<bf16>(M * M).unwrap());
        let mut out = gpu.zeros::<bf16>(M * M).unwrap();
        let cfg = GemmConfig {
            transa: cublasOperation_t::CUBLAS_OP_N,
            transb: cublasOperation_t::CUBLAS_OP_N,
            m: M as i32,
            n: M as i32,
            k: M as i32,
            alpha: bf16::ONE,
            lda: M as i32,
            ldb: M as i32,
            beta: bf16::ZERO,
            ldc: M as i32,
        };
        let mut group = c.benchmark_group("mla_ceiling");
        group.bench_function(BenchmarkId::new("cublas_bf16", format!("m{M}")), |bench| {
            bench.iter_custom(|iters| {
                time_direct(gpu, iters, || unsafe { blas.gemm(cfg, &a, &b, &mut out) }.expect("gemm"))
            })
        });
        group.finish();
    }

    /// Device buffers of one shape: cache, block tables, prefixes, queries, outputs, plan.
    struct Shape {
        layout: KvLayout,
        rows: cudarc::driver::CudaSlice<bf16>,
        table: cudarc::driver::CudaSlice<i32>,
        seq: cudarc::driver::CudaSlice<i32>,
        q: cudarc::driver::CudaSlice<bf16>,
        o: cudarc::driver::CudaSlice<f32>,
        lse: cudarc::driver::CudaSlice<f32>,
        plan: MlaPlan,
        /// The bound the runs pass: the plan's, which is the shape's longest visible sequence.
        max_seq_len: usize,
    }

    impl Shape {
        fn new(gpu: &Gpu, heads: usize, bs: usize, prefix: usize, n: usize, seq_extra: usize) -> Shape {
            let extra = if n > 1 { n } else { seq_extra };
            let layout = layout(bs, prefix + extra);
            let rows = bs * n * heads;
            Shape {
                layout,
                // Zeros: the timing does not depend on the values, and generating gigabytes on the host would.
                rows: gpu.zeros(layout.num_pages * PAGE * ROW).unwrap(),
                table: gpu.upload(&(0..layout.num_pages as i32).collect::<Vec<_>>()).unwrap(),
                seq: gpu.upload(&vec![(prefix + seq_extra) as i32; bs]).unwrap(),
                q: gpu.zeros(rows * ROW).unwrap(),
                o: gpu.zeros(rows * 512).unwrap(),
                lse: gpu.zeros(rows).unwrap(),
                plan: MlaPlan::new(gpu, bs, heads, prefix + extra, n).unwrap(),
                max_seq_len: prefix + extra,
            }
        }

        fn decode(&mut self, gpu: &Gpu) {
            let cache =
                DeviceCache { rows: self.rows.as_view(), layout: self.layout, block_table: self.table.as_view() };
            let mut out = DeviceMlaOutput { o: self.o.as_view_mut(), lse: self.lse.as_view_mut() };
            let (q, seq) = (self.q.as_view(), self.seq.as_view());
            self.plan.run_decode(gpu, &q, &cache, &seq, self.max_seq_len, SCALE, &mut out).unwrap();
        }

        fn tree(&mut self, gpu: &Gpu, vis: &cudarc::driver::CudaSlice<u32>, n: usize) {
            let cache =
                DeviceCache { rows: self.rows.as_view(), layout: self.layout, block_table: self.table.as_view() };
            let mut out = DeviceMlaOutput { o: self.o.as_view_mut(), lse: self.lse.as_view_mut() };
            let (q, seq, v) = (self.q.as_view(), self.seq.as_view(), vis.as_view());
            self.plan.run_tree_verify(gpu, &q, n, &cache, &seq, self.max_seq_len, &v, SCALE, &mut out).unwrap();
        }
    }

    pub fn bench_decode(c: &mut Criterion, gpu: &Gpu) {
        let mut group = c.benchmark_group("mla");
        group.sampling_mode(criterion::SamplingMode::Flat);
        for heads in [8usize, 16, 64] {
            for bs in [1usize, 8, 32, 64] {
                for prefix in [1024usize, 4096, 16384, 65536] {
                    if bs * prefix * ROW * 2 > MAX_CACHE_BYTES {
                        continue;
                    }
                    let mut shape = Shape::new(gpu, heads, bs, prefix, 1, 0);
                    group.bench_function(BenchmarkId::new("gpu_decode", format!("h{heads}_bs{bs}_s{prefix}")), |b| {
                        b.iter_custom(|iters| time(gpu, iters, || shape.decode(gpu)))
                    });
                }
            }
        }
        group.finish();
    }

    pub fn bench_tree(c: &mut Criterion, gpu: &Gpu) {
        let (heads, n) = (8usize, TREE_ROWS);
        let mut group = c.benchmark_group("mla");
        group.sampling_mode(criterion::SamplingMode::Flat);
        for bs in [1usize, 8, 32] {
            let id = format!("n{n}_h{heads}_bs{bs}_s{TREE_PREFIX}");
            let vis = gpu.upload(&heap_visibility(bs, n)).unwrap();
            let mut shape = Shape::new(gpu, heads, bs, TREE_PREFIX, n, 0);
            group.bench_function(BenchmarkId::new("gpu_tree", &id), |b| {
                b.iter_custom(|iters| time(gpu, iters, || shape.tree(gpu, &vis, n)))
            });
            // Row by row: 65 decodes of the prefix plus one row.
            let mut rows = Shape::new(gpu, heads, bs, TREE_PREFIX, 1, 1);
            group.bench_function(BenchmarkId::new("gpu_decode65", &id), |b| {
                b.iter_custom(|iters| {
                    time(gpu, iters, || {
                        for _ in 0..n {
                            rows.decode(gpu)
                        }
                    })
                })
            });
        }
        group.finish();
    }
}

fn bench(c: &mut Criterion) {
    #[cfg(feature = "cuda")]
    if let Some(gpu) = common::gpu::open() {
        common::gpu::bench_copy(c, &gpu, "mla");
        gpu_rows::bench_gemm(c, &gpu);
        gpu_rows::bench_decode(c, &gpu);
        gpu_rows::bench_tree(c, &gpu);
    }
    bench_cpu(c);
}

criterion::criterion_group! { name = benches; config = criterion(); targets = bench }
criterion::criterion_main!(benches);
