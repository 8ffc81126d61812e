//! The DeepSeek-V3 / Kimi-K2 forward pass over a paged latent KV cache, one code path for every
//! [`Backend`]: embedding, per layer RMSNorm → MLA (absorbed) → RMSNorm → dense MLP or MoE, final norm,
//! lm_head. Weights are placed on the backend once, at load; a step uploads its token ids, positions and
//! block tables, runs every operation where the backend lives, and reads back only the rows asked for
//! (logits, or just their argmax).
//!
//! One call takes any mix of sequences and new tokens: a prefill is many tokens of one sequence, a decode
//! step one token of each. Every token is its own attention row over its sequence's slots `0 ..= position`
//! (the cache rows of the call's tokens are written first), so a prefill gives the bits of token-by-token
//! decoding and a token's results do not depend on what else is in the batch.

use std::collections::HashMap;
use std::ops::Range;
use std::path::Path;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, PoisonError};

use half::bf16;
use indicatif::{ProgressBar, ProgressStyle};

use crate::cpu::backend::CpuBackend;
use crate::cpu::mla::{LATENT, ROPE, ROW, SUPPORTED_HEADS};
use crate::cpu::rowops::{QueryShape, ROPE_TABLE};
use crate::error::{check_len, Error, Result};
use crate::model::backend::{AttentionInputs, Backend, Compaction, ExpertShare, HeadStrides, KvWrite, TreeRows};
use crate::model::config::Config;
use crate::model::layers::{self, MlaWeights, QueryProj};
use crate::model::rope::Rope;
use crate::model::weights::Checkpoint;
use crate::parallel::pipeline::StageLinks;
use crate::parallel::{Collective, Shard};
use crate::types::KvLayout;

/// Checkpoints at least this large show a loading progress bar (on a terminal).
const PROGRESS_BYTES: u64 = 1 << 30;

/// An RMSNorm weight on the backend.
pub(super) struct Norm<B: Backend> {
    w: B::Buf<f32>,
    eps: f32,
    dim: usize,
}

impl<B: Backend> Norm<B> {
    pub(super) fn place(b: &B, n: &layers::RmsNorm) -> Result<Self> {
        Ok(Norm { w: b.upload(&n.w)?, eps: n.eps, dim: n.w.len() })
    }

    /// `y = RMSNorm(x)` for `rows` dense rows.
    pub(super) fn run(&self, b: &B, x: &B::Buf<f32>, rows: usize, y: &mut B::Buf<f32>) -> Result<()> {
        b.rmsnorm(x, self.dim, &self.w, self.eps, rows, y, self.dim)
    }
}

/// A bf16 linear layer on the backend with its shape.
struct Dense<B: Backend> {
    w: B::Linear,
    out: usize,
}

impl<B: Backend> Dense<B> {
    fn place(b: &B, l: &layers::Linear) -> Result<Self> {
        Ok(Dense { w: b.linear(l.weight(), 1, l.out_features(), l.in_features())?, out: l.out_features() })
    }
}

/// The gated MLP with gate and up fused into one `[2I, h]` weight.
struct Mlp<B: Backend> {
    gate_up: B::Linear,
    down: B::Linear,
    inter: usize,
}

impl<B: Backend> Mlp<B> {
    fn place(b: &B, m: &layers::Mlp) -> Result<Self> {
        let (inter, h) = (m.gate.out_features(), m.gate.in_features());
        let fused: Vec<bf16> = m.gate.weight().iter().chain(m.up.weight()).copied().collect();
        Ok(Mlp { gate_up: b.linear(&fused, 1, 2 * inter, h)?, down: Dense::place(b, &m.down)?.w, inter })
    }
}

struct Moe<B: Backend> {
    router: B::Linear,
    bias: B::Buf<f32>,
    experts: B::Experts,
    /// Which experts `experts` are.
    share: ExpertShare,
    shared: Option<Mlp<B>>,
    top_k: usize,
    scaling: f64,
}

enum FeedForward<B: Backend> {
    Dense(Mlp<B>),
    Moe(Box<Moe<B>>),
}

enum Query<B: Backend> {
    Full(Dense<B>),
    LowRank(Dense<B>, Norm<B>, Dense<B>),
}

/// One layer's MLA weights; kv_b split per head into the key part, transposed for the query absorption
/// (`w_uk [heads, 512, nope]`), and the value part (`w_uv [heads, v, 512]`).
struct Attention<B: Backend> {
    q: Query<B>,
    kv_a: B::Linear,
    kv_a_norm: Norm<B>,
    w_uk: B::Linear,
    w_uv: B::Linear,
    o_proj: B::Linear,
}

impl<B: Backend> Attention<B> {
    /// Places `w`, of as many heads as its `kv_b` holds (all of them, or a tensor-parallel share).
    fn place(b: &B, w: &MlaWeights, c: &Config) -> Result<Self> {
        let (nope, v) = (c.qk_nope_head_dim, c.v_head_dim);
        let heads = w.kv_b.out_features() / (nope + v);
        let mut w_uk = Vec::with_capacity(heads * LATENT * nope);
        let mut w_uv = Vec::with_capacity(heads * v * LATENT);
        for h in 0..heads {
            let first = h * (nope + v);
            for j in 0..LATENT {
                w_uk.extend((0..nope).map(|d| w.kv_b.row(first + d)[j]));
            }
            for j in 0..v {
                w_uv.extend_from_slice(w.kv_b.row(first + nope + j));
            }
        }
        let q = match &w.q {
            QueryProj::Full(q) => Query::Full(Dense::place(b, q)?),
            QueryProj::LowRank(a, n, qb) => {
                Query::LowRank(Dense::place(b, a)?, Norm::place(b, n)?, Dense::place(b, qb)?)
            }
        };
        Ok(Attention {
            q,
            kv_a: Dense::place(b, &w.kv_a)?.w,
            kv_a_norm: Norm::place(b, &w.kv_a_norm)?,
            w_uk: b.linear(&w_uk, heads, LATENT, nope)?,
            w_uv: b.linear(&w_uv, heads, v, LATENT)?,
            o_proj: Dense::place(b, &w.o_proj)?.w,
        })
    }
}

pub(super) struct Layer<B: Backend> {
    input_norm: Norm<B>,
    attn: Attention<B>,
    post_attn_norm: Norm<B>,
    ffn: FeedForward<B>,
}

/// Per-step buffers sized for `tokens` tokens and `picked` returned rows; grown when a step needs more.
struct Scratch<B: Backend> {
    tokens: usize,
    picked: usize,
    x: B::Buf<f32>,
    normed: B::Buf<f32>,
    q_a: B::Buf<f32>,
    q_a_normed: B::Buf<f32>,
    q: B::Buf<f32>,
    q_latent: B::Buf<f32>,
    q_rows: B::Buf<bf16>,
    kv: B::Buf<f32>,
    o: B::Buf<f32>,
    lse: B::Buf<f32>,
    values: B::Buf<f32>,
    out: B::Buf<f32>,
    shared_out: B::Buf<f32>,
    gate_up: B::Buf<f32>,
    act: B::Buf<f32>,
    router: B::Buf<f32>,
    x16: B::Buf<bf16>,
    ids: B::Buf<i32>,
    table: B::Buf<f32>,
    slot: B::Buf<i32>,
    block_tables: B::Buf<i32>,
    seq_len: B::Buf<i32>,
    tree_tables: B::Buf<i32>,
    tree_prefix: B::Buf<i32>,
    visibility: B::Buf<u32>,
    pick: B::Buf<i32>,
    /// `0, 1, …, tokens - 1`: the pick of every row.
    every: B::Buf<i32>,
    /// Every token's hidden states after the layers a step asks for, one buffer per layer asked.
    hidden: Vec<B::Buf<f32>>,
    last: B::Buf<f32>,
    last_normed: B::Buf<f32>,
    logits: B::Buf<f32>,
    argmax: B::Buf<i32>,
    /// `[picked, k]` top-K ids and log-probabilities of the last K a step asked for (empty until then).
    top_ids: B::Buf<i32>,
    top_logp: B::Buf<f32>,
    /// With a vocabulary split: what gathers the ranks' logits into `logits`.
    split_logits: Option<SplitLogits<B>>,
}

/// The logits of a vocabulary split: this rank's `[picked, share]`, every rank's `[world, picked, share]`
/// as gathered, and the gathered rows in `[picked, vocab]` order (row r's share of rank k is gathered row
/// `k * picked + r`).
struct SplitLogits<B: Backend> {
    share: B::Buf<f32>,
    gathered: B::Buf<f32>,
    order: B::Buf<i32>,
}

