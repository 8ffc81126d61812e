//! The speculative engine (src/spec): greedy `chain` and `ddtree` emit plain decoding's tokens, alone and
//! in batches of prompts of different lengths, on every backend; the cache commit moves the accepted
//! rows (a wrong path changes the next logits); bad settings and requests are errors naming the problem.
//! One test body per property, run on the CPU here and on CUDA in `mod cuda`.

mod common;

use std::path::{Path, PathBuf};

use std::collections::HashMap;

use kdtree_engine::model::backend::Backend;
use kdtree_engine::model::{Drafter, Logits, Model, StepRequest, TreeCommit, TreeInput};
use kdtree_engine::spec::{
    DflashProposer, DraftRequest, Engine, EngineConfig, FinishReason, Mode, NgramProposer, Proposal, Proposer,
    RequestId, RequestParams, Sampling, TokenLogprob,
};

fn tiny_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("fixtures/tiny_model")
}

/// Prompts of different lengths, with the tokens each generates (half as many in an unoptimized build,
/// where the CPU step is about twenty times slower).
const PROMPTS: [(&[u32], usize); 4] = [
    (&[100, 7, 14, 21, 28], scaled(40)),
    (&[5], scaled(33)),
    (&[900, 901, 17, 17, 17, 4, 88, 1000, 3, 3, 250, 251], scaled(28)),
    (&[42, 43, 44, 45, 46, 47, 48, 49, 50, 51, 52, 53, 54, 55, 56, 57, 58, 59, 60, 61, 62, 63, 64], scaled(21)),
];

const fn scaled(tokens: usize) -> usize {
    if cfg!(debug_assertions) {
        tokens / 2
    } else {
        tokens
    }
}

/// The reference: one token at a time through the model's own decode step.
fn greedy<B: Backend>(model: &Model<B>, prompt: &[u32], n: usize) -> Vec<u32> {
    let len = (prompt.len() + n).max(256);
    let mut cache = model.new_cache(len.div_ceil(16), 16, len).unwrap();
    let seq = cache.add_sequence();
    let mut next = model.forward_argmax(&mut cache, &[(seq, prompt)], Logits::Last).unwrap()[0];
    let mut out = vec![next];
    while out.len() < n {
        next = model.forward_argmax(&mut cache, &[(seq, std::slice::from_ref(&next))], Logits::Last).unwrap()[0];
        out.push(next);
    }
    out
}

fn config(mode: Mode, budget: usize, block: usize) -> EngineConfig {
    EngineConfig { mode, budget, block, num_pages: 256, page_size: 16, max_seq_len: 256 }
}

fn params(max_tokens: usize) -> RequestParams {
    RequestParams { max_tokens, stop_tokens: Vec::new(), sampling: None, logprobs: None }
}

/// Plain sampling: one token at a time through the model's logits, each chosen at its position.
fn sampled<B: Backend>(model: &Model<B>, prompt: &[u32], n: usize, s: &Sampling) -> Vec<u32> {
    let mut cache = model.new_cache(64, 16, 256).unwrap();
    let seq = cache.add_sequence();
    let mut logits = model.forward(&mut cache, &[(seq, prompt)], Logits::Last).unwrap();
    let mut out = Vec::new();
    while out.len() < n {
        let next = s.choose(&logits, prompt.len() + out.len());
        out.push(next);
        logits = model.forward(&mut cache, &[(seq, &[next])], Logits::Last).unwrap();
    }
    out
}

fn sampling(seed: u64) -> Sampling {
    Sampling { temperature: 0.8, top_p: 0.95, top_k: 0, seed }
}

/// With sampling, every mode emits plain sampling's tokens (the same seeds), alone and in a batch where
/// greedy and sampling requests share the steps.
fn check_sampled_modes_equal_plain_sampling<B: Backend>(model: &Model<B>, label: &str) {
    let requests: Vec<(&[u32], usize, Option<Sampling>)> =
        PROMPTS.iter().enumerate().map(|(i, &(p, n))| (p, n, (i != 1).then(|| sampling(11 + i as u64)))).collect();
    let want: Vec<Vec<u32>> =
        requests.iter().map(|&(p, n, s)| s.map_or_else(|| greedy(model, p, n), |s| sampled(model, p, n, &s))).collect();
    for (mode, budget) in [(Mode::Ar, 1), (Mode::Chain, 1), (Mode::DdTree, 16), (Mode::Auto, 16)] {
        let cfg = config(mode, budget, 16);
        let run = |reqs: &[(&[u32], usize, Option<Sampling>)]| {
            let mut engine = Engine::new(model, NgramProposer::default(), cfg).unwrap();
            for &(p, n, sampling) in reqs {
                engine
                    .add_request(p, RequestParams { max_tokens: n, stop_tokens: Vec::new(), sampling, logprobs: None })
                    .unwrap();
            }
            let out: Vec<Vec<u32>> = engine.run_to_end().unwrap().into_iter().map(|(_, t)| t).collect();
            (out, engine.stats().mean_accepted_length())
        };
        let (batched, accepted) = run(&requests);
        println!("{label} sampled {mode:?} B {budget}: batch of 4, mean accepted length {accepted:.2}");
        assert_eq!(batched, want, "{label} sampled {mode:?} B {budget}: the batch differs from plain sampling");
        for (i, r) in requests.iter().enumerate() {
            assert_eq!(run(std::slice::from_ref(r)).0[0], want[i], "{label} sampled {mode:?} B {budget}: prompt {i}");
        }
    }
}

