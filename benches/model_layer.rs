//! One real-size Kimi-K2 MoE decoder layer on the device, random weights: MLA (q_lora 1536, kv_lora 512,
//! nope 128, rope 64, v 128) with 8 or 64 heads, 384 INT4 routed experts (top-8, I 2048) and one shared
//! expert, for a decode step (one token per request over a prefix of 4096) and a tree-verify step (N 65
//! rows per request over the same prefix), bs 1, 8, 32. Also the pieces the 61-layer projection needs:
//! the dense MLP of the first layer (I 18432) and the lm_head (V 163840).
//!
//! Ids are `model_layer/<decode|verify>_h<H>_bs<bs>/<part>`:
//! - `attn`: q_a, q_b, kv_a, the per-head absorption of q_nope into the latent space, the MLA kernel,
//!   the per-head value rows, o_proj (every dense product through kernels/gemm_bf16.cu);
//! - `moe`: router, routing + alignment, the INT4 experts;
//! - `shared_expert`: gate and up stacked in one weight, then down;
//! - `elementwise`: stand-ins for the 9 element-wise passes of a layer (3 RMSNorms, 2 RoPE + bf16 packs,
//!   the residual adds, SiLU·up, the bf16 copy of the MoE input), each timed as a device-to-device copy of
//!   its activation tensor (the same bytes through memory), since the device-resident versions of those
//!   passes do not exist yet;
//! - `layer`: all of the above in order, in one graph.
//!
//! and `model_layer/dense_mlp/t<T>`, `model_layer/lm_head/t<T>` for T = the step's tokens.
//! Weights are random INT4 values times random scales dequantized to bf16 (so the router sends the
//! tokens to varied experts); the dense MLP's and lm_head's weights are zeros (their timing does not
//! depend on the values, and generating 2.4 GB of values would).

mod common;

use common::criterion;
use criterion::Criterion;

#[cfg(feature = "cuda")]
mod kimi {
    use criterion::{BenchmarkGroup, BenchmarkId, Criterion};
    use cudarc::driver::CudaSlice;
    use half::bf16;
    use kdtree_engine::cuda::gemm_bf16::{DeviceWeight, GemmPlan, Strides};
    use kdtree_engine::cuda::mla::{DeviceCache, DeviceMlaOutput, MlaPlan};
    use kdtree_engine::cuda::moe_int4::{
        dequantize_native, random_native, DeviceExperts, DeviceInt4, ExpertsShape, MoePlan,
    };
    use kdtree_engine::cuda::Gpu;
    use kdtree_engine::KvLayout;

    use std::time::Duration;

    use crate::common::gpu::{time, time_direct};
    use crate::common::heap_visibility;

    const HIDDEN: usize = 7168;
    const Q_LORA: usize = 1536;
    const LATENT: usize = 512;
    const NOPE: usize = 128;
    const ROPE: usize = 64;
    const QK: usize = NOPE + ROPE;
    const ROW: usize = LATENT + ROPE;
    const V_HEAD: usize = 128;
    const EXPERTS: ExpertsShape = ExpertsShape { count: 384, hidden: HIDDEN, inter: 2048 };
    const TOP_K: usize = 8;
    const SCALING: f64 = 2.827;
    const DENSE_INTER: usize = 18_432;
    const VOCAB: usize = 163_840;
    const PREFIX: usize = 4096;
    const TREE_ROWS: usize = 65;
    const PAGE: usize = 64;
    const HEADS: [usize; 2] = [8, 64];
    const BATCHES: [usize; 3] = [1, 8, 32];
    /// Kimi-K2's softmax scale with YaRN mscale (any finite value times the same).
    const SCALE: f32 = 0.1353;

    /// A random bf16 weight `[batch, out, inp]` made on the device.
    fn random_weight(gpu: &Gpu, batch: usize, out: usize, inp: usize, seed: u64) -> DeviceWeight {
        let (packed, scale) = random_native(gpu, batch * out, inp, seed, (0.002, 0.006)).unwrap();
        DeviceWeight::from_device(dequantize_native(gpu, &packed, &scale).unwrap(), batch, out, inp).unwrap()
    }

