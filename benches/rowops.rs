//! The per-row operations of a step at Kimi-K2 dimensions (hidden 7168, MoE intermediate 2048, vocab
//! 163840): CPU backend vs CUDA backend at T 1, 32 and 520 rows. Ids are `rowops/<backend>/<op>_t<T>`;
//! the GPU rows are timed from a CUDA graph of repeated launches, so they show each launch's cost in a
//! replayed step.

mod common;

use common::criterion;
use criterion::{BenchmarkId, Criterion};
use half::bf16;
use kdtree_engine::cpu::backend::CpuBackend;
use kdtree_engine::model::backend::{Backend, KvWrite};

const HIDDEN: usize = 7168;
const INTER: usize = 2048;
const VOCAB: usize = 163_840;
const ROWS: [usize; 3] = [1, 32, 520];

/// The buffers of one row count, on backend `B`.
struct Inputs<B: Backend> {
    x: B::Buf<f32>,
    w: B::Buf<f32>,
    y: B::Buf<f32>,
    gu: B::Buf<f32>,
    act: B::Buf<f32>,
    kv: B::Buf<f32>,
    norm_w: B::Buf<f32>,
    table: B::Buf<f32>,
    slot: B::Buf<i32>,
    cache: B::Buf<bf16>,
    logits: B::Buf<f32>,
    ids: B::Buf<i32>,
}

impl<B: Backend> Inputs<B> {
    fn new(b: &B, t: usize) -> Self {
        let ramp = |n: usize| (0..n).map(|i| ((i * 2_654_435_761) % 1000) as f32 / 500.0 - 1.0).collect::<Vec<_>>();
        Inputs {
            x: b.upload(&ramp(t * HIDDEN)).unwrap(),
            w: b.upload(&ramp(HIDDEN)).unwrap(),
            y: b.zeros(t * HIDDEN).unwrap(),
            gu: b.upload(&ramp(t * 2 * INTER)).unwrap(),
            act: b.zeros(t * INTER).unwrap(),
            kv: b.upload(&ramp(t * 576)).unwrap(),
            norm_w: b.upload(&ramp(512)).unwrap(),
            table: b.upload(&ramp(t * 64)).unwrap(),
            slot: b.upload(&(0..t as i32).collect::<Vec<_>>()).unwrap(),
            cache: b.zeros(t * 576).unwrap(),
            logits: b.upload(&ramp(t * VOCAB)).unwrap(),
            ids: b.zeros(t).unwrap(),
        }
    }

    /// Runs op `op` once.
    fn run(&mut self, b: &B, op: &str, t: usize) {
        match op {
            "rmsnorm" => b.rmsnorm(&self.x, HIDDEN, &self.w, 1e-6, t, &mut self.y, HIDDEN).unwrap(),
            "silu_mul" => b.silu_mul(&self.gu, INTER, t, &mut self.act).unwrap(),
            "kv_rows" => {
                let write = KvWrite {
                    kv: &self.kv,
                    norm_w: &self.norm_w,
                    eps: 1e-6,
                    table: &self.table,
                    interleave: true,
                    slot: &self.slot,
                };
                b.kv_rows(&write, t, &mut self.cache).unwrap()
            }
            "argmax" => b.argmax(&self.logits, VOCAB, t, &mut self.ids).unwrap(),
            _ => unreachable!("op {op}"),
        }
    }
}

const OPS: [&str; 4] = ["rmsnorm", "silu_mul", "kv_rows", "argmax"];

fn bench(c: &mut Criterion) {
    #[cfg(feature = "cuda")]
    let gpu = common::gpu::open().map(|g| kdtree_engine::cuda::backend::CudaBackend::new(g).unwrap());
    let mut group = c.benchmark_group("rowops");
    group.sampling_mode(criterion::SamplingMode::Flat);
    for t in ROWS {
        let mut cpu = Inputs::new(&CpuBackend, t);
        #[cfg(feature = "cuda")]
        let mut dev = gpu.as_ref().map(|g| Inputs::new(g, t));
        for op in OPS {
            let id = format!("{op}_t{t}");
            group.bench_function(BenchmarkId::new("cpu", &id), |b| b.iter(|| cpu.run(&CpuBackend, op, t)));
            #[cfg(feature = "cuda")]
            if let (Some(g), Some(dev)) = (&gpu, dev.as_mut()) {
                // Once outside the timed graphs: the backend sizes its scratch (the argmax keys) on first
                // use, which a graph capture must not do.
                dev.run(g, op, t);
                group.bench_function(BenchmarkId::new("gpu", &id), |b| {
                    b.iter_custom(|iters| common::gpu::time(g.gpu(), iters, || dev.run(g, op, t)))
                });
            }
        }
    }
    group.finish();
}

criterion::criterion_group! { name = benches; config = criterion(); targets = bench }
criterion::criterion_main!(benches);
