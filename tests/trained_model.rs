//! The shipped trained model (fixtures/models/tiny-k2, made by train/): its files are the ones the
//! checksums name and fit the 16 MB budget; the Rust tokenizer cuts the held-out text into exactly the
//! tokens PyTorch was scored on; the engine's held-out log-likelihood matches PyTorch's per window on
//! the INT4 checkpoint (and a window shifted by one token fails the same bound); greedy decoding with the
//! trained drafter emits plain decoding's tokens and accepts its drafts. One test body per property, run
//! on the CPU here and on CUDA in `mod cuda`.

mod common;

use std::path::PathBuf;

use kdtree_engine::fixture::read_npy;
use kdtree_engine::model::backend::Backend;
use kdtree_engine::model::perplexity::token_nll;
use kdtree_engine::model::{Drafter, Model, Tokenizer};
use kdtree_engine::spec::{DflashProposer, Engine, EngineConfig, Mode, RequestParams};
use sha2::{Digest, Sha256};

/// Target, drafter and tokenizer together, as issue 34 allows.
const MAX_MODEL_BYTES: u64 = 16_000_000;
/// Tokens per perplexity window, as train/common.py's WINDOW.
const WINDOW: usize = 512;
/// Bound on the mean absolute difference per token between the engine's negative log-likelihoods and
/// PyTorch's float32 ones (reference/heldout_token_nll.npy): twice the worst seen on a correct run
/// (`OBSERVED_TOKEN_NLL_DIFF`). The same windows shifted by one token sit near 3 nats.
const MAX_TOKEN_NLL_DIFF: f64 = 2.0 * OBSERVED_TOKEN_NLL_DIFF;
/// The worst seen, on the CPU: 3.51e-3 over 1 window, 4.42e-3 over 8 (the bf16 activations the kernels take
/// against PyTorch's float32).
const OBSERVED_TOKEN_NLL_DIFF: f64 = 4.5e-3;

fn models_dir() -> PathBuf {
    common::fixtures_root().join("models")
}

fn model_dir() -> PathBuf {
    models_dir().join("tiny-k2")
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

#[test]
fn shipped_files_match_their_checksums() {
    let sums = std::fs::read_to_string(models_dir().join("SHA256SUMS")).expect("fixtures/models/SHA256SUMS");
    let mut model_bytes = 0;
    let mut checked = 0;
    for line in sums.lines() {
        let (want, name) = line.split_once("  ").expect("sha256sum lines: `<hex>  <path>`");
        let path = models_dir().join(name);
        let data = std::fs::read(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
        assert_eq!(hex(&Sha256::digest(&data)), want, "{name}: the file differs from the one trained");
        if name.starts_with("tiny-k2/") {
            model_bytes += data.len() as u64;
        }
        checked += 1;
    }
    assert_eq!(checked, files_under(&models_dir()), "SHA256SUMS must name every file of fixtures/models");
    assert!(model_bytes <= MAX_MODEL_BYTES, "tiny-k2 holds {model_bytes} bytes, over {MAX_MODEL_BYTES}");
}

/// Files under `dir`, at any depth, but for SHA256SUMS itself.
fn files_under(dir: &std::path::Path) -> usize {
    std::fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap().path())
        .map(|p| if p.is_dir() { files_under(&p) } else { usize::from(!p.ends_with("SHA256SUMS")) })
        .sum()
}

/// The held-out text's token ids as Rust's tokenizer cuts them.
fn heldout_tokens() -> Vec<u32> {
    let text = std::fs::read_to_string(models_dir().join("heldout.txt")).unwrap();
    Tokenizer::from_dir(model_dir()).unwrap().encode(&text, false).unwrap()
}

#[test]
fn tokenizer_cuts_the_heldout_text_as_python_did() {
    let meta: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(model_dir().join("reference/heldout_tokens.json")).unwrap())
            .unwrap();
    let ids = heldout_tokens();
    assert_eq!(ids.len() as u64, meta["count"].as_u64().unwrap(), "held-out token count");
    let bytes: Vec<u8> = ids.iter().flat_map(|t| t.to_le_bytes()).collect();
    assert_eq!(hex(&Sha256::digest(&bytes)), meta["sha256_u32le"].as_str().unwrap(), "held-out token ids");
}

/// Mean |engine − PyTorch| per token of the NLLs of the first `windows` windows of `tokens`, and the
/// largest difference of a window's mean.
fn nll_diff<B: Backend>(model: &Model<B>, tokens: &[u32], windows: usize) -> (f64, f64) {
    let reference: Vec<f32> = read_npy(&model_dir().join("reference/heldout_token_nll.npy")).unwrap();
    let nll = token_nll(model, tokens, WINDOW, Some(windows), |_, _| {}).unwrap();
    assert_eq!(nll.len(), windows * (WINDOW - 1));
    let mean_abs = nll.iter().zip(&reference).map(|(a, &b)| (a - b as f64).abs()).sum::<f64>() / nll.len() as f64;
    let worst_window = nll
        .chunks(WINDOW - 1)
        .zip(reference.chunks(WINDOW - 1))
        .map(|(a, b)| (a.iter().sum::<f64>() - b.iter().map(|&x| x as f64).sum::<f64>()).abs() / (WINDOW - 1) as f64)
        .fold(0.0, f64::max);
    (mean_abs, worst_window)
}

