//! The checkpoint's tokenizer: `tokenizer.json` through the `tokenizers` crate (offline, pure-Rust regex)
//! and the chat template of `tokenizer_config.json` rendered with `minijinja` the way transformers'
//! `apply_chat_template` renders it (trim_blocks, lstrip_blocks, `raise_exception`, Python string methods).

use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

use crate::error::{Error, Result};

/// One chat message: a role (`system`, `user`, `assistant`) and its text.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct ChatMessage {
    /// Who speaks.
    pub role: String,
    /// What is said.
    pub content: String,
}

impl ChatMessage {
    /// A message from `role`.
    pub fn new(role: impl Into<String>, content: impl Into<String>) -> Self {
        ChatMessage { role: role.into(), content: content.into() }
    }
}

/// A tokenizer with its special tokens and chat template.
pub struct Tokenizer {
    inner: tokenizers::Tokenizer,
    path: PathBuf,
    /// `tokenizer_config.json`, where the chat template and special tokens come from.
    config_path: Option<PathBuf>,
    chat_template: Option<String>,
    bos_token: Option<String>,
    eos_token: Option<String>,
}

fn data_err(path: &Path, detail: impl ToString) -> Error {
    Error::Data { path: path.to_path_buf(), detail: detail.to_string() }
}

/// A special token in `tokenizer_config.json`: a plain string or an `AddedToken` object with `content`.
fn token_text(config: &serde_json::Value, key: &str) -> Option<String> {
    match config.get(key)? {
        serde_json::Value::String(s) => Some(s.clone()),
        v => v.get("content").and_then(|c| c.as_str()).map(str::to_owned),
    }
}

impl Tokenizer {
    /// Loads `tokenizer.json` and, when present, `tokenizer_config.json` from a checkpoint directory.
    pub fn from_dir(dir: impl AsRef<Path>) -> Result<Self> {
        let dir = dir.as_ref();
        let config = dir.join("tokenizer_config.json");
        Self::from_files(dir.join("tokenizer.json"), config.is_file().then_some(config))
    }

    /// Loads a `tokenizer.json` and an optional `tokenizer_config.json` (special tokens, chat template).
    pub fn from_files(tokenizer_json: impl AsRef<Path>, tokenizer_config: Option<PathBuf>) -> Result<Self> {
        let path = tokenizer_json.as_ref().to_path_buf();
        let bytes = std::fs::read(&path).map_err(|e| data_err(&path, e))?;
        let inner = tokenizers::Tokenizer::from_bytes(&bytes)
            .map_err(|e| data_err(&path, format!("not a valid tokenizer.json: {e}")))?;
        let mut tok =
            Tokenizer { inner, path, config_path: None, chat_template: None, bos_token: None, eos_token: None };
        if let Some(cfg_path) = tokenizer_config {
            let text = std::fs::read_to_string(&cfg_path).map_err(|e| data_err(&cfg_path, e))?;
            let cfg: serde_json::Value =
                serde_json::from_str(&text).map_err(|e| data_err(&cfg_path, format!("invalid JSON: {e}")))?;
            tok.chat_template = match cfg.get("chat_template") {
                None | Some(serde_json::Value::Null) => None,
                Some(serde_json::Value::String(s)) => Some(s.clone()),
                Some(other) => {
                    return Err(data_err(
                        &cfg_path,
                        format!(
                            "`chat_template` must be a string (named template lists are not supported), got {other}"
                        ),
                    ))
                }
            };
            tok.config_path = Some(cfg_path.clone());
            tok.bos_token = token_text(&cfg, "bos_token");
            tok.eos_token = token_text(&cfg, "eos_token");
            for token in [&tok.bos_token, &tok.eos_token].into_iter().flatten() {
                if tok.inner.token_to_id(token).is_none() {
                    return Err(data_err(
                        &cfg_path,
                        format!("special token `{token}` is not in {}", tok.path.display()),
                    ));
                }
            }
        }
        Ok(tok)
    }

    /// Token ids of `text`; special tokens written in the text (e.g. `<|im_end|>`) become their ids.
    /// `add_special_tokens` applies the tokenizer's post-processor (e.g. a BOS), if it has one.
    pub fn encode(&self, text: &str, add_special_tokens: bool) -> Result<Vec<u32>> {
        let enc =
            self.inner.encode(text, add_special_tokens).map_err(|e| data_err(&self.path, format!("encode: {e}")))?;
        Ok(enc.get_ids().to_vec())
    }

    /// The text of `ids`; `skip_special_tokens` drops special tokens. An id outside the vocabulary is an error.
    pub fn decode(&self, ids: &[u32], skip_special_tokens: bool) -> Result<String> {
        let size = self.vocab_size();
        if let Some(&bad) = ids.iter().find(|&&id| id as usize >= size) {
            return Err(Error::Index {
                name: "ids",
                detail: format!("token id {bad} is outside the vocabulary 0..{size}"),
            });
        }
        self.inner.decode(ids, skip_special_tokens).map_err(|e| data_err(&self.path, format!("decode: {e}")))
    }

    /// Vocabulary size including added tokens.
    pub fn vocab_size(&self) -> usize {
        self.inner.get_vocab_size(true)
    }

    /// The id of a token's exact text (e.g. a special token), if it exists.
    pub fn token_id(&self, token: &str) -> Option<u32> {
        self.inner.token_to_id(token)
    }

    /// The BOS token's text from `tokenizer_config.json`.
    pub fn bos_token(&self) -> Option<&str> {
        self.bos_token.as_deref()
    }

    /// The EOS token's text from `tokenizer_config.json`.
    pub fn eos_token(&self) -> Option<&str> {
        self.eos_token.as_deref()
    }

    /// The EOS token's id.
    pub fn eos_token_id(&self) -> Option<u32> {
        self.eos_token.as_deref().and_then(|t| self.token_id(t))
    }

    /// Renders `messages` with the checkpoint's chat template, ending with the assistant's header when
    /// `add_generation_prompt`. Encode the result with `add_special_tokens = false`.
    pub fn apply_chat_template(&self, messages: &[ChatMessage], add_generation_prompt: bool) -> Result<String> {
        let source = self.config_path.as_deref().unwrap_or(&self.path);
        let template = self
            .chat_template
            .as_deref()
            .ok_or_else(|| data_err(source, "no `chat_template` (is tokenizer_config.json there?)"))?;
        let template_err = |e: minijinja::Error| data_err(source, format!("chat template: {e:#}"));
        let mut env = minijinja::Environment::new();
        // transformers compiles chat templates with these two options.
        let syntax = minijinja::syntax::SyntaxConfig::builder().trim_blocks(true).lstrip_blocks(true).build();
        env.set_syntax(syntax.map_err(template_err)?);
        env.set_unknown_method_callback(minijinja_contrib::pycompat::unknown_method_callback);
        env.add_function("raise_exception", |msg: String| -> std::result::Result<String, minijinja::Error> {
            Err(minijinja::Error::new(minijinja::ErrorKind::InvalidOperation, msg))
        });
        env.add_template("chat", template).map_err(template_err)?;
        let ctx = minijinja::context! {
            messages => minijinja::value::Serde(messages),
            add_generation_prompt => add_generation_prompt,
            bos_token => self.bos_token.clone().unwrap_or_default(),
            eos_token => self.eos_token.clone().unwrap_or_default(),
        };
        env.get_template("chat").and_then(|t| t.render(ctx)).map_err(template_err)
    }
}
