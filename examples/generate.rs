//! Generation from a checkpoint directory, on the CPU or (with `--features cuda` and `--gpu`) the CUDA
//! backend, through the speculative engine (`kdtree_engine::spec`) in `--mode ar`, `chain`, `ddtree` or
//! `auto` (drafts from the checkpoint's DFlash drafter in `<model>/drafter`, another one with `--drafter`,
//! or prompt lookup with `--ngram`; `--budget` tree nodes, `--block` size), for `--batch` copies of the
//! prompt or, with `--prompts FILE`, a batch of different prompts cut from a text: greedy, or temperature /
//! top-p sampling with a seed; every mode emits the same tokens. Prints the text as it is generated, then
//! the load time, the time to the first token, the decode rate and the speculative counters. Bad options
//! or a prompt that does not fit the context are errors that say so.
//!
//! ```text
//! cargo run --release --example generate -- --prompt "It is a truth universally acknowledged, that"
//! cargo run --release --example generate -- --mode ddtree --budget 32 --batch 4
//! cargo run --release --example generate -- --mode chain --prompts fixtures/models/heldout.txt --batch 16
//! cargo run --release --example generate -- --chat --prompt "Hi!" --temperature 0.8 --top-p 0.9 --seed 7
//! cargo run --release --features cuda --example generate -- --gpu --mode auto
//! cargo run --release --example generate -- --mode ddtree --tensor 2 --pipeline 2
//! ```
//! The default model is the shipped one, `fixtures/models/tiny-k2` (trained by `train/`, see README).

mod common;

use std::io::Write;
use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::time::{Duration, Instant};

use clap::Parser;
use kdtree_engine::model::backend::Backend;
use kdtree_engine::model::{drafter_beside, ChatMessage, Drafter, Model, Tokenizer};
use kdtree_engine::parallel::{Layout, ShardedModel};
use kdtree_engine::spec::{
    DflashProposer, Engine, EngineConfig, Mode, NgramProposer, Proposer, RequestParams, Sampling, Target,
};
use kdtree_engine::{Error, Result};

#[derive(Parser, Debug)]
#[command(about = "Generate text with a DeepSeek-V3 / Kimi-K2 checkpoint")]
struct Args {
    /// Checkpoint directory: config.json, safetensors, tokenizer.json (+ tokenizer_config.json).
    #[arg(long, default_value = "fixtures/models/tiny-k2")]
    model: PathBuf,
    /// The prompt.
    #[arg(long, default_value = "It is a truth universally acknowledged, that")]
    prompt: String,
    /// Take the batch's prompts from this text instead: request i gets the opening tokens of the i-th of
    /// `--batch` (× `--rounds`) paragraphs spread evenly over the file (the first one's text is printed).
    #[arg(long)]
    prompts: Option<PathBuf>,
    /// Tokens of each prompt cut by `--prompts`.
    #[arg(long, default_value_t = 48)]
    prompt_tokens: usize,
    /// Wrap the prompt as a user message in the checkpoint's chat template.
    #[arg(long)]
    chat: bool,
    /// Tokens to generate (stops earlier at the EOS token).
    #[arg(long, default_value_t = 64)]
    max_tokens: usize,
    /// Sampling temperature; 0 is greedy.
    #[arg(long, default_value_t = 0.0, allow_hyphen_values = true)]
    temperature: f32,
    /// Nucleus sampling: keep the smallest set of tokens whose probability reaches this.
    #[arg(long, default_value_t = 1.0)]
    top_p: f32,
    /// Seed of the sampler.
    #[arg(long, default_value_t = 0)]
    seed: u64,
    /// Run on the CUDA backend (needs the `cuda` feature and a device).
    #[arg(long)]
    gpu: bool,
    /// Decoding mode: ar, chain, ddtree or auto.
    #[arg(long, default_value = "ar")]
    mode: Mode,
    /// Draft tree nodes per step in ddtree mode (the most auto may choose).
    #[arg(long, default_value_t = 16)]
    budget: usize,
    /// Block size: the bonus token and block - 1 draft positions (default: the drafter's, else 16).
    #[arg(long)]
    block: Option<usize>,
    /// A DFlash drafter checkpoint directory (default: `<model>/drafter` when it exists).
    #[arg(long)]
    drafter: Option<PathBuf>,
    /// Draft by prompt lookup (n-gram matches in the sequence) instead of a drafter.
    #[arg(long, conflicts_with = "drafter")]
    ngram: bool,
    /// Requests decoded together: copies of the prompt, or prompts cut by `--prompts` (the first one's
    /// text is printed).
    #[arg(long, default_value_t = 1)]
    batch: usize,
    /// Batches run one after another on the same engine (with `--prompts`, each takes the next
    /// `--batch` prompts); the rates are over all of them, for steadier figures than one short run.
    #[arg(long, default_value_t = 1)]
    rounds: usize,
    /// Ranks sharing each layer (tensor and expert parallel): CPU threads, or GPUs with `--gpu`.
    #[arg(long, default_value_t = 1)]
    tensor: usize,
    /// Pipeline stages of layers, each of `--tensor` ranks; GPUs 0.. in stage order with `--gpu`.
    #[arg(long, default_value_t = 1)]
    pipeline: usize,
}

