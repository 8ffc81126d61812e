//! KV compaction: CPU and GPU against the numpy fixtures (bit-exact), GPU against CPU on random paths,
//! and bad input.

mod common;

use common::{assert_same, cases};
use half::bf16;
use kdtree_engine::cpu::kv_compact::kv_compact;
use kdtree_engine::fixture::Fixture;
use kdtree_engine::{Error, KvLayout};

/// (layout, block_table, seq_len, accept_len, accept_rows, L, N, cache) of a fixture.
struct Case {
    layout: KvLayout,
    table: Vec<i32>,
    seq_len: Vec<i32>,
    accept_len: Vec<i32>,
    accept_rows: Vec<i32>,
    depth: usize,
    n_rows: usize,
    cache: Vec<bf16>,
}

fn load(case: &Fixture) -> Case {
    let u = |k| case.usize(k).unwrap();
    let table = case.array::<i32>("block_table").unwrap();
    let bs = u("bs");
    let layout = KvLayout {
        layers: u("layers"),
        num_pages: u("pages"),
        page_size: u("page_size"),
        row_elems: u("D"),
        pages_per_req: table.len() / bs,
    };
    let bits: Vec<u16> = case.array("cache").unwrap();
    Case {
        layout,
        table,
        seq_len: case.array("seq_len").unwrap(),
        accept_len: case.array("accept_len").unwrap(),
        accept_rows: case.array("accept_rows").unwrap(),
        depth: u("L"),
        n_rows: u("N"),
        cache: bits.into_iter().map(bf16::from_bits).collect(),
    }
}

fn expected(case: &Fixture) -> Vec<u16> {
    case.array("cache_out").unwrap()
}

/// Whether request `b` moves a row to another slot (accept_rows[j] != j for some step j; a step with
/// accept_rows[j] == j, such as every step of a budget-1 tree, copies a slot onto itself).
fn moves_a_row(c: &Case, b: usize) -> bool {
    let w = c.depth + 1;
    (1..=c.accept_len[b].max(0) as usize).any(|j| c.accept_rows[b * w + j] != j as i32)
}

/// A fixture in which a request other than the last moves a row to another slot, so that a partial write
/// (before an error found in a later request) would show in the cache.
fn case_with_a_move() -> Case {
    cases("kv_compact")
        .iter()
        .map(load)
        .find(|c| (0..c.seq_len.len() - 1).any(|b| moves_a_row(c, b)))
        .expect("a case with a move")
}

fn first_mover(c: &Case) -> usize {
    (0..c.seq_len.len()).find(|&b| moves_a_row(c, b)).expect("a request with a move")
}

fn bits(cache: &[bf16]) -> Vec<u16> {
    cache.iter().map(|x| x.to_bits()).collect()
}

#[test]
fn cpu_matches_every_fixture() {
    for case in cases("kv_compact") {
        let mut c = load(&case);
        kv_compact(&mut c.cache, &c.layout, &c.table, &c.seq_len, &c.accept_len, &c.accept_rows, c.depth, c.n_rows)
            .unwrap();
        assert_same(&case.name(), "cache_out", &bits(&c.cache), &expected(&case));
    }
}

#[test]
fn bad_input_is_a_named_error() {
    let c = case_with_a_move();
    let run = |table: &[i32], rows: &[i32]| {
        let mut cache = c.cache.clone();
        kv_compact(&mut cache, &c.layout, table, &c.seq_len, &c.accept_len, rows, c.depth, c.n_rows)
    };
    let w = c.depth + 1;
    let b = first_mover(&c);
    let mut rows = c.accept_rows.clone();
    rows[b * w + 1] = c.n_rows as i32;
    assert!(matches!(run(&c.table, &rows), Err(Error::Index { name: "accept_rows", .. })));
    let mut table = c.table.clone();
    table.iter_mut().for_each(|p| *p = c.layout.num_pages as i32);
    assert!(matches!(run(&table, &c.accept_rows), Err(Error::Index { name: "block_table", .. })));
    assert!(matches!(run(&c.table[1..], &c.accept_rows), Err(Error::Shape { name: "block_table", .. })));

    // A bad later request leaves the cache untouched, even for the requests before it.
    let last = c.seq_len.len() - 1;
    let mut rows = c.accept_rows.clone();
    let mut alen = c.accept_len.clone();
    alen[last] = 1;
    rows[last * w + 1] = c.n_rows as i32;
    let mut cache = c.cache.clone();
    let err = kv_compact(&mut cache, &c.layout, &c.table, &c.seq_len, &alen, &rows, c.depth, c.n_rows).unwrap_err();
    assert!(matches!(err, Error::Index { name: "accept_rows", .. }), "{err}");
    assert_eq!(bits(&cache), bits(&c.cache));

    let zero_pages = KvLayout { page_size: 0, ..c.layout };
    let mut cache = c.cache.clone();
    let err =
        kv_compact(&mut cache, &zero_pages, &c.table, &c.seq_len, &c.accept_len, &c.accept_rows, c.depth, c.n_rows)
            .unwrap_err();
    assert!(matches!(err, Error::Param { name: "page_size", .. }), "{err}");
}