impl<B: Backend> Scratch<B> {
    /// Buffers for a model of `c` holding `heads` attention heads, and `split`'s share of the vocabulary.
    fn new(
        b: &B,
        c: &Config,
        (heads, split): (usize, Option<Shard>),
        pages_per_req: usize,
        tokens: usize,
        picked: usize,
    ) -> Result<Self> {
        let h = c.hidden_size;
        let inter = c.intermediate_size.max(c.moe_intermediate_size * c.n_shared_experts);
        let t = tokens;
        Ok(Scratch {
            tokens,
            picked,
            x: b.zeros(t * h)?,
            normed: b.zeros(t * h)?,
            q_a: b.zeros(t * c.q_lora_rank.unwrap_or(0))?,
            q_a_normed: b.zeros(t * c.q_lora_rank.unwrap_or(0))?,
            q: b.zeros(t * heads * (c.qk_nope_head_dim + ROPE))?,
            q_latent: b.zeros(t * heads * LATENT)?,
            q_rows: b.zeros(t * heads * ROW)?,
            kv: b.zeros(t * ROW)?,
            o: b.zeros(t * heads * LATENT)?,
            lse: b.zeros(t * heads)?,
            values: b.zeros(t * heads * c.v_head_dim)?,
            out: b.zeros(t * h)?,
            shared_out: b.zeros(t * h)?,
            gate_up: b.zeros(t * 2 * inter)?,
            act: b.zeros(t * inter)?,
            router: b.zeros(t * c.n_routed_experts)?,
            x16: b.zeros(t * h)?,
            ids: b.zeros(t)?,
            table: b.zeros(t * ROPE_TABLE)?,
            slot: b.zeros(t)?,
            block_tables: b.zeros(t * pages_per_req)?,
            seq_len: b.zeros(t)?,
            tree_tables: b.zeros(t * pages_per_req)?,
            tree_prefix: b.zeros(t)?,
            visibility: b.zeros(t * t.div_ceil(32))?,
            pick: b.zeros(picked)?,
            every: b.upload(&(0..t as i32).collect::<Vec<i32>>())?,
            hidden: Vec::new(),
            last: b.zeros(picked * h)?,
            last_normed: b.zeros(picked * h)?,
            logits: b.zeros(picked * c.vocab_size)?,
            argmax: b.zeros(picked)?,
            top_ids: b.zeros(1)?,
            top_logp: b.zeros(1)?,
            split_logits: split
                .map(|shard| -> Result<SplitLogits<B>> {
                    let share = c.vocab_size / shard.world;
                    Ok(SplitLogits {
                        share: b.zeros(picked * share)?,
                        gathered: b.zeros(picked * c.vocab_size)?,
                        order: b.zeros(picked * shard.world)?,
                    })
                })
                .transpose()?,
        })
    }
}

/// The model: config, weights placed on its backend, and the backend.
pub struct Model<B: Backend = CpuBackend> {
    config: Config,
    /// Shared with a drafter, which embeds its block with the target's table.
    embed: Arc<B::Buf<bf16>>,
    layers: Vec<Layer<B>>,
    norm: Norm<B>,
    /// The head the logits come from: every row of the vocabulary, or with a vocabulary split
    /// (`vocab_split`) this rank's share. Shared with a drafter when whole.
    lm_head: Arc<B::Linear>,
    /// The group's place of this rank when lm_head holds only its share of the vocabulary (the ranks'
    /// logits are then gathered); `None` when it holds it all.
    vocab_split: Option<Shard>,
    /// The whole head for a drafter beside rank 0 of a vocabulary split.
    drafter_head: Option<Arc<B::Linear>>,
    rope: Rope,
    /// Attention heads this model holds: all of them, or its rank's share.
    heads: usize,
    /// The group whose sum completes each split block; `None` for a whole model.
    group: Option<Arc<dyn Collective<B>>>,
    /// The layers `layers` holds (all of them unless the model is a pipeline stage) and the stages it
    /// takes its rows from and hands them to.
    stage: StageLinks,
    scratch: Mutex<Option<Scratch<B>>>,
    graphs: Mutex<Graphs<B>>,
    /// Shared with a drafter: its work queues behind the target's on the same stream.
    backend: Arc<B>,
}

/// What a drafter takes from its target: the embedding table, lm_head and backend (ENGINE.md §8).
pub(super) struct SharedParts<B: Backend> {
    pub(super) embed: Arc<B::Buf<bf16>>,
    pub(super) lm_head: Arc<B::Linear>,
    pub(super) backend: Arc<B>,
}

/// The shape of a step that a recorded graph replays: everything its launches bake in.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
struct GraphKey {
    cache: u64,
    tokens: usize,
    decode_rows: usize,
    tree: Option<TreeRows>,
    picked: usize,
    max_seq_len: usize,
    tree_seq_len: usize,
    argmax: bool,
    topk: Option<usize>,
    /// Bit l: the step copies out layer l's hidden states.
    hidden: u64,
}

/// Recorded step graphs (CUDA) by shape, with the backend's plan epoch they were recorded at.
struct Graphs<B: Backend> {
    enabled: bool,
    recorded: HashMap<GraphKey, (u64, B::Graph)>,
    /// Graphs recorded since the model was made.
    captures: u64,
}

/// At most this many graphs are kept; recording one more clears them (a shape seen again is recorded again).
const MAX_GRAPHS: usize = 256;

/// Which positions of a forward call get results.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Logits {
    /// Every token of the call, in call order.
    All,
    /// The last token of each sequence in the call (sequences given no tokens get no row).
    Last,
}

/// A part of a step, for [`Model::profile_step`].
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Stage {
    /// RMSNorms, the MLA query and cache rows (RoPE), residual adds, SiLU·mul, bf16 copies, the
    /// embedding and the final row gather.
    Elementwise,
    /// The attention's dense projections: q (a, b or full), kv_a, the per-head absorption and value
    /// products, o_proj.
    Projections,
    /// The MLA attention kernels (decode and tree verify).
    Attention,
    /// The router, the routing and the INT4 routed experts.
    Moe,
    /// The shared expert's GEMMs.
    SharedExpert,
    /// A dense layer's MLP GEMMs.
    DenseMlp,
    /// The sums over the ranks of a split model.
    Communication,
    /// lm_head (and the argmax).
    LmHead,
}

/// The time of one stage of a profiled step.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct StageTime {
    /// The decoder layer, `None` before the first and after the last.
    pub layer: Option<usize>,
    /// The stage.
    pub stage: Stage,
    /// Backend time since the previous entry.
    pub time: std::time::Duration,
}

/// What a step computes besides the chosen rows' logits.
#[derive(Clone, Copy, Debug)]
struct Wanted<'a> {
    /// Their argmax.
    argmax: bool,
    /// Their `k` best tokens with log-probabilities.
    topk: Option<usize>,
    /// The hidden states of these layers.
    hidden: &'a [usize],
}

impl Wanted<'_> {
    const LOGITS: Wanted<'static> = Wanted { argmax: false, topk: None, hidden: &[] };
    const ARGMAX: Wanted<'static> = Wanted { argmax: true, topk: None, hidden: &[] };
}

/// The `k` best tokens of each chosen row of a step (see [`Model::step_topk`]).
#[derive(Clone, Debug, PartialEq)]
pub struct StepTopK {
    /// Tokens per row.
    pub k: usize,
    /// `[rows, k]` token ids, logit descending then id ascending (i32, as [`crate::types::TopK`]).
    pub ids: Vec<i32>,
    /// `[rows, k]` log-probabilities (`logit - logsumexp` of the row).
    pub logp: Vec<f32>,
}

/// Timing marks of a profiled step; off, every `lap` does nothing.
struct Laps<'a, B: Backend> {
    backend: &'a B,
    on: bool,
    layer: Option<usize>,
    marks: Vec<(Option<usize>, Stage, B::Mark)>,
}

impl<'a, B: Backend> Laps<'a, B> {
    fn off(backend: &'a B) -> Self {
        Laps { backend, on: false, layer: None, marks: Vec::new() }
    }

    /// Attributes the work queued since the previous lap to `stage`.
    fn lap(&mut self, stage: Stage) -> Result<()> {
        if self.on {
            self.marks.push((self.layer, stage, self.backend.mark()?));
        }
        Ok(())
    }
}

/// What [`Model::step_hidden`] returns.
#[derive(Clone, Debug, PartialEq)]
pub struct HiddenStep {
    /// The argmax token of each chosen row.
    pub argmax: Vec<u32>,
    /// `[rows, vocab]` logits of the chosen rows when asked for, else empty.
    pub logits: Vec<f32>,
    /// `[layers, tokens, hidden_size]`: every token of the step (in call order, chosen or not) after each
    /// layer asked for, in the order asked.
    pub hidden: Vec<f32>,
}

/// One sequence's part of a step ([`Model::step`]).
#[derive(Clone, Copy, Debug)]
pub struct StepRequest<'a> {
    /// The sequence's id in the cache.
    pub seq: usize,
    /// New tokens (a prefill chunk or a decode token), or a draft tree's node tokens, root first.
    pub tokens: &'a [u32],
    /// When set, `tokens` are tree rows: they are written past the sequence's cached length, attend to
    /// their ancestors only, and do not advance the sequence (the accept step compacts and commits).
    pub tree: Option<TreeInput<'a>>,
}

/// A draft tree's rows for [`StepRequest::tree`], as the tree build lays them out.
#[derive(Clone, Copy, Debug)]
pub struct TreeInput<'a> {
    /// Depth of each node (the root 0): row i sits at position `len + depth[i]` and cache slot `len + i`.
    pub depth: &'a [u32],
    /// `[N, ceil(N / 32)]` bits: row i attends to the tree rows whose bits are set (itself and its
    /// ancestors).
    pub visibility: &'a [u32],
}

/// One sequence's accepted path through its tree of the last step ([`KvCache::commit_trees`]).
#[derive(Clone, Copy, Debug)]
pub struct TreeCommit<'a> {
    /// The sequence's id in the cache.
    pub seq: usize,
    /// The accepted tree rows, root (row 0) first, each the child of the one before.
    pub rows: &'a [usize],
}

/// The tree part of a step: `shape` requests with their block tables, prefix lengths and visibility.
struct TreeStep {
    shape: TreeRows,
    block_tables: Vec<i32>,
    prefix: Vec<i32>,
    visibility: Vec<u32>,
    max_seq_len: usize,
}

/// A step's host-side plan: what is uploaded, and the rows to return. Rows are in request order; the
/// first `decode_rows` attend as decode rows, the rest are tree rows.
struct StepInputs {
    ids: Vec<i32>,
    positions: Vec<usize>,
    slot: Vec<i32>,
    block_tables: Vec<i32>,
    seq_len: Vec<i32>,
    max_seq_len: usize,
    decode_rows: usize,
    tree: Option<TreeStep>,
    pick: Vec<i32>,
}

