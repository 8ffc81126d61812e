//! A serving load generator in the style of SGLang's `bench_serving`, against the OpenAI-compatible HTTP
//! server (`examples/serve.rs`): for each `--concurrency` level, that many clients (one thread each) send
//! streamed `POST /v1/completions` requests back to back, each taking the next request from a shared
//! counter, until `--num-prompts` requests are done; then the level's metrics are printed the way SGLang
//! prints them, appended to a CSV, and at the end the whole CSV (all labels in it) is plotted.
//!
//! Prompts are cut from a held-out text (`--dataset`, blank-line separated paragraphs), never random
//! tokens: each paragraph of at least `--prompt-tokens` tokens (per the tokenizer in `--tokenizer`) is cut
//! to exactly that many tokens and decoded back to text, and only the cuts whose text encodes again to
//! that many tokens are kept, so every prompt has the same length; request i gets cut i mod count.
//! Every request asks for `--max-tokens` tokens at temperature 0 with `ignore_eos`, so each produces
//! exactly that many. One warm-up request (`--warmup-requests`) goes first and is not measured.
//!
//! The metrics follow SGLang's / vLLM's definitions:
//! - TTFT: from sending the request to the first SSE chunk whose text is non-empty;
//! - E2E latency: from sending to the `data: [DONE]` line;
//! - ITL: the gap between consecutive non-empty text chunks. A chunk may carry several tokens (a
//!   speculative step emits all its accepted tokens at once) and the tokens per chunk are not known
//!   exactly, so each chunk is one ITL sample, as in vLLM's client: ITL is the time between the
//!   server's decode steps as the client sees them, not a per-token time;
//! - TPOT: (E2E − TTFT) / (output tokens − 1) over the requests with more than one output token, with
//!   the output tokens from the stream's final usage chunk (`completion_tokens`; the retokenized text
//!   when a stream has no usage), so it is per token whatever the chunking;
//! - throughputs divide by the level's wall time (first request sent to last one done); input tokens
//!   are the usage's `prompt_tokens` (else the local count); "Concurrency" is the sum of E2E latencies
//!   over the wall time; mean, median and percentiles are numpy's (linear interpolation), 0 when empty;
//! - accept length: 1 + Δaccepted / Δdrafts of the server's `kdtree_spec_decode_num_accepted_tokens_total`
//!   and `kdtree_spec_decode_num_drafts_total` counters (vLLM's semantics) between a `GET /metrics`
//!   before and after the level; "n/a" when no draft was made (e.g. `ar` mode) or the scrape failed.
//!
//! A request whose status is not 200, whose stream breaks, carries an error or ends without
//! `data: [DONE]` is failed: it counts in `failed` and in no metric, and each distinct error message
//! is printed once per level. The run exits with an error status when any request failed (after writing everything).
//!
//! The run's label (the CSV's `label` column, the plot's line) is `--label`, else the server's mode from
//! its `kdtree_mode_info{mode="..."} 1` metric, else "unknown". The CSV (`--csv`) gets one row per level
//! (`requests` = requests sent, `failed` = those that failed, times in ms, throughputs per second);
//! `--append` adds the rows to an existing CSV instead of overwriting it, so the runs of several modes
//! accumulate in one file. The plot (`--plot`, SVG) has two panels, output tok/s and mean TPOT against
//! concurrency (log-2 x axis), one line per label; where a label has several rows of one concurrency
//! the last one is drawn. `--plot-only` re-plots an existing CSV without running anything.
//!
//! ```text
//! cargo run --release --example serve -- --mode ddtree &    # the server, on 127.0.0.1:8000
//! cargo run --release --example bench_serving
//! cargo run --release --example bench_serving -- --concurrency 1,8,32 --num-prompts 64 --label ddtree
//! cargo run --release --example bench_serving -- --append --label chain     # another mode, same CSV
//! cargo run --release --example bench_serving -- --plot-only --csv bench_serving.csv --plot sweep.svg
//! ```
//! `--num-prompts` defaults to max(16, 4 × concurrency) per level: every client sends about four
//! requests, so the ramp-up and the tail, where fewer clients are busy, weigh little.

mod common;

use std::fmt::Display;
use std::fs::OpenOptions;
use std::io::{BufRead, BufReader, Write};
use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Mutex;
use std::time::{Duration, Instant};

use clap::Parser;
use indicatif::{ProgressBar, ProgressStyle};
use kdtree_engine::model::Tokenizer;
use kdtree_engine::{Error, Result};
use serde_json::Value;

#[derive(Parser, Debug)]
#[command(about = "Serving benchmark (SGLang bench_serving style) of the OpenAI-compatible server")]
struct Args {
    /// The server's base URL.
    #[arg(long, default_value = "http://127.0.0.1:8000")]
    base_url: String,
    /// Model name sent with each request (default: the first one `GET /v1/models` lists).
    #[arg(long)]
    model: Option<String>,
    /// The run's label in the CSV and the plot (default: the server's mode from `kdtree_mode_info` in
    /// `/metrics`, else "unknown").
    #[arg(long)]
    label: Option<String>,
    /// Text the prompts are cut from: paragraphs separated by blank lines.
    #[arg(long, default_value = "fixtures/models/heldout.txt")]
    dataset: PathBuf,
    /// Checkpoint directory whose tokenizer.json cuts the prompts and counts tokens.
    #[arg(long, default_value = "fixtures/models/tiny-k2")]
    tokenizer: PathBuf,
    /// Tokens of every prompt.
    #[arg(long, default_value_t = 48)]
    prompt_tokens: usize,
    /// Tokens every request generates (`ignore_eos`, so exactly this many).
    #[arg(long, default_value_t = 64)]
    max_tokens: usize,
    /// Concurrency levels (clients sending at once), run in this order; space- or comma-separated.
    #[arg(long, num_args = 1.., value_delimiter = ',', default_values_t = [1, 4, 8, 10, 16, 32, 64])]
    concurrency: Vec<usize>,
    /// Requests per level (default: max(16, 4 × concurrency)).
    #[arg(long)]
    num_prompts: Option<usize>,
    /// Unmeasured requests sent one at a time before the first level.
    #[arg(long, default_value_t = 1)]
    warmup_requests: usize,
    /// Seconds one request may take, stream included, before it fails.
    #[arg(long, default_value_t = 600)]
    timeout: u64,
    /// CSV file of the results, one row per level.
    #[arg(long, default_value = "bench_serving.csv")]
    csv: PathBuf,
    /// Append the rows to `--csv` (its header must be this program's) instead of overwriting it.
    #[arg(long)]
    append: bool,
    /// SVG plot of the whole `--csv`: output tok/s and mean TPOT against concurrency, a line per label.
    #[arg(long, default_value = "bench_serving.svg")]
    plot: PathBuf,
    /// Do not draw the plot.
    #[arg(long, conflicts_with = "plot_only")]
    no_plot: bool,
    /// Only re-plot an existing `--csv` into `--plot`; send no request.
    #[arg(long)]
    plot_only: bool,
}

/// The CSV's header; `--append` requires an existing file to start with it.
const CSV_HEADER: &str = "label,concurrency,requests,failed,duration_s,request_throughput,output_throughput,\
ttft_mean_ms,ttft_median_ms,ttft_p99_ms,tpot_mean_ms,tpot_median_ms,tpot_p99_ms,itl_mean_ms,itl_median_ms,\
itl_p99_ms,e2e_mean_ms,accept_length";