/// Runs `prompts` through one engine, all added before the first step.
fn generate<B: Backend>(model: &Model<B>, cfg: EngineConfig, prompts: &[(&[u32], usize)]) -> (Vec<Vec<u32>>, f64) {
    let mut engine = Engine::new(model, NgramProposer::default(), cfg).unwrap();
    for &(p, n) in prompts {
        engine.add_request(p, params(n)).unwrap();
    }
    let out = engine.run_to_end().unwrap().into_iter().map(|(_, t)| t).collect();
    (out, engine.stats().mean_accepted_length())
}

/// Every mode's tokens equal plain decoding's, per prompt alone and for all prompts in one batch (where
/// the shorter requests leave while the others go on); the drafting modes accept drafts (so the test
/// goes through the cache commit).
fn check_modes_equal_ar<B: Backend>(model: &Model<B>, label: &str) {
    let want: Vec<Vec<u32>> = PROMPTS.iter().map(|&(p, n)| greedy(model, p, n)).collect();
    let modes = [
        (Mode::Ar, 1, 16),
        (Mode::Chain, 1, 5),
        (Mode::Chain, 1, 16),
        (Mode::DdTree, 8, 16),
        (Mode::DdTree, 16, 16),
        (Mode::DdTree, 32, 16),
        (Mode::DdTree, 64, 16),
        (Mode::Auto, 16, 16),
    ];
    for (mode, budget, block) in modes {
        let cfg = config(mode, budget, block);
        let (batched, accepted) = generate(model, cfg, &PROMPTS);
        println!("{label} {mode:?} B {budget} block {block}: batch of 4, mean accepted length {accepted:.2}");
        assert_eq!(batched, want, "{label} {mode:?} B {budget} block {block}: a batch of 4 differs from greedy");
        if !matches!(mode, Mode::Ar | Mode::Auto) {
            assert!(accepted > 1.5, "{label} {mode:?} B {budget}: mean accepted length {accepted:.2}, want > 1.5");
        }
        for (i, &(p, n)) in PROMPTS.iter().enumerate() {
            let (alone, _) = generate(model, cfg, &[(p, n)]);
            assert_eq!(alone[0], want[i], "{label} {mode:?} B {budget} block {block}: prompt {i} alone differs");
        }
    }
}

fn drafter_dir() -> PathBuf {
    tiny_dir().join("drafter")
}

/// Runs `prompts` through one engine drafting with the DFlash drafter, all added before the first step.
fn generate_drafted<B: Backend>(
    model: &Model<B>,
    drafter: &Drafter<B>,
    cfg: EngineConfig,
    prompts: &[(&[u32], usize)],
) -> Vec<Vec<u32>> {
    let mut engine = Engine::new(model, DflashProposer::new(drafter, &cfg).unwrap(), cfg).unwrap();
    for &(p, n) in prompts {
        engine.add_request(p, params(n)).unwrap();
    }
    engine.run_to_end().unwrap().into_iter().map(|(_, t)| t).collect()
}

/// With the DFlash drafter proposing, every mode's tokens equal plain decoding's, alone and batched.
fn check_drafted_modes_equal_ar<B: Backend>(model: &Model<B>, drafter: &Drafter<B>, label: &str) {
    let block = drafter.dflash().block_size;
    let want: Vec<Vec<u32>> = PROMPTS.iter().map(|&(p, n)| greedy(model, p, n)).collect();
    // An unoptimized build runs the smallest budget only: the others take many minutes there (every
    // release run, on the CPU and on CUDA, runs them all).
    let modes: &[(Mode, usize)] = if cfg!(debug_assertions) {
        &[(Mode::Chain, 1), (Mode::DdTree, 8), (Mode::Auto, 32)]
    } else {
        &[
            (Mode::Chain, 1),
            (Mode::DdTree, 8),
            (Mode::DdTree, 16),
            (Mode::DdTree, 32),
            (Mode::DdTree, 64),
            (Mode::Auto, 32),
        ]
    };
    for &(mode, budget) in modes {
        let started = std::time::Instant::now();
        let cfg = config(mode, budget, block);
        assert_eq!(generate_drafted(model, drafter, cfg, &PROMPTS), want, "{label} drafter {mode:?} B {budget}: batch");
        for (i, &(p, n)) in PROMPTS.iter().enumerate() {
            let alone = generate_drafted(model, drafter, cfg, &[(p, n)]);
            assert_eq!(alone[0], want[i], "{label} drafter {mode:?} B {budget}: prompt {i} alone");
        }
        println!("{label} drafter {mode:?} B {budget}: {:.1} s", started.elapsed().as_secs_f64());
    }
}

