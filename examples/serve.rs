//! An OpenAI-compatible server (`kdtree_engine::server`) over the speculative engine: the shipped model
//! on the CPU by default, CUDA with `--features cuda` and `--gpu`.
//!
//! ```text
//! cargo run --release --example serve
//! cargo run --release --example serve -- --mode ddtree --budget 32 --max-batch 16 --port 8000
//! cargo run --release --features cuda --example serve -- --gpu --mode auto
//! cargo run --release --features cuda --example serve -- --gpu --model path/to/Kimi-K2 --tensor 8
//! cargo run --release --example serve -- --tensor 2 --pipeline 2
//! curl http://127.0.0.1:8000/v1/completions -H 'content-type: application/json' \
//!     -d '{"model": "tiny-k2", "prompt": "It is a truth universally acknowledged, that", "max_tokens": 32}'
//! ```

mod common;

use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::sync::Arc;

use clap::Parser;
use kdtree_engine::model::backend::Backend;
use kdtree_engine::model::{drafter_beside, Drafter, Model, Tokenizer};
use kdtree_engine::parallel::{Layout, ShardedModel};
use kdtree_engine::server::{self, AppState, LoopStarter};
use kdtree_engine::spec::{DflashProposer, Engine, EngineConfig, Mode, NgramProposer, Target};
use kdtree_engine::{Error, Result};

#[derive(Parser, Debug, Clone)]
#[command(about = "Serve a DeepSeek-V3 / Kimi-K2 checkpoint over OpenAI's HTTP API")]
struct Args {
    /// Checkpoint directory: config.json, safetensors, tokenizer.json (+ tokenizer_config.json).
    #[arg(long, default_value = "fixtures/models/tiny-k2")]
    model: PathBuf,
    /// The model name clients ask for (default: the checkpoint directory's name).
    #[arg(long)]
    served_model_name: Option<String>,
    /// A DFlash drafter checkpoint directory (default: `<model>/drafter` when it exists).
    #[arg(long)]
    drafter: Option<PathBuf>,
    /// Draft by prompt lookup instead of a drafter.
    #[arg(long, conflicts_with = "drafter")]
    ngram: bool,
    /// Decoding mode: ar, chain, ddtree or auto.
    #[arg(long, default_value = "ddtree")]
    mode: Mode,
    /// Draft tree nodes per step (ddtree; the most auto may choose).
    #[arg(long, default_value_t = 16)]
    budget: usize,
    /// Most requests decoded together.
    #[arg(long, default_value_t = 64)]
    max_batch: usize,
    /// Most requests waiting for a place in the batch; more get 503.
    #[arg(long, default_value_t = 256)]
    max_queue: usize,
    /// KV cache pages of 16 slots (default: 64 a request of the batch, room for 1,024 tokens each; a
    /// request is admitted when its prompt and max_tokens fit the pages left).
    #[arg(long)]
    kv_pages: Option<usize>,
    /// Longest sequence, prompt and output (default and limit: the model's context).
    #[arg(long)]
    max_seq_len: Option<usize>,
    /// Run on the CUDA backend (needs the `cuda` feature and a device).
    #[arg(long)]
    gpu: bool,
    /// Ranks sharing each layer (tensor and expert parallel): CPU threads, or GPUs with `--gpu`.
    #[arg(long, default_value_t = 1)]
    tensor: usize,
    /// Pipeline stages of layers, each of `--tensor` ranks; GPUs 0.. in stage order with `--gpu`.
    #[arg(long, default_value_t = 1)]
    pipeline: usize,
    /// Address to listen on.
    #[arg(long, default_value = "127.0.0.1")]
    host: String,
    /// Port to listen on (0 picks a free one; the address is printed).
    #[arg(long, default_value_t = 8000)]
    port: u16,
}

fn main() -> ExitCode {
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env()
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info")),
        )
        .init();
    common::exit_with(run(Args::parse()))
}

