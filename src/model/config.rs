//! Model configuration from a Hugging Face `config.json` of DeepSeek-V3 / Kimi-K2 (`DeepseekV3ForCausalLM`).
//!
//! Every field the model needs is read and checked; a value the code does not support is an error that
//! names the field, never a silent fallback.

use std::path::Path;

use serde::Deserialize;

use crate::error::{Error, Result};

/// YaRN rotary scaling (`rope_scaling` with `type` or `rope_type` "yarn").
#[derive(Clone, Debug, PartialEq)]
pub struct Yarn {
    /// Context extension factor.
    pub factor: f64,
    /// Pre-training context length.
    pub original_max_position_embeddings: usize,
    /// Fast and slow correction bounds.
    pub beta_fast: f64,
    /// Slow correction bound.
    pub beta_slow: f64,
    /// Attention magnitude scaling.
    pub mscale: f64,
    /// Attention magnitude scaling applied to all dims (enters the softmax scale).
    pub mscale_all_dim: f64,
    /// Factor on the rotary cos/sin (transformers' `attention_factor`): given, or
    /// `mscale(factor, mscale) / mscale(factor, mscale_all_dim)` when both are set, else `mscale(factor, 1)`.
    pub attention_factor: f64,
    /// Whether the correction range is rounded outward to whole dims (transformers' `truncate`, default true).
    pub truncate: bool,
}

/// INT4 routed experts in compressed-tensors `pack-quantized` format.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Int4Experts {
    /// Quantization group size along the input dim (32 for Kimi-K2).
    pub group_size: usize,
}

/// The checked configuration of a DeepSeek-V3 / Kimi-K2 model.
#[derive(Clone, Debug, PartialEq)]
pub struct Config {
    /// Vocabulary size.
    pub vocab_size: usize,
    /// Hidden size H.
    pub hidden_size: usize,
    /// Dense MLP intermediate size.
    pub intermediate_size: usize,
    /// Routed and shared experts' intermediate size I.
    pub moe_intermediate_size: usize,
    /// Decoder layers.
    pub num_hidden_layers: usize,
    /// The longest sequence the model is made for (transformers' default 4096 when absent).
    pub max_position_embeddings: usize,
    /// Multi-token-prediction layers stored after the decoder layers (DeepSeek-V3's layer 61); the
    /// forward pass does not run them.
    pub num_nextn_predict_layers: usize,
    /// Attention heads.
    pub num_attention_heads: usize,
    /// Query low-rank dimension, `None` for a full-rank query projection.
    pub q_lora_rank: Option<usize>,
    /// Latent KV dimension (512).
    pub kv_lora_rank: usize,
    /// Per-head non-rotary query/key dimension (128).
    pub qk_nope_head_dim: usize,
    /// Per-head rotary dimension (64).
    pub qk_rope_head_dim: usize,
    /// Per-head value dimension (128).
    pub v_head_dim: usize,
    /// Routed experts E.
    pub n_routed_experts: usize,
    /// Experts per token k.
    pub num_experts_per_tok: usize,
    /// Shared experts.
    pub n_shared_experts: usize,
    /// Leading dense layers.
    pub first_k_dense_replace: usize,
    /// Every `moe_layer_freq`-th layer after the dense ones is MoE.
    pub moe_layer_freq: usize,
    /// Multiplier of the routing weights.
    pub routed_scaling_factor: f64,
    /// Renormalize the chosen experts' scores.
    pub norm_topk_prob: bool,
    /// RMSNorm epsilon.
    pub rms_norm_eps: f64,
    /// RoPE base.
    pub rope_theta: f64,
    /// YaRN scaling, if any.
    pub yarn: Option<Yarn>,
    /// Whether lm_head shares the embedding.
    pub tie_word_embeddings: bool,
    /// Whether the checkpoint's rotary dims are stored as interleaved pairs `(2i, 2i+1)` (DeepSeek's layout,
    /// transformers' default) rather than as halves `(i, i + d/2)`.
    pub rope_interleave: bool,
    /// INT4 routed experts, or `None` for bf16 experts.
    pub int4_experts: Option<Int4Experts>,
}

