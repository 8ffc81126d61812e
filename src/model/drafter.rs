//! The DFlash-style drafter (ENGINE.md §8, research/ddtree.md §1): D dense decoder layers of the target's
//! own MLA and MLP shape that read the target through two things only, its hidden states at a few layers
//! (the context features) and its embedding table and lm_head.
//!
//! Per sequence the drafter keeps its own latent KV cache of the committed tokens: each token's context
//! features `[k · hidden]` (the k target layers' hidden states, concatenated) go through `fc` and
//! `hidden_norm`, and every draft layer writes that one vector's latent row (kv_a, latent norm, RoPE at the
//! token's position) — the context takes no query and passes through no layer. A draft is one step over
//! the block `[bonus, MASK × (block_size − 1)]` at the positions after the context: the block rows are
//! tree rows that all see each other (non-causal inside the block) and the whole context, are written past
//! the context without being committed, and each masked row's logits are the drafter's distribution of
//! the token at its position.
//!
//! Checkpoint: a directory with `config.json` (a DeepSeek-V3 config of the draft layers, all dense, with
//! a `dflash_config` object: `block_size`, `target_layer_ids`, `mask_token_id`) and safetensors holding
//! `fc.weight [hidden, k · hidden]`, `hidden_norm.weight`, `norm.weight` and `layers.{i}.…` named as the
//! target's `model.layers.{i}.…`.

use std::path::{Path, PathBuf};
use std::sync::{Mutex, PoisonError};

use serde::Deserialize;

use crate::cpu::backend::CpuBackend;
use crate::cpu::mla::ROW;
use crate::cpu::rowops::ROPE_TABLE;
use crate::error::{Error, Result};
use crate::model::backend::Backend;
use crate::model::config::Config;
use crate::model::forward::{load_layer, Norm, SharedParts};
use crate::model::layers::{Linear, RmsNorm};
use crate::model::weights::Checkpoint;
use crate::model::{KvCache, Logits, Model, StepRequest, TreeInput};
use crate::parallel::Shard;
use crate::MAX_DEPTH;

/// The `dflash_config` of a drafter's `config.json`.
#[derive(Clone, Debug, PartialEq, Eq, Deserialize)]
pub struct DflashConfig {
    /// Block length: the bonus token and `block_size - 1` masked positions drafted at once.
    pub block_size: usize,
    /// The target layers whose hidden states (the residual stream leaving the layer) are the context
    /// features, in the order `fc` reads them.
    pub target_layer_ids: Vec<usize>,
    /// The token the masked block positions are embedded as.
    pub mask_token_id: u32,
}

impl DflashConfig {
    /// Checks the block size and the ids against a target of `layers` layers and `vocab` tokens.
    pub fn validate(&self, layers: usize, vocab: usize) -> Result<()> {
        if self.block_size < 2 || self.block_size > MAX_DEPTH + 1 {
            return Err(Error::param(
                "dflash_config.block_size",
                self.block_size,
                format!("must be in 2..={}", MAX_DEPTH + 1),
            ));
        }
        let ids = &self.target_layer_ids;
        if ids.is_empty() || ids.iter().enumerate().any(|(i, &l)| l >= layers || ids[..i].contains(&l)) {
            return Err(Error::param(
                "dflash_config.target_layer_ids",
                format!("{ids:?}"),
                format!("need distinct target layers in 0..{layers}"),
            ));
        }
        if self.mask_token_id as usize >= vocab {
            return Err(Error::param(
                "dflash_config.mask_token_id",
                self.mask_token_id,
                format!("must be inside the target's vocabulary 0..{vocab}"),
            ));
        }
        Ok(())
    }

    /// Draft positions per block.
    pub fn depth(&self) -> usize {
        self.block_size - 1
    }
}

/// What the drafter proposes for one block: the `[depth, k]` best tokens of each masked position and
/// their log-probabilities, best first.
#[derive(Clone, Debug, PartialEq)]
pub struct BlockDraft {
    /// `[depth, k]` token ids.
    pub ids: Vec<i32>,
    /// `[depth, k]` log-probabilities (0 when only the argmax was asked for).
    pub logp: Vec<f32>,
}

/// Scratch of the context write, sized for `tokens` rows; grown when a write needs more.
struct ContextScratch<B: Backend> {
    tokens: usize,
    features: B::Buf<f32>,
    projected: B::Buf<f32>,
    normed: B::Buf<f32>,
    table: B::Buf<f32>,
    slot: B::Buf<i32>,
    kv: B::Buf<f32>,
}

impl<B: Backend> ContextScratch<B> {
    fn new(b: &B, tokens: usize, features: usize, hidden: usize) -> Result<Self> {
        Ok(ContextScratch {
            tokens,
            features: b.zeros(tokens * features)?,
            projected: b.zeros(tokens * hidden)?,
            normed: b.zeros(tokens * hidden)?,
            table: b.zeros(tokens * ROPE_TABLE)?,
            slot: b.zeros(tokens)?,
            kv: b.zeros(tokens * ROW)?,
        })
    }
}

