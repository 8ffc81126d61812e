//! Greedy generation throughput of the engine's plain autoregressive step: for each batch size, every
//! sequence gets the same 5-token prompt (the one `scripts/hf_generate_bench.py` gives transformers), a
//! prefill, then `--tokens` decode steps of the whole batch, each taking the device argmax; with recorded
//! step graphs off and on. Prints tok/s (batch × tokens / decode time) and the time of a step, checks that
//! both settings emit the same tokens, and writes the table as CSV with `--out`.
//!
//! With `--profile-step` (CUDA only) it then runs one more eager decode step at the first batch size
//! between `cuProfilerStart` and `cuProfilerStop`, so that `ncu --profile-from-start off` times that
//! step's kernels one by one: their sum beside the replayed step's time is the step's overhead.
//!
//! ```text
//! cargo run --release --example bench_generate -- --batches 1,8
//! cargo run --release --features cuda --example bench_generate -- --gpu
//! ```

mod common;

use std::path::PathBuf;
use std::process::ExitCode;
use std::time::{Duration, Instant};

use clap::Parser;
use kdtree_engine::model::backend::Backend;
use kdtree_engine::model::{Logits, Model};
use kdtree_engine::{Error, Result};

#[derive(Parser, Debug)]
#[command(about = "Greedy decode throughput of the engine at several batch sizes, graphs off and on")]
struct Args {
    /// Checkpoint directory.
    #[arg(long, default_value = "fixtures/tiny_model")]
    model: PathBuf,
    /// Tokens generated per sequence.
    #[arg(long, default_value_t = 256)]
    tokens: usize,
    /// Batch sizes, comma-separated.
    #[arg(long, default_value = "1,8,32", value_delimiter = ',')]
    batches: Vec<usize>,
    /// Run on the CUDA backend (needs the `cuda` feature and a device).
    #[arg(long)]
    gpu: bool,
    /// Also write the table as CSV here.
    #[arg(long)]
    out: Option<PathBuf>,
    /// Then run one eager decode step inside a profiler range (for `ncu --profile-from-start off`).
    #[arg(long)]
    profile_step: bool,
}

/// Opens (true) or closes (false) the profiler's range.
type ProfilerRange = fn(bool) -> Result<()>;

const PROMPT: [u32; 5] = [100, 7, 14, 21, 28];

/// One measured configuration.
struct Run {
    batch: usize,
    graphs: bool,
    /// Kernel launches of the last decode step run op by op (0 on the CPU and for replayed steps).
    launches: u64,
    first: Duration,
    decode: Duration,
    tokens: Vec<Vec<u32>>,
}

fn main() -> ExitCode {
    common::exit_with(run(&Args::parse()))
}

fn run(args: &Args) -> Result<()> {
    if args.tokens < 2 || args.batches.is_empty() || args.batches.contains(&0) {
        return Err(Error::param("--tokens / --batches", args.tokens, "need at least 2 tokens and batches >= 1"));
    }
    if !args.gpu {
        if args.profile_step {
            return Err(Error::param("--profile-step", true, "needs --gpu: the profiler range is CUDA's"));
        }
        return bench(args, Model::load(&args.model)?, None);
    }
    #[cfg(feature = "cuda")]
    {
        let gpu = kdtree_engine::cuda::Gpu::new(0)?;
        let model = Model::load_on(&args.model, kdtree_engine::cuda::backend::CudaBackend::new(gpu)?)?;
        bench(args, model, args.profile_step.then_some(cuda_profiler as ProfilerRange))
    }
    #[cfg(not(feature = "cuda"))]
    Err(Error::param("--gpu", true, "this build has no CUDA backend: build with `--features cuda`"))
}

