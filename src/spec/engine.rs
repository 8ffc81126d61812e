//! The generation loop over a target [`Model`]: requests join and leave between steps; each step is a
//! prefill of the requests that joined, or one decode / verify step of all the others.

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use crate::cpu::greedy_accept::accept_from_argmax;
use crate::cpu::tree_build::build_trees;
use crate::error::{Error, Result};
use crate::model::backend::Backend;
use crate::model::{Logits, Model, StepRequest, TreeCommit, TreeInput};
use crate::types::{top_k_for, DraftTree, TreeShape};
use crate::MAX_DEPTH;

use super::auto::{record_steps, AutoBudget, Drafting, StepTimes, WarmShape};
use super::proposer::{DraftRequest, Proposal, Proposer};
use super::sampling::Sampling;
use super::target::{Target, TargetCache};

/// Largest tree budget the engine takes: the range it is tested and measured in (DDTree's B 8-64; the
/// tree kernels themselves take more).
const MAX_ENGINE_BUDGET: usize = 64;

/// How the engine decodes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Mode {
    /// One token per sequence per step.
    Ar,
    /// The proposer's best token at each of `block - 1` positions, verified as a path.
    Chain,
    /// The best-first tree of `budget` nodes over the proposer's candidates (DDTree), verified at once.
    DdTree,
    /// DDTree with the budget chosen each step, 0 (a plain decode step) to `budget`, for the most
    /// expected tokens per second from the step times the engine measures (ENGINE.md §7).
    Auto,
}

impl std::str::FromStr for Mode {
    type Err = Error;

    fn from_str(s: &str) -> Result<Self> {
        match s {
            "ar" => Ok(Mode::Ar),
            "chain" => Ok(Mode::Chain),
            "ddtree" => Ok(Mode::DdTree),
            "auto" => Ok(Mode::Auto),
            _ => Err(Error::param("mode", s, "must be one of ar, chain, ddtree, auto")),
        }
    }
}

/// The engine's settings.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct EngineConfig {
    /// Decoding mode.
    pub mode: Mode,
    /// Draft nodes per tree (`ddtree`; the largest `auto` may choose), root excluded: a verify step runs
    /// `budget + 1` rows a sequence.
    pub budget: usize,
    /// Block size: the bonus token and `block - 1` draft positions (the deepest a draft goes).
    pub block: usize,
    /// KV cache pages.
    pub num_pages: usize,
    /// Slots per page.
    pub page_size: usize,
    /// Longest sequence (prompt, generated tokens and the rows of one tree).
    pub max_seq_len: usize,
}

impl Default for EngineConfig {
    fn default() -> Self {
        EngineConfig { mode: Mode::DdTree, budget: 16, block: 16, num_pages: 1024, page_size: 16, max_seq_len: 2048 }
    }
}

impl EngineConfig {
    /// Checks the budget and block against the tree limits.
    pub fn validate(&self) -> Result<()> {
        if self.block < 2 || self.block > MAX_DEPTH + 1 {
            return Err(Error::param("block", self.block, format!("block size must be in 2..={}", MAX_DEPTH + 1)));
        }
        if matches!(self.mode, Mode::DdTree | Mode::Auto) && (self.budget == 0 || self.budget > MAX_ENGINE_BUDGET) {
            return Err(Error::param(
                "budget",
                self.budget,
                format!("tree budget must be in 1..={}", MAX_ENGINE_BUDGET),
            ));
        }
        Ok(())
    }

    /// Draft positions L.
    fn depth(&self) -> usize {
        self.block - 1
    }

    /// Rows a verify step gives a sequence: the root and the draft nodes.
    fn tree_rows(&self) -> usize {
        match self.mode {
            Mode::Ar => 1,
            Mode::Chain => self.block,
            Mode::DdTree | Mode::Auto => self.budget + 1,
        }
    }
}

/// What a request asks for.
#[derive(Clone, Debug, PartialEq)]
pub struct RequestParams {
    /// Tokens to generate at most (at least 1).
    pub max_tokens: usize,
    /// Tokens that end the request; the stop token itself is not emitted.
    pub stop_tokens: Vec<u32>,
    /// Sampling settings; `None` is greedy.
    pub sampling: Option<Sampling>,
    /// `Some(n)`: every emitted token comes with its log-probability under the target and the `n` (at
    /// most [`MAX_TOP_LOGPROBS`]) most likely tokens with theirs.
    pub logprobs: Option<usize>,
}

/// Most alternatives a request may ask [`RequestParams::logprobs`] for (OpenAI's limit).
pub const MAX_TOP_LOGPROBS: usize = 20;