/// The counter of speculative steps (vLLM: drafts proposed).
const METRIC_DRAFTS: &str = "kdtree_spec_decode_num_drafts_total";
/// The counter of draft tokens proposed.
const METRIC_DRAFT_TOKENS: &str = "kdtree_spec_decode_num_draft_tokens_total";
/// The counter of draft tokens accepted.
const METRIC_ACCEPTED: &str = "kdtree_spec_decode_num_accepted_tokens_total";
/// The info metric whose `mode` label names the server's decoding mode.
const METRIC_MODE: &str = "kdtree_mode_info";

/// Checks the options of a run; an error names the bad one.
fn check_args(args: &Args) -> Result<()> {
    if args.concurrency.is_empty() {
        return Err(Error::param("--concurrency", "[]", "give at least one level, e.g. `--concurrency 1,4,16`"));
    }
    if args.concurrency.contains(&0) {
        let list: Vec<String> = args.concurrency.iter().map(|c| c.to_string()).collect();
        return Err(Error::param("--concurrency", list.join(","), "every level must be at least 1"));
    }
    if args.max_tokens == 0 {
        return Err(Error::param("--max-tokens", 0, "must be at least 1"));
    }
    if args.prompt_tokens == 0 {
        return Err(Error::param("--prompt-tokens", 0, "must be at least 1"));
    }
    if args.num_prompts == Some(0) {
        return Err(Error::param("--num-prompts", 0, "must be at least 1"));
    }
    if args.timeout == 0 {
        return Err(Error::param("--timeout", 0, "must be at least 1 second"));
    }
    if !(args.base_url.starts_with("http://") || args.base_url.starts_with("https://")) {
        return Err(Error::param("--base-url", &args.base_url, "must start with http:// (e.g. http://127.0.0.1:8000)"));
    }
    Ok(())
}

fn main() -> ExitCode {
    common::exit_with(run(&Args::parse()))
}

/// Runs the sweep (or, with `--plot-only`, only the plot).
fn run(args: &Args) -> Result<()> {
    if args.plot_only {
        return plot_csv(&args.csv, &args.plot);
    }
    check_args(args)?;
    let tokenizer = Tokenizer::from_dir(&args.tokenizer)?;
    let prompts = load_prompts(&args.dataset, args.prompt_tokens, &tokenizer)?;
    let base = args.base_url.trim_end_matches('/').to_string();
    let pool = args.concurrency.iter().copied().max().unwrap_or(1);
    let agent: ureq::Agent = ureq::Agent::config_builder()
        .http_status_as_error(false)
        .timeout_global(Some(Duration::from_secs(args.timeout)))
        .timeout_connect(Some(Duration::from_secs(10)))
        .max_idle_connections(pool)
        .max_idle_connections_per_host(pool)
        .build()
        .into();
    let model = match &args.model {
        Some(model) => {
            list_models(&agent, &base)?;
            model.clone()
        }
        None => list_models(&agent, &base)?.into_iter().next().ok_or_else(|| {
            Error::param("--model", "(none)", format!("{base}/v1/models lists no model; name one with --model"))
        })?,
    };
    let first_scrape = scrape_metrics(&agent, &base);
    if let Err(e) = &first_scrape {
        eprintln!("warning: {e}; the accept length will be n/a");
    }
    let label = match &args.label {
        Some(label) => label.clone(),
        None => first_scrape.as_deref().ok().and_then(parse_mode_info).unwrap_or_else(|| "unknown".into()),
    };
    println!(
        "{base}: model {model}, label {label}; {} prompts of {} tokens from {}, {} tokens each",
        prompts.len(),
        args.prompt_tokens,
        args.dataset.display(),
        args.max_tokens
    );
    let client = Client { agent, url: format!("{base}/v1/completions"), model, max_tokens: args.max_tokens };
    for i in 0..args.warmup_requests {
        let out = client.send(&prompts[i % prompts.len()]);
        if !out.success {
            return Err(Error::param("--base-url", &base, format!("the warm-up request failed: {}", out.error)));
        }
    }
    let mut csv = open_csv(&args.csv, args.append)?;
    let (mut summaries, mut failed, mut sent) = (Vec::new(), 0, 0);
    let mut first_texts: Vec<Option<String>> = vec![None; prompts.len()];
    let mut differing = Vec::new();
    for &concurrency in &args.concurrency {
        let num = args.num_prompts.unwrap_or((4 * concurrency).max(16));
        let before = scrape_metrics(&client.agent, &base).ok();
        let (outputs, duration_s) = run_level(&client, &prompts, concurrency, num)?;
        let after = scrape_metrics(&client.agent, &base).ok();
        let accept = match (&before, &after) {
            (Some(b), Some(a)) => accept_length(&parse_spec_counters(b), &parse_spec_counters(a)),
            _ => None,
        };
        let retokenized = outputs
            .iter()
            .map(|o| if o.success { tokenizer.encode(&o.text, false).map(|ids| ids.len()) } else { Ok(0) })
            .collect::<Result<Vec<_>>>()?;
        differing.extend(compare_texts(&mut first_texts, &outputs, concurrency));
        let summary = summarize(concurrency, &outputs, &retokenized, duration_s, accept);
        print_summary(&label, &summary);
        writeln!(csv, "{}", csv_row(&label, &summary))
            .and_then(|()| csv.flush())
            .map_err(|e| Error::Data { path: args.csv.clone(), detail: e.to_string() })?;
        failed += summary.failed;
        sent += summary.requests;
        summaries.push(summary);
    }
    print_table(&label, &summaries);
    match differing.first() {
        None => println!("greedy outputs: every prompt's text is identical at concurrency {:?}", args.concurrency),
        Some(first) => {
            println!("greedy outputs DIFFER across concurrency: {} requests, first: {first}", differing.len())
        }
    }
    println!("wrote {}", args.csv.display());
    if !args.no_plot {
        plot_csv(&args.csv, &args.plot)?;
    }
    if failed > 0 {
        return Err(Error::param("--base-url", &base, format!("{failed} of {sent} requests failed (errors above)")));
    }
    if !differing.is_empty() {
        return Err(Error::param("--concurrency", format!("{:?}", args.concurrency), "greedy outputs differ (above)"));
    }
    Ok(())
}

/// Checks every successful request's text against the first text seen for its prompt (request i uses
/// prompt i mod count; at temperature 0 the text must not depend on the concurrency); returns one line
/// per request whose text differs.
fn compare_texts(first: &mut [Option<String>], outputs: &[RequestOutput], concurrency: usize) -> Vec<String> {
    let mut differing = Vec::new();
    for (i, out) in outputs.iter().enumerate().filter(|(_, o)| o.success) {
        match &mut first[i % first.len()] {
            Some(text) if *text != out.text => {
                differing.push(format!("request {i} (prompt {}) at concurrency {concurrency}", i % first.len()))
            }
            Some(_) => {}
            slot => *slot = Some(out.text.clone()),
        }
    }
    differing
}

/// One prompt: its text and its length in tokens.
#[derive(Debug, Clone)]
struct Prompt {
    /// The text sent.
    text: String,
    /// Its tokens per the local tokenizer.
    tokens: usize,
}

