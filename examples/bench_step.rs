//! The model step at real dimensions, without a checkpoint: a Kimi-K2-shaped model (hidden 7168, 384
//! INT4 experts top-8 with I 2048 and one shared expert, q_lora 1536, vocab 163840; 64 heads, or 8 as
//! one GPU's share of eight) with `--layers` layers (the first `--dense` dense: one, as in Kimi-K2) of
//! random weights made on the backend ([`Model::random`]), run through the same step code as a
//! checkpoint. `--layers 6 --dense 6` is a DFlash drafter of Kimi-K2 size.
//!
//! Every sequence first gets a `--prefix`-token prefill. Then, for each batch: decode steps, and tree
//! steps of N rows (a heap-shaped tree: node i's parent is (i - 1) / 2); each timed as the mean of
//! `--steps` steps replayed from recorded graphs (input copies and the argmax read-back included), and
//! once op by op with CUDA events for the per-stage table ([`Model::profile_step`]). Prints the table,
//! each step's share per stage, the 61-layer projections and the verify-to-decode ratio, and writes
//! CSV with `--out`. The projections come from the profiled (op by op) stage times, which include the
//! gaps of launching op by op: the 1-GPU one as measured, the 8-GPU one (meaningful with `--heads 8`)
//! with the routed and shared experts, the dense MLP and lm_head divided by eight and no communication.
//!
//! With `--pipeline 2,4` it instead times the decode and tree steps through pipeline stages
//! ([`ShardedModel::random`]) of 1 and each given count, and prints each count's step beside one
//! stage's and the difference per stage boundary: with every stage on the same device (`--tensor 1`),
//! what handing the rows from stage to stage through the host costs (the stages' own work adds up to
//! one stage's). `--tensor N` splits every stage over N ranks (N GPUs a stage with `--gpu`, CPU threads
//! without) and adds each layout's communication, the sums (and the logits' gather) of a profiled step.
//!
//! ```text
//! cargo run --release --features cuda --example bench_step -- --gpu --heads 64
//! cargo run --release --features cuda --example bench_step -- --gpu --layers 4 --pipeline 2,4
//! cargo run --release --example bench_step -- --config fixtures/tiny_model/config.json --prefix 64
//! ```

mod common;

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::process::ExitCode;
use std::time::{Duration, Instant};

use clap::Parser;
use kdtree_engine::model::backend::Backend;
use kdtree_engine::model::config::Config;
use kdtree_engine::model::{Logits, Model, Stage, StageTime, StepRequest, TreeInput};
use kdtree_engine::parallel::{Collective, Layout, ShardedCache, ShardedModel};
use kdtree_engine::{Error, Result};

#[derive(Parser, Debug)]
#[command(about = "The model step at Kimi-K2 dimensions with random weights: step times and per-stage table")]
struct Args {
    /// Run on the CUDA backend (needs the `cuda` feature and a device).
    #[arg(long)]
    gpu: bool,
    /// A config.json to use instead of the built-in Kimi-K2 shape (its layer count and heads are kept).
    #[arg(long)]
    config: Option<PathBuf>,
    /// Attention heads of the built-in shape: 64 (one GPU holds the model) or 8 (a GPU's share of 8).
    #[arg(long, default_value_t = 64)]
    heads: usize,
    /// Decoder layers of the built-in shape (the first `--dense` dense, the others MoE).
    #[arg(long, default_value_t = 3)]
    layers: usize,
    /// Leading dense layers of the built-in shape: 1 as in Kimi-K2; all of them (`--dense 6 --layers 6`)
    /// for a DFlash drafter of Kimi-K2 size (six dense layers of the target's width).
    #[arg(long, default_value_t = 1)]
    dense: usize,
    /// Prefix tokens per sequence before the measured steps.
    #[arg(long, default_value_t = 4096)]
    prefix: usize,
    /// Decode batches, comma-separated.
    #[arg(long, default_value = "1,8,32", value_delimiter = ',')]
    batches: Vec<usize>,
    /// Tree rows per sequence (root included), comma-separated.
    #[arg(long, default_value = "17,33,65", value_delimiter = ',')]
    trees: Vec<usize>,
    /// Tree batches, comma-separated.
    #[arg(long, default_value = "1,8", value_delimiter = ',')]
    tree_batches: Vec<usize>,
    /// Timed steps per configuration.
    #[arg(long, default_value_t = 20)]
    steps: usize,
    /// Also write the table as CSV here.
    #[arg(long)]
    out: Option<PathBuf>,
    /// Pipeline stage counts to time beside one stage (on one device), comma-separated; replaces the
    /// per-stage table.
    #[arg(long, value_delimiter = ',')]
    pipeline: Vec<usize>,
    /// Ranks a stage for the `--pipeline` table (GPUs 0.. with `--gpu`); with more than 1 the table is
    /// made even without `--pipeline`.
    #[arg(long, default_value_t = 1)]
    tensor: usize,
}

