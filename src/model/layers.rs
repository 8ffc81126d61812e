//! The model's building blocks as read from a checkpoint, in host memory: bf16 linear layers, RMSNorm
//! weights, the dense MLP, the MoE block (router, INT4 routed experts, shared expert) and the MLA
//! projections. Each shape is checked against the config while reading; [`crate::model::Model`] places
//! them on its backend once.

use half::bf16;

use crate::cpu::moe_int4::{self, Experts, Int4Owned, OwnedExperts};
use crate::error::{check_len, Error, Result};
use crate::model::config::Config;
use crate::model::weights::Checkpoint;

/// A bias-free linear layer with a bf16 weight `[out, in]`.
#[derive(Clone, Debug)]
pub struct Linear {
    w: Vec<bf16>,
    out: usize,
    inp: usize,
}

impl Linear {
    /// A layer of weight `w [out, inp]`.
    pub fn new(w: Vec<bf16>, out: usize, inp: usize) -> Result<Self> {
        check_len("w", w.len(), &[("out", out), ("in", inp)])?;
        Ok(Linear { w, out, inp })
    }

    /// Reads `<name>` as a `[out, inp]` bf16 tensor.
    pub fn load(ckpt: &Checkpoint, name: &str, out: usize, inp: usize) -> Result<Self> {
        Self::new(ckpt.bf16(name, &[out, inp])?, out, inp)
    }

    /// The weight, `[out, in]` row-major.
    pub fn weight(&self) -> &[bf16] {
        &self.w
    }

    /// Output features.
    pub fn out_features(&self) -> usize {
        self.out
    }

    /// Row `r` of the weight.
    pub fn row(&self, r: usize) -> &[bf16] {
        &self.w[r * self.inp..(r + 1) * self.inp]
    }

    /// Input features.
    pub fn in_features(&self) -> usize {
        self.inp
    }

    /// Output rows `rows` of this layer (a row-split share of it).
    pub fn rows(&self, rows: std::ops::Range<usize>) -> Result<Self> {
        check_range("rows", &rows, self.out)?;
        Self::new(self.w[rows.start * self.inp..rows.end * self.inp].to_vec(), rows.len(), self.inp)
    }

    /// Input columns `cols` of this layer (a column-split share of it, whose outputs are partial sums).
    pub fn columns(&self, cols: std::ops::Range<usize>) -> Result<Self> {
        check_range("columns", &cols, self.inp)?;
        let w = (0..self.out).flat_map(|r| self.row(r)[cols.clone()].iter().copied()).collect();
        Self::new(w, self.out, cols.len())
    }
}

/// `range` is a non-empty part of `0..len`.
fn check_range(name: &'static str, range: &std::ops::Range<usize>, len: usize) -> Result<()> {
    if range.is_empty() || range.end > len {
        return Err(Error::param(name, format!("{range:?}"), format!("must be a non-empty part of 0..{len}")));
    }
    Ok(())
}

/// RMSNorm with a learned scale: `w · x / sqrt(mean(x²) + eps)` ([`crate::cpu::rowops::rmsnorm`]).
#[derive(Clone, Debug)]
pub struct RmsNorm {
    /// The scale, widened to f32.
    pub w: Vec<f32>,
    /// Epsilon.
    pub eps: f32,
}

impl RmsNorm {
    /// Reads the `[dim]` bf16 scale `<name>`.
    pub fn load(ckpt: &Checkpoint, name: &str, dim: usize, eps: f64) -> Result<Self> {
        let w = ckpt.bf16(name, &[dim])?.into_iter().map(|v| v.to_f32()).collect();
        Ok(RmsNorm { w, eps: eps as f32 })
    }
}

/// The gated MLP `down(SiLU(gate(x)) · up(x))` in bf16 weights (dense layers and the shared expert).
#[derive(Clone, Debug)]
pub struct Mlp {
    /// `gate_proj`.
    pub gate: Linear,
    /// `up_proj`.
    pub up: Linear,
    /// `down_proj`.
    pub down: Linear,
}

impl Mlp {
    /// The share of intermediate features `inter` of this MLP: those gate and up rows, the matching down
    /// columns; its output is a partial sum of the whole MLP's.
    pub fn part(&self, inter: std::ops::Range<usize>) -> Result<Self> {
        Ok(Mlp {
            gate: self.gate.rows(inter.clone())?,
            up: self.up.rows(inter.clone())?,
            down: self.down.columns(inter)?,
        })
    }

    /// Reads `<prefix>.{gate,up,down}_proj.weight` for hidden size `h` and intermediate size `i`.
    pub fn load(ckpt: &Checkpoint, prefix: &str, h: usize, i: usize) -> Result<Self> {
        Ok(Mlp {
            gate: Linear::load(ckpt, &format!("{prefix}.gate_proj.weight"), i, h)?,
            up: Linear::load(ckpt, &format!("{prefix}.up_proj.weight"), i, h)?,
            down: Linear::load(ckpt, &format!("{prefix}.down_proj.weight"), h, i)?,
        })
    }
}