/// The paragraphs of `text`: runs of lines separated by blank (whitespace-only) lines, trimmed.
fn paragraphs(text: &str) -> Vec<String> {
    let (mut out, mut current) = (Vec::new(), Vec::new());
    for line in text.lines().chain(std::iter::once("")) {
        if line.trim().is_empty() {
            if !current.is_empty() {
                out.push(current.join("\n").trim().to_string());
                current.clear();
            }
        } else {
            current.push(line);
        }
    }
    out
}

/// The prompts cut from the paragraphs of `path`: each one's first `tokens` tokens decoded to text,
/// kept when that text encodes to `tokens` tokens again.
fn load_prompts(path: &Path, tokens: usize, tokenizer: &Tokenizer) -> Result<Vec<Prompt>> {
    let text = std::fs::read_to_string(path).map_err(|e| Error::Data { path: path.into(), detail: e.to_string() })?;
    let mut prompts = Vec::new();
    for paragraph in paragraphs(&text) {
        let ids = tokenizer.encode(&paragraph, false)?;
        if ids.len() < tokens {
            continue;
        }
        let cut = tokenizer.decode(&ids[..tokens], false)?;
        if tokenizer.encode(&cut, false)?.len() == tokens {
            prompts.push(Prompt { text: cut, tokens });
        }
    }
    if prompts.is_empty() {
        return Err(Error::Data {
            path: path.into(),
            detail: format!("no paragraph of at least {tokens} tokens (per --tokenizer); lower --prompt-tokens"),
        });
    }
    Ok(prompts)
}

/// The model ids `GET /v1/models` lists; an unreachable server or a bad answer is an error naming
/// `--base-url`.
fn list_models(agent: &ureq::Agent, base: &str) -> Result<Vec<String>> {
    let url = format!("{base}/v1/models");
    let bad = |detail: String| Error::param("--base-url", base, detail);
    let mut response = agent.get(&url).call().map_err(|e| bad(format!("cannot reach the server ({url}): {e}")))?;
    if response.status().as_u16() != 200 {
        return Err(bad(format!("GET {url} answered {}", response.status())));
    }
    let body: Value = response.body_mut().read_json().map_err(|e| bad(format!("GET {url}: {e}")))?;
    let data = body.get("data").and_then(Value::as_array).ok_or_else(|| bad(format!("GET {url}: no `data` list")))?;
    Ok(data.iter().filter_map(|m| m.get("id").and_then(Value::as_str)).map(str::to_owned).collect())
}

/// The text of `GET /metrics`; the error says why it could not be read.
fn scrape_metrics(agent: &ureq::Agent, base: &str) -> std::result::Result<String, String> {
    let url = format!("{base}/metrics");
    let mut response = agent.get(&url).call().map_err(|e| format!("GET {url}: {e}"))?;
    if response.status().as_u16() != 200 {
        return Err(format!("GET {url} answered {}", response.status()));
    }
    response.body_mut().read_to_string().map_err(|e| format!("GET {url}: {e}"))
}

/// What every request of the run shares.
struct Client {
    /// The HTTP client (a connection pool shared by the threads).
    agent: ureq::Agent,
    /// `<base>/v1/completions`.
    url: String,
    /// The `model` field.
    model: String,
    /// The `max_tokens` field.
    max_tokens: usize,
}

/// One request's measurements (SGLang's `RequestFuncOutput`); times in seconds.
#[derive(Debug, Clone, Default)]
struct RequestOutput {
    /// Whether the stream ended with `[DONE]` and carried text.
    success: bool,
    /// Why it failed.
    error: String,
    /// Prompt tokens: the usage's, else the local count.
    prompt_tokens: usize,
    /// Output tokens from the final usage chunk, if the stream had one.
    output_tokens: Option<usize>,
    /// Time to the first non-empty text chunk.
    ttft: f64,
    /// Gaps between consecutive non-empty text chunks.
    itl: Vec<f64>,
    /// Time to `[DONE]`.
    latency: f64,
    /// The generated text.
    text: String,
}

impl Client {
    /// Sends one streamed completion request for `prompt` and measures it; a failure is recorded in the
    /// output, never returned.
    fn send(&self, prompt: &Prompt) -> RequestOutput {
        let body = serde_json::json!({
            "model": self.model,
            "prompt": prompt.text,
            "max_tokens": self.max_tokens,
            "temperature": 0,
            "stream": true,
            "stream_options": {"include_usage": true},
            "ignore_eos": true,
        });
        let start = Instant::now();
        let mut out = RequestOutput { prompt_tokens: prompt.tokens, ..RequestOutput::default() };
        let fail = |mut out: RequestOutput, error: String| {
            out.latency = start.elapsed().as_secs_f64();
            out.error = error;
            out
        };
        let response = match self.agent.post(&self.url).send_json(&body) {
            Ok(response) => response,
            Err(e) => return fail(out, format!("POST {}: {e}", self.url)),
        };
        let status = response.status();
        if status.as_u16() != 200 {
            let text = response.into_body().with_config().limit(2000).read_to_string().unwrap_or_default();
            return fail(out, format!("HTTP {status}: {}", text.trim()));
        }
        let mut last = 0.0;
        let mut seen_text = false;
        for line in BufReader::new(response.into_body().into_reader()).lines() {
            let line = match line {
                Ok(line) => line,
                Err(e) => return fail(out, format!("reading the stream: {e}")),
            };
            match parse_sse_line(&line) {
                SseEvent::Skip => {}
                SseEvent::Done => {
                    out.latency = start.elapsed().as_secs_f64();
                    if !seen_text {
                        return fail(out, "the stream ended without any text".into());
                    }
                    out.success = true;
                    return out;
                }
                SseEvent::Error(e) => return fail(out, e),
                SseEvent::Chunk { text, usage } => {
                    if !text.is_empty() {
                        let now = start.elapsed().as_secs_f64();
                        if seen_text {
                            out.itl.push(now - last);
                        } else {
                            out.ttft = now;
                            seen_text = true;
                        }
                        last = now;
                        out.text.push_str(&text);
                    }
                    if let Some(usage) = usage {
                        out.prompt_tokens = usage.prompt_tokens;
                        out.output_tokens = Some(usage.completion_tokens);
                    }
                }
            }
        }
        fail(out, "the stream ended without `data: [DONE]`".into())
    }
}