impl Model<CpuBackend> {
    /// Loads `config.json` and the safetensors of a checkpoint directory, for the CPU backend.
    pub fn load(dir: impl AsRef<Path>) -> Result<Self> {
        Self::load_on(dir, CpuBackend)
    }
}

impl<B: Backend> Model<B> {
    /// Loads a checkpoint directory onto `backend` (e.g. [`crate::cuda::backend::CudaBackend`] with the
    /// `cuda` feature).
    pub fn load_on(dir: impl AsRef<Path>, backend: B) -> Result<Self> {
        let dir = dir.as_ref();
        let config = Config::from_file(dir.join("config.json"))?;
        let ckpt = Checkpoint::open(dir)?;
        Self::from_checkpoint(config, &ckpt, backend)
    }

    /// Builds the model from a checked config and an open checkpoint, placing every weight on `backend`.
    pub fn from_checkpoint(config: Config, ckpt: &Checkpoint, backend: B) -> Result<Self> {
        let stage = StageLinks::whole(config.num_hidden_layers);
        Self::from_checkpoint_in(config, ckpt, backend, None, stage)
    }

    /// Like [`Model::from_checkpoint`], but placing only the share of `group`'s rank (see
    /// [`crate::parallel`]): its attention heads, intermediate features and routed experts. Every rank
    /// of the group must run every step, at once ([`crate::parallel::ShardedModel`] does).
    pub fn from_checkpoint_sharded(
        config: Config,
        ckpt: &Checkpoint,
        backend: B,
        group: Arc<dyn Collective<B>>,
    ) -> Result<Self> {
        let stage = StageLinks::whole(config.num_hidden_layers);
        Self::from_checkpoint_in(config, ckpt, backend, Some(group), stage)
    }

    /// Like [`Model::from_checkpoint_sharded`], but placing only the layers of `stage`, a pipeline stage
    /// that takes its rows from the stage before and hands them to the stage after.
    pub(crate) fn from_checkpoint_stage(
        config: Config,
        ckpt: &Checkpoint,
        backend: B,
        group: Arc<dyn Collective<B>>,
        stage: StageLinks,
    ) -> Result<Self> {
        Self::from_checkpoint_in(config, ckpt, backend, Some(group), stage)
    }

    fn from_checkpoint_in(
        config: Config,
        ckpt: &Checkpoint,
        backend: B,
        group: Option<Arc<dyn Collective<B>>>,
        stage: StageLinks,
    ) -> Result<Self> {
        let c = &config;
        check_mla_dims(c)?;
        let shard = group.as_ref().map_or(Shard::WHOLE, |g| g.shard());
        check_split(c, shard)?;
        let bar = if ckpt.size_bytes() >= PROGRESS_BYTES {
            let bar = ProgressBar::new(stage.layers.len() as u64);
            if let Ok(style) = ProgressStyle::with_template("loading layers {bar:40} {pos}/{len} {elapsed}") {
                bar.set_style(style);
            }
            bar
        } else {
            ProgressBar::hidden()
        };
        let mut layers = Vec::with_capacity(stage.layers.len());
        for i in stage.layers.clone() {
            layers.push(load_layer(&backend, ckpt, c, &format!("model.layers.{i}"), i, shard)?);
            bar.inc(1);
        }
        bar.finish_and_clear();
        let (v, h) = (c.vocab_size, c.hidden_size);
        let embed = ckpt.bf16("model.embed_tokens.weight", &[v, h])?;
        let head_rows = if c.tie_word_embeddings { None } else { Some(ckpt.bf16("lm_head.weight", &[v, h])?) };
        let head_rows = head_rows.as_deref().unwrap_or(&embed);
        // A split group splits the vocabulary too when it divides evenly: each rank's logits GEMM reads a
        // share of the head, and the ranks' logits are gathered.
        let vocab_split = (shard.world > 1 && v.is_multiple_of(shard.world)).then_some(shard);
        let (lm_head, drafter_head) = match vocab_split {
            None => (backend.linear(head_rows, 1, v, h)?, None),
            Some(shard) => {
                let rows = shard.range("vocab_size", v)?;
                let share = backend.linear(&head_rows[rows.start * h..rows.end * h], 1, rows.len(), h)?;
                let whole = (shard.rank == 0).then(|| backend.linear(head_rows, 1, v, h)).transpose()?;
                (share, whole.map(Arc::new))
            }
        };
        let norm = layers::RmsNorm::load(ckpt, "model.norm.weight", h, c.rms_norm_eps)?;
        check_all_read(ckpt, c, &stage.layers)?;
        let embed = Arc::new(backend.upload(&embed)?);
        let norm = Norm::place(&backend, &norm)?;
        let mut model = Model::from_parts(config, embed, layers, norm, Arc::new(lm_head), Arc::new(backend), group)?;
        model.stage = stage;
        model.vocab_split = vocab_split;
        model.drafter_head = drafter_head;
        Ok(model)
    }

    /// A model of `config`'s shape with random weights made on `backend` (no checkpoint): every norm
    /// weight 1, the router bias 0, every other weight from [`Backend::random_linear`] (INT4-grid values),
    /// the routed experts from [`Backend::random_experts`]. For measuring the step at real dimensions; its
    /// outputs mean nothing.
    pub fn random(config: Config, backend: B, seed: u64) -> Result<Self> {
        let stage = StageLinks::whole(config.num_hidden_layers);
        Self::random_stage(config, backend, seed, None, stage)
    }

    /// Like [`Model::random`], but only the layers of `stage` (a pipeline stage), each of the shape of
    /// `group`'s rank's share (its heads, intermediate features, routed experts and vocabulary rows).
    pub(crate) fn random_stage(
        config: Config,
        backend: B,
        seed: u64,
        group: Option<Arc<dyn Collective<B>>>,
        stage: StageLinks,
    ) -> Result<Self> {
        let c = &config;
        check_mla_dims(c)?;
        let shard = group.as_ref().map_or(Shard::WHOLE, |g| g.shard());
        check_split(c, shard)?;
        let b = &backend;
        let world = shard.world;
        let (h, heads, nope, v) = (c.hidden_size, c.num_attention_heads / world, c.qk_nope_head_dim, c.v_head_dim);
        let experts = c.n_routed_experts / world;
        // Each weight its own seed, from a linear congruential sequence.
        let next = std::cell::Cell::new(seed);
        let seed = || {
            next.set(next.get().wrapping_mul(6_364_136_223_846_793_005).wrapping_add(1_442_695_040_888_963_407));
            next.get()
        };
        let ones = |dim: usize, eps: f64| -> Result<Norm<B>> {
            Ok(Norm { w: b.upload(&vec![1f32; dim])?, eps: eps as f32, dim })
        };
        let dense = |out: usize, inp: usize| -> Result<Dense<B>> {
            Ok(Dense { w: b.random_linear(1, out, inp, seed())?, out })
        };
        let mut layers = Vec::with_capacity(stage.layers.len());
        for i in stage.layers.clone() {
            let q_dim = heads * (nope + ROPE);
            let q = match c.q_lora_rank {
                None => Query::Full(dense(q_dim, h)?),
                Some(r) => Query::LowRank(dense(r, h)?, ones(r, 1e-6)?, dense(q_dim, r)?),
            };
            let attn = Attention {
                q,
                kv_a: dense(ROW, h)?.w,
                kv_a_norm: ones(LATENT, 1e-6)?,
                w_uk: b.random_linear(heads, LATENT, nope, seed())?,
                w_uv: b.random_linear(heads, v, LATENT, seed())?,
                o_proj: dense(h, heads * v)?.w,
            };
            let mlp = |inter: usize| -> Result<Mlp<B>> {
                Ok(Mlp { gate_up: dense(2 * inter, h)?.w, down: dense(h, inter)?.w, inter })
            };
            let ffn = if c.is_moe_layer(i) {
                let shared_inter = c.moe_intermediate_size * c.n_shared_experts / world;
                let shared = (c.n_shared_experts > 0).then(|| mlp(shared_inter)).transpose()?;
                FeedForward::Moe(Box::new(Moe {
                    router: dense(c.n_routed_experts, h)?.w,
                    bias: b.zeros(c.n_routed_experts)?,
                    experts: b.random_experts(experts, h, c.moe_intermediate_size, seed())?,
                    share: ExpertShare { first: shard.rank * experts, total: c.n_routed_experts },
                    shared,
                    top_k: c.num_experts_per_tok,
                    scaling: c.routed_scaling_factor,
                }))
            } else {
                FeedForward::Dense(mlp(c.intermediate_size / world)?)
            };
            let norm = ones(h, c.rms_norm_eps)?;
            layers.push(Layer { input_norm: norm, attn, post_attn_norm: ones(h, c.rms_norm_eps)?, ffn });
        }
        let embed = Arc::new(b.random_table(c.vocab_size, h, seed())?);
        let vocab_split = (world > 1 && c.vocab_size.is_multiple_of(world)).then_some(shard);
        let head_rows = if vocab_split.is_some() { c.vocab_size / world } else { c.vocab_size };
        let lm_head = Arc::new(b.random_linear(1, head_rows, h, seed())?);
        let norm = ones(h, c.rms_norm_eps)?;
        let mut model = Model::from_parts(config, embed, layers, norm, lm_head, Arc::new(backend), group)?;
        model.stage = stage;
        model.vocab_split = vocab_split;
        Ok(model)
    }

