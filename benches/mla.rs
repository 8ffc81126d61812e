//! MLA absorbed attention (Kimi-K2 latent 512 + rope 64, page size 64). Ids:
//! - `mla/gpu_decode/h<H>_bs<bs>_s<prefix>`: `mla_decode` for H 8, 16, 64, bs 1..64, prefix 1024..65536
//!   (shapes whose cache passes 20 GB are skipped);
//! - `mla/gpu_unfused/h<H>_bs<bs>_s<prefix>` for H 8 and 64, bs 1, 8, 32, prefix 1024, 4096, 16384: the
//!   unfused path a user might write instead (issue 3), over a contiguous latent cache `[bs, seq, 576]`:
//!   a cuBLAS strided-batched bf16 GEMM for the scores (f32 compute, bf16 S), a row softmax compiled with
//!   NVRTC at bench start (f32 math, bf16 P), and a second strided-batched GEMM for P·V (V the first 512
//!   columns of the cache rows, bf16 O); the three timed together on the stream (no graph). Before any row
//!   runs, its output is checked against `mla_decode` on random data (H 8, bs 2, seq 296 and 301), and the
//!   bench panics when they disagree;
//! - `mla/gpu_tree/n<N>_h<H>_bs<bs>_s<prefix>`: `tree_verify` over a heap tree of N 17, 33, 65 rows, H 8
//!   and 16, bs 1, 8, 32, prefix 1024, 4096, 16384; benches/report.py sets it beside N times the
//!   `gpu_decode` row of the same H, bs and prefix, what verifying the tree row by row would cost;
//! - `mla/cpu_decode/...`, `mla/cpu_tree/...`: the CPU reference at a few small shapes;
//! - `mla_ceiling/cublas_bf16/m8192`: an 8192³ cuBLAS bf16 GEMM (f32 accumulate), the mma ceiling, next
//!   to `copy/d2d/mla`, the bandwidth ceiling; benches/report.py turns both into roofline fractions.

mod common;

use common::{criterion, heap_visibility};
use criterion::{BenchmarkId, Criterion};
use half::bf16;
use kdtree_engine::cpu::mla::{mla_decode, tree_verify, PagedCache, ROW};
use kdtree_engine::KvLayout;

const PAGE: usize = 64;
const SCALE: f32 = 0.130_860_8;

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
    use cudarc::cublas::{sys::cublasOperation_t, CudaBlas, Gemm, GemmConfig, StridedBatchedConfig};
    use cudarc::driver::{CudaFunction, CudaSlice, LaunchConfig, PushKernelArg};
    use kdtree_engine::cpu::mla::LATENT;
    use kdtree_engine::cuda::mla::{DeviceCache, DeviceMlaOutput, MlaPlan};
    use kdtree_engine::cuda::Gpu;

    /// Tree rows of the tree-verify rows (budgets 16, 32, 64) and their prefixes.
    const TREE_ROWS: [usize; 3] = [17, 33, 65];
    const TREE_PREFIXES: [usize; 3] = [1024, 4096, 16384];
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

    /// Buffer bytes (cache, queries, scores, probabilities, outputs) above which an unfused shape is skipped.
    const MAX_UNFUSED_BYTES: usize = 4 << 30;
    /// Threads of a softmax block (one block per row).
    const SOFTMAX_THREADS: u32 = 256;
    /// Softmax kernel name in [`SOFTMAX_SRC`].
    const SOFTMAX_NAME: &str = "softmax_rows_bf16";

    /// The unfused path's softmax, compiled with NVRTC when the bench starts: a baseline of this bench,
    /// not a kernel of the library.
    const SOFTMAX_SRC: &str = r#"
// p = softmax(scale * s) over each row of `len` bf16 scores: one block per row, a max pass and a sum pass
// with block reductions, then the write pass; f32 math, bf16 out. No headers (NVRTC): bf16 values are
// handled as their bits. Rows whose length is a multiple of 8 are read and written 16 bytes at a time.
#define NEG_INF __uint_as_float(0xff800000u)

__device__ __forceinline__ float bf16_bits_to_f32(unsigned int bits) { return __uint_as_float(bits << 16); }

// Round to nearest even (the values are finite).
__device__ __forceinline__ unsigned int f32_to_bf16_bits(float f) {
    const unsigned int u = __float_as_uint(f);
    return (u + 0x7fffu + ((u >> 16) & 1u)) >> 16;
}

