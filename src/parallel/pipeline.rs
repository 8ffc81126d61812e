//! Pipeline parallelism (ENGINE.md §10): the layers split into contiguous stages, each stage's ranks
//! handing the residual stream to the next stage's, and a step's requests cut into micro-batches so that
//! the stages work on different requests at once.
//!
//! A stage hands its rows over through the host (a mailbox per pair of ranks): the rows leave the device once per stage
//! boundary and micro-batch (`tokens × hidden_size` floats), whatever the backend, so a stage's step is
//! one recorded graph from its first layer to its last. No float is added or reordered on the way, so a
//! pipelined model gives the bits of the same model unpipelined.

use std::collections::VecDeque;
use std::ops::Range;
use std::sync::{Condvar, Mutex, MutexGuard, PoisonError};

use super::aborted;
use crate::error::{Error, Result};
use crate::model::StepRequest;

/// How a model is split over ranks: `tensor` ranks share each layer (attention heads, MLP features and
/// routed experts), `pipeline` stages of them each hold a contiguous run of layers. Ranks are numbered
/// stage by stage: rank `r` is tensor rank `r % tensor` of stage `r / tensor`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Layout {
    /// Ranks per stage, splitting each layer.
    pub tensor: usize,
    /// Stages, splitting the layers.
    pub pipeline: usize,
}

impl Layout {
    /// `ranks` ranks sharing every layer, one stage.
    pub fn tensor(ranks: usize) -> Layout {
        Layout { tensor: ranks, pipeline: 1 }
    }

    /// `stages` stages of one rank each.
    pub fn pipeline(stages: usize) -> Layout {
        Layout { tensor: 1, pipeline: stages }
    }

    /// Ranks in all (saturating: [`Layout::check_ranks`] rejects a count that overflows).
    pub fn ranks(&self) -> usize {
        self.tensor.saturating_mul(self.pipeline)
    }

    /// An error naming the part of the layout that is zero.
    pub fn check_ranks(&self) -> Result<()> {
        if self.tensor == 0 {
            return Err(Error::param("tensor", 0, "a stage needs at least one rank"));
        }
        if self.pipeline == 0 {
            return Err(Error::param("pipeline", 0, "a model needs at least one stage"));
        }
        if self.tensor.checked_mul(self.pipeline).is_none() {
            return Err(Error::param("tensor × pipeline", format!("{self:?}"), "the rank count overflows"));
        }
        Ok(())
    }

    /// An error naming the part of the layout that is zero or, for a model of `layers` layers, leaves a
    /// stage with none.
    pub fn check(&self, layers: usize) -> Result<()> {
        self.check_ranks()?;
        if self.pipeline > layers {
            return Err(Error::param(
                "pipeline",
                self.pipeline,
                format!("must be in 1..={layers}: every stage holds at least one of the {layers} layers"),
            ));
        }
        Ok(())
    }

    /// The layers of stage `stage` out of `layers`: contiguous runs, the first `layers % pipeline`
    /// stages one layer longer than the rest.
    pub fn stage_layers(&self, stage: usize, layers: usize) -> Range<usize> {
        let stages = self.pipeline.max(1);
        let (each, longer) = (layers / stages, layers % stages);
        let start = stage * each + stage.min(longer);
        start..start + each + usize::from(stage < longer)
    }
}

/// The rows one stage hands the next, in micro-batch order, through the host.
#[derive(Default)]
pub(crate) struct Mailbox {
    state: Mutex<Queue>,
    changed: Condvar,
}

#[derive(Default)]
struct Queue {
    rows: VecDeque<Vec<f32>>,
    aborted: bool,
}

impl Mailbox {
    fn lock(&self) -> MutexGuard<'_, Queue> {
        self.state.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Leaves one micro-batch's rows for the next stage (never waits).
    pub(crate) fn send(&self, rows: Vec<f32>) -> Result<()> {
        let mut queue = self.lock();
        if queue.aborted {
            return Err(aborted());
        }
        queue.rows.push_back(rows);
        self.changed.notify_all();
        Ok(())
    }

    /// Takes the oldest micro-batch's rows, waiting for them; an error once aborted.
    pub(crate) fn receive(&self) -> Result<Vec<f32>> {
        let mut queue = self.lock();
        loop {
            if queue.aborted {
                return Err(aborted());
            }
            if let Some(rows) = queue.rows.pop_front() {
                return Ok(rows);
            }
            queue = self.changed.wait(queue).unwrap_or_else(PoisonError::into_inner);
        }
    }