    /// The model of `config` from weights already on `backend`: the share of `group`'s rank, or whole.
    pub(super) fn from_parts(
        config: Config,
        embed: Arc<B::Buf<bf16>>,
        layers: Vec<Layer<B>>,
        norm: Norm<B>,
        lm_head: Arc<B::Linear>,
        backend: Arc<B>,
        group: Option<Arc<dyn Collective<B>>>,
    ) -> Result<Self> {
        let world = group.as_ref().map_or(1, |g| g.shard().world);
        Ok(Model {
            heads: config.num_attention_heads / world,
            vocab_split: None,
            drafter_head: None,
            group,
            stage: StageLinks::whole(layers.len()),
            embed,
            layers,
            norm,
            lm_head,
            rope: Rope::new(&config)?,
            config,
            scratch: Mutex::new(None),
            graphs: Mutex::new(Graphs { enabled: true, recorded: HashMap::new(), captures: 0 }),
            backend,
        })
    }

    /// The model's configuration.
    pub fn config(&self) -> &Config {
        &self.config
    }

    /// The backend it runs on.
    pub fn backend(&self) -> &B {
        &self.backend
    }

    /// Recorded step graphs currently kept.
    pub fn recorded_graphs(&self) -> usize {
        self.graphs.lock().unwrap_or_else(PoisonError::into_inner).recorded.len()
    }

    /// Step graphs recorded since the model was made (each costs a step run op by op and a capture).
    pub fn graph_captures(&self) -> u64 {
        self.graphs.lock().unwrap_or_else(PoisonError::into_inner).captures
    }

    /// Turns the replay of recorded steps on or off (on by default; the CPU backend records none). With
    /// graphs on, a step whose requests are all decode tokens or trees is recorded the first time its
    /// shape is seen (batch, tree shape, rows returned, cache, sequence-length bucket) and replayed
    /// after, with the same bits as running it op by op.
    pub fn set_graphs(&self, enabled: bool) {
        let mut g = self.graphs.lock().unwrap_or_else(PoisonError::into_inner);
        g.enabled = enabled;
        g.recorded.clear();
    }

    /// A KV cache for this model on its backend: `num_pages` pages of `page_size` slots per layer, at most
    /// `max_seq_len` slots per sequence.
    pub fn new_cache(&self, num_pages: usize, page_size: usize, max_seq_len: usize) -> Result<KvCache<B>> {
        KvCache::new(&*self.backend, self.layers.len(), num_pages, page_size, max_seq_len)
    }

    /// Runs `batch` (sequence id in `cache`, its new tokens) one step: appends the tokens' latent rows to
    /// the cache and returns `[rows, vocab]` float32 logits for the positions `which` asks for.
    pub fn forward(&self, cache: &mut KvCache<B>, batch: &[(usize, &[u32])], which: Logits) -> Result<Vec<f32>> {
        self.step(cache, &plain_requests(batch), which)
    }

    /// Runs one step of any mix of prefill chunks, decode tokens and draft trees (tree requests after
    /// every other request; every tree of a step has the same number of rows) and returns `[rows, vocab]`
    /// logits: with [`Logits::Last`] the last row of each prefill or decode request and every row of each
    /// tree, with [`Logits::All`] every row, in request order.
    pub fn step(&self, cache: &mut KvCache<B>, requests: &[StepRequest], which: Logits) -> Result<Vec<f32>> {
        self.check_not_staged()?;
        self.stage_step(cache, requests, which)
    }

    /// [`Model::step`] of a pipeline stage: empty unless the stage is the last.
    pub(crate) fn stage_step(
        &self,
        cache: &mut KvCache<B>,
        requests: &[StepRequest],
        which: Logits,
    ) -> Result<Vec<f32>> {
        let vocab = self.config.vocab_size;
        self.run_step(cache, requests, which, Wanted::LOGITS, &mut Laps::off(&*self.backend), |b, s, rows, last| {
            read_if_last(b, &s.logits, rows * vocab, last)
        })
    }

    /// Like [`Model::step`], but returns only the argmax token of each chosen row, computed where the
    /// backend lives.
    pub fn step_argmax(&self, cache: &mut KvCache<B>, requests: &[StepRequest], which: Logits) -> Result<Vec<u32>> {
        self.check_not_staged()?;
        self.stage_step_argmax(cache, requests, which)
    }

    /// [`Model::step_argmax`] of a pipeline stage: empty unless the stage is the last.
    pub(crate) fn stage_step_argmax(
        &self,
        cache: &mut KvCache<B>,
        requests: &[StepRequest],
        which: Logits,
    ) -> Result<Vec<u32>> {
        let mut laps = Laps::off(&*self.backend);
        let ids = self.run_step(cache, requests, which, Wanted::ARGMAX, &mut laps, |b, s, rows, last| {
            read_if_last(b, &s.argmax, rows, last)
        })?;
        Ok(ids.into_iter().map(|t| t as u32).collect())
    }

    /// Like [`Model::step`], but returns only the `k` best tokens of each chosen row with their
    /// log-probabilities, computed where the backend lives (the bits of [`crate::cpu::topk`]).
    pub fn step_topk(
        &self,
        cache: &mut KvCache<B>,
        requests: &[StepRequest],
        which: Logits,
        k: usize,
    ) -> Result<StepTopK> {
        let vocab = self.config.vocab_size;
        if k == 0 || k > vocab {
            return Err(Error::param("k", k, format!("must be in 1..={vocab} (the vocabulary)")));
        }
        self.check_not_staged()?;
        let wanted = Wanted { argmax: false, topk: Some(k), hidden: &[] };
        self.run_step(cache, requests, which, wanted, &mut Laps::off(&*self.backend), |b, s, rows, _| {
            Ok(StepTopK { k, ids: b.read(&s.top_ids, rows * k)?, logp: b.read(&s.top_logp, rows * k)? })
        })
    }

    /// Like [`Model::step_argmax`] (and [`Model::step`] when `logits` is set), and also returns every
    /// token's hidden state after each layer of `layers` (the residual stream leaving the layer, what a
    /// DFlash drafter reads as context features).
    pub fn step_hidden(
        &self,
        cache: &mut KvCache<B>,
        requests: &[StepRequest],
        which: Logits,
        layers: &[usize],
        logits: bool,
    ) -> Result<HiddenStep> {
        self.check_not_staged()?;
        self.stage_step_hidden(cache, requests, which, layers, logits)
    }

    /// [`Model::step_hidden`] of a pipeline stage: the hidden states of the layers asked for that the
    /// stage holds, in the order asked, and argmax and logits only from the last stage.
    pub(crate) fn stage_step_hidden(
        &self,
        cache: &mut KvCache<B>,
        requests: &[StepRequest],
        which: Logits,
        layers: &[usize],
        logits: bool,
    ) -> Result<HiddenStep> {
        let (h, vocab) = (self.config.hidden_size, self.config.vocab_size);
        let tokens: usize = requests.iter().map(|r| r.tokens.len()).sum();
        let held = self.held_layers(layers).len();
        let mut laps = Laps::off(&*self.backend);
        let wanted = Wanted { argmax: true, topk: None, hidden: layers };
        self.run_step(cache, requests, which, wanted, &mut laps, |b, s, rows, last| {
            let mut hidden = Vec::with_capacity(held * tokens * h);
            for buf in &s.hidden[..held] {
                hidden.extend(b.read(buf, tokens * h)?);
            }
            Ok(HiddenStep {
                argmax: if last {
                    b.read(&s.argmax, rows)?.into_iter().map(|t| t as u32).collect()
                } else {
                    Vec::new()
                },
                logits: if last && logits { b.read(&s.logits, rows * vocab)? } else { Vec::new() },
                hidden,
            })
        })
    }

    /// The layers of `layers` this model holds, in the order given.
    fn held_layers(&self, layers: &[usize]) -> Vec<usize> {
        layers.iter().copied().filter(|l| self.stage.layers.contains(l)).collect()
    }

    /// An error for a pipeline stage stepped on its own: it would wait for the stage before it forever,
    /// or compute no logits.
    fn check_not_staged(&self) -> Result<()> {
        if self.stage.from_previous.is_some() || self.stage.to_next.is_some() {
            return Err(Error::param(
                "model",
                format!("layers {:?}", self.stage.layers),
                "a pipeline stage steps only with the others, through ShardedModel",
            ));
        }
        Ok(())
    }

    /// Runs one step like [`Model::step_argmax`], op by op (never from a recorded graph), and returns the
    /// time each stage of it took on the backend, in order: each entry is the work queued since the
    /// previous one (on CUDA, measured between events, so launch gaps count to the stage after them).
    pub fn profile_step(
        &self,
        cache: &mut KvCache<B>,
        requests: &[StepRequest],
        which: Logits,
    ) -> Result<Vec<StageTime>> {
        self.check_not_staged()?;
        self.stage_profile_step(cache, requests, which)
    }

    /// [`Model::profile_step`] of a pipeline stage: the times of its own layers (and of the embedding or
    /// lm_head where it runs them).
    pub(crate) fn stage_profile_step(
        &self,
        cache: &mut KvCache<B>,
        requests: &[StepRequest],
        which: Logits,
    ) -> Result<Vec<StageTime>> {
        let mut laps = Laps {
            backend: &*self.backend,
            on: true,
            layer: None,
            marks: vec![(None, Stage::Elementwise, self.backend.mark()?)],
        };
        self.run_step(cache, requests, which, Wanted::ARGMAX, &mut laps, |_, _, _, _| Ok(()))?;
        let b = &*self.backend;
        laps.marks
            .windows(2)
            .map(|w| Ok(StageTime { layer: w[1].0, stage: w[1].1, time: b.elapsed(&w[0].2, &w[1].2)? }))
            .collect()
    }