/// The raw JSON, before checks: every field optional so that a missing one can be named.
#[derive(Deserialize)]
struct Raw {
    vocab_size: Option<usize>,
    hidden_size: Option<usize>,
    max_position_embeddings: Option<usize>,
    num_nextn_predict_layers: Option<usize>,
    intermediate_size: Option<usize>,
    moe_intermediate_size: Option<usize>,
    num_hidden_layers: Option<usize>,
    num_attention_heads: Option<usize>,
    num_key_value_heads: Option<usize>,
    q_lora_rank: Option<usize>,
    kv_lora_rank: Option<usize>,
    qk_nope_head_dim: Option<usize>,
    qk_rope_head_dim: Option<usize>,
    v_head_dim: Option<usize>,
    n_routed_experts: Option<usize>,
    num_experts_per_tok: Option<usize>,
    n_shared_experts: Option<usize>,
    first_k_dense_replace: Option<usize>,
    moe_layer_freq: Option<usize>,
    routed_scaling_factor: Option<f64>,
    norm_topk_prob: Option<bool>,
    topk_method: Option<String>,
    scoring_func: Option<String>,
    n_group: Option<usize>,
    topk_group: Option<usize>,
    rms_norm_eps: Option<f64>,
    rope_theta: Option<f64>,
    rope_scaling: Option<serde_json::Value>,
    tie_word_embeddings: Option<bool>,
    rope_interleave: Option<bool>,
    quantization_config: Option<serde_json::Value>,
}

fn unsupported(field: &'static str, value: impl ToString, reason: &str) -> Error {
    Error::param(field, value, format!("config.json: {reason}"))
}

fn required<T>(field: &'static str, v: Option<T>) -> Result<T> {
    v.ok_or_else(|| unsupported(field, "missing", "this field is required"))
}

impl Config {
    /// Reads and checks `config.json`.
    pub fn from_file(path: impl AsRef<Path>) -> Result<Self> {
        let path = path.as_ref();
        let text = std::fs::read_to_string(path)
            .map_err(|e| Error::Data { path: path.to_path_buf(), detail: e.to_string() })?;
        Self::from_json(&text).map_err(|e| match e {
            Error::Param { .. } => e,
            other => Error::Data { path: path.to_path_buf(), detail: other.to_string() },
        })
    }

