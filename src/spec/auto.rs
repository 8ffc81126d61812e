//! `auto`: the cost-aware tree budget (ENGINE.md §7). One best-first build of the largest budget serves
//! every smaller one (its first rows, [`crate::types::DraftTree::first_rows`]); the expected accepted
//! drafts of a budget are the sum of its nodes' path probabilities under the draft. Each step takes the
//! budget, 0 (a plain decode step) included, with the most expected tokens per second of target step,
//! from step times measured on the model itself at the step's batch bucket ([`crate::spec::Engine::warm_up`]
//! at start-up, else the first time a bucket is needed); the predicted accepted drafts are scaled by how
//! many the last verifications accepted against their prediction. Drafting is backed off (1, 2, 4 … 64 steps) while
//! the draft costs a noticeable share of a step and even the best budget, counting the draft's own time,
//! is slower than plain decoding; greedy output does not depend on any of these choices.

use std::collections::HashMap;
use std::time::{Duration, Instant};

use crate::error::{Error, Result};
use crate::model::backend::Backend;
use crate::model::{Logits, StepRequest, TreeInput};
use crate::types::DraftTree;

use super::proposer::Proposal;
use super::target::{Target, TargetCache};

/// Longest drafting back-off, in steps.
const MAX_BACKOFF: usize = 64;

/// A draft shorter than this share of a plain step is never backed off: skipping it saves nothing.
const NOTICEABLE_DRAFT: f64 = 0.05;

/// Weight of the earlier verifications in the acceptance calibration, per verification (about the last
/// 50 count).
const CALIBRATION_DECAY: f64 = 0.98;

/// Predicted accepted drafts the calibration needs before it trusts its ratio; until then it takes the
/// optimistic bound, so that the first steps verify drafts and gather the evidence (a pessimistic start
/// would back drafting off before any verification could show it pays).
const CALIBRATION_EVIDENCE: f64 = 4.0;

/// Bounds of the calibration ratio: a few unlucky steps must not switch drafting off for good.
const CALIBRATION_RANGE: (f64, f64) = (0.25, 4.0);

/// Timed repetitions of a measured step (after two untimed ones); the fastest counts.
const REPEATS: usize = 3;

/// Target step times by (batch bucket, rows per sequence), measured when first asked for.
pub(super) struct StepTimes {
    budgets: Vec<usize>,
    table: HashMap<(usize, usize), f64>,
}

impl StepTimes {
    /// A table for budgets 0, 1, 2, 4, … up to `max_budget` (and `max_budget` itself).
    pub(super) fn new(max_budget: usize) -> Self {
        let mut budgets: Vec<usize> = std::iter::once(0)
            .chain(std::iter::successors(Some(1usize), |b| Some(b * 2)).take_while(|&b| b < max_budget))
            .collect();
        budgets.push(max_budget);
        budgets.dedup();
        StepTimes { budgets, table: HashMap::new() }
    }

    /// Measures every budget's step at the bucket of `batch` that is not measured yet (see
    /// [`StepTimes::seconds`]), the largest first: a step that grows the model's scratch drops the
    /// recorded graphs, so growing it once keeps the smaller budgets' graphs for the run.
    pub(super) fn measure<B: Backend, T: Target<B>>(
        &mut self,
        model: &T,
        cache: &mut T::Cache,
        batch: usize,
        layers: &[usize],
    ) -> Result<()> {
        for budget in self.budgets.clone().into_iter().rev() {
            self.seconds(model, cache, batch, budget + 1, layers)?;
        }
        Ok(())
    }

    /// Seconds of a target step of `batch` sequences with `rows` rows each (decode rows for 1, chain
    /// trees above), at the power-of-two bucket of `batch`: measured on short sequences added to `cache`
    /// for the purpose (the steps it records are the ones the engine replays), or on a cache of their
    /// own when `cache` has too few free pages.
    fn seconds<B: Backend, T: Target<B>>(
        &mut self,
        model: &T,
        cache: &mut T::Cache,
        batch: usize,
        rows: usize,
        layers: &[usize],
    ) -> Result<f64> {
        let bucket = batch.next_power_of_two();
        if let Some(&t) = self.table.get(&(bucket, rows)) {
            return Ok(t);
        }
        let room = rows + REPEATS + 4;
        let pages = |c: &T::Cache| bucket * room.div_ceil(c.page_size());
        let t = if cache.free_pages() >= pages(cache) && room <= cache.max_seq_len() {
            time_step(model, cache, bucket, rows, layers)?
        } else {
            let mut own = model.new_cache(pages(cache), cache.page_size(), room)?;
            time_step(model, &mut own, bucket, rows, layers)?
        };
        self.table.insert((bucket, rows), t);
        Ok(t)
    }
}