    /// Writes every layer's latent cache rows of `x` (`[tokens, hidden]` f32 on the backend) at the next
    /// slots of the sequences of `rows` (`(sequence, tokens)`, in the order of `x`'s rows) and commits
    /// them: kv_a, the latent RMSNorm and RoPE at the slots' positions, as a step writes its tokens' rows
    /// but with no query. A drafter's context K/V enter attention this way (ENGINE.md §8). `table`,
    /// `slot` and `kv` are scratch of at least `tokens` rows.
    pub(super) fn write_context(
        &self,
        cache: &mut KvCache<B>,
        rows: &[(usize, usize)],
        x: &B::Buf<f32>,
        table: &mut B::Buf<f32>,
        slot: &mut B::Buf<i32>,
        kv: &mut B::Buf<f32>,
    ) -> Result<()> {
        for (i, &(seq, n)) in rows.iter().enumerate() {
            if rows[..i].iter().any(|o| o.0 == seq) {
                return Err(Error::param("context rows", seq, "a sequence may appear only once per write"));
            }
            let start = cache.len(seq)?;
            cache.reserve(seq, start + n)?;
        }
        let (mut positions, mut slots) = (Vec::new(), Vec::new());
        for &(seq, n) in rows {
            let (start, table) = (cache.len(seq)?, cache.block_table(seq)?);
            for p in start..start + n {
                positions.push(p);
                slots.push(cache.slot_row(&table, p)?);
            }
        }
        let t = positions.len();
        if t == 0 {
            return Ok(());
        }
        let b = &*self.backend;
        b.write(&self.rope.table(&positions), table)?;
        b.write(&slots, slot)?;
        for (l, layer) in self.layers.iter().enumerate() {
            let w = &layer.attn;
            b.matmul(&w.kv_a, x, t, kv)?;
            let write = KvWrite {
                kv: &*kv,
                norm_w: &w.kv_a_norm.w,
                eps: w.kv_a_norm.eps,
                table: &*table,
                interleave: self.rope.interleave(),
                slot: &*slot,
            };
            b.kv_rows(&write, t, &mut cache.storage[l])?;
        }
        for &(seq, n) in rows {
            cache.extend(seq, n);
        }
        Ok(())
    }

    /// The parts a drafter of this target shares with it; an error for a rank that holds only a share of
    /// lm_head and no whole copy (a drafter sits beside rank 0).
    pub(super) fn shared_parts(&self) -> Result<SharedParts<B>> {
        let lm_head = match (&self.vocab_split, &self.drafter_head) {
            (None, _) => self.lm_head.clone(),
            (Some(_), Some(whole)) => whole.clone(),
            (Some(shard), None) => {
                return Err(Error::param(
                    "target",
                    format!("rank {} of {}", shard.rank, shard.world),
                    "a drafter sits beside rank 0, the one rank of a vocabulary split with the whole lm_head",
                ))
            }
        };
        Ok(SharedParts { embed: self.embed.clone(), lm_head, backend: self.backend.clone() })
    }

    /// Like [`Model::forward`], but returns only the argmax token of each chosen row, computed where the
    /// backend lives (one small read-back instead of the logits).
    pub fn forward_argmax(&self, cache: &mut KvCache<B>, batch: &[(usize, &[u32])], which: Logits) -> Result<Vec<u32>> {
        self.step_argmax(cache, &plain_requests(batch), which)
    }

    /// One step up to the chosen rows' logits (and their argmax) in the scratch, then `finish` reads what
    /// the caller wants.
    fn run_step<T>(
        &self,
        cache: &mut KvCache<B>,
        requests: &[StepRequest],
        which: Logits,
        wanted: Wanted,
        laps: &mut Laps<B>,
        finish: impl FnOnce(&B, &Scratch<B>, usize, bool) -> Result<T>,
    ) -> Result<T> {
        let layers = self.config.num_hidden_layers;
        for (i, &l) in wanted.hidden.iter().enumerate() {
            if l >= layers || wanted.hidden[..i].contains(&l) {
                return Err(Error::param(
                    "hidden layers",
                    format!("{:?}", wanted.hidden),
                    format!("distinct layers in 0..{layers}"),
                ));
            }
        }
        let held = self.held_layers(wanted.hidden);
        let wanted = Wanted { hidden: &held, ..wanted };
        let Wanted { argmax, topk, hidden } = wanted;
        let inputs = self.plan_step(cache, requests, which)?;
        let b = &*self.backend;
        let (tokens, picked) = (inputs.ids.len(), inputs.pick.len());
        let mut guard = self.scratch.lock().unwrap_or_else(PoisonError::into_inner);
        let mut graphs = self.graphs.lock().unwrap_or_else(PoisonError::into_inner);
        if !guard.as_ref().is_some_and(|s| s.tokens >= tokens && s.picked >= picked) {
            let (t, p) = guard.as_ref().map_or((tokens, picked), |s| (s.tokens.max(tokens), s.picked.max(picked)));
            graphs.recorded.clear(); // they hold the old buffers' addresses
            *guard = None; // free the old buffers before allocating the new ones
            let (heads, split) = (self.heads, self.vocab_split);
            *guard =
                Some(Scratch::new(b, &self.config, (heads, split), cache.layout.pages_per_req, t.max(1), p.max(1))?);
        }
        let s = guard.as_mut().expect("made above");
        while s.hidden.len() < hidden.len() {
            s.hidden.push(b.zeros(s.tokens * self.config.hidden_size)?);
        }
        if let Some(k) = topk.filter(|&k| b.len(&s.top_ids) < s.picked * k) {
            graphs.recorded.clear(); // they hold the old buffers' addresses
            s.top_ids = b.zeros(s.picked * k)?;
            s.top_logp = b.zeros(s.picked * k)?;
        }
        self.upload_inputs(s, &inputs)?;
        if let Some(previous) = &self.stage.from_previous {
            let rows = previous.receive()?;
            check_len(
                "rows from the previous stage",
                rows.len(),
                &[("tokens", tokens), ("hidden", self.config.hidden_size)],
            )?;
            b.write(&rows, &mut s.x)?;
        }
        let graphable = requests.iter().all(|r| r.tree.is_some() || r.tokens.len() == 1);
        let hidden_mask = hidden.iter().try_fold(0u64, |m, &l| (l < 64).then(|| m | 1 << l));
        let key = (graphs.enabled && graphable && !laps.on && hidden_mask.is_some()).then(|| GraphKey {
            cache: cache.id,
            tokens,
            decode_rows: inputs.decode_rows,
            tree: inputs.tree.as_ref().map(|t| t.shape),
            picked,
            max_seq_len: inputs.max_seq_len,
            tree_seq_len: inputs.tree.as_ref().map_or(0, |t| t.max_seq_len),
            argmax,
            topk,
            hidden: hidden_mask.unwrap_or(0),
        });
        let epoch = self.plan_epoch();
        match key.and_then(|k| graphs.recorded.get(&k)).filter(|(e, _)| *e == epoch) {
            Some((_, graph)) => b.replay(graph)?,
            None => {
                self.record(cache, &inputs, s, wanted, laps)?;
                if let Some(key) = key {
                    let graph = b.capture(&mut || self.record(cache, &inputs, s, wanted, &mut Laps::off(b)))?;
                    if graphs.recorded.len() >= MAX_GRAPHS {
                        graphs.recorded.clear();
                    }
                    // A plan that grew while recording would leave the graph with stale addresses.
                    if let Some(graph) = graph.filter(|_| self.plan_epoch() == epoch) {
                        graphs.captures += 1;
                        graphs.recorded.insert(key, (epoch, graph));
                    }
                }
            }
        }
        cache.advance(requests);
        if let Some(next) = &self.stage.to_next {
            next.send(b.read(&s.x, tokens * self.config.hidden_size)?)?;
        }
        b.fetch_status()?;
        let result = finish(b, s, picked, self.stage.is_last())?;
        b.check()?;
        Ok(result)
    }

    /// Queues every operation of a step whose inputs are in the scratch: the layers, the final norm of the
    /// chosen rows, lm_head, and what `wanted` asks of them (argmax, top-K, hidden states).
    fn record(
        &self,
        cache: &mut KvCache<B>,
        inputs: &StepInputs,
        s: &mut Scratch<B>,
        wanted: Wanted,
        laps: &mut Laps<B>,
    ) -> Result<()> {
        let Wanted { argmax, topk, hidden } = wanted;
        let b = &*self.backend;
        let (tokens, picked) = (inputs.ids.len(), inputs.pick.len());
        let h = self.config.hidden_size;
        if self.stage.from_previous.is_none() {
            b.embed(&self.embed, h, &s.ids, tokens, &mut s.x)?;
            laps.lap(Stage::Elementwise)?;
        }
        for (local, layer) in self.layers.iter().enumerate() {
            let l = self.stage.layers.start + local;
            laps.layer = Some(l);
            layer.input_norm.run(b, &s.x, tokens, &mut s.normed)?;
            laps.lap(Stage::Elementwise)?;
            self.attention(layer, &mut cache.storage[local], cache.layout, inputs, s, laps)?;
            self.sum_over_ranks(&mut s.out, tokens * h, laps)?;
            b.add(&mut s.x, &s.out, tokens * h)?;
            layer.post_attn_norm.run(b, &s.x, tokens, &mut s.normed)?;
            laps.lap(Stage::Elementwise)?;
            self.feed_forward(&layer.ffn, tokens, s, laps)?;
            self.sum_over_ranks(&mut s.out, tokens * h, laps)?;
            b.add(&mut s.x, &s.out, tokens * h)?;
            if let Some(k) = hidden.iter().position(|&want| want == l) {
                b.gather(&s.x, h, tokens, &s.every, tokens, &mut s.hidden[k])?;
            }
            laps.lap(Stage::Elementwise)?;
        }
        laps.layer = None;
        if !self.stage.is_last() {
            return Ok(());
        }
        b.gather(&s.x, h, tokens, &s.pick, picked, &mut s.last)?;
        self.norm.run(b, &s.last, picked, &mut s.last_normed)?;
        laps.lap(Stage::Elementwise)?;
        self.logits(s, picked, laps)?;
        if argmax {
            b.argmax(&s.logits, self.config.vocab_size, picked, &mut s.argmax)?;
        }
        if let Some(k) = topk {
            b.topk(&s.logits, self.config.vocab_size, picked, k, &mut s.top_ids, &mut s.top_logp)?;
        }
        laps.lap(Stage::LmHead)
    }

