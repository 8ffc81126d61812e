//! MLA decode and tree verify: CPU against the float64 numpy fixtures (tolerances from meta.json), and the
//! properties the engine relies on: batch invariance, a tree row equal to a decode over the same logical
//! sequence, a root-only tree equal to a decode; and bad input.

mod common;

use common::{cases, xorshift};
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

/// Relative Frobenius error of `o` and max absolute error of `lse` (-inf must match -inf).
fn check_close(name: &str, case: &Fixture, got: &MlaOutput) {
    let (want_o, want_lse) = (case.array::<f32>("o").unwrap(), case.array::<f32>("lse").unwrap());
    assert_eq!(got.o.len(), want_o.len(), "{name}: o length");
    let (mut err, mut norm) = (0.0f64, 0.0f64);
    for (g, w) in got.o.iter().zip(&want_o) {
        err += (*g as f64 - *w as f64).powi(2);
        norm += (*w as f64).powi(2);
    }
    let rel = (err / norm.max(f64::MIN_POSITIVE)).sqrt();
    let tol_o = case.f64("tol_o_rel").unwrap();
    assert!(rel <= tol_o, "{name}: o relative error {rel:e} > {tol_o:e}");
    let tol_lse = case.f64("tol_lse_abs").unwrap();
    for (i, (g, w)) in got.lse.iter().zip(&want_lse).enumerate() {
        if w.is_infinite() {
            assert_eq!(g, w, "{name}: lse[{i}]");
        } else {
            assert!((g - w).abs() as f64 <= tol_lse, "{name}: lse[{i}] {g} vs {w}");
        }
    }
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

#[test]
fn cpu_decode_matches_every_fixture() {
    for case in cases("mla_decode") {
        let x = MlaInputs::load(&case);
        let got = mla_decode(&x.q, case.usize("H").unwrap(), &x.cache(), &x.seq_len, x.scale);
        check_close(&case.name(), &case, &got.unwrap());
    }
}

#[test]
fn cpu_tree_verify_matches_every_fixture() {
    for case in cases("tree_verify") {
        let x = MlaInputs::load(&case);
        let (n, h) = (case.usize("N").unwrap(), case.usize("H").unwrap());
        let vis = case.array::<u32>("visibility").unwrap();
        let got = tree_verify(&x.q, n, h, &x.cache(), &x.seq_len, &vis, x.scale);
        check_close(&case.name(), &case, &got.unwrap());
    }
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