/// Prompt lookup that also reads the drafter's target layers and keeps every feature the engine hands
/// it, per request (with the history it came with).
struct FeatureLog {
    ngram: NgramProposer,
    layers: Vec<usize>,
    seen: HashMap<RequestId, (Vec<u32>, Vec<f32>)>,
}

impl Proposer for FeatureLog {
    fn feature_layers(&self) -> &[usize] {
        &self.layers
    }

    fn propose(
        &mut self,
        batch: &[DraftRequest],
        depth: usize,
        k: usize,
        vocab: usize,
    ) -> kdtree_engine::Result<Vec<Proposal>> {
        for r in batch {
            let entry = self.seen.entry(r.id).or_default();
            entry.0 = r.history.to_vec();
            entry.1.extend_from_slice(r.features);
        }
        self.ngram.propose(batch, depth, k, vocab)
    }
}

/// The features the engine hands a proposer over a whole generation (prefill, decode rows, the
/// accepted rows of trees, accepted several deep) are, token for token and bit for bit, the hidden
/// states a plain prefill of the same tokens gives.
fn check_features_follow_the_committed_tokens<B: Backend>(model: &Model<B>, layers: &[usize], label: &str) {
    let log = FeatureLog { ngram: NgramProposer::default(), layers: layers.to_vec(), seen: HashMap::new() };
    let cfg = config(Mode::DdTree, 16, 8);
    let mut engine = Engine::new(model, log, cfg).unwrap();
    let ids: Vec<RequestId> = PROMPTS.iter().map(|&(p, n)| engine.add_request(p, params(n)).unwrap()).collect();
    engine.run_to_end().unwrap();
    let accepted = engine.stats().mean_accepted_length();
    assert!(accepted > 1.5, "{label}: mean accepted length {accepted:.2}: the test needs deep accepted paths");
    let h = model.config().hidden_size;
    let seen = &engine.proposer().seen;
    for (i, id) in ids.iter().enumerate() {
        let (history, got) = &seen[id];
        let committed = &history[..history.len() - 1];
        let mut cache = model.new_cache(64, 16, 256).unwrap();
        let seq = cache.add_sequence();
        let request = [StepRequest { seq, tokens: committed, tree: None }];
        let step = model.step_hidden(&mut cache, &request, Logits::Last, layers, false).unwrap();
        let t = committed.len();
        let mut want = Vec::new();
        for j in 0..t {
            for l in 0..layers.len() {
                want.extend_from_slice(&step.hidden[(l * t + j) * h..(l * t + j + 1) * h]);
            }
        }
        assert_eq!(got.len(), want.len(), "{label}: prompt {i}: features of {t} tokens");
        assert!(bits(got) == bits(&want), "{label}: prompt {i}: features differ from a plain prefill's");
    }
}

/// A drafter stand-in whose drafts are slow and never right: it reads the target's feature layers, takes
/// `delay` a draft and proposes tokens at log-probability -20.
struct LosingDrafter {
    layers: Vec<usize>,
    delay: std::time::Duration,
    drafts: usize,
    released: Vec<RequestId>,
}

impl Proposer for LosingDrafter {
    fn feature_layers(&self) -> &[usize] {
        &self.layers
    }

    fn propose(
        &mut self,
        batch: &[DraftRequest],
        depth: usize,
        k: usize,
        vocab: usize,
    ) -> kdtree_engine::Result<Vec<Proposal>> {
        self.drafts += 1;
        std::thread::sleep(self.delay);
        let proposal = |r: &DraftRequest| {
            let last = *r.history.last().unwrap() as usize;
            Proposal {
                ids: (0..depth * k).map(|i| ((last + 1 + i) % vocab) as i32).collect(),
                logp: vec![-20.0; depth * k],
            }
        };
        Ok(batch.iter().map(proposal).collect())
    }

    fn release(&mut self, id: RequestId) -> kdtree_engine::Result<()> {
        self.released.push(id);
        Ok(())
    }
}

/// The time of a plain decode step of `batch` one-token sequences, the longest of three.
fn decode_step_time<B: Backend>(model: &Model<B>, batch: usize) -> std::time::Duration {
    let mut cache = model.new_cache(batch * 2, 16, 32).unwrap();
    let seqs: Vec<usize> = (0..batch).map(|_| cache.add_sequence()).collect();
    let token = [1u32];
    let step: Vec<(usize, &[u32])> = seqs.iter().map(|&s| (s, &token[..])).collect();
    (0..3)
        .map(|_| {
            let started = std::time::Instant::now();
            model.forward_argmax(&mut cache, &step, Logits::Last).unwrap();
            started.elapsed()
        })
        .max()
        .unwrap()
}