/// Kimi-K2's shape (config.json of moonshotai/Kimi-K2-Instruct, research/kimi-int4.md) with `layers`
/// layers, the first `dense` of them dense, and `heads` heads.
fn kimi_config(layers: usize, dense: usize, heads: usize) -> Result<Config> {
    Config::from_json(&format!(
        r#"{{"vocab_size": 163840, "hidden_size": 7168, "intermediate_size": 18432, "moe_intermediate_size": 2048,
        "num_hidden_layers": {layers}, "num_attention_heads": {heads}, "q_lora_rank": 1536, "kv_lora_rank": 512,
        "qk_nope_head_dim": 128, "qk_rope_head_dim": 64, "v_head_dim": 128, "n_routed_experts": 384,
        "num_experts_per_tok": 8, "n_shared_experts": 1, "moe_layer_freq": 1,
        "first_k_dense_replace": {dense}, "routed_scaling_factor": 2.827, "norm_topk_prob": true,
        "rms_norm_eps": 1e-6, "rope_theta": 50000.0,
        "max_position_embeddings": 131072, "n_group": 1, "topk_group": 1, "topk_method": "noaux_tc",
        "scoring_func": "sigmoid", "rope_scaling": {{"type": "yarn", "factor": 32.0, "beta_fast": 1.0,
        "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 1.0, "original_max_position_embeddings": 4096}}}}"#
    ))
}

/// One measured step shape.
struct Row {
    kind: &'static str,
    batch: usize,
    rows: usize,
    step: Duration,
    stages: Vec<StageTime>,
}

fn main() -> ExitCode {
    common::exit_with(run(&Args::parse()))
}

fn run(args: &Args) -> Result<()> {
    let config = match &args.config {
        Some(path) => Config::from_file(path)?,
        None => kimi_config(args.layers, args.dense, args.heads)?,
    };
    if args.dense > args.layers {
        return Err(Error::param("--dense", args.dense, format!("at most --layers ({})", args.layers)));
    }
    if args.steps == 0 || args.batches.contains(&0) || args.tree_batches.contains(&0) {
        return Err(Error::param("--steps / --batches / --tree-batches", 0, "every count must be at least 1"));
    }
    if let Some(&n) = args.trees.iter().find(|&&n| n == 0 || n > 257) {
        return Err(Error::param("--trees", n, "tree rows must be in 1..=257"));
    }
    let split = !args.pipeline.is_empty() || args.tensor > 1;
    if !args.gpu {
        if split {
            return bench_pipeline(args, config, kdtree_engine::parallel::cpu_ranks);
        }
        return bench(args, Model::random(config, kdtree_engine::cpu::backend::CpuBackend, 1)?);
    }
    #[cfg(feature = "cuda")]
    {
        use kdtree_engine::cuda::{backend::CudaBackend, Gpu};
        if split {
            // Stages of one rank share GPU 0; with more ranks a stage, one rank a GPU.
            let ordinals =
                |l: Layout| if l.tensor == 1 { vec![0; l.pipeline] } else { (0..l.ranks()).collect::<Vec<_>>() };
            return bench_pipeline(args, config, |l| kdtree_engine::parallel::cuda_ranks(l, &ordinals(l)));
        }
        bench(args, Model::random(config, CudaBackend::new(Gpu::new(0)?)?, 1)?)
    }
    #[cfg(not(feature = "cuda"))]
    Err(Error::param("--gpu", true, "this build has no CUDA backend: build with `--features cuda`"))
}

/// A heap-shaped tree of `n` rows: depths and visibility bits (each row sees itself and its ancestors).
fn heap_tree(n: usize) -> (Vec<u32>, Vec<u32>) {
    let words = n.div_ceil(32);
    let mut depth = vec![0u32; n];
    let mut visibility = vec![0u32; n * words];
    for i in 0..n {
        let mut node = i;
        loop {
            visibility[i * words + node / 32] |= 1 << (node % 32);
            if node == 0 {
                break;
            }
            node = (node - 1) / 2;
            depth[i] += 1;
        }
    }
    (depth, visibility)
}

fn bench<B: Backend>(args: &Args, model: Model<B>) -> Result<()> {
    let c = model.config().clone();
    let max_batch = args.batches.iter().chain(&args.tree_batches).copied().max().unwrap_or(1);
    let max_tree = args.trees.iter().copied().max().unwrap_or(1);
    let len = args.prefix + args.steps * (args.batches.len() + 2) + max_tree + 8;
    let page = 64;
    let mut cache = model.new_cache(max_batch * len.div_ceil(page), page, len)?;
    let seqs: Vec<usize> = (0..max_batch).map(|_| cache.add_sequence()).collect();
    let token = |i: usize| ((i * 7919 + 13) % c.vocab_size) as u32;
    let start = Instant::now();
    for &seq in &seqs {
        let prompt: Vec<u32> = (0..args.prefix).map(|i| token(i + seq)).collect();
        for chunk in prompt.chunks(1024) {
            model.forward_argmax(&mut cache, &[(seq, chunk)], Logits::Last)?;
        }
    }
    eprintln!(
        "{}: {} sequences of {} prefix tokens in {:.1?}",
        model.backend().name(),
        seqs.len(),
        args.prefix,
        start.elapsed()
    );
    let mut rows = Vec::new();
    for &batch in &args.batches {
        let tokens: Vec<u32> = (0..batch).map(token).collect();
        let requests = decode_requests(&seqs[..batch], &tokens);
        rows.push(measure(&model, &mut cache, &requests, "decode", batch, 1, args.steps)?);
    }
    for &n in &args.trees {
        let (depth, visibility) = heap_tree(n);
        let tokens: Vec<u32> = (0..n).map(token).collect();
        for &batch in &args.tree_batches {
            let tree = Some(TreeInput { depth: &depth, visibility: &visibility });
            let requests: Vec<StepRequest> =
                seqs[..batch].iter().map(|&seq| StepRequest { seq, tokens: &tokens, tree }).collect();
            rows.push(measure(&model, &mut cache, &requests, "tree", batch, n, args.steps)?);
        }
    }
    report(args, &model.backend().name(), &c, &rows)
}

/// The decode and tree steps of `args` through 1 and each `--pipeline` count of stages of `--tensor`
/// ranks each, made by `ranks`, one micro-batch a step: a table of the mean step times (graphs on), of
/// each layout's communication in a profiled step, and of the difference to one stage per boundary.
fn bench_pipeline<B: Backend>(
    args: &Args,
    config: Config,
    ranks: impl Fn(Layout) -> Result<Vec<(B, std::sync::Arc<dyn Collective<B>>)>>,
) -> Result<()> {
    let mut counts = vec![1];
    for &p in &args.pipeline {
        if p == 0 || p > config.num_hidden_layers {
            return Err(Error::param("--pipeline", p, format!("stage counts in 1..={}", config.num_hidden_layers)));
        }
        if !counts.contains(&p) {
            counts.push(p);
        }
    }
    let mut names = Vec::new();
    let mut times: Vec<Vec<Duration>> = Vec::new();
    let mut comms: Vec<Vec<Duration>> = Vec::new();
    for &p in &counts {
        let layout = Layout { tensor: args.tensor, pipeline: p };
        let mut model = ShardedModel::random(config.clone(), layout, ranks(layout)?, 1)?;
        model.set_micro_batches(1)?;
        let steps = time_pipeline_steps(args, &model)?;
        names = steps.iter().map(|s| s.name.clone()).collect();
        times.push(steps.iter().map(|s| s.step).collect());
        comms.push(steps.iter().map(|s| s.communication).collect());
    }
    println!(
        "{} pipeline stages of {} rank(s), {} layers, {} heads, prefix {}, graph steps and profiled communication (ms):",
        counts.iter().map(|p| p.to_string()).collect::<Vec<_>>().join("/"),
        args.tensor,
        config.num_hidden_layers,
        config.num_attention_heads,
        args.prefix
    );
    let label = |p: usize| format!("{}x{p}", args.tensor);
    let head: Vec<String> = counts.iter().map(|&p| format!("{} step | {} comm", label(p), label(p))).collect();
    let per: Vec<String> = counts[1..].iter().map(|&p| format!("hand-over ({})", label(p))).collect();
    println!("| step | {} | {} |", head.join(" | "), per.join(" | "));
    println!("|---|{}{}", "---|".repeat(2 * head.len()), "---|".repeat(per.len()));
    for (i, name) in names.iter().enumerate() {
        let cells: Vec<String> =
            times.iter().zip(&comms).map(|(t, c)| format!("{:.3} | {:.3}", ms(t[i]), ms(c[i]))).collect();
        let boundary: Vec<String> = counts[1..]
            .iter()
            .zip(&times[1..])
            .map(|(&p, t)| format!("{:.3}", (ms(t[i]) - ms(times[0][i])) / (p - 1) as f64))
            .collect();
        println!("| {name} | {} | {} |", cells.join(" | "), boundary.join(" | "));
    }
    Ok(())
}

/// One step shape through a split model: its mean graph step and the communication of a profiled one.
struct SplitStep {
    name: String,
    step: Duration,
    communication: Duration,
}

/// Prefills every sequence, then times each decode batch and tree shape of `args` through `model`.
fn time_pipeline_steps<B: Backend>(args: &Args, model: &ShardedModel<B>) -> Result<Vec<SplitStep>> {
    let vocab = model.config().vocab_size;
    let max_batch = args.batches.iter().chain(&args.tree_batches).copied().max().unwrap_or(1);
    let max_tree = args.trees.iter().copied().max().unwrap_or(1);
    let len = args.prefix + (args.steps + 3) * (args.batches.len() + 2) + max_tree + 8;
    let page = 64;
    let mut cache = model.new_cache(max_batch * len.div_ceil(page), page, len)?;
    let seqs: Vec<usize> = (0..max_batch).map(|_| cache.add_sequence()).collect();
    let token = |i: usize| ((i * 7919 + 13) % vocab) as u32;
    for &seq in &seqs {
        let prompt: Vec<u32> = (0..args.prefix).map(|i| token(i + seq)).collect();
        for chunk in prompt.chunks(1024) {
            model.step_argmax(&mut cache, &[StepRequest { seq, tokens: chunk, tree: None }], Logits::Last)?;
        }
    }
    let mut times = Vec::new();
    for &batch in &args.batches {
        let tokens: Vec<u32> = (0..batch).map(token).collect();
        let requests = decode_requests(&seqs[..batch], &tokens);
        times.push(time_split_step(model, &mut cache, &requests, format!("decode bs {batch}"), args.steps)?);
    }
    for &n in &args.trees {
        let (depth, visibility) = heap_tree(n);
        let tokens: Vec<u32> = (0..n).map(token).collect();
        for &batch in &args.tree_batches {
            let tree = Some(TreeInput { depth: &depth, visibility: &visibility });
            let requests: Vec<StepRequest> =
                seqs[..batch].iter().map(|&seq| StepRequest { seq, tokens: &tokens, tree }).collect();
            times.push(time_split_step(model, &mut cache, &requests, format!("tree N {n} bs {batch}"), args.steps)?);
        }
    }
    Ok(times)
}

/// The mean step time of `requests` through `model` over `steps` steps, after two warm-up steps, and
/// the communication of one profiled step.
fn time_split_step<B: Backend>(
    model: &ShardedModel<B>,
    cache: &mut ShardedCache<B>,
    requests: &[StepRequest],
    name: String,
    steps: usize,
) -> Result<SplitStep> {
    let step = mean_step(steps, || model.step_argmax(cache, requests, Logits::Last).map(drop))?;
    let profiled = model.profile_step(cache, requests, Logits::Last)?;
    let communication = profiled.iter().filter(|t| t.stage == Stage::Communication).map(|t| t.time).sum();
    let layout = model.layout();
    eprintln!(
        "{}x{} {name}: {:.3} ms a step, {:.3} ms communication",
        layout.tensor,
        layout.pipeline,
        ms(step),
        ms(communication)
    );
    Ok(SplitStep { name, step, communication })
}

/// One decode token of `tokens` for each sequence of `seqs`.
fn decode_requests<'a>(seqs: &[usize], tokens: &'a [u32]) -> Vec<StepRequest<'a>> {
    seqs.iter().zip(tokens).map(|(&seq, t)| StepRequest { seq, tokens: std::slice::from_ref(t), tree: None }).collect()
}