/// An emitted token's log-probability under the target's distribution (log-softmax of its logits,
/// temperature 1, whatever the request samples with), and the most likely tokens there.
#[derive(Clone, Debug, PartialEq)]
pub struct TokenLogprob {
    /// The token.
    pub token: u32,
    /// Its log-probability.
    pub logprob: f32,
    /// The most likely tokens with their log-probabilities, most likely first (equal ones by id).
    pub top: Vec<(u32, f32)>,
}

/// A request's handle.
pub type RequestId = u64;

/// Why a request ended.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum FinishReason {
    /// It generated `max_tokens`.
    Length,
    /// It emitted a stop token.
    Stop,
}

/// A request's part of a step's result.
#[derive(Clone, Debug, PartialEq)]
pub struct StepOutput {
    /// The request.
    pub id: RequestId,
    /// Its new tokens, in order.
    pub tokens: Vec<u32>,
    /// With [`RequestParams::logprobs`], one entry per new token; else empty.
    pub logprobs: Vec<TokenLogprob>,
    /// Set when the request ended with this step (it is then removed).
    pub finished: Option<FinishReason>,
}

/// Counters of a run (ENGINE.md §9; the spec-decode ones have vLLM's meaning).
#[derive(Clone, Debug, Default, PartialEq)]
pub struct SpecStats {
    /// Prefill steps.
    pub prefill_steps: u64,
    /// Decode and verify steps.
    pub steps: u64,
    /// Tokens emitted (prefills' first tokens included).
    pub tokens: u64,
    /// Sequence verifications of a draft (one per sequence per verify step).
    pub drafts: u64,
    /// Draft nodes verified.
    pub draft_tokens: u64,
    /// Draft tokens accepted.
    pub accepted: u64,
    /// Entry d: verifications that accepted at least d + 1 draft tokens.
    pub accepted_by_depth: Vec<u64>,
    /// Decode and verify steps by the tree budget they ran (0: a plain decode step).
    pub steps_by_budget: BTreeMap<usize, u64>,
    /// Where the steps' time went.
    pub stages: StageTimes,
    /// Requests finished (ended by length or a stop token; cancelled ones not counted).
    pub finished: u64,
    /// Summed over the finished requests: time from `add_request` to the end of the step that emitted
    /// the first token.
    pub ttft_total: Duration,
    /// Summed over the finished requests that emitted at least two tokens: the time after the first
    /// token divided by the tokens after it.
    pub tpot_total: Duration,
    /// Finished requests that emitted at least two tokens.
    pub tpot_requests: u64,
}

/// Wall-clock time of the parts of the engine's steps, summed over the run. Each part that reads a
/// result from the backend waits for its work there, so a part's time includes its own backend work
/// (on CUDA the drafter's step and top-K are in `draft`, the target's step and its read-back in
/// `verify`).
#[derive(Clone, Debug, Default, PartialEq)]
pub struct StageTimes {
    /// Prefill steps (the target's prompt steps).
    pub prefill: Duration,
    /// The proposer: context writes, the draft step, top-K.
    pub draft: Duration,
    /// Tree build (and `auto`'s budget choice, its step-time measurements included).
    pub tree_build: Duration,
    /// The target's decode / verify step, read-back included.
    pub verify: Duration,
    /// Greedy acceptance on the host.
    pub accept: Duration,
    /// The KV commit of the accepted rows.
    pub compaction: Duration,
    /// Everything else in the decode and verify steps: planning, stop handling, bookkeeping.
    pub host: Duration,
}

impl SpecStats {
    /// 1 + accepted / drafts: tokens a verification emits on average (1 without drafts).
    pub fn mean_accepted_length(&self) -> f64 {
        1.0 + self.accepted as f64 / self.drafts.max(1) as f64
    }

    /// Mean time to first token of the finished requests.
    pub fn mean_ttft(&self) -> Duration {
        self.ttft_total / self.finished.max(1) as u32
    }

    /// Mean time per output token after the first, over the finished requests.
    pub fn mean_tpot(&self) -> Duration {
        self.tpot_total / self.tpot_requests.max(1) as u32
    }
}

/// One request in flight. The cache holds every history token but the last (the one the target
/// emitted last, which the next step feeds in).
struct Active {
    id: RequestId,
    seq: usize,
    history: Vec<u32>,
    prefilled: bool,
    params: RequestParams,
    generated: usize,
    /// Context features of the tokens cached since the proposer's last look at this request.
    features: Vec<f32>,
    /// Whether the proposer can draft for this request: false once `auto` switched drafting off while
    /// it was in flight (its drafter context then stops following the target's cache).
    drafts: bool,
    added: Instant,
    first_token: Option<Instant>,
}