    fn zero_weight(gpu: &Gpu, out: usize, inp: usize) -> DeviceWeight {
        DeviceWeight::from_device(gpu.zeros(out * inp).unwrap(), 1, out, inp).unwrap()
    }

    /// The weights that do not depend on the head count.
    struct Shared {
        q_a: DeviceWeight,
        kv_a: DeviceWeight,
        router: DeviceWeight,
        bias: CudaSlice<f32>,
        experts: DeviceExperts,
        shared_gate_up: DeviceWeight,
        shared_down: DeviceWeight,
    }

    impl Shared {
        fn new(gpu: &Gpu) -> Shared {
            let (e, h, i) = (EXPERTS.count, EXPERTS.hidden, EXPERTS.inter);
            let scales = (0.004, 0.012);
            let (w13p, w13s) = random_native(gpu, e * 2 * i, h, 1, scales).unwrap();
            let (w2p, w2s) = random_native(gpu, e * h, i, 2, scales).unwrap();
            let w13 = DeviceInt4::from_native(gpu, w13p, w13s, e * 2 * i, h).unwrap();
            let w2 = DeviceInt4::from_native(gpu, w2p, w2s, e * h, i).unwrap();
            Shared {
                q_a: random_weight(gpu, 1, Q_LORA, HIDDEN, 3),
                kv_a: random_weight(gpu, 1, ROW, HIDDEN, 4),
                router: random_weight(gpu, 1, e, HIDDEN, 5),
                bias: gpu.zeros(e).unwrap(),
                experts: DeviceExperts::new(EXPERTS, w13, w2).unwrap(),
                shared_gate_up: random_weight(gpu, 1, 2 * i, HIDDEN, 6),
                shared_down: random_weight(gpu, 1, HIDDEN, i, 7),
            }
        }
    }

    /// The head-count dependent weights.
    struct Attn {
        heads: usize,
        q_b: DeviceWeight,
        absorb: DeviceWeight,
        values: DeviceWeight,
        o_proj: DeviceWeight,
    }

    impl Attn {
        fn new(gpu: &Gpu, heads: usize) -> Attn {
            Attn {
                heads,
                q_b: random_weight(gpu, 1, heads * QK, Q_LORA, 8),
                absorb: random_weight(gpu, heads, LATENT, NOPE, 9),
                values: random_weight(gpu, heads, V_HEAD, LATENT, 10),
                o_proj: random_weight(gpu, 1, HIDDEN, heads * V_HEAD, 11),
            }
        }
    }

    /// Activations, cache and plans of one step shape.
    struct Step {
        bs: usize,
        rows: usize,
        tokens: usize,
        x: CudaSlice<f32>,
        x16: CudaSlice<bf16>,
        qa: CudaSlice<f32>,
        q: CudaSlice<f32>,
        kv: CudaSlice<f32>,
        q_lat: CudaSlice<f32>,
        q_rows: CudaSlice<bf16>,
        o_lat: CudaSlice<f32>,
        lse: CudaSlice<f32>,
        attn_v: CudaSlice<f32>,
        y: CudaSlice<f32>,
        logits: CudaSlice<f32>,
        moe_out: CudaSlice<f32>,
        gate_up: CudaSlice<f32>,
        act: CudaSlice<f32>,
        cache: CudaSlice<bf16>,
        table: CudaSlice<i32>,
        seq: CudaSlice<i32>,
        visibility: CudaSlice<u32>,
        layout: KvLayout,
        max_seq_len: usize,
        gemm: GemmPlan,
        mla: MlaPlan,
        moe: MoePlan,
        ew_src: CudaSlice<f32>,
        ew_dst: CudaSlice<f32>,
    }