/// The mean time of `steps` calls of `step`, after two warm-up calls (which record the graphs).
fn mean_step(steps: usize, mut step: impl FnMut() -> Result<()>) -> Result<Duration> {
    for _ in 0..2 {
        step()?;
    }
    let start = Instant::now();
    for _ in 0..steps {
        step()?;
    }
    Ok(start.elapsed() / steps as u32)
}

/// The mean step time over `steps` steps (graphs on, after two warm-up steps) and one profiled step.
fn measure<B: Backend>(
    model: &Model<B>,
    cache: &mut kdtree_engine::model::KvCache<B>,
    requests: &[StepRequest],
    kind: &'static str,
    batch: usize,
    rows: usize,
    steps: usize,
) -> Result<Row> {
    let step = mean_step(steps, || model.step_argmax(cache, requests, Logits::Last).map(drop))?;
    let stages = model.profile_step(cache, requests, Logits::Last)?;
    let profiled: Duration = stages.iter().map(|t| t.time).sum();
    // Also printed as it goes, so that a run cut short still shows what it measured.
    eprintln!("{kind} rows {rows} bs {batch}: {:.3} ms a step from graphs, {:.3} ms profiled", ms(step), ms(profiled));
    Ok(Row { kind, batch, rows, step, stages })
}

fn ms(d: Duration) -> f64 {
    d.as_secs_f64() * 1e3
}

