//! Running one model over several devices (ENGINE.md §10): tensor parallelism for attention (heads
//! split) and the dense MLPs (intermediate features split), expert parallelism for the routed experts
//! (each rank holds a contiguous share), with one sum over the ranks after each attention block and each
//! feed-forward block. The embedding, the norms, the latent projections and the router are whole on
//! every rank, so after each sum every rank holds the same hidden states. lm_head is split by vocabulary
//! rows when the ranks divide the vocabulary (each rank's logits GEMM reads its share, then the logits are
//! gathered; rank 0 also keeps the whole head for a drafter beside it), so every rank ends with the same
//! logits and rank 0's outputs are the model's.
//!
//! The sum runs in rank order (`((x₀ + x₁) + x₂) + …`, per element) on every rank, so a row's result
//! depends neither on the batch nor on which rank computes it: the batch invariance of DESIGN.md §4.5
//! survives the split. Against one device the split changes the order of the additions inside the
//! split products (each rank's partial sum, then the ranks), so logits agree within rounding, not bit
//! for bit; with one rank the path is the single-device one, bit for bit.
//!
//! Pipeline parallelism ([`pipeline`]) splits the layers into stages on top of that: a [`Layout`] of
//! `tensor × pipeline` ranks, each stage a tensor-parallel group of its own, a step's requests cut into
//! micro-batches that flow through the stages one after another.
//!
//! [`Collective`] is the sum (and the logits' gather), per backend: [`ThreadGroup`] for CPU ranks in
//! threads of one process, and, with the `cuda` feature, [`nccl::NcclGroup`] for GPUs through NCCL
//! (loaded at run time, like the driver). [`ShardedModel`] holds one [`Model`] per rank and runs a step
//! on all of them at once.

#[cfg(feature = "cuda")]
pub mod nccl;
pub mod pipeline;
mod thread_group;

use std::ops::Range;
use std::path::Path;
use std::sync::Arc;

pub use pipeline::Layout;
pub use thread_group::ThreadGroup;

use crate::cpu::backend::CpuBackend;
use crate::error::{Error, Result};
use crate::model::backend::Backend;
use crate::model::config::Config;
use crate::model::weights::Checkpoint;
use crate::model::{HiddenStep, KvCache, Logits, Model, StageTime, StepRequest, TreeCommit};
use pipeline::{micro_batches, Mailbox, StageLinks};

/// One rank's place in a group of `world` ranks.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Shard {
    /// This rank, `0 .. world`.
    pub rank: usize,
    /// Ranks in the group.
    pub world: usize,
}

impl Shard {
    /// The whole model on one rank.
    pub const WHOLE: Shard = Shard { rank: 0, world: 1 };

    /// This rank's contiguous share of `len` items (heads, features, experts) named `name`; an error when
    /// they do not split evenly.
    pub fn range(&self, name: &'static str, len: usize) -> Result<Range<usize>> {
        if len == 0 || !len.is_multiple_of(self.world) {
            return Err(Error::param(
                name,
                len,
                format!("must be a positive multiple of the {} ranks to split over them", self.world),
            ));
        }
        let each = len / self.world;
        Ok(self.rank * each..(self.rank + 1) * each)
    }
}

/// The sum over a group's ranks that a split model needs, for buffers of backend `B`.
pub trait Collective<B: Backend>: Send + Sync {
    /// This rank's place in the group.
    fn shard(&self) -> Shard;

    /// Replaces `x[..n]` on every rank by the element-wise sum of every rank's `x[..n]`, added in rank
    /// order from rank 0: the same bits on every rank, whatever else the buffers hold. Every rank of the
    /// group must call it, in the same order, with the same `n`.
    fn all_reduce(&self, backend: &B, x: &mut B::Buf<f32>, n: usize) -> Result<()>;

    /// Writes every rank's `x[..n]` into `out[..world * n]` on every rank, rank 0's first. Every rank of
    /// the group must call it, in the same order, with the same `n`.
    fn all_gather(&self, backend: &B, x: &B::Buf<f32>, n: usize, out: &mut B::Buf<f32>) -> Result<()>;

    /// Changes whenever the group reallocates a buffer that a recorded graph holds the address of.
    fn epoch(&self) -> u64 {
        0
    }