    /// Parses and checks the text of a `config.json`.
    pub fn from_json(text: &str) -> Result<Self> {
        let raw: Raw = serde_json::from_str(text)
            .map_err(|e| Error::Data { path: "config.json".into(), detail: e.to_string() })?;
        let heads = required("num_attention_heads", raw.num_attention_heads)?;
        if let Some(kv) = raw.num_key_value_heads {
            if kv != heads {
                return Err(unsupported(
                    "num_key_value_heads",
                    kv,
                    "MLA needs num_key_value_heads == num_attention_heads",
                ));
            }
        }
        if let Some(m) = raw.topk_method.as_deref() {
            if m != "noaux_tc" {
                return Err(unsupported("topk_method", m, "only \"noaux_tc\" (bias-corrected top-k) is supported"));
            }
        }
        if let Some(f) = raw.scoring_func.as_deref() {
            if f != "sigmoid" {
                return Err(unsupported("scoring_func", f, "only \"sigmoid\" routing scores are supported"));
            }
        }
        for (field, v) in [("n_group", raw.n_group), ("topk_group", raw.topk_group)] {
            if let Some(v) = v.filter(|&v| v != 1) {
                return Err(unsupported(field, v, "group-limited routing (groups > 1) is not supported yet"));
            }
        }
        let config = Config {
            vocab_size: required("vocab_size", raw.vocab_size)?,
            hidden_size: required("hidden_size", raw.hidden_size)?,
            intermediate_size: required("intermediate_size", raw.intermediate_size)?,
            moe_intermediate_size: required("moe_intermediate_size", raw.moe_intermediate_size)?,
            num_hidden_layers: required("num_hidden_layers", raw.num_hidden_layers)?,
            max_position_embeddings: raw.max_position_embeddings.unwrap_or(4096),
            num_nextn_predict_layers: raw.num_nextn_predict_layers.unwrap_or(0),
            num_attention_heads: heads,
            q_lora_rank: raw.q_lora_rank,
            kv_lora_rank: required("kv_lora_rank", raw.kv_lora_rank)?,
            qk_nope_head_dim: required("qk_nope_head_dim", raw.qk_nope_head_dim)?,
            qk_rope_head_dim: required("qk_rope_head_dim", raw.qk_rope_head_dim)?,
            v_head_dim: required("v_head_dim", raw.v_head_dim)?,
            n_routed_experts: required("n_routed_experts", raw.n_routed_experts)?,
            num_experts_per_tok: required("num_experts_per_tok", raw.num_experts_per_tok)?,
            n_shared_experts: raw.n_shared_experts.unwrap_or(0),
            first_k_dense_replace: raw.first_k_dense_replace.unwrap_or(0),
            moe_layer_freq: raw.moe_layer_freq.unwrap_or(1),
            routed_scaling_factor: raw.routed_scaling_factor.unwrap_or(1.0),
            norm_topk_prob: raw.norm_topk_prob.unwrap_or(true),
            rms_norm_eps: required("rms_norm_eps", raw.rms_norm_eps)?,
            rope_theta: required("rope_theta", raw.rope_theta)?,
            yarn: raw.rope_scaling.as_ref().map(parse_yarn).transpose()?,
            tie_word_embeddings: raw.tie_word_embeddings.unwrap_or(false),
            rope_interleave: raw.rope_interleave.unwrap_or(true),
            int4_experts: raw.quantization_config.as_ref().map(parse_int4).transpose()?,
        };
        config.check()?;
        Ok(config)
    }

    fn check(&self) -> Result<()> {
        if self.kv_lora_rank != crate::cpu::mla::LATENT || self.qk_rope_head_dim != crate::cpu::mla::ROPE {
            return Err(unsupported(
                "kv_lora_rank / qk_rope_head_dim",
                format!("{} / {}", self.kv_lora_rank, self.qk_rope_head_dim),
                "the MLA kernels are built for a 512-wide latent and 64 rotary dims",
            ));
        }
        if self.num_experts_per_tok == 0 || self.num_experts_per_tok > self.n_routed_experts {
            return Err(unsupported(
                "num_experts_per_tok",
                self.num_experts_per_tok,
                "must be in 1..=n_routed_experts",
            ));
        }
        if self.moe_layer_freq == 0 {
            return Err(unsupported("moe_layer_freq", 0, "must be >= 1"));
        }
        if !self.norm_topk_prob {
            return Err(unsupported("norm_topk_prob", false, "only renormalized routing weights are supported"));
        }
        Ok(())
    }

    /// Whether layer `i` is MoE (else a dense MLP).
    pub fn is_moe_layer(&self, i: usize) -> bool {
        i >= self.first_k_dense_replace && (i - self.first_k_dense_replace).is_multiple_of(self.moe_layer_freq)
    }

    /// The attention softmax scale: `(qk_nope + qk_rope)^-0.5`, times `mscale²` under YaRN with
    /// `mscale = 0.1 · mscale_all_dim · ln(factor) + 1` (factor > 1).
    pub fn softmax_scale(&self) -> f64 {
        let base = ((self.qk_nope_head_dim + self.qk_rope_head_dim) as f64).powf(-0.5);
        match &self.yarn {
            Some(y) if y.mscale_all_dim != 0.0 => {
                let m = yarn_mscale(y.factor, y.mscale_all_dim);
                base * m * m
            }
            _ => base,
        }
    }
}