/// Windows scored by the perplexity test: one in an unoptimized build (a 512-token prefill there takes
/// a while), eight otherwise (as many as the reference holds).
const fn windows() -> usize {
    if cfg!(debug_assertions) {
        1
    } else {
        8
    }
}

/// 1% in perplexity, as a window's mean NLL: ln(1.01) nats.
const ONE_PERCENT_NATS: f64 = 9.95e-3;

fn check_perplexity_matches_pytorch<B: Backend>(model: &Model<B>, label: &str) {
    let tokens = heldout_tokens();
    let (mean_abs, worst_window) = nll_diff(model, &tokens, windows());
    println!(
        "{label}: {} windows, per-token NLL {mean_abs:.3e} nats from PyTorch on average, worst window mean \
         {worst_window:.3e}",
        windows()
    );
    assert!(mean_abs <= MAX_TOKEN_NLL_DIFF, "{label}: {mean_abs:.3e} nats per token, bound {MAX_TOKEN_NLL_DIFF:.1e}");
    assert!(worst_window <= ONE_PERCENT_NATS, "{label}: a window's perplexity is off by more than 1%");
    let (shifted, _) = nll_diff(model, &tokens[1..], 1);
    println!("{label}: the first window shifted by one token: {shifted:.3e} nats per token");
    assert!(shifted > MAX_TOKEN_NLL_DIFF, "{label}: a window shifted by one token passes the bound ({shifted:.3e})");
}

#[test]
fn perplexity_matches_pytorch() {
    check_perplexity_matches_pytorch(&Model::load(model_dir()).unwrap(), "cpu");
}

/// The opening `tokens` tokens of held-out paragraphs `picks` (blank-line separated, long enough).
fn heldout_prompts(picks: &[usize], tokens: usize) -> Vec<Vec<u32>> {
    let text = std::fs::read_to_string(models_dir().join("heldout.txt")).unwrap();
    let tokenizer = Tokenizer::from_dir(model_dir()).unwrap();
    let long: Vec<Vec<u32>> = text
        .split("\n\n")
        .map(|p| tokenizer.encode(p.trim(), false).unwrap())
        .filter(|ids| ids.len() >= tokens)
        .collect();
    picks.iter().map(|&i| long[i][..tokens].to_vec()).collect()
}

/// Greedy output of `mode` for `prompts`, all in one batch, and the mean accepted length.
fn run<B: Backend>(
    model: &Model<B>,
    drafter: &Drafter<B>,
    mode: Mode,
    prompts: &[Vec<u32>],
    n: usize,
) -> (Vec<Vec<u32>>, f64) {
    let cfg = EngineConfig { mode, budget: 16, block: 16, num_pages: 128, page_size: 16, max_seq_len: 160 };
    let mut engine = Engine::new(model, DflashProposer::new(drafter, &cfg).unwrap(), cfg).unwrap();
    for p in prompts {
        let params = RequestParams { max_tokens: n, stop_tokens: Vec::new(), sampling: None, logprobs: None };
        engine.add_request(p, params).unwrap();
    }
    let out = engine.run_to_end().unwrap().into_iter().map(|(_, t)| t).collect();
    (out, engine.stats().mean_accepted_length())
}

fn check_trained_drafter_is_accepted<B: Backend>(model: &Model<B>, label: &str) {
    let drafter = Drafter::load(model_dir().join("drafter"), model).unwrap();
    let prompts = heldout_prompts(&[3, 40, 120], 32);
    let n = if cfg!(debug_assertions) { 24 } else { 96 };
    let (want, _) = run(model, &drafter, Mode::Ar, &prompts, n);
    for mode in [Mode::Chain, Mode::DdTree] {
        let (got, accepted) = run(model, &drafter, mode, &prompts, n);
        println!("{label} {mode:?} B 16: mean accepted length {accepted:.2} over {} held-out prompts", prompts.len());
        assert_eq!(got, want, "{label} {mode:?}: the drafted tokens differ from plain greedy decoding");
        assert!(accepted >= MIN_ACCEPTED, "{label} {mode:?}: mean accepted length {accepted:.2} < {MIN_ACCEPTED}");
    }
}

/// Well under what the trained drafter gets on these prompts (a drafter reading the wrong features or
/// positions falls to about 1.0).
const MIN_ACCEPTED: f64 = 1.4;

#[test]
fn trained_drafter_is_accepted() {
    check_trained_drafter_is_accepted(&Model::load(model_dir()).unwrap(), "cpu");
}

#[cfg(feature = "cuda")]
mod cuda {
    use super::*;
    use kdtree_engine::cuda::backend::CudaBackend;
    use kdtree_engine::cuda::Gpu;

    fn cuda_model() -> Model<CudaBackend> {
        let gpu = Gpu::new(0).expect("a CUDA device is present, so it must open");
        Model::load_on(model_dir(), CudaBackend::new(gpu).unwrap()).unwrap()
    }

    #[test]
    fn cuda_perplexity_matches_pytorch() {
        if common::gpu().is_none() {
            return;
        }
        check_perplexity_matches_pytorch(&cuda_model(), "cuda");
    }

    #[test]
    fn cuda_trained_drafter_is_accepted() {
        if common::gpu().is_none() {
            return;
        }
        let model = cuda_model();
        for graphs in [false, true] {
            model.set_graphs(graphs);
            check_trained_drafter_is_accepted(&model, if graphs { "cuda, graphs on" } else { "cuda, graphs off" });
        }
    }
}
