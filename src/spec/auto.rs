//! `auto`: the cost-aware tree budget (ENGINE.md §7). One best-first build of the largest budget serves
//! every smaller one (its first rows, [`crate::types::DraftTree::first_rows`]); the expected accepted
//! drafts of a budget are the sum of its nodes' path probabilities under the draft. Each step takes the
//! budget, 0 (a plain decode step) included, with the most expected tokens per second of target step,
//! from step times measured on the model itself at the step's batch bucket ([`crate::spec::Engine::warm_up`]
//! at start-up, else the first time a bucket is needed); the predicted accepted drafts are scaled by how
//! many the last verifications accepted against their prediction. Drafting is backed off (1, 2, 4 … 64 steps) while
//! the draft costs a noticeable share of a step and even the best budget, counting the draft's own time,
//! is slower than plain decoding; after a few such losses in a row it is switched off at that batch
//! bucket for a long stretch, so that the plain steps there are `ar`'s own (no context features for the
//! drafter). Greedy output does not depend on any of these choices.

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

/// Losing drafts in a row (each after a back-off, 1 + 2 + 4 steps) that switch drafting off at
/// a batch bucket, when the steps that drafted there were also clearly slower ([`OFF_MARGIN`]): a
/// stretch of text the drafter guesses badly backs drafting off without switching it off, a batch
/// where verification never pays switches it off after about ten steps.
const LOSSES_TO_SWITCH_OFF: usize = 4;

/// Drafted steps slower than this share of the plain steps' tokens per second are clearly slower.
const OFF_MARGIN: f64 = 0.8;

/// Steps at a batch bucket that drafting stays off for once switched off.
const OFF_STEPS: usize = 4096;

/// Weight of the earlier steps in the observed step rates, per step (about the last 20 count).
const STEP_RATE_DECAY: f64 = 0.95;

/// Steps of a kind (drafted or plain) at a batch bucket before their observed rates may switch drafting
/// off there.
const STEP_RATE_EVIDENCE: usize = 3;

/// Weight of the earlier verifications in the mean of their host work, per verification.
const OVERHEAD_DECAY: f64 = 0.9;

/// Tokens a warm-up fill step gives all its sequences together, at least (see [`record_steps`]): the
/// model's scratch grows to it once, so that a run's prefills of up to this many tokens a step do not
/// grow it again (a growth drops the recorded graphs).
const FILL_TOKENS: usize = 8192;

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
    with_sequences(cache, batch, |cache, seqs| {
        fill(model, cache, seqs, 1, 1)?;
        let mut best = f64::INFINITY;
        for run in 0..REPEATS + 2 {
            let started = Instant::now();
            run_rows(model, cache, seqs, rows, layers)?;
            if run >= 2 {
                best = best.min(started.elapsed().as_secs_f64());
            }
        }
        Ok(best)
    })
}

/// The step shapes of a warm-up: rows per sequence, and whether the step returns context features.
pub(super) type WarmShape = (usize, bool);

/// Runs one target step of each shape in `shapes` for `batch` sequences at every sequence-length bucket
/// from the shortest to the one holding `max_len` tokens, so that the model records the step graphs a
/// run of such sequences replays (graphs are keyed by the bucket of the longest sequence). The
/// sequences are added to `cache`, filled with `max(FILL_TOKENS, batch × widest shape's rows)` tokens a step,
/// and removed after; buckets the cache has no free pages for are left out. Longest bucket first: its
/// fill grows the model's scratch once, before any graph it would drop.
pub(super) fn record_steps<B: Backend, T: Target<B>>(
    model: &T,
    cache: &mut T::Cache,
    batch: usize,
    max_len: usize,
    shapes: &[WarmShape],
    layers: &[usize],
) -> Result<()> {
    let Some(&(widest, _)) = shapes.iter().max_by_key(|s| s.0) else { return Ok(()) };
    let per_step = FILL_TOKENS.max(batch * widest).div_ceil(batch.max(1));
    let limit = cache.max_seq_len();
    for start in bucket_starts(max_len.min(limit)).into_iter().rev() {
        let room = start + widest + 1;
        if room > limit || cache.free_pages() < batch * room.div_ceil(cache.page_size()) {
            continue;
        }
        with_sequences(cache, batch, |cache, seqs| {
            fill(model, cache, seqs, start, per_step)?;
            for &(rows, features) in shapes {
                run_rows(model, cache, seqs, rows, if features { layers } else { &[] })?;
            }
            Ok(())
        })?;
    }
    Ok(())
}

/// Sequence lengths, shortest first, at which a step lands in each sequence-length bucket (of the
/// attention launches, 256 tokens and its powers of two) that sequences of up to `max_len` tokens reach:
/// 1, then each bucket's lower bound below `max_len`.
pub(super) fn bucket_starts(max_len: usize) -> Vec<usize> {
    let mut starts = vec![1];
    let mut bucket = crate::cpu::mla::SPLIT;
    while bucket < max_len {
        starts.push(bucket);
        bucket *= 2;
    }
    starts
}

