//! The DeepSeek-V3 / Kimi-K2 model (issue 5). So far: the configuration read from a Hugging Face
//! `config.json` and the checkpoint tensors.

pub mod config;
pub mod weights;