/// The speculative decoding engine over the target `model` (a [`Model`] by default, or a
/// [`crate::parallel::ShardedModel`]) with proposer `P` (see the module documentation).
pub struct Engine<'m, B: Backend, P: Proposer, T: Target<B> = Model<B>> {
    model: &'m T,
    cache: T::Cache,
    proposer: P,
    config: EngineConfig,
    active: Vec<Active>,
    next_id: RequestId,
    stats: SpecStats,
    /// The target layers whose hidden states the proposer reads (none in `ar` mode).
    feature_layers: Vec<usize>,
    /// `auto`'s step-time table and drafting back-off.
    auto: AutoBudget,
}

impl<'m, B: Backend, P: Proposer, T: Target<B>> Engine<'m, B, P, T> {
    /// An engine with its own KV cache.
    pub fn new(model: &'m T, proposer: P, config: EngineConfig) -> Result<Self> {
        config.validate()?;
        if let Some(block) = proposer.block_size().filter(|&b| config.mode != Mode::Ar && b != config.block) {
            return Err(Error::param(
                "block",
                config.block,
                format!("the proposer drafts blocks of {block} only (the size its drafter was trained for)"),
            ));
        }
        let cache = model.new_cache(config.num_pages, config.page_size, config.max_seq_len)?;
        let stats = SpecStats { accepted_by_depth: vec![0; config.depth()], ..SpecStats::default() };
        let feature_layers = if config.mode == Mode::Ar { Vec::new() } else { proposer.feature_layers().to_vec() };
        Ok(Engine {
            model,
            cache,
            proposer,
            config,
            active: Vec::new(),
            next_id: 0,
            stats,
            feature_layers,
            auto: AutoBudget::new(StepTimes::new(config.budget)),
        })
    }

