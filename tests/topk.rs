//! Top-K with logsumexp: CPU and GPU against the numpy fixtures (bit-exact), GPU against CPU on random
//! inputs, and bad input; the same through each backend's `Backend::topk`, the operation a model step
//! runs.

mod common;

use common::{assert_bits, assert_same, cases};
use kdtree_engine::cpu::backend::CpuBackend;
use kdtree_engine::cpu::topk::{expd, topk_logsumexp};
use kdtree_engine::fixture::Fixture;
use kdtree_engine::model::backend::Backend;
use kdtree_engine::{Error, Logits, TopK};

/// (bs, L, V, K) of a top-K fixture.
fn dims(case: &Fixture) -> (usize, usize, usize, usize) {
    let u = |k| case.usize(k).unwrap();
    (u("bs"), u("L"), u("V"), u("K"))
}

fn check_against_fixture(case: &Fixture, got: &TopK) {
    let name = case.name();
    assert_same(&name, "top_ids", &got.ids, &case.array::<i32>("top_ids").unwrap());
    assert_bits(&name, "top_logp", &got.logp, &case.array::<f32>("top_logp").unwrap());
    assert_bits(&name, "lse", &got.lse, &case.array::<f32>("lse").unwrap());
}

#[test]
fn cpu_matches_every_fixture() {
    for case in cases("topk") {
        let (bs, l, v, k) = dims(&case);
        let logits = case.logits("logits").unwrap();
        let got = topk_logsumexp(logits.view(), bs, l, v, k).unwrap();
        check_against_fixture(&case, &got);
    }
}

#[test]
fn cpu_expd_matches_the_fixture() {
    for case in cases("expd") {
        let d = case.array::<f32>("d").unwrap();
        let got: Vec<f32> = d.iter().map(|&x| expd(x)).collect();
        assert_bits(&case.name(), "expd", &got, &case.array::<f32>("expd").unwrap());
    }
}

#[test]
fn expd_is_exp_to_f32_accuracy() {
    for d in (0..31_000).map(|i| -(i as f32) * 1e-3).filter(|&d| d >= -31.0) {
        let rel = (expd(d) as f64 - (d as f64).exp()).abs() / (d as f64).exp();
        assert!(rel < 1e-6, "expd({d}) off by {rel}");
    }
    assert_eq!(expd(-31.5), 0.0);
    assert_eq!(expd(0.0), 1.0);
}

#[test]
fn bad_input_is_a_named_error() {
    let ok = vec![0.5f32; 2 * 8];
    let mut nan = ok.clone();
    nan[11] = f32::NAN;
    let mut inf = ok.clone();
    inf[3] = f32::INFINITY;
    let mut all_neg_inf = ok.clone();
    all_neg_inf[8..].fill(f32::NEG_INFINITY);
    let run = |x: &[f32], k| topk_logsumexp(Logits::F32(x), 1, 2, 8, k);
    assert!(matches!(run(&nan, 4), Err(Error::Logits { row: 1, problem: "NaN logit", .. })));
    assert!(matches!(run(&inf, 4), Err(Error::Logits { row: 0, problem: "+inf logit", .. })));
    assert!(matches!(run(&all_neg_inf, 4), Err(Error::Logits { row: 1, .. })));
    assert!(matches!(run(&ok[..15], 4), Err(Error::Shape { name: "logits", .. })));
    assert!(matches!(run(&ok, 0), Err(Error::Param { name: "k", .. })));
    assert!(matches!(run(&ok, 9), Err(Error::Param { name: "k", .. })));
    let huge = topk_logsumexp(Logits::F32(&ok), 1 << 40, 1 << 40, 8, 4);
    assert!(matches!(huge, Err(Error::Param { name: "logits", .. })), "a shape whose size overflows is an error");
}

