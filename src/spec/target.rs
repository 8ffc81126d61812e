//! What the engine verifies drafts with: a [`Model`] on one device, or a [`ShardedModel`] split over
//! ranks (whose steps run on every rank at once and answer with rank 0's outputs). The engine, the
//! scheduler, lives on the host beside rank 0 and hands every rank the same step inputs.

use crate::error::Result;
use crate::model::backend::Backend;
use crate::model::config::Config;
use crate::model::{HiddenStep, KvCache, Logits, Model, StepRequest, TreeCommit};
use crate::parallel::{ShardedCache, ShardedModel};

/// A target model's step, as the engine uses it (see the [`Model`] methods of the same names).
pub trait Target<B: Backend>: Sync {
    /// The target's KV cache.
    type Cache: TargetCache;

    /// The model's configuration.
    fn config(&self) -> &Config;
    /// An empty KV cache.
    fn new_cache(&self, num_pages: usize, page_size: usize, max_seq_len: usize) -> Result<Self::Cache>;
    /// [`Model::step`].
    fn step(&self, cache: &mut Self::Cache, requests: &[StepRequest], which: Logits) -> Result<Vec<f32>>;
    /// [`Model::step_argmax`].
    fn step_argmax(&self, cache: &mut Self::Cache, requests: &[StepRequest], which: Logits) -> Result<Vec<u32>>;
    /// [`Model::step_hidden`].
    fn step_hidden(
        &self,
        cache: &mut Self::Cache,
        requests: &[StepRequest],
        which: Logits,
        layers: &[usize],
        logits: bool,
    ) -> Result<HiddenStep>;
    /// [`KvCache::commit_trees`] on the target's backend (every rank's).
    fn commit_trees(&self, cache: &mut Self::Cache, commits: &[TreeCommit], n_rows: usize) -> Result<()>;
}

/// A target's KV cache, as the engine uses it (see the [`KvCache`] methods of the same names).
pub trait TargetCache: Send {
    /// Adds an empty sequence; its id.
    fn add_sequence(&mut self) -> usize;
    /// Removes a sequence, freeing its pages.
    fn remove_sequence(&mut self, id: usize) -> Result<()>;
    /// Pages not held by any sequence.
    fn free_pages(&self) -> usize;
    /// Rows per page.
    fn page_size(&self) -> usize;
    /// The longest sequence the cache holds.
    fn max_seq_len(&self) -> usize;
}

impl<B: Backend> Target<B> for Model<B> {
    type Cache = KvCache<B>;

    fn config(&self) -> &Config {
        Model::config(self)
    }

    fn new_cache(&self, num_pages: usize, page_size: usize, max_seq_len: usize) -> Result<KvCache<B>> {
        Model::new_cache(self, num_pages, page_size, max_seq_len)
    }

    fn step(&self, cache: &mut KvCache<B>, requests: &[StepRequest], which: Logits) -> Result<Vec<f32>> {
        Model::step(self, cache, requests, which)
    }

    fn step_argmax(&self, cache: &mut KvCache<B>, requests: &[StepRequest], which: Logits) -> Result<Vec<u32>> {
        Model::step_argmax(self, cache, requests, which)
    }

    fn step_hidden(
        &self,
        cache: &mut KvCache<B>,
        requests: &[StepRequest],
        which: Logits,
        layers: &[usize],
        logits: bool,
    ) -> Result<HiddenStep> {
        Model::step_hidden(self, cache, requests, which, layers, logits)
    }

    fn commit_trees(&self, cache: &mut KvCache<B>, commits: &[TreeCommit], n_rows: usize) -> Result<()> {
        cache.commit_trees(self.backend(), commits, n_rows)
    }
}

impl<B: Backend> TargetCache for KvCache<B> {
    fn add_sequence(&mut self) -> usize {
        KvCache::add_sequence(self)
    }

    fn remove_sequence(&mut self, id: usize) -> Result<()> {
        KvCache::remove_sequence(self, id)
    }

    fn free_pages(&self) -> usize {
        KvCache::free_pages(self)
    }

    fn page_size(&self) -> usize {
        KvCache::page_size(self)
    }

    fn max_seq_len(&self) -> usize {
        KvCache::max_seq_len(self)
    }
}

impl<B: Backend> Target<B> for ShardedModel<B> {
    type Cache = ShardedCache<B>;

    fn config(&self) -> &Config {
        ShardedModel::config(self)
    }

    fn new_cache(&self, num_pages: usize, page_size: usize, max_seq_len: usize) -> Result<ShardedCache<B>> {
        ShardedModel::new_cache(self, num_pages, page_size, max_seq_len)
    }

    fn step(&self, cache: &mut ShardedCache<B>, requests: &[StepRequest], which: Logits) -> Result<Vec<f32>> {
        ShardedModel::step(self, cache, requests, which)
    }

    fn step_argmax(&self, cache: &mut ShardedCache<B>, requests: &[StepRequest], which: Logits) -> Result<Vec<u32>> {
        ShardedModel::step_argmax(self, cache, requests, which)
    }

    fn step_hidden(
        &self,
        cache: &mut ShardedCache<B>,
        requests: &[StepRequest],
        which: Logits,
        layers: &[usize],
        logits: bool,
    ) -> Result<HiddenStep> {
        ShardedModel::step_hidden(self, cache, requests, which, layers, logits)
    }

    fn commit_trees(&self, cache: &mut ShardedCache<B>, commits: &[TreeCommit], n_rows: usize) -> Result<()> {
        ShardedModel::commit_trees(self, cache, commits, n_rows)
    }
}

impl<B: Backend> TargetCache for ShardedCache<B> {
    fn add_sequence(&mut self) -> usize {
        ShardedCache::add_sequence(self)
    }

    fn remove_sequence(&mut self, id: usize) -> Result<()> {
        ShardedCache::remove_sequence(self, id)
    }

    fn free_pages(&self) -> usize {
        ShardedCache::free_pages(self)
    }

    fn page_size(&self) -> usize {
        ShardedCache::page_size(self)
    }

    fn max_seq_len(&self) -> usize {
        ShardedCache::max_seq_len(self)
    }
}
