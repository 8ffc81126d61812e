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
/// (see [`gpu`]: a failure instead when `KDTREE_REQUIRE_GPU` is set). Works in every build profile: a
/// debug build's synchronize after each launch is skipped while the stream is being captured
/// (src/cuda/mod.rs `after_launch`). The shared `Gpu`'s stream serves the other test threads, and a
/// capture of it would take in their launches and copies (replayed later into freed memory).
#[cfg(feature = "cuda")]
pub fn capture_gpu() -> Option<kdtree_engine::cuda::Gpu> {
    gpu()?;
    Some(kdtree_engine::cuda::Gpu::new(0).expect("a CUDA device is present, so it must open"))
}

/// A CUDA backend on a `Gpu` of its own; `None` without a device (see [`gpu`]).
#[cfg(feature = "cuda")]
pub fn cuda_backend() -> Option<kdtree_engine::cuda::backend::CudaBackend> {
    Some(kdtree_engine::cuda::backend::CudaBackend::new(capture_gpu()?).expect("a backend on an open device"))
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

/// The largest error of an array against its reference, and where it is.
#[derive(Clone, Copy, Debug)]
pub struct Worst {
    /// Index of the position (or element) with the largest error.
    pub at: usize,
    /// That error; infinite where a reference with nothing in it (zero norm, -inf) is not matched exactly.
    pub error: f64,
}

impl Worst {
    fn of(errors: impl Iterator<Item = f64>) -> Worst {
        let mut worst = Worst { at: 0, error: 0.0 };
        for (at, e) in errors.enumerate() {
            let e = if e.is_nan() { f64::INFINITY } else { e };
            if e > worst.error {
                worst = Worst { at, error: e };
            }
        }
        worst
    }
}

/// Worst per-position relative L2 error of `got` against `want`, both `[positions, width]` (float64 sums).
/// A position whose reference is all zeros must be matched exactly. Panics on a length mismatch.
pub fn worst_rel_l2(got: &[f32], want: &[f32], width: usize) -> Worst {
    assert_eq!(got.len(), want.len(), "arrays of different lengths");
    Worst::of(got.chunks(width).zip(want.chunks(width)).map(|(g, w)| {
        let diff: f64 = g.iter().zip(w).map(|(g, w)| (*g as f64 - *w as f64).powi(2)).sum();
        let norm: f64 = w.iter().map(|w| (*w as f64).powi(2)).sum();
        if diff == 0.0 {
            0.0
        } else if norm == 0.0 {
            f64::INFINITY
        } else {
            (diff / norm).sqrt()
        }
    }))
}

/// Worst absolute error of `got` against `want`; an infinite reference value must be matched exactly.
pub fn worst_abs(got: &[f32], want: &[f32]) -> Worst {
    assert_eq!(got.len(), want.len(), "arrays of different lengths");
    Worst::of(got.iter().zip(want).map(|(g, w)| match (g, w) {
        (g, w) if g == w => 0.0,
        (_, w) if w.is_infinite() => f64::INFINITY,
        (g, w) => (*g as f64 - *w as f64).abs(),
    }))
}

/// The names of a fixture's mutants (`meta.json` key `mutants`; none when absent): deliberate contract
/// violations applied to the reference, stored as `mutant_<name>_<array>.npy`, that the tolerances must reject.
pub fn mutants(case: &Fixture) -> Vec<String> {
    case.strings("mutants").unwrap_or_default()
}

/// Checks `got` row by row (`[rows, width]`, the relative L2 error of each row, e.g. a token's outputs)
/// against `want` within `tol`; returns the worst error, or a message naming the row.
pub fn check_rows(got: &[f32], want: &[f32], width: usize, tol: f64) -> Result<f64, String> {
    if got.len() != want.len() {
        return Err(format!("length {}, want {}", got.len(), want.len()));
    }
    let worst = worst_rel_l2(got, want, width);
    if worst.error > tol {
        return Err(format!("token {} relative error {:e} > {tol:e}", worst.at, worst.error));
    }
    Ok(worst.error)
}