    /// The target model.
    pub fn model(&self) -> &'m T {
        self.model
    }

    /// The proposer.
    pub fn proposer(&self) -> &P {
        &self.proposer
    }

    /// The counters so far.
    pub fn stats(&self) -> &SpecStats {
        &self.stats
    }

    /// The engine's settings.
    pub fn config(&self) -> &EngineConfig {
        &self.config
    }

    /// KV cache pages held by requests now.
    pub fn kv_pages_in_use(&self) -> usize {
        self.config.num_pages - self.cache.free_pages()
    }

    /// Rows a verify step gives each sequence (1 in `ar` mode): the cache room a request needs beyond
    /// its prompt and generated tokens.
    pub fn tree_rows(&self) -> usize {
        self.config.tree_rows()
    }

    /// Requests not yet finished.
    pub fn pending(&self) -> usize {
        self.active.len()
    }

    /// Prepares for steps of `batch` requests whose sequences grow to `max_len` tokens, so that a run's
    /// steps do not pay for it: in `auto` mode measures the target's step times at every power-of-two
    /// batch bucket up to `batch`'s, and in every mode runs the target steps of the mode's shapes once
    /// at each sequence-length bucket up to `max_len`, and the proposer's drafts likewise, which records
    /// their graphs (on a backend without graphs there is nothing to record). Call it before adding
    /// requests: it uses free cache pages (a bucket they do not cover is skipped).
    pub fn warm_up(&mut self, batch: usize, max_len: usize) -> Result<()> {
        if batch == 0 {
            return Ok(());
        }
        if self.config.mode == Mode::Auto {
            self.auto.warm_up(self.model, &mut self.cache, batch, &self.feature_layers)?;
        }
        if !B::RECORDS_GRAPHS {
            return Ok(());
        }
        // The drafter shares the target's backend, so a plan either of them grows stales the graphs of
        // both: the first round makes every plan, the second records the graphs that went stale.
        let shapes = self.warm_shapes();
        for _ in 0..2 {
            if self.config.mode != Mode::Ar {
                self.proposer.warm_up(batch, max_len, self.draft_shape().1)?;
            }
            record_steps(self.model, &mut self.cache, batch, max_len, &shapes, &self.feature_layers)?;
        }
        Ok(())
    }

    /// The step shapes the mode runs, the widest first: rows per sequence, and whether the step returns
    /// context features.
    fn warm_shapes(&self) -> Vec<WarmShape> {
        let features = !self.feature_layers.is_empty();
        let mut shapes = match self.config.mode {
            Mode::Ar => vec![(1, false)],
            Mode::Chain | Mode::DdTree => vec![(self.config.tree_rows(), features)],
            Mode::Auto => self.auto.budgets().iter().rev().map(|&b| (b + 1, features)).collect(),
        };
        if self.config.mode == Mode::Auto && features {
            shapes.push((1, false)); // the plain step once drafting is off
        }
        shapes
    }

    /// Queues a request; its prefill runs at the next step.
    pub fn add_request(&mut self, prompt: &[u32], params: RequestParams) -> Result<RequestId> {
        let vocab = self.model.config().vocab_size;
        if prompt.is_empty() {
            return Err(Error::param("prompt", "[]", "needs at least one token"));
        }
        if let Some(&t) = prompt.iter().find(|&&t| t as usize >= vocab) {
            return Err(Error::param("prompt", t, format!("token ids must be < the vocabulary size {vocab}")));
        }
        if params.max_tokens == 0 {
            return Err(Error::param("max_tokens", 0, "must be at least 1"));
        }
        if let Some(s) = &params.sampling {
            s.validate(vocab)?;
        }
        if let Some(n) = params.logprobs.filter(|&n| n > MAX_TOP_LOGPROBS) {
            return Err(Error::param("logprobs", n, format!("at most {MAX_TOP_LOGPROBS} alternatives a token")));
        }
        let room = self.cache.max_seq_len();
        if prompt.len() + params.max_tokens > room {
            return Err(Error::param(
                "max_tokens",
                params.max_tokens,
                format!("prompt ({} tokens) + max_tokens exceeds the context of {room} tokens", prompt.len()),
            ));
        }
        let id = self.next_id;
        self.next_id += 1;
        let seq = self.cache.add_sequence();
        self.active.push(Active {
            id,
            seq,
            history: prompt.to_vec(),
            prefilled: false,
            params,
            generated: 0,
            features: Vec::new(),
            drafts: true,
            added: Instant::now(),
            first_token: None,
        });
        Ok(id)
    }

    /// Ends a request early and frees its cache pages.
    pub fn cancel(&mut self, id: RequestId) -> Result<()> {
        let i = self.active.iter().position(|a| a.id == id).ok_or_else(|| unknown(id))?;
        let a = self.active.remove(i);
        self.proposer.release(a.id)?;
        self.cache.remove_sequence(a.seq)
    }

    /// Runs one step: the prefill of the requests added since the last step if there are any, else a
    /// decode or verify step of every request. Returns each stepped request's new tokens.
    pub fn step(&mut self) -> Result<Vec<StepOutput>> {
        let fresh: Vec<usize> = (0..self.active.len()).filter(|&i| !self.active[i].prefilled).collect();
        let started = Instant::now();
        if !fresh.is_empty() {
            let emitted = self.prefill(&fresh)?;
            self.stats.stages.prefill += started.elapsed();
            return self.finish(emitted);
        }
        if self.active.is_empty() {
            return Ok(Vec::new());
        }
        let before = self.stats.stages.clone();
        let emitted = self.decode()?;
        let out = self.finish(emitted)?;
        let st = &mut self.stats.stages;
        let parts = (st.draft - before.draft)
            + (st.tree_build - before.tree_build)
            + (st.verify - before.verify)
            + (st.accept - before.accept)
            + (st.compaction - before.compaction);
        st.host += started.elapsed().saturating_sub(parts);
        Ok(out)
    }

    /// Runs steps until every request has finished; returns each request's tokens, in id order.
    pub fn run_to_end(&mut self) -> Result<Vec<(RequestId, Vec<u32>)>> {
        let mut out: Vec<(RequestId, Vec<u32>)> = self.active.iter().map(|a| (a.id, Vec::new())).collect();
        while !self.active.is_empty() {
            for o in self.step()? {
                if let Some(entry) = out.iter_mut().find(|(id, _)| *id == o.id) {
                    entry.1.extend(o.tokens);
                }
            }
        }
        Ok(out)
    }

    /// The prompts of `fresh` (indices into `active`) in one step; each gets its first token.
    fn prefill(&mut self, fresh: &[usize]) -> Result<(Vec<Emitted>, Chosen)> {
        let requests: Vec<StepRequest> = fresh
            .iter()
            .map(|&i| StepRequest { seq: self.active[i].seq, tokens: &self.active[i].history, tree: None })
            .collect();
        let rows: Vec<(usize, usize)> = fresh.iter().map(|&i| (i, self.active[i].history.len())).collect();
        let layers = &self.feature_layers;
        let step = choose(self.model, &mut self.cache, &self.active, &requests, Logits::Last, &rows, layers)?;
        self.stats.prefill_steps += 1;
        let mut first_token = 0;
        for &i in fresh {
            let n = self.active[i].history.len();
            self.active[i].features.extend(step.features(first_token..first_token + n));
            self.active[i].prefilled = true;
            first_token += n;
        }
        let emitted = fresh
            .iter()
            .zip(&step.tokens)
            .enumerate()
            .map(|(row, (&i, &t))| Emitted { active: i, tokens: vec![t], rows: vec![row] })
            .collect();
        Ok((emitted, step))
    }

    /// One step of every request: a decode row for each in `ar` mode (and for a sequence with no room
    /// left for a tree, and in `auto` mode when a plain step is the faster choice), otherwise a draft
    /// verified as a tree.
    fn decode(&mut self) -> Result<(Vec<Emitted>, Chosen)> {
        let room = self.cache.max_seq_len();
        let may_draft = match self.config.mode {
            Mode::Ar => false,
            Mode::Auto => match self.auto.drafting(self.active.len()) {
                Drafting::Draft => true,
                Drafting::Wait => false,
                Drafting::Off => {
                    self.stop_drafting()?;
                    false
                }
            },
            Mode::Chain | Mode::DdTree => true,
        };
        let (mut plain, mut drafted) = (Vec::new(), Vec::new());
        for (i, a) in self.active.iter().enumerate() {
            if may_draft && a.drafts && a.history.len() - 1 + self.config.tree_rows() <= room {
                drafted.push(i);
            } else {
                plain.push(i);
            }
        }
        let (started, drafts) = (Instant::now(), !drafted.is_empty());
        let trees = if drafts { self.draft(&mut plain, &mut drafted)? } else { None };
        let n_rows = trees.as_ref().map_or(1, |t| t.shape.rows());
        self.stats.steps += 1;
        *self.stats.steps_by_budget.entry(n_rows - 1).or_default() += 1;
        let rows = trees.as_ref().map(TreeRows::of).unwrap_or_default();
        let mut requests: Vec<StepRequest> = plain
            .iter()
            .map(|&i| StepRequest { seq: self.active[i].seq, tokens: last(&self.active[i].history), tree: None })
            .collect();
        for (j, &i) in drafted.iter().enumerate() {
            let r = j * n_rows..(j + 1) * n_rows;
            let w = rows.words;
            let tree =
                TreeInput { depth: &rows.depth[r.clone()], visibility: &rows.visibility[r.start * w..r.end * w] };
            requests.push(StepRequest { seq: self.active[i].seq, tokens: &rows.tokens[r], tree: Some(tree) });
        }
        // The position each row predicts: a decode row's is the sequence's length, a tree row's that plus
        // its depth.
        let mut meta: Vec<(usize, usize)> = plain.iter().map(|&i| (i, self.active[i].history.len())).collect();
        for (j, &i) in drafted.iter().enumerate() {
            let len = self.active[i].history.len();
            meta.extend(rows.depth[j * n_rows..(j + 1) * n_rows].iter().map(|&d| (i, len + d as usize)));
        }
        let layers = if self.active.iter().any(|a| a.drafts) { &self.feature_layers[..] } else { &[] };
        let verify = Instant::now();
        let step = choose(self.model, &mut self.cache, &self.active, &requests, Logits::All, &meta, layers)?;
        self.stats.stages.verify += verify.elapsed();
        for (j, &i) in plain.iter().enumerate() {
            if self.active[i].drafts {
                self.active[i].features.extend(step.features(j..j + 1));
            }
        }
        let mut emitted: Vec<Emitted> = plain
            .iter()
            .zip(&step.tokens)
            .enumerate()
            .map(|(row, (&i, &t))| Emitted { active: i, tokens: vec![t], rows: vec![row] })
            .collect();
        if let Some(tree) = &trees {
            emitted.extend(self.accept(&drafted, tree, &step, plain.len(), n_rows)?);
        }
        if self.config.mode == Mode::Auto {
            let tokens = emitted.iter().map(|e| e.tokens.len()).sum();
            self.auto.observe_step(self.active.len(), drafts, tokens, started.elapsed().as_secs_f64());
        }
        Ok((emitted, step))
    }

    /// `auto` switched drafting off: the requests in flight let their drafter contexts go and take plain
    /// steps to the end, which then need no context features (a proposer that reads none keeps drafting
    /// once drafting is back on).
    fn stop_drafting(&mut self) -> Result<()> {
        if self.feature_layers.is_empty() {
            return Ok(());
        }
        for a in self.active.iter_mut().filter(|a| a.drafts) {
            a.drafts = false;
            a.features = Vec::new();
            self.proposer.release(a.id)?;
        }
        Ok(())
    }

    /// The draft trees of `drafted` (indices into `active`). In `auto` mode this also picks the budget:
    /// the first rows of the full tree, or none (then every request moves to `plain`).
    fn draft(&mut self, plain: &mut Vec<usize>, drafted: &mut Vec<usize>) -> Result<Option<DraftTree>> {
        let started = Instant::now();
        let proposals = self.propose(drafted)?;
        let draft_time = started.elapsed();
        self.stats.stages.draft += draft_time;
        let tree = self.build_trees(drafted, &proposals)?;
        if self.config.mode != Mode::Auto {
            self.stats.stages.tree_build += started.elapsed() - draft_time;
            return Ok(Some(tree));
        }
        let (_, k) = self.draft_shape();
        let expected = super::auto::expected_tokens(&tree, &proposals, k, plain.len())?;
        let layers = &self.feature_layers;
        let batch = plain.len() + drafted.len();
        let drafted_for = started.elapsed();
        let budget = self.auto.choose(self.model, &mut self.cache, &expected, batch, drafted_for, layers)?;
        let tree = if budget == 0 {
            plain.append(drafted);
            None
        } else {
            Some(tree.first_rows(budget)?)
        };
        self.stats.stages.tree_build += started.elapsed() - draft_time;
        Ok(tree)
    }

    /// The tree budget and candidates per position of a full draft.
    fn draft_shape(&self) -> (usize, usize) {
        let vocab = self.model.config().vocab_size;
        match self.config.mode {
            Mode::Chain => (self.config.depth(), 1),
            _ => (self.config.budget, top_k_for(self.config.budget, vocab, None)),
        }
    }

    /// The proposer's candidates for `drafted` (indices into `active`), handing it each request's
    /// pending context features.
    fn propose(&mut self, drafted: &[usize]) -> Result<Vec<Proposal>> {
        let vocab = self.model.config().vocab_size;
        let (depth, (_, k)) = (self.config.depth(), self.draft_shape());
        let batch: Vec<DraftRequest> = drafted
            .iter()
            .map(|&i| {
                let a = &self.active[i];
                DraftRequest { id: a.id, history: &a.history, features: &a.features }
            })
            .collect();
        let proposals = self.proposer.propose(&batch, depth, k, vocab)?;
        if proposals.len() != drafted.len() {
            return Err(Error::param(
                "proposals",
                proposals.len(),
                format!("the proposer must give one per request ({})", drafted.len()),
            ));
        }
        for &i in drafted {
            self.active[i].features.clear();
        }
        for p in &proposals {
            if p.ids.len() != depth * k || p.logp.len() != depth * k {
                return Err(Error::shape("proposal", format!("[{depth}, {k}]"), depth * k, p.ids.len()));
            }
            if let Some(&t) = p.ids.iter().find(|&&t| t < 0 || t as usize >= vocab) {
                return Err(Error::param("proposal", t, format!("token ids must be in 0..{vocab}")));
            }
        }
        Ok(proposals)
    }

    /// The best-first trees of `drafted` (indices into `active`) over their proposals.
    fn build_trees(&self, drafted: &[usize], proposals: &[Proposal]) -> Result<DraftTree> {
        let (budget, k) = self.draft_shape();
        let (mut ids, mut logp, mut roots, mut lens) = (Vec::new(), Vec::new(), Vec::new(), Vec::new());
        for (&i, p) in drafted.iter().zip(proposals) {
            let a = &self.active[i];
            ids.extend_from_slice(&p.ids);
            logp.extend_from_slice(&p.logp);
            roots.push(*a.history.last().expect("a request has tokens") as i32);
            lens.push((a.history.len() - 1) as i32);
        }
        let shape = TreeShape::new(drafted.len(), self.config.depth(), budget)?;
        build_trees(shape, k, &ids, &logp, &roots, &lens)
    }

    /// Greedy acceptance of each tree against the target's argmax of its rows, then the cache commit.
    fn accept(
        &mut self,
        drafted: &[usize],
        tree: &DraftTree,
        step: &Chosen,
        first_row: usize,
        n_rows: usize,
    ) -> Result<Vec<Emitted>> {
        let started = Instant::now();
        let argmax: Vec<i32> = step.tokens[first_row..].iter().map(|&t| t as i32).collect();
        let acc = accept_from_argmax(tree, &argmax)?;
        self.stats.stages.accept += started.elapsed();
        let width = acc.depth + 1;
        let paths: Vec<Vec<usize>> = (0..drafted.len())
            .map(|b| {
                let a = acc.accept_len[b] as usize;
                acc.accept_rows[b * width..b * width + a + 1].iter().map(|&r| r as usize).collect()
            })
            .collect();
        let commits: Vec<TreeCommit> =
            drafted.iter().zip(&paths).map(|(&i, rows)| TreeCommit { seq: self.active[i].seq, rows }).collect();
        let committed = Instant::now();
        self.model.commit_trees(&mut self.cache, &commits, n_rows)?;
        self.stats.stages.compaction += committed.elapsed();
        self.auto.observe_verify_overhead(started.elapsed().as_secs_f64());
        self.auto.observe(acc.accept_len[..drafted.len()].iter().map(|&a| a as usize).sum());
        let mut emitted = Vec::with_capacity(drafted.len());
        for (b, &i) in drafted.iter().enumerate() {
            let a = acc.accept_len[b] as usize;
            self.stats.drafts += 1;
            self.stats.draft_tokens += tree.num_nodes[b] as u64;
            self.stats.accepted += a as u64;
            for d in 0..a {
                self.stats.accepted_by_depth[d] += 1;
            }
            let base = first_row + b * n_rows;
            self.active[i].features.extend(step.features(paths[b].iter().map(|&r| base + r)));
            emitted.push(Emitted {
                active: i,
                tokens: acc.emitted[b * width..b * width + a + 1].iter().map(|&t| t as u32).collect(),
                rows: paths[b].iter().map(|&r| base + r).collect(),
            });
        }
        Ok(emitted)
    }

    /// Applies stop tokens and max_tokens to the emitted tokens, extends the histories, and removes the
    /// requests that ended.
    fn finish(&mut self, (emitted, step): (Vec<Emitted>, Chosen)) -> Result<Vec<StepOutput>> {
        let mut out = Vec::with_capacity(emitted.len());
        let mut ended = Vec::new();
        let now = Instant::now();
        for Emitted { active: i, tokens, rows } in emitted {
            let a = &mut self.active[i];
            a.first_token.get_or_insert(now);
            a.history.extend(&tokens);
            let mut kept = tokens;
            let mut finished = None;
            if let Some(p) = kept.iter().position(|t| a.params.stop_tokens.contains(t)) {
                kept.truncate(p);
                finished = Some(FinishReason::Stop);
            }
            let left = a.params.max_tokens - a.generated;
            if kept.len() >= left {
                kept.truncate(left);
                finished = finished.or(Some(FinishReason::Length));
            }
            a.generated += kept.len();
            self.stats.tokens += kept.len() as u64;
            if finished.is_some() {
                ended.push(i);
            }
            let logprobs = match a.params.logprobs {
                Some(top) => kept.iter().zip(&rows).map(|(&t, &r)| step.logprob(r, t, top)).collect::<Result<_>>()?,
                None => Vec::new(),
            };
            out.push(StepOutput { id: a.id, tokens: kept, logprobs, finished });
        }
        ended.sort_unstable();
        for i in ended.into_iter().rev() {
            let a = self.active.remove(i);
            self.record_latency(&a, now);
            self.proposer.release(a.id)?;
            self.cache.remove_sequence(a.seq)?;
        }
        Ok(out)
    }

    /// Adds a finished request's time to first token and time per output token to the stats.
    fn record_latency(&mut self, a: &Active, now: Instant) {
        let first = a.first_token.unwrap_or(now);
        self.stats.finished += 1;
        self.stats.ttft_total += first - a.added;
        if a.generated >= 2 {
            self.stats.tpot_total += (now - first) / (a.generated - 1) as u32;
            self.stats.tpot_requests += 1;
        }
    }
}

