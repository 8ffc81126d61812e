//! MLA decode and tree verify: CPU against the float64 numpy fixtures (tolerances from meta.json), and the
//! properties the engine relies on: batch invariance, a tree row equal to a decode over the same logical
//! sequence, a root-only tree equal to a decode; and bad input.

mod common;

use common::{cases, mutants, worst_abs, worst_rel_l2, xorshift, Worst};
use half::bf16;
use kdtree_engine::cpu::mla::{mla_decode, tree_verify, MlaOutput, PagedCache, LATENT, ROW};
use kdtree_engine::fixture::Fixture;
use kdtree_engine::{Error, KvLayout};

/// Kimi-K2's scale: mscale² / sqrt(192) with YaRN mscale = 0.1 ln(32) + 1.
fn kimi_scale() -> f32 {
    let mscale = 0.1 * 32f64.ln() + 1.0;
    (mscale * mscale / 192f64.sqrt()) as f32
}

fn bf16_array(case: &Fixture, name: &str) -> Vec<bf16> {
    case.array::<u16>(name).unwrap().into_iter().map(bf16::from_bits).collect()
}

/// The fixture's cache layout (one layer of 576-element rows).
fn layout(case: &Fixture, bs: usize) -> KvLayout {
    let u = |k| case.usize(k).unwrap();
    let pages_per_req = u("pages_per_req");
    assert_eq!(case.array::<i32>("block_table").unwrap().len(), bs * pages_per_req);
    KvLayout { layers: 1, num_pages: u("pages"), page_size: u("page_size"), row_elems: ROW, pages_per_req }
}

/// The per-position tolerances of a case (`meta.json`): a multiple of the worst error of a correct f32
/// implementation against the float64 reference, per (query row, head).
#[derive(Clone, Copy, Debug)]
struct Tolerance {
    o_rel: f64,
    lse_abs: f64,
}

impl Tolerance {
    fn of(case: &Fixture) -> Self {
        Tolerance { o_rel: case.f64("tol_o_rel").unwrap(), lse_abs: case.f64("tol_lse_abs").unwrap() }
    }
}

/// Checks an MLA output position by position (a position is one query row and head): the relative L2 error
/// of its 512 `o` values and the absolute error of its `lse` (-inf and all-zero rows matched exactly). Returns
/// the worst errors, or a message naming the first bound broken and where.
fn check_mla(
    got: &MlaOutput,
    want_o: &[f32],
    want_lse: &[f32],
    heads: usize,
    tol: Tolerance,
) -> Result<(Worst, Worst), String> {
    if got.o.len() != want_o.len() || got.lse.len() != want_lse.len() {
        return Err(format!(
            "o / lse lengths {} / {}, want {} / {}",
            got.o.len(),
            got.lse.len(),
            want_o.len(),
            want_lse.len()
        ));
    }
    let (o, lse) = (worst_rel_l2(&got.o, want_o, LATENT), worst_abs(&got.lse, want_lse));
    let at = |p: usize| format!("query row {}, head {}", p / heads, p % heads);
    if o.error > tol.o_rel {
        return Err(format!("o relative error {:e} > {:e} at {}", o.error, tol.o_rel, at(o.at)));
    }
    if lse.error > tol.lse_abs {
        let (g, w) = (got.lse[lse.at], want_lse[lse.at]);
        return Err(format!("lse error {:e} > {:e} at {} (got {g}, want {w})", lse.error, tol.lse_abs, at(lse.at)));
    }
    Ok((o, lse))
}

/// Runs `run` on every fixture of `kernel` and checks it against the reference within the case's tolerance.
fn matches_every_fixture(label: &str, kernel: &str, run: impl Fn(&Fixture) -> MlaOutput) {
    for case in cases(kernel) {
        let got = run(&case);
        let (o, lse, heads) =
            (case.array::<f32>("o").unwrap(), case.array::<f32>("lse").unwrap(), case.usize("H").unwrap());
        let tol = Tolerance::of(&case);
        let name = format!("{label} {kernel}/{}", case.name());
        let (wo, wl) = check_mla(&got, &o, &lse, heads, tol).unwrap_or_else(|e| panic!("{name}: {e}"));
        println!(
            "{name}: worst o_rel {:.2e} (tolerance {:.2e}, f32 emulation {:.2e}), worst lse_abs {:.2e} (tolerance {:.2e}, emulation {:.2e})",
            wo.error,
            tol.o_rel,
            case.f64("observed_o_rel").unwrap(),
            wl.error,
            tol.lse_abs,
            case.f64("observed_lse_abs").unwrap()
        );
    }
}

/// Runs `run` on every fixture of `kernel` that carries mutants and checks that each mutant (a contract
/// violation applied to the reference) is rejected by the tolerance the real reference passes.
fn rejects_every_mutant(label: &str, kernel: &str, run: impl Fn(&Fixture) -> MlaOutput) {
    let mut rejected = 0;
    for case in cases(kernel) {
        let names = mutants(&case);
        if names.is_empty() {
            continue;
        }
        let got = run(&case);
        let (heads, tol) = (case.usize("H").unwrap(), Tolerance::of(&case));
        for m in names {
            let o = case.array::<f32>(&format!("mutant_{m}_o")).unwrap();
            let lse = case.array::<f32>(&format!("mutant_{m}_lse")).unwrap();
            match check_mla(&got, &o, &lse, heads, tol) {
                Ok((wo, wl)) => panic!(
                    "{label} {kernel}/{}: mutant {m} accepted (worst o_rel {:e}, lse_abs {:e})",
                    case.name(),
                    wo.error,
                    wl.error
                ),
                Err(why) => println!("{label} {kernel}/{}: mutant {m} rejected: {why}", case.name()),
            }
            rejected += 1;
        }
    }
    assert!(rejected > 0, "{label} {kernel}: no fixture carries mutants");
}