/// A row's step and its 8-GPU, 61-layer projection, whole and the routed experts' part of it.
struct Projection {
    step: Duration,
    gpus_8: Duration,
    routed_8: Duration,
}

/// Each tree row against the decode row of its batch: the measured step, the 8-GPU projection (the
/// accepted length a DDTree step must reach to tie decoding, the drafter not counted) and its part
/// outside the routed experts, with the routed experts' time beside it.
fn verify_ratios(rows: &[Row], projections: &[Projection]) {
    println!("| verify vs decode | graph step | 8-GPU projection = break-even accepted length | without routed experts | routed experts, verify / decode ms |");
    println!("|---|---|---|---|---|");
    for (r, p) in rows.iter().zip(projections).filter(|(r, _)| r.kind == "tree") {
        let Some((_, d)) = rows.iter().zip(projections).find(|(d, _)| d.kind == "decode" && d.batch == r.batch) else {
            continue;
        };
        let ratio = |a: Duration, b: Duration| a.as_secs_f64() / b.as_secs_f64();
        println!(
            "| N {} bs {} | {:.2}x | {:.2}x | {:.2}x | {:.2} / {:.2} |",
            r.rows,
            r.batch,
            ratio(p.step, d.step),
            ratio(p.gpus_8, d.gpus_8),
            ratio(p.gpus_8 - p.routed_8, d.gpus_8 - d.routed_8),
            ms(p.routed_8),
            ms(d.routed_8)
        );
    }
}

