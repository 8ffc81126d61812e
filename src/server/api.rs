//! OpenAI request parsing and checking: a request body becomes a [`Generation`] or an [`ApiError`] in
//! OpenAI's error shape that names the bad field.

use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use serde::Deserialize;
use serde_json::{json, Value};

use crate::model::{ChatMessage, Tokenizer};
use crate::spec::{RequestParams, Sampling, MAX_TOP_LOGPROBS};

use super::worker::EngineInfo;

/// An error response: HTTP status and OpenAI's `{"error": {...}}` body.
#[derive(Debug, Clone, PartialEq)]
pub struct ApiError {
    /// The HTTP status.
    pub status: StatusCode,
    /// What went wrong, for a person.
    pub message: String,
    /// The request field at fault, if one is.
    pub param: Option<String>,
    /// OpenAI's error type, e.g. `invalid_request_error`.
    pub kind: &'static str,
}

impl ApiError {
    /// A 400 about `param`.
    pub fn invalid(param: impl Into<Option<String>>, message: impl Into<String>) -> Self {
        ApiError {
            status: StatusCode::BAD_REQUEST,
            message: message.into(),
            param: param.into(),
            kind: "invalid_request_error",
        }
    }

    /// A 503: the server cannot take the request now.
    pub fn unavailable(message: impl Into<String>) -> Self {
        ApiError {
            status: StatusCode::SERVICE_UNAVAILABLE,
            message: message.into(),
            param: None,
            kind: "server_overloaded",
        }
    }

    /// OpenAI's error body.
    pub fn body(&self) -> Value {
        json!({"error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.status.as_u16()}})
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        (self.status, axum::Json(self.body())).into_response()
    }
}

fn field(name: &str, message: impl Into<String>) -> ApiError {
    ApiError::invalid(Some(name.to_string()), message)
}

/// Which endpoint a request came to.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Endpoint {
    /// `/v1/completions`.
    Completions,
    /// `/v1/chat/completions`.
    Chat,
}

/// A checked generation request.
#[derive(Debug)]
pub struct Generation {
    /// The endpoint, which decides the response's shape.
    pub endpoint: Endpoint,
    /// The served model's name, echoed in responses.
    pub model: String,
    /// Prompt token ids.
    pub prompt: Vec<u32>,
    /// What the engine is asked for.
    pub params: RequestParams,
    /// Strings that end the output (not included in it).
    pub stop: Vec<String>,
    /// Stream the output as server-sent events.
    pub stream: bool,
    /// With `stream`, a last chunk with the token usage.
    pub include_usage: bool,
}

/// Fields either endpoint takes (vLLM's `top_k` and `ignore_eos` included).
const COMMON_FIELDS: &[&str] = &[
    "model",
    "max_tokens",
    "temperature",
    "top_p",
    "top_k",
    "seed",
    "stop",
    "stream",
    "stream_options",
    "n",
    "user",
    "ignore_eos",
    "presence_penalty",
    "frequency_penalty",
];
const COMPLETION_FIELDS: &[&str] = &["prompt", "logprobs", "echo", "best_of", "suffix"];
const CHAT_FIELDS: &[&str] = &["messages", "logprobs", "top_logprobs", "max_completion_tokens"];

#[derive(Deserialize)]
struct Common {
    model: Option<String>,
    max_tokens: Option<i64>,
    max_completion_tokens: Option<i64>,
    temperature: Option<f64>,
    top_p: Option<f64>,
    top_k: Option<i64>,
    seed: Option<i64>,
    stop: Option<Stop>,
    #[serde(default)]
    stream: bool,
    stream_options: Option<StreamOptions>,
    n: Option<i64>,
    #[serde(default)]
    ignore_eos: bool,
    presence_penalty: Option<f64>,
    frequency_penalty: Option<f64>,
    #[serde(default)]
    echo: bool,
    best_of: Option<i64>,
    suffix: Option<String>,
}

#[derive(Deserialize)]
#[serde(untagged)]
enum Stop {
    One(String),
    Many(Vec<String>),
}

#[derive(Deserialize)]
struct StreamOptions {
    #[serde(default)]
    include_usage: bool,
}

#[derive(Deserialize)]
struct CompletionOnly {
    prompt: Option<Value>,
    logprobs: Option<i64>,
}

#[derive(Deserialize)]
struct ChatOnly {
    messages: Option<Vec<ChatMessage>>,
    #[serde(default)]
    logprobs: bool,
    top_logprobs: Option<i64>,
}

/// Deserializes `body` as `T`, naming the field a type error is in.
fn typed<T: serde::de::DeserializeOwned>(body: &Value) -> Result<T, ApiError> {
    serde_path_to_error::deserialize(body).map_err(|e| {
        let path = e.path().to_string();
        let message = format!("'{path}': {}", e.inner());
        ApiError::invalid((path != ".").then_some(path), message)
    })
}

/// What a request is checked against.
pub struct Limits<'a> {
    /// The served model's name.
    pub model: &'a str,
    /// The tokenizer (prompts, chat template, stop strings).
    pub tokenizer: &'a Tokenizer,
    /// The engine's facts.
    pub info: &'a EngineInfo,
    /// Seed of a sampled request that gives none.
    pub default_seed: u64,
}