/// Runs `work` on `batch` sequences added to `cache` for it, and removes them whatever happened.
fn with_sequences<C: TargetCache, R>(
    cache: &mut C,
    batch: usize,
    work: impl FnOnce(&mut C, &[usize]) -> Result<R>,
) -> Result<R> {
    let seqs: Vec<usize> = (0..batch).map(|_| cache.add_sequence()).collect();
    let result = work(cache, &seqs);
    for &seq in &seqs {
        cache.remove_sequence(seq)?;
    }
    result
}

/// Prefills each of the empty sequences `seqs` with `len` tokens (id 0), `per_step` a sequence per step.
fn fill<B: Backend, T: Target<B>>(
    model: &T,
    cache: &mut T::Cache,
    seqs: &[usize],
    len: usize,
    per_step: usize,
) -> Result<()> {
    let chunk = vec![0u32; per_step.max(1)];
    let mut done = 0;
    while done < len {
        let n = chunk.len().min(len - done);
        let requests: Vec<StepRequest> =
            seqs.iter().map(|&seq| StepRequest { seq, tokens: &chunk[..n], tree: None }).collect();
        model.step_argmax(cache, &requests, Logits::Last)?;
        done += n;
    }
    Ok(())
}

/// One target step of `rows` rows for each of `seqs`, as the engine runs it: a decode row (committed)
/// for 1, a path tree of `rows` rows (not committed) above; with the hidden states of `layers` when
/// there are any.
fn run_rows<B: Backend, T: Target<B>>(
    model: &T,
    cache: &mut T::Cache,
    seqs: &[usize],
    rows: usize,
    layers: &[usize],
) -> Result<()> {
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
    if layers.is_empty() {
        model.step_argmax(cache, &requests, Logits::All)?;
    } else {
        model.step_hidden(cache, &requests, Logits::All, layers, false)?;
    }
    Ok(())
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

/// What a step of `auto` does about drafting.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Drafting {
    /// Draft, and choose the budget.
    Draft,
    /// A back-off step: a plain step that keeps the drafter's contexts up to date.
    Wait,
    /// Drafting is off at this batch bucket: a plain step that lets the drafter's contexts go.
    Off,
}

/// `auto`'s state: the step-time table, the acceptance calibration, the drafting back-off and the
/// batch buckets where drafting is off.
pub(super) struct AutoBudget {
    times: StepTimes,
    calibration: Calibration,
    skip: usize,
    backoff: usize,
    /// Losing drafts in a row.
    losses: usize,
    /// Steps left without drafting, by batch bucket.
    off: HashMap<usize, usize>,
    /// Decayed mean seconds of a verification's host work past its target step.
    verify_overhead: f64,
    /// Tokens per second of whole steps, with and without a draft, by batch bucket.
    observed: HashMap<usize, ObservedSteps>,
}

/// Decayed sums of the tokens and seconds of whole engine steps.
#[derive(Clone, Copy, Debug, Default)]
struct StepRate {
    tokens: f64,
    seconds: f64,
    steps: usize,
}

impl StepRate {
    fn add(&mut self, tokens: usize, seconds: f64) {
        self.tokens = STEP_RATE_DECAY * self.tokens + tokens as f64;
        self.seconds = STEP_RATE_DECAY * self.seconds + seconds;
        self.steps += 1;
    }

    /// Tokens per second, once [`STEP_RATE_EVIDENCE`] steps were seen.
    fn rate(&self) -> Option<f64> {
        (self.steps >= STEP_RATE_EVIDENCE && self.seconds > 0.0).then(|| self.tokens / self.seconds)
    }
}

/// The observed rates of one batch bucket's steps.
#[derive(Clone, Copy, Debug, Default)]
struct ObservedSteps {
    /// Steps that drafted (verified or not).
    drafted: StepRate,
    /// Steps that did not.
    plain: StepRate,
}

impl AutoBudget {
    pub(super) fn new(times: StepTimes) -> Self {
        AutoBudget {
            times,
            calibration: Calibration::default(),
            skip: 0,
            backoff: 1,
            losses: 0,
            off: HashMap::new(),
            verify_overhead: 0.0,
            observed: HashMap::new(),
        }
    }

    /// The budgets `auto` chooses among, 0 (a plain step) included.
    pub(super) fn budgets(&self) -> &[usize] {
        &self.times.budgets
    }

    /// Records how many drafts the verification of the step `choose` last chose a budget for accepted.
    pub(super) fn observe(&mut self, accepted: usize) {
        self.calibration.observe(accepted);
    }

    /// What this step of `batch` sequences does about drafting; counts it.
    pub(super) fn drafting(&mut self, batch: usize) -> Drafting {
        let bucket = batch.next_power_of_two();
        if let Some(left) = self.off.get_mut(&bucket) {
            if *left > 0 {
                *left -= 1;
                return Drafting::Off;
            }
            self.off.remove(&bucket);
        }
        if self.skip > 0 {
            self.skip -= 1;
            return Drafting::Wait;
        }
        Drafting::Draft
    }