/// `auto` over a drafter that only loses (each draft takes twice a plain step, at least 20 ms, and
/// nothing in it is likely): after four losing drafts (each followed by a back-off, 7 steps in all) it
/// switches drafting off, lets the drafter's contexts of the requests in flight go, and finishes them
/// with plain steps: greedy tokens, no further draft.
fn check_auto_switches_a_losing_drafter_off<B: Backend>(model: &Model<B>, label: &str) {
    let prompts: Vec<(&[u32], usize)> = PROMPTS.iter().map(|&(p, _)| (p, 64)).collect();
    let want: Vec<Vec<u32>> = prompts.iter().map(|&(p, n)| greedy(model, p, n)).collect();
    let delay = (2 * decode_step_time(model, PROMPTS.len())).max(std::time::Duration::from_millis(20));
    let drafter = LosingDrafter { layers: vec![1, 3], delay, drafts: 0, released: Vec::new() };
    let mut engine = Engine::new(model, drafter, config(Mode::Auto, 16, 16)).unwrap();
    let ids: Vec<RequestId> = prompts.iter().map(|&(p, n)| engine.add_request(p, params(n)).unwrap()).collect();
    let out: Vec<Vec<u32>> = engine.run_to_end().unwrap().into_iter().map(|(_, t)| t).collect();
    assert_eq!(out, want, "{label}: auto with drafting switched off differs from greedy");
    let drafter = engine.proposer();
    assert_eq!(drafter.drafts, 4, "{label}: drafts before drafting went off");
    let mut in_flight = drafter.released[..ids.len()].to_vec();
    in_flight.sort_unstable();
    assert_eq!(in_flight, ids, "{label}: every request in flight lets its drafter context go first");
}

fn bits(x: &[f32]) -> Vec<u32> {
    x.iter().map(|v| v.to_bits()).collect()
}

/// Logits of the last token after a prompt and then `chunks`, each one forward call.
fn logits_after_chunks<B: Backend>(model: &Model<B>, prompt: &[u32], chunks: &[&[u32]]) -> Vec<f32> {
    let mut cache = model.new_cache(16, 16, 64).unwrap();
    let s = cache.add_sequence();
    let mut logits = model.forward(&mut cache, &[(s, prompt)], Logits::Last).unwrap();
    for chunk in chunks {
        logits = model.forward(&mut cache, &[(s, chunk)], Logits::Last).unwrap();
    }
    logits
}

/// A tree of the root and two children, the second the token plain decoding emits, then the commit of
/// `path` and one decode step of `next`: the commit must leave the cache as if the path's tokens had
/// been decoded, so the right path gives plain decoding's bits and the wrong one those of decoding the
/// wrong token.
fn check_commit_moves_the_accepted_rows<B: Backend>(model: &Model<B>) {
    let prompt: &[u32] = &[100, 7, 14, 21, 28];
    let want = greedy(model, prompt, 3);
    let wrong = (want[1] + 1) % model.config().vocab_size as u32;
    let tokens = [want[0], wrong, want[1]];
    let after_commit = |path: &[usize]| {
        let mut cache = model.new_cache(16, 16, 64).unwrap();
        let s = cache.add_sequence();
        model.forward(&mut cache, &[(s, prompt)], Logits::Last).unwrap();
        let tree = TreeInput { depth: &[0, 1, 1], visibility: &[0b001, 0b011, 0b101] };
        model.step(&mut cache, &[StepRequest { seq: s, tokens: &tokens, tree: Some(tree) }], Logits::All).unwrap();
        cache.commit_trees(model.backend(), &[TreeCommit { seq: s, rows: path }], 3).unwrap();
        assert_eq!(cache.len(s).unwrap(), prompt.len() + 2);
        model.step(&mut cache, &[StepRequest { seq: s, tokens: &want[2..3], tree: None }], Logits::Last).unwrap()
    };
    let right = logits_after_chunks(model, prompt, &[&want[..2], &want[2..3]]);
    let decoded_wrong = logits_after_chunks(model, prompt, &[&[want[0], wrong], &want[2..3]]);
    assert_ne!(bits(&right), bits(&decoded_wrong), "the test needs the two paths to differ");
    assert_eq!(bits(&after_commit(&[0, 2])), bits(&right), "committing the accepted row did not move it");
    assert_eq!(bits(&after_commit(&[0, 1])), bits(&decoded_wrong), "committing the other row");
    let mut cache = model.new_cache(16, 16, 64).unwrap();
    let s = cache.add_sequence();
    model.forward(&mut cache, &[(s, prompt)], Logits::Last).unwrap();
    for bad in [&[1, 2][..], &[0, 0], &[0, 3], &[]] {
        let e = cache.commit_trees(model.backend(), &[TreeCommit { seq: s, rows: bad }], 3).err().unwrap();
        assert!(e.to_string().contains("rows"), "{bad:?}: {e}");
    }
    assert_eq!(cache.len(s).unwrap(), prompt.len(), "a rejected commit must not advance the sequence");
}