/// A DFlash drafter placed beside its target (see the module documentation).
pub struct Drafter<B: Backend = CpuBackend> {
    /// The draft layers with the drafter's final norm and the target's embedding and lm_head.
    model: Model<B>,
    fc: B::Linear,
    hidden_norm: Norm<B>,
    dflash: DflashConfig,
    scratch: Mutex<Option<ContextScratch<B>>>,
}

/// The drafter shipped beside the checkpoint in `model_dir`: `<model_dir>/drafter` when it holds a
/// config.json.
pub fn drafter_beside(model_dir: impl AsRef<Path>) -> Option<PathBuf> {
    Some(model_dir.as_ref().join("drafter")).filter(|d| d.join("config.json").exists())
}

/// The raw `dflash_config` member.
#[derive(Deserialize)]
struct RawDrafterConfig {
    dflash_config: Option<DflashConfig>,
}

impl<B: Backend> Drafter<B> {
    /// Loads the drafter checkpoint in `dir` for `target`, on the target's backend. Its hidden size
    /// and vocabulary must be the target's, its layers dense, its target layers inside the target.
    pub fn load(dir: impl AsRef<Path>, target: &Model<B>) -> Result<Self> {
        let dir = dir.as_ref();
        let path = dir.join("config.json");
        let text =
            std::fs::read_to_string(&path).map_err(|e| Error::Data { path: path.clone(), detail: e.to_string() })?;
        let config = Config::from_json(&text)?;
        let raw: RawDrafterConfig =
            serde_json::from_str(&text).map_err(|e| Error::Data { path: path.clone(), detail: e.to_string() })?;
        let dflash = raw.dflash_config.ok_or_else(|| Error::Data {
            path: path.clone(),
            detail: "no `dflash_config` (block_size, target_layer_ids, mask_token_id): not a DFlash drafter".into(),
        })?;
        Self::check_against(&config, &dflash, target.config())?;
        let ckpt = Checkpoint::open(dir)?;
        Self::from_checkpoint(config, dflash, &ckpt, target)
    }

    /// The drafter's shape against its target's.
    fn check_against(c: &Config, dflash: &DflashConfig, target: &Config) -> Result<()> {
        for (name, mine, theirs) in
            [("hidden_size", c.hidden_size, target.hidden_size), ("vocab_size", c.vocab_size, target.vocab_size)]
        {
            if mine != theirs {
                return Err(Error::param(name, mine, format!("the drafter needs the target's {name}, {theirs}")));
            }
        }
        if c.first_k_dense_replace < c.num_hidden_layers {
            return Err(Error::param(
                "first_k_dense_replace",
                c.first_k_dense_replace,
                format!("every draft layer is dense: need >= num_hidden_layers = {}", c.num_hidden_layers),
            ));
        }
        dflash.validate(target.num_hidden_layers, target.vocab_size)
    }

    fn from_checkpoint(config: Config, dflash: DflashConfig, ckpt: &Checkpoint, target: &Model<B>) -> Result<Self> {
        let SharedParts { embed, lm_head, backend } = target.shared_parts()?;
        let (b, h) = (&*backend, config.hidden_size);
        let k = dflash.target_layer_ids.len();
        let fc = Linear::load(ckpt, "fc.weight", h, k * h)?;
        let hidden_norm = RmsNorm::load(ckpt, "hidden_norm.weight", h, config.rms_norm_eps)?;
        let norm = RmsNorm::load(ckpt, "norm.weight", h, config.rms_norm_eps)?;
        let layers = (0..config.num_hidden_layers)
            .map(|i| load_layer(b, ckpt, &config, &format!("layers.{i}"), i, Shard::WHOLE))
            .collect::<Result<Vec<_>>>()?;
        let unread = ckpt.unread();
        if !unread.is_empty() {
            return Err(Error::Data {
                path: ckpt.dir().to_path_buf(),
                detail: format!("{} tensors a drafter does not use, e.g. `{}`", unread.len(), unread[0]),
            });
        }
        Ok(Drafter {
            fc: b.linear(fc.weight(), 1, h, k * h)?,
            hidden_norm: Norm::place(b, &hidden_norm)?,
            model: Model::from_parts(config, embed, layers, Norm::place(b, &norm)?, lm_head, backend.clone(), None)?,
            dflash,
            scratch: Mutex::new(None),
        })
    }

    /// The `dflash_config`.
    pub fn dflash(&self) -> &DflashConfig {
        &self.dflash
    }

    /// The draft layers as a model (its config, its graphs switch).
    pub fn model(&self) -> &Model<B> {
        &self.model
    }

    /// Width of one token's context features: `target_layer_ids.len() · hidden_size`.
    pub fn feature_width(&self) -> usize {
        self.dflash.target_layer_ids.len() * self.model.config().hidden_size
    }

