//! The DeepSeek-V3 / Kimi-K2 model (issue 5): the configuration read from a Hugging Face `config.json`,
//! the checkpoint tensors, the tokenizer with its chat template, and the forward pass over a paged latent
//! KV cache (CPU backend; the heavy operations sit behind [`ops::Ops`]).

pub mod config;
pub mod forward;
pub mod layers;
pub mod ops;
pub mod rope;
pub mod tokenizer;
pub mod weights;

pub use forward::{KvCache, Logits, Model};
pub use tokenizer::{ChatMessage, Tokenizer};