fn run(args: Args) -> Result<()> {
    let tokenizer = Arc::new(Tokenizer::from_dir(&args.model)?);
    let name = args.served_model_name.clone().unwrap_or_else(|| dir_name(&args.model));
    let build_args = args.clone();
    let engine = server::spawn(move |starter| build(&build_args, starter), args.max_batch, args.max_queue)?;
    let info = engine.info().clone();
    let state = AppState::new(name.clone(), tokenizer, engine);
    let runtime = tokio::runtime::Runtime::new().map_err(|e| Error::param("tokio runtime", e, "could not start"))?;
    runtime.block_on(async move {
        let address = format!("{}:{}", args.host, args.port);
        let listener = tokio::net::TcpListener::bind(&address)
            .await
            .map_err(|e| Error::param("--host/--port", &address, format!("cannot listen there: {e}")))?;
        let local = listener.local_addr().map_err(|e| Error::param("listener", e, "has no address"))?;
        tracing::info!(
            "serving `{name}` on http://{local} (mode {}, max batch {}, context {}, {} KV pages)",
            info.mode,
            info.max_batch,
            info.max_seq_len,
            info.num_pages
        );
        let shutdown = async {
            let _ = tokio::signal::ctrl_c().await;
        };
        server::serve(listener, state, shutdown).await.map_err(|e| Error::param("server", e, "stopped"))
    })
}

fn dir_name(dir: &Path) -> String {
    dir.file_name().map_or_else(|| "model".to_string(), |n| n.to_string_lossy().into_owned())
}

/// Loads the model on the backend `--gpu` asks for, whole or split by `--tensor` / `--pipeline`, and
/// runs the engine loop (on the engine thread).
fn build(args: &Args, starter: LoopStarter) -> Result<()> {
    let layout = Layout { tensor: args.tensor, pipeline: args.pipeline };
    let split = layout != Layout::tensor(1);
    if !args.gpu {
        if split {
            let model = ShardedModel::load_cpu(&args.model, layout)?;
            return serve_model(args, &model, &model.ranks()[0], starter);
        }
        let model = Model::load(&args.model)?;
        return serve_model(args, &model, &model, starter);
    }
    #[cfg(feature = "cuda")]
    {
        use kdtree_engine::cuda::backend::CudaBackend;
        if split {
            let ordinals: Vec<usize> = (0..layout.ranks()).collect();
            let model = ShardedModel::load_cuda(&args.model, layout, &ordinals)?;
            return serve_model(args, &model, &model.ranks()[0], starter);
        }
        let model = Model::load_on(&args.model, CudaBackend::new(kdtree_engine::cuda::Gpu::new(0)?)?)?;
        serve_model(args, &model, &model, starter)
    }
    #[cfg(not(feature = "cuda"))]
    Err(Error::param("--gpu", true, "this build has no CUDA backend: build with `--features cuda`"))
}

/// The engine over `model` with the proposer the options ask for, served until the server stops. The
/// drafter sits beside `first`, the model's first rank (the whole model when it is not split).
fn serve_model<B: Backend, T: Target<B>>(args: &Args, model: &T, first: &Model<B>, starter: LoopStarter) -> Result<()> {
    let drafter_dir = if args.ngram || args.mode == Mode::Ar {
        None
    } else {
        args.drafter.clone().or_else(|| drafter_beside(&args.model))
    };
    let drafter = drafter_dir.map(|dir| Drafter::load(dir, first)).transpose()?;
    let context = model.config().max_position_embeddings;
    let max_seq_len = args.max_seq_len.unwrap_or(context);
    if max_seq_len > context {
        return Err(Error::param(
            "--max-seq-len",
            max_seq_len,
            format!("must be at most the model's context {context}"),
        ));
    }
    let block = drafter.as_ref().map_or(16, |d| d.dflash().block_size);
    let page_size = 16;
    let rows = max_seq_len + args.budget.max(block) + 1;
    let config = EngineConfig {
        mode: args.mode,
        budget: args.budget,
        block,
        num_pages: args.kv_pages.unwrap_or((args.max_batch * 1024 / page_size).max(rows.div_ceil(page_size))),
        page_size,
        max_seq_len: rows,
    };
    match &drafter {
        Some(d) => {
            let mut engine = Engine::new(model, DflashProposer::new(d, &config)?, config)?;
            engine.warm_up(args.max_batch, config.max_seq_len)?;
            starter.run(&mut engine)
        }
        None => {
            let mut engine = Engine::new(model, NgramProposer::default(), config)?;
            engine.warm_up(args.max_batch, config.max_seq_len)?;
            starter.run(&mut engine)
        }
    }
}
