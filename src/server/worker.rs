//! The engine loop: one thread owns the model, the proposer and the KV cache (the device), admits
//! queued requests between steps while the batch and the cache have room, steps, and sends every
//! request its new tokens. A request whose receiver is gone (the client disconnected, or a stop string
//! ended it) is cancelled before the next step, which frees its pages.

use std::collections::VecDeque;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{mpsc, Arc};
use std::time::Instant;

use tokio::sync::mpsc::UnboundedSender;

use crate::error::{Error, Result};
use crate::model::backend::Backend;
use crate::spec::{Engine, FinishReason, Proposer, RequestId, RequestParams, StepOutput, Target, TokenLogprob};

use super::metrics::Metrics;

/// A request handed to the engine loop.
pub(crate) struct Job {
    pub prompt: Vec<u32>,
    pub params: RequestParams,
    pub events: UnboundedSender<Event>,
}

/// What the engine loop sends a request.
#[derive(Debug)]
pub(crate) enum Event {
    /// New tokens (and their log-probabilities when asked for).
    Tokens { tokens: Vec<u32>, logprobs: Vec<TokenLogprob> },
    /// The request ended.
    Finished(FinishReason),
    /// The engine failed on a step that held this request.
    Failed(String),
}

/// Why a request was not queued.
#[derive(Debug, PartialEq, Eq)]
pub(crate) enum Rejected {
    /// The queue holds `max_queue` requests.
    QueueFull(usize),
    /// The request needs more KV pages than the whole cache has.
    TooLarge { needed: usize, total: usize },
    /// The engine loop has stopped.
    Stopped,
}

/// What the HTTP side needs to know of the engine, fixed at start-up.
#[derive(Clone, Debug)]
pub struct EngineInfo {
    /// Longest sequence (prompt + generated tokens) a request may have.
    pub max_seq_len: usize,
    /// KV cache pages in all.
    pub num_pages: usize,
    /// Slots per page.
    pub page_size: usize,
    /// Cache rows a step may need beyond the tokens (a verify tree's rows).
    pub tree_rows: usize,
    /// Most requests decoded together.
    pub max_batch: usize,
    /// Most requests waiting for a place in the batch.
    pub max_queue: usize,
    /// The decoding mode, as its name.
    pub mode: String,
}

impl EngineInfo {
    /// Pages a request of `prompt` tokens and `max_tokens` more holds at most.
    pub fn pages_for(&self, prompt: usize, max_tokens: usize) -> usize {
        (prompt + max_tokens + self.tree_rows).min(self.max_seq_len + self.tree_rows).div_ceil(self.page_size)
    }
}

/// The HTTP side's end of the engine loop: submits jobs into the bounded queue.
#[derive(Clone)]
pub struct EngineHandle {
    jobs: mpsc::Sender<Job>,
    queued: Arc<AtomicUsize>,
    info: EngineInfo,
    metrics: Arc<Metrics>,
}

impl EngineHandle {
    /// The engine's fixed facts.
    pub fn info(&self) -> &EngineInfo {
        &self.info
    }

    /// The counters the loop updates.
    pub fn metrics(&self) -> &Metrics {
        &self.metrics
    }

    /// Queues a job unless the queue is full or the job could never fit the cache.
    pub(crate) fn submit(&self, job: Job) -> std::result::Result<(), Rejected> {
        let needed = self.info.pages_for(job.prompt.len(), job.params.max_tokens);
        if needed > self.info.num_pages {
            return Err(Rejected::TooLarge { needed, total: self.info.num_pages });
        }
        let max = self.info.max_queue;
        if self.queued.fetch_update(Ordering::SeqCst, Ordering::SeqCst, |q| (q < max).then_some(q + 1)).is_err() {
            return Err(Rejected::QueueFull(max));
        }
        self.metrics.set_waiting(self.queued.load(Ordering::SeqCst));
        self.jobs.send(job).map_err(|_| {
            self.queued.fetch_sub(1, Ordering::SeqCst);
            Rejected::Stopped
        })
    }
}

