//! The tiny checkpoint's tokenizer against transformers: the prompts' ids, decode round trips, special
//! tokens, and the chat template rendered as `apply_chat_template` renders it.

use std::path::{Path, PathBuf};

use kdtree_engine::fixture::Fixture;
use kdtree_engine::model::{ChatMessage, Tokenizer};
use kdtree_engine::Error;

fn tiny_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("fixtures/tiny_model")
}

fn case(name: &str) -> Fixture {
    Fixture::open(tiny_dir().join("reference").join(name)).unwrap()
}

fn ids(f: &Fixture) -> Vec<u32> {
    f.array::<i32>("input_ids").unwrap().into_iter().map(|v| v as u32).collect()
}

/// The fixture's messages from its meta.json.
fn messages(dir: &str) -> (Vec<ChatMessage>, bool) {
    let path = tiny_dir().join("reference").join(dir).join("meta.json");
    let meta: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap();
    let msgs = meta["messages"]
        .as_array()
        .unwrap()
        .iter()
        .map(|m| ChatMessage::new(m["role"].as_str().unwrap(), m["content"].as_str().unwrap()))
        .collect();
    (msgs, meta["add_generation_prompt"].as_bool().unwrap())
}

#[test]
fn prompts_encode_to_the_transformers_ids_and_decode_back() {
    let tok = Tokenizer::from_dir(tiny_dir()).unwrap();
    assert_eq!(tok.vocab_size(), 4096);
    for name in ["hello", "capital", "story", "chat"] {
        let f = case(name);
        let prompt = f.str("prompt").unwrap();
        let got = tok.encode(&prompt, false).unwrap();
        assert_eq!(got, ids(&f), "{name}: ids differ from transformers'");
        assert_eq!(tok.decode(&got, false).unwrap(), prompt, "{name}: decode does not round-trip");
    }
}

#[test]
fn special_tokens_are_single_ids_and_can_be_skipped() {
    let tok = Tokenizer::from_dir(tiny_dir()).unwrap();
    assert_eq!(tok.eos_token(), Some("[EOS]"));
    assert_eq!(tok.bos_token(), Some("[BOS]"));
    let eos = tok.eos_token_id().unwrap();
    let end = tok.token_id("<|im_end|>").unwrap();
    let ids = tok.encode("Hi<|im_end|>[EOS]", false).unwrap();
    assert_eq!(&ids[ids.len() - 2..], &[end, eos]);
    assert_eq!(tok.decode(&ids, true).unwrap(), "Hi");
    let err = tok.decode(&[4096], false).unwrap_err();
    assert!(err.to_string().contains("token id 4096"), "{err}");
}

#[test]
fn the_chat_template_renders_as_transformers_does() {
    let tok = Tokenizer::from_dir(tiny_dir()).unwrap();
    for dir in ["chat_template", "chat_template_two_turns"] {
        let f = case(dir);
        let (msgs, add_generation_prompt) = messages(dir);
        let text = tok.apply_chat_template(&msgs, add_generation_prompt).unwrap();
        assert_eq!(text, f.str("text").unwrap(), "{dir}: rendered text");
        assert_eq!(tok.encode(&text, false).unwrap(), ids(&f), "{dir}: ids of the rendered chat");
    }
}

#[test]
fn an_unknown_role_raises_the_templates_exception() {
    let tok = Tokenizer::from_dir(tiny_dir()).unwrap();
    let err = tok.apply_chat_template(&[ChatMessage::new("robot", "beep")], true).unwrap_err();
    assert!(err.to_string().contains("unknown role: robot"), "{err}");
}

#[test]
fn a_bad_tokenizer_file_is_named() {
    let dir = std::env::temp_dir().join(format!("kdtree-tokenizer-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join("tokenizer.json");
    std::fs::write(&path, "{ not json").unwrap();
    match Tokenizer::from_files(&path, None) {
        Err(Error::Data { path: p, detail }) => {
            assert_eq!(p, path);
            assert!(detail.contains("not a valid tokenizer.json"), "{detail}");
        }
        Err(other) => panic!("expected a data error naming the file, got {other}"),
        Ok(_) => panic!("a broken tokenizer.json should fail"),
    }
    let missing = Tokenizer::from_dir(dir.join("nowhere")).err().map(|e| e.to_string()).unwrap_or_default();
    assert!(missing.contains("nowhere/tokenizer.json"), "{missing}");
}
