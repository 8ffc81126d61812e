//! Checkpoint reading: single-file and sharded safetensors, and an error naming the tensor or the file
//! for a missing tensor, a wrong dtype or shape, a truncated file and a missing shard.

use std::path::{Path, PathBuf};

use half::bf16;
use kdtree_engine::model::weights::Checkpoint;
use kdtree_engine::Error;
use safetensors::tensor::TensorView;
use safetensors::{serialize_to_file, Dtype};

/// A fresh directory under the system temp dir, unique to this test.
fn scratch(test: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("kdtree-weights-{}-{test}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

fn bf16_bytes(v: &[f32]) -> Vec<u8> {
    v.iter().flat_map(|x| bf16::from_f32(*x).to_le_bytes()).collect()
}

fn i32_bytes(v: &[i32]) -> Vec<u8> {
    v.iter().flat_map(|x| x.to_le_bytes()).collect()
}

/// Writes `tensors` (name, dtype, shape, bytes) into `path`.
fn write(path: &Path, tensors: &[(&str, Dtype, Vec<usize>, Vec<u8>)]) {
    let views: Vec<(String, TensorView)> =
        tensors.iter().map(|(n, d, s, b)| (n.to_string(), TensorView::new(*d, s.clone(), b).unwrap())).collect();
    serialize_to_file(views, None, path).unwrap();
}

fn sample() -> Vec<(&'static str, Dtype, Vec<usize>, Vec<u8>)> {
    vec![
        ("model.embed_tokens.weight", Dtype::BF16, vec![2, 3], bf16_bytes(&[1.0, -2.0, 0.5, 3.0, 0.25, -1.5])),
        ("model.layers.1.mlp.experts.0.down_proj.weight_packed", Dtype::I32, vec![2, 1], i32_bytes(&[0x7654_3210, -1])),
    ]
}

fn data_detail(err: Error) -> String {
    match err {
        Error::Data { path, detail } => format!("{}: {detail}", path.display()),
        other => panic!("expected a data error, got {other:?}"),
    }
}

#[test]
fn a_single_file_checkpoint_reads_back() {
    let dir = scratch("single");
    write(&dir.join("model.safetensors"), &sample());
    let ckpt = Checkpoint::open(&dir).unwrap();
    let emb = ckpt.bf16("model.embed_tokens.weight", &[2, 3]).unwrap();
    assert_eq!(emb.iter().map(|x| x.to_f32()).collect::<Vec<_>>(), [1.0, -2.0, 0.5, 3.0, 0.25, -1.5]);
    let packed = ckpt.i32("model.layers.1.mlp.experts.0.down_proj.weight_packed", &[2, 1]).unwrap();
    assert_eq!(packed, [0x7654_3210, -1]);
}

#[test]
fn bad_tensors_name_the_tensor() {
    let dir = scratch("bad-tensors");
    write(&dir.join("model.safetensors"), &sample());
    let ckpt = Checkpoint::open(&dir).unwrap();
    let missing = data_detail(ckpt.bf16("lm_head.weight", &[2, 3]).unwrap_err());
    assert!(missing.contains("missing tensor `lm_head.weight`"), "{missing}");
    let shape = data_detail(ckpt.bf16("model.embed_tokens.weight", &[3, 2]).unwrap_err());
    assert!(shape.contains("model.embed_tokens.weight") && shape.contains("[2, 3]"), "{shape}");
    let dtype = data_detail(ckpt.i32("model.embed_tokens.weight", &[2, 3]).unwrap_err());
    assert!(dtype.contains("model.embed_tokens.weight") && dtype.contains("BF16"), "{dtype}");
}

#[test]
fn a_truncated_file_names_the_file() {
    let dir = scratch("truncated");
    let path = dir.join("model.safetensors");
    write(&path, &sample());
    let bytes = std::fs::read(&path).unwrap();
    std::fs::write(&path, &bytes[..bytes.len() - 5]).unwrap();
    let err = data_detail(Checkpoint::open(&dir).err().expect("a truncated file must not open"));
    assert!(err.contains("model.safetensors"), "{err}");
}

#[test]
fn a_sharded_checkpoint_reads_every_shard_and_names_a_missing_one() {
    let dir = scratch("sharded");
    let tensors = sample();
    write(&dir.join("model-00001-of-00002.safetensors"), &tensors[..1]);
    write(&dir.join("model-00002-of-00002.safetensors"), &tensors[1..]);
    let index = serde_json::json!({"metadata": {}, "weight_map": {
        tensors[0].0: "model-00001-of-00002.safetensors",
        tensors[1].0: "model-00002-of-00002.safetensors",
    }});
    std::fs::write(dir.join("model.safetensors.index.json"), index.to_string()).unwrap();
    let ckpt = Checkpoint::open(&dir).unwrap();
    assert!(ckpt.contains(tensors[0].0) && ckpt.contains(tensors[1].0));
    assert_eq!(ckpt.i32(tensors[1].0, &[2, 1]).unwrap(), [0x7654_3210, -1]);

    std::fs::remove_file(dir.join("model-00002-of-00002.safetensors")).unwrap();
    let err = data_detail(Checkpoint::open(&dir).err().expect("a missing shard must not open"));
    assert!(err.contains("model-00002-of-00002.safetensors"), "{err}");
}