// Calls f(x) for each element this thread owns.
template <typename F>
__device__ __forceinline__ void for_each(const unsigned short* row, int len, F f) {
    if ((len & 7) == 0) {
        const uint4* v = reinterpret_cast<const uint4*>(row);
        for (int c = threadIdx.x; c < (len >> 3); c += blockDim.x) {
            const uint4 w = v[c];
            const unsigned int words[4] = {w.x, w.y, w.z, w.w};
#pragma unroll
            for (int j = 0; j < 4; ++j) {
                f(bf16_bits_to_f32(words[j] & 0xffffu));
                f(bf16_bits_to_f32(words[j] >> 16));
            }
        }
    } else {
        for (int i = threadIdx.x; i < len; i += blockDim.x) f(bf16_bits_to_f32(row[i]));
    }
}

// Block-wide max or sum; every thread gets the result. red: one float per warp.
template <bool MAX>
__device__ __forceinline__ float block_reduce(float v, float* red) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, warps = blockDim.x >> 5;
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) {
        const float other = __shfl_xor_sync(0xffffffffu, v, o);
        v = MAX ? fmaxf(v, other) : v + other;
    }
    if (lane == 0) red[warp] = v;
    __syncthreads();
    v = lane < warps ? red[lane] : (MAX ? NEG_INF : 0.0f);
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) {
        const float other = __shfl_xor_sync(0xffffffffu, v, o);
        v = MAX ? fmaxf(v, other) : v + other;
    }
    __syncthreads();  // red is reused by the next reduction
    return v;
}