/// Runs `num` requests with `concurrency` clients; returns their outputs in request order and the
/// wall time in seconds.
fn run_level(client: &Client, prompts: &[Prompt], concurrency: usize, num: usize) -> Result<(Vec<RequestOutput>, f64)> {
    let style =
        ProgressStyle::with_template("concurrency {prefix}: {bar:40} {pos}/{len} requests, {elapsed} (eta {eta})")
            .map_err(|e| Error::param("progress template", e, "invalid"))?;
    let bar = ProgressBar::new(num as u64).with_style(style).with_prefix(concurrency.to_string());
    let next = AtomicUsize::new(0);
    let reported = Mutex::new(Vec::<String>::new());
    let start = Instant::now();
    let joined = std::thread::scope(|scope| {
        let (next, bar, reported) = (&next, &bar, &reported);
        let mut handles = Vec::new();
        for _ in 0..concurrency.min(num) {
            let worker = move || {
                let mut done = Vec::new();
                loop {
                    let i = next.fetch_add(1, Ordering::Relaxed);
                    if i >= num {
                        return done;
                    }
                    let out = client.send(&prompts[i % prompts.len()]);
                    if !out.success {
                        let mut seen = reported.lock().unwrap_or_else(|poisoned| poisoned.into_inner());
                        if !seen.contains(&out.error) {
                            bar.suspend(|| eprintln!("request {i} failed: {}", out.error));
                            seen.push(out.error.clone());
                        }
                    }
                    bar.inc(1);
                    done.push((i, out));
                }
            };
            match std::thread::Builder::new().name(format!("client-{}", handles.len())).spawn_scoped(scope, worker) {
                Ok(handle) => handles.push(handle),
                Err(e) => {
                    next.store(num, Ordering::Relaxed);
                    return Err(Error::param(
                        "--concurrency",
                        concurrency,
                        format!("cannot start a client thread: {e}"),
                    ));
                }
            }
        }
        handles
            .into_iter()
            .map(|h| h.join().map_err(|_| Error::param("--concurrency", concurrency, "a client thread panicked")))
            .collect::<Result<Vec<_>>>()
    });
    let duration_s = start.elapsed().as_secs_f64();
    bar.finish_and_clear();
    let mut outputs = vec![RequestOutput::default(); num];
    for (i, out) in joined?.into_iter().flatten() {
        outputs[i] = out;
    }
    Ok((outputs, duration_s))
}

/// What one SSE line of a completion stream holds.
#[derive(Debug, Clone, PartialEq)]
enum SseEvent {
    /// No data: a blank line, a comment, or another field (`event:`, `id:`, `retry:`).
    Skip,
    /// `data: [DONE]`.
    Done,
    /// A completion chunk: its first choice's text ("" for none) and its usage, if any.
    Chunk {
        /// The text of the chunk's first choice.
        text: String,
        /// The usage object, present on the final chunk with `include_usage`.
        usage: Option<Usage>,
    },
    /// An error object in the stream, or data that is not a completion chunk.
    Error(String),
}

/// A usage object's token counts.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Usage {
    /// `prompt_tokens`.
    prompt_tokens: usize,
    /// `completion_tokens`.
    completion_tokens: usize,
}

/// Parses one line of a `text/event-stream` completion response.
fn parse_sse_line(line: &str) -> SseEvent {
    let line = line.trim_end_matches('\r');
    let Some(data) = line.strip_prefix("data:") else {
        return SseEvent::Skip;
    };
    let data = data.trim();
    if data.is_empty() {
        return SseEvent::Skip;
    }
    if data == "[DONE]" {
        return SseEvent::Done;
    }
    let json: Value = match serde_json::from_str(data) {
        Ok(json) => json,
        Err(e) => return SseEvent::Error(format!("invalid JSON in the stream ({e}): {data}")),
    };
    if let Some(error) = json.get("error") {
        let message = error.get("message").and_then(Value::as_str).map_or_else(|| error.to_string(), str::to_owned);
        return SseEvent::Error(format!("error in the stream: {message}"));
    }
    let text = match json.get("choices") {
        None | Some(Value::Null) => String::new(),
        Some(Value::Array(choices)) => {
            choices.first().and_then(|c| c.get("text")).and_then(Value::as_str).unwrap_or_default().to_string()
        }
        Some(_) => return SseEvent::Error(format!("`choices` is not a list: {data}")),
    };
    let usage = match json.get("usage") {
        None | Some(Value::Null) => None,
        Some(usage) => {
            let count = |key: &str| usage.get(key).and_then(Value::as_u64).map(|n| n as usize);
            match (count("prompt_tokens"), count("completion_tokens")) {
                (Some(prompt_tokens), Some(completion_tokens)) => Some(Usage { prompt_tokens, completion_tokens }),
                _ => return SseEvent::Error(format!("a usage without token counts: {data}")),
            }
        }
    };
    SseEvent::Chunk { text, usage }
}

/// The sum of the samples of metric `name` (any labels) in a Prometheus text exposition; 0 if absent.
fn metric_sum(text: &str, name: &str) -> f64 {
    text.lines()
        .filter_map(parse_sample)
        .filter(|(n, _, _)| *n == name)
        .map(|(_, _, value)| value)
        .filter(|v| v.is_finite())
        .sum()
}

/// One sample line of a Prometheus text exposition: its name, its raw label block (without braces,
/// "" for none) and its value; `None` for comments, blank lines and lines that do not parse.
fn parse_sample(line: &str) -> Option<(&str, &str, f64)> {
    let line = line.trim();
    if line.is_empty() || line.starts_with('#') {
        return None;
    }
    let name_end = line.find(|c: char| c == '{' || c.is_whitespace())?;
    let name = &line[..name_end];
    let rest = &line[name_end..];
    let (labels, rest) = match rest.strip_prefix('{') {
        Some(inner) => {
            let close = label_block_end(inner)?;
            (&inner[..close], &inner[close + 1..])
        }
        None => ("", rest),
    };
    let value = rest.split_whitespace().next()?.parse().ok()?;
    Some((name, labels, value))
}

/// The index of the `}` that closes a label block, skipping braces inside quoted values.
fn label_block_end(inner: &str) -> Option<usize> {
    let (mut quoted, mut escaped) = (false, false);
    for (i, c) in inner.char_indices() {
        match c {
            _ if escaped => escaped = false,
            '\\' if quoted => escaped = true,
            '"' => quoted = !quoted,
            '}' if !quoted => return Some(i),
            _ => {}
        }
    }
    None
}

/// The value of label `key` in a raw label block (`a="x",b="y"`), unescaped.
fn label_value(labels: &str, key: &str) -> Option<String> {
    let mut rest = labels.trim_start_matches([',', ' ']);
    while !rest.is_empty() {
        let eq = rest.find('=')?;
        let name = rest[..eq].trim();
        let body = rest[eq + 1..].trim_start().strip_prefix('"')?;
        let (mut value, mut escaped, mut end) = (String::new(), false, None);
        for (i, c) in body.char_indices() {
            if escaped {
                value.push(if c == 'n' { '\n' } else { c });
                escaped = false;
            } else if c == '\\' {
                escaped = true;
            } else if c == '"' {
                end = Some(i + 1);
                break;
            } else {
                value.push(c);
            }
        }
        if name == key {
            return end.map(|_| value);
        }
        rest = body[end?..].trim_start_matches([',', ' ']);
    }
    None
}

/// The server's mode: the `mode` label of a `kdtree_mode_info` sample whose value is not 0.
fn parse_mode_info(text: &str) -> Option<String> {
    text.lines()
        .filter_map(parse_sample)
        .filter(|(name, _, value)| *name == METRIC_MODE && *value != 0.0)
        .find_map(|(_, labels, _)| label_value(labels, "mode"))
}

/// The speculative-decoding counters of one `/metrics` scrape.
#[derive(Debug, Clone, Copy, PartialEq, Default)]
struct SpecCounters {
    /// Speculative steps (drafts) so far.
    drafts: f64,
    /// Draft tokens proposed so far.
    draft_tokens: f64,
    /// Draft tokens accepted so far.
    accepted: f64,
}

/// The speculative counters in a Prometheus text (0 for those absent).
fn parse_spec_counters(text: &str) -> SpecCounters {
    SpecCounters {
        drafts: metric_sum(text, METRIC_DRAFTS),
        draft_tokens: metric_sum(text, METRIC_DRAFT_TOKENS),
        accepted: metric_sum(text, METRIC_ACCEPTED),
    }
}