    /// Ends every collective waiting now or later on any rank with an error, until [`Collective::reset`]:
    /// a rank failed, so the others would wait for it forever.
    fn abort(&self) {}

    /// Readies the group for the next step after an aborted one; called when no rank is in a collective.
    fn reset(&self) {}
}

/// The error of a collective that another rank's failure ended.
fn aborted() -> Error {
    Error::param("collective", "aborted", "another rank of the group failed during this step")
}

fn is_abort(e: &Error) -> bool {
    matches!(e, Error::Param { name: "collective", value, .. } if value == "aborted")
}

/// A model split over ranks by a [`Layout`], one [`Model`] per rank, each on its own backend.
pub struct ShardedModel<B: Backend> {
    ranks: Vec<Model<B>>,
    layout: Layout,
    /// Stage `s`'s tensor rank `t` hands its rows to stage `s + 1`'s through entry `s * tensor + t`.
    mailboxes: Vec<Arc<Mailbox>>,
    micro_batches: usize,
}

/// The KV caches of a [`ShardedModel`]: every rank holds the whole latent cache (every head reads every
/// latent row), kept in step.
pub struct ShardedCache<B: Backend> {
    ranks: Vec<KvCache<B>>,
}

impl ShardedModel<CpuBackend> {
    /// Loads a checkpoint directory split by `layout` over CPU ranks in threads of this process.
    pub fn load_cpu(dir: impl AsRef<Path>, layout: Layout) -> Result<Self> {
        check_layout(dir.as_ref(), layout)?;
        Self::load(dir, layout, cpu_ranks(layout)?)
    }
}

/// Most CPU ranks [`cpu_ranks`] makes (threads of this process).
pub const MAX_CPU_RANKS: usize = 1024;

/// A backend and its stage's tensor-parallel group on the CPU.
pub type CpuRank = (CpuBackend, Arc<dyn Collective<CpuBackend>>);

/// CPU ranks for `layout`, stage by stage: each stage's tensor ranks a [`ThreadGroup`].
pub fn cpu_ranks(layout: Layout) -> Result<Vec<CpuRank>> {
    layout.check_ranks()?;
    if layout.ranks() > MAX_CPU_RANKS {
        return Err(Error::param("tensor × pipeline", layout.ranks(), format!("at most {MAX_CPU_RANKS} CPU ranks")));
    }
    let mut ranks = Vec::with_capacity(layout.ranks());
    for _ in 0..layout.pipeline {
        let groups = ThreadGroup::new(layout.tensor)?;
        ranks.extend(groups.into_iter().map(|g| (CpuBackend, Arc::new(g) as Arc<dyn Collective<CpuBackend>>)));
    }
    Ok(ranks)
}

#[cfg(feature = "cuda")]
impl ShardedModel<crate::cuda::backend::CudaBackend> {
    /// Loads a checkpoint directory split by `layout` over the GPUs `ordinals` ([`cuda_ranks`]).
    pub fn load_cuda(dir: impl AsRef<Path>, layout: Layout, ordinals: &[usize]) -> Result<Self> {
        check_layout(dir.as_ref(), layout)?;
        Self::load(dir, layout, cuda_ranks(layout, ordinals)?)
    }
}

/// A backend and its stage's tensor-parallel group on a GPU.
#[cfg(feature = "cuda")]
pub type CudaRank = (crate::cuda::backend::CudaBackend, Arc<dyn Collective<crate::cuda::backend::CudaBackend>>);

