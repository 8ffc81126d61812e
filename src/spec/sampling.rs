//! Sampling from the target's distribution (ENGINE.md §5): temperature, then top-k, then top-p over
//! `softmax(logits / temperature)`, with a uniform number that depends only on the request's seed and
//! the position of the token being chosen. Every row of a draft tree that predicts position p uses the
//! number of p, so along any path the tokens chosen are the ones plain sampling chooses: following the
//! child whose token equals the sample (SpecInfer's rule) emits exactly plain sampling's tokens, and a
//! request's tokens do not depend on its batch.

use crate::error::{Error, Result};

/// A request's sampling settings.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Sampling {
    /// Temperature, > 0 (greedy requests carry no `Sampling`).
    pub temperature: f32,
    /// Keep the smallest set of most likely tokens whose probability reaches this, in (0, 1].
    pub top_p: f32,
    /// Keep only the `top_k` most likely tokens; 0 keeps all.
    pub top_k: usize,
    /// Seed of the request's random numbers.
    pub seed: u64,
}

impl Sampling {
    /// Checks the ranges against a vocabulary of `vocab` ids.
    pub fn validate(&self, vocab: usize) -> Result<()> {
        if !(self.temperature.is_finite() && self.temperature > 0.0) {
            return Err(Error::param("temperature", self.temperature, "must be a finite number > 0 to sample"));
        }
        if !(self.top_p > 0.0 && self.top_p <= 1.0) {
            return Err(Error::param("top_p", self.top_p, "must be in (0, 1]"));
        }
        if self.top_k > vocab {
            return Err(Error::param("top_k", self.top_k, format!("must be at most the vocabulary size {vocab}")));
        }
        Ok(())
    }

    /// The token chosen at sequence position `position` from that position's `logits`.
    pub fn choose(&self, logits: &[f32], position: usize) -> u32 {
        sample(logits, self, uniform(self.seed, position as u64))
    }
}

/// A uniform number in [0, 1) from (seed, position): SplitMix64's finalizer of a Weyl step of each.
pub fn uniform(seed: u64, position: u64) -> f64 {
    let mix = |mut z: u64| {
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    };
    let z = mix(mix(seed.wrapping_add(0x9E37_79B9_7F4A_7C15)) ^ position.wrapping_mul(0xD1B5_4A32_D192_ED03));
    (z >> 11) as f64 / (1u64 << 53) as f64
}

/// The token at `u` of the cumulative distribution of the kept tokens, most likely first (ties to the
/// smaller id); weights `exp((logit - max) / temperature)` summed in f64. A NaN logit counts as
/// impossible; if every logit is NaN or -inf, the smallest id.
pub fn sample(logits: &[f32], s: &Sampling, u: f64) -> u32 {
    let mut order: Vec<usize> = (0..logits.len()).filter(|&i| logits[i] > f32::NEG_INFINITY).collect();
    let by_probability = |a: &usize, b: &usize| logits[*b].total_cmp(&logits[*a]).then(a.cmp(b));
    if s.top_k > 0 && s.top_k < order.len() {
        order.select_nth_unstable_by(s.top_k - 1, by_probability);
        order.truncate(s.top_k);
    }
    order.sort_by(by_probability);
    let Some(&first) = order.first() else { return 0 };
    let max = logits[first] as f64;
    let weights: Vec<f64> = order.iter().map(|&i| ((logits[i] as f64 - max) / s.temperature as f64).exp()).collect();
    let total: f64 = weights.iter().sum();
    let (mut kept, mut nucleus) = (0.0, 0);
    while nucleus < order.len() && kept < s.top_p as f64 * total {
        kept += weights[nucleus];
        nucleus += 1;
    }
    let mut r = u * kept;
    for (i, w) in weights[..nucleus].iter().enumerate() {
        if r < *w {
            return order[i] as u32;
        }
        r -= w;
    }
    order[nucleus - 1] as u32
}

#[cfg(test)]
mod tests {
    use super::*;

    fn at(temperature: f32, top_p: f32, top_k: usize) -> Sampling {
        Sampling { temperature, top_p, top_k, seed: 0 }
    }

    #[test]
    fn the_cumulative_distribution_is_walked_in_probability_order() {
        // Weights at temperature 1: e^0 = 1 for ids 2 and 0 (tie: 0 first), e^-ln2 = 0.5 for id 1.
        let logits = [0.0, -std::f32::consts::LN_2, 0.0, f32::NEG_INFINITY];
        let s = at(1.0, 1.0, 0);
        assert_eq!([0.0, 0.39, 0.41, 0.79, 0.81, 0.999].map(|u| sample(&logits, &s, u)), [0, 0, 2, 2, 1, 1]);
        // top_k 2 drops id 1; top_p 0.3 keeps id 0 alone (its weight is 0.4 of the total).
        assert_eq!(sample(&logits, &at(1.0, 1.0, 2), 0.99), 2);
        assert_eq!(sample(&logits, &at(1.0, 0.3, 0), 0.99), 0);
        assert_eq!(sample(&logits, &at(1.0, 0.41, 0), 0.99), 2);
        assert_eq!(sample(&[f32::NAN, f32::NEG_INFINITY], &s, 0.5), 0);
    }

    #[test]
    fn uniforms_depend_on_seed_and_position_only_and_fill_the_unit_interval() {
        assert_eq!(uniform(7, 100), uniform(7, 100));
        assert_ne!(uniform(7, 100), uniform(7, 101));
        assert_ne!(uniform(7, 100), uniform(8, 100));
        let n = 100_000;
        let mean: f64 = (0..n).map(|p| uniform(3, p)).sum::<f64>() / n as f64;
        assert!((mean - 0.5).abs() < 0.005, "mean {mean}");
        assert!((0..n).map(|p| uniform(3, p)).all(|u| (0.0..1.0).contains(&u)));
    }

    #[test]
    fn bad_settings_are_errors_naming_them() {
        for (s, name) in [
            (at(0.0, 1.0, 0), "temperature"),
            (at(f32::NAN, 1.0, 0), "temperature"),
            (at(-1.0, 1.0, 0), "temperature"),
            (at(1.0, 0.0, 0), "top_p"),
            (at(1.0, 1.5, 0), "top_p"),
            (at(1.0, 1.0, 9), "top_k"),
        ] {
            assert!(s.validate(8).err().unwrap().to_string().contains(name), "{s:?}");
        }
        assert!(at(0.5, 1.0, 8).validate(8).is_ok());
    }
}