/// Mean tokens per speculative step between two scrapes, vLLM's mean acceptance length:
/// 1 + Δaccepted / Δdrafts; `None` when no draft was made in between.
fn accept_length(before: &SpecCounters, after: &SpecCounters) -> Option<f64> {
    let drafts = after.drafts - before.drafts;
    (drafts > 0.0).then(|| 1.0 + (after.accepted - before.accepted) / drafts)
}

/// The `p`-th percentile (0–100) of ascending `sorted` values, with numpy's default linear
/// interpolation; 0 for no values.
fn percentile(sorted: &[f64], p: f64) -> f64 {
    let Some(&first) = sorted.first() else {
        return 0.0;
    };
    let rank = p.clamp(0.0, 100.0) / 100.0 * (sorted.len() - 1) as f64;
    let (lo, hi) = (rank.floor() as usize, rank.ceil() as usize);
    match (sorted.get(lo), sorted.get(hi)) {
        (Some(&a), Some(&b)) => a + (b - a) * (rank - lo as f64),
        _ => first,
    }
}

/// Mean, median and tail percentiles of a set of times, in milliseconds; all 0 for an empty set.
#[derive(Debug, Clone, Copy, PartialEq, Default)]
struct Stats {
    /// Mean.
    mean: f64,
    /// Median.
    median: f64,
    /// 95th percentile.
    p95: f64,
    /// 99th percentile.
    p99: f64,
    /// Maximum.
    max: f64,
}

impl Stats {
    /// The statistics of `seconds`, converted to milliseconds.
    fn of_seconds(seconds: &[f64]) -> Self {
        let mut ms: Vec<f64> = seconds.iter().map(|s| s * 1000.0).collect();
        ms.sort_by(f64::total_cmp);
        let mean = if ms.is_empty() { 0.0 } else { ms.iter().sum::<f64>() / ms.len() as f64 };
        Stats {
            mean,
            median: percentile(&ms, 50.0),
            p95: percentile(&ms, 95.0),
            p99: percentile(&ms, 99.0),
            max: ms.last().copied().unwrap_or(0.0),
        }
    }
}

/// One level's metrics (SGLang's `BenchmarkMetrics`).
#[derive(Debug, Clone, PartialEq, Default)]
struct Summary {
    /// Clients sending at once.
    concurrency: usize,
    /// Requests sent.
    requests: usize,
    /// Requests that succeeded.
    completed: usize,
    /// Requests that failed.
    failed: usize,
    /// Wall time of the level, seconds.
    duration_s: f64,
    /// Prompt tokens of the successful requests.
    total_input: usize,
    /// Output tokens of the successful requests (usage counts).
    total_output: usize,
    /// Their texts' tokens, retokenized locally.
    total_output_retokenized: usize,
    /// Successful requests per second.
    request_throughput: f64,
    /// Input tokens per second.
    input_throughput: f64,
    /// Output tokens per second.
    output_throughput: f64,
    /// Input and output tokens per second.
    total_throughput: f64,
    /// Sum of E2E latencies over the wall time: the mean number of requests in flight.
    measured_concurrency: f64,
    /// End-to-end latency.
    e2e: Stats,
    /// Time to first token.
    ttft: Stats,
    /// Time per output token after the first.
    tpot: Stats,
    /// Inter-chunk latency.
    itl: Stats,
    /// Mean tokens per speculative step, if drafts were made.
    accept_length: Option<f64>,
}

/// The metrics of a level's `outputs` (in request order, with `retokenized[i]` the local token count
/// of output i's text) that took `duration_s` seconds, as SGLang's `calculate_metrics` computes them.
fn summarize(
    concurrency: usize,
    outputs: &[RequestOutput],
    retokenized: &[usize],
    duration_s: f64,
    accept_length: Option<f64>,
) -> Summary {
    let (mut ttfts, mut tpots, mut itls, mut e2es) = (Vec::new(), Vec::new(), Vec::new(), Vec::new());
    let (mut completed, mut total_input, mut total_output, mut total_retok) = (0, 0, 0, 0);
    for (i, out) in outputs.iter().enumerate().filter(|(_, o)| o.success) {
        let retok = retokenized.get(i).copied().unwrap_or(0);
        let output_len = out.output_tokens.unwrap_or(retok);
        completed += 1;
        total_input += out.prompt_tokens;
        total_output += output_len;
        total_retok += retok;
        if output_len > 1 {
            tpots.push((out.latency - out.ttft) / (output_len - 1) as f64);
        }
        itls.extend_from_slice(&out.itl);
        ttfts.push(out.ttft);
        e2es.push(out.latency);
    }
    let per_s = |n: f64| if duration_s > 0.0 { n / duration_s } else { 0.0 };
    Summary {
        concurrency,
        requests: outputs.len(),
        completed,
        failed: outputs.len() - completed,
        duration_s,
        total_input,
        total_output,
        total_output_retokenized: total_retok,
        request_throughput: per_s(completed as f64),
        input_throughput: per_s(total_input as f64),
        output_throughput: per_s(total_output as f64),
        total_throughput: per_s((total_input + total_output) as f64),
        measured_concurrency: per_s(e2es.iter().sum()),
        e2e: Stats::of_seconds(&e2es),
        ttft: Stats::of_seconds(&ttfts),
        tpot: Stats::of_seconds(&tpots),
        itl: Stats::of_seconds(&itls),
        accept_length,
    }
}

/// An accept length as printed: two decimals, or "n/a".
fn fmt_accept(accept: Option<f64>) -> String {
    accept.map_or_else(|| "n/a".into(), |a| format!("{a:.2}"))
}

/// Prints a level's metrics in the layout of SGLang's `bench_serving`.
fn print_summary(label: &str, s: &Summary) {
    let row = |name: &str, value: &dyn Display| println!("{name:<40} {value:<10}");
    let num = |name: &str, value: f64| println!("{name:<40} {value:<10.2}");
    let rule = |title: &str| println!("{title:-^50}");
    println!("{:=^50}", " Serving Benchmark Result ");
    row("Label:", &label);
    row("Traffic request rate:", &"inf");
    row("Max request concurrency:", &s.concurrency);
    row("Successful requests:", &s.completed);
    row("Failed requests:", &s.failed);
    num("Benchmark duration (s):", s.duration_s);
    row("Total input tokens:", &s.total_input);
    row("Total generated tokens:", &s.total_output);
    row("Total generated tokens (retokenized):", &s.total_output_retokenized);
    num("Request throughput (req/s):", s.request_throughput);
    num("Input token throughput (tok/s):", s.input_throughput);
    num("Output token throughput (tok/s):", s.output_throughput);
    num("Total token throughput (tok/s):", s.total_throughput);
    num("Concurrency:", s.measured_concurrency);
    row("Accept length:", &fmt_accept(s.accept_length));
    rule("End-to-End Latency");
    num("Mean E2E Latency (ms):", s.e2e.mean);
    num("Median E2E Latency (ms):", s.e2e.median);
    num("P99 E2E Latency (ms):", s.e2e.p99);
    rule("Time to First Token");
    num("Mean TTFT (ms):", s.ttft.mean);
    num("Median TTFT (ms):", s.ttft.median);
    num("P99 TTFT (ms):", s.ttft.p99);
    rule("Time per Output Token (excl. 1st token)");
    num("Mean TPOT (ms):", s.tpot.mean);
    num("Median TPOT (ms):", s.tpot.median);
    num("P99 TPOT (ms):", s.tpot.p99);
    rule("Inter-Token Latency (per chunk)");
    num("Mean ITL (ms):", s.itl.mean);
    num("Median ITL (ms):", s.itl.median);
    num("P95 ITL (ms):", s.itl.p95);
    num("P99 ITL (ms):", s.itl.p99);
    num("Max ITL (ms):", s.itl.max);
    println!("{}", "=".repeat(50));
}