    /// Checks a step's requests against the model and `cache` and reserves their cache pages; an error
    /// leaves every cache row as it was.
    pub(crate) fn check_step(&self, cache: &mut KvCache<B>, requests: &[StepRequest]) -> Result<()> {
        if cache.storage.len() != self.layers.len() {
            return Err(Error::param(
                "cache",
                format!("{} layers", cache.storage.len()),
                format!("this model holds {} layers: a cache from its own new_cache", self.layers.len()),
            ));
        }
        check_requests(requests, self.config.vocab_size)?;
        for r in requests {
            let start = cache.len(r.seq)?;
            cache.reserve(r.seq, start + r.tokens.len())?;
        }
        Ok(())
    }

    /// lm_head on the chosen rows into `s.logits`: directly, or with a vocabulary split this rank's share
    /// gathered with every other rank's and laid out row by row.
    fn logits(&self, s: &mut Scratch<B>, picked: usize, laps: &mut Laps<B>) -> Result<()> {
        let b = &*self.backend;
        let (Some(shard), Some(group), Some(split)) = (self.vocab_split, &self.group, s.split_logits.as_mut()) else {
            return b.matmul(&self.lm_head, &s.last_normed, picked, &mut s.logits);
        };
        let share = self.config.vocab_size / shard.world;
        b.matmul(&self.lm_head, &s.last_normed, picked, &mut split.share)?;
        laps.lap(Stage::LmHead)?;
        group.all_gather(b, &split.share, picked * share, &mut split.gathered)?;
        laps.lap(Stage::Communication)?;
        let rows = picked * shard.world;
        b.gather(&split.gathered, share, rows, &split.order, rows, &mut s.logits)
    }

    /// Checks the requests, reserves their cache pages (an error here leaves every cache row as it was)
    /// and lays out the step's inputs.
    fn plan_step(&self, cache: &mut KvCache<B>, requests: &[StepRequest], which: Logits) -> Result<StepInputs> {
        self.check_step(cache, requests)?;
        let mut x = StepInputs {
            ids: Vec::new(),
            positions: Vec::new(),
            slot: Vec::new(),
            block_tables: Vec::new(),
            seq_len: Vec::new(),
            max_seq_len: 0,
            decode_rows: 0,
            tree: None,
            pick: Vec::new(),
        };
        for r in requests {
            let start = cache.len(r.seq)?;
            let table = cache.block_table(r.seq)?;
            for (j, &id) in r.tokens.iter().enumerate() {
                let pos = start + r.tree.map_or(j, |t| t.depth[j] as usize);
                x.ids.push(id as i32);
                x.positions.push(pos);
                x.slot.push(cache.slot_row(&table, start + j)?);
                if which == Logits::All || r.tree.is_some() {
                    x.pick.push(x.ids.len() as i32 - 1);
                }
            }
            if which == Logits::Last && r.tree.is_none() && !r.tokens.is_empty() {
                x.pick.push(x.ids.len() as i32 - 1);
            }
            match r.tree {
                None => {
                    for j in 0..r.tokens.len() {
                        x.block_tables.extend_from_slice(&table);
                        x.seq_len.push((start + j) as i32 + 1);
                        x.max_seq_len = x.max_seq_len.max(start + j + 1);
                    }
                    x.decode_rows += r.tokens.len();
                }
                Some(tree) => {
                    let n_rows = r.tokens.len();
                    let t = x.tree.get_or_insert_with(|| TreeStep {
                        shape: TreeRows { bs: 0, n_rows },
                        block_tables: Vec::new(),
                        prefix: Vec::new(),
                        visibility: Vec::new(),
                        max_seq_len: 0,
                    });
                    t.shape.bs += 1;
                    t.block_tables.extend_from_slice(&table);
                    t.prefix.push(start as i32);
                    t.visibility.extend_from_slice(tree.visibility);
                    t.max_seq_len = t.max_seq_len.max(start + n_rows);
                }
            }
        }
        if x.ids.is_empty() {
            return Err(Error::param("batch", 0, "a step needs at least one token"));
        }
        // The attention launches are sized by these bounds, their results are not: rounding them up to a
        // power of two lets one recorded step serve many sequence lengths.
        let limit = cache.layout.pages_per_req * cache.layout.page_size;
        x.max_seq_len = seq_bucket(x.max_seq_len, limit);
        if let Some(tree) = &mut x.tree {
            tree.max_seq_len = seq_bucket(tree.max_seq_len, limit);
        }
        Ok(x)
    }

    fn upload_inputs(&self, s: &mut Scratch<B>, x: &StepInputs) -> Result<()> {
        let b = &*self.backend;
        b.write(&x.ids, &mut s.ids)?;
        b.write(&self.rope.table(&x.positions), &mut s.table)?;
        b.write(&x.slot, &mut s.slot)?;
        b.write(&x.block_tables, &mut s.block_tables)?;
        b.write(&x.seq_len, &mut s.seq_len)?;
        if let Some(tree) = &x.tree {
            b.write(&tree.block_tables, &mut s.tree_tables)?;
            b.write(&tree.prefix, &mut s.tree_prefix)?;
            b.write(&tree.visibility, &mut s.visibility)?;
        }
        if let (Some(shard), Some(split)) = (self.vocab_split, s.split_logits.as_mut()) {
            let picked = x.pick.len();
            let order: Vec<i32> =
                (0..picked).flat_map(|r| (0..shard.world).map(move |k| (k * picked + r) as i32)).collect();
            b.write(&order, &mut split.order)?;
        }
        b.write(&x.pick, &mut s.pick)
    }

    /// MLA of one layer on `s.normed`: writes the tokens' cache rows, attends each token over its
    /// sequence's slots up to its own, leaves `o_proj`'s output in `s.out`.
    fn attention(
        &self,
        layer: &Layer<B>,
        cache: &mut B::Buf<bf16>,
        layout: KvLayout,
        x: &StepInputs,
        s: &mut Scratch<B>,
        laps: &mut Laps<B>,
    ) -> Result<()> {
        let (b, c, w) = (&*self.backend, &self.config, &layer.attn);
        let (t, heads, nope, v) = (x.ids.len(), self.heads, c.qk_nope_head_dim, c.v_head_dim);
        b.matmul(&w.kv_a, &s.normed, t, &mut s.kv)?;
        laps.lap(Stage::Projections)?;
        let write = KvWrite {
            kv: &s.kv,
            norm_w: &w.kv_a_norm.w,
            eps: w.kv_a_norm.eps,
            table: &s.table,
            interleave: self.rope.interleave(),
            slot: &s.slot,
        };
        b.kv_rows(&write, t, cache)?;
        laps.lap(Stage::Elementwise)?;
        match &w.q {
            Query::Full(q) => b.matmul(&q.w, &s.normed, t, &mut s.q)?,
            Query::LowRank(a, norm, q) => {
                b.matmul(&a.w, &s.normed, t, &mut s.q_a)?;
                laps.lap(Stage::Projections)?;
                b.rmsnorm(&s.q_a, a.out, &norm.w, norm.eps, t, &mut s.q_a_normed, a.out)?;
                laps.lap(Stage::Elementwise)?;
                b.matmul(&q.w, &s.q_a_normed, t, &mut s.q)?;
            }
        }
        let q_width = nope + ROPE;
        let q_strides = HeadStrides { row: heads * q_width, head: q_width };
        let latent_strides = HeadStrides { row: heads * LATENT, head: LATENT };
        b.matmul_heads(&w.w_uk, &s.q, q_strides, t, &mut s.q_latent, latent_strides)?;
        laps.lap(Stage::Projections)?;
        let shape = QueryShape { heads, nope };
        b.q_rows(&s.q_latent, &s.q, shape, &s.table, t, self.rope.interleave(), &mut s.q_rows)?;
        laps.lap(Stage::Elementwise)?;
        let scale = c.softmax_scale() as f32;
        if x.decode_rows > 0 {
            let inputs = AttentionInputs {
                cache: &*cache,
                layout,
                block_tables: &s.block_tables,
                seq_len: &s.seq_len,
                max_seq_len: x.max_seq_len,
            };
            b.attention(&s.q_rows, heads, 0, x.decode_rows, &inputs, scale, &mut s.o, &mut s.lse)?;
        }
        if let Some(tree) = &x.tree {
            let inputs = AttentionInputs {
                cache: &*cache,
                layout,
                block_tables: &s.tree_tables,
                seq_len: &s.tree_prefix,
                max_seq_len: tree.max_seq_len,
            };
            let first = x.decode_rows;
            b.tree_attention(&s.q_rows, heads, first, tree.shape, &inputs, &s.visibility, scale, &mut s.o, &mut s.lse)?;
        }
        laps.lap(Stage::Attention)?;
        let value_strides = HeadStrides { row: heads * v, head: v };
        b.matmul_heads(&w.w_uv, &s.o, latent_strides, t, &mut s.values, value_strides)?;
        b.matmul(&w.o_proj, &s.values, t, &mut s.out)?;
        laps.lap(Stage::Projections)
    }

    /// Completes a split block's output `x[..n]` (this rank's partial sum) with the other ranks'; nothing
    /// to do for a whole model or a group of one rank (a pipeline stage of one rank).
    fn sum_over_ranks(&self, x: &mut B::Buf<f32>, n: usize, laps: &mut Laps<B>) -> Result<()> {
        match &self.group {
            Some(group) if group.shard().world > 1 => {
                group.all_reduce(&self.backend, x, n)?;
                laps.lap(Stage::Communication)
            }
            _ => Ok(()),
        }
    }