    impl Step {
        fn new(gpu: &Gpu, attn: &Attn, shared: &Shared, bs: usize, rows: usize) -> Step {
            let (tokens, heads) = (bs * rows, attn.heads);
            // A decode step attends over the prefix and its own new row; a verify step over the prefix and
            // its visible tree rows.
            let max_seq_len = PREFIX + rows;
            let pages_per_req = max_seq_len.div_ceil(PAGE);
            let layout =
                KvLayout { layers: 1, num_pages: bs * pages_per_req, page_size: PAGE, row_elems: ROW, pages_per_req };
            let seq_len = if rows == 1 { PREFIX + 1 } else { PREFIX };
            let x_host: Vec<f32> =
                (0..tokens * HIDDEN).map(|i| ((i * 2_654_435_761) % 2001) as f32 / 1000.0 - 1.0).collect();
            let weights =
                [&shared.q_a, &attn.q_b, &shared.kv_a, &attn.absorb, &attn.values, &attn.o_proj, &shared.router];
            let weights = [&weights[..], &[&shared.shared_gate_up, &shared.shared_down]].concat();
            let ew = tokens * HIDDEN.max(heads * ROW);
            Step {
                bs,
                rows,
                tokens,
                x: gpu.upload(&x_host).unwrap(),
                x16: gpu.upload(&x_host.iter().map(|&v| bf16::from_f32(v)).collect::<Vec<_>>()).unwrap(),
                qa: gpu.zeros(tokens * Q_LORA).unwrap(),
                q: gpu.zeros(tokens * heads * QK).unwrap(),
                kv: gpu.zeros(tokens * ROW).unwrap(),
                q_lat: gpu.zeros(tokens * heads * LATENT).unwrap(),
                q_rows: gpu.zeros(tokens * heads * ROW).unwrap(),
                o_lat: gpu.zeros(tokens * heads * LATENT).unwrap(),
                lse: gpu.zeros(tokens * heads).unwrap(),
                attn_v: gpu.zeros(tokens * heads * V_HEAD).unwrap(),
                y: gpu.zeros(tokens * HIDDEN).unwrap(),
                logits: gpu.zeros(tokens * EXPERTS.count).unwrap(),
                moe_out: gpu.zeros(tokens * HIDDEN).unwrap(),
                gate_up: gpu.zeros(tokens * 2 * EXPERTS.inter).unwrap(),
                act: gpu.zeros(tokens * EXPERTS.inter).unwrap(),
                cache: gpu.zeros(layout.num_pages * PAGE * ROW).unwrap(),
                table: gpu.upload(&(0..layout.num_pages as i32).collect::<Vec<_>>()).unwrap(),
                seq: gpu.upload(&vec![seq_len as i32; bs]).unwrap(),
                visibility: gpu.upload(&heap_visibility(bs, rows)).unwrap(),
                layout,
                max_seq_len,
                gemm: GemmPlan::new(gpu, tokens, &weights).unwrap(),
                mla: MlaPlan::new(gpu, bs, heads, max_seq_len, rows).unwrap(),
                moe: MoePlan::new(gpu, EXPERTS, TOP_K, tokens).unwrap(),
                ew_src: gpu.zeros(ew).unwrap(),
                ew_dst: gpu.zeros(ew).unwrap(),
            }
        }

        fn attention(&mut self, gpu: &Gpu, attn: &Attn, shared: &Shared) {
            let (t, heads) = (self.tokens, attn.heads);
            dense(&mut self.gemm, gpu, &shared.q_a, &self.x, t, &mut self.qa);
            dense(&mut self.gemm, gpu, &attn.q_b, &self.qa, t, &mut self.q);
            dense(&mut self.gemm, gpu, &shared.kv_a, &self.x, t, &mut self.kv);
            let xs = Strides { row: heads * QK, batch: QK };
            let ys = Strides { row: heads * LATENT, batch: LATENT };
            self.gemm.run(gpu, &attn.absorb, &self.q.as_view(), xs, t, &mut self.q_lat.as_view_mut(), ys).unwrap();
            let cache =
                DeviceCache { rows: self.cache.as_view(), layout: self.layout, block_table: self.table.as_view() };
            let mut out = DeviceMlaOutput { o: self.o_lat.as_view_mut(), lse: self.lse.as_view_mut() };
            let (q, seq) = (self.q_rows.as_view(), self.seq.as_view());
            if self.rows == 1 {
                self.mla.run_decode(gpu, &q, &cache, &seq, self.max_seq_len, SCALE, &mut out).unwrap();
            } else {
                let vis = self.visibility.as_view();
                let (n, max) = (self.rows, self.max_seq_len);
                self.mla.run_tree_verify(gpu, &q, n, &cache, &seq, max, &vis, SCALE, &mut out).unwrap();
            }
            let xs = Strides { row: heads * LATENT, batch: LATENT };
            let ys = Strides { row: heads * V_HEAD, batch: V_HEAD };
            self.gemm.run(gpu, &attn.values, &self.o_lat.as_view(), xs, t, &mut self.attn_v.as_view_mut(), ys).unwrap();
            dense(&mut self.gemm, gpu, &attn.o_proj, &self.attn_v, t, &mut self.y);
        }

