//! Rotary position embedding of the MLA rotary dims (`q_pe`, `k_pe`), with YaRN, computed as transformers'
//! `DeepseekV3RotaryEmbedding` computes it: float32 inverse frequencies (YaRN's ramp between interpolated
//! and extrapolated frequencies), `cos`/`sin` of `inv_freq · position` in float32, both times the YaRN
//! attention factor.
//!
//! Layout: with `rope_interleave` (DeepSeek's checkpoints, transformers' default) the input pairs are
//! `(x[2i], x[2i+1])`, otherwise `(x[i], x[i + d/2])`; the output is always in the half-split layout
//! `[rotated firsts | rotated seconds]`, as transformers writes it. Queries and keys get the same layout, so
//! their dot products are those of the model.

use crate::error::{Error, Result};
use crate::model::config::Config;

/// Precomputed rotary frequencies for one model.
#[derive(Clone, Debug)]
pub struct Rope {
    inv_freq: Vec<f32>,
    attention_factor: f32,
    interleave: bool,
}

/// transformers' `find_correction_dim`: the dim whose wavelength makes `rotations` turns over `max_pos`.
fn correction_dim(rotations: f64, dim: usize, base: f64, max_pos: f64) -> f64 {
    dim as f64 * (max_pos / (rotations * 2.0 * std::f64::consts::PI)).ln() / (2.0 * base.ln())
}

impl Rope {
    /// Frequencies for `config.qk_rope_head_dim` rotary dims, with the config's YaRN scaling if any.
    pub fn new(config: &Config) -> Result<Self> {
        let dim = config.qk_rope_head_dim;
        if dim == 0 || !dim.is_multiple_of(2) {
            return Err(Error::param("qk_rope_head_dim", dim, "must be even and > 0"));
        }
        let base = config.rope_theta;
        // base^(2i/dim) in float32, as `base ** (arange(0, dim, 2).float() / dim)`.
        let pos_freqs: Vec<f32> = (0..dim / 2).map(|i| (base as f32).powf((2 * i) as f32 / dim as f32)).collect();
        let Some(yarn) = &config.yarn else {
            let inv_freq = pos_freqs.iter().map(|p| 1.0 / p).collect();
            return Ok(Rope { inv_freq, attention_factor: 1.0, interleave: config.rope_interleave });
        };
        let max_pos = yarn.original_max_position_embeddings as f64;
        let mut low = correction_dim(yarn.beta_fast, dim, base, max_pos);
        let mut high = correction_dim(yarn.beta_slow, dim, base, max_pos);
        if yarn.truncate {
            low = low.floor();
            high = high.ceil();
        }
        let low = low.max(0.0);
        let mut high = high.min((dim - 1) as f64);
        if low == high {
            high += 0.001; // transformers' guard against a zero-width ramp
        }
        let factor = yarn.factor as f32;
        let inv_freq = pos_freqs
            .iter()
            .enumerate()
            .map(|(i, &p)| {
                let ramp = ((i as f32 - low as f32) / (high as f32 - low as f32)).clamp(0.0, 1.0);
                let extrapolation = 1.0 - ramp;
                let (inter, extra) = (1.0 / (factor * p), 1.0 / p);
                inter * (1.0 - extrapolation) + extra * extrapolation
            })
            .collect();
        Ok(Rope { inv_freq, attention_factor: yarn.attention_factor as f32, interleave: config.rope_interleave })
    }

    /// Rotary dims.
    pub fn dim(&self) -> usize {
        2 * self.inv_freq.len()
    }

    /// Whether the checkpoint's rotary pairs are interleaved (`rope_interleave`).
    pub fn interleave(&self) -> bool {
        self.interleave
    }

    /// The rotary table rows of `positions`, as [`crate::cpu::rowops`] takes them: per position the
    /// `dim / 2` cosines, then the `dim / 2` sines, of `inv_freq · position` in float32, each times the
    /// attention factor. Computed once on the host, so every backend rotates with the same values.
    pub fn table(&self, positions: &[usize]) -> Vec<f32> {
        let half = self.inv_freq.len();
        let mut out = vec![0f32; positions.len() * 2 * half];
        for (row, &position) in out.chunks_mut(2 * half).zip(positions) {
            for (i, &f) in self.inv_freq.iter().enumerate() {
                let angle = f * position as f32;
                row[i] = angle.cos() * self.attention_factor;
                row[half + i] = angle.sin() * self.attention_factor;
            }
        }
        out
    }
}
