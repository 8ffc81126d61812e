//! The DeepSeek-V3 / Kimi-K2 model (issue 5): the configuration read from a Hugging Face `config.json`,
//! the checkpoint tensors, the tokenizer with its chat template, and the forward pass over a paged latent
//! KV cache, one code path for every [`backend::Backend`].

pub mod backend;
pub mod config;
pub mod drafter;
pub mod forward;
pub mod layers;
pub mod perplexity;
pub mod rope;
pub mod tokenizer;
pub mod weights;

pub use drafter::{drafter_beside, BlockDraft, DflashConfig, Drafter};
pub use forward::{HiddenStep, KvCache, Logits, Model, Stage, StageTime, StepRequest, StepTopK, TreeCommit, TreeInput};
pub use tokenizer::{ChatMessage, Tokenizer};