        /// Router logits, routing + alignment, the routed INT4 experts.
        fn moe(&mut self, gpu: &Gpu, shared: &Shared) {
            let t = self.tokens;
            dense(&mut self.gemm, gpu, &shared.router, &self.x, t, &mut self.logits);
            self.moe.route(gpu, &self.logits.as_view(), &shared.bias.as_view(), SCALING, t).unwrap();
            let (x16, out) = (self.x16.as_view(), &mut self.moe_out.as_view_mut());
            self.moe.experts_forward(gpu, &shared.experts, &x16, out).unwrap();
        }

        /// The shared expert: gate and up in one stacked weight, then down.
        fn shared_expert(&mut self, gpu: &Gpu, shared: &Shared) {
            let t = self.tokens;
            dense(&mut self.gemm, gpu, &shared.shared_gate_up, &self.x, t, &mut self.gate_up);
            dense(&mut self.gemm, gpu, &shared.shared_down, &self.act, t, &mut self.y);
        }

        /// The element counts of a layer's element-wise passes (see the top of the file).
        fn elementwise_sizes(&self, heads: usize) -> [usize; 9] {
            let t = self.tokens;
            [
                t * HIDDEN,        // input RMSNorm
                t * Q_LORA,        // q_a_layernorm
                t * ROW,           // kv_a_layernorm + RoPE + the cache row write
                t * heads * ROW,   // q RoPE + bf16 pack of the attention's query rows
                t * HIDDEN,        // residual add
                t * HIDDEN,        // post-attention RMSNorm
                t * HIDDEN,        // bf16 copy of the MoE input
                t * EXPERTS.inter, // SiLU(gate) · up of the shared expert
                t * HIDDEN,        // residual add of the MoE and shared outputs
            ]
        }

        fn elementwise(&mut self, gpu: &Gpu, heads: usize) {
            for n in self.elementwise_sizes(heads) {
                let src = self.ew_src.slice(..n);
                let mut dst = self.ew_dst.slice_mut(..n);
                gpu.stream().memcpy_dtod(&src, &mut dst).unwrap();
            }
        }
    }

    /// `y [t, out] = x [t, in] · wᵀ` over dense operands.
    fn dense(plan: &mut GemmPlan, gpu: &Gpu, w: &DeviceWeight, x: &CudaSlice<f32>, t: usize, y: &mut CudaSlice<f32>) {
        let (xs, ys) = (Strides::dense(w.in_features()), Strides::dense(w.out_features()));
        plan.run(gpu, w, &x.as_view(), xs, t, &mut y.as_view_mut(), ys).unwrap();
    }

    type Group<'a> = BenchmarkGroup<'a, criterion::measurement::WallTime>;

    /// Graph replay for steps short enough that host launch overhead would show, direct launches for the
    /// rest (a graph of 20 such steps would take seconds to capture and replay).
    fn timer(tokens: usize) -> fn(&Gpu, u64, &mut dyn FnMut()) -> Duration {
        if tokens <= TREE_ROWS {
            |gpu, iters, f| time(gpu, iters, f)
        } else {
            |gpu, iters, f| time_direct(gpu, iters, f)
        }
    }