#[test]
fn modes_emit_greedy_tokens_alone_and_in_batches() {
    check_modes_equal_ar(&Model::load(tiny_dir()).unwrap(), "cpu");
}

#[test]
fn drafted_modes_emit_greedy_tokens_alone_and_in_batches() {
    let model = Model::load(tiny_dir()).unwrap();
    let drafter = Drafter::load(drafter_dir(), &model).unwrap();
    check_drafted_modes_equal_ar(&model, &drafter, "cpu");
}

#[test]
fn auto_switches_a_losing_drafter_off() {
    check_auto_switches_a_losing_drafter_off(&Model::load(tiny_dir()).unwrap(), "cpu");
}

#[test]
fn features_follow_the_committed_tokens() {
    check_features_follow_the_committed_tokens(&Model::load(tiny_dir()).unwrap(), &[1, 3], "cpu");
}

#[test]
fn sampled_modes_emit_plain_sampling_tokens_alone_and_in_batches() {
    check_sampled_modes_equal_plain_sampling(&Model::load(tiny_dir()).unwrap(), "cpu");
}

/// Probabilities of the `top_k` most likely tokens of `softmax(logits / t)`, renormalized (f64).
fn top_k_probs(logits: &[f32], t: f64, top_k: usize) -> Vec<(u32, f64)> {
    let mut order: Vec<usize> = (0..logits.len()).collect();
    order.sort_by(|&a, &b| logits[b].total_cmp(&logits[a]).then(a.cmp(&b)));
    order.truncate(top_k);
    let max = logits[order[0]] as f64;
    let w: Vec<f64> = order.iter().map(|&i| ((logits[i] as f64 - max) / t).exp()).collect();
    let total: f64 = w.iter().sum();
    order.iter().zip(w).map(|(&i, w)| (i as u32, w / total)).collect()
}

/// Pearson's statistic of `counts` against `probs` (bins expecting fewer than 5 merged into one), and the
/// critical value at significance 0.001 (Wilson-Hilferty's approximation of the chi-square quantile).
fn chi_square_pairs<T: PartialEq + Copy>(counts: &[(T, usize)], probs: &[(T, f64)]) -> (f64, f64) {
    let n: usize = counts.iter().map(|c| c.1).sum();
    let observed = |t: T| counts.iter().find(|c| c.0 == t).map_or(0, |c| c.1) as f64;
    let (mut stat, mut bins, mut rest_o, mut rest_e) = (0.0, 0usize, 0.0, 0.0);
    for &(t, p) in probs {
        let e = p * n as f64;
        if e >= 5.0 {
            stat += (observed(t) - e).powi(2) / e;
            bins += 1;
        } else {
            (rest_o, rest_e) = (rest_o + observed(t), rest_e + e);
        }
    }
    let outside: f64 = counts.iter().filter(|c| !probs.iter().any(|p| p.0 == c.0)).map(|c| c.1 as f64).sum();
    if rest_e > 0.0 {
        stat += (rest_o + outside - rest_e).powi(2) / rest_e;
        bins += 1;
    } else if outside > 0.0 {
        stat = f64::INFINITY;
    }
    let df = (bins - 1) as f64;
    let z = 3.090; // the 0.999 quantile of the standard normal
    let critical = df * (1.0 - 2.0 / (9.0 * df) + z * (2.0 / (9.0 * df)).sqrt()).powi(3);
    (stat, critical)
}

/// Counts of each value.
fn histogram<T: PartialEq + Copy>(values: impl Iterator<Item = T>) -> Vec<(T, usize)> {
    let mut counts: Vec<(T, usize)> = Vec::new();
    for v in values {
        match counts.iter_mut().find(|c| c.0 == v) {
            Some(c) => c.1 += 1,
            None => counts.push((v, 1)),
        }
    }
    counts
}

/// The target's distribution of the first two tokens after `prompt` with top-k `k` at temperature `t`:
/// p(a) p(b | a), each from the model's logits.
fn pair_probs<B: Backend>(model: &Model<B>, prompt: &[u32], t: f64, k: usize) -> Vec<((u32, u32), f64)> {
    let first = top_k_probs(&logits_after_chunks(model, prompt, &[]), t, k);
    let mut pairs = Vec::new();
    for (a, pa) in first {
        for (b, pb) in top_k_probs(&logits_after_chunks(model, prompt, &[&[a]]), t, k) {
            pairs.push(((a, b), pa * pb));
        }
    }
    pairs
}

