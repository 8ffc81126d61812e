//! Helpers shared by the integration tests: fixture paths, the GPU gate, and exact comparisons.
#![allow(dead_code)]

use std::path::PathBuf;

use kdtree_engine::fixture::Fixture;

/// The `fixtures/` directory: `$KDTREE_FIXTURES` when set (test binaries copied to another machine),
/// else the crate's own.
pub fn fixtures_root() -> PathBuf {
    match std::env::var_os("KDTREE_FIXTURES") {
        Some(dir) => PathBuf::from(dir),
        None => PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("fixtures"),
    }
}

/// Every case of `kernel`; fails the test if there are none (a missing fixture set must not pass).
pub fn cases(kernel: &str) -> Vec<Fixture> {
    let cases = Fixture::cases(fixtures_root(), kernel).expect("fixtures readable");
    assert!(!cases.is_empty(), "no fixtures for {kernel}: run `python3 reference/gen_fixtures.py`");
    cases
}

/// A small deterministic generator (xorshift64) for test data; `seed` 0 is mapped to 1.
pub fn xorshift(seed: u64) -> impl FnMut() -> u64 {
    let mut s = seed | 1;
    move || {
        s ^= s << 13;
        s ^= s >> 7;
        s ^= s << 17;
        s
    }
}

/// Asserts two arrays are identical, naming the array, the case and the first differing index.
pub fn assert_same<T: PartialEq + std::fmt::Debug>(case: &str, name: &str, got: &[T], want: &[T]) {
    assert_eq!(got.len(), want.len(), "{case}: `{name}` length");
    if let Some(i) = (0..got.len()).find(|&i| got[i] != want[i]) {
        panic!("{case}: `{name}` differs at {i}: got {:?}, want {:?}", got[i], want[i]);
    }
}

/// Relative Frobenius error of `got` against `want` (float64 sums; panics on a length mismatch).
pub fn rel_frobenius(got: &[f32], want: &[f32]) -> f64 {
    assert_eq!(got.len(), want.len(), "relative error of arrays of different lengths");
    let err: f64 = got.iter().zip(want).map(|(g, w)| (*g as f64 - *w as f64).powi(2)).sum();
    let norm: f64 = want.iter().map(|w| (*w as f64).powi(2)).sum();
    (err / norm.max(f64::MIN_POSITIVE)).sqrt()
}

/// Bit-exact comparison of f32 arrays (so -0.0 != 0.0 and NaN == NaN when the bits agree).
pub fn assert_bits(case: &str, name: &str, got: &[f32], want: &[f32]) {
    let g: Vec<u32> = got.iter().map(|v| v.to_bits()).collect();
    let w: Vec<u32> = want.iter().map(|v| v.to_bits()).collect();
    if let Some(i) = (0..g.len().min(w.len())).find(|&i| g[i] != w[i]) {
        panic!("{case}: `{name}` differs at {i}: got {} ({:#x}), want {} ({:#x})", got[i], g[i], want[i], w[i]);
    }
    assert_eq!(g.len(), w.len(), "{case}: `{name}` length");
}

/// The shared GPU, or `None` after printing `skipped: no CUDA device` (a failure instead when
/// `KDTREE_REQUIRE_GPU` is set, as scripts/gpu-run.sh does).
#[cfg(feature = "cuda")]
pub fn gpu() -> Option<&'static kdtree_engine::cuda::Gpu> {
    static GPU: std::sync::OnceLock<Option<kdtree_engine::cuda::Gpu>> = std::sync::OnceLock::new();
    let gpu = GPU.get_or_init(|| {
        kdtree_engine::cuda::device_available()
            .then(|| kdtree_engine::cuda::Gpu::new(0).expect("a CUDA device is present, so it must open"))
    });
    if gpu.is_none() {
        assert!(std::env::var_os("KDTREE_REQUIRE_GPU").is_none(), "KDTREE_REQUIRE_GPU is set but no CUDA device");
        println!("skipped: no CUDA device");
    }
    gpu.as_ref()
}

/// A `Gpu` of its own, for a test that captures its stream into a CUDA graph; `None` without a device
/// (see [`gpu`]) or in a debug build, which synchronizes after every launch, something a capture does not
/// allow. The shared `Gpu`'s stream serves the other test threads, and a capture of it would take in
/// their launches and copies (replayed later into freed memory).
#[cfg(feature = "cuda")]
pub fn capture_gpu() -> Option<kdtree_engine::cuda::Gpu> {
    gpu()?;
    if cfg!(debug_assertions) {
        return None;
    }
    Some(kdtree_engine::cuda::Gpu::new(0).expect("a CUDA device is present, so it must open"))
}

/// Captures the work `record` queues on `gpu`'s stream into a graph and replays it `replays` times.
#[cfg(feature = "cuda")]
pub fn replay_graph(gpu: &kdtree_engine::cuda::Gpu, replays: usize, record: impl FnOnce()) {
    use cudarc::driver::sys;
    let stream = gpu.stream();
    stream.begin_capture(sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL).expect("begin capture");
    record();
    let graph = stream.end_capture(sys::CUgraphInstantiate_flags(0)).expect("end capture").expect("a graph");
    for _ in 0..replays {
        graph.launch().expect("graph replay");
    }
}