    fn bench_step(group: &mut Group, gpu: &Gpu, attn: &Attn, shared: &Shared, step: &mut Step) {
        let time = timer(step.tokens);
        let mode = if step.rows == 1 { "decode" } else { "verify" };
        let id = format!("{mode}_h{}_bs{}", attn.heads, step.bs);
        let heads = attn.heads;
        group.bench_function(BenchmarkId::new(&id, "attn"), |b| {
            b.iter_custom(|iters| time(gpu, iters, &mut || step.attention(gpu, attn, shared)))
        });
        group.bench_function(BenchmarkId::new(&id, "moe"), |b| {
            b.iter_custom(|iters| time(gpu, iters, &mut || step.moe(gpu, shared)))
        });
        group.bench_function(BenchmarkId::new(&id, "shared_expert"), |b| {
            b.iter_custom(|iters| time(gpu, iters, &mut || step.shared_expert(gpu, shared)))
        });
        group.bench_function(BenchmarkId::new(&id, "elementwise"), |b| {
            b.iter_custom(|iters| time(gpu, iters, &mut || step.elementwise(gpu, heads)))
        });
        group.bench_function(BenchmarkId::new(&id, "layer"), |b| {
            b.iter_custom(|iters| {
                time(gpu, iters, &mut || {
                    step.elementwise(gpu, heads);
                    step.attention(gpu, attn, shared);
                    step.moe(gpu, shared);
                    step.shared_expert(gpu, shared);
                })
            })
        });
    }

    /// The dense MLP of the first layer and the lm_head at the token counts of the steps.
    fn bench_dense(group: &mut Group, gpu: &Gpu) {
        let gate_up = zero_weight(gpu, 2 * DENSE_INTER, HIDDEN);
        let down = zero_weight(gpu, HIDDEN, DENSE_INTER);
        let head = zero_weight(gpu, VOCAB, HIDDEN);
        let mut token_counts: Vec<usize> = BATCHES.iter().flat_map(|&bs| [bs, bs * TREE_ROWS]).collect();
        token_counts.sort_unstable();
        for t in token_counts {
            let mut plan = GemmPlan::new(gpu, t, &[&gate_up, &down, &head]).unwrap();
            let x = gpu.zeros::<f32>(t * DENSE_INTER).unwrap();
            let mut h = gpu.zeros::<f32>(t * 2 * DENSE_INTER).unwrap();
            let mut y = gpu.zeros::<f32>(t * VOCAB).unwrap();
            group.bench_function(BenchmarkId::new("dense_mlp", format!("t{t}")), |b| {
                b.iter_custom(|iters| {
                    time_direct(gpu, iters, || {
                        let (xs, hs) = (Strides::dense(HIDDEN), Strides::dense(2 * DENSE_INTER));
                        plan.run(gpu, &gate_up, &x.as_view(), xs, t, &mut h.as_view_mut(), hs).unwrap();
                        let (xs, ys) = (Strides::dense(DENSE_INTER), Strides::dense(HIDDEN));
                        plan.run(gpu, &down, &x.as_view(), xs, t, &mut y.as_view_mut(), ys).unwrap();
                    })
                })
            });
            group.bench_function(BenchmarkId::new("lm_head", format!("t{t}")), |b| {
                b.iter_custom(|iters| {
                    time_direct(gpu, iters, || {
                        let (xs, ys) = (Strides::dense(HIDDEN), Strides::dense(VOCAB));
                        plan.run(gpu, &head, &x.as_view(), xs, t, &mut y.as_view_mut(), ys).unwrap();
                    })
                })
            });
        }
    }

    pub fn bench(c: &mut Criterion) {
        let Some(gpu) = crate::common::gpu::open() else { return };
        crate::common::gpu::bench_copy(c, &gpu, "model_layer");
        let shared = Shared::new(&gpu);
        let mut group = c.benchmark_group("model_layer");
        group.sampling_mode(criterion::SamplingMode::Flat);
        for heads in HEADS {
            let attn = Attn::new(&gpu, heads);
            for rows in [1, TREE_ROWS] {
                for bs in BATCHES {
                    let mut step = Step::new(&gpu, &attn, &shared, bs, rows);
                    bench_step(&mut group, &gpu, &attn, &shared, &mut step);
                }
            }
        }
        bench_dense(&mut group, &gpu);
        group.finish();
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