/// Sampling through trees follows the target's distribution: over 1500 seeds of one prompt (the first
/// token from the prefill, the second chosen by a ddtree verify step), the counts of the first two
/// tokens pass a chi-square test at significance 0.001 against the target's top-k distribution of the
/// pair, and fail it against the distribution at twice the temperature.
#[test]
fn sampling_through_a_tree_follows_the_target_distribution() {
    let model = Model::load(tiny_dir()).unwrap();
    let prompt: &[u32] = &[100, 7, 14, 21, 28];
    // The tiny random model's logits are close together; a low temperature spreads its probabilities.
    let (temperature, k, seeds) = (0.1, 4, 1500);
    let mut cfg = config(Mode::DdTree, 8, 4);
    cfg.num_pages = seeds;
    let mut engine = Engine::new(&model, NgramProposer::default(), cfg).unwrap();
    for seed in 0..seeds as u64 {
        let sampling = Some(Sampling { temperature, top_p: 1.0, top_k: k, seed });
        engine
            .add_request(prompt, RequestParams { max_tokens: 2, stop_tokens: Vec::new(), sampling, logprobs: None })
            .unwrap();
    }
    let out = engine.run_to_end().unwrap();
    assert_eq!(engine.stats().drafts, seeds as u64, "every second token must come from a verify step");
    let counts = histogram(out.iter().map(|(_, t)| (t[0], t[1])));
    let (stat, critical) = chi_square_pairs(&counts, &pair_probs(&model, prompt, temperature as f64, k));
    println!("first two tokens over {seeds} seeds: chi-square {stat:.2}, critical {critical:.2}");
    assert!(stat < critical, "chi-square {stat:.2} >= {critical:.2}: the samples do not follow the target");
    let (wrong, wrong_critical) = chi_square_pairs(&counts, &pair_probs(&model, prompt, 2.0 * temperature as f64, k));
    println!("against twice the temperature: chi-square {wrong:.2}, critical {wrong_critical:.2}");
    assert!(wrong > wrong_critical, "the test cannot tell temperature {} from {temperature}", 2.0 * temperature);
}

/// Runs `requests` (prompt, tokens, sampling) through one engine asking for `top` alternatives a token;
/// returns each request's tokens with their log-probabilities.
fn generate_logprobs<B: Backend>(
    model: &Model<B>,
    cfg: EngineConfig,
    requests: &[(&[u32], usize, Option<Sampling>)],
    top: usize,
) -> Vec<Vec<TokenLogprob>> {
    let mut engine = Engine::new(model, NgramProposer::default(), cfg).unwrap();
    let ids: Vec<RequestId> = requests
        .iter()
        .map(|&(p, n, sampling)| {
            let params = RequestParams { max_tokens: n, stop_tokens: Vec::new(), sampling, logprobs: Some(top) };
            engine.add_request(p, params).unwrap()
        })
        .collect();
    let mut out: Vec<Vec<TokenLogprob>> = vec![Vec::new(); ids.len()];
    while engine.pending() > 0 {
        for o in engine.step().unwrap() {
            assert_eq!(o.logprobs.len(), o.tokens.len(), "one logprob entry per token");
            assert!(o.logprobs.iter().zip(&o.tokens).all(|(l, &t)| l.token == t));
            out[ids.iter().position(|&id| id == o.id).unwrap()].extend(o.logprobs);
        }
    }
    out
}

/// Every mode gives each emitted token the log-probability plain decoding's logits give it (computed here
/// in f64 from the plain step's logits) and the same top alternatives, bit for bit across modes, for
/// greedy and sampling requests sharing the steps.
fn check_logprobs_follow_the_target<B: Backend>(model: &Model<B>, label: &str) {
    let top = 3;
    let requests: Vec<(&[u32], usize, Option<Sampling>)> = PROMPTS
        .iter()
        .enumerate()
        .map(|(i, &(p, n))| (p, n.min(12), (i % 2 == 1).then(|| sampling(5 + i as u64))))
        .collect();
    let vocab = model.config().vocab_size;
    let want = generate_logprobs(model, config(Mode::Ar, 1, 16), &requests, top);
    for (r, (&(prompt, _, _), got)) in requests.iter().zip(&want).enumerate() {
        let mut cache = model.new_cache(64, 16, 256).unwrap();
        let seq = cache.add_sequence();
        let mut logits = model.forward(&mut cache, &[(seq, prompt)], Logits::Last).unwrap();
        for l in got {
            let max = logits.iter().fold(f32::NEG_INFINITY, |m, &v| m.max(v)) as f64;
            let lse = max + logits.iter().map(|&v| (v as f64 - max).exp()).sum::<f64>().ln();
            let exact = logits[l.token as usize] as f64 - lse;
            assert!((l.logprob as f64 - exact).abs() < 1e-4, "{label} request {r}: {} against {exact}", l.logprob);
            let mut order: Vec<usize> = (0..vocab).collect();
            order.sort_by(|&a, &b| logits[b].total_cmp(&logits[a]).then(a.cmp(&b)));
            let ids: Vec<u32> = l.top.iter().map(|t| t.0).collect();
            assert_eq!(ids, order[..top].iter().map(|&t| t as u32).collect::<Vec<_>>(), "{label} request {r}: top");
            logits = model.forward(&mut cache, &[(seq, &[l.token])], Logits::Last).unwrap();
        }
    }
    for (mode, budget) in [(Mode::Chain, 1), (Mode::DdTree, 16), (Mode::Auto, 16)] {
        let got = generate_logprobs(model, config(mode, budget, 16), &requests, top);
        assert_eq!(got, want, "{label} {mode:?}: logprobs differ from ar's");
    }
}