    /// Ends every wait on this mailbox, now and until [`Mailbox::reset`], with an error.
    pub(crate) fn abort(&self) {
        self.lock().aborted = true;
        self.changed.notify_all();
    }

    /// Empties the mailbox and ends the abort: no stage is stepping.
    pub(crate) fn reset(&self) {
        *self.lock() = Queue::default();
    }
}

/// A stage's place in the pipeline: the layers it holds and its mailboxes from the stage before and to
/// the stage after (none at the ends).
pub(crate) struct StageLinks {
    pub(crate) layers: Range<usize>,
    pub(crate) from_previous: Option<std::sync::Arc<Mailbox>>,
    pub(crate) to_next: Option<std::sync::Arc<Mailbox>>,
}

impl StageLinks {
    /// All `layers` layers, no stage before or after: a model that is not pipelined.
    pub(crate) fn whole(layers: usize) -> StageLinks {
        StageLinks { layers: 0..layers, from_previous: None, to_next: None }
    }

    /// Whether this stage ends the pipeline (and so computes the logits).
    pub(crate) fn is_last(&self) -> bool {
        self.to_next.is_none()
    }
}

/// Cuts `requests` into at most `count` runs of consecutive requests with about the same number of
/// tokens each, every run with at least one token (a request with none joins the run before it, or the
/// first). Request order, and so the order of the step's rows, is kept.
pub(crate) fn micro_batches<'r, 'a>(requests: &'r [StepRequest<'a>], count: usize) -> Vec<&'r [StepRequest<'a>]> {
    let total: usize = requests.iter().map(|r| r.tokens.len()).sum();
    let target = total.div_ceil(count.max(1)).max(1);
    let mut runs = Vec::new();
    let (mut start, mut tokens) = (0, 0);
    for (i, r) in requests.iter().enumerate() {
        if tokens >= target && !r.tokens.is_empty() {
            runs.push(&requests[start..i]);
            (start, tokens) = (i, 0);
        }
        tokens += r.tokens.len();
    }
    runs.push(&requests[start..]);
    runs
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn stages_cover_the_layers_in_order_longer_first() {
        let layout = Layout::pipeline(3);
        let stages: Vec<Range<usize>> = (0..3).map(|s| layout.stage_layers(s, 61)).collect();
        assert_eq!(stages, vec![0..21, 21..41, 41..61]);
        assert_eq!(Layout::pipeline(4).stage_layers(3, 4), 3..4);
    }

    #[test]
    fn layouts_with_an_empty_part_are_errors() {
        assert!(Layout::pipeline(5).check(4).is_err());
        assert!(Layout::pipeline(0).check(4).is_err());
        assert!(Layout { tensor: 0, pipeline: 1 }.check(4).is_err());
        assert!(Layout { tensor: 2, pipeline: 4 }.check(4).is_ok());
    }

    #[test]
    fn micro_batches_keep_order_and_balance_tokens() {
        let toks = [1u32; 8];
        let sizes = [3usize, 1, 0, 2, 2, 0];
        let requests: Vec<StepRequest> =
            sizes.iter().enumerate().map(|(seq, &n)| StepRequest { seq, tokens: &toks[..n], tree: None }).collect();
        let runs = micro_batches(&requests, 2);
        let seqs: Vec<Vec<usize>> = runs.iter().map(|r| r.iter().map(|q| q.seq).collect()).collect();
        assert_eq!(seqs, vec![vec![0, 1, 2], vec![3, 4, 5]]);
        assert_eq!(micro_batches(&requests, 1).len(), 1);
        assert_eq!(micro_batches(&requests, 100).len(), 4, "one run per request with tokens");
    }

    #[test]
    fn an_aborted_mailbox_ends_the_wait() {
        let mailbox = std::sync::Arc::new(Mailbox::default());
        let waiter = {
            let m = mailbox.clone();
            std::thread::spawn(move || m.receive())
        };
        mailbox.abort();
        assert!(waiter.join().unwrap().is_err());
        mailbox.reset();
        mailbox.send(vec![1.0]).unwrap();
        assert_eq!(mailbox.receive().unwrap(), vec![1.0]);
    }
}