/// `Backend::topk` gives every fixture's ids and log-prob bits (bf16 logits widened to f32, which is
/// what the reference does with them), with K and the row count changing from call to call.
fn backend_matches_every_fixture<B: Backend>(b: &B) {
    for case in cases("topk") {
        let (bs, l, v, k) = dims(&case);
        let owned = case.logits("logits").unwrap();
        let logits = owned.view();
        let x: Vec<f32> = (0..logits.len()).map(|i| logits.get(i)).collect();
        let rows = bs * l;
        let (mut ids, mut logp) = (b.zeros::<i32>(rows * k).unwrap(), b.zeros::<f32>(rows * k).unwrap());
        b.topk(&b.upload(&x).unwrap(), v, rows, k, &mut ids, &mut logp).unwrap();
        b.check().unwrap();
        let name = case.name();
        assert_same(&name, "top_ids", &b.read(&ids, rows * k).unwrap(), &case.array::<i32>("top_ids").unwrap());
        assert_bits(&name, "top_logp", &b.read(&logp, rows * k).unwrap(), &case.array::<f32>("top_logp").unwrap());
    }
}

/// A row of invalid logits is an error naming the row, from the call or the next check, and it does not
/// stay behind to fail the next call.
fn backend_reports_bad_logits<B: Backend>(b: &B) {
    let (rows, vocab, k) = (3, 20_000, 16);
    let mut x = vec![0.25f32; rows * vocab];
    let (mut ids, mut logp) = (b.zeros::<i32>(rows * k).unwrap(), b.zeros::<f32>(rows * k).unwrap());
    let mut run =
        |x: &[f32]| b.topk(&b.upload(x).unwrap(), vocab, rows, k, &mut ids, &mut logp).and_then(|()| b.check());
    x[vocab + 17] = f32::NAN;
    let err = run(&x).unwrap_err();
    assert!(matches!(err, Error::Logits { row: 1, problem: "NaN logit", .. }), "{err}");
    x[vocab + 17] = 0.0;
    x[2 * vocab..].fill(f32::NEG_INFINITY);
    let err = run(&x).unwrap_err();
    assert!(matches!(err, Error::Logits { row: 2, .. }), "{err}");
    x[2 * vocab..].fill(1.0);
    run(&x).unwrap();
}

#[test]
fn cpu_backend_matches_every_fixture() {
    backend_matches_every_fixture(&CpuBackend);
}

#[test]
fn cpu_backend_reports_bad_logits() {
    backend_reports_bad_logits(&CpuBackend);
}

#[cfg(feature = "cuda")]
mod gpu {
    use super::*;
    use common::{capture_gpu, gpu, replay_graph};
    use half::bf16;
    use proptest::prelude::*;

    /// Logits with many exact ties and some -inf: values on a coarse grid.
    fn tie_heavy_logits(seed: u64, n: usize) -> Vec<f32> {
        let mut next = common::xorshift(seed);
        (0..n)
            .map(|_| match next() % 50 {
                0 => f32::NEG_INFINITY,
                r => (r as f32 - 25.0) * 0.25,
            })
            .collect()
    }

    #[test]
    fn gpu_matches_every_fixture() {
        let Some(gpu) = gpu() else { return };
        for case in cases("topk") {
            let (bs, l, v, k) = dims(&case);
            let logits = case.logits("logits").unwrap();
            let got = gpu.topk_logsumexp(logits.view(), bs, l, v, k).unwrap();
            check_against_fixture(&case, &got);
        }
    }

    #[test]
    fn cuda_backend_matches_every_fixture() {
        let Some(b) = common::cuda_backend() else { return };
        backend_matches_every_fixture(&b);
    }

    #[test]
    fn cuda_backend_reports_bad_logits() {
        let Some(b) = common::cuda_backend() else { return };
        backend_reports_bad_logits(&b);
    }