    /// The backend's plan epoch, and the group's: a recorded graph is stale when either changed.
    fn plan_epoch(&self) -> u64 {
        self.backend.plan_epoch().wrapping_add(self.group.as_ref().map_or(0, |g| g.epoch() << 32))
    }

    /// Aborts the collectives of this model's group ([`Collective::abort`]).
    pub(crate) fn abort_group(&self) {
        if let Some(g) = &self.group {
            g.abort();
        }
    }

    /// Readies this model's group after an aborted step ([`Collective::reset`]).
    pub(crate) fn reset_group(&self) {
        if let Some(g) = &self.group {
            g.reset();
        }
    }

    /// The feed-forward block on `s.normed` into `s.out`.
    fn feed_forward(&self, ffn: &FeedForward<B>, t: usize, s: &mut Scratch<B>, laps: &mut Laps<B>) -> Result<()> {
        let b = &*self.backend;
        let h = self.config.hidden_size;
        match ffn {
            FeedForward::Dense(mlp) => self.mlp(mlp, t, s, false, laps),
            FeedForward::Moe(moe) => {
                b.to_bf16(&s.normed, t * h, &mut s.x16)?;
                laps.lap(Stage::Elementwise)?;
                b.matmul(&moe.router, &s.normed, t, &mut s.router)?;
                b.moe(&s.router, &moe.bias, moe.top_k, moe.scaling, &s.x16, &moe.experts, moe.share, t, &mut s.out)?;
                laps.lap(Stage::Moe)?;
                match &moe.shared {
                    Some(shared) => {
                        self.mlp(shared, t, s, true, laps)?;
                        b.add(&mut s.out, &s.shared_out, t * h)
                    }
                    None => Ok(()),
                }
            }
        }
    }

    /// The gated MLP on `s.normed`, into `s.out` (or `s.shared_out` for the shared expert).
    fn mlp(&self, mlp: &Mlp<B>, t: usize, s: &mut Scratch<B>, shared: bool, laps: &mut Laps<B>) -> Result<()> {
        let b = &*self.backend;
        let stage = if shared { Stage::SharedExpert } else { Stage::DenseMlp };
        b.matmul(&mlp.gate_up, &s.normed, t, &mut s.gate_up)?;
        laps.lap(stage)?;
        b.silu_mul(&s.gate_up, mlp.inter, t, &mut s.act)?;
        laps.lap(Stage::Elementwise)?;
        let out = if shared { &mut s.shared_out } else { &mut s.out };
        b.matmul(&mlp.down, &s.act, t, out)?;
        laps.lap(stage)
    }
}

/// Every tensor of the checkpoint was read, except those of its multi-token-prediction layers and of the
/// layers outside `held` (another pipeline stage's); else an error naming the unused ones (and saying so
/// when they belong to layers past `num_hidden_layers`).
fn check_all_read(ckpt: &Checkpoint, c: &Config, held: &Range<usize>) -> Result<()> {
    let layer_of = |name: &str| name.strip_prefix("model.layers.")?.split('.').next()?.parse::<usize>().ok();
    let mtp = c.num_hidden_layers..c.num_hidden_layers + c.num_nextn_predict_layers;
    // Another stage's layers are that stage's to read.
    let skipped = |l: usize| mtp.contains(&l) || (l < c.num_hidden_layers && !held.contains(&l));
    let unused: Vec<String> = ckpt.unread().into_iter().filter(|n| !layer_of(n).is_some_and(skipped)).collect();
    if unused.is_empty() {
        return Ok(());
    }
    let shown: Vec<String> = unused.iter().take(4).map(|n| format!("`{n}`")).collect();
    let more = if unused.len() > 4 { format!(" and {} more", unused.len() - 4) } else { String::new() };
    let layers = if unused.iter().any(|n| layer_of(n).is_some_and(|l| l >= c.num_hidden_layers)) {
        format!("; the checkpoint has layers past num_hidden_layers = {}", c.num_hidden_layers)
    } else {
        String::new()
    };
    Err(Error::Data {
        path: ckpt.dir().to_path_buf(),
        detail: format!("{} tensors the config does not use: {}{more}{layers}", unused.len(), shown.join(", ")),
    })
}

/// `buf[..len]` on the last pipeline stage (the only one whose outputs are the model's), else nothing.
fn read_if_last<B: Backend, T: crate::model::backend::Elem>(
    b: &B,
    buf: &B::Buf<T>,
    len: usize,
    last: bool,
) -> Result<Vec<T>> {
    if last {
        b.read(buf, len)
    } else {
        Ok(Vec::new())
    }
}

/// The latent and rotary widths the MLA kernels are built for.
fn check_mla_dims(c: &Config) -> Result<()> {
    if c.qk_rope_head_dim != ROPE || c.kv_lora_rank != LATENT {
        return Err(Error::param("kv_lora_rank / qk_rope_head_dim", c.kv_lora_rank, "the MLA kernels need 512 / 64"));
    }
    Ok(())
}

/// `len` rounded up to a power of two of at least [`crate::cpu::mla::SPLIT`], at most `limit` (and never
/// below `len`).
fn seq_bucket(len: usize, limit: usize) -> usize {
    len.max(crate::cpu::mla::SPLIT).next_power_of_two().min(limit).max(len)
}

/// Prefill / decode requests of `(sequence, tokens)` pairs.
fn plain_requests<'a>(batch: &[(usize, &'a [u32])]) -> Vec<StepRequest<'a>> {
    batch.iter().map(|&(seq, tokens)| StepRequest { seq, tokens, tree: None }).collect()
}

/// Every check of a step's requests that needs no cache: unique sequences, token ids in the vocabulary,
/// trees after the other requests, of one row count, with a depth and a visibility row per node.
fn check_requests(requests: &[StepRequest], vocab: usize) -> Result<()> {
    let mut tree_rows = None;
    for (i, r) in requests.iter().enumerate() {
        if requests[..i].iter().any(|other| other.seq == r.seq) {
            return Err(Error::param("batch", r.seq, "a sequence may appear only once per step"));
        }
        if let Some(&id) = r.tokens.iter().find(|&&id| id as usize >= vocab) {
            return Err(Error::Index {
                name: "tokens",
                detail: format!("token id {id} is outside the vocabulary 0..{vocab}"),
            });
        }
        let Some(tree) = r.tree else {
            if tree_rows.is_some() {
                return Err(Error::param(
                    "batch",
                    r.seq,
                    "tree requests must come after every prefill or decode request",
                ));
            }
            continue;
        };
        let n = r.tokens.len();
        if n == 0 || *tree_rows.get_or_insert(n) != n {
            return Err(Error::param(
                "tree rows",
                n,
                format!("every tree of a step needs the same row count (>= 1), here {tree_rows:?}"),
            ));
        }
        check_len("tree depth", tree.depth.len(), &[("N", n)])?;
        check_len("tree visibility", tree.visibility.len(), &[("N", n), ("ceil(N / 32)", n.div_ceil(32))])?;
        if tree.depth[0] != 0 || tree.depth[1..].iter().any(|&d| d == 0 || d as usize >= n) {
            return Err(Error::param(
                "tree depth",
                format!("{:?}", tree.depth),
                "the root has depth 0, every other node 1..N",
            ));
        }
    }
    Ok(())
}

/// Checks, before anything is loaded, that every size a split divides splits evenly over `shard`'s
/// ranks, and that a rank's share of the heads is a head count the attention kernels take.
fn check_split(c: &Config, shard: Shard) -> Result<()> {
    if shard.world == 1 {
        return Ok(());
    }
    let heads = shard.range("num_attention_heads", c.num_attention_heads)?.len();
    if !SUPPORTED_HEADS.contains(&heads) {
        return Err(Error::param(
            "num_attention_heads",
            c.num_attention_heads,
            format!("{heads} heads per rank over {} ranks; the attention takes {SUPPORTED_HEADS:?}", shard.world),
        ));
    }
    let layers = 0..c.num_hidden_layers;
    if layers.clone().any(|i| !c.is_moe_layer(i)) {
        shard.range("intermediate_size", c.intermediate_size)?;
    }
    if layers.clone().any(|i| c.is_moe_layer(i)) {
        shard.range("n_routed_experts", c.n_routed_experts)?;
        if c.n_shared_experts > 0 {
            shard.range("shared expert intermediate size", c.moe_intermediate_size * c.n_shared_experts)?;
        }
    }
    Ok(())
}

/// Decoder layer `i` of `c`, its tensors named `{p}.…`: the share of `shard`'s rank (its attention
/// heads, intermediate features and routed experts), or all of it for [`Shard::WHOLE`].
pub(super) fn load_layer<B: Backend>(
    b: &B,
    ckpt: &Checkpoint,
    c: &Config,
    p: &str,
    i: usize,
    shard: Shard,
) -> Result<Layer<B>> {
    let h = c.hidden_size;
    let whole = shard == Shard::WHOLE;
    let mlp_share = |m: &layers::Mlp, name: &'static str| -> Result<Mlp<B>> {
        if whole {
            return Mlp::place(b, m);
        }
        Mlp::place(b, &m.part(shard.range(name, m.gate.out_features())?)?)
    };
    let ffn = if c.is_moe_layer(i) {
        let m = layers::Moe::load(ckpt, &format!("{p}.mlp"), c)?;
        let total = c.n_routed_experts;
        let experts = shard.range("n_routed_experts", total)?;
        let share = ExpertShare { first: experts.start, total };
        FeedForward::Moe(Box::new(Moe {
            router: Dense::place(b, &m.router)?.w,
            bias: b.upload(&m.bias)?,
            experts: if whole { b.experts(&m.experts.view())? } else { b.experts(&m.experts.range(experts)?.view())? },
            share,
            shared: m.shared.as_ref().map(|s| mlp_share(s, "shared expert intermediate size")).transpose()?,
            top_k: m.top_k,
            scaling: m.scaling,
        }))
    } else {
        let mlp = layers::Mlp::load(ckpt, &format!("{p}.mlp"), h, c.intermediate_size)?;
        FeedForward::Dense(mlp_share(&mlp, "intermediate_size")?)
    };
    let attn = MlaWeights::load(ckpt, &format!("{p}.self_attn"), c)?;
    let attn = if whole { attn } else { attn.heads(shard.range("num_attention_heads", c.num_attention_heads)?, c)? };
    let norm = |name: &str| layers::RmsNorm::load(ckpt, &format!("{p}.{name}.weight"), h, c.rms_norm_eps);
    Ok(Layer {
        input_norm: Norm::place(b, &norm("input_layernorm")?)?,
        attn: Attention::place(b, &attn, c)?,
        post_attn_norm: Norm::place(b, &norm("post_attention_layernorm")?)?,
        ffn,
    })
}