    /// A context cache for the drafter (its layers, its pages).
    pub fn new_cache(&self, num_pages: usize, page_size: usize, max_seq_len: usize) -> Result<KvCache<B>> {
        self.model.new_cache(num_pages, page_size, max_seq_len)
    }

    /// Appends context to the sequences of `rows` (`(sequence, tokens)`): `features` holds each new
    /// token's `[feature_width]` features, the sequences' tokens one after another, in `rows`' order.
    pub fn write_context(&self, cache: &mut KvCache<B>, rows: &[(usize, usize)], features: &[f32]) -> Result<()> {
        let width = self.feature_width();
        let tokens: usize = rows.iter().map(|r| r.1).sum();
        if features.len() != tokens * width {
            return Err(Error::shape(
                "context features",
                format!("[tokens={tokens}, k * hidden={width}]"),
                tokens * width,
                features.len(),
            ));
        }
        if tokens == 0 {
            return Ok(());
        }
        let b = self.model.backend();
        let h = self.model.config().hidden_size;
        let mut guard = self.scratch.lock().unwrap_or_else(PoisonError::into_inner);
        if guard.as_ref().is_none_or(|s| s.tokens < tokens) {
            *guard = None;
            *guard = Some(ContextScratch::new(b, tokens.next_power_of_two(), width, h)?);
        }
        let s = guard.as_mut().expect("made above");
        b.write(features, &mut s.features)?;
        b.matmul(&self.fc, &s.features, tokens, &mut s.projected)?;
        self.hidden_norm.run(b, &s.projected, tokens, &mut s.normed)?;
        self.model.write_context(cache, rows, &s.normed, &mut s.table, &mut s.slot, &mut s.kv)
    }

    /// Drafts one block for each `(sequence, bonus token)` of `blocks` past the sequence's context: the
    /// `k` best tokens of every masked position with their log-probabilities, or with `k` `None` only
    /// the argmax, both computed where the backend lives. The block rows are not committed.
    pub fn draft(&self, cache: &mut KvCache<B>, blocks: &[(usize, u32)], k: Option<usize>) -> Result<Vec<BlockDraft>> {
        let (n, depth) = (self.dflash.block_size, self.dflash.depth());
        let inputs = BlockInputs::new(&self.dflash, blocks);
        let requests = inputs.requests(blocks);
        // Each block's first row is its bonus token's: its result is dropped.
        let Some(k) = k else {
            let argmax = self.model.step_argmax(cache, &requests, Logits::All)?;
            return Ok(argmax
                .chunks(n)
                .map(|block| BlockDraft { ids: block[1..].iter().map(|&t| t as i32).collect(), logp: vec![0.0; depth] })
                .collect());
        };
        let top = self.model.step_topk(cache, &requests, Logits::All, k)?;
        Ok(top
            .ids
            .chunks(n * k)
            .zip(top.logp.chunks(n * k))
            .map(|(ids, logp)| BlockDraft { ids: ids[k..].to_vec(), logp: logp[k..].to_vec() })
            .collect())
    }

    /// The logits `[blocks, depth, vocab]` of every masked position of the blocks [`Drafter::draft`]
    /// would draft, read back whole (to inspect the drafter's distribution). The block rows are not
    /// committed.
    pub fn draft_logits(&self, cache: &mut KvCache<B>, blocks: &[(usize, u32)]) -> Result<Vec<f32>> {
        let (n, vocab) = (self.dflash.block_size, self.model.config().vocab_size);
        let inputs = BlockInputs::new(&self.dflash, blocks);
        let logits = self.model.step(cache, &inputs.requests(blocks), Logits::All)?;
        Ok(logits.chunks(n * vocab).flat_map(|block| block[vocab..].iter().copied()).collect())
    }
}

/// The step inputs of draft blocks: each block `[bonus, MASK × depth]`, one tree of `block_size` rows
/// at the block's positions, every row seeing every other.
struct BlockInputs {
    tokens: Vec<Vec<u32>>,
    positions: Vec<u32>,
    visibility: Vec<u32>,
}

impl BlockInputs {
    fn new(dflash: &DflashConfig, blocks: &[(usize, u32)]) -> Self {
        let (n, depth) = (dflash.block_size, dflash.depth());
        let tokens = blocks
            .iter()
            .map(|&(_, bonus)| std::iter::once(bonus).chain(std::iter::repeat_n(dflash.mask_token_id, depth)).collect())
            .collect();
        let mut row = vec![0u32; n.div_ceil(32)];
        for j in 0..n {
            row[j / 32] |= 1 << (j % 32);
        }
        BlockInputs { tokens, positions: (0..n as u32).collect(), visibility: row.repeat(n) }
    }

    /// One tree request per `(sequence, bonus)` of `blocks`, in order.
    fn requests(&self, blocks: &[(usize, u32)]) -> Vec<StepRequest<'_>> {
        let tree = TreeInput { depth: &self.positions, visibility: &self.visibility };
        blocks.iter().zip(&self.tokens).map(|(&(seq, _), t)| StepRequest { seq, tokens: t, tree: Some(tree) }).collect()
    }
}