/// One layer's routed experts in the `pack-quantized` INT4 layout, concatenated the way
/// [`moe_int4::moe_int4`] reads them: `w13` = each expert's gate rows then up rows, `w2` = down rows.
#[derive(Clone, Debug)]
pub struct RoutedExperts(OwnedExperts);

impl RoutedExperts {
    /// Reads `<prefix>.experts.<e>.{gate,up,down}_proj.weight_{packed,scale,shape}` for every expert.
    pub fn load(ckpt: &Checkpoint, prefix: &str, config: &Config) -> Result<Self> {
        let (count, hidden, inter) = (config.n_routed_experts, config.hidden_size, config.moe_intermediate_size);
        let empty = || Int4Owned { packed: Vec::new(), scale: Vec::new() };
        let mut experts = OwnedExperts { count, hidden, inter, w13: empty(), w2: empty() };
        for e in 0..count {
            for proj in ["gate_proj", "up_proj"] {
                let (p, s) = read_int4(ckpt, &format!("{prefix}.experts.{e}.{proj}"), inter, hidden)?;
                experts.w13.packed.extend(p);
                experts.w13.scale.extend(s);
            }
            let (p, s) = read_int4(ckpt, &format!("{prefix}.experts.{e}.down_proj"), hidden, inter)?;
            experts.w2.packed.extend(p);
            experts.w2.scale.extend(s);
        }
        Ok(RoutedExperts(experts))
    }

    /// The borrowed view the MoE kernel takes.
    pub fn view(&self) -> Experts<'_> {
        self.0.view()
    }

    /// Experts `range` alone (an expert-parallel share), numbered from 0.
    pub fn range(&self, range: std::ops::Range<usize>) -> Result<OwnedExperts> {
        self.0.range(range)
    }
}

/// One INT4 projection `[rows, cols]`: its packed values and scales, after checking `weight_shape` (when the
/// checkpoint has it) against the shape the config implies.
fn read_int4(ckpt: &Checkpoint, base: &str, rows: usize, cols: usize) -> Result<(Vec<i32>, Vec<bf16>)> {
    if !cols.is_multiple_of(moe_int4::GROUP) {
        return Err(Error::param(
            "routed expert input features",
            cols,
            format!("`{base}`: INT4 groups need a multiple of {}", moe_int4::GROUP),
        ));
    }
    let shape_name = format!("{base}.weight_shape");
    if ckpt.contains(&shape_name) {
        let shape = ckpt.i32(&shape_name, &[2])?;
        if shape != [rows as i32, cols as i32] {
            return Err(Error::param(
                "weight_shape",
                format!("{shape:?}"),
                format!("`{shape_name}` must be [{rows}, {cols}] for this config"),
            ));
        }
    }
    let packed = ckpt.i32(&format!("{base}.weight_packed"), &[rows, cols / moe_int4::PACK])?;
    let scale = ckpt.bf16(&format!("{base}.weight_scale"), &[rows, cols / moe_int4::GROUP])?;
    Ok((packed, scale))
}

/// A DeepSeek-V3 MoE block: sigmoid router with a correction bias, INT4 routed experts, shared expert.
#[derive(Clone, Debug)]
pub struct Moe {
    /// The router `gate.weight` `[E, h]`.
    pub router: Linear,
    /// `gate.e_score_correction_bias`.
    pub bias: Vec<f32>,
    /// The routed experts.
    pub experts: RoutedExperts,
    /// The shared expert, when the config has one.
    pub shared: Option<Mlp>,
    /// Experts per token.
    pub top_k: usize,
    /// `routed_scaling_factor`.
    pub scaling: f64,
}

impl Moe {
    /// Reads `<prefix>.gate.{weight,e_score_correction_bias}`, the routed and the shared experts.
    pub fn load(ckpt: &Checkpoint, prefix: &str, config: &Config) -> Result<Self> {
        if config.int4_experts.is_none() {
            return Err(Error::param(
                "quantization_config",
                "missing",
                "only INT4 (compressed-tensors pack-quantized) routed experts are supported",
            ));
        }
        let (h, e) = (config.hidden_size, config.n_routed_experts);
        let shared = (config.n_shared_experts > 0)
            .then(|| {
                let i = config.moe_intermediate_size * config.n_shared_experts;
                Mlp::load(ckpt, &format!("{prefix}.shared_experts"), h, i)
            })
            .transpose()?;
        Ok(Moe {
            router: Linear::load(ckpt, &format!("{prefix}.gate.weight"), e, h)?,
            bias: ckpt.f32(&format!("{prefix}.gate.e_score_correction_bias"), &[e])?,
            experts: RoutedExperts::load(ckpt, prefix, config)?,
            shared,
            top_k: config.num_experts_per_tok,
            scaling: config.routed_scaling_factor,
        })
    }
}

