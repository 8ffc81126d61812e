//! An OpenAI-compatible HTTP server over the speculative engine (`examples/serve.rs` runs it).
//!
//! One thread owns the engine and the device ([`spawn`]); HTTP handlers check a request
//! ([`api::parse`]), queue it, and turn the tokens the engine loop sends back into OpenAI's responses:
//! whole, or streamed as server-sent events. Stop strings are found in the decoded text here; a request
//! that hits one, or whose client goes away, is cancelled at the next step and its KV pages freed.
//!
//! Endpoints: `POST /v1/completions`, `POST /v1/chat/completions`, `GET /v1/models`, `GET /health`,
//! `GET /metrics` (Prometheus text, [`Metrics`]).

pub mod api;
mod metrics;
mod text;
mod worker;

use std::convert::Infallible;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{SystemTime, UNIX_EPOCH};

use axum::body::Bytes;
use axum::extract::State;
use axum::http::StatusCode;
use axum::response::sse::{Event as SseEvent, Sse};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use serde_json::{json, Value};
use tokio::sync::mpsc;
use tokio_stream::wrappers::ReceiverStream;

use crate::model::Tokenizer;
use crate::spec::FinishReason;

pub use api::{ApiError, Endpoint, Generation};
pub use metrics::Metrics;
pub use worker::{spawn, EngineHandle, EngineInfo, LoopStarter};

use text::TextAssembler;
use worker::{Event, Job, Rejected};

/// What every handler shares.
pub struct AppState {
    /// The name `/v1/models` lists and requests must ask for.
    pub model_name: String,
    /// The model's tokenizer.
    pub tokenizer: Arc<Tokenizer>,
    /// The engine loop.
    pub engine: EngineHandle,
    requests: AtomicU64,
}

impl AppState {
    /// The state of a server for `model_name`.
    pub fn new(model_name: impl Into<String>, tokenizer: Arc<Tokenizer>, engine: EngineHandle) -> Arc<Self> {
        Arc::new(AppState { model_name: model_name.into(), tokenizer, engine, requests: AtomicU64::new(0) })
    }
}

/// The server's routes.
pub fn router(state: Arc<AppState>) -> Router {
    Router::new()
        .route("/v1/completions", post(completions))
        .route("/v1/chat/completions", post(chat_completions))
        .route("/v1/models", get(models))
        .route("/health", get(health))
        .route("/metrics", get(metrics))
        .fallback(not_found)
        .with_state(state)
}

/// Serves `router(state)` on `listener` until `shutdown` resolves.
pub async fn serve(
    listener: tokio::net::TcpListener,
    state: Arc<AppState>,
    shutdown: impl std::future::Future<Output = ()> + Send + 'static,
) -> std::io::Result<()> {
    axum::serve(listener, router(state)).with_graceful_shutdown(shutdown).await
}

async fn completions(State(state): State<Arc<AppState>>, body: Bytes) -> Response {
    generate(state, Endpoint::Completions, &body).await
}

async fn chat_completions(State(state): State<Arc<AppState>>, body: Bytes) -> Response {
    generate(state, Endpoint::Chat, &body).await
}

async fn models(State(state): State<Arc<AppState>>) -> Json<Value> {
    Json(json!({"object": "list", "data": [{
        "id": state.model_name, "object": "model", "created": unix_time(), "owned_by": "kdtree-engine",
        "max_model_len": state.engine.info().max_seq_len,
    }]}))
}

async fn health() -> &'static str {
    "ok"
}

async fn metrics(State(state): State<Arc<AppState>>) -> Response {
    ([("content-type", "text/plain; version=0.0.4")], state.engine.metrics().render()).into_response()
}

async fn not_found() -> ApiError {
    ApiError { status: StatusCode::NOT_FOUND, message: "no such route".into(), param: None, kind: "not_found" }
}

fn unix_time() -> u64 {
    SystemTime::now().duration_since(UNIX_EPOCH).map_or(0, |d| d.as_secs())
}