/// Parses and checks a request body for `endpoint`.
pub fn parse(endpoint: Endpoint, body: &[u8], limits: &Limits) -> Result<Generation, ApiError> {
    let value: Value = serde_json::from_slice(body)
        .map_err(|e| ApiError::invalid(None, format!("We could not parse the JSON body of your request: {e}")))?;
    let Value::Object(map) = &value else {
        return Err(ApiError::invalid(None, "The request body must be a JSON object."));
    };
    let own = if endpoint == Endpoint::Chat { CHAT_FIELDS } else { COMPLETION_FIELDS };
    if let Some(unknown) = map.keys().find(|k| !COMMON_FIELDS.contains(&k.as_str()) && !own.contains(&k.as_str())) {
        return Err(field(unknown, format!("Unrecognized request argument supplied: {unknown}")));
    }
    let common: Common = typed(&value)?;
    check_unsupported(&common)?;
    let model = common.model.clone().unwrap_or_else(|| limits.model.to_string());
    if model != limits.model {
        let mut e = field("model", format!("The model `{model}` does not exist."));
        e.status = StatusCode::NOT_FOUND;
        e.kind = "model_not_found";
        return Err(e);
    }
    let (prompt, logprobs) = match endpoint {
        Endpoint::Completions => completion_prompt(typed(&value)?, limits.tokenizer)?,
        Endpoint::Chat => chat_prompt(typed(&value)?, limits.tokenizer)?,
    };
    let max_tokens = max_tokens(endpoint, &common, prompt.len(), limits.info)?;
    let sampling = sampling(&common, limits)?;
    let stop = stop_strings(common.stop)?;
    let stop_tokens =
        if common.ignore_eos { Vec::new() } else { limits.tokenizer.eos_token_id().into_iter().collect() };
    Ok(Generation {
        endpoint,
        model,
        prompt,
        params: RequestParams { max_tokens, stop_tokens, sampling, logprobs },
        stop,
        stream: common.stream,
        include_usage: common.stream_options.is_some_and(|o| o.include_usage),
    })
}

/// OpenAI fields the engine does not implement are errors unless they ask for the default.
fn check_unsupported(c: &Common) -> Result<(), ApiError> {
    if let Some(n) = c.n.filter(|&n| n != 1) {
        return Err(field(
            "n",
            format!("n = {n} is not supported: this server returns one choice per request (n = 1)"),
        ));
    }
    if let Some(b) = c.best_of.filter(|&b| b != 1) {
        return Err(field("best_of", format!("best_of = {b} is not supported: only 1")));
    }
    for (name, v) in [("presence_penalty", c.presence_penalty), ("frequency_penalty", c.frequency_penalty)] {
        if let Some(v) = v.filter(|&v| v != 0.0) {
            return Err(field(name, format!("{name} = {v} is not supported: only 0")));
        }
    }
    if c.echo {
        return Err(field("echo", "echo is not supported"));
    }
    if c.suffix.as_deref().is_some_and(|s| !s.is_empty()) {
        return Err(field("suffix", "suffix is not supported"));
    }
    Ok(())
}

/// The completion prompt's ids and the `logprobs` count (0-20).
fn completion_prompt(c: CompletionOnly, tokenizer: &Tokenizer) -> Result<(Vec<u32>, Option<usize>), ApiError> {
    let ids = match c.prompt {
        None => return Err(field("prompt", "'prompt' is a required property")),
        Some(Value::String(text)) => encode(tokenizer, &text)?,
        Some(Value::Array(items)) if items.iter().all(Value::is_string) && items.len() > 1 => {
            return Err(field(
                "prompt",
                format!("{} prompts given: this server takes one prompt per request", items.len()),
            ))
        }
        Some(Value::Array(items)) if items.len() == 1 && items[0].is_string() => {
            encode(tokenizer, items[0].as_str().unwrap_or_default())?
        }
        Some(Value::Array(items)) => token_ids(&items, tokenizer.vocab_size())?,
        Some(_) => return Err(field("prompt", PROMPT_SHAPE)),
    };
    if ids.is_empty() {
        return Err(field("prompt", "The prompt is empty: give at least one token"));
    }
    let logprobs = c.logprobs.map(|n| top_n("logprobs", n)).transpose()?;
    Ok((ids, logprobs))
}

