//! The CPU forward pass against Hugging Face transformers on the second tiny checkpoint of
//! `reference/make_tiny_checkpoint.py`, `fixtures/tiny_model_noqlora/`: `q_lora_rank` null (the query through
//! `q_proj`) and `tie_word_embeddings` (no `lm_head.weight`; the logits come from the embedding), the two paths
//! `fixtures/tiny_model/` (q_lora_rank 64, untied lm_head) does not take. Same bounds as `model_forward.rs`.

use std::path::{Path, PathBuf};

use kdtree_engine::fixture::Fixture;
use kdtree_engine::model::config::Config;
use kdtree_engine::model::weights::Checkpoint;
use kdtree_engine::model::{KvCache, Logits, Model, Tokenizer};

const CASES: [&str; 3] = ["hello", "capital", "story"];
/// Issue 5's bounds against the float32 transformers reference.
const MAX_REL_FROBENIUS: f64 = 1e-2;
const MIN_ARGMAX_AGREEMENT: f64 = 0.99;

fn noqlora_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("fixtures/tiny_model_noqlora")
}

fn case(name: &str) -> Fixture {
    Fixture::open(noqlora_dir().join("reference").join(name)).unwrap()
}

fn ids(f: &Fixture, key: &str) -> Vec<u32> {
    f.array::<i32>(key).unwrap().into_iter().map(|v| v as u32).collect()
}

fn cache(model: &Model) -> KvCache {
    model.new_cache(64, 16, 256).unwrap()
}

/// Index of the largest value, ties to the smaller index.
fn argmax(row: &[f32]) -> u32 {
    let mut best = 0;
    for (i, &v) in row.iter().enumerate() {
        if v > row[best] {
            best = i;
        }
    }
    best as u32
}

fn rel_frobenius(a: &[f32], reference: &[f32]) -> f64 {
    let diff: f64 = a.iter().zip(reference).map(|(x, r)| (*x as f64 - *r as f64).powi(2)).sum();
    let norm: f64 = reference.iter().map(|r| (*r as f64).powi(2)).sum();
    (diff / norm).sqrt()
}

#[test]
fn the_checkpoint_takes_the_q_proj_and_tied_embedding_paths() {
    let config = Config::from_file(noqlora_dir().join("config.json")).unwrap();
    assert_eq!(config.q_lora_rank, None);
    assert!(config.tie_word_embeddings);
    assert_eq!((config.kv_lora_rank, config.qk_rope_head_dim), (512, 64));
    assert!(config.num_attention_heads >= 8);
    assert!(config.int4_experts.is_some());
    let ckpt = Checkpoint::open(noqlora_dir()).unwrap();
    assert!(ckpt.contains("model.layers.0.self_attn.q_proj.weight"));
    assert!(!ckpt.contains("model.layers.0.self_attn.q_a_proj.weight"));
    assert!(!ckpt.contains("model.layers.0.self_attn.q_b_proj.weight"));
    assert!(!ckpt.contains("lm_head.weight"));
    assert!(ckpt.contains("model.layers.1.mlp.experts.0.gate_proj.weight_packed"));
}

#[test]
fn prompts_are_the_tokenizer_ids() {
    let tok = Tokenizer::from_dir(noqlora_dir()).unwrap();
    for name in CASES {
        let f = case(name);
        let prompt = f.str("prompt").unwrap();
        assert_eq!(tok.encode(&prompt, false).unwrap(), ids(&f, "input_ids"), "{name}");
    }
}

#[test]
fn prompt_logits_match_transformers() {
    let model = Model::load(noqlora_dir()).unwrap();
    let vocab = model.config().vocab_size;
    for name in CASES {
        let f = case(name);
        let prompt = ids(&f, "input_ids");
        let expected: Vec<f32> = f.array("logits").unwrap();
        let mut cache = cache(&model);
        let seq = cache.add_sequence();
        let got = model.forward(&mut cache, &[(seq, &prompt)], Logits::All).unwrap();
        assert_eq!(got.len(), expected.len(), "{name}: logits shape");
        let err = rel_frobenius(&got, &expected);
        let rows = prompt.len();
        let same = (0..rows)
            .filter(|&t| argmax(&got[t * vocab..(t + 1) * vocab]) == argmax(&expected[t * vocab..(t + 1) * vocab]))
            .count();
        let agreement = same as f64 / rows as f64;
        println!(
            "noqlora {name}: {rows} positions, relative Frobenius error {err:.3e}, argmax agreement {same}/{rows}"
        );
        assert!(
            err <= MAX_REL_FROBENIUS,
            "noqlora {name}: relative Frobenius error {err:.3e} > {MAX_REL_FROBENIUS} (argmax agreement {same}/{rows})"
        );
        assert!(
            agreement >= MIN_ARGMAX_AGREEMENT,
            "noqlora {name}: argmax agreement {same}/{rows} < {MIN_ARGMAX_AGREEMENT} (rel. Frobenius error {err:.3e})"
        );
    }
}

#[test]
fn greedy_continuation_matches_transformers() {
    let model = Model::load(noqlora_dir()).unwrap();
    for name in CASES {
        let f = case(name);
        let prompt = ids(&f, "input_ids");
        let expected = ids(&f, "greedy");
        let mut cache = cache(&model);
        let seq = cache.add_sequence();
        let mut logits = model.forward(&mut cache, &[(seq, &prompt)], Logits::Last).unwrap();
        let mut generated = Vec::new();
        while generated.len() < expected.len() {
            let next = argmax(&logits);
            generated.push(next);
            logits = model.forward(&mut cache, &[(seq, &[next])], Logits::Last).unwrap();
        }
        let same = generated.iter().zip(&expected).take_while(|(a, b)| a == b).count();
        println!("noqlora {name}: greedy continuation matches for {same}/{} tokens", expected.len());
        assert_eq!(
            generated,
            expected,
            "noqlora {name}: greedy continuation differs from transformers after {same}/{} tokens",
            expected.len()
        );
    }
}