    #[test]
    fn gpu_reports_bad_logits() {
        let Some(gpu) = gpu() else { return };
        let mut x = vec![0.25f32; 3 * 20000];
        x[20000 + 17] = f32::NAN;
        let err = gpu.topk_logsumexp(Logits::F32(&x), 1, 3, 20000, 16).unwrap_err();
        assert!(matches!(err, Error::Logits { row: 1, problem: "NaN logit", .. }), "{err}");
        x[20000 + 17] = 0.0;
        x[40000..].fill(f32::NEG_INFINITY);
        let err = gpu.topk_logsumexp(Logits::F32(&x), 1, 3, 20000, 16).unwrap_err();
        assert!(matches!(err, Error::Logits { row: 2, .. }), "{err}");
    }

    #[test]
    fn gpu_is_deterministic_on_kimi_vocab() {
        let Some(gpu) = gpu() else { return };
        let (bs, l, v) = (2, 15, 163_840);
        let x: Vec<bf16> = tie_heavy_logits(7, bs * l * v).into_iter().map(bf16::from_f32).collect();
        // K 64 merges inside the chunk kernel, K 256 in the merge kernel.
        for k in [64, 256] {
            let a = gpu.topk_logsumexp(Logits::Bf16(&x), bs, l, v, k).unwrap();
            let b = gpu.topk_logsumexp(Logits::Bf16(&x), bs, l, v, k).unwrap();
            assert_eq!(a, b);
            let cpu = topk_logsumexp(Logits::Bf16(&x), bs, l, v, k).unwrap();
            check_same(&cpu, &a);
        }
    }

    /// Distinct-valued logits (sums of two uniforms, as in the bench), so that a chunk's candidates are
    /// about K of distinct values: the chunk kernel's ranking path, and its radix path at K 256.
    fn smooth_logits(seed: u64, n: usize) -> Vec<f32> {
        let mut next = common::xorshift(seed);
        (0..n)
            .map(|_| {
                let s = next();
                let (a, b) = ((s >> 40) as f32, ((s >> 16) & 0xFF_FFFF) as f32);
                ((a + b) / (1u64 << 24) as f32 - 1.0) * 4.0
            })
            .collect()
    }

    #[test]
    fn gpu_matches_cpu_on_smooth_kimi_logits() {
        let Some(gpu) = gpu() else { return };
        let (bs, l, v) = (2, 3, 163_840);
        let x = smooth_logits(11, bs * l * v);
        let xb: Vec<bf16> = x.iter().map(|&f| bf16::from_f32(f)).collect();
        for k in [1, 16, 64, 200, 256, 512] {
            let cpu = topk_logsumexp(Logits::F32(&x), bs, l, v, k).unwrap();
            check_same(&cpu, &gpu.topk_logsumexp(Logits::F32(&x), bs, l, v, k).unwrap());
            let cpu = topk_logsumexp(Logits::Bf16(&xb), bs, l, v, k).unwrap();
            check_same(&cpu, &gpu.topk_logsumexp(Logits::Bf16(&xb), bs, l, v, k).unwrap());
        }
    }

    /// Logits of V 163840 (20 chunks, so K 64 merges inside the chunk kernel, over 128 slots a chunk)
    /// where each chunk holds `per_chunk[c]` copies of 10.0, one in each of as many groups of 16 values
    /// (f32 element 4t is item 0 of thread t, so one per thread), over smaller distinct values.
    fn planted_ties(per_chunk: &[usize]) -> Vec<f32> {
        let mut x = smooth_logits(5, 163_840);
        for (c, &n) in per_chunk.iter().enumerate() {
            for t in 0..n {
                x[c * 8192 + 4 * t] = 10.0;
            }
        }
        x
    }

    #[test]
    fn gpu_matches_cpu_when_a_merge_has_more_candidates_than_shared_memory() {
        let Some(gpu) = gpu() else { return };
        // 128 candidates in every chunk, all equal: each chunk writes its 128 unselected and every one of
        // the row's 2560 reaches the merge's bound, more than the 2048 it holds in shared memory.
        let x = planted_ties(&[128; 20]);
        let cpu = topk_logsumexp(Logits::F32(&x), 1, 1, 163_840, 64).unwrap();
        check_same(&cpu, &gpu.topk_logsumexp(Logits::F32(&x), 1, 1, 163_840, 64).unwrap());
        assert!(cpu.ids.iter().all(|&id| id < 8192 && id % 4 == 0), "the first chunk's ties win");
    }