/// The chat prompt's ids (the messages in the chat template) and the `top_logprobs` count.
fn chat_prompt(c: ChatOnly, tokenizer: &Tokenizer) -> Result<(Vec<u32>, Option<usize>), ApiError> {
    let messages = c.messages.ok_or_else(|| field("messages", "'messages' is a required property"))?;
    if messages.is_empty() {
        return Err(field("messages", "'messages' must hold at least one message"));
    }
    let text = tokenizer
        .apply_chat_template(&messages, true)
        .map_err(|e| field("messages", format!("the chat template failed on these messages: {e}")))?;
    let ids = encode(tokenizer, &text)?;
    let top = c.top_logprobs.map(|n| top_n("top_logprobs", n)).transpose()?;
    if top.is_some() && !c.logprobs {
        return Err(field("top_logprobs", "top_logprobs needs logprobs = true"));
    }
    Ok((ids, c.logprobs.then(|| top.unwrap_or(0))))
}

const PROMPT_SHAPE: &str = "'prompt' must be a string, an array of one string, or an array of token ids";

/// A prompt given as token ids, each checked against the vocabulary.
fn token_ids(items: &[Value], vocab: usize) -> Result<Vec<u32>, ApiError> {
    items
        .iter()
        .map(|v| match v.as_u64() {
            Some(t) if (t as usize) < vocab => Ok(t as u32),
            Some(t) => Err(field("prompt", format!("token id {t} is outside the vocabulary of {vocab}"))),
            None => Err(field("prompt", PROMPT_SHAPE)),
        })
        .collect()
}

fn encode(tokenizer: &Tokenizer, text: &str) -> Result<Vec<u32>, ApiError> {
    tokenizer.encode(text, false).map_err(|e| field("prompt", format!("could not tokenize the prompt: {e}")))
}

fn top_n(name: &str, n: i64) -> Result<usize, ApiError> {
    if !(0..=MAX_TOP_LOGPROBS as i64).contains(&n) {
        return Err(field(name, format!("{name} = {n} must be in 0..={MAX_TOP_LOGPROBS}")));
    }
    Ok(n as usize)
}

/// `max_tokens` (chat: or `max_completion_tokens`), checked against the context; by default 16 for a
/// completion (OpenAI's default) and the rest of the context for a chat.
fn max_tokens(endpoint: Endpoint, c: &Common, prompt: usize, info: &EngineInfo) -> Result<usize, ApiError> {
    let context = info.max_seq_len;
    if prompt >= context {
        return Err(field(
            "prompt",
            format!(
                "This model's maximum context length is {context} tokens. However, your prompt has {prompt} tokens."
            ),
        ));
    }
    let (name, asked) = match (c.max_tokens, c.max_completion_tokens) {
        (_, Some(m)) => ("max_completion_tokens", Some(m)),
        (m, None) => ("max_tokens", m),
    };
    let room = context - prompt;
    let n = match asked {
        Some(n) if n <= 0 => return Err(field(name, format!("{name} = {n} must be at least 1"))),
        Some(n) if n as u64 > room as u64 => {
            return Err(field(
                name,
                format!(
                    "This model's maximum context length is {context} tokens. However, you requested {} tokens \
                     ({prompt} in the prompt, {n} for the completion).",
                    prompt as i64 + n
                ),
            ))
        }
        Some(n) => n as usize,
        None if endpoint == Endpoint::Completions => 16.min(room),
        None => room,
    };
    Ok(n)
}

/// Sampling settings: `None` (greedy) at temperature 0, the default 1.0 otherwise as OpenAI.
fn sampling(c: &Common, limits: &Limits) -> Result<Option<Sampling>, ApiError> {
    let temperature = c.temperature.unwrap_or(1.0);
    if !(0.0..=2.0).contains(&temperature) {
        return Err(field("temperature", format!("temperature = {temperature} must be in [0, 2]")));
    }
    let top_p = c.top_p.unwrap_or(1.0);
    if !(top_p > 0.0 && top_p <= 1.0) {
        return Err(field("top_p", format!("top_p = {top_p} must be in (0, 1]")));
    }
    let vocab = limits.tokenizer.vocab_size() as i64;
    let top_k = match c.top_k.unwrap_or(-1) {
        -1 | 0 => 0,
        k if (1..=vocab).contains(&k) => k as usize,
        k => return Err(field("top_k", format!("top_k = {k} must be -1 (all), or in 1..={vocab}"))),
    };
    if temperature == 0.0 {
        return Ok(None);
    }
    let seed = c.seed.map_or(limits.default_seed, |s| s as u64);
    Ok(Some(Sampling { temperature: temperature as f32, top_p: top_p as f32, top_k, seed }))
}

/// At most four non-empty stop strings, as OpenAI.
fn stop_strings(stop: Option<Stop>) -> Result<Vec<String>, ApiError> {
    let stop = match stop {
        None => Vec::new(),
        Some(Stop::One(s)) => vec![s],
        Some(Stop::Many(v)) => v,
    };
    if stop.len() > 4 {
        return Err(field("stop", format!("{} stop strings given: at most 4", stop.len())));
    }
    if stop.iter().any(|s| s.is_empty()) {
        return Err(field("stop", "a stop string must not be empty"));
    }
    Ok(stop)
}