#[cfg(feature = "cuda")]
mod gpu {
    use super::*;
    use common::gpu;

    #[test]
    fn gpu_matches_every_fixture() {
        let Some(gpu) = gpu() else { return };
        for case in cases("kv_compact") {
            let mut c = load(&case);
            gpu.kv_compact(
                &mut c.cache,
                &c.layout,
                &c.table,
                &c.seq_len,
                &c.accept_len,
                &c.accept_rows,
                c.depth,
                c.n_rows,
            )
            .unwrap();
            assert_same(&case.name(), "cache_out", &bits(&c.cache), &expected(&case));
        }
    }

    #[test]
    fn gpu_rejects_out_of_range_rows_and_leaves_the_cache() {
        let Some(gpu) = gpu() else { return };
        let mut c = case_with_a_move();
        let before = bits(&c.cache);
        let w = c.depth + 1;
        let b = first_mover(&c);
        c.accept_rows[b * w + 1] = 10_000;
        let err = gpu
            .kv_compact(&mut c.cache, &c.layout, &c.table, &c.seq_len, &c.accept_len, &c.accept_rows, c.depth, c.n_rows)
            .unwrap_err();
        assert!(matches!(err, Error::Index { .. }), "{err}");
        assert_eq!(bits(&c.cache), before);
    }

    #[test]
    fn gpu_matches_cpu_on_kimi_sized_random_cache() {
        let Some(gpu) = gpu() else { return };
        let (bs, depth, page_size, row_elems, layers) = (16usize, 15usize, 64usize, 576usize, 4usize);
        let n_rows = 65usize;
        let pages_per_req = (4096 + n_rows).div_ceil(page_size);
        let layout = KvLayout { layers, num_pages: bs * pages_per_req, page_size, row_elems, pages_per_req };
        let mut next = common::xorshift(12345);
        let mut table: Vec<i32> = (0..(bs * pages_per_req) as i32).collect();
        for i in (1..table.len()).rev() {
            table.swap(i, next() as usize % (i + 1));
        }
        let cache: Vec<bf16> = (0..layout.elems()).map(|_| bf16::from_bits(next() as u16)).collect();
        let seq_len: Vec<i32> = (0..bs).map(|_| (next() % 4000) as i32).collect();
        let accept_len: Vec<i32> = (0..bs).map(|b| if b == 0 { depth as i32 } else { (next() % 16) as i32 }).collect();
        let mut accept_rows = vec![-1; bs * (depth + 1)];
        for b in 0..bs {
            let mut row = 0;
            accept_rows[b * (depth + 1)] = 0;
            for j in 1..=accept_len[b] as usize {
                row += 1 + (next() % 3) as i32;
                accept_rows[b * (depth + 1) + j] = row;
            }
        }
        let (mut cpu, mut dev) = (cache.clone(), cache);
        kv_compact(&mut cpu, &layout, &table, &seq_len, &accept_len, &accept_rows, depth, n_rows).unwrap();
        gpu.kv_compact(&mut dev, &layout, &table, &seq_len, &accept_len, &accept_rows, depth, n_rows).unwrap();
        assert_eq!(bits(&dev), bits(&cpu));
    }
}
