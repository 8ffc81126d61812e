//! The DFlash drafter as a [`Proposer`]: it keeps one drafter context cache per request, writes the
//! context features the engine hands it, drafts the block after each request's bonus token, and gives
//! the masked positions' top-K (or just their argmax for a chain) as the proposal.

use std::collections::HashMap;

use crate::error::{Error, Result};
use crate::model::backend::Backend;
use crate::model::{Drafter, KvCache};

use super::auto::bucket_starts;
use super::engine::{EngineConfig, RequestId};
use super::proposer::{DraftRequest, Proposal, Proposer};

/// Context tokens a warm-up writes for all its sequences together, at most: the plans of a context
/// write grow to it once, so that a run's writes of up to this many tokens (a batch's prompts) do not
/// grow them again (a growth stales every recorded graph on the backend).
const WARM_WRITE_TOKENS: usize = 8192;

/// A [`Drafter`] proposing for an engine (see the module documentation).
pub struct DflashProposer<'d, B: Backend> {
    drafter: &'d Drafter<B>,
    cache: KvCache<B>,
    seqs: HashMap<RequestId, usize>,
}

impl<'d, B: Backend> DflashProposer<'d, B> {
    /// A proposer for an engine of `config`: its context cache holds as many tokens as the engine's
    /// (every committed token of every request) plus one block per sequence.
    pub fn new(drafter: &'d Drafter<B>, config: &EngineConfig) -> Result<Self> {
        let block = drafter.dflash().block_size;
        if config.block != block {
            return Err(Error::param(
                "block",
                config.block,
                format!("the drafter was trained for blocks of {block} (dflash_config.block_size)"),
            ));
        }
        let block_pages = block.div_ceil(config.page_size) + 1;
        let cache = drafter.new_cache(
            config.num_pages.saturating_mul(block_pages + 1),
            config.page_size,
            config.max_seq_len + block,
        )?;
        Ok(DflashProposer { drafter, cache, seqs: HashMap::new() })
    }

    /// Writes `len` context tokens of zero features to each of `seqs` (`per_write` a sequence at a time),
    /// then drafts a block after each.
    fn draft_from_zeros(&mut self, seqs: &[usize], len: usize, per_write: usize, width: usize, k: usize) -> Result<()> {
        let mut written = 0;
        while written < len {
            let n = per_write.max(1).min(len - written);
            let rows: Vec<(usize, usize)> = seqs.iter().map(|&seq| (seq, n)).collect();
            self.drafter.write_context(&mut self.cache, &rows, &vec![0.0; seqs.len() * n * width])?;
            written += n;
        }
        let blocks: Vec<(usize, u32)> = seqs.iter().map(|&seq| (seq, 0)).collect();
        self.drafter.draft(&mut self.cache, &blocks, (k > 1).then_some(k))?;
        Ok(())
    }

    /// The drafter's sequence of request `id`, started on first sight.
    fn sequence(&mut self, id: RequestId) -> usize {
        let cache = &mut self.cache;
        *self.seqs.entry(id).or_insert_with(|| cache.add_sequence())
    }
}

impl<B: Backend> Proposer for DflashProposer<'_, B> {
    fn feature_layers(&self) -> &[usize] {
        &self.drafter.dflash().target_layer_ids
    }

    fn block_size(&self) -> Option<usize> {
        Some(self.drafter.dflash().block_size)
    }

    fn propose(&mut self, batch: &[DraftRequest], depth: usize, k: usize, vocab: usize) -> Result<Vec<Proposal>> {
        let trained = self.drafter.dflash().depth();
        if depth != trained || k == 0 || k > vocab {
            return Err(Error::param(
                "depth, k",
                format!("{depth}, {k}"),
                format!("the drafter drafts {trained} positions; k must be in 1..={vocab}"),
            ));
        }
        let width = self.drafter.feature_width();
        let mut rows = Vec::with_capacity(batch.len());
        let mut features = Vec::new();
        for r in batch {
            if r.features.len() % width != 0 {
                return Err(Error::param(
                    "features",
                    r.features.len(),
                    format!("request {}: whole tokens of {width} values (target layers × hidden size)", r.id),
                ));
            }
            let seq = self.sequence(r.id);
            rows.push((seq, r.features.len() / width));
            features.extend_from_slice(r.features);
        }
        self.drafter.write_context(&mut self.cache, &rows, &features)?;
        let mut blocks = Vec::with_capacity(batch.len());
        for (r, &(seq, _)) in batch.iter().zip(&rows) {
            let (have, want) = (self.cache.len(seq)?, r.history.len() - 1);
            if have != want {
                return Err(Error::param(
                    "features",
                    have,
                    format!("request {}: the drafter's context must hold its {want} committed tokens", r.id),
                ));
            }
            blocks.push((seq, *r.history.last().expect("a request has tokens")));
        }
        let drafts = self.drafter.draft(&mut self.cache, &blocks, (k > 1).then_some(k))?;
        Ok(drafts.into_iter().map(|d| Proposal { ids: d.ids, logp: d.logp }).collect())
    }

    /// Drafts from zero features: the shapes, not the values, decide what is recorded. A bucket the
    /// context cache has no free pages for is left out.
    fn warm_up(&mut self, batch: usize, max_len: usize, k: usize) -> Result<()> {
        let block = self.drafter.dflash().block_size;
        let width = self.drafter.feature_width();
        let limit = self.cache.max_seq_len().saturating_sub(block);
        let per_write = WARM_WRITE_TOKENS.div_ceil(batch.max(1));
        for start in bucket_starts(max_len.min(limit)).into_iter().rev() {
            let room = (start + block).div_ceil(self.cache.page_size()) + 1;
            if start + block > self.cache.max_seq_len() || self.cache.free_pages() < batch * room {
                continue;
            }
            let seqs: Vec<usize> = (0..batch).map(|_| self.cache.add_sequence()).collect();
            let drafted = self.draft_from_zeros(&seqs, start, per_write, width, k);
            for &seq in &seqs {
                self.cache.remove_sequence(seq)?;
            }
            drafted?;
        }
        Ok(())
    }

    fn release(&mut self, id: RequestId) -> Result<()> {
        match self.seqs.remove(&id) {
            Some(seq) => self.cache.remove_sequence(seq),
            None => Ok(()),
        }
    }
}