/// GPU ranks for `layout` on the GPUs `ordinals` (rank order: stage by stage), each stage's ranks an
/// NCCL group. A GPU may serve several stages of one rank each (their rows pass through the host);
/// with more ranks a stage, one rank a GPU.
#[cfg(feature = "cuda")]
pub fn cuda_ranks(layout: Layout, ordinals: &[usize]) -> Result<Vec<CudaRank>> {
    use crate::cuda::backend::CudaBackend;
    layout.check_ranks()?;
    if ordinals.len() != layout.ranks() {
        return Err(Error::param(
            "ordinals",
            format!("{ordinals:?}"),
            format!("the layout {layout:?} needs {} GPUs, one a rank", layout.ranks()),
        ));
    }
    // Communicators of two stages on one device, used at once from two threads, may deadlock unless
    // their operations are issued in one order; stages of one rank each have none that wait.
    let twice = |gpus: &[usize]| (1..gpus.len()).find(|&i| gpus[..i].contains(&gpus[i])).map(|i| gpus[i]);
    if let Some(gpu) = (layout.tensor > 1).then(|| twice(ordinals)).flatten() {
        return Err(Error::param(
            "ordinals",
            format!("{ordinals:?}"),
            format!("GPU {gpu} is named twice: with {} ranks a stage, one rank a GPU", layout.tensor),
        ));
    }
    let mut ranks = Vec::with_capacity(ordinals.len());
    for stage in ordinals.chunks(layout.tensor) {
        let backends: Vec<CudaBackend> =
            stage.iter().map(|&o| CudaBackend::new(crate::cuda::Gpu::new(o)?)).collect::<Result<_>>()?;
        let groups = nccl::NcclGroup::new(&backends)?;
        ranks.extend(
            backends.into_iter().zip(groups).map(|(b, g)| (b, Arc::new(g) as Arc<dyn Collective<CudaBackend>>)),
        );
    }
    Ok(ranks)
}

impl<B: Backend> ShardedModel<B> {
    /// Loads a checkpoint directory split by `layout` over `ranks` (a backend and its stage's
    /// tensor-parallel group, stage by stage, in rank order).
    pub fn load(dir: impl AsRef<Path>, layout: Layout, ranks: Vec<(B, Arc<dyn Collective<B>>)>) -> Result<Self> {
        let dir = dir.as_ref();
        let config = Config::from_file(dir.join("config.json"))?;
        layout.check(config.num_hidden_layers)?;
        check_groups(layout, &ranks)?;
        let (links, mailboxes) = stage_links(layout, config.num_hidden_layers);
        let mut models = Vec::with_capacity(ranks.len());
        for ((backend, group), links) in ranks.into_iter().zip(links) {
            // Each rank its own view of the (memory-mapped) files, so each checks that it read them all.
            let ckpt = Checkpoint::open(dir)?;
            models.push(Model::from_checkpoint_stage(config.clone(), &ckpt, backend, group, links)?);
        }
        Ok(ShardedModel { ranks: models, layout, mailboxes, micro_batches: layout.pipeline })
    }

    /// A model of `config`'s shape with random weights ([`Model::random`]) split by `layout` over
    /// `ranks` (as [`ShardedModel::load`] takes them: [`cpu_ranks`], or `cuda_ranks` with `cuda`), for
    /// measuring the split at real dimensions. Each rank has its own weights: the outputs mean nothing.
    pub fn random(config: Config, layout: Layout, ranks: Vec<(B, Arc<dyn Collective<B>>)>, seed: u64) -> Result<Self> {
        layout.check(config.num_hidden_layers)?;
        check_groups(layout, &ranks)?;
        let (links, mailboxes) = stage_links(layout, config.num_hidden_layers);
        let models = ranks
            .into_iter()
            .zip(links)
            .enumerate()
            .map(|(rank, ((b, group), links))| {
                Model::random_stage(config.clone(), b, seed.wrapping_add(rank as u64), Some(group), links)
            })
            .collect::<Result<_>>()?;
        Ok(ShardedModel { ranks: models, layout, mailboxes, micro_batches: layout.pipeline })
    }

    /// How the model is split.
    pub fn layout(&self) -> Layout {
        self.layout
    }

    /// Cuts each step into at most `count` micro-batches of whole requests (default: one per pipeline
    /// stage), so that the stages work on different requests at once. Rows do not depend on their batch,
    /// so the outputs are the same bits for every count. Without stages there is nothing to overlap, and
    /// a step stays whole.
    pub fn set_micro_batches(&mut self, count: usize) -> Result<()> {
        if count == 0 {
            return Err(Error::param("micro_batches", 0, "a step is cut into at least one micro-batch"));
        }
        self.micro_batches = count;
        Ok(())
    }

    /// The ranks' models, rank 0 (the first stage's) first.
    pub fn ranks(&self) -> &[Model<B>] {
        &self.ranks
    }

    /// The model's configuration (of the whole model).
    pub fn config(&self) -> &Config {
        self.ranks[0].config()
    }