    /// Measures the step times of every batch bucket up to that of `batch` now (start-up), not at the
    /// first step of each (a run's batch shrinks as its requests finish).
    pub(super) fn warm_up<B: Backend, T: Target<B>>(
        &mut self,
        model: &T,
        cache: &mut T::Cache,
        batch: usize,
        layers: &[usize],
    ) -> Result<()> {
        let mut bucket = 1;
        while bucket <= batch.next_power_of_two() {
            self.times.measure(model, cache, bucket, layers)?;
            bucket *= 2;
        }
        Ok(())
    }

    /// Whether the whole steps that drafted at the bucket of `batch` emitted tokens clearly slower than
    /// those that did not ([`OFF_MARGIN`]): the drafter's probabilities may be off, and a drafted step
    /// costs host work past the target's (tree build, acceptance, commit, features), so that only what
    /// whole steps did switches drafting off. No evidence is no.
    fn clearly_slower(&self, batch: usize) -> bool {
        let Some(observed) = self.observed.get(&batch.next_power_of_two()) else { return false };
        match (observed.drafted.rate(), observed.plain.rate()) {
            (Some(drafted), Some(plain)) => drafted < OFF_MARGIN * plain,
            _ => false,
        }
    }

    /// Records a whole step of `batch` sequences: whether it drafted, the tokens it emitted and its
    /// seconds. The drafting decision compares these rates once there are a few of each.
    pub(super) fn observe_step(&mut self, batch: usize, drafted: bool, tokens: usize, seconds: f64) {
        let observed = self.observed.entry(batch.next_power_of_two()).or_default();
        let rate = if drafted { &mut observed.drafted } else { &mut observed.plain };
        rate.add(tokens, seconds);
    }

    /// Records the host work a verification adds to its target step (greedy acceptance and the cache
    /// commit), which the budget choice counts beside the step time.
    pub(super) fn observe_verify_overhead(&mut self, seconds: f64) {
        self.verify_overhead = OVERHEAD_DECAY * self.verify_overhead + (1.0 - OVERHEAD_DECAY) * seconds;
    }

    /// The budget of this step of `batch` sequences: the most expected tokens (`expected(budget)`, its
    /// accepted drafts scaled by the calibration) per second of target step, plus the verification's
    /// host work for a budget above 0 (the draft is already made). A draft loses when it took a
    /// noticeable share of a step and the best budget, counting `draft` time (the draft and its tree
    /// build), is slower than the measured plain step. A loss starts a back-off, [`LOSSES_TO_SWITCH_OFF`] in a row
    /// switch drafting off at the bucket of `batch` for [`OFF_STEPS`] steps if whole steps agree
    /// ([`AutoBudget::observe_step`]).
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
            let t = self.times.seconds(model, cache, batch, budget + 1, layers)? + self.verify_overhead;
            let tokens = calibrated(budget);
            if tokens / t > best_rate {
                (best, best_rate) = (budget, tokens / t);
            }
            drafted_rate = drafted_rate.max(tokens / (t + draft.as_secs_f64()));
        }
        if drafted_rate < plain_rate && draft.as_secs_f64() > NOTICEABLE_DRAFT * plain {
            self.lose(batch);
        } else {
            (self.backoff, self.losses) = (1, 0);
        }
        self.calibration.pending = (best > 0).then(|| expected(best) - no_drafts);
        Ok(best)
    }

    /// A losing draft at a step of `batch` sequences: a back-off, or drafting off at its bucket.
    fn lose(&mut self, batch: usize) {
        self.losses += 1;
        if self.losses >= LOSSES_TO_SWITCH_OFF && self.clearly_slower(batch) {
            self.off.insert(batch.next_power_of_two(), OFF_STEPS);
            (self.skip, self.backoff, self.losses) = (0, 1, 0);
        } else {
            self.skip = self.backoff;
            self.backoff = (self.backoff * 2).min(MAX_BACKOFF);
        }
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
    fn losses_back_off_then_switch_drafting_off_at_their_bucket_when_steps_agree() {
        let mut auto = AutoBudget::new(StepTimes::new(16));
        let steps = |auto: &mut AutoBudget, batch, n| (0..n).map(|_| auto.drafting(batch)).collect::<Vec<_>>();
        assert_eq!(auto.drafting(8), Drafting::Draft);
        for loss in 0..LOSSES_TO_SWITCH_OFF - 1 {
            auto.lose(8);
            let mut want = vec![Drafting::Wait; 1 << loss];
            want.push(Drafting::Draft);
            assert_eq!(steps(&mut auto, 8, want.len()), want, "back-off after loss {loss}");
        }
        auto.lose(7);
        assert_eq!(auto.drafting(8), Drafting::Wait, "no observed steps: a back-off, drafting stays on");
        for _ in 0..STEP_RATE_EVIDENCE {
            auto.observe_step(8, true, 8, 2.0);
            auto.observe_step(8, false, 8, 1.0);
        }
        auto.lose(7);
        assert_eq!(auto.drafting(1), Drafting::Draft, "another bucket drafts");
        assert!(steps(&mut auto, 5, OFF_STEPS).iter().all(|&d| d == Drafting::Off), "bucket 8 is off");
        assert_eq!(auto.drafting(8), Drafting::Draft, "and drafts again after OFF_STEPS");
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