/// Checks the sampling options; an error names the bad one.
fn check_args(args: &Args) -> Result<()> {
    if !(args.temperature.is_finite() && args.temperature >= 0.0) {
        return Err(Error::param("--temperature", args.temperature, "must be a finite number >= 0 (0 is greedy)"));
    }
    if !(args.top_p > 0.0 && args.top_p <= 1.0) {
        return Err(Error::param("--top-p", args.top_p, "must be in (0, 1]"));
    }
    if args.max_tokens == 0 {
        return Err(Error::param("--max-tokens", 0, "must be at least 1"));
    }
    if args.rounds == 0 {
        return Err(Error::param("--rounds", 0, "must be at least 1"));
    }
    if args.batch == 0 {
        return Err(Error::param("--batch", 0, "must be at least 1"));
    }
    Ok(())
}

fn main() -> ExitCode {
    common::exit_with(run(&Args::parse()))
}

/// Loads the model on the backend `--gpu` asks for and generates.
fn run(args: &Args) -> Result<()> {
    check_args(args)?;
    let start = Instant::now();
    let layout = Layout { tensor: args.tensor, pipeline: args.pipeline };
    let split = layout != Layout::tensor(1);
    if !args.gpu {
        if split {
            let model = ShardedModel::load_cpu(&args.model, layout)?;
            return generate(args, &model, &model.ranks()[0], start);
        }
        let model = Model::load(&args.model)?;
        return generate(args, &model, &model, start);
    }
    #[cfg(feature = "cuda")]
    {
        use kdtree_engine::cuda::backend::CudaBackend;
        if split {
            let ordinals: Vec<usize> = (0..layout.ranks()).collect();
            let model = ShardedModel::load_cuda(&args.model, layout, &ordinals)?;
            return generate(args, &model, &model.ranks()[0], start);
        }
        let model = Model::load_on(&args.model, CudaBackend::new(kdtree_engine::cuda::Gpu::new(0)?)?)?;
        generate(args, &model, &model, start)
    }
    #[cfg(not(feature = "cuda"))]
    Err(Error::param("--gpu", true, "this build has no CUDA backend: build with `--features cuda`"))
}

/// The batch's prompts (text, token ids), each checked against the model's context.
fn encode_prompts(args: &Args, tokenizer: &Tokenizer, context: usize) -> Result<Vec<(String, Vec<u32>)>> {
    let prompts = match &args.prompts {
        Some(path) => cut_prompts(path, args.batch * args.rounds, args.prompt_tokens, tokenizer)?,
        None => vec![encode_prompt(args, tokenizer)?; args.batch * args.rounds],
    };
    let longest = prompts.iter().map(|(_, ids)| ids.len()).max().unwrap_or(0);
    if longest + args.max_tokens > context {
        return Err(Error::param(
            "--max-tokens",
            args.max_tokens,
            format!("a prompt's {longest} tokens plus max tokens exceed the model's context of {context}"),
        ));
    }
    Ok(prompts)
}

/// `--prompt`, wrapped in the chat template with `--chat`.
fn encode_prompt(args: &Args, tokenizer: &Tokenizer) -> Result<(String, Vec<u32>)> {
    let text = if args.chat {
        tokenizer.apply_chat_template(&[ChatMessage::new("user", &args.prompt)], true)?
    } else {
        args.prompt.clone()
    };
    let prompt = tokenizer.encode(&text, false)?;
    if prompt.is_empty() {
        return Err(Error::param("--prompt", "\"\"", "the prompt has no tokens; give at least one"));
    }
    Ok((text, prompt))
}

