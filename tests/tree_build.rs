//! Tree build: CPU and GPU against the numpy fixtures (bit-exact), GPU against CPU on random inputs,
//! the DDTree invariants (including brute-force optimality on small cases), and bad input.

mod common;

use common::{assert_same, cases};
use kdtree_engine::cpu::topk::topk_logsumexp;
use kdtree_engine::cpu::tree_build::build_trees;
use kdtree_engine::fixture::Fixture;
use kdtree_engine::{DraftTree, Error, Logits, TreeShape, MAX_BUDGET};
use proptest::prelude::*;

/// Inputs of a tree_build fixture: (shape, K, top_ids, top_logp, root_token, seq_len).
type TreeInputs = (TreeShape, usize, Vec<i32>, Vec<f32>, Vec<i32>, Vec<i32>);

fn inputs(case: &Fixture) -> TreeInputs {
    let u = |k| case.usize(k).unwrap();
    let shape = TreeShape::new(u("bs"), u("L"), u("budget")).unwrap();
    let arr = |n| case.array::<i32>(n).unwrap();
    (shape, u("K"), arr("top_ids"), case.array("top_logp").unwrap(), arr("root_token"), arr("seq_len"))
}

fn check_against_fixture(case: &Fixture, got: &DraftTree) {
    let name = case.name();
    for (field, value) in [
        ("num_nodes", &got.num_nodes),
        ("node_token", &got.node_token),
        ("node_depth", &got.node_depth),
        ("parent", &got.parent),
        ("first_child", &got.first_child),
        ("next_sibling", &got.next_sibling),
        ("position", &got.position),
    ] {
        assert_same(&name, field, value, &case.array::<i32>(field).unwrap());
    }
    assert_same(&name, "visibility", &got.visibility, &case.array::<u32>("visibility").unwrap());
}

#[test]
fn cpu_matches_every_fixture() {
    for case in cases("tree_build") {
        let (shape, k, ids, logp, root, seq) = inputs(&case);
        check_against_fixture(&case, &build_trees(shape, k, &ids, &logp, &root, &seq).unwrap());
    }
}

/// Row score as the contract defines it: f32 additions along the path from the root.
fn row_score(
    tree: &DraftTree,
    b: usize,
    row: usize,
    rank_of: &dyn Fn(usize) -> (usize, usize),
    logp: &[f32],
    k: usize,
    l: usize,
) -> f32 {
    let base = b * tree.shape.rows();
    let mut path = vec![];
    let mut r = row as i32;
    while r > 0 {
        path.push(r as usize);
        r = tree.parent[base + r as usize];
    }
    path.iter().rev().fold(0.0f32, |acc, &row| {
        let (d, rank) = rank_of(row);
        acc + logp[b * l * k + (d - 1) * k + rank]
    })
}

/// Checks the invariants of DESIGN.md §4.1 and returns each request's row scores.
fn check_invariants(tree: &DraftTree, ids: &[i32], logp: &[f32], k: usize) -> Vec<Vec<f32>> {
    let s = tree.shape;
    let (n_rows, words, l) = (s.rows(), s.words(), s.depth);
    let mut all_scores = vec![];
    for b in 0..s.bs {
        let base = b * n_rows;
        let n = tree.num_nodes[b] as usize;
        assert!(n <= s.budget, "n <= B");
        // Each row's rank: the position of its token among the top ids at its depth.
        let rank_of = |row: usize| {
            let d = tree.node_depth[base + row] as usize;
            let row_ids = &ids[b * l * k + (d - 1) * k..b * l * k + d * k];
            (d, row_ids.iter().position(|&t| t == tree.node_token[base + row]).expect("token is a top-K id"))
        };
        let mut scores = vec![0.0f32];
        for i in 1..=n {
            let p = tree.parent[base + i];
            assert!(p >= 0 && (p as usize) < i, "parent < child");
            assert_eq!(tree.node_depth[base + i], tree.node_depth[base + p as usize] + 1, "depth = parent's + 1");
            let (_, rank) = rank_of(i);
            if rank > 0 {
                // Prefix-closed over ranks too: the previous-rank sibling is in the tree.
                let prev = ids[b * l * k + (tree.node_depth[base + i] as usize - 1) * k + rank - 1];
                assert!(
                    (1..=n).any(|j| tree.parent[base + j] == p && tree.node_token[base + j] == prev),
                    "rank-closed"
                );
            }
            scores.push(row_score(tree, b, i, &rank_of, logp, k, l));
            for j in 0..n_rows {
                let bit = tree.visibility[(base + i) * words + j / 32] >> (j % 32) & 1 == 1;
                let mut anc = i as i32;
                while anc > j as i32 {
                    anc = tree.parent[base + anc as usize];
                }
                assert_eq!(bit, anc == j as i32, "visibility bit ({i}, {j})");
            }
        }
        for w in scores[1..].windows(2) {
            assert!(w[0] >= w[1], "scores non-increasing in row order: {} then {}", w[0], w[1]);
        }
        all_scores.push(scores);
    }
    all_scores
}