// Grid: one block per row; block: a multiple of 32 threads, at most 1024.
extern "C" __global__ void softmax_rows_bf16(const unsigned short* __restrict__ s, unsigned short* __restrict__ p,
                                             int len, float scale) {
    __shared__ float red[32];
    const unsigned long long offset = (unsigned long long)blockIdx.x * (unsigned long long)len;
    const unsigned short* in = s + offset;
    unsigned short* out = p + offset;
    float m = NEG_INF;
    for_each(in, len, [&](float x) { m = fmaxf(m, scale * x); });
    m = block_reduce<true>(m, red);
    float sum = 0.0f;
    for_each(in, len, [&](float x) { sum += expf(scale * x - m); });
    sum = block_reduce<false>(sum, red);
    const float inv = 1.0f / sum;
    if ((len & 7) == 0) {
        const uint4* v = reinterpret_cast<const uint4*>(in);
        uint4* o = reinterpret_cast<uint4*>(out);
        for (int c = threadIdx.x; c < (len >> 3); c += blockDim.x) {
            const uint4 w = v[c];
            unsigned int words[4] = {w.x, w.y, w.z, w.w};
#pragma unroll
            for (int j = 0; j < 4; ++j) {
                const float lo = expf(scale * bf16_bits_to_f32(words[j] & 0xffffu) - m) * inv;
                const float hi = expf(scale * bf16_bits_to_f32(words[j] >> 16) - m) * inv;
                words[j] = f32_to_bf16_bits(lo) | (f32_to_bf16_bits(hi) << 16);
            }
            uint4 r;
            r.x = words[0];
            r.y = words[1];
            r.z = words[2];
            r.w = words[3];
            o[c] = r;
        }
    } else {
        for (int i = threadIdx.x; i < len; i += blockDim.x)
            out[i] = (unsigned short)f32_to_bf16_bits(expf(scale * bf16_bits_to_f32(in[i]) - m) * inv);
    }
}
"#;

    /// Uniform values in [-1, 1) from a xorshift stream: unlike `host_bf16`, queries and cache rows made
    /// with different seeds are not copies of each other, so the scores are not dominated by one row.
    fn random_bf16(n: usize, seed: u64) -> Vec<bf16> {
        let mut s = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
        (0..n)
            .map(|_| {
                s ^= s << 13;
                s ^= s >> 7;
                s ^= s << 17;
                bf16::from_f32((s >> 40) as f32 / (1u64 << 23) as f32 - 1.0)
            })
            .collect()
    }

    /// Device buffers of one unfused shape, all bf16 and row-major.
    struct UnfusedShape {
        heads: usize,
        bs: usize,
        seq: usize,
        /// The contiguous latent cache `[bs, seq, 576]`: K is the whole row, V its first 512 elements.
        cache: CudaSlice<bf16>,
        /// Queries `[bs, H, 576]`.
        q: CudaSlice<bf16>,
        /// Unscaled scores `[bs, H, seq]`.
        s: CudaSlice<bf16>,
        /// Probabilities `[bs, H, seq]`.
        p: CudaSlice<bf16>,
        /// Outputs `[bs, H, 512]`.
        o: CudaSlice<bf16>,
    }

    impl UnfusedShape {
        fn bytes(heads: usize, bs: usize, seq: usize) -> usize {
            2 * (bs * seq * ROW + bs * heads * (ROW + 2 * seq + LATENT))
        }

        /// Zeros, as the fused rows use: the timing does not depend on the values.
        fn zeros(gpu: &Gpu, heads: usize, bs: usize, seq: usize) -> UnfusedShape {
            let cache = gpu.zeros(bs * seq * ROW).expect("unfused cache");
            let q = gpu.zeros(bs * heads * ROW).expect("unfused queries");
            UnfusedShape::with(gpu, heads, bs, seq, cache, q)
        }

        fn with(
            gpu: &Gpu,
            heads: usize,
            bs: usize,
            seq: usize,
            cache: CudaSlice<bf16>,
            q: CudaSlice<bf16>,
        ) -> UnfusedShape {
            let rows = bs * heads;
            UnfusedShape {
                heads,
                bs,
                seq,
                cache,
                q,
                s: gpu.zeros(rows * seq).expect("unfused scores"),
                p: gpu.zeros(rows * seq).expect("unfused probabilities"),
                o: gpu.zeros(rows * LATENT).expect("unfused outputs"),
            }
        }
    }

    /// The unfused path a user might write instead of `mla_decode`, over a contiguous (unpaged) latent
    /// cache `[bs, seq, 576]` and queries `[bs, H, 576]`, both bf16:
    /// 1. `S[b] = Q[b] · K[b]ᵀ` (H x seq): one cuBLAS strided-batched GEMM over the requests, bf16 inputs,
    ///    f32 compute, **bf16 output** (cudarc's bf16 GEMM writes C in bf16, as `torch.bmm` on bf16 does);
    /// 2. `P = softmax(scale · S)` per row (bs·H rows of seq): the NVRTC kernel, f32 math, bf16 P;
    /// 3. `O[b] = P[b] · V[b]` (H x 512), V the first 512 columns of the same cache rows: a second
    ///    strided-batched GEMM, bf16 output (the fused kernel writes f32).
    pub struct Unfused {
        blas: CudaBlas,
        softmax: CudaFunction,
    }

    impl Unfused {
        /// Compiles and loads the softmax, and makes a cuBLAS handle on the `Gpu`'s stream.
        pub fn new(gpu: &Gpu) -> Unfused {
            let ptx = cudarc::nvrtc::compile_ptx(SOFTMAX_SRC).expect("NVRTC compile of the unfused softmax");
            let module = gpu.stream().context().load_module(ptx).expect("loading the unfused softmax PTX");
            let softmax = module.load_function(SOFTMAX_NAME).expect("the unfused softmax function");
            Unfused { blas: CudaBlas::new(gpu.stream().clone()).expect("cuBLAS handle"), softmax }
        }

        /// Queues the three steps on the `Gpu`'s stream.
        ///
        /// cuBLAS is column-major, and a row-major r x c matrix with row stride ld is, in the same memory,
        /// the column-major c x r matrix with leading dimension ld (its transpose). So a row-major product
        /// C = A·B is computed as the column-major Cᵀ = Bᵀ·Aᵀ, each operand read in place.
        fn run(&self, gpu: &Gpu, x: &mut UnfusedShape) {
            let (heads, seq, row, latent) = (x.heads as i32, x.seq as i32, ROW as i32, LATENT as i32);
            let (n, t) = (cublasOperation_t::CUBLAS_OP_N, cublasOperation_t::CUBLAS_OP_T);
            // (1) Row-major S[b] (H x seq, ld seq) = Q[b] (H x 576, ld 576) · K[b]ᵀ, K[b] the request's cache
            // rows (seq x 576, ld 576). Column-major: Sᵀ (seq x H, ldc seq) = K · Qᵀ, where
            //   A = the cache, column-major Kᵀ (576 x seq, lda 576), transa T gives K (m = seq, k = 576);
            //   B = the queries, column-major Qᵀ (576 x H, ldb 576), transb N (k = 576, n = H).
            // Batch strides: cache seq·576, queries H·576, scores H·seq.
            let scores = StridedBatchedConfig {
                gemm: GemmConfig {
                    transa: t,
                    transb: n,
                    m: seq,
                    n: heads,
                    k: row,
                    alpha: bf16::ONE,
                    lda: row,
                    ldb: row,
                    beta: bf16::ZERO,
                    ldc: seq,
                },
                batch_size: x.bs as i32,
                stride_a: (x.seq * ROW) as i64,
                stride_b: (x.heads * ROW) as i64,
                stride_c: (x.heads * x.seq) as i64,
            };
            unsafe { self.blas.gemm_strided_batched(scores, &x.cache, &x.q, &mut x.s) }.expect("cuBLAS scores GEMM");
            // (2) P = softmax(scale · S), one block per row of seq.
            let cfg = LaunchConfig {
                grid_dim: ((x.bs * x.heads) as u32, 1, 1),
                block_dim: (SOFTMAX_THREADS, 1, 1),
                shared_mem_bytes: 0,
            };
            let scale = SCALE;
            let mut launch = gpu.stream().launch_builder(&self.softmax);
            launch.arg(&x.s).arg(&mut x.p).arg(&seq).arg(&scale);
            unsafe { launch.launch(cfg) }.expect("softmax launch");
            // (3) Row-major O[b] (H x 512, ld 512) = P[b] (H x seq, ld seq) · V[b], V[b] the first 512 columns
            // of the request's cache rows (seq x 512, ld 576). Column-major: Oᵀ (512 x H, ldc 512) = Vᵀ · Pᵀ:
            //   A = the cache, column-major Vᵀ (512 x seq, lda 576: the row stride, not 512), transa N
            //   (m = 512, k = seq);
            //   B = P, column-major Pᵀ (seq x H, ldb seq), transb N (k = seq, n = H).
            // Batch strides: cache seq·576, probabilities H·seq, outputs H·512.
            let values = StridedBatchedConfig {
                gemm: GemmConfig {
                    transa: n,
                    transb: n,
                    m: latent,
                    n: heads,
                    k: seq,
                    alpha: bf16::ONE,
                    lda: row,
                    ldb: seq,
                    beta: bf16::ZERO,
                    ldc: latent,
                },
                batch_size: x.bs as i32,
                stride_a: (x.seq * ROW) as i64,
                stride_b: (x.heads * x.seq) as i64,
                stride_c: (x.heads * LATENT) as i64,
            };
            unsafe { self.blas.gemm_strided_batched(values, &x.cache, &x.p, &mut x.o) }.expect("cuBLAS P·V GEMM");
        }

        /// Runs the unfused path and the fused `Gpu::mla_decode` (the same rows laid out as pages of 64) on
        /// the same random data at H 8, bs 2 and `seq`, and panics unless their O agree to a relative
        /// Frobenius error below 2e-2 (S, P and O are bf16 here): a wrong transpose or leading dimension
        /// must not produce fast but meaningless rows.
        pub fn check(&self, gpu: &Gpu, seq: usize) {
            let (heads, bs) = (8usize, 2usize);
            let (cache, q) = (random_bf16(bs * seq * ROW, 1), random_bf16(bs * heads * ROW, 2));
            let (dev_cache, dev_q) = (gpu.upload(&cache).expect("upload"), gpu.upload(&q).expect("upload"));
            let mut shape = UnfusedShape::with(gpu, heads, bs, seq, dev_cache, dev_q);
            self.run(gpu, &mut shape);
            let got = gpu.download(&shape.o).expect("download of the unfused O");
            // Request b owns pages b * pages_per_req.. (the block table is the identity), so its slot t is
            // paged row b * pages_per_req * 64 + t.
            let l = layout(bs, seq);
            let mut rows = vec![bf16::ZERO; l.num_pages * PAGE * ROW];
            for b in 0..bs {
                let dst = b * l.pages_per_req * PAGE * ROW;
                rows[dst..dst + seq * ROW].copy_from_slice(&cache[b * seq * ROW..(b + 1) * seq * ROW]);
            }
            let table = (0..l.num_pages as i32).collect::<Vec<_>>();
            let paged = PagedCache { rows: &rows, layout: l, block_table: &table };
            let want = gpu.mla_decode(&q, heads, &paged, &vec![seq as i32; bs], SCALE).expect("fused mla_decode");
            assert_eq!(got.len(), want.o.len(), "unfused and fused O sizes");
            let (mut err, mut norm) = (0.0f64, 0.0f64);
            for (g, w) in got.iter().zip(&want.o) {
                err += (g.to_f64() - *w as f64).powi(2);
                norm += (*w as f64).powi(2);
            }
            let rel = (err / norm).sqrt();
            assert!(
                rel < 2e-2,
                "unfused MLA baseline disagrees with mla_decode at h{heads}_bs{bs}_s{seq}: relative Frobenius \
                 error {rel:.3e} (limit 2e-2); its GEMM mappings or softmax are wrong, so its rows would mean nothing"
            );
            println!("unfused MLA baseline matches mla_decode at h{heads}_bs{bs}_s{seq}: relative error {rel:.2e}");
        }
    }

    /// `mla/gpu_unfused/h<H>_bs<bs>_s<prefix>`: the three unfused steps, timed together directly on the
    /// stream (cuBLAS calls are not captured in a graph).
    pub fn bench_unfused(c: &mut Criterion, gpu: &Gpu, unfused: &Unfused) {
        let mut group = c.benchmark_group("mla");
        group.sampling_mode(criterion::SamplingMode::Flat);
        for heads in [8usize, 64] {
            for bs in [1usize, 8, 32] {
                for prefix in [1024usize, 4096, 16384] {
                    if UnfusedShape::bytes(heads, bs, prefix) > MAX_UNFUSED_BYTES {
                        continue;
                    }
                    let mut shape = UnfusedShape::zeros(gpu, heads, bs, prefix);
                    group.bench_function(BenchmarkId::new("gpu_unfused", format!("h{heads}_bs{bs}_s{prefix}")), |b| {
                        b.iter_custom(|iters| time_direct(gpu, iters, || unfused.run(gpu, &mut shape)))
                    });
                }
            }
        }
        group.finish();
    }

    /// `mla/gpu_tree/n<N>_h<H>_bs<bs>_s<prefix>`: one tree_verify launch over a heap tree of N rows.
    /// N separate decodes cost N times the `gpu_decode` row of the same heads, batch and prefix.
    pub fn bench_tree(c: &mut Criterion, gpu: &Gpu) {
        let mut group = c.benchmark_group("mla");
        group.sampling_mode(criterion::SamplingMode::Flat);
        for n in TREE_ROWS {
            for heads in [8usize, 16] {
                for bs in [1usize, 8, 32] {
                    let vis = gpu.upload(&heap_visibility(bs, n)).unwrap();
                    for prefix in TREE_PREFIXES {
                        let mut shape = Shape::new(gpu, heads, bs, prefix, n, 0);
                        group.bench_function(
                            BenchmarkId::new("gpu_tree", format!("n{n}_h{heads}_bs{bs}_s{prefix}")),
                            |b| b.iter_custom(|iters| time(gpu, iters, || shape.tree(gpu, &vis, n))),
                        );
                    }
                }
            }
        }
        group.finish();
    }
}

fn bench(c: &mut Criterion) {
    #[cfg(feature = "cuda")]
    if let Some(gpu) = common::gpu::open() {
        // The unfused baseline is checked against mla_decode before any row runs.
        let unfused = gpu_rows::Unfused::new(&gpu);
        unfused.check(&gpu, 296); // a multiple of 8: the softmax's 16-byte path, which the rows take
        unfused.check(&gpu, 301); // odd: its element-wise path
        common::gpu::bench_copy(c, &gpu, "mla");
        gpu_rows::bench_gemm(c, &gpu);
        gpu_rows::bench_decode(c, &gpu);
        gpu_rows::bench_unfused(c, &gpu, &unfused);
        gpu_rows::bench_tree(c, &gpu);
    }
    bench_cpu(c);
}

criterion::criterion_group! { name = benches; config = criterion(); targets = bench }
criterion::criterion_main!(benches);