/// Per-stage sums of a profiled step, and the per-layer-kind times of the 61-layer projection.
fn report(args: &Args, backend: &str, c: &Config, rows: &[Row]) -> Result<()> {
    const ORDER: [Stage; 7] = [
        Stage::Attention,
        Stage::Projections,
        Stage::Moe,
        Stage::SharedExpert,
        Stage::DenseMlp,
        Stage::Elementwise,
        Stage::LmHead,
    ];
    let mut csv = vec![format!(
        "backend,heads,layers,kind,batch,rows,step_ms,profiled_ms,{},dense_layer_ms,moe_layer_ms,outside_ms,projected_61_ms,projected_61_8gpu_ms",
        ORDER.map(|s| format!("{s:?}_ms").to_lowercase()).join(",")
    )];
    println!(
        "{backend}, {} heads, {} layers ({} MoE), prefix {}:",
        c.num_attention_heads,
        c.num_hidden_layers,
        (0..c.num_hidden_layers).filter(|&l| c.is_moe_layer(l)).count(),
        args.prefix
    );
    println!(
        "| step | graph step | profiled | {} | dense layer | MoE layer | 61-layer projection | 8-GPU projection |",
        ORDER.map(|s| format!("{s:?}")).join(" | ")
    );
    println!("|---|---|---|{}---|---|---|---|", "---|".repeat(ORDER.len()));
    let mut projections = Vec::with_capacity(rows.len());
    for r in rows {
        let mut by_stage: BTreeMap<Stage, Duration> = BTreeMap::new();
        let (mut dense, mut moe, mut outside) = (Duration::ZERO, Duration::ZERO, Duration::ZERO);
        // The share of each part that eight GPUs split (experts, MLPs, lm_head), counted once more here.
        let (mut dense_split, mut moe_split, mut outside_split) = (Duration::ZERO, Duration::ZERO, Duration::ZERO);
        let moe_layers = (0..c.num_hidden_layers).filter(|&l| c.is_moe_layer(l)).count();
        // The routed experts' own time in the MoE layers: the part no kernel removes (issue 36 reports the
        // rest of the step against it).
        let mut routed = Duration::ZERO;
        for t in &r.stages {
            *by_stage.entry(t.stage).or_default() += t.time;
            if t.stage == Stage::Moe && t.layer.is_some_and(|l| c.is_moe_layer(l)) {
                routed += t.time;
            }
            let split = matches!(t.stage, Stage::Moe | Stage::SharedExpert | Stage::DenseMlp | Stage::LmHead);
            let split_time = if split { t.time } else { Duration::ZERO };
            match t.layer {
                Some(l) if c.is_moe_layer(l) => (moe += t.time, moe_split += split_time),
                Some(_) => (dense += t.time, dense_split += split_time),
                None => (outside += t.time, outside_split += split_time),
            };
        }
        let profiled: Duration = by_stage.values().sum();
        let moe_layer = if moe_layers > 0 { moe / moe_layers as u32 } else { Duration::ZERO };
        let dense_layers = c.num_hidden_layers - moe_layers;
        let dense_layer = if dense_layers > 0 { dense / dense_layers as u32 } else { Duration::ZERO };
        // Kimi-K2: 61 layers, the first dense; embedding, final norm and lm_head once.
        let projected = dense_layer + moe_layer * 60 + outside;
        // Eight GPUs, each with this run's heads (--heads 8: one GPU's share of the attention), and the
        // experts, shared expert, dense MLP and lm_head split eight ways with no communication counted.
        let per_layer = |total: Duration, split: Duration, layers: usize| {
            if layers == 0 {
                Duration::ZERO
            } else {
                (total - split + split / 8) / layers as u32
            }
        };
        let projected_8 = per_layer(dense, dense_split, dense_layers)
            + per_layer(moe, moe_split, moe_layers) * 60
            + (outside - outside_split + outside_split / 8);
        let routed_8 = if moe_layers > 0 { routed / moe_layers as u32 * 60 / 8 } else { Duration::ZERO };
        projections.push(Projection { step: r.step, gpus_8: projected_8, routed_8 });
        let cells: Vec<String> =
            ORDER.iter().map(|s| format!("{:.3}", ms(by_stage.get(s).copied().unwrap_or_default()))).collect();
        let name = if r.kind == "tree" {
            format!("tree N {} bs {}", r.rows, r.batch)
        } else {
            format!("decode bs {}", r.batch)
        };
        println!(
            "| {name} | {:.3} | {:.3} | {} | {:.3} | {:.3} | {:.2} | {:.2} |",
            ms(r.step),
            ms(profiled),
            cells.join(" | "),
            ms(dense_layer),
            ms(moe_layer),
            ms(projected),
            ms(projected_8)
        );
        csv.push(format!(
            "{backend},{},{},{},{},{},{:.4},{:.4},{},{:.4},{:.4},{:.4},{:.3},{:.3}",
            c.num_attention_heads,
            c.num_hidden_layers,
            r.kind,
            r.batch,
            r.rows,
            ms(r.step),
            ms(profiled),
            cells.join(","),
            ms(dense_layer),
            ms(moe_layer),
            ms(outside),
            ms(projected),
            ms(projected_8)
        ));
    }
    verify_ratios(rows, &projections);
    if let Some(out) = &args.out {
        std::fs::write(out, csv.join("\n") + "\n")
            .map_err(|e| Error::Data { path: out.clone(), detail: e.to_string() })?;
    }
    Ok(())
}
