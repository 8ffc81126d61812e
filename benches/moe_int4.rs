//! MoE with INT4 experts at full Kimi-K2 dimensions (H 7168, I 2048, 384 experts resident, top-8) for
//! T 1..256 tokens. Ids are `moe_int4/<row>/t<T>` (`moe_int4_tiled/...` when built with `int4-tiled`):
//! - `gpu_experts`: the two grouped GEMMs and the combine for a routing already on the device;
//! - `gpu_step`: routing + alignment + the same;
//! - `cublas_bf16`: the baseline a user would otherwise pick, the same experts dequantized to bf16 and
//!   run through cuBLAS, one GEMM for gate/up and one for down per active expert. Only the GEMMs are
//!   timed (no gather, activation or combine), so this is a lower bound on that path's time;
//! - `cpu`: the Rust reference (T 1, 4, 16).
//!
//! The GPU rows' throughput is the bytes of the distinct experts the routing touches (packed weights
//! plus scales), the figure compared with the device-to-device copy bandwidth of the same run.

mod common;

use common::criterion;
use criterion::Criterion;

#[cfg(feature = "cuda")]
mod kimi {
    use criterion::{BenchmarkGroup, BenchmarkId, Criterion, Throughput};
    use cudarc::cublas::{sys::cublasOperation_t, CudaBlas, Gemm, GemmConfig};
    use cudarc::driver::{CudaSlice, CudaView};
    use half::bf16;
    use kdtree_engine::cpu::moe_int4::{moe_int4, Experts, Int4Matrix, Routing};
    use kdtree_engine::cuda::moe_int4::{
        dequantize_native, random_native, DeviceExperts, DeviceInt4, ExpertsShape, Int4Layout, MoePlan, LAYOUT,
    };
    use kdtree_engine::cuda::Gpu;

    use crate::common::gpu::{bench_copy, time, time_direct};
    use crate::common::random_logits;

    const SHAPE: ExpertsShape = ExpertsShape { count: 384, hidden: 7168, inter: 2048 };
    const K: usize = 8;
    const SCALING: f64 = 2.827;
    const TOKENS: [usize; 8] = [1, 4, 8, 16, 32, 64, 128, 256];
    const CPU_TOKENS: [usize; 3] = [1, 4, 16];

    /// The layer in every form the rows need.
    struct Layer {
        experts: DeviceExperts,
        w13_bf16: CudaSlice<bf16>,
        w2_bf16: CudaSlice<bf16>,
        host: HostLayer,
    }

    /// Checkpoint-order copies for the CPU rows.
    struct HostLayer {
        w13: (Vec<i32>, Vec<bf16>),
        w2: (Vec<i32>, Vec<bf16>),
    }