#[test]
fn logprobs_follow_the_target_in_every_mode() {
    check_logprobs_follow_the_target(&Model::load(tiny_dir()).unwrap(), "cpu");
}

#[test]
fn commit_moves_the_accepted_rows() {
    check_commit_moves_the_accepted_rows(&Model::load(tiny_dir()).unwrap());
}

#[test]
fn stop_tokens_and_max_tokens_end_requests() {
    let model = Model::load(tiny_dir()).unwrap();
    let prompt: &[u32] = &[100, 7, 14, 21, 28];
    let want = greedy(&model, prompt, 12);
    let stop = want[5];
    let first_stop = want.iter().position(|&t| t == stop).unwrap();
    let mut engine = Engine::new(&model, NgramProposer::default(), config(Mode::DdTree, 16, 8)).unwrap();
    let id = engine
        .add_request(prompt, RequestParams { max_tokens: 12, stop_tokens: vec![stop], sampling: None, logprobs: None })
        .unwrap();
    let (mut tokens, mut reason) = (Vec::new(), None);
    while engine.pending() > 0 {
        for o in engine.step().unwrap() {
            assert_eq!(o.id, id);
            tokens.extend(o.tokens);
            reason = o.finished.or(reason);
        }
    }
    assert_eq!((tokens.as_slice(), reason), (&want[..first_stop], Some(FinishReason::Stop)));
    let (out, _) = generate(&model, config(Mode::DdTree, 16, 8), &[(prompt, 7)]);
    assert_eq!(out[0], want[..7]);
}

#[test]
fn bad_settings_and_requests_are_errors_naming_them() {
    let model = Model::load(tiny_dir()).unwrap();
    let err = |cfg: EngineConfig| Engine::new(&model, NgramProposer::default(), cfg).err().unwrap().to_string();
    assert!(err(config(Mode::DdTree, 0, 16)).contains("budget"));
    assert!(err(config(Mode::DdTree, 65, 16)).contains("budget"));
    assert!(err(config(Mode::Chain, 1, 1)).contains("block"));
    assert!(err(config(Mode::Chain, 1, 65)).contains("block"));
    assert!(err(config(Mode::Auto, 0, 16)).contains("budget"));
    let drafter = Drafter::load(drafter_dir(), &model).unwrap();
    let trained = drafter.dflash().block_size;
    let wrong_block = config(Mode::DdTree, 16, trained + 1);
    let e = DflashProposer::new(&drafter, &wrong_block).err().unwrap().to_string();
    assert!(e.contains("block") && e.contains(&trained.to_string()), "{e}");
    let e =
        Engine::new(&model, DflashProposer::new(&drafter, &config(Mode::DdTree, 16, trained)).unwrap(), wrong_block)
            .err()
            .unwrap()
            .to_string();
    assert!(e.contains("block"), "{e}");
    assert_eq!("auto".parse::<Mode>().unwrap(), Mode::Auto);
    let mut engine = Engine::new(&model, NgramProposer::default(), config(Mode::DdTree, 8, 8)).unwrap();
    let vocab = model.config().vocab_size as u32;
    let bad = |e: &mut Engine<_, _>, p: &[u32], n: usize| e.add_request(p, params(n)).err().unwrap().to_string();
    assert!(bad(&mut engine, &[], 4).contains("prompt"));
    assert!(bad(&mut engine, &[vocab], 4).contains("vocabulary"));
    assert!(bad(&mut engine, &[1, 2], 0).contains("max_tokens"));
    assert!(bad(&mut engine, &[1, 2], 255).contains("context"));
    let too_many = RequestParams { logprobs: Some(21), ..params(4) };
    assert!(engine.add_request(&[1, 2], too_many).err().unwrap().to_string().contains("logprobs"));
    assert!(engine.cancel(7).err().unwrap().to_string().contains("request"));
    assert_eq!("chain".parse::<Mode>().unwrap(), Mode::Chain);
    assert!("auto2".parse::<Mode>().err().unwrap().to_string().contains("mode"));
    let id = engine.add_request(&[1, 2, 3], params(4)).unwrap();
    engine.cancel(id).unwrap();
    assert_eq!(engine.pending(), 0);
}

#[cfg(feature = "cuda")]
mod cuda {
    use super::*;
    use kdtree_engine::cuda::backend::CudaBackend;
    use kdtree_engine::cuda::Gpu;