/// Prefills `batch` copies of the prompt and decodes `tokens` steps.
fn generate<B: Backend>(model: &Model<B>, batch: usize, tokens: usize, graphs: bool) -> Result<Run> {
    model.set_graphs(graphs);
    let len = PROMPT.len() + tokens;
    let mut cache = model.new_cache(batch * len.div_ceil(16), 16, len)?;
    let seqs: Vec<usize> = (0..batch).map(|_| cache.add_sequence()).collect();
    let start = Instant::now();
    let prefill: Vec<(usize, &[u32])> = seqs.iter().map(|&s| (s, &PROMPT[..])).collect();
    let mut last = model.forward_argmax(&mut cache, &prefill, Logits::Last)?;
    let first = start.elapsed();
    let mut emitted: Vec<Vec<u32>> = last.iter().map(|&t| vec![t]).collect();
    let begin = Instant::now();
    let mut launches = 0;
    for _ in 1..tokens {
        let step: Vec<(usize, &[u32])> = seqs.iter().zip(&last).map(|(&s, t)| (s, std::slice::from_ref(t))).collect();
        let before = model.backend().launches();
        let next = model.forward_argmax(&mut cache, &step, Logits::Last)?;
        launches = model.backend().launches() - before;
        emitted.iter_mut().zip(&next).for_each(|(e, &t)| e.push(t));
        last = next;
    }
    Ok(Run { batch, graphs, launches, first, decode: begin.elapsed(), tokens: emitted })
}

/// `cuProfilerStart` / `cuProfilerStop`.
#[cfg(feature = "cuda")]
fn cuda_profiler(start: bool) -> Result<()> {
    let result = if start { cudarc::driver::profiler_start() } else { cudarc::driver::profiler_stop() };
    result.map_err(|e| Error::param("--profile-step", start, format!("the CUDA profiler call failed: {e}")))
}

/// Prefills `batch` sequences and runs two eager decode steps, the second inside `range`.
fn profile_step<B: Backend>(model: &Model<B>, batch: usize, range: ProfilerRange) -> Result<()> {
    model.set_graphs(false);
    let mut cache = model.new_cache(batch * (PROMPT.len() + 2).div_ceil(16), 16, PROMPT.len() + 2)?;
    let seqs: Vec<usize> = (0..batch).map(|_| cache.add_sequence()).collect();
    let prefill: Vec<(usize, &[u32])> = seqs.iter().map(|&s| (s, &PROMPT[..])).collect();
    let mut last = model.forward_argmax(&mut cache, &prefill, Logits::Last)?;
    for profiled in [false, true] {
        let step: Vec<(usize, &[u32])> = seqs.iter().zip(&last).map(|(&s, t)| (s, std::slice::from_ref(t))).collect();
        if profiled {
            range(true)?;
        }
        let before = model.backend().launches();
        last = model.forward_argmax(&mut cache, &step, Logits::Last)?;
        if profiled {
            range(false)?;
            let launches = model.backend().launches() - before;
            println!("profiled one eager decode step at batch {batch}: {launches} launches");
        }
    }
    Ok(())
}

fn bench<B: Backend>(args: &Args, model: Model<B>, profiler: Option<ProfilerRange>) -> Result<()> {
    let backend = model.backend().name();
    let mut rows = vec!["backend,batch,graphs,tok_per_s,step_us,first_token_ms,launches".to_string()];
    for &batch in &args.batches {
        let eager = generate(&model, batch, args.tokens, false)?;
        let replayed = generate(&model, batch, args.tokens, true)?;
        if eager.tokens != replayed.tokens {
            return Err(Error::param("graphs", batch, "with graphs on, other tokens came out than with graphs off"));
        }
        for r in [&eager, &replayed] {
            let steps = (args.tokens - 1) as f64;
            let rate = r.batch as f64 * steps / r.decode.as_secs_f64();
            let step_us = r.decode.as_secs_f64() * 1e6 / steps;
            let first_ms = r.first.as_secs_f64() * 1e3;
            println!(
                "{backend}: batch {:>2}, graphs {:<3}: {rate:>9.1} tok/s, {step_us:>8.1} µs a step, first token {first_ms:.1} ms, {} launches a step",
                r.batch,
                if r.graphs { "on" } else { "off" },
                r.launches
            );
            rows.push(format!(
                "{backend},{},{},{rate:.1},{step_us:.1},{first_ms:.2},{}",
                r.batch, r.graphs, r.launches
            ));
        }
        println!("{backend}: batch {batch}: the same {} tokens per sequence with graphs off and on", args.tokens);
    }
    if let Some(out) = &args.out {
        std::fs::write(out, rows.join("\n") + "\n")
            .map_err(|e| Error::Data { path: out.clone(), detail: e.to_string() })?;
    }
    match profiler {
        Some(range) => profile_step(&model, args.batches[0], range),
        None => Ok(()),
    }
}