/// The B best prefix scores by brute force over all rank tuples up to depth L.
fn brute_force_best(logp: &[f32], l: usize, k: usize, budget: usize) -> Vec<f32> {
    let mut scores = vec![];
    let mut frontier = vec![0.0f32];
    for d in 0..l {
        let next: Vec<f32> = frontier.iter().flat_map(|&s| (0..k).map(move |r| s + logp[d * k + r])).collect();
        scores.extend_from_slice(&next);
        frontier = next;
    }
    scores.sort_by(|a, b| b.total_cmp(a));
    scores.truncate(budget);
    scores
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(64))]
    #[test]
    fn tree_holds_invariants_and_is_the_top_b_prefixes(
        l in 1usize..5, v in 2usize..7, budget in 1usize..40, seed in any::<u64>(), bs in 1usize..3,
    ) {
        let k = budget.min(v);
        let logits = common_logits(seed, bs * l * v);
        let top = topk_logsumexp(Logits::F32(&logits), bs, l, v, k).unwrap();
        let shape = TreeShape::new(bs, l, budget).unwrap();
        let tree = build_trees(shape, k, &top.ids, &top.logp, &vec![7; bs], &vec![100; bs]).unwrap();
        let scores = check_invariants(&tree, &top.ids, &top.logp, k);
        for (b, s) in scores.iter().enumerate() {
            let mut got = s[1..].to_vec();
            got.sort_by(|a, b| b.total_cmp(a));
            let want = brute_force_best(&top.logp[b * l * k..(b + 1) * l * k], l, k, budget);
            prop_assert_eq!(got, want);
        }
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(64))]
    /// One build serves every smaller budget (`auto`, ENGINE.md §7): the first rows of a budget-B tree
    /// are, field for field, the tree a build of the smaller budget makes from the same candidates.
    #[test]
    fn first_rows_are_the_smaller_budget_tree(
        l in 1usize..5, v in 2usize..7, budget in 2usize..40, seed in any::<u64>(), bs in 1usize..3,
    ) {
        let k = budget.min(v);
        let logits = common_logits(seed, bs * l * v);
        let top = topk_logsumexp(Logits::F32(&logits), bs, l, v, k).unwrap();
        let (root, seq) = (vec![7; bs], vec![100; bs]);
        let tree = build_trees(TreeShape::new(bs, l, budget).unwrap(), k, &top.ids, &top.logp, &root, &seq).unwrap();
        for smaller in 1..budget {
            let want = build_trees(TreeShape::new(bs, l, smaller).unwrap(), k, &top.ids, &top.logp, &root, &seq).unwrap();
            prop_assert_eq!(tree.first_rows(smaller).unwrap(), want, "budget {} of {}", smaller, budget);
        }
        prop_assert!(tree.first_rows(0).is_err() && tree.first_rows(budget + 1).is_err());
    }
}

/// Random logits with a per-position temperature, so trees take varied shapes.
fn common_logits(seed: u64, n: usize) -> Vec<f32> {
    let mut next = common::xorshift(seed);
    (0..n).map(|i| ((next() >> 40) as f32 / (1u64 << 24) as f32 - 0.5) * (1.0 + (i % 5) as f32)).collect()
}