    /// Two copies of 10.0 in each of the 512 groups of every whole chunk of a row of `vocab` values read
    /// `vec` to a 16-byte vector (item i of thread t is element ((i / vec) * 256 + t) * vec + i % vec):
    /// 1024 candidates a chunk, the most a chunk writes unselected at K 512.
    fn ties_in_every_group(vocab: usize, vec: usize) -> Vec<f32> {
        let mut x = smooth_logits(9, vocab);
        for chunk in 0..vocab / 8192 {
            for t in 0..256 {
                for first_item in [0, 16] {
                    let e = chunk * 8192 + ((first_item / vec) * 256 + t) * vec;
                    x[e] = 10.0;
                    x[e + 1] = 10.0;
                }
            }
        }
        x
    }

    #[test]
    fn gpu_matches_cpu_when_a_merge_over_4096_slots_overflows_with_a_short_last_chunk() {
        let Some(gpu) = gpu() else { return };
        // V = 3 * 8192 + 100: four chunks, the last of 100 values; K 512 fills all 4096 slots of the row's
        // merge, and 3072 ties reach its bound.
        let v = 3 * 8192 + 100;
        let x = ties_in_every_group(v, 4);
        let cpu = topk_logsumexp(Logits::F32(&x), 1, 1, v, 512).unwrap();
        check_same(&cpu, &gpu.topk_logsumexp(Logits::F32(&x), 1, 1, v, 512).unwrap());
        let xb: Vec<bf16> = ties_in_every_group(v, 8).into_iter().map(bf16::from_f32).collect();
        let cpu = topk_logsumexp(Logits::Bf16(&xb), 1, 1, v, 512).unwrap();
        check_same(&cpu, &gpu.topk_logsumexp(Logits::Bf16(&xb), 1, 1, v, 512).unwrap());
        assert!(cpu.ids.iter().all(|&id| (id as usize) < 8192), "the first chunk's ties win");
    }

    #[test]
    fn gpu_matches_cpu_when_some_chunks_select_exactly() {
        let Some(gpu) = gpu() else { return };
        // 200 candidates (over 128 slots) make chunks 1 and 7 select their 64 best and leave the rest of
        // their slots empty; the others write theirs unselected.
        let mut per_chunk = [0usize; 20];
        per_chunk[1] = 200;
        per_chunk[7] = 200;
        per_chunk[3] = 100;
        let x = planted_ties(&per_chunk);
        let cpu = topk_logsumexp(Logits::F32(&x), 1, 1, 163_840, 64).unwrap();
        check_same(&cpu, &gpu.topk_logsumexp(Logits::F32(&x), 1, 1, 163_840, 64).unwrap());
    }

    #[test]
    fn a_plan_runs_again_on_fewer_rows() {
        use kdtree_engine::cuda::topk::TopKPlan;
        let Some(gpu) = gpu() else { return };
        let (v, k) = (20_000, 64);
        let x = tie_heavy_logits(3, 6 * v);
        let mut plan = TopKPlan::new(gpu, 6, v, k).unwrap();
        let mut out = plan.alloc_output(gpu).unwrap();
        let dev = gpu.upload(&x).unwrap();
        for rows in [6usize, 2, 6] {
            let logits = kdtree_engine::cuda::DeviceLogits::F32(dev.slice(..rows * v));
            plan.run(gpu, &logits, rows, &mut out).unwrap();
            let got = out.to_host(gpu, 1, rows).unwrap();
            check_same(&topk_logsumexp(Logits::F32(&x[..rows * v]), 1, rows, v, k).unwrap(), &got);
        }
    }