/// The query projection: full rank, or low rank through `q_a_proj → q_a_layernorm → q_b_proj`.
#[derive(Clone, Debug)]
pub enum QueryProj {
    /// `q_proj`.
    Full(Linear),
    /// `q_a_proj`, `q_a_layernorm`, `q_b_proj`.
    LowRank(Linear, RmsNorm, Linear),
}

/// The MLA projections of one layer (the attention itself runs over the latent cache, in `forward.rs`).
#[derive(Clone, Debug)]
pub struct MlaWeights {
    /// Query projection.
    pub q: QueryProj,
    /// `kv_a_proj_with_mqa`: `[kv_lora_rank + rope, h]`, the latent then the shared rotary key.
    pub kv_a: Linear,
    /// `kv_a_layernorm` on the latent.
    pub kv_a_norm: RmsNorm,
    /// `kv_b_proj`: `[heads · (nope + v), kv_lora_rank]`, per head the key rows (absorbed into the query)
    /// then the value rows (applied to the attention's latent output).
    pub kv_b: Linear,
    /// `o_proj`: `[h, heads · v]`.
    pub o_proj: Linear,
}

impl MlaWeights {
    /// The share of attention heads `heads` of these projections (tensor parallel by heads): those heads'
    /// query rows, `kv_b` rows and `o_proj` columns (whose output is then a partial sum); the latent
    /// projections, which every head reads, whole.
    pub fn heads(&self, heads: std::ops::Range<usize>, c: &Config) -> Result<Self> {
        let q_width = c.qk_nope_head_dim + c.qk_rope_head_dim;
        let kv_width = c.qk_nope_head_dim + c.v_head_dim;
        let scaled = |w: usize| heads.start * w..heads.end * w;
        let q = match &self.q {
            QueryProj::Full(q) => QueryProj::Full(q.rows(scaled(q_width))?),
            QueryProj::LowRank(a, n, qb) => QueryProj::LowRank(a.clone(), n.clone(), qb.rows(scaled(q_width))?),
        };
        Ok(MlaWeights {
            q,
            kv_a: self.kv_a.clone(),
            kv_a_norm: self.kv_a_norm.clone(),
            kv_b: self.kv_b.rows(scaled(kv_width))?,
            o_proj: self.o_proj.columns(scaled(c.v_head_dim))?,
        })
    }
}

/// transformers builds `q_a_layernorm` and `kv_a_layernorm` with their default epsilon, not the config's.
const LATENT_NORM_EPS: f64 = 1e-6;

impl MlaWeights {
    /// Reads `<prefix>.{q_proj | q_a_proj, q_a_layernorm, q_b_proj}, kv_a_proj_with_mqa, kv_a_layernorm,
    /// kv_b_proj, o_proj`.
    pub fn load(ckpt: &Checkpoint, prefix: &str, c: &Config) -> Result<Self> {
        let (h, heads) = (c.hidden_size, c.num_attention_heads);
        let q_dim = heads * (c.qk_nope_head_dim + c.qk_rope_head_dim);
        let q = match c.q_lora_rank {
            None => QueryProj::Full(Linear::load(ckpt, &format!("{prefix}.q_proj.weight"), q_dim, h)?),
            Some(r) => QueryProj::LowRank(
                Linear::load(ckpt, &format!("{prefix}.q_a_proj.weight"), r, h)?,
                RmsNorm::load(ckpt, &format!("{prefix}.q_a_layernorm.weight"), r, LATENT_NORM_EPS)?,
                Linear::load(ckpt, &format!("{prefix}.q_b_proj.weight"), q_dim, r)?,
            ),
        };
        Ok(MlaWeights {
            q,
            kv_a: Linear::load(
                ckpt,
                &format!("{prefix}.kv_a_proj_with_mqa.weight"),
                c.kv_lora_rank + c.qk_rope_head_dim,
                h,
            )?,
            kv_a_norm: RmsNorm::load(
                ckpt,
                &format!("{prefix}.kv_a_layernorm.weight"),
                c.kv_lora_rank,
                LATENT_NORM_EPS,
            )?,
            kv_b: Linear::load(
                ckpt,
                &format!("{prefix}.kv_b_proj.weight"),
                heads * (c.qk_nope_head_dim + c.v_head_dim),
                c.kv_lora_rank,
            )?,
            o_proj: Linear::load(ckpt, &format!("{prefix}.o_proj.weight"), h, heads * c.v_head_dim)?,
        })
    }
}