/// Prints the sweep's table, one row per level.
fn print_table(label: &str, summaries: &[Summary]) {
    println!();
    println!(
        "{:<12} {:>5} {:>5} {:>5} {:>8} {:>7} {:>9} {:>9} {:>9} {:>8} {:>8} {:>8} {:>8} {:>9} {:>6}",
        "label",
        "conc",
        "ok",
        "fail",
        "dur s",
        "req/s",
        "out tok/s",
        "TTFT mean",
        "TTFT p99",
        "TPOT mn",
        "TPOT p99",
        "ITL mn",
        "ITL p99",
        "E2E mean",
        "accept"
    );
    for s in summaries {
        println!(
            "{:<12} {:>5} {:>5} {:>5} {:>8.2} {:>7.2} {:>9.1} {:>9.1} {:>9.1} {:>8.2} {:>8.2} {:>8.2} {:>8.2} {:>9.1} {:>6}",
            label,
            s.concurrency,
            s.completed,
            s.failed,
            s.duration_s,
            s.request_throughput,
            s.output_throughput,
            s.ttft.mean,
            s.ttft.p99,
            s.tpot.mean,
            s.tpot.p99,
            s.itl.mean,
            s.itl.p99,
            s.e2e.mean,
            fmt_accept(s.accept_length)
        );
    }
    println!("(times in ms; ITL is per streamed chunk, TPOT per token)");
}

/// A CSV field, quoted when it holds a comma, a quote or a line break.
fn csv_field(field: &str) -> String {
    if field.contains([',', '"', '\n', '\r']) {
        format!("\"{}\"", field.replace('"', "\"\""))
    } else {
        field.to_string()
    }
}

/// The fields of one CSV line (quoted fields with doubled quotes allowed).
fn parse_csv_line(line: &str) -> Vec<String> {
    let (mut fields, mut field, mut quoted) = (Vec::new(), String::new(), false);
    let mut chars = line.chars().peekable();
    while let Some(c) = chars.next() {
        match c {
            '"' if quoted && chars.peek() == Some(&'"') => {
                field.push('"');
                chars.next();
            }
            '"' => quoted = !quoted,
            ',' if !quoted => fields.push(std::mem::take(&mut field)),
            _ => field.push(c),
        }
    }
    fields.push(field);
    fields
}

/// A level's CSV row, in the columns of [`CSV_HEADER`].
fn csv_row(label: &str, s: &Summary) -> String {
    let accept = s.accept_length.map_or_else(|| "n/a".into(), |a| format!("{a:.4}"));
    format!(
        "{},{},{},{},{:.4},{:.4},{:.4},{:.4},{:.4},{:.4},{:.4},{:.4},{:.4},{:.4},{:.4},{:.4},{:.4},{}",
        csv_field(label),
        s.concurrency,
        s.requests,
        s.failed,
        s.duration_s,
        s.request_throughput,
        s.output_throughput,
        s.ttft.mean,
        s.ttft.median,
        s.ttft.p99,
        s.tpot.mean,
        s.tpot.median,
        s.tpot.p99,
        s.itl.mean,
        s.itl.median,
        s.itl.p99,
        s.e2e.mean,
        accept
    )
}

/// Opens the CSV for the run's rows: a new file with the header, or with `append` an existing one
/// (whose header must be [`CSV_HEADER`]) at its end.
fn open_csv(path: &Path, append: bool) -> Result<std::fs::File> {
    let err = |e: std::io::Error| Error::Data { path: path.into(), detail: e.to_string() };
    let existing = if append && path.exists() { std::fs::read_to_string(path).map_err(err)? } else { String::new() };
    if let Some(header) = existing.lines().next() {
        if header.trim_end() != CSV_HEADER {
            return Err(Error::param(
                "--csv",
                path.display(),
                "--append needs a CSV written by this program, and this one's header differs",
            ));
        }
    }
    let mut file =
        OpenOptions::new().create(true).write(true).append(append).truncate(!append).open(path).map_err(err)?;
    if existing.trim().is_empty() {
        writeln!(file, "{CSV_HEADER}").map_err(err)?;
    } else if !existing.ends_with('\n') {
        writeln!(file).map_err(err)?;
    }
    Ok(file)
}

/// The points the plot draws from one CSV row.
#[derive(Debug, Clone, PartialEq)]
struct PlotRow {
    /// The run's label.
    label: String,
    /// Concurrency level.
    concurrency: f64,
    /// Output tokens per second.
    output_throughput: f64,
    /// Mean TPOT, ms.
    tpot_mean_ms: f64,
}

/// The plot rows of a CSV text written by this program; for a repeated (label, concurrency) the last
/// row wins. Sorted by label in order of appearance, then concurrency.
fn parse_plot_rows(text: &str) -> std::result::Result<Vec<PlotRow>, String> {
    let mut lines = text.lines().enumerate().filter(|(_, l)| !l.trim().is_empty());
    let header = parse_csv_line(lines.next().ok_or("the CSV is empty")?.1);
    let column = |name: &str| header.iter().position(|h| h.trim() == name).ok_or(format!("no `{name}` column"));
    let (label, conc, out, tpot) =
        (column("label")?, column("concurrency")?, column("output_throughput")?, column("tpot_mean_ms")?);
    let mut rows: Vec<PlotRow> = Vec::new();
    let mut labels: Vec<String> = Vec::new();
    for (n, line) in lines {
        let fields = parse_csv_line(line);
        let number = |i: usize, name: &str| -> std::result::Result<f64, String> {
            let field = fields.get(i).map(|f| f.trim()).unwrap_or_default();
            field.parse().map_err(|_| format!("line {}: `{name}` is `{field}`, not a number", n + 1))
        };
        let row = PlotRow {
            label: fields.get(label).cloned().unwrap_or_default(),
            concurrency: number(conc, "concurrency")?,
            output_throughput: number(out, "output_throughput")?,
            tpot_mean_ms: number(tpot, "tpot_mean_ms")?,
        };
        if !labels.contains(&row.label) {
            labels.push(row.label.clone());
        }
        rows.retain(|r| !(r.label == row.label && r.concurrency == row.concurrency));
        rows.push(row);
    }
    rows.sort_by(|a, b| {
        let rank = |r: &PlotRow| labels.iter().position(|l| *l == r.label);
        rank(a).cmp(&rank(b)).then(a.concurrency.total_cmp(&b.concurrency))
    });
    Ok(rows)
}

