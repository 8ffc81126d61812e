//! Top-K with logsumexp: CPU reference vs CUDA at bs 1..64, B 16/64/256, L 15, V 163840 and 32000.
//! Benchmark ids are `topk/<backend>_<dtype>/bs<bs>_b<B>_v<V>`; benches/report.py turns them into tables.

mod common;

use common::{criterion, random_logits, BATCHES, BUDGETS, DEPTH, VOCABS};
use criterion::{BenchmarkId, Criterion};
use kdtree_engine::cpu::topk::topk_logsumexp;
use kdtree_engine::types::top_k_for;
use kdtree_engine::Logits;

fn bench(c: &mut Criterion) {
    #[cfg(feature = "cuda")]
    let gpu = common::gpu::open();
    #[cfg(feature = "cuda")]
    if let Some(gpu) = &gpu {
        common::gpu::bench_copy(c, gpu, "topk");
    }
    let mut group = c.benchmark_group("topk");
    group.sampling_mode(criterion::SamplingMode::Flat);
    for vocab in VOCABS {
        let max_rows = BATCHES[BATCHES.len() - 1] * DEPTH;
        let host = random_logits(max_rows * vocab, vocab, 1);
        #[cfg(feature = "cuda")]
        let dev = gpu.as_ref().map(|g| {
            let host_bf16: Vec<half::bf16> = host.iter().map(|&x| half::bf16::from_f32(x)).collect();
            (g.upload(&host).unwrap(), g.upload(&host_bf16).unwrap())
        });
        for bs in BATCHES {
            for budget in BUDGETS {
                let (k, rows) = (top_k_for(budget, vocab, None), bs * DEPTH);
                let id = format!("bs{bs}_b{budget}_v{vocab}");
                let x = &host[..rows * vocab];
                group.bench_function(BenchmarkId::new("cpu_f32", &id), |b| {
                    b.iter(|| topk_logsumexp(Logits::F32(x), bs, DEPTH, vocab, k).unwrap())
                });
                #[cfg(feature = "cuda")]
                if let (Some(gpu), Some((f32_dev, bf16_dev))) = (&gpu, &dev) {
                    use kdtree_engine::cuda::topk::TopKPlan;
                    use kdtree_engine::cuda::DeviceLogits;
                    let mut plan = TopKPlan::new(gpu, rows, vocab, k).unwrap();
                    let mut out = plan.alloc_output(gpu).unwrap();
                    let n = rows * vocab;
                    for (name, logits) in [
                        ("gpu_f32", DeviceLogits::F32(f32_dev.slice(..n))),
                        ("gpu_bf16", DeviceLogits::Bf16(bf16_dev.slice(..n))),
                    ] {
                        group.bench_function(BenchmarkId::new(name, &id), |b| {
                            b.iter_custom(|iters| {
                                common::gpu::time(gpu, iters, || plan.run(gpu, &logits, rows, &mut out).unwrap())
                            })
                        });
                    }
                }
            }
        }
    }
    group.finish();
}

criterion::criterion_group! { name = benches; config = criterion(); targets = bench }
criterion::criterion_main!(benches);