/// One admitted request.
struct Running {
    id: RequestId,
    pages: usize,
    events: UnboundedSender<Event>,
}

/// Starts the engine loop on its own thread. `build` runs there: it makes the model, the proposer and
/// the engine (so that device state never leaves that thread) and hands the engine to
/// [`LoopStarter::run`], which serves requests until every [`EngineHandle`] is dropped. The call
/// returns once the loop runs, or with `build`'s error.
pub fn spawn<F>(build: F, max_batch: usize, max_queue: usize) -> Result<EngineHandle>
where
    F: FnOnce(LoopStarter) -> Result<()> + Send + 'static,
{
    for (name, v) in [("max_batch", max_batch), ("max_queue", max_queue)] {
        if v == 0 {
            return Err(Error::param(name, 0, "must be at least 1"));
        }
    }
    let (jobs, rx) = mpsc::channel::<Job>();
    let (ready, ready_rx) = mpsc::channel::<Result<EngineInfo>>();
    let queued = Arc::new(AtomicUsize::new(0));
    let metrics = Arc::new(Metrics::default());
    let starter = LoopStarter {
        jobs: rx,
        ready: ready.clone(),
        queued: queued.clone(),
        metrics: metrics.clone(),
        max_batch,
        max_queue,
    };
    std::thread::Builder::new()
        .name("engine".into())
        .spawn(move || {
            if let Err(e) = build(starter) {
                let _ = ready.send(Err(e));
            }
        })
        .map_err(|e| Error::param("engine thread", e, "could not be started"))?;
    let info = ready_rx
        .recv()
        .map_err(|_| Error::param("engine", "thread", "the engine thread ended before it was ready"))??;
    Ok(EngineHandle { jobs, queued, info, metrics })
}

/// What [`spawn`]'s `build` gets: runs the loop over the engine it made.
pub struct LoopStarter {
    jobs: mpsc::Receiver<Job>,
    ready: mpsc::Sender<Result<EngineInfo>>,
    queued: Arc<AtomicUsize>,
    metrics: Arc<Metrics>,
    max_batch: usize,
    max_queue: usize,
}

impl LoopStarter {
    /// Serves requests with `engine` until every handle is dropped and no request is left.
    pub fn run<B: Backend, P: Proposer, T: Target<B>>(self, engine: &mut Engine<B, P, T>) -> Result<()> {
        let config = engine.config();
        let info = EngineInfo {
            max_seq_len: config.max_seq_len.saturating_sub(engine.tree_rows()),
            num_pages: config.num_pages,
            page_size: config.page_size,
            tree_rows: engine.tree_rows(),
            max_batch: self.max_batch,
            max_queue: self.max_queue,
            mode: format!("{:?}", config.mode).to_lowercase(),
        };
        self.metrics.set_mode(&info.mode, info.num_pages);
        let _ = self.ready.send(Ok(info.clone()));
        EngineLoop { engine, info, jobs: &self.jobs, queued: &self.queued, metrics: &self.metrics }.run();
        Ok(())
    }
}

/// The loop's state over an engine built on its thread.
struct EngineLoop<'e, 'm, B: Backend, P: Proposer, T: Target<B>> {
    engine: &'e mut Engine<'m, B, P, T>,
    info: EngineInfo,
    jobs: &'e mpsc::Receiver<Job>,
    queued: &'e AtomicUsize,
    metrics: &'e Metrics,
}

impl<B: Backend, P: Proposer, T: Target<B>> EngineLoop<'_, '_, B, P, T> {
    /// Admits, steps and dispatches until every handle is dropped and no request is left.
    fn run(mut self) {
        let mut running: Vec<Running> = Vec::new();
        let mut waiting: VecDeque<Job> = VecDeque::new();
        loop {
            if running.is_empty() && waiting.is_empty() {
                match self.jobs.recv() {
                    Ok(job) => waiting.push_back(job),
                    Err(_) => return,
                }
            }
            waiting.extend(self.jobs.try_iter());
            self.drop_disconnected(&mut running, &mut waiting);
            self.admit(&mut running, &mut waiting);
            if running.is_empty() {
                continue;
            }
            let started = Instant::now();
            let result = self.engine.step();
            self.metrics.record_step(started.elapsed(), self.engine.stats());
            match result {
                Ok(outputs) => dispatch(outputs, &mut running),
                Err(e) => self.fail_all(&mut running, &e),
            }
            self.publish(&running);
        }
    }

