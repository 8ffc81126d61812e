//! Running one model over several devices (ENGINE.md §10): tensor parallelism for attention (heads
//! split) and the dense MLPs (intermediate features split), expert parallelism for the routed experts
//! (each rank holds a contiguous share), with one sum over the ranks after each attention block and each
//! feed-forward block. The embedding, the norms, the latent projections, the router and lm_head are whole
//! on every rank, so after each sum every rank holds the same hidden states and rank 0's outputs are the
//! model's.
//!
//! The sum runs in rank order (`((x₀ + x₁) + x₂) + …`, per element) on every rank, so a row's result
//! depends neither on the batch nor on which rank computes it: the batch invariance of DESIGN.md §4.5
//! survives the split. Against one device the split changes the order of the additions inside the
//! split products (each rank's partial sum, then the ranks), so logits agree within rounding, not bit
//! for bit; with one rank the path is the single-device one, bit for bit.
//!
//! [`Collective`] is the sum, per backend: [`ThreadGroup`] for CPU ranks in threads of one process,
//! and, with the `cuda` feature, [`nccl::NcclGroup`] for GPUs through NCCL (loaded at run time, like the
//! driver). [`ShardedModel`] holds one [`Model`] per rank and runs a step on all of them at once.

#[cfg(feature = "cuda")]
pub mod nccl;
mod thread_group;

use std::ops::Range;
use std::path::Path;
use std::sync::Arc;

pub use thread_group::ThreadGroup;

use crate::cpu::backend::CpuBackend;
use crate::error::{Error, Result};
use crate::model::backend::Backend;
use crate::model::config::Config;
use crate::model::weights::Checkpoint;
use crate::model::{HiddenStep, KvCache, Logits, Model, StepRequest, TreeCommit};

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

/// A model split over the ranks of a group, one [`Model`] per rank, each on its own backend.
pub struct ShardedModel<B: Backend> {
    ranks: Vec<Model<B>>,
}

/// The KV caches of a [`ShardedModel`]: every rank holds the whole latent cache (every head reads every
/// latent row), kept in step.
pub struct ShardedCache<B: Backend> {
    ranks: Vec<KvCache<B>>,
}

impl ShardedModel<CpuBackend> {
    /// Loads a checkpoint directory split over `world` CPU ranks in threads of this process.
    pub fn load_cpu(dir: impl AsRef<Path>, world: usize) -> Result<Self> {
        let groups = ThreadGroup::new(world)?;
        let ranks = groups.into_iter().map(|g| (CpuBackend, Arc::new(g) as Arc<dyn Collective<CpuBackend>>));
        Self::load(dir, ranks.collect())
    }
}

#[cfg(feature = "cuda")]
impl ShardedModel<crate::cuda::backend::CudaBackend> {
    /// Loads a checkpoint directory split over the GPUs `ordinals` (rank order), summing through NCCL.
    pub fn load_cuda(dir: impl AsRef<Path>, ordinals: &[usize]) -> Result<Self> {
        use crate::cuda::backend::CudaBackend;
        if let Some(i) = (1..ordinals.len()).find(|&i| ordinals[..i].contains(&ordinals[i])) {
            return Err(Error::param(
                "ordinals",
                format!("{ordinals:?}"),
                format!("GPU {} is named twice: one rank a GPU", ordinals[i]),
            ));
        }
        let backends: Vec<CudaBackend> =
            ordinals.iter().map(|&o| CudaBackend::new(crate::cuda::Gpu::new(o)?)).collect::<Result<_>>()?;
        let groups = nccl::NcclGroup::new(&backends)?;
        let ranks = backends.into_iter().zip(groups).map(|(b, g)| (b, Arc::new(g) as Arc<dyn Collective<CudaBackend>>));
        Self::load(dir, ranks.collect())
    }
}

impl<B: Backend> ShardedModel<B> {
    /// Loads a checkpoint directory split over `ranks` (a backend and its place in the group, every rank
    /// of one group, in rank order).
    pub fn load(dir: impl AsRef<Path>, ranks: Vec<(B, Arc<dyn Collective<B>>)>) -> Result<Self> {
        let dir = dir.as_ref();
        let config = Config::from_file(dir.join("config.json"))?;
        let world = ranks.len();
        if world == 0 {
            return Err(Error::param("ranks", 0, "a split model needs at least one rank"));
        }
        let mut models = Vec::with_capacity(world);
        for (rank, (backend, group)) in ranks.into_iter().enumerate() {
            if group.shard() != (Shard { rank, world }) {
                return Err(Error::param(
                    "ranks",
                    format!("{:?}", group.shard()),
                    format!("entry {rank} must be rank {rank} of a group of {world}"),
                ));
            }
            // Each rank its own view of the (memory-mapped) files, so each checks that it read them all.
            let ckpt = Checkpoint::open(dir)?;
            models.push(Model::from_checkpoint_sharded(config.clone(), &ckpt, backend, group)?);
        }
        Ok(ShardedModel { ranks: models })
    }

    /// The ranks' models, rank 0 first.
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

    /// [`Model::step`] on every rank at once; rank 0's logits.
    pub fn step(&self, cache: &mut ShardedCache<B>, requests: &[StepRequest], which: Logits) -> Result<Vec<f32>> {
        self.on_every_rank(cache, |m, c| m.step(c, requests, which))
    }

    /// [`Model::step_argmax`] on every rank at once; rank 0's tokens.
    pub fn step_argmax(
        &self,
        cache: &mut ShardedCache<B>,
        requests: &[StepRequest],
        which: Logits,
    ) -> Result<Vec<u32>> {
        self.on_every_rank(cache, |m, c| m.step_argmax(c, requests, which))
    }

    /// [`Model::step_hidden`] on every rank at once; rank 0's outputs.
    pub fn step_hidden(
        &self,
        cache: &mut ShardedCache<B>,
        requests: &[StepRequest],
        which: Logits,
        layers: &[usize],
        logits: bool,
    ) -> Result<HiddenStep> {
        self.on_every_rank(cache, |m, c| m.step_hidden(c, requests, which, layers, logits))
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

    /// Runs `f` for every rank, each in its own thread (the collectives need them all at once), and
    /// returns rank 0's result, or the first error in rank order. A rank that fails aborts the group, so
    /// the others return instead of waiting for it.
    fn on_every_rank<T: Send>(
        &self,
        cache: &mut ShardedCache<B>,
        f: impl Fn(&Model<B>, &mut KvCache<B>) -> Result<T> + Sync,
    ) -> Result<T> {
        self.check_ranks(cache)?;
        if self.ranks.len() == 1 {
            return f(&self.ranks[0], &mut cache.ranks[0]);
        }
        let f = &f;
        let results: Vec<Result<T>> = std::thread::scope(|scope| {
            let handles: Vec<_> = self
                .ranks
                .iter()
                .zip(cache.ranks.iter_mut())
                .map(|(model, cache)| {
                    scope.spawn(move || {
                        let result = f(model, cache);
                        if result.is_err() {
                            model.abort_group();
                        }
                        result
                    })
                })
                .collect();
            handles.into_iter().map(|h| h.join().unwrap_or_else(|p| std::panic::resume_unwind(p))).collect()
        });
        if results.iter().any(|r| r.is_err()) {
            self.ranks.iter().for_each(|m| m.reset_group());
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
            None => Ok(oks.swap_remove(0)),
        }
    }
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