#[test]
fn bad_input_is_a_named_error() {
    assert!(matches!(TreeShape::new(1, 3, 0), Err(Error::Param { name: "budget", .. })));
    assert!(matches!(TreeShape::new(1, 3, MAX_BUDGET + 1), Err(Error::Param { name: "budget", .. })));
    assert!(matches!(TreeShape::new(1, 0, 4), Err(Error::Param { name: "depth", .. })));
    let shape = TreeShape::new(1, 2, 4).unwrap();
    let (ids, mut logp) = (vec![1, 2, 3, 4], vec![-0.1f32, -0.2, -0.3, -0.4]);
    assert!(matches!(build_trees(shape, 2, &ids[..3], &logp, &[0], &[0]), Err(Error::Shape { name: "top_ids", .. })));
    assert!(matches!(build_trees(shape, 2, &ids, &logp, &[0, 1], &[0]), Err(Error::Shape { name: "root_token", .. })));
    let bypass = TreeShape { bs: 1, depth: 0, budget: 3 }; // a literal skips TreeShape::new
    assert!(matches!(build_trees(bypass, 1, &[], &[], &[7], &[0]), Err(Error::Param { name: "depth", .. })));
    assert!(matches!(build_trees(shape, 2, &ids, &logp, &[0], &[-1]), Err(Error::Param { name: "seq_len", .. })));
    assert!(matches!(build_trees(shape, 2, &ids, &logp, &[0], &[i32::MAX]), Err(Error::Param { name: "seq_len", .. })));
    logp[2] = f32::INFINITY;
    let err = build_trees(shape, 2, &ids, &logp, &[0], &[0]).unwrap_err();
    assert!(matches!(err, Error::Logits { name: "top_logp", problem: "+inf log-prob", .. }), "{err}");
    logp[2] = f32::NAN;
    assert!(matches!(build_trees(shape, 2, &ids, &logp, &[0], &[0]), Err(Error::Logits { name: "top_logp", .. })));
}

#[cfg(feature = "cuda")]
mod gpu {
    use super::*;
    use common::gpu;

    #[test]
    fn gpu_matches_every_fixture() {
        let Some(gpu) = gpu() else { return };
        for case in cases("tree_build") {
            let (shape, k, ids, logp, root, seq) = inputs(&case);
            check_against_fixture(&case, &gpu.build_trees(shape, k, &ids, &logp, &root, &seq).unwrap());
        }
    }

    #[test]
    fn gpu_reports_nan_log_probs() {
        let Some(gpu) = gpu() else { return };
        let shape = TreeShape::new(2, 2, 4).unwrap();
        let mut logp = vec![-0.5f32; 8];
        logp[6] = f32::NAN;
        let err = gpu.build_trees(shape, 2, &[1, 2, 3, 4, 5, 6, 7, 8], &logp, &[0, 0], &[0, 0]).unwrap_err();
        assert!(matches!(err, Error::Logits { name: "top_logp", row: 1, .. }), "{err}");
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(48))]
        #[test]
        fn gpu_matches_cpu_on_random_inputs(
            bs in 1usize..9, l in prop::sample::select(vec![1usize, 2, 7, 15]),
            budget in prop::sample::select(vec![1usize, 3, 16, 31, 32, 33, 64, 255, 256, 512]),
            v in prop::sample::select(vec![2usize, 5, 300, 1000]), seed in any::<u64>(), ties in any::<bool>(),
        ) {
            let Some(gpu) = gpu() else { return Ok(()) };
            let k = budget.min(v);
            let mut logits = common_logits(seed, bs * l * v);
            if ties {
                logits.iter_mut().for_each(|x| *x = (*x * 2.0).round() * 0.5);
            }
            let top = topk_logsumexp(Logits::F32(&logits), bs, l, v, k).unwrap();
            let shape = TreeShape::new(bs, l, budget).unwrap();
            let root: Vec<i32> = (0..bs as i32).collect();
            let seq: Vec<i32> = (0..bs as i32).map(|b| b * 37).collect();
            let cpu = build_trees(shape, k, &top.ids, &top.logp, &root, &seq).unwrap();
            let got = gpu.build_trees(shape, k, &top.ids, &top.logp, &root, &seq).unwrap();
            prop_assert_eq!(got, cpu);
        }
    }
}