/// A request's new tokens of a step and, for each, the step row whose distribution chose it.
struct Emitted {
    active: usize,
    tokens: Vec<u32>,
    rows: Vec<usize>,
}

/// A step's chosen tokens, the returned rows' logits when a request needed them, and, when the proposer
/// reads them, every step token's hidden states.
struct Chosen {
    tokens: Vec<u32>,
    /// `[rows, vocab]`, or empty.
    logits: Vec<f32>,
    vocab: usize,
    /// `[layers, step_tokens, hidden]`.
    hidden: Vec<f32>,
    layers: usize,
    step_tokens: usize,
    hidden_size: usize,
}

impl Chosen {
    /// The log-probability of `token` under row `row`'s distribution, with the `top` most likely tokens.
    fn logprob(&self, row: usize, token: u32, top: usize) -> Result<TokenLogprob> {
        let logits = self.logits.get(row * self.vocab..(row + 1) * self.vocab).ok_or_else(|| Error::Index {
            name: "logprobs",
            detail: format!("row {row} of the step was not read back"),
        })?;
        let lse =
            crate::cpu::topk::row_lse(logits).map_err(|problem| Error::Logits { name: "logits", row, problem })?;
        let mut order: Vec<u32> = (0..self.vocab as u32).collect();
        let by_logit = |a: &u32, b: &u32| logits[*b as usize].total_cmp(&logits[*a as usize]).then(a.cmp(b));
        if top > 0 && top < order.len() {
            order.select_nth_unstable_by(top - 1, by_logit);
        }
        order.truncate(top);
        order.sort_unstable_by(by_logit);
        Ok(TokenLogprob {
            token,
            logprob: logits[token as usize] - lse,
            top: order.into_iter().map(|t| (t, logits[t as usize] - lse)).collect(),
        })
    }