/// A fixture's shared inputs: queries, the paged cache and its block tables, prefix lengths, the scale.
struct MlaInputs {
    q: Vec<bf16>,
    rows: Vec<bf16>,
    table: Vec<i32>,
    layout: KvLayout,
    seq_len: Vec<i32>,
    scale: f32,
}

impl MlaInputs {
    fn load(case: &Fixture) -> Self {
        let bs = case.usize("bs").unwrap();
        MlaInputs {
            q: bf16_array(case, "q"),
            rows: bf16_array(case, "cache"),
            table: case.array("block_table").unwrap(),
            layout: layout(case, bs),
            seq_len: case.array("seq_len").unwrap(),
            scale: case.f64("softmax_scale").unwrap() as f32,
        }
    }

    fn cache(&self) -> PagedCache<'_> {
        PagedCache { rows: &self.rows, layout: self.layout, block_table: &self.table }
    }
}

fn cpu_decode(case: &Fixture) -> MlaOutput {
    let x = MlaInputs::load(case);
    mla_decode(&x.q, case.usize("H").unwrap(), &x.cache(), &x.seq_len, x.scale).unwrap()
}

fn cpu_tree_verify(case: &Fixture) -> MlaOutput {
    let x = MlaInputs::load(case);
    let (n, h) = (case.usize("N").unwrap(), case.usize("H").unwrap());
    let vis = case.array::<u32>("visibility").unwrap();
    tree_verify(&x.q, n, h, &x.cache(), &x.seq_len, &vis, x.scale).unwrap()
}

#[test]
fn cpu_decode_matches_every_fixture() {
    matches_every_fixture("cpu", "mla_decode", cpu_decode);
}

#[test]
fn cpu_tree_verify_matches_every_fixture() {
    matches_every_fixture("cpu", "tree_verify", cpu_tree_verify);
}

#[test]
fn cpu_decode_rejects_every_mutant() {
    rejects_every_mutant("cpu", "mla_decode", cpu_decode);
}

#[test]
fn cpu_tree_verify_rejects_every_mutant() {
    rejects_every_mutant("cpu", "tree_verify", cpu_tree_verify);
}

/// Random bf16 values of standard-normal-like spread.
fn random_bf16(next: &mut impl FnMut() -> u64, n: usize) -> Vec<bf16> {
    (0..n).map(|_| bf16::from_f32(((next() >> 40) as f32 / (1u64 << 24) as f32 - 0.5) * 3.0)).collect()
}

/// A one-page-per-slot-range cache with `bs` requests of `capacity` slots each, page size 16.
struct Setup {
    rows: Vec<bf16>,
    table: Vec<i32>,
    layout: KvLayout,
}

fn setup(seed: u64, bs: usize, capacity: usize) -> Setup {
    let page_size = 16;
    let pages_per_req = capacity.div_ceil(page_size);
    let num_pages = bs * pages_per_req;
    let mut next = xorshift(seed);
    let rows = random_bf16(&mut next, num_pages * page_size * ROW);
    // Reverse page order so that logical and physical order differ.
    let table = (0..num_pages as i32).rev().collect();
    Setup { rows, table, layout: KvLayout { layers: 1, num_pages, page_size, row_elems: ROW, pages_per_req } }
}

#[test]
fn a_request_gives_the_same_bits_alone_and_in_a_batch() {
    let (bs, heads, capacity) = (32, 8, 600);
    let s = setup(11, bs, capacity);
    let cache = PagedCache { rows: &s.rows, layout: s.layout, block_table: &s.table };
    let mut next = xorshift(12);
    let q = random_bf16(&mut next, bs * heads * ROW);
    let seq: Vec<i32> = (0..bs as i32).map(|b| 1 + (b * 37) % 599).collect();
    let batch = mla_decode(&q, heads, &cache, &seq, kimi_scale()).unwrap();
    for b in [0, 7, 31] {
        let ppr = s.layout.pages_per_req;
        let alone_cache = PagedCache { rows: &s.rows, layout: s.layout, block_table: &s.table[b * ppr..(b + 1) * ppr] };
        let alone =
            mla_decode(&q[b * heads * ROW..(b + 1) * heads * ROW], heads, &alone_cache, &seq[b..=b], kimi_scale())
                .unwrap();
        assert_eq!(alone.o, batch.o[b * heads * LATENT..(b + 1) * heads * LATENT]);
        assert_eq!(alone.lse, batch.lse[b * heads..(b + 1) * heads]);
    }
}