    /// Turns graph replay on or off on every rank ([`Model::set_graphs`]).
    pub fn set_graphs(&self, enabled: bool) {
        self.ranks.iter().for_each(|m| m.set_graphs(enabled));
    }

    /// A KV cache on every rank ([`Model::new_cache`]).
    pub fn new_cache(&self, num_pages: usize, page_size: usize, max_seq_len: usize) -> Result<ShardedCache<B>> {
        let ranks = self.ranks.iter().map(|m| m.new_cache(num_pages, page_size, max_seq_len)).collect::<Result<_>>()?;
        Ok(ShardedCache { ranks })
    }

    /// [`Model::step`] on every rank at once; the last stage's logits.
    pub fn step(&self, cache: &mut ShardedCache<B>, requests: &[StepRequest], which: Logits) -> Result<Vec<f32>> {
        let runs = self.micro_batches(requests);
        let mut parts = self.on_every_rank(cache, requests, &runs, |m, c, r| m.stage_step(c, r, which))?;
        Ok(parts.swap_remove(self.last_rank()).concat())
    }

    /// [`Model::step_argmax`] on every rank at once; the last stage's tokens.
    pub fn step_argmax(
        &self,
        cache: &mut ShardedCache<B>,
        requests: &[StepRequest],
        which: Logits,
    ) -> Result<Vec<u32>> {
        let runs = self.micro_batches(requests);
        let mut parts = self.on_every_rank(cache, requests, &runs, |m, c, r| m.stage_step_argmax(c, r, which))?;
        Ok(parts.swap_remove(self.last_rank()).concat())
    }

    /// [`Model::step_hidden`] on every rank at once: each layer's hidden states from the stage that holds
    /// it, argmax and logits from the last stage.
    pub fn step_hidden(
        &self,
        cache: &mut ShardedCache<B>,
        requests: &[StepRequest],
        which: Logits,
        layers: &[usize],
        logits: bool,
    ) -> Result<HiddenStep> {
        let runs = self.micro_batches(requests);
        let parts =
            self.on_every_rank(cache, requests, &runs, |m, c, r| m.stage_step_hidden(c, r, which, layers, logits))?;
        let last = &parts[self.last_rank()];
        let h = self.config().hidden_size;
        let mut hidden = Vec::new();
        for (k, &layer) in layers.iter().enumerate() {
            let stage = self.stage_of(layer);
            // The stage's blocks are the layers asked for that it holds, in the order asked.
            let block = layers[..k].iter().filter(|&&l| self.stage_of(l) == stage).count();
            for (run, part) in runs.iter().zip(&parts[stage * self.layout.tensor]) {
                let n = run.iter().map(|r| r.tokens.len()).sum::<usize>() * h;
                hidden.extend_from_slice(&part.hidden[block * n..(block + 1) * n]);
            }
        }
        Ok(HiddenStep {
            argmax: last.iter().flat_map(|p| p.argmax.iter().copied()).collect(),
            logits: last.iter().flat_map(|p| p.logits.iter().copied()).collect(),
            hidden,
        })
    }

    /// [`Model::profile_step`] on every rank at once, one micro-batch: tensor rank 0's stage times of
    /// each stage, stage by stage (its layers; the sums over its group in [`crate::model::Stage::Communication`]).
    /// With several stages on one device their times add up to what one stage would take.
    pub fn profile_step(
        &self,
        cache: &mut ShardedCache<B>,
        requests: &[StepRequest],
        which: Logits,
    ) -> Result<Vec<StageTime>> {
        let parts = self.on_every_rank(cache, requests, &[requests], |m, c, r| m.stage_profile_step(c, r, which))?;
        Ok(parts.into_iter().step_by(self.layout.tensor).flatten().flatten().collect())
    }

