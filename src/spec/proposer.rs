//! Draft proposers: what guesses the next tokens of a sequence for the verifier to check. A proposal is
//! DDTree's input (research/ddtree.md §1): for each of the next L positions, K candidate tokens with
//! log-probabilities, best first. `chain` takes the first candidate of each position; `ddtree` builds the
//! best-first tree of a budget from all of them.

use std::collections::BTreeMap;

use crate::error::{Error, Result};

use super::engine::RequestId;

/// The candidates of a proposal for one sequence: `[depth, k]` ids and log-probs, best first per position.
#[derive(Clone, Debug, PartialEq)]
pub struct Proposal {
    /// `[depth, k]` token ids.
    pub ids: Vec<i32>,
    /// `[depth, k]` log-probabilities; `-inf` for a candidate with no support.
    pub logp: Vec<f32>,
}

/// One sequence's part of a [`Proposer::propose`] call.
#[derive(Clone, Copy, Debug)]
pub struct DraftRequest<'a> {
    /// The engine's request: a proposer that keeps state per sequence keys it by this.
    pub id: RequestId,
    /// The sequence's tokens so far; the last is the one the target emitted last (the bonus token, the
    /// root of the tree), every other one is in the target's cache.
    pub history: &'a [u32],
    /// The target's hidden states at [`Proposer::feature_layers`] of the tokens that entered its cache
    /// since this request's previous proposal (all of them at the first): per token the layers'
    /// `hidden_size` values one after another, tokens in order. Empty for a proposer that reads none.
    pub features: &'a [f32],
}

/// Proposes the continuation of sequences.
pub trait Proposer {
    /// The target layers whose hidden states the proposer reads (none by default).
    fn feature_layers(&self) -> &[usize] {
        &[]
    }

    /// The only block size the proposer drafts, if it has one (a drafter trained for it).
    fn block_size(&self) -> Option<usize> {
        None
    }

    /// Candidates for the `depth` positions after each request's history, `k` per position, for a
    /// vocabulary of `vocab` ids: one proposal per request, in order.
    fn propose(&mut self, batch: &[DraftRequest], depth: usize, k: usize, vocab: usize) -> Result<Vec<Proposal>>;

    /// Forgets a request that ended (its state, its cache pages).
    fn release(&mut self, _id: RequestId) -> Result<()> {
        Ok(())
    }

    /// Drafts once for `batch` requests at each sequence-length bucket up to `max_len` tokens, `k`
    /// candidates a position, so that a run's drafts find their plans made and their graphs recorded
    /// (see [`crate::spec::Engine::warm_up`]); nothing by default.
    fn warm_up(&mut self, _batch: usize, _max_len: usize, _k: usize) -> Result<()> {
        Ok(())
    }
}

/// Prompt-lookup drafting (vLLM's `ngram` method): the longest suffix of the history, of at most
/// `max_ngram` and at least `min_ngram` tokens, that occurred before proposes what followed it there.
/// Position d's candidates are the tokens found d places after the earlier occurrences, scored by their
/// share of those occurrences; positions with fewer candidates than `k` are filled with unused ids at
/// `-inf`. Needs no weights, and does well on text that repeats itself (code, quoting, a small model's
/// loops).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct NgramProposer {
    /// Longest suffix to match.
    pub max_ngram: usize,
    /// Shortest suffix to match.
    pub min_ngram: usize,
}

impl Default for NgramProposer {
    fn default() -> Self {
        NgramProposer { max_ngram: 4, min_ngram: 1 }
    }
}

impl NgramProposer {
    /// Start positions of the continuations after the earlier occurrences of the longest matching suffix.
    fn matches(&self, history: &[u32]) -> Vec<usize> {
        let len = history.len();
        for n in (self.min_ngram.max(1)..=self.max_ngram.min(len.saturating_sub(1))).rev() {
            let suffix = &history[len - n..];
            let found: Vec<usize> = (0..len - n).filter(|&p| &history[p..p + n] == suffix).map(|p| p + n).collect();
            if !found.is_empty() {
                return found;
            }
        }
        Vec::new()
    }
}

impl Proposer for NgramProposer {
    fn propose(&mut self, batch: &[DraftRequest], depth: usize, k: usize, vocab: usize) -> Result<Vec<Proposal>> {
        batch.iter().map(|r| self.propose_one(r.history, depth, k, vocab)).collect()
    }
}

impl NgramProposer {
    /// The proposal for one history.
    fn propose_one(&self, history: &[u32], depth: usize, k: usize, vocab: usize) -> Result<Proposal> {
        if depth == 0 || k == 0 || k > vocab {
            return Err(Error::param(
                "depth, k",
                format!("{depth}, {k}"),
                format!("need depth >= 1, 1 <= k <= {vocab}"),
            ));
        }
        let starts = self.matches(history);
        let mut proposal = Proposal { ids: Vec::with_capacity(depth * k), logp: Vec::with_capacity(depth * k) };
        for d in 0..depth {
            let mut counts: BTreeMap<u32, usize> = BTreeMap::new();
            for &s in &starts {
                if let Some(&t) = history.get(s + d) {
                    *counts.entry(t).or_default() += 1;
                }
            }
            let mut ranked: Vec<(u32, usize)> = counts.into_iter().collect();
            ranked.sort_by(|a, b| b.1.cmp(&a.1).then(a.0.cmp(&b.0)));
            ranked.truncate(k);
            let total = starts.len().max(1) as f32;
            for &(t, c) in &ranked {
                proposal.ids.push(t as i32);
                proposal.logp.push((c as f32 / total).ln());
            }
            let used: Vec<u32> = ranked.iter().map(|&(t, _)| t).collect();
            for filler in (0..vocab as u32).filter(|t| !used.contains(t)).take(k - ranked.len()) {
                proposal.ids.push(filler as i32);
                proposal.logp.push(f32::NEG_INFINITY);
            }
        }
        Ok(proposal)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_longest_repeated_suffix_proposes_what_followed_it() {
        // "1 2 3" occurred twice before, followed by 4 then 5, and by 9 then 5.
        let history = [1, 2, 3, 4, 5, 1, 2, 3, 9, 5, 7, 1, 2, 3];
        let p = NgramProposer::default().propose_one(&history, 2, 2, 16).unwrap();
        assert_eq!(p.ids, vec![4, 9, 5, 0]);
        let half = 0.5f32.ln();
        assert_eq!(p.logp, vec![half, half, 0.0, f32::NEG_INFINITY]);
    }

    #[test]
    fn no_match_gives_fillers_at_minus_infinity() {
        let p = NgramProposer::default().propose_one(&[5, 6, 7], 3, 1, 8).unwrap();
        assert_eq!(p.ids, vec![0, 0, 0]);
        assert!(p.logp.iter().all(|&l| l == f32::NEG_INFINITY));
        assert!(NgramProposer::default().propose_one(&[1], 0, 1, 8).is_err());
        assert!(NgramProposer::default().propose_one(&[1], 1, 9, 8).is_err());
    }
}
