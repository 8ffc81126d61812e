//! Held-out perplexity of a checkpoint on a text file, windows as `train/common.py` cuts them, beside
//! the per-window reference PyTorch wrote at training time when the checkpoint has one.
//!
//! ```text
//! cargo run --release --example perplexity                       # the shipped model, CPU
//! cargo run --release --features cuda --example perplexity -- --gpu
//! ```

mod common;

use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::time::Instant;

use clap::Parser;
use indicatif::{ProgressBar, ProgressStyle};
use kdtree_engine::fixture::read_npy;
use kdtree_engine::model::backend::Backend;
use kdtree_engine::model::perplexity::{perplexity, window_nll};
use kdtree_engine::model::{Model, Tokenizer};
use kdtree_engine::{Error, Result};

#[derive(Parser, Debug)]
#[command(about = "Held-out perplexity of a checkpoint, beside PyTorch's")]
struct Args {
    /// Checkpoint directory (config.json, safetensors, tokenizer.json).
    #[arg(long, default_value = "fixtures/models/tiny-k2")]
    model: PathBuf,
    /// The text to score.
    #[arg(long, default_value = "fixtures/models/heldout.txt")]
    text: PathBuf,
    /// Tokens per window (each window is read from its start).
    #[arg(long, default_value_t = 512)]
    window: usize,
    /// Score at most this many windows (default: all).
    #[arg(long)]
    max_windows: Option<usize>,
    /// Per-window NLL from PyTorch to compare with (default: <model>/reference/heldout_nll.npy if present).
    #[arg(long)]
    reference: Option<PathBuf>,
    /// Run on the CUDA backend (needs the `cuda` feature and a device).
    #[arg(long)]
    gpu: bool,
}

fn main() -> ExitCode {
    common::exit_with(run(&Args::parse()))
}

fn run(args: &Args) -> Result<()> {
    if !args.gpu {
        return score(args, Model::load(&args.model)?);
    }
    #[cfg(feature = "cuda")]
    {
        let gpu = kdtree_engine::cuda::Gpu::new(0)?;
        score(args, Model::load_on(&args.model, kdtree_engine::cuda::backend::CudaBackend::new(gpu)?)?)
    }
    #[cfg(not(feature = "cuda"))]
    Err(Error::param("--gpu", true, "this build has no CUDA backend: build with `--features cuda`"))
}

fn score<B: Backend>(args: &Args, model: Model<B>) -> Result<()> {
    let text = std::fs::read_to_string(&args.text)
        .map_err(|e| Error::Data { path: args.text.clone(), detail: e.to_string() })?;
    let tokens = Tokenizer::from_dir(&args.model)?.encode(&text, false)?;
    let start = Instant::now();
    let bar = ProgressBar::new(0).with_style(
        ProgressStyle::with_template("{bar:40} {pos}/{len} windows, {elapsed} (eta {eta})")
            .map_err(|e| Error::param("progress template", e, "invalid"))?,
    );
    let nll = window_nll(&model, &tokens, args.window, args.max_windows, |done, total| {
        bar.set_length(total as u64);
        bar.set_position(done as u64);
    })?;
    bar.finish_and_clear();
    let ppl = perplexity(&nll, args.window);
    println!(
        "{}: {} tokens, {} windows of {}: perplexity {ppl:.4} ({:.1} s on {})",
        args.text.display(),
        tokens.len(),
        nll.len(),
        args.window,
        start.elapsed().as_secs_f64(),
        if args.gpu { "cuda" } else { "cpu" }
    );
    let reference = args.reference.clone().unwrap_or_else(|| args.model.join("reference/heldout_nll.npy"));
    if args.reference.is_some() || reference.exists() {
        compare(&reference, &nll, args.window, ppl)?;
    }
    Ok(())
}

/// PyTorch's perplexity over the same windows, the ratio, and the worst window.
fn compare(path: &Path, nll: &[f64], window: usize, ppl: f64) -> Result<()> {
    let theirs: Vec<f32> = read_npy(path)?;
    if theirs.len() < nll.len() {
        return Err(Error::Data {
            path: path.to_path_buf(),
            detail: format!("{} windows, fewer than the {} scored", theirs.len(), nll.len()),
        });
    }
    let theirs: Vec<f64> = theirs[..nll.len()].iter().map(|&x| x as f64).collect();
    let ref_ppl = perplexity(&theirs, window);
    let worst = nll.iter().zip(&theirs).map(|(a, b)| (a - b).abs() / (window - 1) as f64).fold(0.0, f64::max);
    println!(
        "PyTorch (same windows): perplexity {ref_ppl:.4}; engine / PyTorch = {:.5}; worst window's mean NLL differs by {worst:.2e} nats",
        ppl / ref_ppl
    );
    Ok(())
}