#[test]
fn a_tree_row_equals_a_decode_over_its_logical_sequence() {
    // One request, prefix 300 (two chunks), a small tree: rows 1 and 2 children of the root, 3 of 1, 4 of 3.
    let (heads, prefix, n) = (16, 300usize, 5usize);
    let parent = [-1i32, 0, 0, 1, 3];
    let vis: Vec<u32> = (0..n)
        .map(|i| {
            let mut bits = 1u32 << i;
            let mut p = parent[i];
            while p >= 0 {
                bits |= 1 << p;
                p = parent[p as usize];
            }
            bits
        })
        .collect();
    let s = setup(21, 1, prefix + n);
    let cache = PagedCache { rows: &s.rows, layout: s.layout, block_table: &s.table };
    let mut next = xorshift(22);
    let q = random_bf16(&mut next, n * heads * ROW);
    let tree = tree_verify(&q, n, heads, &cache, &[prefix as i32], &vis, kimi_scale()).unwrap();
    for (row, bits) in vis.iter().enumerate() {
        // A compacted copy: the prefix, then the row's visible tree rows in row order, contiguous.
        let visible: Vec<usize> = (0..n).filter(|j| bits >> j & 1 == 1).collect();
        let c = setup(21, 1, prefix + n);
        let mut rows = c.rows.clone();
        for (k, &j) in visible.iter().enumerate() {
            let (src, dst) = (slot(&s, prefix + j), slot(&c, prefix + k));
            rows[dst..dst + ROW].copy_from_slice(&s.rows[src..src + ROW]);
        }
        let decode_cache = PagedCache { rows: &rows, layout: c.layout, block_table: &c.table };
        let seq = (prefix + visible.len()) as i32;
        let q_row = &q[row * heads * ROW..(row + 1) * heads * ROW];
        let decode = mla_decode(q_row, heads, &decode_cache, &[seq], kimi_scale()).unwrap();
        assert_eq!(decode.o, tree.o[row * heads * LATENT..(row + 1) * heads * LATENT], "row {row}: o");
        assert_eq!(decode.lse, tree.lse[row * heads..(row + 1) * heads], "row {row}: lse");
    }
}

/// Element offset of `slot` in a setup's cache.
fn slot(s: &Setup, slot: usize) -> usize {
    s.layout.slot_offset(&s.table, 0, slot).unwrap()
}

#[test]
fn a_root_only_tree_equals_a_decode() {
    let (heads, prefix) = (8, 65usize);
    let s = setup(31, 1, prefix + 1);
    let cache = PagedCache { rows: &s.rows, layout: s.layout, block_table: &s.table };
    let mut next = xorshift(32);
    let q = random_bf16(&mut next, heads * ROW);
    let tree = tree_verify(&q, 1, heads, &cache, &[prefix as i32], &[1], kimi_scale()).unwrap();
    let decode = mla_decode(&q, heads, &cache, &[prefix as i32 + 1], kimi_scale()).unwrap();
    assert_eq!(tree, decode);
}

#[test]
fn bad_input_is_a_named_error() {
    let s = setup(41, 1, 64);
    let cache = PagedCache { rows: &s.rows, layout: s.layout, block_table: &s.table };
    let q = vec![bf16::ONE; 8 * ROW];
    let scale = kimi_scale();
    assert!(matches!(mla_decode(&q[..7 * ROW], 7, &cache, &[10], scale), Err(Error::Param { name: "heads", .. })));
    assert!(matches!(mla_decode(&q, 8, &cache, &[65], scale), Err(Error::Param { name: "seq_len", .. })));
    assert!(matches!(mla_decode(&q, 8, &cache, &[0], scale), Err(Error::Param { name: "seq_len", .. })));
    assert!(matches!(mla_decode(&q[1..], 8, &cache, &[10], scale), Err(Error::Shape { name: "q", .. })));
    assert!(matches!(mla_decode(&q, 8, &cache, &[10], f32::NAN), Err(Error::Param { name: "softmax_scale", .. })));
    let bad_table = vec![99; s.table.len()];
    let bad_cache = PagedCache { block_table: &bad_table, ..cache };
    assert!(matches!(mla_decode(&q, 8, &bad_cache, &[10], scale), Err(Error::Index { name: "block_table", .. })));
    let q3 = vec![bf16::ONE; 3 * 8 * ROW];
    let short = tree_verify(&q3, 3, 8, &cache, &[10], &[1, 3], scale);
    assert!(matches!(short, Err(Error::Shape { name: "visibility", .. })), "a bitmask too short is an error");
    assert!(matches!(
        tree_verify(&q3, 3, 8, &cache, &[62], &[1, 3, 5], scale),
        Err(Error::Param { name: "seq_len", .. })
    ));
}

#[cfg(feature = "cuda")]
mod gpu {
    use super::*;
    use common::{assert_bits, capture_gpu, gpu, replay_graph};
    use kdtree_engine::cpu::tree_build::build_trees;
    use kdtree_engine::TreeShape;
    use proptest::prelude::*;

    /// GPU against CPU, per position: each is within its fixture tolerance of float64, so they are within
    /// twice the widest fixture tolerance of each other.
    fn gpu_vs_cpu_tolerance() -> Tolerance {
        let all: Vec<Tolerance> = cases("mla_decode").iter().chain(&cases("tree_verify")).map(Tolerance::of).collect();
        let widest = |f: fn(&Tolerance) -> f64| 2.0 * all.iter().map(f).fold(0.0, f64::max);
        Tolerance { o_rel: widest(|t| t.o_rel), lse_abs: widest(|t| t.lse_abs) }
    }

