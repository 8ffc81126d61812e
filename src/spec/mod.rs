//! Speculative decoding on top of the model step (ENGINE.md §3, §5, §7, §8): a proposer (prompt
//! lookup, or the DFlash drafter reading the target's hidden states) drafts the next tokens of every
//! sequence, one target step verifies them all (a path for `chain`, a best-first tree of
//! a budget for `ddtree`), greedy acceptance keeps the longest path the target agrees with, and the
//! accepted rows' cache entries are compacted as if they had been decoded one by one. With temperature
//! 0 every mode emits the tokens plain autoregressive decoding emits, at any batch.
//!
//! [`Engine`] is the library API: add requests, call [`Engine::step`] until they finish, read each
//! request's new tokens from the step's output.

mod auto;
mod dflash;
mod engine;
mod proposer;
mod sampling;
mod target;

pub use dflash::DflashProposer;
pub use engine::{
    Engine, EngineConfig, FinishReason, Mode, RequestId, RequestParams, SpecStats, StageTimes, StepOutput,
    TokenLogprob, MAX_TOP_LOGPROBS,
};
pub use proposer::{DraftRequest, NgramProposer, Proposal, Proposer};
pub use sampling::{sample, uniform, Sampling};
pub use target::{Target, TargetCache};
