//! The speculative engine (src/spec): greedy `chain` and `ddtree` emit plain decoding's tokens, alone and
//! in batches of prompts of different lengths, on every backend; the cache commit moves the accepted
//! rows (a wrong path changes the next logits); bad settings and requests are errors naming the problem.
//! One test body per property, run on the CPU here and on CUDA in `mod cuda`.

mod common;

use std::path::{Path, PathBuf};

use kdtree_engine::model::backend::Backend;
use kdtree_engine::model::{Logits, Model, StepRequest, TreeCommit, TreeInput};
use kdtree_engine::spec::{Engine, EngineConfig, FinishReason, Mode, NgramProposer, RequestParams};

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
    let mut cache = model.new_cache(64, 16, 256).unwrap();
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
    RequestParams { max_tokens, stop_tokens: Vec::new() }
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
    ];
    for (mode, budget, block) in modes {
        let cfg = config(mode, budget, block);
        let (batched, accepted) = generate(model, cfg, &PROMPTS);
        println!("{label} {mode:?} B {budget} block {block}: batch of 4, mean accepted length {accepted:.2}");
        assert_eq!(batched, want, "{label} {mode:?} B {budget} block {block}: a batch of 4 differs from greedy");
        if mode != Mode::Ar {
            assert!(accepted > 1.5, "{label} {mode:?} B {budget}: mean accepted length {accepted:.2}, want > 1.5");
        }
        for (i, &(p, n)) in PROMPTS.iter().enumerate() {
            let (alone, _) = generate(model, cfg, &[(p, n)]);
            assert_eq!(alone[0], want[i], "{label} {mode:?} B {budget} block {block}: prompt {i} alone differs");
        }
    }
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
    let id = engine.add_request(prompt, RequestParams { max_tokens: 12, stop_tokens: vec![stop] }).unwrap();
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
    let mut engine = Engine::new(&model, NgramProposer::default(), config(Mode::DdTree, 8, 8)).unwrap();
    let vocab = model.config().vocab_size as u32;
    let bad = |e: &mut Engine<_, _>, p: &[u32], n: usize| e.add_request(p, params(n)).err().unwrap().to_string();
    assert!(bad(&mut engine, &[], 4).contains("prompt"));
    assert!(bad(&mut engine, &[vocab], 4).contains("vocabulary"));
    assert!(bad(&mut engine, &[1, 2], 0).contains("max_tokens"));
    assert!(bad(&mut engine, &[1, 2], 255).contains("context"));
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
    fn cuda_commit_moves_the_accepted_rows() {
        if common::gpu().is_none() {
            return;
        }
        check_commit_moves_the_accepted_rows(&cuda_model());
    }
}
