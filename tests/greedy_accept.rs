//! Greedy accept: CPU and GPU against the numpy fixtures (bit-exact), GPU against CPU on random trees
//! and logits, the walk's invariants, and bad input.

mod common;

use common::{assert_same, cases};
use kdtree_engine::cpu::greedy_accept::{accept_from_argmax, greedy_accept};
use kdtree_engine::cpu::topk::topk_logsumexp;
use kdtree_engine::cpu::tree_build::build_trees;
use kdtree_engine::fixture::Fixture;
use kdtree_engine::{Acceptance, DraftTree, Error, Logits, TreeShape};
use proptest::prelude::*;

/// The tree stored in a greedy_accept fixture (only the arrays the walk reads are stored).
fn fixture_tree(case: &Fixture) -> DraftTree {
    let u = |k| case.usize(k).unwrap();
    let (bs, n, l) = (u("bs"), u("N"), u("L"));
    let shape = TreeShape::new(bs, l, n - 1).unwrap();
    let arr = |name| case.array::<i32>(name).unwrap();
    DraftTree {
        shape,
        num_nodes: arr("num_nodes"),
        node_token: arr("node_token"),
        node_depth: vec![-1; bs * n],
        parent: vec![-1; bs * n],
        first_child: arr("first_child"),
        next_sibling: arr("next_sibling"),
        position: vec![-1; bs * n],
        visibility: vec![0; bs * n * shape.words()],
    }
}

fn check_against_fixture(case: &Fixture, got: &Acceptance) {
    let name = case.name();
    assert_same(&name, "target_argmax", &got.target_argmax, &case.array::<i32>("target_argmax").unwrap());
    assert_same(&name, "accept_len", &got.accept_len, &case.array::<i32>("accept_len").unwrap());
    assert_same(&name, "accept_rows", &got.accept_rows, &case.array::<i32>("accept_rows").unwrap());
    assert_same(&name, "emitted", &got.emitted, &case.array::<i32>("emitted").unwrap());
}

#[test]
fn cpu_matches_every_fixture() {
    for case in cases("greedy_accept") {
        let tree = fixture_tree(&case);
        let logits = case.logits("target_logits").unwrap();
        let got = greedy_accept(&tree, logits.view(), case.usize("V").unwrap()).unwrap();
        check_against_fixture(&case, &got);
        let from_argmax = accept_from_argmax(&tree, &got.target_argmax).unwrap();
        assert_eq!(from_argmax, got, "{}: walk from argmax", case.name());
    }
}

/// A random batch of real trees and target logits that follow a random path for a few steps.
fn random_case(seed: u64, bs: usize, l: usize, v: usize, budget: usize) -> (DraftTree, Vec<f32>) {
    let mut next = common::xorshift(seed);
    let draft: Vec<f32> = (0..bs * l * v).map(|_| (next() % 1000) as f32 * 0.01).collect();
    let k = budget.min(v);
    let top = topk_logsumexp(Logits::F32(&draft), bs, l, v, k).unwrap();
    let shape = TreeShape::new(bs, l, budget).unwrap();
    let tree = build_trees(shape, k, &top.ids, &top.logp, &vec![1; bs], &vec![0; bs]).unwrap();
    let n = shape.rows();
    let mut target: Vec<f32> = (0..bs * n * v).map(|_| (next() % 64) as f32 * 0.125).collect();
    for b in 0..bs {
        // Make each row's argmax its first child's token with probability 3/4, so walks go deep.
        for i in 0..n {
            let c = tree.first_child[b * n + i];
            if c > 0 && !next().is_multiple_of(4) {
                target[(b * n + i) * v + tree.node_token[b * n + c as usize] as usize] = 100.0;
            }
        }
    }
    (tree, target)
}

fn check_walk_invariants(tree: &DraftTree, acc: &Acceptance) {
    let (n, w) = (tree.shape.rows(), tree.shape.depth + 1);
    for b in 0..tree.shape.bs {
        let len = acc.accept_len[b] as usize;
        assert_eq!(acc.accept_rows[b * w], 0);
        for j in 0..len {
            let (prev, row) = (acc.accept_rows[b * w + j] as usize, acc.accept_rows[b * w + j + 1] as usize);
            assert_eq!(tree.parent[b * n + row] as usize, prev, "accepted path is a root path");
            assert_eq!(tree.node_token[b * n + row], acc.target_argmax[b * n + prev], "token matches argmax");
            assert_eq!(acc.emitted[b * w + j], tree.node_token[b * n + row]);
        }
        let last = acc.accept_rows[b * w + len] as usize;
        let bonus = acc.target_argmax[b * n + last];
        assert_eq!(acc.emitted[b * w + len], bonus, "bonus token");
        let stops = len == tree.shape.depth
            || !(1..n).any(|c| tree.parent[b * n + c] == last as i32 && tree.node_token[b * n + c] == bonus);
        assert!(stops, "the walk stops only where no child matches");
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(32))]
    #[test]
    fn accepted_path_is_a_root_path_matching_argmax(
        seed in any::<u64>(), bs in 1usize..5, l in 1usize..8, budget in 1usize..40,
    ) {
        let v = 50;
        let (tree, target) = random_case(seed, bs, l, v, budget);
        let acc = greedy_accept(&tree, Logits::F32(&target), v).unwrap();
        check_walk_invariants(&tree, &acc);
    }
}