    impl HostLayer {
        fn experts(&self) -> Experts<'_> {
            let (h, i, e) = (SHAPE.hidden, SHAPE.inter, SHAPE.count);
            Experts {
                count: e,
                hidden: h,
                inter: i,
                w13: Int4Matrix { packed: &self.w13.0, scale: &self.w13.1, rows: e * 2 * i, cols: h },
                w2: Int4Matrix { packed: &self.w2.0, scale: &self.w2.1, rows: e * h, cols: i },
            }
        }
    }

    fn layer(gpu: &Gpu) -> Layer {
        let (h, i, e) = (SHAPE.hidden, SHAPE.inter, SHAPE.count);
        // Scales near what 0.02-std bf16 weights quantize to (max|w| / 7).
        let scales = (0.004, 0.012);
        let (w13p, w13s) = random_native(gpu, e * 2 * i, h, 1, scales).unwrap();
        let (w2p, w2s) = random_native(gpu, e * h, i, 2, scales).unwrap();
        let w13_bf16 = dequantize_native(gpu, &w13p, &w13s).unwrap();
        let w2_bf16 = dequantize_native(gpu, &w2p, &w2s).unwrap();
        let host = HostLayer {
            w13: (gpu.download(&w13p).unwrap(), gpu.download(&w13s).unwrap()),
            w2: (gpu.download(&w2p).unwrap(), gpu.download(&w2s).unwrap()),
        };
        let w13 = DeviceInt4::from_native(gpu, w13p, w13s, e * 2 * i, h).unwrap();
        let w2 = DeviceInt4::from_native(gpu, w2p, w2s, e * h, i).unwrap();
        Layer { experts: DeviceExperts::new(SHAPE, w13, w2).unwrap(), w13_bf16, w2_bf16, host }
    }

    /// Device inputs of one token count, with the routing already computed by the plan.
    struct Batch {
        tokens: usize,
        x: CudaSlice<bf16>,
        logits: CudaSlice<f32>,
        bias: CudaSlice<f32>,
        plan: MoePlan,
        out: CudaSlice<f32>,
        routing: Routing,
        host_x: Vec<bf16>,
    }

    fn batch(gpu: &Gpu, tokens: usize) -> Batch {
        let host_x: Vec<bf16> =
            random_logits(tokens * SHAPE.hidden, SHAPE.hidden, 7).into_iter().map(bf16::from_f32).collect();
        let logits = random_logits(tokens * SHAPE.count, SHAPE.count, 11 + tokens as u64);
        let bias: Vec<f32> = random_logits(SHAPE.count, SHAPE.count, 5).iter().map(|b| b * 0.01).collect();
        let (x, logits, bias) =
            (gpu.upload(&host_x).unwrap(), gpu.upload(&logits).unwrap(), gpu.upload(&bias).unwrap());
        let mut plan = MoePlan::new(gpu, SHAPE, K, tokens).unwrap();
        plan.route(gpu, &logits.as_view(), &bias.as_view(), SCALING, tokens).unwrap();
        plan.check_status(gpu).unwrap();
        let routing = plan.routing(gpu).unwrap();
        let out = gpu.zeros::<f32>(tokens * SHAPE.hidden).unwrap();
        Batch { tokens, x, logits, bias, plan, out, routing, host_x }
    }

    /// Bytes of the distinct experts the routing touches.
    fn touched_bytes(routing: &Routing) -> u64 {
        let active = routing.expert_offsets.windows(2).filter(|w| w[1] > w[0]).count();
        (active * SHAPE.bytes_per_expert()) as u64
    }

    pub fn bench(c: &mut Criterion) {
        let Some(gpu) = crate::common::gpu::open() else { return };
        // One group per layout, so that the two builds' results sit side by side.
        let name = match LAYOUT {
            Int4Layout::Native => "moe_int4",
            Int4Layout::Tiled => "moe_int4_tiled",
        };
        bench_copy(c, &gpu, name);
        let layer = layer(&gpu);
        let blas = CudaBlas::new(gpu.stream().clone()).expect("cuBLAS loads");
        let mut group = c.benchmark_group(name);
        group.sampling_mode(criterion::SamplingMode::Flat);
        for tokens in TOKENS {
            let mut b = batch(&gpu, tokens);
            group.throughput(Throughput::Bytes(touched_bytes(&b.routing)));
            bench_gpu_rows(&mut group, &gpu, &layer, &mut b);
            bench_cublas(&mut group, &gpu, &blas, &layer, &b);
            // The CPU reference does not depend on the layout: its rows come with the native build only.
            if LAYOUT == Int4Layout::Native && CPU_TOKENS.contains(&tokens) {
                let experts = layer.host.experts();
                group.bench_function(BenchmarkId::new("cpu", format!("t{tokens}")), |bench| {
                    bench.iter(|| moe_int4(&b.host_x, &b.routing, &experts).unwrap())
                });
            }
        }
        group.finish();
    }

    fn bench_gpu_rows(
        group: &mut BenchmarkGroup<criterion::measurement::WallTime>,
        gpu: &Gpu,
        layer: &Layer,
        b: &mut Batch,
    ) {
        let id = format!("t{}", b.tokens);
        let Batch { x, logits, bias, plan, out, tokens, .. } = b;
        group.bench_function(BenchmarkId::new("gpu_experts", &id), |bench| {
            bench.iter_custom(|iters| {
                time(gpu, iters, || {
                    plan.experts_forward(gpu, &layer.experts, &x.as_view(), &mut out.as_view_mut()).unwrap()
                })
            })
        });
        group.bench_function(BenchmarkId::new("gpu_step", &id), |bench| {
            bench.iter_custom(|iters| {
                time(gpu, iters, || {
                    plan.route(gpu, &logits.as_view(), &bias.as_view(), SCALING, *tokens).unwrap();
                    plan.experts_forward(gpu, &layer.experts, &x.as_view(), &mut out.as_view_mut()).unwrap()
                })
            })
        });
    }

    /// Per active expert: its tokens' rows gathered (outside the timing), the gate/up and down outputs.
    struct ExpertGemm {
        expert: usize,
        rows: usize,
        x: CudaSlice<bf16>,
        gate_up: CudaSlice<bf16>,
        act: CudaSlice<bf16>,
        y: CudaSlice<bf16>,
    }

    fn bench_cublas(
        group: &mut BenchmarkGroup<criterion::measurement::WallTime>,
        gpu: &Gpu,
        blas: &CudaBlas,
        layer: &Layer,
        b: &Batch,
    ) {
        let (h, i) = (SHAPE.hidden, SHAPE.inter);
        let offsets = &b.routing.expert_offsets;
        let mut gemms: Vec<ExpertGemm> = (0..SHAPE.count)
            .filter(|&e| offsets[e + 1] > offsets[e])
            .map(|e| {
                let pairs = &b.routing.sorted_pairs[offsets[e] as usize..offsets[e + 1] as usize];
                let rows: Vec<bf16> = pairs
                    .iter()
                    .flat_map(|&p| b.host_x[(p as usize / K) * h..(p as usize / K + 1) * h].to_vec())
                    .collect();
                ExpertGemm {
                    expert: e,
                    rows: pairs.len(),
                    x: gpu.upload(&rows).unwrap(),
                    gate_up: gpu.zeros(pairs.len() * 2 * i).unwrap(),
                    act: gpu.zeros(pairs.len() * i).unwrap(),
                    y: gpu.zeros(pairs.len() * h).unwrap(),
                }
            })
            .collect();
        group.bench_function(BenchmarkId::new("cublas_bf16", format!("t{}", b.tokens)), |bench| {
            bench.iter_custom(|iters| {
                time_direct(gpu, iters, || {
                    for g in gemms.iter_mut() {
                        let w13 = layer.w13_bf16.slice(g.expert * 2 * i * h..(g.expert + 1) * 2 * i * h);
                        let w2 = layer.w2_bf16.slice(g.expert * h * i..(g.expert + 1) * h * i);
                        row_major_gemm(blas, &w13, &g.x, &mut g.gate_up, 2 * i, g.rows, h);
                        row_major_gemm(blas, &w2, &g.act, &mut g.y, h, g.rows, i);
                    }
                })
            })
        });
    }

    /// `c [n, m] = a_rows [n, k] · w [m, k]ᵀ`, all row-major bf16 (f32 accumulate): in cuBLAS's
    /// column-major terms, `c = wᵀ · a` with w transposed.
    fn row_major_gemm(
        blas: &CudaBlas,
        w: &CudaView<bf16>,
        a_rows: &CudaSlice<bf16>,
        c: &mut CudaSlice<bf16>,
        m: usize,
        n: usize,
        k: usize,
    ) {
        let cfg = GemmConfig {
            transa: cublasOperation_t::CUBLAS_OP_T,
            transb: cublasOperation_t::CUBLAS_OP_N,
            m: m as i32,
            n: n as i32,
            k: k as i32,
            alpha: bf16::ONE,
            lda: k as i32,
            ldb: k as i32,
            beta: bf16::ZERO,
            ldc: m as i32,
        };
        unsafe { blas.gemm(cfg, w, a_rows, c) }.expect("cuBLAS gemm");
    }
}

fn bench(c: &mut Criterion) {
    #[cfg(feature = "cuda")]
    kimi::bench(c);
    #[cfg(not(feature = "cuda"))]
    let _ = c;
}

criterion::criterion_group! { name = benches; config = criterion(); targets = bench }
criterion::criterion_main!(benches);