/// Checks, queues and answers one generation request.
async fn generate(state: Arc<AppState>, endpoint: Endpoint, body: &[u8]) -> Response {
    let n = state.requests.fetch_add(1, Ordering::Relaxed);
    let metrics = state.engine.metrics();
    let limits = api::Limits {
        model: &state.model_name,
        tokenizer: &state.tokenizer,
        info: state.engine.info(),
        default_seed: n ^ unix_time().rotate_left(32),
    };
    let generation = match api::parse(endpoint, body, &limits) {
        Ok(g) => g,
        Err(e) => {
            metrics.count_request(e.status.as_str());
            return e.into_response();
        }
    };
    let (events, rx) = mpsc::unbounded_channel();
    let job = Job { prompt: generation.prompt.clone(), params: generation.params.clone(), events };
    if let Err(why) = state.engine.submit(job) {
        let e = rejected(why);
        metrics.count_request(e.status.as_str());
        return e.into_response();
    }
    let reply = Reply::new(&state, generation, format!("cmpl-{n}"));
    if reply.generation.stream {
        stream(reply, rx)
    } else {
        whole(reply, rx).await
    }
}

fn rejected(why: Rejected) -> ApiError {
    match why {
        Rejected::QueueFull(max) => {
            ApiError::unavailable(format!("The server is busy: its queue holds {max} requests. Retry later."))
        }
        Rejected::TooLarge { needed, total } => ApiError::unavailable(format!(
            "The KV cache cannot hold this request: it needs {needed} pages of the {total} the server has."
        )),
        Rejected::Stopped => ApiError::unavailable("The engine has stopped."),
    }
}

/// A response being built from the engine's events.
struct Reply {
    state: Arc<AppState>,
    generation: Generation,
    id: String,
    created: u64,
    text: TextAssembler,
    completion_tokens: usize,
}

/// One piece of output: new text, its tokens' log-probabilities, and the end when it came.
struct Piece {
    text: String,
    logprobs: Vec<crate::spec::TokenLogprob>,
    finish: Option<&'static str>,
}

impl Reply {
    fn new(state: &Arc<AppState>, generation: Generation, id: String) -> Self {
        let text = TextAssembler::new(generation.stop.clone());
        Reply { state: state.clone(), generation, id, created: unix_time(), text, completion_tokens: 0 }
    }

    /// The output an engine event adds; `Err` when the engine failed.
    fn take(&mut self, event: Event) -> Result<Piece, ApiError> {
        match event {
            Event::Tokens { tokens, logprobs } => {
                self.completion_tokens += tokens.len();
                let (text, stopped) = self.text.push(&self.state.tokenizer, &tokens);
                Ok(Piece { text, logprobs, finish: stopped.then_some("stop") })
            }
            Event::Finished(reason) => {
                let text = self.text.flush(&self.state.tokenizer);
                let finish = match reason {
                    FinishReason::Length => "length",
                    FinishReason::Stop => "stop",
                };
                Ok(Piece { text, logprobs: Vec::new(), finish: Some(finish) })
            }
            Event::Failed(message) => Err(ApiError {
                status: StatusCode::INTERNAL_SERVER_ERROR,
                message: format!("the engine failed: {message}"),
                param: None,
                kind: "server_error",
            }),
        }
    }

    fn usage(&self) -> Value {
        let prompt = self.generation.prompt.len();
        json!({"prompt_tokens": prompt, "completion_tokens": self.completion_tokens,
               "total_tokens": prompt + self.completion_tokens})
    }

    fn object(&self, chunk: bool) -> &'static str {
        match (self.generation.endpoint, chunk) {
            (Endpoint::Completions, _) => "text_completion",
            (Endpoint::Chat, false) => "chat.completion",
            (Endpoint::Chat, true) => "chat.completion.chunk",
        }
    }

    /// OpenAI's `logprobs` object of `entries` (null when the request asked for none).
    fn logprobs(&self, entries: &[crate::spec::TokenLogprob], offset: usize) -> Value {
        if self.generation.params.logprobs.is_none() {
            return Value::Null;
        }
        let tokenizer = &self.state.tokenizer;
        let piece = |id: u32| tokenizer.decode(&[id], false).unwrap_or_default();
        match self.generation.endpoint {
            Endpoint::Completions => {
                let mut at = offset;
                let mut offsets = Vec::new();
                for e in entries {
                    offsets.push(at);
                    at += piece(e.token).len();
                }
                json!({
                    "tokens": entries.iter().map(|e| piece(e.token)).collect::<Vec<_>>(),
                    "token_logprobs": entries.iter().map(|e| e.logprob).collect::<Vec<_>>(),
                    "top_logprobs": entries.iter().map(|e| e.top.iter().map(|&(t, l)| (piece(t), json!(l)))
                        .collect::<serde_json::Map<_, _>>()).collect::<Vec<_>>(),
                    "text_offset": offsets,
                })
            }
            Endpoint::Chat => {
                let entry = |t: u32, l: f32| json!({"token": piece(t), "logprob": l, "bytes": piece(t).into_bytes()});
                let content: Vec<Value> = entries
                    .iter()
                    .map(|e| {
                        let mut v = entry(e.token, e.logprob);
                        v["top_logprobs"] = e.top.iter().map(|&(t, l)| entry(t, l)).collect();
                        v
                    })
                    .collect();
                json!({ "content": content })
            }
        }
    }

    /// A streamed chunk with `piece`.
    fn chunk(&self, piece: &Piece, first: bool, offset: usize) -> Value {
        let logprobs = self.logprobs(&piece.logprobs, offset);
        let choice = match self.generation.endpoint {
            Endpoint::Completions => {
                json!({"index": 0, "text": piece.text, "logprobs": logprobs, "finish_reason": piece.finish})
            }
            Endpoint::Chat => {
                let mut delta = json!({"content": piece.text});
                if first {
                    delta["role"] = json!("assistant");
                }
                json!({"index": 0, "delta": delta, "logprobs": logprobs, "finish_reason": piece.finish})
            }
        };
        json!({"id": self.id, "object": self.object(true), "created": self.created,
               "model": self.generation.model, "choices": [choice]})
    }
}