/// Plots the CSV at `csv` into the SVG at `svg`.
fn plot_csv(csv: &Path, svg: &Path) -> Result<()> {
    let text = std::fs::read_to_string(csv).map_err(|e| Error::Data { path: csv.into(), detail: e.to_string() })?;
    let rows = parse_plot_rows(&text).map_err(|detail| Error::Data { path: csv.into(), detail })?;
    if rows.is_empty() {
        return Err(Error::Data { path: csv.into(), detail: "no rows to plot".into() });
    }
    draw_plot(&rows, svg).map_err(|detail| Error::Data { path: svg.into(), detail: format!("plot: {detail}") })?;
    println!("plotted {} rows of {} into {}", rows.len(), csv.display(), svg.display());
    Ok(())
}

/// The value a panel draws of a row.
type PlotValue = fn(&PlotRow) -> f64;

/// Draws the two panels (output tok/s and mean TPOT against concurrency, a line per label).
fn draw_plot(rows: &[PlotRow], svg: &Path) -> std::result::Result<(), String> {
    use plotters::prelude::*;
    let root = SVGBackend::new(svg, (1280, 520)).into_drawing_area();
    root.fill(&WHITE).map_err(|e| e.to_string())?;
    let (left, right) = root.split_horizontally(640);
    let panels: [(&_, &str, &str, PlotValue); 2] = [
        (&left, "Output throughput", "output tok/s", |r| r.output_throughput),
        (&right, "Mean TPOT", "mean TPOT (ms)", |r| r.tpot_mean_ms),
    ];
    let mut labels: Vec<&str> = Vec::new();
    for r in rows {
        if !labels.contains(&r.label.as_str()) {
            labels.push(&r.label);
        }
    }
    let x_min = rows.iter().map(|r| r.concurrency).fold(f64::INFINITY, f64::min).max(1e-3);
    let x_max = rows.iter().map(|r| r.concurrency).fold(0.0, f64::max).max(x_min);
    for (area, title, y_desc, value) in panels {
        let y_max = rows.iter().map(value).filter(|v| v.is_finite()).fold(0.0, f64::max);
        let y_max = if y_max > 0.0 { y_max * 1.1 } else { 1.0 };
        let mut chart = ChartBuilder::on(area)
            .caption(title, ("sans-serif", 22))
            .margin(16)
            .x_label_area_size(44)
            .y_label_area_size(64)
            .build_cartesian_2d((x_min / 1.25..x_max * 1.25).log_scale().base(2.0), 0.0..y_max)
            .map_err(|e| e.to_string())?;
        chart
            .configure_mesh()
            .x_desc("concurrency")
            .y_desc(y_desc)
            .light_line_style(TRANSPARENT)
            .x_label_formatter(&|x| format!("{x:.0}"))
            .y_label_formatter(&|y| if y_max >= 100.0 { format!("{y:.0}") } else { format!("{y:.1}") })
            .draw()
            .map_err(|e| e.to_string())?;
        for (i, label) in labels.iter().enumerate() {
            let color = Palette99::pick(i).to_rgba();
            let points: Vec<(f64, f64)> =
                rows.iter().filter(|r| r.label == *label).map(|r| (r.concurrency, value(r))).collect();
            chart
                .draw_series(LineSeries::new(points.clone(), color.stroke_width(2)))
                .map_err(|e| e.to_string())?
                .label(*label)
                .legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 20, y)], color.stroke_width(2)));
            chart.draw_series(points.iter().map(|&p| Circle::new(p, 4, color.filled()))).map_err(|e| e.to_string())?;
        }
        chart
            .configure_series_labels()
            .position(SeriesLabelPosition::UpperLeft)
            .background_style(WHITE.mix(0.85))
            .border_style(BLACK)
            .draw()
            .map_err(|e| e.to_string())?;
    }
    root.present().map_err(|e| e.to_string())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn percentile_matches_numpy_linear_interpolation() {
        let v = [1.0, 2.0, 3.0, 4.0];
        assert_eq!(percentile(&v, 50.0), 2.5); // np.percentile([1,2,3,4], 50)
        assert!((percentile(&v, 99.0) - 3.97).abs() < 1e-12); // rank 2.97: 3 + 0.97 * (4 - 3)
        assert!((percentile(&v, 95.0) - 3.85).abs() < 1e-12); // rank 2.85
        assert_eq!(percentile(&v, 0.0), 1.0);
        assert_eq!(percentile(&v, 100.0), 4.0);
        assert_eq!(percentile(&[10.0, 20.0, 30.0], 50.0), 20.0);
        assert_eq!(percentile(&[7.0], 99.0), 7.0);
        assert_eq!(percentile(&[], 99.0), 0.0);
    }

    #[test]
    fn stats_are_in_milliseconds() {
        let s = Stats::of_seconds(&[0.004, 0.001, 0.003, 0.002]);
        assert!((s.mean - 2.5).abs() < 1e-9);
        assert!((s.median - 2.5).abs() < 1e-9);
        assert!((s.p99 - 3.97).abs() < 1e-9);
        assert!((s.max - 4.0).abs() < 1e-9);
        assert_eq!(Stats::of_seconds(&[]), Stats::default());
    }

    #[test]
    fn sse_lines() {
        let chunk = r#"data: {"id":"cmpl-1","object":"text_completion","created":1,"model":"tiny-k2","choices":[{"index":0,"text":" the","logprobs":null,"finish_reason":null}],"usage":null}"#;
        assert_eq!(parse_sse_line(chunk), SseEvent::Chunk { text: " the".into(), usage: None });
        let usage = r#"data: {"id":"cmpl-1","object":"text_completion","created":1,"model":"tiny-k2","choices":[],"usage":{"prompt_tokens":48,"completion_tokens":64,"total_tokens":112}}"#;
        assert_eq!(
            parse_sse_line(usage),
            SseEvent::Chunk { text: String::new(), usage: Some(Usage { prompt_tokens: 48, completion_tokens: 64 }) }
        );
        assert_eq!(parse_sse_line("data: [DONE]"), SseEvent::Done);
        assert_eq!(parse_sse_line("data:[DONE]\r"), SseEvent::Done);
        assert_eq!(
            parse_sse_line(r#"data:{"choices":[{"text":"a"}]}"#),
            SseEvent::Chunk { text: "a".into(), usage: None }
        );
        assert_eq!(parse_sse_line(""), SseEvent::Skip);
        assert_eq!(parse_sse_line(": keep-alive"), SseEvent::Skip);
        assert_eq!(parse_sse_line("event: message"), SseEvent::Skip);
        assert_eq!(
            parse_sse_line(r#"data: {"error":{"message":"prompt too long","type":"invalid_request_error"}}"#),
            SseEvent::Error("error in the stream: prompt too long".into())
        );
        assert!(matches!(parse_sse_line("data: {not json"), SseEvent::Error(_)));
        assert!(matches!(parse_sse_line(r#"data: {"choices":3}"#), SseEvent::Error(_)));
        assert!(matches!(parse_sse_line(r#"data: {"choices":[],"usage":{}}"#), SseEvent::Error(_)));
    }

    /// A `/metrics` text shaped like the server's (and vLLM's): counters with labels, `_created`
    /// series beside them, comments.
    const METRICS: &str = "\
# HELP kdtree_spec_decode_num_drafts_total Speculative steps.
# TYPE kdtree_spec_decode_num_drafts_total counter
kdtree_spec_decode_num_drafts_total{model_name=\"tiny-k2\",engine=\"0\"} 20
kdtree_spec_decode_num_drafts_total{model_name=\"tiny-k2\",engine=\"1\"} 5
kdtree_spec_decode_num_drafts_created{model_name=\"tiny-k2\"} 1.7e9
kdtree_spec_decode_num_draft_tokens_total 375
kdtree_spec_decode_num_accepted_tokens_per_pos_total{position=\"1\"} 20
kdtree_spec_decode_num_accepted_tokens_total{model_name=\"tiny-k2\"} 50.0 1733140000000
# TYPE kdtree_mode_info gauge
kdtree_mode_info{mode=\"chain\"} 0
kdtree_mode_info{note=\"a,b}\",mode=\"ddtree\"} 1
";

    #[test]
    fn metric_parsing() {
        assert_eq!(metric_sum(METRICS, METRIC_DRAFTS), 25.0);
        assert_eq!(metric_sum(METRICS, METRIC_DRAFT_TOKENS), 375.0);
        assert_eq!(metric_sum(METRICS, METRIC_ACCEPTED), 50.0);
        assert_eq!(metric_sum(METRICS, "absent_total"), 0.0);
        assert_eq!(parse_mode_info(METRICS).as_deref(), Some("ddtree"));
        assert_eq!(parse_mode_info("kdtree_mode_info 1\n"), None);
        assert_eq!(parse_mode_info(""), None);
        assert_eq!(parse_sample("a_total{x=\"1\"} 2.5"), Some(("a_total", "x=\"1\"", 2.5)), "name, raw labels, value");
        assert_eq!(parse_sample("# HELP a_total x"), None);
        assert_eq!(parse_sample("broken{x=\"1\" 2"), None);
        assert_eq!(label_value(r#"a="x\"y",mode="ar""#, "mode").as_deref(), Some("ar"));
        assert_eq!(label_value(r#"a="x\"y",mode="ar""#, "a").as_deref(), Some("x\"y"));
    }

    #[test]
    fn accept_length_from_two_scrapes() {
        let before = parse_spec_counters(METRICS);
        assert_eq!(before, SpecCounters { drafts: 25.0, draft_tokens: 375.0, accepted: 50.0 });
        let after = SpecCounters { drafts: 45.0, draft_tokens: 675.0, accepted: 90.0 };
        // 1 + (90 - 50) / (45 - 25) = 3
        assert_eq!(accept_length(&before, &after), Some(3.0));
        assert_eq!(accept_length(&before, &before), None, "no drafts in between (e.g. ar mode)");
        assert_eq!(accept_length(&SpecCounters::default(), &SpecCounters::default()), None);
    }

    #[test]
    fn summary_follows_sglang() {
        let ok = |ttft: f64, latency: f64, itl: Vec<f64>| RequestOutput {
            success: true,
            prompt_tokens: 48,
            output_tokens: Some(5),
            ttft,
            itl,
            latency,
            ..RequestOutput::default()
        };
        let outputs = vec![
            ok(0.1, 0.5, vec![0.2, 0.2]),
            ok(0.3, 1.1, vec![0.4, 0.4]),
            RequestOutput { error: "HTTP 500".into(), latency: 9.0, ..RequestOutput::default() },
        ];
        let s = summarize(2, &outputs, &[5, 4, 0], 2.0, Some(2.5));
        assert_eq!((s.requests, s.completed, s.failed), (3, 2, 1));
        assert_eq!((s.total_input, s.total_output, s.total_output_retokenized), (96, 10, 9));
        assert!((s.request_throughput - 1.0).abs() < 1e-12);
        assert!((s.output_throughput - 5.0).abs() < 1e-12);
        assert!((s.total_throughput - 53.0).abs() < 1e-12);
        assert!((s.measured_concurrency - 0.8).abs() < 1e-12); // (0.5 + 1.1) / 2
                                                               // TPOT: (0.5 - 0.1) / 4 = 100 ms and (1.1 - 0.3) / 4 = 200 ms.
        assert!((s.tpot.mean - 150.0).abs() < 1e-9);
        assert!((s.ttft.mean - 200.0).abs() < 1e-9);
        assert!((s.itl.median - 300.0).abs() < 1e-9); // [200, 200, 400, 400]
        assert!((s.e2e.mean - 800.0).abs() < 1e-9);
        let no_usage = RequestOutput { output_tokens: None, ..ok(0.1, 0.5, vec![]) };
        assert_eq!(summarize(1, &[no_usage], &[3], 1.0, None).total_output, 3, "retokenized count without usage");
    }

    #[test]
    fn csv_round_trip() {
        let s = Summary {
            concurrency: 8,
            requests: 32,
            failed: 1,
            duration_s: 2.0,
            output_throughput: 1000.0,
            tpot: Stats { mean: 7.5, ..Stats::default() },
            accept_length: None,
            ..Summary::default()
        };
        let row = csv_row("dd,tree", &s);
        assert!(row.starts_with("\"dd,tree\",8,32,1,2.0000,"));
        assert!(row.ends_with(",n/a"));
        assert_eq!(parse_csv_line(&row).len(), CSV_HEADER.split(',').count());
        assert_eq!(parse_csv_line(r#"a,"b ""c"", d",e"#), vec!["a", "b \"c\", d", "e"]);
        let text = format!(
            "{CSV_HEADER}\n{row}\n{}\n{}\n",
            csv_row("ar", &s),
            csv_row("ar", &Summary { concurrency: 1, ..s.clone() })
        );
        let rows = parse_plot_rows(&text).unwrap_or_default();
        let got: Vec<(&str, f64)> = rows.iter().map(|r| (r.label.as_str(), r.concurrency)).collect();
        assert_eq!(got, vec![("dd,tree", 8.0), ("ar", 1.0), ("ar", 8.0)]);
        assert_eq!(rows[0].output_throughput, 1000.0);
        assert_eq!(rows[0].tpot_mean_ms, 7.5);
        let replaced = format!("{text}{}\n", csv_row("ar", &Summary { output_throughput: 5.0, ..s.clone() }));
        let rows = parse_plot_rows(&replaced).unwrap_or_default();
        assert_eq!(rows.len(), 3, "a repeated (label, concurrency) keeps the last row");
        assert_eq!(rows[2].output_throughput, 5.0);
        assert!(parse_plot_rows("label,concurrency\n").is_err());
    }

    #[test]
    fn prompts_from_the_shipped_text_have_the_asked_length() -> Result<()> {
        let tokenizer = Tokenizer::from_dir("fixtures/models/tiny-k2")?;
        let prompts = load_prompts(Path::new("fixtures/models/heldout.txt"), 48, &tokenizer)?;
        assert!(prompts.len() >= 64, "only {} prompts", prompts.len());
        for p in prompts.iter().take(64) {
            assert_eq!(p.tokens, 48);
            assert_eq!(tokenizer.encode(&p.text, false)?.len(), 48, "{:?}", p.text);
        }
        assert!(load_prompts(Path::new("fixtures/models/heldout.txt"), 1_000_000, &tokenizer).is_err());
        Ok(())
    }

    #[test]
    fn paragraphs_split_on_blank_lines() {
        assert_eq!(paragraphs("a b\nc\n\n \n\nd\r\n\r\ne\n"), vec!["a b\nc", "d", "e"]);
        assert!(paragraphs("\n\n").is_empty());
    }
}
