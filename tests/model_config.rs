//! The model configuration: a Kimi-K2 `config.json` parses with the values the kernels need, and every
//! unsupported or missing value is an error that names its field.

use kdtree_engine::model::config::Config;
use kdtree_engine::Error;

/// Kimi-K2's text config (values from research/kernels.md §1.2) with its INT4 quantization block.
fn kimi() -> serde_json::Value {
    serde_json::json!({
        "architectures": ["DeepseekV3ForCausalLM"], "model_type": "kimi_k2",
        "vocab_size": 163840, "hidden_size": 7168, "intermediate_size": 18432, "moe_intermediate_size": 2048,
        "num_hidden_layers": 61, "num_attention_heads": 64, "num_key_value_heads": 64,
        "q_lora_rank": 1536, "kv_lora_rank": 512, "qk_nope_head_dim": 128, "qk_rope_head_dim": 64, "v_head_dim": 128,
        "n_routed_experts": 384, "num_experts_per_tok": 8, "n_shared_experts": 1, "first_k_dense_replace": 1,
        "moe_layer_freq": 1, "routed_scaling_factor": 2.827, "norm_topk_prob": true, "topk_method": "noaux_tc",
        "scoring_func": "sigmoid", "n_group": 1, "topk_group": 1, "rms_norm_eps": 1e-6, "rope_theta": 50000.0,
        "rope_scaling": {"type": "yarn", "factor": 32.0, "original_max_position_embeddings": 4096,
                         "beta_fast": 1.0, "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 1.0},
        "tie_word_embeddings": false,
        "quantization_config": {"quant_method": "compressed-tensors", "format": "pack-quantized",
            "config_groups": {"group_0": {"weights": {"num_bits": 4, "type": "int", "symmetric": true,
                                                      "strategy": "group", "group_size": 32}}}}
    })
}

fn parse(v: &serde_json::Value) -> kdtree_engine::Result<Config> {
    Config::from_json(&v.to_string())
}

#[test]
fn kimi_k2_parses_with_the_kernels_values() {
    let c = parse(&kimi()).unwrap();
    assert_eq!((c.num_attention_heads, c.n_routed_experts, c.num_experts_per_tok), (64, 384, 8));
    assert_eq!(c.q_lora_rank, Some(1536));
    assert_eq!(c.int4_experts.as_ref().map(|q| q.group_size), Some(32));
    assert!(!c.is_moe_layer(0) && c.is_moe_layer(1) && c.is_moe_layer(60));
    // The MLA fixtures use this scale: mscale² / sqrt(192) with mscale = 0.1 ln 32 + 1.
    assert_eq!(c.softmax_scale() as f32, 0.130_860_8_f32);
}

#[test]
fn a_null_q_lora_rank_is_a_full_rank_query() {
    let mut v = kimi();
    v["q_lora_rank"] = serde_json::Value::Null;
    assert_eq!(parse(&v).unwrap().q_lora_rank, None);
}

/// Sets `path` (a dotted path into the JSON) to `value` and expects an error naming `field`.
fn rejects(path: &[&str], value: serde_json::Value, field: &str) {
    let mut v = kimi();
    let mut at = &mut v;
    for key in &path[..path.len() - 1] {
        at = &mut at[*key];
    }
    at[path[path.len() - 1]] = value;
    match parse(&v) {
        Err(Error::Param { name, .. }) => assert!(name.contains(field), "{path:?}: error names `{name}`"),
        other => panic!("{path:?}: expected an error naming {field}, got {other:?}"),
    }
}

#[test]
fn unsupported_values_name_their_field() {
    rejects(&["n_group"], 8.into(), "n_group");
    rejects(&["topk_group"], 4.into(), "topk_group");
    rejects(&["scoring_func"], "softmax".into(), "scoring_func");
    rejects(&["topk_method"], "greedy".into(), "topk_method");
    rejects(&["num_key_value_heads"], 8.into(), "num_key_value_heads");
    rejects(&["kv_lora_rank"], 256.into(), "kv_lora_rank");
    rejects(&["num_experts_per_tok"], 400.into(), "num_experts_per_tok");
    rejects(&["norm_topk_prob"], false.into(), "norm_topk_prob");
    rejects(&["rope_scaling", "type"], "linear".into(), "rope_scaling.type");
    rejects(&["quantization_config", "format"], "naive-quantized".into(), "format");
    rejects(&["quantization_config", "config_groups", "group_0", "weights", "group_size"], 128.into(), "group_size");
    rejects(&["quantization_config", "config_groups", "group_0", "weights", "num_bits"], 8.into(), "num_bits");
}

#[test]
fn a_missing_field_is_named() {
    let mut v = kimi();
    v.as_object_mut().unwrap().remove("hidden_size");
    match parse(&v) {
        Err(Error::Param { name: "hidden_size", .. }) => {}
        other => panic!("expected an error naming hidden_size, got {other:?}"),
    }
}

#[test]
fn a_missing_file_is_named() {
    let err = Config::from_file("/nonexistent/config.json").unwrap_err();
    assert!(err.to_string().contains("/nonexistent/config.json"), "{err}");
}