    /// Cancels the running requests whose receiver is gone and forgets such waiting ones.
    fn drop_disconnected(&mut self, running: &mut Vec<Running>, waiting: &mut VecDeque<Job>) {
        let before = waiting.len();
        waiting.retain(|j| !j.events.is_closed());
        self.release_queue_slots(before - waiting.len());
        let mut i = 0;
        while i < running.len() {
            if running[i].events.is_closed() {
                let r = running.swap_remove(i);
                // The request may have finished in the same step; then it is already gone.
                let _ = self.engine.cancel(r.id);
                self.metrics.count_cancelled();
                self.metrics.set_running(running.len(), self.engine.kv_pages_in_use());
            } else {
                i += 1;
            }
        }
    }

    /// Admits waiting jobs in order while the batch and the cache (every running request's largest
    /// need reserved) have room; a job the engine rejects gets the error.
    fn admit(&mut self, running: &mut Vec<Running>, waiting: &mut VecDeque<Job>) {
        let mut reserved: usize = running.iter().map(|r| r.pages).sum();
        while running.len() < self.info.max_batch {
            let Some(job) = waiting.front() else { break };
            let pages = self.info.pages_for(job.prompt.len(), job.params.max_tokens);
            if reserved + pages > self.info.num_pages {
                break;
            }
            let Some(job) = waiting.pop_front() else { break };
            self.release_queue_slots(1);
            match self.engine.add_request(&job.prompt, job.params) {
                Ok(id) => {
                    reserved += pages;
                    self.metrics.count_admitted(job.prompt.len());
                    running.push(Running { id, pages, events: job.events });
                }
                Err(e) => {
                    let _ = job.events.send(Event::Failed(e.to_string()));
                }
            }
        }
    }

    /// Ends every running request with the step's error (the engine has removed none of them).
    fn fail_all(&mut self, running: &mut Vec<Running>, e: &Error) {
        tracing::error!("engine step failed: {e}");
        for r in running.drain(..) {
            let _ = self.engine.cancel(r.id);
            let _ = r.events.send(Event::Failed(e.to_string()));
        }
    }

    /// `n` jobs left the bounded queue.
    fn release_queue_slots(&self, n: usize) {
        if n > 0 {
            self.queued.fetch_sub(n, Ordering::SeqCst);
        }
    }

    /// Updates the gauges.
    fn publish(&self, running: &[Running]) {
        self.metrics.set_running(running.len(), self.engine.kv_pages_in_use());
        self.metrics.set_waiting(self.queued.load(Ordering::SeqCst));
    }
}

/// Sends each stepped request its tokens, and its end; finished requests leave `running`.
fn dispatch(outputs: Vec<StepOutput>, running: &mut Vec<Running>) {
    for out in outputs {
        let Some(i) = running.iter().position(|r| r.id == out.id) else { continue };
        let events = &running[i].events;
        if !out.tokens.is_empty() {
            let _ = events.send(Event::Tokens { tokens: out.tokens, logprobs: out.logprobs });
        }
        if let Some(reason) = out.finished {
            let _ = events.send(Event::Finished(reason));
            running.swap_remove(i);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pages_cover_prompt_generation_and_tree_rows() {
        let info = EngineInfo {
            max_seq_len: 100,
            num_pages: 10,
            page_size: 16,
            tree_rows: 17,
            max_batch: 4,
            max_queue: 4,
            mode: "ddtree".into(),
        };
        assert_eq!(info.pages_for(10, 5), 2); // 32 rows
        assert_eq!(info.pages_for(10, 6), 3); // 33 rows
    }
}