/// The fastest of [`REPEATS`] target steps of `batch` one-token sequences added to `cache` (and removed
/// after), each with `rows` rows.
fn time_step<B: Backend, T: Target<B>>(
    model: &T,
    cache: &mut T::Cache,
    batch: usize,
    rows: usize,
    layers: &[usize],
) -> Result<f64> {
    let seqs: Vec<usize> = (0..batch).map(|_| cache.add_sequence()).collect();
    let best = run_timed(model, cache, &seqs, rows, layers);
    for &seq in &seqs {
        cache.remove_sequence(seq)?;
    }
    best
}

fn run_timed<B: Backend, T: Target<B>>(
    model: &T,
    cache: &mut T::Cache,
    seqs: &[usize],
    rows: usize,
    layers: &[usize],
) -> Result<f64> {
    let token = [0u32];
    let first: Vec<StepRequest> = seqs.iter().map(|&seq| StepRequest { seq, tokens: &token, tree: None }).collect();
    model.step_argmax(cache, &first, Logits::Last)?;
    let tokens = vec![0u32; rows];
    let depth: Vec<u32> = (0..rows as u32).collect();
    let words = rows.div_ceil(32);
    let mut visibility = vec![0u32; rows * words];
    for i in 0..rows {
        for j in 0..=i {
            visibility[i * words + j / 32] |= 1 << (j % 32);
        }
    }
    let tree = (rows > 1).then_some(TreeInput { depth: &depth, visibility: &visibility });
    let requests: Vec<StepRequest> = seqs.iter().map(|&seq| StepRequest { seq, tokens: &tokens, tree }).collect();
    let mut best = f64::INFINITY;
    for run in 0..REPEATS + 2 {
        let started = Instant::now();
        if layers.is_empty() {
            model.step_argmax(cache, &requests, Logits::All)?;
        } else {
            model.step_hidden(cache, &requests, Logits::All, layers, false)?;
        }
        if run >= 2 {
            best = best.min(started.elapsed().as_secs_f64());
        }
    }
    Ok(best)
}

/// Per budget of `budgets`, the tokens a step is expected to emit: 1 for each of `plain` requests, and
/// for each tree 1 plus its first nodes' path probabilities under the draft (`proposals[b]`: `[depth,
/// k]` candidates per position, log-probabilities).
pub(super) fn expected_tokens(
    tree: &DraftTree,
    proposals: &[Proposal],
    k: usize,
    plain: usize,
) -> Result<impl Fn(usize) -> f64> {
    let n = tree.shape.rows();
    let mut path_probs = Vec::with_capacity(tree.shape.bs);
    for (b, p) in proposals.iter().enumerate().take(tree.shape.bs) {
        let base = b * n;
        let mut logp = vec![0f64; n];
        let mut probs = Vec::new();
        for i in 1..=tree.num_nodes[b] as usize {
            let (d, token) = (tree.node_depth[base + i] as usize, tree.node_token[base + i]);
            let candidates = (d - 1) * k..d * k;
            let j = p.ids[candidates.clone()].iter().position(|&t| t == token).ok_or_else(|| {
                Error::param("tree", token, format!("row {i}: its token is not a candidate at depth {d}"))
            })?;
            let parent = tree.parent[base + i] as usize;
            logp[i] = logp[parent] + p.logp[candidates.start + j] as f64;
            probs.push(logp[i].exp());
        }
        path_probs.push(probs);
    }
    Ok(move |budget: usize| {
        plain as f64 + path_probs.iter().map(|p| 1.0 + p.iter().take(budget).sum::<f64>()).sum::<f64>()
    })
}

/// The drafts a verification accepted against the number the draft's own probabilities predicted,
/// decayed sums of both: a drafter's probabilities may be over- or under-confident, and the budget
/// choice scales its predictions by their ratio.
#[derive(Clone, Copy, Debug, Default)]
struct Calibration {
    predicted: f64,
    observed: f64,
    /// The prediction of the budget chosen for the step in flight.
    pending: Option<f64>,
}

impl Calibration {
    /// Observed over predicted accepted drafts, the upper bound until there is enough evidence.
    fn ratio(&self) -> f64 {
        if self.predicted < CALIBRATION_EVIDENCE {
            return CALIBRATION_RANGE.1;
        }
        (self.observed / self.predicted).clamp(CALIBRATION_RANGE.0, CALIBRATION_RANGE.1)
    }