#[test]
fn bad_input_is_a_named_error() {
    let (tree, mut target) = random_case(3, 2, 3, 20, 8);
    assert!(matches!(
        greedy_accept(&tree, Logits::F32(&target[1..]), 20),
        Err(Error::Shape { name: "target_logits", .. })
    ));
    target[5] = f32::NAN; // row 0 is always valid
    assert!(matches!(greedy_accept(&tree, Logits::F32(&target), 20), Err(Error::Logits { row: 0, .. })));
    assert!(matches!(accept_from_argmax(&tree, &[0; 3]), Err(Error::Shape { name: "target_argmax", .. })));
    let mut broken = tree.clone();
    broken.num_nodes[1] = -1;
    assert!(matches!(accept_from_argmax(&broken, &[0; 2 * 9]), Err(Error::Param { name: "num_nodes", .. })));
    let mut broken = tree.clone();
    broken.next_sibling[3] = 9; // N is 9
    assert!(matches!(accept_from_argmax(&broken, &[0; 2 * 9]), Err(Error::Index { name: "next_sibling", .. })));
}

#[cfg(feature = "cuda")]
mod gpu {
    use super::*;
    use common::gpu;

    #[test]
    fn gpu_matches_every_fixture() {
        let Some(gpu) = gpu() else { return };
        for case in cases("greedy_accept") {
            let tree = fixture_tree(&case);
            let logits = case.logits("target_logits").unwrap();
            let got = gpu.greedy_accept(&tree, logits.view(), case.usize("V").unwrap()).unwrap();
            check_against_fixture(&case, &got);
            let from_argmax = gpu.accept_from_argmax(&tree, &got.target_argmax).unwrap();
            assert_eq!(from_argmax, got, "{}: walk from argmax", case.name());
        }
    }

    #[test]
    fn gpu_reports_nan_in_a_valid_row() {
        let Some(gpu) = gpu() else { return };
        let (tree, mut target) = random_case(5, 2, 3, 40000, 8);
        target[(tree.shape.rows() + 1) * 40000 + 33333] = f32::NAN; // request 1, row 1 (valid: n >= 1)
        let err = gpu.greedy_accept(&tree, Logits::F32(&target), 40000).unwrap_err();
        assert!(matches!(err, Error::Logits { name: "target_logits", row: 1, .. }), "{err}");
    }

    #[test]
    fn a_plan_runs_again_with_the_same_results() {
        use kdtree_engine::cuda::greedy_accept::{AcceptPlan, DeviceAcceptance};
        use kdtree_engine::cuda::tree_build::DeviceTree;
        let Some(gpu) = gpu() else { return };
        let v = 40_000;
        let (tree, target) = random_case(9, 4, 7, v, 16);
        let cpu = greedy_accept(&tree, Logits::F32(&target), v).unwrap();
        let dev_tree = DeviceTree::upload(gpu, &tree).unwrap();
        let mut plan = AcceptPlan::new(gpu, tree.shape, v).unwrap();
        let mut out = DeviceAcceptance::alloc(gpu, tree.shape).unwrap();
        let logits = gpu.upload(&target).unwrap();
        for _ in 0..3 {
            // The arrival counters must be back at zero after each launch.
            plan.run(gpu, &dev_tree, &kdtree_engine::cuda::DeviceLogits::F32(logits.as_view()), &mut out).unwrap();
            assert_eq!(out.to_host(gpu).unwrap(), cpu);
        }
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(32))]
        #[test]
        fn gpu_matches_cpu_on_random_inputs(
            seed in any::<u64>(), bs in 1usize..9, l in prop::sample::select(vec![1usize, 3, 7, 15]),
            budget in prop::sample::select(vec![1usize, 8, 16, 64, 256]),
            v in prop::sample::select(vec![50usize, 16384, 16385, 40000]), bf in any::<bool>(),
        ) {
            let Some(gpu) = gpu() else { return Ok(()) };
            let (tree, target) = random_case(seed, bs, l, v, budget);
            let (cpu, got) = if bf {
                let tb: Vec<half::bf16> = target.iter().map(|&x| half::bf16::from_f32(x)).collect();
                (greedy_accept(&tree, Logits::Bf16(&tb), v).unwrap(), gpu.greedy_accept(&tree, Logits::Bf16(&tb), v).unwrap())
            } else {
                (greedy_accept(&tree, Logits::F32(&target), v).unwrap(), gpu.greedy_accept(&tree, Logits::F32(&target), v).unwrap())
            };
            prop_assert_eq!(got, cpu);
        }
    }
}