/// Collects the whole output, then answers.
async fn whole(mut reply: Reply, mut rx: mpsc::UnboundedReceiver<Event>) -> Response {
    let (mut text, mut logprobs, mut finish) = (String::new(), Vec::new(), None);
    while let Some(event) = rx.recv().await {
        match reply.take(event) {
            Ok(piece) => {
                text.push_str(&piece.text);
                logprobs.extend(piece.logprobs);
                finish = piece.finish;
            }
            Err(e) => {
                reply.state.engine.metrics().count_request(e.status.as_str());
                return e.into_response();
            }
        }
        if finish.is_some() {
            break;
        }
    }
    drop(rx);
    let finish = finish.unwrap_or("abort");
    reply.state.engine.metrics().count_request(finish);
    let logprobs = reply.logprobs(&logprobs, 0);
    let choice = match reply.generation.endpoint {
        Endpoint::Completions => json!({"index": 0, "text": text, "logprobs": logprobs, "finish_reason": finish}),
        Endpoint::Chat => json!({"index": 0, "message": {"role": "assistant", "content": text},
                                 "logprobs": logprobs, "finish_reason": finish}),
    };
    Json(json!({"id": reply.id, "object": reply.object(false), "created": reply.created,
                "model": reply.generation.model, "choices": [choice], "usage": reply.usage()}))
    .into_response()
}

/// Streams the output as server-sent events: one chunk per engine step, a usage chunk when asked,
/// `[DONE]` last. A client that goes away drops the stream, which ends the forwarding task and with it
/// the request's receiver, so the engine loop cancels the request.
fn stream(mut reply: Reply, mut rx: mpsc::UnboundedReceiver<Event>) -> Response {
    let (tx, out) = mpsc::channel::<Result<SseEvent, Infallible>>(64);
    tokio::spawn(async move {
        let (mut first, mut offset) = (true, 0);
        while let Some(event) = rx.recv().await {
            let data = match reply.take(event) {
                Ok(piece) => {
                    let chunk = reply.chunk(&piece, first, offset);
                    offset += piece.text.len();
                    first = false;
                    let done = piece.finish;
                    if tx.send(Ok(SseEvent::default().data(chunk.to_string()))).await.is_err() {
                        return;
                    }
                    match done {
                        Some(finish) => {
                            reply.state.engine.metrics().count_request(finish);
                            break;
                        }
                        None => continue,
                    }
                }
                Err(e) => {
                    reply.state.engine.metrics().count_request(e.status.as_str());
                    e.body().to_string()
                }
            };
            let _ = tx.send(Ok(SseEvent::default().data(data))).await;
            break;
        }
        drop(rx);
        if reply.generation.include_usage {
            let usage = json!({"id": reply.id, "object": reply.object(true), "created": reply.created,
                               "model": reply.generation.model, "choices": [], "usage": reply.usage()});
            let _ = tx.send(Ok(SseEvent::default().data(usage.to_string()))).await;
        }
        let _ = tx.send(Ok(SseEvent::default().data("[DONE]"))).await;
    });
    Sse::new(ReceiverStream::new(out)).into_response()
}