    fn observe(&mut self, accepted: usize) {
        if let Some(predicted) = self.pending.take() {
            self.predicted = CALIBRATION_DECAY * self.predicted + predicted;
            self.observed = CALIBRATION_DECAY * self.observed + accepted as f64;
        }
    }
}

/// `auto`'s state: the step-time table, the acceptance calibration and the drafting back-off.
pub(super) struct AutoBudget {
    times: StepTimes,
    calibration: Calibration,
    skip: usize,
    backoff: usize,
}

impl AutoBudget {
    pub(super) fn new(times: StepTimes) -> Self {
        AutoBudget { times, calibration: Calibration::default(), skip: 0, backoff: 1 }
    }

    /// Records how many drafts the verification of the step `choose` last chose a budget for accepted.
    pub(super) fn observe(&mut self, accepted: usize) {
        self.calibration.observe(accepted);
    }

    /// Whether this step skips drafting (a back-off step); counts it.
    pub(super) fn skip_drafting(&mut self) -> bool {
        if self.skip > 0 {
            self.skip -= 1;
            return true;
        }
        false
    }

    /// Measures the step times of the bucket of `batch` now (start-up), not at its first step.
    pub(super) fn warm_up<B: Backend, T: Target<B>>(
        &mut self,
        model: &T,
        cache: &mut T::Cache,
        batch: usize,
        layers: &[usize],
    ) -> Result<()> {
        self.times.measure(model, cache, batch, layers)
    }

    /// The budget of this step of `batch` sequences: the most expected tokens (`expected(budget)`, its
    /// accepted drafts scaled by the calibration) per second of target step (the draft is already
    /// made). Starts a back-off when the draft took a noticeable share of a step and the best budget,
    /// counting `draft` time, is slower than a plain step.
    pub(super) fn choose<B: Backend, T: Target<B>>(
        &mut self,
        model: &T,
        cache: &mut T::Cache,
        expected: &impl Fn(usize) -> f64,
        batch: usize,
        draft: Duration,
        layers: &[usize],
    ) -> Result<usize> {
        self.times.measure(model, cache, batch, layers)?;
        let plain = self.times.seconds(model, cache, batch, 1, layers)?;
        let plain_rate = batch as f64 / plain;
        let (no_drafts, ratio) = (expected(0), self.calibration.ratio());
        let calibrated = |budget| no_drafts + ratio * (expected(budget) - no_drafts);
        let (mut best, mut best_rate, mut drafted_rate) = (0, plain_rate, 0f64);
        for budget in self.times.budgets.clone().into_iter().filter(|&b| b > 0) {
            let t = self.times.seconds(model, cache, batch, budget + 1, layers)?;
            let tokens = calibrated(budget);
            if tokens / t > best_rate {
                (best, best_rate) = (budget, tokens / t);
            }
            drafted_rate = drafted_rate.max(tokens / (t + draft.as_secs_f64()));
        }
        if drafted_rate < plain_rate && draft.as_secs_f64() > NOTICEABLE_DRAFT * plain {
            self.skip = self.backoff;
            self.backoff = (self.backoff * 2).min(MAX_BACKOFF);
        } else {
            self.backoff = 1;
        }
        self.calibration.pending = (best > 0).then(|| expected(best) - no_drafts);
        Ok(best)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Verifications that each accepted `accepted` drafts against a prediction of `predicted`.
    fn run(c: &mut Calibration, steps: usize, predicted: f64, accepted: usize) {
        for _ in 0..steps {
            c.pending = Some(predicted);
            c.observe(accepted);
        }
    }

    #[test]
    fn calibration_follows_the_observed_ratio_within_bounds() {
        let mut c = Calibration::default();
        assert_eq!(c.ratio(), CALIBRATION_RANGE.1, "optimistic without evidence");
        run(&mut c, 2, 1.0, 0);
        assert_eq!(c.ratio(), CALIBRATION_RANGE.1, "too little evidence to move");
        run(&mut c, 200, 1.0, 2);
        assert!((c.ratio() - 2.0).abs() < 0.01, "{}", c.ratio());
        run(&mut c, 400, 1.5, 0);
        assert_eq!(c.ratio(), CALIBRATION_RANGE.0);
        run(&mut c, 400, 0.1, 3);
        assert_eq!(c.ratio(), CALIBRATION_RANGE.1);
        let before = (c.predicted, c.observed);
        c.observe(5);
        assert_eq!((c.predicted, c.observed), before, "a step with no chosen budget is not counted");
    }
}
