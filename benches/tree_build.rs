//! Tree build from top-K: CPU reference vs CUDA at bs 1..64, B 16/64/256, L 15. The inputs are real
//! top-K outputs of drafter-like logits. Ids are `tree_build/<backend>/bs<bs>_b<B>`.

mod common;

use common::{criterion, random_logits, BATCHES, BUDGETS, DEPTH};
use criterion::{BenchmarkId, Criterion};
use kdtree_engine::cpu::topk::topk_logsumexp;
use kdtree_engine::cpu::tree_build::build_trees;
use kdtree_engine::{Logits, TopK, TreeShape};

/// Vocabulary of the synthetic drafter logits; the build's cost does not depend on it.
const VOCAB: usize = 4096;

fn top_k(budget: usize) -> TopK {
    let bs = BATCHES[BATCHES.len() - 1];
    let logits = random_logits(bs * DEPTH * VOCAB, VOCAB, 2);
    topk_logsumexp(Logits::F32(&logits), bs, DEPTH, VOCAB, budget).unwrap()
}

fn bench(c: &mut Criterion) {
    #[cfg(feature = "cuda")]
    let gpu = common::gpu::open();
    let mut group = c.benchmark_group("tree_build");
    group.sampling_mode(criterion::SamplingMode::Flat);
    for budget in BUDGETS {
        let top = top_k(budget);
        let lk = DEPTH * budget;
        for bs in BATCHES {
            let shape = TreeShape::new(bs, DEPTH, budget).unwrap();
            let (ids, logp) = (&top.ids[..bs * lk], &top.logp[..bs * lk]);
            let (root, seq) = (vec![1; bs], vec![4096; bs]);
            let id = format!("bs{bs}_b{budget}");
            group.bench_function(BenchmarkId::new("cpu", &id), |b| {
                b.iter(|| build_trees(shape, budget, ids, logp, &root, &seq).unwrap())
            });
            #[cfg(feature = "cuda")]
            if let Some(gpu) = &gpu {
                use kdtree_engine::cuda::tree_build::{build_trees as gpu_build, DeviceTree};
                let (d_ids, d_logp) = (gpu.upload(ids).unwrap(), gpu.upload(logp).unwrap());
                let (d_root, d_seq) = (gpu.upload(&root).unwrap(), gpu.upload(&seq).unwrap());
                let mut out = DeviceTree::alloc(gpu, shape).unwrap();
                group.bench_function(BenchmarkId::new("gpu", &id), |b| {
                    b.iter_custom(|iters| {
                        common::gpu::time(gpu, iters, || {
                            gpu_build(gpu, budget, &d_ids, &d_logp, &d_root, &d_seq, &mut out).unwrap()
                        })
                    })
                });
            }
        }
    }
    group.finish();
}

criterion::criterion_group! { name = benches; config = criterion(); targets = bench }
criterion::criterion_main!(benches);