    /// The context features of the step tokens `tokens`: per token its layers' hidden states one after
    /// another (empty when the step read none).
    fn features(&self, tokens: impl IntoIterator<Item = usize>) -> Vec<f32> {
        let (t, h) = (self.step_tokens, self.hidden_size);
        let mut out = Vec::new();
        if self.layers == 0 {
            return out;
        }
        for j in tokens {
            for l in 0..self.layers {
                out.extend_from_slice(&self.hidden[(l * t + j) * h..(l * t + j + 1) * h]);
            }
        }
        out
    }
}

/// Runs a step and picks each returned row's token: the argmax of a greedy request's row (on the
/// backend when no request in the step samples), a sample of a sampling request's row at the position
/// `rows[r].1` predicts. `rows[r].0` is the row's request (an index into `active`). With `layers`, the
/// step also returns every token's hidden states there.
fn choose<B: Backend, T: Target<B>>(
    model: &T,
    cache: &mut T::Cache,
    active: &[Active],
    requests: &[StepRequest],
    which: Logits,
    rows: &[(usize, usize)],
    layers: &[usize],
) -> Result<Chosen> {
    let needs = |p: &RequestParams| p.sampling.is_some() || p.logprobs.is_some();
    let sampling = rows.iter().any(|&(i, _)| needs(&active[i].params));
    let mut chosen = Chosen {
        tokens: Vec::new(),
        logits: Vec::new(),
        vocab: model.config().vocab_size,
        hidden: Vec::new(),
        layers: layers.len(),
        step_tokens: requests.iter().map(|r| r.tokens.len()).sum(),
        hidden_size: model.config().hidden_size,
    };
    let logits = match (layers.is_empty(), sampling) {
        (true, false) => {
            chosen.tokens = model.step_argmax(cache, requests, which)?;
            return Ok(chosen);
        }
        (true, true) => model.step(cache, requests, which)?,
        (false, _) => {
            let step = model.step_hidden(cache, requests, which, layers, sampling)?;
            chosen.hidden = step.hidden;
            if !sampling {
                chosen.tokens = step.argmax;
                return Ok(chosen);
            }
            step.logits
        }
    };
    let vocab = model.config().vocab_size;
    for (row, &(i, position)) in logits.chunks(vocab).zip(rows) {
        chosen.tokens.push(match &active[i].params.sampling {
            Some(s) => s.choose(row, position),
            None => {
                let mut best = [0i32];
                crate::cpu::rowops::argmax(row, vocab, &mut best)?;
                best[0] as u32
            }
        });
    }
    chosen.logits = logits;
    Ok(chosen)
}

