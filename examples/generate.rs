//! Autoregressive generation from a checkpoint directory, on the CPU or (with `--features cuda` and
//! `--gpu`) the CUDA backend: greedy, or temperature / top-p sampling with a seed. Prints the text as it
//! is generated, then tokens per second.
//!
//! ```text
//! cargo run --release --example generate -- --prompt "The capital of France is"
//! cargo run --release --example generate -- --chat --prompt "Hi!" --temperature 0.8 --top-p 0.9 --seed 7
//! cargo run --release --features cuda --example generate -- --gpu --prompt "The capital of France is"
//! ```
//! The default model is the tiny random checkpoint in `fixtures/tiny_model` (its text is noise).

use std::io::Write;
use std::path::PathBuf;
use std::time::Instant;

use clap::Parser;
use kdtree_engine::model::{ChatMessage, Logits, Model, Tokenizer};
use kdtree_engine::{Error, Result};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

#[derive(Parser, Debug)]
#[command(about = "Generate text with a DeepSeek-V3 / Kimi-K2 checkpoint")]
struct Args {
    /// Checkpoint directory: config.json, safetensors, tokenizer.json (+ tokenizer_config.json).
    #[arg(long, default_value = "fixtures/tiny_model")]
    model: PathBuf,
    /// The prompt.
    #[arg(long, default_value = "Once upon a time")]
    prompt: String,
    /// Wrap the prompt as a user message in the checkpoint's chat template.
    #[arg(long)]
    chat: bool,
    /// Tokens to generate (stops earlier at the EOS token).
    #[arg(long, default_value_t = 64)]
    max_tokens: usize,
    /// Sampling temperature; 0 is greedy.
    #[arg(long, default_value_t = 0.0)]
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
}

/// The model on the backend `--gpu` asks for.
fn load(args: &Args) -> Result<Model> {
    if !args.gpu {
        return Model::load(&args.model);
    }
    #[cfg(feature = "cuda")]
    {
        let gpu = kdtree_engine::cuda::Gpu::new(0)?;
        Model::load_on(&args.model, Box::new(kdtree_engine::model::ops::CudaOps::new(gpu)))
    }
    #[cfg(not(feature = "cuda"))]
    Err(Error::param("--gpu", true, "this build has no CUDA backend: build with `--features cuda`"))
}

fn main() -> Result<()> {
    let args = Args::parse();
    if args.temperature < 0.0 || !(args.top_p > 0.0 && args.top_p <= 1.0) {
        return Err(Error::param(
            "temperature / top_p",
            format!("{} / {}", args.temperature, args.top_p),
            "temperature must be >= 0 and top_p in (0, 1]",
        ));
    }
    let tokenizer = Tokenizer::from_dir(&args.model)?;
    let model = load(&args)?;
    let text = if args.chat {
        tokenizer.apply_chat_template(&[ChatMessage::new("user", &args.prompt)], true)?
    } else {
        args.prompt.clone()
    };
    let prompt = tokenizer.encode(&text, false)?;
    let mut cache =
        model.new_cache((prompt.len() + args.max_tokens).div_ceil(64) + 1, 64, prompt.len() + args.max_tokens)?;
    let seq = cache.add_sequence();
    let mut rng = StdRng::seed_from_u64(args.seed);
    print!("{text}");

    let start = Instant::now();
    let mut logits = model.forward(&mut cache, &[(seq, &prompt)], Logits::Last)?;
    let prefill = start.elapsed();
    let mut generated: Vec<u32> = Vec::new();
    let mut shown = 0;
    while generated.len() < args.max_tokens {
        let next = pick(&logits, args.temperature, args.top_p, &mut rng);
        generated.push(next);
        // Decode everything so far and print the new suffix; a token that ends inside a UTF-8 character
        // decodes to U+FFFD until the character is complete, so wait for it.
        let so_far = tokenizer.decode(&generated, true)?;
        if so_far.len() > shown && so_far.is_char_boundary(shown) && !so_far.ends_with('\u{FFFD}') {
            print!("{}", &so_far[shown..]);
            std::io::stdout().flush().ok();
            shown = so_far.len();
        }
        if Some(next) == tokenizer.eos_token_id() {
            break;
        }
        logits = model.forward(&mut cache, &[(seq, &[next])], Logits::Last)?;
    }
    let decode = start.elapsed() - prefill;
    println!();
    eprintln!(
        "prompt {} tokens in {:.2?} ({:.1} tok/s), generated {} tokens in {:.2?} ({:.1} tok/s)",
        prompt.len(),
        prefill,
        prompt.len() as f64 / prefill.as_secs_f64(),
        generated.len(),
        decode,
        generated.len() as f64 / decode.as_secs_f64()
    );
    Ok(())
}

/// Greedy (ties to the smaller id) at temperature 0, else a sample from the top-p nucleus of
/// `softmax(logits / temperature)`.
fn pick(logits: &[f32], temperature: f32, top_p: f32, rng: &mut StdRng) -> u32 {
    let mut order: Vec<usize> = (0..logits.len()).collect();
    // Largest first; the stable sort keeps the smaller id first among ties.
    order.sort_by(|&a, &b| logits[b].total_cmp(&logits[a]));
    if temperature == 0.0 {
        return order[0] as u32;
    }
    let max = logits[order[0]];
    let weights: Vec<f64> = order.iter().map(|&i| (((logits[i] - max) / temperature) as f64).exp()).collect();
    let total: f64 = weights.iter().sum();
    let mut kept = 0.0;
    let mut nucleus = 0;
    while nucleus < order.len() && kept < top_p as f64 * total {
        kept += weights[nucleus];
        nucleus += 1;
    }
    let mut r = rng.random::<f64>() * kept;
    for (i, w) in weights[..nucleus].iter().enumerate() {
        if r < *w {
            return order[i] as u32;
        }
        r -= w;
    }
    order[nucleus - 1] as u32
}