/// The opening `tokens` tokens of `count` paragraphs (blank-line separated, at least that long) spread
/// evenly over the text in `path`.
fn cut_prompts(path: &Path, count: usize, tokens: usize, tokenizer: &Tokenizer) -> Result<Vec<(String, Vec<u32>)>> {
    if tokens == 0 {
        return Err(Error::param("--prompt-tokens", 0, "must be at least 1"));
    }
    let text = std::fs::read_to_string(path).map_err(|e| Error::Data { path: path.into(), detail: e.to_string() })?;
    let mut long = Vec::new();
    for paragraph in text.split("\n\n") {
        let ids = tokenizer.encode(paragraph.trim(), false)?;
        if ids.len() >= tokens {
            long.push(ids[..tokens].to_vec());
        }
    }
    if long.len() < count {
        return Err(Error::Data {
            path: path.into(),
            detail: format!(
                "{} paragraphs of at least {tokens} tokens, fewer than the {count} prompts asked for",
                long.len()
            ),
        });
    }
    (0..count)
        .map(|i| {
            let ids = long[i * long.len() / count].clone();
            Ok((tokenizer.decode(&ids, false)?, ids))
        })
        .collect()
}

/// Prints the new suffix of the text of `generated` past the `shown` bytes printed already; a token
/// that ends inside a UTF-8 character decodes to U+FFFD until the character is complete, so wait for it.
fn show(tokenizer: &Tokenizer, generated: &[u32], shown: &mut usize) -> Result<()> {
    let so_far = tokenizer.decode(generated, true)?;
    if so_far.len() > *shown && so_far.is_char_boundary(*shown) && !so_far.ends_with('\u{FFFD}') {
        print!("{}", &so_far[*shown..]);
        std::io::stdout().flush().ok();
        *shown = so_far.len();
    }
    Ok(())
}

/// Generates from `model`, whose first rank is `first` (the model itself when not split; loading began
/// at `start`).
fn generate<B: Backend, T: Target<B>>(args: &Args, model: &T, first: &Model<B>, start: Instant) -> Result<()> {
    let tokenizer = Tokenizer::from_dir(&args.model)?;
    let load = start.elapsed();
    let prompts = encode_prompts(args, &tokenizer, model.config().max_position_embeddings)?;
    let on = Run { backend: first.backend().name(), tokenizer: &tokenizer, prompts: &prompts, load };
    generate_with_engine(args, model, first, &on)
}

/// What a generation run prints beside its counters.
struct Run<'a> {
    backend: String,
    tokenizer: &'a Tokenizer,
    prompts: &'a [(String, Vec<u32>)],
    load: std::time::Duration,
}

/// `--batch` copies of the prompt through the speculative engine with the proposer the options ask for
/// (a drafter beside `first`, the model's first rank).
fn generate_with_engine<B: Backend, T: Target<B>>(args: &Args, model: &T, first: &Model<B>, on: &Run) -> Result<()> {
    let prompts = on.prompts;
    let drafter = drafter_dir(args).map(|dir| Drafter::load(dir, first)).transpose()?;
    let block = args.block.or(drafter.as_ref().map(|d| d.dflash().block_size)).unwrap_or(16);
    let longest = prompts.iter().map(|(_, ids)| ids.len()).max().unwrap_or(0);
    let len = longest + args.max_tokens + args.budget.max(block) + 1;
    let page_size = 16;
    let config = EngineConfig {
        mode: args.mode,
        budget: args.budget,
        block,
        num_pages: args.batch * len.div_ceil(page_size),
        page_size,
        max_seq_len: len,
    };
    let captures = || first.graph_captures() + drafter.as_ref().map_or(0, |d| d.model().graph_captures());
    match &drafter {
        Some(d) => drive(args, Engine::new(model, DflashProposer::new(d, &config)?, config)?, on, &captures),
        None => drive(args, Engine::new(model, NgramProposer::default(), config)?, on, &captures),
    }
}

/// `--drafter`, else `<model>/drafter` when it holds a checkpoint; none with `--ngram` or in `ar` mode.
fn drafter_dir(args: &Args) -> Option<PathBuf> {
    if args.ngram || args.mode == Mode::Ar {
        return None;
    }
    args.drafter.clone().or_else(|| drafter_beside(&args.model))
}