/// A batch of trees as the model step takes them: per row its token, depth and visibility words.
#[derive(Default)]
struct TreeRows {
    tokens: Vec<u32>,
    depth: Vec<u32>,
    visibility: Vec<u32>,
    words: usize,
}

impl TreeRows {
    /// The rows of `tree`. A padding row (past a tree's nodes) becomes a child of the root that nothing
    /// accepts, so that every row attends to something.
    fn of(tree: &DraftTree) -> TreeRows {
        let (n, words) = (tree.shape.rows(), tree.shape.words());
        let mut rows = TreeRows { words, ..TreeRows::default() };
        for b in 0..tree.shape.bs {
            let base = b * n;
            for i in 0..n {
                let valid = i <= tree.num_nodes[b] as usize;
                let token = if valid { tree.node_token[base + i] } else { tree.node_token[base] };
                rows.tokens.push(token as u32);
                rows.depth.push(if valid { tree.node_depth[base + i] as u32 } else { 1 });
                let bits = &tree.visibility[(base + i) * words..(base + i + 1) * words];
                if valid {
                    rows.visibility.extend_from_slice(bits);
                } else {
                    let mut own = vec![0u32; words];
                    own[0] |= 1;
                    own[i / 32] |= 1 << (i % 32);
                    rows.visibility.extend(own);
                }
            }
        }
        rows
    }
}

fn last(history: &[u32]) -> &[u32] {
    &history[history.len() - 1..]
}

fn unknown(id: RequestId) -> Error {
    Error::Index { name: "request", detail: format!("no request {id} in flight") }
}
