//! Helpers shared by the criterion benches: configuration, data generation, GPU event timing and the
//! device-to-device copy bandwidth measured in the same run (the ceiling the GPU rows are compared with).
#![allow(dead_code)]

use std::time::Duration;

use criterion::Criterion;

/// Batch sizes of every table.
pub const BATCHES: [usize; 6] = [1, 4, 8, 16, 32, 64];
/// Tree budgets of every table.
pub const BUDGETS: [usize; 3] = [16, 64, 256];
/// Draft positions (block size 16).
pub const DEPTH: usize = 15;
/// The Kimi-K2 vocabulary and a Llama-sized one.
pub const VOCABS: [usize; 2] = [163_840, 32_000];

/// Short runs: the GPU machine's time is scarce and the kernels are stable to a few percent.
pub fn criterion() -> Criterion {
    Criterion::default()
        .sample_size(10)
        .without_plots()
        .warm_up_time(Duration::from_millis(200))
        .measurement_time(Duration::from_millis(1000))
        .configure_from_args()
}

/// Deterministic logits shaped like a drafter's: a few standard normals scaled per row, so the top of
/// each row is peaked but varied.
pub fn random_logits(n: usize, row_len: usize, seed: u64) -> Vec<f32> {
    use rayon::prelude::*;
    let mut out = vec![0.0f32; n];
    out.par_chunks_mut(row_len).enumerate().for_each(|(row, values)| {
        let mut s = (seed ^ row as u64).wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
        let scale = 1.0 + (row % 8) as f32;
        for v in values {
            s ^= s << 13;
            s ^= s >> 7;
            s ^= s << 17;
            // Sum of two uniforms (the two halves of one draw): a peaked, varied logit distribution.
            let (a, b) = ((s >> 40) as f32, ((s >> 16) & 0xFF_FFFF) as f32);
            *v = ((a + b) / (1u64 << 24) as f32 - 1.0) * scale;
        }
    });
    out
}

/// A heap-shaped tree: row i's parent is (i - 1) / 2, so the deepest rows see 7 tree rows.
pub fn heap_visibility(bs: usize, n: usize) -> Vec<u32> {
    let w = n.div_ceil(32);
    let mut vis = vec![0u32; bs * n * w];
    for b in 0..bs {
        for i in 0..n {
            let mut j = i;
            loop {
                vis[(b * n + i) * w + j / 32] |= 1 << (j % 32);
                if j == 0 {
                    break;
                }
                j = (j - 1) / 2;
            }
        }
    }
    vis
}

#[cfg(feature = "cuda")]
pub mod gpu {
    use std::time::Duration;

    use criterion::{BenchmarkId, Criterion, Throughput};
    use cudarc::driver::sys::{self, CUevent_flags};
    use kdtree_engine::cuda::Gpu;

    /// The GPU, or `None` (the bench then has CPU rows only); a panic instead when `KDTREE_REQUIRE_GPU`
    /// is set (scripts/gpu-run.sh sets it), so that a GPU bench run without a device fails rather than
    /// reporting CPU rows only.
    pub fn open() -> Option<Gpu> {
        if !kdtree_engine::cuda::device_available() {
            assert!(std::env::var_os("KDTREE_REQUIRE_GPU").is_none(), "KDTREE_REQUIRE_GPU is set but no CUDA device");
            println!("skipped GPU rows: no CUDA device");
            return None;
        }
        Some(Gpu::new(0).expect("a CUDA device is present, so it must open"))
    }

    /// Launches per captured graph: enough that graph launch overhead is amortized, few enough to
    /// capture quickly.
    const GRAPH_LAUNCHES: u64 = 20;

    /// Device time of `iters` calls of `launch`. The calls are captured in a CUDA graph that is replayed,
    /// so the host's launch overhead does not hide the kernel time of small kernels.
    pub fn time(gpu: &Gpu, iters: u64, mut launch: impl FnMut()) -> Duration {
        let stream = gpu.stream();
        stream.begin_capture(sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL).expect("capture");
        for _ in 0..GRAPH_LAUNCHES {
            launch();
        }
        let graph = stream.end_capture(sys::CUgraphInstantiate_flags(0)).expect("end capture").expect("a graph");
        graph.upload().expect("graph upload");
        graph.launch().expect("warm-up replay");
        let replays = iters.div_ceil(GRAPH_LAUNCHES);
        let start = stream.record_event(Some(CUevent_flags::CU_EVENT_DEFAULT)).expect("event");
        for _ in 0..replays {
            graph.launch().expect("replay");
        }
        let end = stream.record_event(Some(CUevent_flags::CU_EVENT_DEFAULT)).expect("event");
        end.synchronize().expect("sync");
        let per_launch = start.elapsed_ms(&end).expect("elapsed") as f64 * 1e-3 / (replays * GRAPH_LAUNCHES) as f64;
        Duration::from_secs_f64(per_launch * iters as f64)
    }

    /// Device time of `iters` calls of `launch` queued directly on the stream, for operations long
    /// enough that launch overhead does not matter.
    pub fn time_direct(gpu: &Gpu, iters: u64, mut launch: impl FnMut()) -> Duration {
        let stream = gpu.stream();
        let start = stream.record_event(Some(CUevent_flags::CU_EVENT_DEFAULT)).expect("event");
        for _ in 0..iters {
            launch();
        }
        let end = stream.record_event(Some(CUevent_flags::CU_EVENT_DEFAULT)).expect("event");
        end.synchronize().expect("sync");
        Duration::from_secs_f64(start.elapsed_ms(&end).expect("elapsed") as f64 * 1e-3)
    }

    /// The copy ceiling: a 1 GiB device-to-device copy, counted as bytes read plus bytes written;
    /// `label` names the bench binary whose rows it serves (`copy/d2d/<label>`). Timed directly on the
    /// stream: the same copy replayed from a graph measured 2.8 TB/s against 4.3 TB/s queued directly on
    /// the H200, and the faster figure is the ceiling the kernels are held to.
    pub fn bench_copy(c: &mut Criterion, gpu: &Gpu, label: &str) {
        const BYTES: usize = 1 << 30;
        let src = gpu.zeros::<u8>(BYTES).expect("alloc");
        let mut dst = gpu.zeros::<u8>(BYTES).expect("alloc");
        let mut group = c.benchmark_group("copy");
        group.throughput(Throughput::Bytes(2 * BYTES as u64));
        group.bench_function(BenchmarkId::new("d2d", label), |b| {
            b.iter_custom(|iters| time_direct(gpu, iters, || gpu.stream().memcpy_dtod(&src, &mut dst).expect("copy")))
        });
        group.finish();
    }
}
