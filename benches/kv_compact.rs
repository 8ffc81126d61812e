//! KV compaction at Kimi-K2 dimensions (61 layers, 576-element rows, page size 64): CPU reference vs CUDA
//! at bs 1..64 with every request accepting 4 or 15 draft rows. Ids are `kv_compact/<backend>/bs<bs>_a<a>`;
//! GB/s counts the bytes read and written, like the copy ceiling.

mod common;

use common::{criterion, BATCHES};
use criterion::{BenchmarkId, Criterion};
use half::bf16;
use kdtree_engine::cpu::kv_compact::kv_compact;
use kdtree_engine::KvLayout;

const LAYERS: usize = 61;
const ROW: usize = 576;
const PAGE: usize = 64;
const DEPTH: usize = 15;
/// Tree rows after each prefix (B 64).
const N_ROWS: usize = 65;
/// Prefix length: one page, so the tree rows span pages 1 and 2.
const PREFIX: i32 = 64;

fn bench(c: &mut Criterion) {
    #[cfg(feature = "cuda")]
    let gpu = common::gpu::open();
    #[cfg(feature = "cuda")]
    if let Some(gpu) = &gpu {
        common::gpu::bench_copy(c, gpu, "kv_compact");
    }
    let bs_max = BATCHES[BATCHES.len() - 1];
    let pages_per_req = (PREFIX as usize + N_ROWS).div_ceil(PAGE);
    let layout =
        KvLayout { layers: LAYERS, num_pages: bs_max * pages_per_req, page_size: PAGE, row_elems: ROW, pages_per_req };
    let cache: Vec<bf16> = (0..layout.elems()).map(|i| bf16::from_bits((i * 2_654_435_761) as u16)).collect();
    let table: Vec<i32> = (0..layout.num_pages as i32).collect();
    let mut group = c.benchmark_group("kv_compact");
    group.sampling_mode(criterion::SamplingMode::Flat);
    for accepted in [4usize, 15] {
        // Path rows 0, 2, 4, ...: every move is a real copy (no row is already in place).
        let path: Vec<i32> = (0..=DEPTH).map(|j| if j <= accepted { 2 * j as i32 } else { -1 }).collect();
        for bs in BATCHES {
            let id = format!("bs{bs}_a{accepted}");
            let seq = vec![PREFIX; bs];
            let alen = vec![accepted as i32; bs];
            let rows: Vec<i32> = (0..bs).flat_map(|_| path.iter().copied()).collect();
            let bs_layout = KvLayout { num_pages: bs * pages_per_req, ..layout };
            let mut host = cache[..bs_layout.elems()].to_vec();
            let t = &table[..bs * pages_per_req];
            group.bench_function(BenchmarkId::new("cpu", &id), |b| {
                b.iter(|| kv_compact(&mut host, &bs_layout, t, &seq, &alen, &rows, DEPTH, N_ROWS).unwrap())
            });
            #[cfg(feature = "cuda")]
            if let Some(gpu) = &gpu {
                use kdtree_engine::cuda::kv_compact::{kv_compact as gpu_compact, CompactArgs};
                let mut dev = gpu.upload(&host).unwrap();
                let (d_table, d_seq, d_alen, d_rows) = (
                    gpu.upload(t).unwrap(),
                    gpu.upload(&seq).unwrap(),
                    gpu.upload(&alen).unwrap(),
                    gpu.upload(&rows).unwrap(),
                );
                let args = CompactArgs {
                    block_table: &d_table,
                    seq_len: &d_seq,
                    accept_len: &d_alen,
                    accept_rows: &d_rows,
                    depth: DEPTH,
                    n_rows: N_ROWS,
                };
                let mut status = gpu.zeros::<i32>(1).unwrap();
                group.bench_function(BenchmarkId::new("gpu", &id), |b| {
                    b.iter_custom(|iters| {
                        common::gpu::time(gpu, iters, || {
                            gpu_compact(gpu, &mut dev, &bs_layout, &args, &mut status).unwrap()
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