    /// Runs captured in one graph and replayed give the eager runs' outputs, and an eager run after the
    /// replays does too: the chunk kernel's per-row arrival counts, which pick the CTA that merges a row,
    /// must be back at zero after every launch. K 16 and 64 merge inside the chunk kernel (20 chunks), K
    /// 256 in the merge kernel.
    #[test]
    fn a_graph_of_runs_matches_the_eager_runs() {
        use kdtree_engine::cuda::topk::{DeviceTopK, TopKPlan};
        use kdtree_engine::cuda::DeviceLogits;
        let Some(own) = capture_gpu() else { return };
        let gpu = &own;
        let (rows, v, steps) = (6, 163_840, 3);
        let x = smooth_logits(23, steps * rows * v);
        let dev = gpu.upload(&x).unwrap();
        for k in [16, 64, 256] {
            let mut plan = TopKPlan::new(gpu, rows, v, k).unwrap();
            let run = |plan: &mut TopKPlan, outs: &mut [DeviceTopK]| {
                for (s, out) in outs.iter_mut().enumerate() {
                    let logits = DeviceLogits::F32(dev.slice(s * rows * v..(s + 1) * rows * v));
                    plan.run(gpu, &logits, rows, out).unwrap();
                }
            };
            let mut eager: Vec<DeviceTopK> = (0..steps).map(|_| plan.alloc_output(gpu).unwrap()).collect();
            run(&mut plan, &mut eager);
            let want: Vec<TopK> = eager.iter().map(|o| o.to_host(gpu, 1, rows).unwrap()).collect();
            for (s, w) in want.iter().enumerate() {
                let cpu = topk_logsumexp(Logits::F32(&x[s * rows * v..(s + 1) * rows * v]), 1, rows, v, k).unwrap();
                check_same(&cpu, w);
            }
            let mut replayed: Vec<DeviceTopK> = (0..steps).map(|_| plan.alloc_output(gpu).unwrap()).collect();
            replay_graph(gpu, 3, || run(&mut plan, &mut replayed));
            for (w, out) in want.iter().zip(&replayed) {
                assert_eq!(&out.to_host(gpu, 1, rows).unwrap(), w, "graph replay, K {k}");
            }
            run(&mut plan, &mut eager);
            for (w, out) in want.iter().zip(&eager) {
                assert_eq!(&out.to_host(gpu, 1, rows).unwrap(), w, "eager run after the replays, K {k}");
            }
        }
    }

    fn check_same(cpu: &TopK, gpu: &TopK) {
        assert_same("random", "top_ids", &gpu.ids, &cpu.ids);
        assert_bits("random", "top_logp", &gpu.logp, &cpu.logp);
        assert_bits("random", "lse", &gpu.lse, &cpu.lse);
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(48))]
        #[test]
        fn gpu_matches_cpu_on_random_inputs(
            bs in 1usize..4, l in 1usize..4, v in prop::sample::select(vec![1usize, 7, 64, 1000, 8192, 8193, 20000, 32000]),
            k_frac in 0.0f64..1.0, seed in any::<u64>(), bf in any::<bool>(),
        ) {
            let Some(gpu) = gpu() else { return Ok(()) };
            let k = 1 + ((v.min(512) - 1) as f64 * k_frac) as usize;
            let mut x = tie_heavy_logits(seed, bs * l * v);
            for r in 0..bs * l { x[r * v + (seed as usize % v)] = 1.5; } // every row keeps a finite value
            let (cpu, got) = if bf {
                let xb: Vec<bf16> = x.iter().map(|&f| bf16::from_f32(f)).collect();
                (topk_logsumexp(Logits::Bf16(&xb), bs, l, v, k).unwrap(), gpu.topk_logsumexp(Logits::Bf16(&xb), bs, l, v, k).unwrap())
            } else {
                (topk_logsumexp(Logits::F32(&x), bs, l, v, k).unwrap(), gpu.topk_logsumexp(Logits::F32(&x), bs, l, v, k).unwrap())
            };
            check_same(&cpu, &got);
        }
    }
}
