//! Greedy accept (target argmax over the vocabulary fused with the walk): CPU reference vs CUDA at
//! bs 1..64, B 16/64/256, L 15, V 163840 and 32000. Batches whose bs * N logits rows exceed 64 * 65
//! are skipped to bound memory. Ids are `greedy_accept/<backend>_<dtype>/bs<bs>_b<B>_v<V>`.

mod common;

use common::{criterion, random_logits, BATCHES, BUDGETS, DEPTH, VOCABS};
use criterion::{BenchmarkId, Criterion};
use kdtree_engine::cpu::greedy_accept::greedy_accept;
use kdtree_engine::cpu::topk::topk_logsumexp;
use kdtree_engine::cpu::tree_build::build_trees;
use kdtree_engine::{DraftTree, Logits, TreeShape};

/// Most target-logit rows held at once (bs 64 with N 65).
const MAX_ROWS: usize = 64 * 65;

fn trees(bs: usize, budget: usize) -> DraftTree {
    let vocab = 4096;
    let logits = random_logits(bs * DEPTH * vocab, vocab, 3);
    let top = topk_logsumexp(Logits::F32(&logits), bs, DEPTH, vocab, budget).unwrap();
    let shape = TreeShape::new(bs, DEPTH, budget).unwrap();
    build_trees(shape, budget, &top.ids, &top.logp, &vec![1; bs], &vec![4096; bs]).unwrap()
}

fn bench(c: &mut Criterion) {
    #[cfg(feature = "cuda")]
    let gpu = common::gpu::open();
    #[cfg(feature = "cuda")]
    if let Some(gpu) = &gpu {
        common::gpu::bench_copy(c, gpu, "greedy_accept");
    }
    let mut group = c.benchmark_group("greedy_accept");
    group.sampling_mode(criterion::SamplingMode::Flat);
    for vocab in VOCABS {
        let host = random_logits(MAX_ROWS * vocab, vocab, 4);
        #[cfg(feature = "cuda")]
        let dev = gpu.as_ref().map(|g| {
            let host_bf16: Vec<half::bf16> = host.iter().map(|&x| half::bf16::from_f32(x)).collect();
            (g.upload(&host).unwrap(), g.upload(&host_bf16).unwrap())
        });
        for budget in BUDGETS {
            for bs in BATCHES.into_iter().filter(|bs| bs * (budget + 1) <= MAX_ROWS) {
                let tree = trees(bs, budget);
                let n = bs * tree.shape.rows() * vocab;
                let id = format!("bs{bs}_b{budget}_v{vocab}");
                group.bench_function(BenchmarkId::new("cpu_f32", &id), |b| {
                    b.iter(|| greedy_accept(&tree, Logits::F32(&host[..n]), vocab).unwrap())
                });
                #[cfg(feature = "cuda")]
                if let (Some(gpu), Some((f32_dev, bf16_dev))) = (&gpu, &dev) {
                    use kdtree_engine::cuda::greedy_accept::{AcceptPlan, DeviceAcceptance};
                    use kdtree_engine::cuda::tree_build::DeviceTree;
                    use kdtree_engine::cuda::DeviceLogits;
                    let dev_tree = DeviceTree::upload(gpu, &tree).unwrap();
                    let mut plan = AcceptPlan::new(gpu, tree.shape, vocab).unwrap();
                    let mut out = DeviceAcceptance::alloc(gpu, tree.shape).unwrap();
                    for (name, logits) in [
                        ("gpu_f32", DeviceLogits::F32(f32_dev.slice(..n))),
                        ("gpu_bf16", DeviceLogits::Bf16(bf16_dev.slice(..n))),
                    ] {
                        group.bench_function(BenchmarkId::new(name, &id), |b| {
                            b.iter_custom(|iters| {
                                common::gpu::time(gpu, iters, || plan.run(gpu, &dev_tree, &logits, &mut out).unwrap())
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