    fn assert_same_output(name: &str, got: &MlaOutput, want: &MlaOutput) {
        assert_bits(name, "o", &got.o, &want.o);
        assert_bits(name, "lse", &got.lse, &want.lse);
    }

    /// A paged cache of `bs` requests with `capacity` slots each, page size `page_size`, pages in
    /// shuffled order.
    fn paged(seed: u64, bs: usize, capacity: usize, page_size: usize) -> Setup {
        let pages_per_req = capacity.div_ceil(page_size);
        let num_pages = bs * pages_per_req + 1;
        let mut next = xorshift(seed);
        let rows = random_bf16(&mut next, num_pages * page_size * ROW);
        let mut table: Vec<i32> = (0..(bs * pages_per_req) as i32).collect();
        for i in (1..table.len()).rev() {
            table.swap(i, (next() % (i as u64 + 1)) as usize);
        }
        Setup { rows, table, layout: KvLayout { layers: 1, num_pages, page_size, row_elems: ROW, pages_per_req } }
    }

    fn cache_of(s: &Setup) -> PagedCache<'_> {
        PagedCache { rows: &s.rows, layout: s.layout, block_table: &s.table }
    }

    /// Real tree_build trees of `budget` nodes over L 15 from peaked draft log-probs: a deep main chain
    /// with branches.
    fn trees(seed: u64, bs: usize, budget: usize, seq_len: &[i32]) -> Vec<u32> {
        let (depth, k) = (15, budget.min(32));
        let mut next = xorshift(seed);
        let mut logp = vec![0.0f32; bs * depth * k];
        for row in logp.chunks_mut(k) {
            let spread = 0.3 + (next() % 1000) as f32 * 0.003;
            let mut v = -((next() % 100) as f32) * 0.001;
            for x in row.iter_mut() {
                *x = v;
                v -= spread * (0.5 + (next() % 1000) as f32 * 0.001);
            }
        }
        let ids: Vec<i32> = (0..bs * depth * k).map(|i| (i % k) as i32).collect();
        let shape = TreeShape::new(bs, depth, budget).unwrap();
        build_trees(shape, k, &ids, &logp, &vec![1; bs], seq_len).unwrap().visibility
    }

    fn scale() -> f32 {
        kimi_scale()
    }

    fn gpu_decode(gpu: &kdtree_engine::cuda::Gpu, case: &Fixture) -> MlaOutput {
        let x = MlaInputs::load(case);
        gpu.mla_decode(&x.q, case.usize("H").unwrap(), &x.cache(), &x.seq_len, x.scale).unwrap()
    }

    fn gpu_tree_verify(gpu: &kdtree_engine::cuda::Gpu, case: &Fixture) -> MlaOutput {
        let x = MlaInputs::load(case);
        let (n, h) = (case.usize("N").unwrap(), case.usize("H").unwrap());
        let vis = case.array::<u32>("visibility").unwrap();
        gpu.tree_verify(&x.q, n, h, &x.cache(), &x.seq_len, &vis, x.scale).unwrap()
    }

    #[test]
    fn gpu_matches_every_fixture() {
        let Some(gpu) = gpu() else { return };
        matches_every_fixture("gpu", "mla_decode", |case| gpu_decode(gpu, case));
        matches_every_fixture("gpu", "tree_verify", |case| gpu_tree_verify(gpu, case));
    }

    #[test]
    fn gpu_rejects_every_mutant() {
        let Some(gpu) = gpu() else { return };
        rejects_every_mutant("gpu", "mla_decode", |case| gpu_decode(gpu, case));
        rejects_every_mutant("gpu", "tree_verify", |case| gpu_tree_verify(gpu, case));
    }

    /// GPU vs CPU for one batch: decode when `budget` is 0, else tree verify over real trees.
    fn gpu_vs_cpu(name: &str, seed: u64, heads: usize, page_size: usize, seq: &[i32], budget: usize) {
        let Some(gpu) = gpu() else { return };
        let (bs, n) = (seq.len(), if budget == 0 { 1 } else { budget + 1 });
        let extra = if budget == 0 { 0 } else { n };
        let capacity = *seq.iter().max().unwrap() as usize + extra;
        let s = paged(seed, bs, capacity.max(1), page_size);
        let mut next = xorshift(seed ^ 0x5eed);
        let q = random_bf16(&mut next, bs * n * heads * ROW);
        let (want, got) = if budget == 0 {
            (
                mla_decode(&q, heads, &cache_of(&s), seq, scale()).unwrap(),
                gpu.mla_decode(&q, heads, &cache_of(&s), seq, scale()).unwrap(),
            )
        } else {
            let vis = trees(seed, bs, budget, seq);
            (
                tree_verify(&q, n, heads, &cache_of(&s), seq, &vis, scale()).unwrap(),
                gpu.tree_verify(&q, n, heads, &cache_of(&s), seq, &vis, scale()).unwrap(),
            )
        };
        let name = format!("{name}: H {heads} page {page_size} seq {seq:?} B {budget}");
        let tol = gpu_vs_cpu_tolerance();
        let (o, lse) = check_mla(&got, &want.o, &want.lse, heads, tol).unwrap_or_else(|e| panic!("{name}: {e}"));
        println!("{name}: worst o_rel {:.2e}, lse_abs {:.2e} against the CPU (tolerance {tol:?})", o.error, lse.error);
    }

    const PREFIXES: [i32; 11] = [0, 1, 63, 64, 65, 255, 256, 257, 511, 1500, 2900];

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(16))]
        #[test]
        fn gpu_matches_cpu_on_random_shapes(
            seed in any::<u64>(),
            heads in prop::sample::select(vec![1usize, 2, 4, 8, 16, 32]),
            page_size in prop::sample::select(vec![1usize, 16, 64]),
            prefix_picks in prop::collection::vec(0usize..PREFIXES.len(), 1..4),
            budget in prop::sample::select(vec![0usize, 16, 64]),
        ) {
            // A decode needs at least one row; a tree request may have an empty prefix.
            let seq: Vec<i32> = prefix_picks.iter().map(|&i| PREFIXES[i].max((budget == 0) as i32)).collect();
            // Trees keep to 16 heads so that the CPU reference stays fast.
            let heads = if budget == 0 { heads } else { heads.min(16) };
            gpu_vs_cpu("random", seed, heads, page_size, &seq, budget);
        }
    }

    #[test]
    fn gpu_matches_cpu_on_long_prefixes_and_many_heads() {
        gpu_vs_cpu("decode 64 heads", 1, 64, 64, &[4096, 1000], 0);
        gpu_vs_cpu("decode 128 heads", 2, 128, 16, &[1000, 4096, 1], 0);
        gpu_vs_cpu("tree 64 heads", 3, 64, 64, &[1000], 64);
        gpu_vs_cpu("tree 128 heads", 4, 128, 16, &[300, 0], 16);
        gpu_vs_cpu("tree long prefix", 5, 8, 64, &[4096, 4000], 64);
        gpu_vs_cpu("decode bs 32", 6, 16, 16, &(0..32).map(|b| 1 + b * 97).collect::<Vec<i32>>(), 0);
        gpu_vs_cpu("tree bs 32", 7, 8, 16, &(0..32).map(|b| b * 41).collect::<Vec<i32>>(), 16);
        // 128 rows: the combine takes 128 dims per CTA and stages at most 64 chunks' partials at a time,
        // so these rows (65 and 66 chunks) fold over two windows.
        gpu_vs_cpu("decode over two combine windows", 8, 64, 64, &[16500, 16700], 0);
    }

    /// Fewer than 8 heads, as a split over ranks gives (Kimi-K2's 64 heads over 16 ranks, a small model's
    /// 8 over 2 or 4): decode and tree rows, one request and a batch, short and multi-chunk prefixes.
    #[test]
    fn gpu_matches_cpu_below_eight_heads() {
        for heads in [1usize, 2, 4] {
            let seed = 20 + heads as u64;
            gpu_vs_cpu(&format!("decode {heads} heads"), seed, heads, 16, &[1, 300, 2900], 0);
            gpu_vs_cpu(&format!("tree {heads} heads"), seed + 1, heads, 16, &[0, 257, 1500], 16);
            gpu_vs_cpu(&format!("tree {heads} heads, 64 rows"), seed + 2, heads, 64, &[700], 64);
        }
    }

    /// A tree batch: bs requests with prefixes `seq`, budget B, on a page-16 cache; q and visibility.
    struct TreeBatch {
        s: Setup,
        seq: Vec<i32>,
        q: Vec<bf16>,
        vis: Vec<u32>,
        n: usize,
        heads: usize,
    }

    fn tree_batch(seed: u64, heads: usize, seq: Vec<i32>, budget: usize) -> TreeBatch {
        let n = budget + 1;
        let s = paged(seed, seq.len(), *seq.iter().max().unwrap() as usize + n, 16);
        let mut next = xorshift(seed ^ 0x9);
        let q = random_bf16(&mut next, seq.len() * n * heads * ROW);
        let vis = trees(seed, seq.len(), budget, &seq);
        TreeBatch { s, seq, q, vis, n, heads }
    }

    impl TreeBatch {
        fn run(&self, gpu: &kdtree_engine::cuda::Gpu) -> MlaOutput {
            gpu.tree_verify(&self.q, self.n, self.heads, &cache_of(&self.s), &self.seq, &self.vis, scale()).unwrap()
        }

        /// Request b alone: its block-table row, prefix, queries and bitmask.
        fn alone(&self, gpu: &kdtree_engine::cuda::Gpu, b: usize) -> MlaOutput {
            let (ppr, w, per_req) = (self.s.layout.pages_per_req, self.n.div_ceil(32), self.n * self.heads * ROW);
            let cache = PagedCache { block_table: &self.s.table[b * ppr..(b + 1) * ppr], ..cache_of(&self.s) };
            let vis = &self.vis[b * self.n * w..(b + 1) * self.n * w];
            let q = &self.q[b * per_req..(b + 1) * per_req];
            gpu.tree_verify(q, self.n, self.heads, &cache, &self.seq[b..=b], vis, scale()).unwrap()
        }
    }

    #[test]
    fn gpu_is_deterministic() {
        let Some(gpu) = gpu() else { return };
        let t = tree_batch(51, 16, vec![700, 256, 3], 64);
        assert_same_output("tree run twice", &t.run(gpu), &t.run(gpu));
        let cache = cache_of(&t.s);
        let q = &t.q[..3 * 16 * ROW];
        let a = gpu.mla_decode(q, 16, &cache, &[700, 255, 1], scale()).unwrap();
        assert_same_output("decode run twice", &gpu.mla_decode(q, 16, &cache, &[700, 255, 1], scale()).unwrap(), &a);
    }

    #[test]
    fn gpu_requests_give_the_same_bits_alone_and_in_a_batch_of_32() {
        let Some(gpu) = gpu() else { return };
        for heads in [8, 64] {
            let seq: Vec<i32> = (0..32).map(|b| 1 + (b * 131) % 1200).collect();
            let t = tree_batch(61 + heads as u64, heads, seq, 16);
            let batch = t.run(gpu);
            let rows = t.n * heads;
            for b in [0usize, 5, 31] {
                let name = format!("tree H {heads} request {b}");
                let alone = t.alone(gpu, b);
                assert_bits(&name, "o", &alone.o, &batch.o[b * rows * LATENT..(b + 1) * rows * LATENT]);
                assert_bits(&name, "lse", &alone.lse, &batch.lse[b * rows..(b + 1) * rows]);
            }
            // Decode: the first tree row's queries of every request, over its prefix.
            let q: Vec<bf16> = (0..32).flat_map(|b| t.q[b * rows * ROW..(b * rows + heads) * ROW].to_vec()).collect();
            let batch = gpu.mla_decode(&q, heads, &cache_of(&t.s), &t.seq, scale()).unwrap();
            let ppr = t.s.layout.pages_per_req;
            for b in [0usize, 5, 31] {
                let cache = PagedCache { block_table: &t.s.table[b * ppr..(b + 1) * ppr], ..cache_of(&t.s) };
                let q_b = &q[b * heads * ROW..(b + 1) * heads * ROW];
                let alone = gpu.mla_decode(q_b, heads, &cache, &t.seq[b..=b], scale()).unwrap();
                let name = format!("decode H {heads} request {b}");
                assert_bits(&name, "o", &alone.o, &batch.o[b * heads * LATENT..(b + 1) * heads * LATENT]);
                assert_bits(&name, "lse", &alone.lse, &batch.lse[b * heads..(b + 1) * heads]);
            }
        }
    }

    /// Large decode batches run several chunks in a CTA (src/cuda/mla.rs `chunk_runs`): at H 64 this
    /// batch folds them by groups of four, at H 8 it runs pairs of chunks, each written to its own slot.
    /// A request alone takes one chunk a CTA: both must give the same bits.
    #[test]
    fn gpu_decodes_run_in_folds_or_pairs_give_the_same_bits_as_a_request_alone() {
        let Some(gpu) = gpu() else { return };
        let bs = 64usize;
        let seq: Vec<i32> = (0..bs as i32).map(|b| 1024 + b * 16).collect();
        let s = paged(91, bs, 2048, 64);
        let ppr = s.layout.pages_per_req;
        for heads in [64usize, 8] {
            let mut next = xorshift(92 + heads as u64);
            let q = random_bf16(&mut next, bs * heads * ROW);
            let batch = gpu.mla_decode(&q, heads, &cache_of(&s), &seq, scale()).unwrap();
            for b in [0usize, 17, 63] {
                let cache = PagedCache { block_table: &s.table[b * ppr..(b + 1) * ppr], ..cache_of(&s) };
                let q_b = &q[b * heads * ROW..(b + 1) * heads * ROW];
                let alone = gpu.mla_decode(q_b, heads, &cache, &seq[b..=b], scale()).unwrap();
                let name = format!("H {heads} decode request {b} of a batch");
                assert_bits(&name, "o", &alone.o, &batch.o[b * heads * LATENT..(b + 1) * heads * LATENT]);
                assert_bits(&name, "lse", &alone.lse, &batch.lse[b * heads..(b + 1) * heads]);
            }
        }
    }

    /// Decode and tree-verify runs captured in one graph and replayed give the eager runs' bits. The
    /// runs share one plan's scratch and status word, and a replayed graph runs the kernels back to back
    /// with no host work between them, so a kernel that touched the scratch or the status word before the
    /// previous kernel was done would show here. (The MLA kernels launch plainly; with programmatic
    /// dependent launches, tried in session 13, the test passed as well.)
    #[test]
    fn gpu_runs_replayed_from_a_graph_give_the_eager_bits() {
        use kdtree_engine::cuda::mla::{DeviceCache, DeviceMlaOutput, MlaPlan};
        let Some(own) = capture_gpu() else { return };
        let gpu = &own;
        let (heads, steps) = (8usize, 3usize);
        // Prefixes of several chunks, one of them long enough for the tree prefix to span fold groups.
        let t = tree_batch(81, heads, vec![1500, 300, 65], 16);
        let (bs, rows) = (t.seq.len(), t.n * heads);
        let max_len = *t.seq.iter().max().unwrap() as usize + t.n;
        let mut next = xorshift(82);
        let q = gpu.upload(&random_bf16(&mut next, steps * bs * rows * ROW)).unwrap();
        let (cache_rows, table) = (gpu.upload(&t.s.rows).unwrap(), gpu.upload(&t.s.table).unwrap());
        let (seq, vis) = (gpu.upload(&t.seq).unwrap(), gpu.upload(&t.vis).unwrap());
        let cache = DeviceCache { rows: cache_rows.as_view(), layout: t.s.layout, block_table: table.as_view() };
        let mut plan = MlaPlan::new(gpu, bs, heads, max_len, t.n).unwrap();
        // Per step: a decode (over the step's first bs · H query rows), then a tree verify; every
        // output buffer holds all steps.
        let (dec_rows, tree_rows) = (bs * heads, bs * rows);
        let outputs = || -> [cudarc::driver::CudaSlice<f32>; 4] {
            [dec_rows * LATENT, dec_rows, tree_rows * LATENT, tree_rows].map(|n| gpu.zeros::<f32>(steps * n).unwrap())
        };
        let run = |plan: &mut MlaPlan, out: &mut [cudarc::driver::CudaSlice<f32>; 4]| {
            let [dec_o, dec_lse, tree_o, tree_lse] = out;
            for s in 0..steps {
                let q_step = q.slice(s * tree_rows * ROW..(s + 1) * tree_rows * ROW);
                let q_dec = q.slice(s * tree_rows * ROW..s * tree_rows * ROW + dec_rows * ROW);
                let mut dec = DeviceMlaOutput {
                    o: dec_o.slice_mut(s * dec_rows * LATENT..(s + 1) * dec_rows * LATENT),
                    lse: dec_lse.slice_mut(s * dec_rows..(s + 1) * dec_rows),
                };
                plan.run_decode(gpu, &q_dec, &cache, &seq.as_view(), max_len, scale(), &mut dec).unwrap();
                let mut tree = DeviceMlaOutput {
                    o: tree_o.slice_mut(s * tree_rows * LATENT..(s + 1) * tree_rows * LATENT),
                    lse: tree_lse.slice_mut(s * tree_rows..(s + 1) * tree_rows),
                };
                let vis = vis.as_view();
                plan.run_tree_verify(gpu, &q_step, t.n, &cache, &seq.as_view(), max_len, &vis, scale(), &mut tree)
                    .unwrap();
            }
        };
        let mut eager = outputs();
        run(&mut plan, &mut eager);
        plan.check_status(gpu).unwrap();
        let mut replayed = outputs();
        replay_graph(gpu, 3, || run(&mut plan, &mut replayed));
        plan.check_status(gpu).unwrap();
        for (name, (got, want)) in
            ["decode o", "decode lse", "tree o", "tree lse"].iter().zip(replayed.iter().zip(&eager))
        {
            assert_bits("graph replay", name, &gpu.download(got).unwrap(), &gpu.download(want).unwrap());
        }
    }

    #[test]
    fn gpu_root_only_tree_equals_a_decode() {
        let Some(gpu) = gpu() else { return };
        for (heads, prefix) in [(8, 0usize), (16, 255), (64, 512), (128, 70)] {
            let s = paged(71, 1, prefix + 1, 16);
            let mut next = xorshift(72);
            let q = random_bf16(&mut next, heads * ROW);
            let tree = gpu.tree_verify(&q, 1, heads, &cache_of(&s), &[prefix as i32], &[1], scale()).unwrap();
            let decode = gpu.mla_decode(&q, heads, &cache_of(&s), &[prefix as i32 + 1], scale()).unwrap();
            assert_same_output(&format!("root only, H {heads}, prefix {prefix}"), &tree, &decode);
        }
    }

    #[test]
    fn gpu_tree_rows_equal_decodes_over_their_compacted_sequences() {
        let Some(gpu) = gpu() else { return };
        // Prefix 250: the tails of deep rows span two chunks; 512: the tail starts a chunk; 1000: mid chunk;
        // 4096: the prefix launch runs pairs of chunks (33 m-tiles × 16 chunks, src/cuda/mla.rs `chunk_runs`).
        for (heads, prefix, budget) in [(8, 250usize, 64usize), (16, 512, 16), (64, 1000, 64), (8, 4096, 64)] {
            let t = tree_batch(81 + prefix as u64, heads, vec![prefix as i32], budget);
            let tree = t.run(gpu);
            let w = t.n.div_ceil(32);
            let depth = |row: usize| (0..t.n).filter(|&j| t.vis[row * w + j / 32] >> (j % 32) & 1 == 1).count();
            let deepest = (0..t.n).max_by_key(|&r| depth(r)).unwrap();
            for row in [0, 1, 2, deepest, t.n - 1] {
                let visible: Vec<usize> = (0..t.n).filter(|&j| t.vis[row * w + j / 32] >> (j % 32) & 1 == 1).collect();
                let mut rows = t.s.rows.clone();
                for (k, &j) in visible.iter().enumerate() {
                    let (src, dst) = (slot(&t.s, prefix + j), slot(&t.s, prefix + k));
                    rows[dst..dst + ROW].copy_from_slice(&t.s.rows[src..src + ROW]);
                }
                let cache = PagedCache { rows: &rows, ..cache_of(&t.s) };
                let q = &t.q[row * heads * ROW..(row + 1) * heads * ROW];
                let seq = (prefix + visible.len()) as i32;
                let decode = gpu.mla_decode(q, heads, &cache, &[seq], scale()).unwrap();
                let name = format!("H {heads} prefix {prefix} row {row} ({} visible)", visible.len());
                assert_bits(&name, "o", &decode.o, &tree.o[row * heads * LATENT..(row + 1) * heads * LATENT]);
                assert_bits(&name, "lse", &decode.lse, &tree.lse[row * heads..(row + 1) * heads]);
            }
        }
    }

    #[test]
    fn gpu_bad_input_is_a_named_error() {
        use kdtree_engine::cuda::mla::{DeviceCache, DeviceMlaOutput, MlaPlan};
        let Some(gpu) = gpu() else { return };
        let s = setup(41, 1, 64);
        let cache = PagedCache { rows: &s.rows, layout: s.layout, block_table: &s.table };
        let q = vec![bf16::ONE; 8 * ROW];
        let sc = scale();
        assert!(matches!(gpu.mla_decode(&q[..7 * ROW], 7, &cache, &[10], sc), Err(Error::Param { name: "heads", .. })));
        assert!(matches!(gpu.mla_decode(&q, 8, &cache, &[65], sc), Err(Error::Param { name: "seq_len", .. })));
        assert!(matches!(gpu.mla_decode(&q, 8, &cache, &[0], sc), Err(Error::Param { name: "seq_len", .. })));
        assert!(matches!(gpu.mla_decode(&q[1..], 8, &cache, &[10], sc), Err(Error::Shape { name: "q", .. })));
        assert!(matches!(gpu.mla_decode(&q, 8, &cache, &[10], 0.0), Err(Error::Param { name: "softmax_scale", .. })));
        let bad_table = vec![99; s.table.len()];
        let bad_cache = PagedCache { block_table: &bad_table, ..cache };
        assert!(matches!(gpu.mla_decode(&q, 8, &bad_cache, &[10], sc), Err(Error::Index { name: "block_table", .. })));
        let q3 = vec![bf16::ONE; 3 * 8 * ROW];
        let short = gpu.tree_verify(&q3, 3, 8, &cache, &[10], &[1, 3], sc);
        assert!(matches!(short, Err(Error::Shape { name: "visibility", .. })));
        let long = gpu.tree_verify(&q3, 3, 8, &cache, &[62], &[1, 3, 5], sc);
        assert!(matches!(long, Err(Error::Param { name: "seq_len", .. })));
        assert!(matches!(MlaPlan::new(gpu, 1, 12, 64, 1), Err(Error::Param { name: "heads", .. })));
        assert!(matches!(MlaPlan::new(gpu, 1, 8, 64, 300), Err(Error::Param { name: "MlaPlan", .. })));

        // Device path: a batch larger than the plan, and a page id out of range (reported by status).
        let mut plan = MlaPlan::new(gpu, 1, 8, 64, 1).unwrap();
        let (q_dev, rows, seq2) =
            (gpu.upload(&q).unwrap(), gpu.upload(&s.rows).unwrap(), gpu.upload(&[10, 10]).unwrap());
        let (table, bad) = (gpu.upload(&s.table).unwrap(), gpu.upload(&bad_table).unwrap());
        let (mut o, mut lse) = (gpu.zeros::<f32>(2 * 8 * LATENT).unwrap(), gpu.zeros::<f32>(2 * 8).unwrap());
        let dev_cache = DeviceCache { rows: rows.as_view(), layout: s.layout, block_table: table.as_view() };
        let mut out = DeviceMlaOutput { o: o.slice_mut(..2 * 8 * LATENT), lse: lse.slice_mut(..16) };
        let too_many = plan.run_decode(gpu, &q_dev.as_view(), &dev_cache, &seq2.as_view(), 64, sc, &mut out);
        assert!(matches!(too_many, Err(Error::Shape { .. }) | Err(Error::Param { .. })), "{too_many:?}");
        let seq1 = gpu.upload(&[10]).unwrap();
        let mut out = DeviceMlaOutput { o: o.slice_mut(..8 * LATENT), lse: lse.slice_mut(..8) };
        let bad_cache = DeviceCache { rows: rows.as_view(), layout: s.layout, block_table: bad.as_view() };
        plan.run_decode(gpu, &q_dev.as_view(), &bad_cache, &seq1.as_view(), 64, sc, &mut out).unwrap();
        assert!(matches!(plan.check_status(gpu), Err(Error::Index { name: "block_table", .. })));
        plan.run_decode(gpu, &q_dev.as_view(), &dev_cache, &seq1.as_view(), 10, sc, &mut out).unwrap();
        plan.check_status(gpu).unwrap();
        // A bound above the plan's is refused; a sequence past the run's bound is reported by status and
        // its rows get o = 0, lse = -inf.
        let over = plan.run_decode(gpu, &q_dev.as_view(), &dev_cache, &seq1.as_view(), 65, sc, &mut out);
        assert!(matches!(over, Err(Error::Param { name: "max_seq_len", .. })), "{over:?}");
        plan.run_decode(gpu, &q_dev.as_view(), &dev_cache, &seq1.as_view(), 9, sc, &mut out).unwrap();
        assert!(matches!(plan.check_status(gpu), Err(Error::Param { name: "seq_len", .. })));
        assert!(gpu.download(&lse).unwrap()[..8].iter().all(|&x| x == f32::NEG_INFINITY));
        assert!(gpu.download(&o).unwrap()[..8 * LATENT].iter().all(|&x| x == 0.0));
    }
}