    /// The runs of requests a step is cut into ([`ShardedModel::set_micro_batches`]).
    fn micro_batches<'r, 'a>(&self, requests: &'r [StepRequest<'a>]) -> Vec<&'r [StepRequest<'a>]> {
        let count = if self.layout.pipeline > 1 { self.micro_batches } else { 1 };
        micro_batches(requests, count)
    }

    /// The rank whose outputs are the model's: tensor rank 0 of the last stage.
    fn last_rank(&self) -> usize {
        (self.layout.pipeline - 1) * self.layout.tensor
    }

    /// The stage that holds layer `layer`.
    fn stage_of(&self, layer: usize) -> usize {
        let layers = self.config().num_hidden_layers;
        (0..self.layout.pipeline).find(|&s| self.layout.stage_layers(s, layers).contains(&layer)).unwrap_or(0)
    }

    /// [`KvCache::commit_trees`] on every rank (no rank waits for another: nothing is summed).
    pub fn commit_trees(&self, cache: &mut ShardedCache<B>, commits: &[TreeCommit], n_rows: usize) -> Result<()> {
        self.check_ranks(cache)?;
        self.ranks.iter().zip(&mut cache.ranks).try_for_each(|(m, c)| c.commit_trees(m.backend(), commits, n_rows))
    }

    fn check_ranks(&self, cache: &ShardedCache<B>) -> Result<()> {
        if cache.ranks.len() != self.ranks.len() {
            return Err(Error::param("cache", cache.ranks.len(), format!("must have {} ranks", self.ranks.len())));
        }
        Ok(())
    }

    /// Runs `f` on every rank for each run of requests in turn, each rank in its own thread (the
    /// collectives and the stages need them all at once), and returns every rank's results, `[rank][run]`,
    /// or the first error in rank order. A step cut into several runs is checked whole and its cache
    /// pages reserved on every rank first, so a bad request fails before any run has moved a cache (one
    /// run checks itself before it moves anything); after a failure later on,
    /// every rank's sequences are set back to their lengths before the step. A rank that fails (or
    /// panics) aborts its own group and every mailbox, so the others return instead of waiting for it:
    /// the other stages fail at their next hand-over, where all their ranks stand at once, never inside
    /// a collective.
    fn on_every_rank<T: Send>(
        &self,
        cache: &mut ShardedCache<B>,
        requests: &[StepRequest],
        runs: &[&[StepRequest]],
        f: impl Fn(&Model<B>, &mut KvCache<B>, &[StepRequest]) -> Result<T> + Sync,
    ) -> Result<Vec<Vec<T>>> {
        self.check_ranks(cache)?;
        // One run is checked whole by the step itself; several are checked here first, once.
        if runs.len() > 1 {
            for (model, cache) in self.ranks.iter().zip(&mut cache.ranks) {
                model.check_step(cache, requests)?;
            }
        }
        let every_run = |model: &Model<B>, cache: &mut KvCache<B>| -> Result<Vec<T>> {
            runs.iter().map(|run| f(model, cache, run)).collect()
        };
        if self.ranks.len() == 1 {
            return Ok(vec![every_run(&self.ranks[0], &mut cache.ranks[0])?]);
        }
        let lengths: Vec<(usize, usize)> =
            requests.iter().map(|r| Ok((r.seq, cache.ranks[0].len(r.seq)?))).collect::<Result<_>>()?;
        let results: Vec<Result<Vec<T>>> = std::thread::scope(|scope| {
            let handles: Vec<_> = self
                .ranks
                .iter()
                .zip(cache.ranks.iter_mut())
                .map(|(model, cache)| {
                    let every_run = &every_run;
                    scope.spawn(move || {
                        let result = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| every_run(model, cache)));
                        if !matches!(result, Ok(Ok(_))) {
                            self.abort_after_failure(model);
                        }
                        result.unwrap_or_else(|p| std::panic::resume_unwind(p))
                    })
                })
                .collect();
            handles.into_iter().map(|h| h.join().unwrap_or_else(|p| std::panic::resume_unwind(p))).collect()
        });
        if results.iter().any(|r| r.is_err()) {
            self.reset_all();
            for c in &mut cache.ranks {
                lengths.iter().for_each(|&(seq, len)| c.truncate(seq, len));
            }
        }
        // The error that made the others abort, rather than one of their aborts.
        let mut oks = Vec::new();
        let mut aborted = None;
        for r in results {
            match r {
                Ok(v) => oks.push(v),
                Err(e) if is_abort(&e) => {
                    aborted.get_or_insert(e);
                }
                Err(e) => return Err(e),
            }
        }
        match aborted {
            Some(e) => Err(e),
            None => Ok(oks),
        }
    }

    /// After `failed` failed: ends the collectives of its own group (its peers stop at their next sum)
    /// and every hand-over between stages (every other stage stops at its next one). Another stage's
    /// group is left alone: its ranks may be inside a collective together, which NCCL cannot leave.
    fn abort_after_failure(&self, failed: &Model<B>) {
        failed.abort_group();
        self.mailboxes.iter().for_each(|m| m.abort());
    }

    /// Readies every group and mailbox for the next step after an aborted one.
    fn reset_all(&self) {
        self.ranks.iter().for_each(|m| m.reset_group());
        self.mailboxes.iter().for_each(|m| m.reset());
    }
}