/// One sequence's place in the cache.
#[derive(Clone, Debug, Default)]
struct Sequence {
    pages: Vec<i32>,
    len: usize,
}

/// A paged latent KV cache for every layer: the page table and allocator on the host (pages handed to
/// sequences as they grow and returned when they are removed), the page storage, per layer
/// `[num_pages, page_size, 576]` bf16 rows, on the backend.
pub struct KvCache<B: Backend = CpuBackend> {
    /// Unique per cache in the process: recorded step graphs are keyed by it.
    id: u64,
    storage: Vec<B::Buf<bf16>>,
    layout: KvLayout,
    free: Vec<i32>,
    seqs: Vec<Option<Sequence>>,
}

impl<B: Backend> KvCache<B> {
    /// `layers` layers of `num_pages` pages of `page_size` slots on `backend`; sequences of at most
    /// `max_seq_len` slots.
    pub fn new(backend: &B, layers: usize, num_pages: usize, page_size: usize, max_seq_len: usize) -> Result<Self> {
        for (name, v) in [("num_pages", num_pages), ("page_size", page_size), ("max_seq_len", max_seq_len)] {
            if v == 0 {
                return Err(Error::param(name, v, "the KV cache needs every size >= 1"));
            }
        }
        if num_pages > i32::MAX as usize || (num_pages * page_size) > i32::MAX as usize {
            return Err(Error::param("num_pages", num_pages, "page ids and cache rows are i32"));
        }
        let layout = KvLayout {
            layers: 1,
            num_pages,
            page_size,
            row_elems: ROW,
            pages_per_req: max_seq_len.div_ceil(page_size),
        };
        let storage = (0..layers).map(|_| backend.zeros(num_pages * page_size * ROW)).collect::<Result<_>>()?;
        static NEXT_ID: AtomicU64 = AtomicU64::new(0);
        let id = NEXT_ID.fetch_add(1, Ordering::Relaxed);
        Ok(KvCache { id, storage, layout, free: (0..num_pages as i32).rev().collect(), seqs: Vec::new() })
    }

    /// Starts an empty sequence; returns its id.
    pub fn add_sequence(&mut self) -> usize {
        match self.seqs.iter().position(Option::is_none) {
            Some(id) => {
                self.seqs[id] = Some(Sequence::default());
                id
            }
            None => {
                self.seqs.push(Some(Sequence::default()));
                self.seqs.len() - 1
            }
        }
    }

    /// Ends a sequence and frees its pages.
    pub fn remove_sequence(&mut self, id: usize) -> Result<()> {
        let seq = self.seqs.get_mut(id).and_then(Option::take).ok_or_else(|| unknown(id))?;
        self.free.extend(seq.pages.iter().rev());
        Ok(())
    }

    /// Tokens cached for sequence `id`.
    pub fn len(&self, id: usize) -> Result<usize> {
        Ok(self.seq(id)?.len)
    }

    /// Pages not held by any sequence.
    pub fn free_pages(&self) -> usize {
        self.free.len()
    }

    /// Slots per page.
    pub fn page_size(&self) -> usize {
        self.layout.page_size
    }

    /// Slots a sequence may hold (the `max_seq_len` the cache was made for, rounded up to whole pages).
    pub fn max_seq_len(&self) -> usize {
        self.layout.pages_per_req * self.layout.page_size
    }

    /// Commits the accepted paths through the trees of the last step: each path's rows (root first,
    /// written at slots `len + row`) move to the slots `len ..` in every layer, and the sequence advances
    /// by the path's length. `n_rows` is the step's tree rows per sequence. Every path is checked before
    /// any row moves, so an error leaves the cache as it was.
    pub fn commit_trees(&mut self, backend: &B, commits: &[TreeCommit], n_rows: usize) -> Result<()> {
        let depth = commits.iter().map(|c| c.rows.len().saturating_sub(1)).max().unwrap_or(0);
        let mut moves = Compaction { depth, n_rows, ..Compaction::default() };
        for (i, c) in commits.iter().enumerate() {
            self.check_commit(c, n_rows)?;
            if commits[..i].iter().any(|o| o.seq == c.seq) {
                return Err(Error::param("commits", c.seq, "a sequence may commit one path a step"));
            }
            moves.block_tables.extend(self.block_table(c.seq)?);
            moves.seq_len.push(self.seq(c.seq)?.len as i32);
            moves.accept_len.push((c.rows.len() - 1) as i32);
            let mut rows: Vec<i32> = c.rows.iter().map(|&r| r as i32).collect();
            rows.resize(depth + 1, -1);
            moves.accept_rows.extend(rows);
        }
        if depth > 0 {
            backend.kv_compact(&mut self.storage, self.layout, &moves)?;
        }
        for c in commits {
            if let Some(seq) = self.seqs.get_mut(c.seq).and_then(Option::as_mut) {
                seq.len += c.rows.len();
            }
        }
        Ok(())
    }

    /// A path starts at the root and goes down the rows (a child's row is after its parent's) of a
    /// tree whose rows the sequence's pages hold.
    fn check_commit(&self, c: &TreeCommit, n_rows: usize) -> Result<()> {
        let seq = self.seq(c.seq)?;
        if c.rows.first() != Some(&0) || c.rows.len() > n_rows {
            return Err(Error::param(
                "rows",
                format!("{:?}", c.rows),
                format!("sequence {}: a path of 1..={n_rows} tree rows starting at the root (row 0)", c.seq),
            ));
        }
        if let Some(j) = (1..c.rows.len()).find(|&j| c.rows[j] <= c.rows[j - 1] || c.rows[j] >= n_rows) {
            return Err(Error::param(
                "rows",
                format!("{:?}", c.rows),
                format!("sequence {}: row {j} must come after row {} and be < {n_rows}", c.seq, j - 1),
            ));
        }
        if seq.len + n_rows > seq.pages.len() * self.layout.page_size {
            return Err(Error::param(
                "n_rows",
                n_rows,
                format!("sequence {} holds no tree of {n_rows} rows past its {} tokens", c.seq, seq.len),
            ));
        }
        Ok(())
    }

    fn seq(&self, id: usize) -> Result<&Sequence> {
        self.seqs.get(id).and_then(Option::as_ref).ok_or_else(|| unknown(id))
    }

    /// Makes room for `len` slots in sequence `id`.
    pub(super) fn reserve(&mut self, id: usize, len: usize) -> Result<()> {
        let max = self.layout.pages_per_req * self.layout.page_size;
        if len > max {
            return Err(Error::param("sequence length", len, format!("sequence {id} exceeds max_seq_len {max}")));
        }
        let need = len.div_ceil(self.layout.page_size);
        let have = self.seq(id)?.pages.len();
        if need > have + self.free.len() {
            return Err(Error::param("num_pages", self.layout.num_pages, "the KV cache is out of pages"));
        }
        let new: Vec<i32> = (have..need).filter_map(|_| self.free.pop()).collect();
        if let Some(seq) = self.seqs[id].as_mut() {
            seq.pages.extend(new);
        }
        Ok(())
    }

    /// Commits `n` more slots of sequence `id` (reserved, and written).
    pub(super) fn extend(&mut self, id: usize, n: usize) {
        if let Some(seq) = self.seqs.get_mut(id).and_then(Option::as_mut) {
            seq.len += n;
        }
    }

    /// Sets sequence `id`'s length back to `len` (no longer than it is): the rows past it are written
    /// again by the next step. For undoing a step that failed on another rank after this one committed.
    pub(crate) fn truncate(&mut self, id: usize, len: usize) {
        if let Some(seq) = self.seqs.get_mut(id).and_then(Option::as_mut) {
            seq.len = seq.len.min(len);
        }
    }

    /// Commits the tokens of every request that is not a tree.
    fn advance(&mut self, requests: &[StepRequest]) {
        for r in requests.iter().filter(|r| r.tree.is_none()) {
            if let Some(seq) = self.seqs.get_mut(r.seq).and_then(Option::as_mut) {
                seq.len += r.tokens.len();
            }
        }
    }

    /// Sequence `id`'s block table, padded with -1 to `pages_per_req`.
    pub(super) fn block_table(&self, id: usize) -> Result<Vec<i32>> {
        let mut table = self.seq(id)?.pages.clone();
        table.resize(self.layout.pages_per_req, -1);
        Ok(table)
    }

    /// The storage row of `slot` in a sequence with block table `table`.
    pub(super) fn slot_row(&self, table: &[i32], slot: usize) -> Result<i32> {
        let off = self.layout.slot_offset(table, 0, slot)?;
        Ok((off / ROW) as i32)
    }
}

fn unknown(id: usize) -> Error {
    Error::Index { name: "sequence", detail: format!("no sequence {id} in the KV cache") }
}