    fn cuda_model() -> Model<CudaBackend> {
        let gpu = Gpu::new(0).expect("a CUDA device is present, so it must open");
        Model::load_on(tiny_dir(), CudaBackend::new(gpu).unwrap()).unwrap()
    }

    #[test]
    fn cuda_modes_emit_greedy_tokens_alone_and_in_batches() {
        if common::gpu().is_none() {
            return;
        }
        let model = cuda_model();
        for graphs in [false, true] {
            model.set_graphs(graphs);
            check_modes_equal_ar(&model, if graphs { "cuda, graphs on" } else { "cuda, graphs off" });
        }
    }

    #[test]
    fn cuda_drafted_modes_emit_greedy_tokens_alone_and_in_batches() {
        if common::gpu().is_none() {
            return;
        }
        let model = cuda_model();
        let drafter = Drafter::load(drafter_dir(), &model).unwrap();
        for graphs in [false, true] {
            model.set_graphs(graphs);
            drafter.model().set_graphs(graphs);
            check_drafted_modes_equal_ar(&model, &drafter, if graphs { "cuda, graphs on" } else { "cuda, graphs off" });
        }
    }

    #[test]
    fn cuda_features_follow_the_committed_tokens() {
        if common::gpu().is_none() {
            return;
        }
        let model = cuda_model();
        for graphs in [false, true] {
            model.set_graphs(graphs);
            check_features_follow_the_committed_tokens(&model, &[1, 3], &format!("cuda, graphs {graphs}"));
        }
    }

    #[test]
    fn cuda_auto_switches_a_losing_drafter_off() {
        if common::gpu().is_none() {
            return;
        }
        check_auto_switches_a_losing_drafter_off(&cuda_model(), "cuda");
    }

    /// Warms `engine` up for two requests of 300 tokens after `prompt`, runs them, and checks the run
    /// recorded no step graph (`captures` counts the graphs recorded so far) and emitted `want`.
    fn check_warm_run<P: Proposer>(
        mut engine: Engine<CudaBackend, P>,
        captures: &dyn Fn() -> u64,
        prompt: &[u32],
        want: &[u32],
        label: &str,
    ) {
        engine.warm_up(2, engine.config().max_seq_len).unwrap();
        let recorded = captures();
        assert!(recorded > 0, "{label}: the warm-up recorded no graph");
        for _ in 0..2 {
            engine.add_request(prompt, params(want.len())).unwrap();
        }
        let out = engine.run_to_end().unwrap();
        assert_eq!(out[0].1, want, "{label}: tokens after the warm-up");
        assert_eq!(captures(), recorded, "{label}: the run recorded graphs the warm-up did not");
    }

    /// After `warm_up` for the run's batch and length, a run whose sequences cross a length bucket
    /// records no step graph, with prompt lookup and with the drafter (which shares the target's
    /// backend, so that a plan it grows would stale the target's graphs): every shape the run replays
    /// was recorded at start-up.
    #[test]
    fn cuda_warm_up_records_every_graph_a_run_replays() {
        if common::gpu().is_none() {
            return;
        }
        let model = cuda_model();
        let drafter = Drafter::load(drafter_dir(), &model).unwrap();
        let prompt: &[u32] = &[100, 7, 14, 21, 28];
        let want = greedy(&model, prompt, 300);
        let block = drafter.dflash().block_size;
        let captures = || model.graph_captures() + drafter.model().graph_captures();
        for (mode, budget) in [(Mode::Ar, 1), (Mode::DdTree, 16), (Mode::Auto, 16), (Mode::Chain, 1)] {
            let cfg = EngineConfig { max_seq_len: 512, ..config(mode, budget, 16) };
            let engine = Engine::new(&model, NgramProposer::default(), cfg).unwrap();
            check_warm_run(engine, &captures, prompt, &want, &format!("{mode:?}, prompt lookup"));
            let cfg = EngineConfig { block, ..cfg };
            let engine = Engine::new(&model, DflashProposer::new(&drafter, &cfg).unwrap(), cfg).unwrap();
            check_warm_run(engine, &captures, prompt, &want, &format!("{mode:?}, drafter"));
        }
    }

    #[test]
    fn cuda_sampled_modes_emit_plain_sampling_tokens_alone_and_in_batches() {
        if common::gpu().is_none() {
            return;
        }
        check_sampled_modes_equal_plain_sampling(&cuda_model(), "cuda");
    }

    #[test]
    fn cuda_logprobs_follow_the_target_in_every_mode() {
        if common::gpu().is_none() {
            return;
        }
        check_logprobs_follow_the_target(&cuda_model(), "cuda");
    }

    #[test]
    fn cuda_commit_moves_the_accepted_rows() {
        if common::gpu().is_none() {
            return;
        }
        check_commit_moves_the_accepted_rows(&cuda_model());
    }
}