/// Adds `batch`'s requests and steps until all have finished; prints the first one's text as it comes
/// when given the tokenizer. Returns the time to the first tokens and the time after them.
fn run_round<B: Backend, P: Proposer, T: Target<B>>(
    engine: &mut Engine<B, P, T>,
    batch: &[(String, Vec<u32>)],
    params: &RequestParams,
    shown_with: Option<&Tokenizer>,
) -> Result<(Duration, Duration)> {
    let ids: Vec<_> = batch.iter().map(|(_, ids)| engine.add_request(ids, params.clone())).collect::<Result<_>>()?;
    let begin = Instant::now();
    let (mut generated, mut shown, mut first_token) = (Vec::new(), 0, None);
    while engine.pending() > 0 {
        for out in engine.step()? {
            if let Some(tokenizer) = shown_with.filter(|_| out.id == ids[0]) {
                generated.extend(&out.tokens);
                show(tokenizer, &generated, &mut shown)?;
            }
        }
        first_token.get_or_insert_with(|| begin.elapsed());
    }
    let total = begin.elapsed();
    let first_token = first_token.unwrap_or(total);
    Ok((first_token, total - first_token))
}

/// Runs the requests to the end; prints the first one's text as it comes, then the rates and counters.
/// `captures` counts the step graphs recorded so far (target and drafter).
fn drive<B: Backend, P: Proposer, T: Target<B>>(
    args: &Args,
    mut engine: Engine<B, P, T>,
    on: &Run,
    captures: &dyn Fn() -> u64,
) -> Result<()> {
    let Run { backend, tokenizer, prompts, load } = on;
    let warm = Instant::now();
    engine.warm_up(args.batch, engine.config().max_seq_len)?;
    eprintln!("warm-up for batch {}: {:.2?}, {} step graphs recorded", args.batch, warm.elapsed(), captures());
    let warm_captures = captures();
    print!("{}", prompts[0].0);
    let params = RequestParams {
        max_tokens: args.max_tokens,
        stop_tokens: tokenizer.eos_token_id().into_iter().collect(),
        sampling: (args.temperature > 0.0).then_some(Sampling {
            temperature: args.temperature,
            top_p: args.top_p,
            top_k: 0,
            seed: args.seed,
        }),
        logprobs: None,
    };
    let (mut decode, mut first_tokens) = (Duration::ZERO, Duration::ZERO);
    for (round, batch) in prompts.chunks(args.batch).enumerate() {
        let (first, rest) = run_round(&mut engine, batch, &params, (round == 0).then_some(*tokenizer))?;
        (first_tokens, decode) = (first_tokens + first, decode + rest);
    }
    println!();
    let stats = engine.stats();
    let decoded = stats.tokens.saturating_sub(prompts.len() as u64);
    eprintln!(
        "{}: load {load:.2?}; {} x {} prompts of {}-{} tokens, first tokens after {:.2?}; {decoded} more tokens in \
         {decode:.2?} ({:.1} tok/s)",
        backend,
        args.rounds,
        args.batch,
        prompts.iter().map(|(_, ids)| ids.len()).min().unwrap_or(0),
        prompts.iter().map(|(_, ids)| ids.len()).max().unwrap_or(0),
        first_tokens / args.rounds as u32,
        decoded as f64 / decode.as_secs_f64()
    );
    let by_depth: Vec<String> = stats.accepted_by_depth.iter().map(|n| n.to_string()).collect();
    eprintln!(
        "mode {:?}: {} steps, mean accepted length {:.2}, {} of {} draft tokens accepted; accepted at depth 1..: [{}]",
        args.mode,
        stats.steps,
        stats.mean_accepted_length(),
        stats.accepted,
        stats.draft_tokens,
        by_depth.join(", ")
    );
    let budgets: Vec<String> = stats.steps_by_budget.iter().map(|(b, n)| format!("B {b}: {n}")).collect();
    eprintln!(
        "steps by tree budget: {}; step graphs recorded during the run: {}",
        budgets.join(", "),
        captures() - warm_captures
    );
    let st = &stats.stages;
    eprintln!(
        "stages: prefill {:.2?}, draft {:.2?}, tree build {:.2?}, verify {:.2?}, accept {:.2?}, compaction {:.2?}, \
         host {:.2?}; TTFT {:.2?}, TPOT {:.2?}",
        st.prefill,
        st.draft,
        st.tree_build,
        st.verify,
        st.accept,
        st.compaction,
        st.host,
        stats.mean_ttft(),
        stats.mean_tpot()
    );
    Ok(())
}