/// That `ranks` are `layout`'s: as many, each entry's group its stage's, in rank order.
fn check_groups<B: Backend>(layout: Layout, ranks: &[(B, Arc<dyn Collective<B>>)]) -> Result<()> {
    if ranks.len() != layout.ranks() {
        return Err(Error::param(
            "ranks",
            ranks.len(),
            format!("the layout {layout:?} needs {} ranks", layout.ranks()),
        ));
    }
    let tensor = layout.tensor;
    for (rank, (_, group)) in ranks.iter().enumerate() {
        let (stage, t) = (rank / tensor, rank % tensor);
        if group.shard() != (Shard { rank: t, world: tensor }) {
            return Err(Error::param(
                "ranks",
                format!("{:?}", group.shard()),
                format!("entry {rank} must be rank {t} of a group of {tensor} (stage {stage})"),
            ));
        }
    }
    Ok(())
}

/// `layout` against the checkpoint's config in `dir`, before any rank is made: an error naming a part
/// that is zero, too large for the model (more stages than layers, more tensor ranks than heads) or
/// whose rank count overflows.
fn check_layout(dir: &Path, layout: Layout) -> Result<()> {
    let config = Config::from_file(dir.join("config.json"))?;
    layout.check(config.num_hidden_layers)?;
    if layout.tensor > config.num_attention_heads {
        return Err(Error::param(
            "tensor",
            layout.tensor,
            format!("at most the {} attention heads, each rank at least one", config.num_attention_heads),
        ));
    }
    Ok(())
}

/// Every rank's layers and mailboxes in `layout` over `layers` layers (rank order), and the mailboxes:
/// stage `s`'s tensor rank `t` hands its rows to stage `s + 1`'s through entry `s * tensor + t`.
fn stage_links(layout: Layout, layers: usize) -> (Vec<StageLinks>, Vec<Arc<Mailbox>>) {
    let tensor = layout.tensor;
    let mailboxes: Vec<Arc<Mailbox>> = (0..(layout.pipeline - 1) * tensor).map(|_| Arc::default()).collect();
    let links = (0..layout.ranks())
        .map(|rank| {
            let (stage, t) = (rank / tensor, rank % tensor);
            StageLinks {
                layers: layout.stage_layers(stage, layers),
                from_previous: stage.checked_sub(1).map(|p| mailboxes[p * tensor + t].clone()),
                to_next: (stage + 1 < layout.pipeline).then(|| mailboxes[stage * tensor + t].clone()),
            }
        })
        .collect();
    (links, mailboxes)
}

impl<B: Backend> ShardedCache<B> {
    /// Adds an empty sequence on every rank; its id.
    pub fn add_sequence(&mut self) -> usize {
        let ids: Vec<usize> = self.ranks.iter_mut().map(|c| c.add_sequence()).collect();
        debug_assert!(ids.windows(2).all(|w| w[0] == w[1]), "rank caches kept in step");
        ids[0]
    }

    /// Removes a sequence on every rank.
    pub fn remove_sequence(&mut self, id: usize) -> Result<()> {
        self.ranks.iter_mut().try_for_each(|c| c.remove_sequence(id))
    }

    /// A sequence's length.
    pub fn len(&self, id: usize) -> Result<usize> {
        self.ranks[0].len(id)
    }

    /// Pages not held by any sequence (the same on every rank).
    pub fn free_pages(&self) -> usize {
        self.ranks[0].free_pages()
    }

    /// Rows per page.
    pub fn page_size(&self) -> usize {
        self.ranks[0].page_size()
    }

    /// The longest sequence the cache holds.
    pub fn max_seq_len(&self) -> usize {
        self.ranks[0].max_seq_len()
    }
}