fn parse_yarn(v: &serde_json::Value) -> Result<Yarn> {
    let kind = v.get("type").or_else(|| v.get("rope_type")).and_then(|t| t.as_str()).unwrap_or("missing");
    if kind != "yarn" {
        return Err(unsupported("rope_scaling.type", kind, "only YaRN rope scaling is supported"));
    }
    let num = |field: &'static str, default: Option<f64>| -> Result<f64> {
        match v.get(field) {
            Some(x) => x.as_f64().ok_or_else(|| unsupported(field, x, "must be a number")),
            None => default.ok_or_else(|| unsupported(field, "missing", "required in rope_scaling")),
        }
    };
    let factor = num("factor", None)?;
    if !(factor.is_finite() && factor > 0.0) {
        return Err(unsupported("rope_scaling.factor", factor, "must be finite and > 0"));
    }
    // transformers treats an absent and a zero mscale alike (`if mscale and mscale_all_dim`).
    let mscale = num("mscale", Some(0.0))?;
    let mscale_all_dim = num("mscale_all_dim", Some(0.0))?;
    let attention_factor = match v.get("attention_factor") {
        Some(_) => num("attention_factor", None)?,
        None if mscale != 0.0 && mscale_all_dim != 0.0 => {
            yarn_mscale(factor, mscale) / yarn_mscale(factor, mscale_all_dim)
        }
        None => yarn_mscale(factor, 1.0),
    };
    let truncate = match v.get("truncate") {
        None => true,
        Some(t) => t.as_bool().ok_or_else(|| unsupported("rope_scaling.truncate", t, "must be a boolean"))?,
    };
    Ok(Yarn {
        factor,
        original_max_position_embeddings: num("original_max_position_embeddings", None)? as usize,
        beta_fast: num("beta_fast", Some(32.0))?,
        beta_slow: num("beta_slow", Some(1.0))?,
        mscale: if mscale == 0.0 { 1.0 } else { mscale },
        mscale_all_dim,
        attention_factor,
        truncate,
    })
}

/// YaRN's magnitude correction `0.1 · m · ln(factor) + 1` (1 for factor <= 1).
pub fn yarn_mscale(factor: f64, m: f64) -> f64 {
    if factor <= 1.0 {
        1.0
    } else {
        0.1 * m * factor.ln() + 1.0
    }
}

/// Accepts only compressed-tensors `pack-quantized` symmetric INT4 weights with a group strategy.
fn parse_int4(v: &serde_json::Value) -> Result<Int4Experts> {
    let method = v.get("quant_method").and_then(|m| m.as_str()).unwrap_or("missing");
    if method != "compressed-tensors" {
        return Err(unsupported("quantization_config.quant_method", method, "only compressed-tensors is supported"));
    }
    let format = v.get("format").and_then(|m| m.as_str()).unwrap_or("missing");
    if format != "pack-quantized" {
        return Err(unsupported("quantization_config.format", format, "only pack-quantized is supported"));
    }
    let weights = v
        .get("config_groups")
        .and_then(|g| g.as_object())
        .and_then(|g| g.values().next())
        .and_then(|g| g.get("weights"))
        .ok_or_else(|| unsupported("quantization_config.config_groups", "missing", "needs a weights scheme"))?;
    let field = |name: &str| weights.get(name).cloned().unwrap_or(serde_json::Value::Null);
    if field("num_bits").as_u64() != Some(4) {
        return Err(unsupported("quantization_config.weights.num_bits", field("num_bits"), "only 4-bit weights"));
    }
    if field("symmetric").as_bool() != Some(true) {
        return Err(unsupported("quantization_config.weights.symmetric", field("symmetric"), "only symmetric"));
    }
    if field("strategy").as_str() != Some("group") {
        return Err(unsupported("quantization_config.weights.strategy", field("strategy"), "only per-group scales"));
    }
    match field("group_size").as_u64() {
        Some(32) => Ok(Int4Experts { group_size: 32 }),
        _ => Err(unsupported("quantization_config.weights.group_size", field("group_size"), "only group 32")),
    }
}
