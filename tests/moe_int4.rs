//! MoE with INT4 experts: routing bit-exact against the numpy fixtures, the expert output within the
//! fixture tolerance, the INT4 layout, batch invariance, and bad input.

mod common;

use common::{assert_bits, assert_same, cases, xorshift};
use half::bf16;
use kdtree_engine::cpu::moe_int4::{moe_int4, quantize, route, Experts, Int4Matrix, Routing, GROUP};
use kdtree_engine::fixture::Fixture;
use kdtree_engine::Error;

fn bf16_array(case: &Fixture, name: &str) -> Vec<bf16> {
    case.array::<u16>(name).unwrap().into_iter().map(bf16::from_bits).collect()
}

#[test]
fn routing_matches_every_fixture() {
    for case in cases("moe_routing") {
        let name = case.name();
        let (e, k) = (case.usize("E").unwrap(), case.usize("k").unwrap());
        let scaling = case.f64("routed_scaling_factor").unwrap();
        let logits: Vec<f32> = case.array("router_logits").unwrap();
        let got = route(&logits, &case.array::<f32>("bias").unwrap(), e, k, scaling).unwrap();
        assert_same(&name, "topk_ids", &got.topk_ids, &case.array::<i32>("topk_ids").unwrap());
        assert_bits(&name, "topk_weights", &got.topk_weights, &case.array::<f32>("topk_weights").unwrap());
        assert_same(&name, "expert_offsets", &got.expert_offsets, &case.array::<i32>("expert_offsets").unwrap());
        assert_same(&name, "sorted_pairs", &got.sorted_pairs, &case.array::<i32>("sorted_pairs").unwrap());
    }
}

/// The routing stored in a moe_int4 fixture (ids and weights; alignment is not needed by the math).
fn fixture_routing(case: &Fixture) -> Routing {
    Routing {
        k: case.usize("k").unwrap(),
        topk_ids: case.array("topk_ids").unwrap(),
        topk_weights: case.array("topk_weights").unwrap(),
        expert_offsets: vec![],
        sorted_pairs: vec![],
    }
}

#[test]
fn expert_output_matches_every_fixture() {
    for case in cases("moe_int4") {
        let name = case.name();
        let u = |k| case.usize(k).unwrap();
        let (h, i, e) = (u("H"), u("I"), u("E"));
        let (w13p, w13s) = (case.array::<i32>("w13_packed").unwrap(), bf16_array(&case, "w13_scale"));
        let (w2p, w2s) = (case.array::<i32>("w2_packed").unwrap(), bf16_array(&case, "w2_scale"));
        let experts = Experts {
            count: e,
            hidden: h,
            inter: i,
            w13: Int4Matrix { packed: &w13p, scale: &w13s, rows: e * 2 * i, cols: h },
            w2: Int4Matrix { packed: &w2p, scale: &w2s, rows: e * h, cols: i },
        };
        let got = moe_int4(&bf16_array(&case, "x"), &fixture_routing(&case), &experts).unwrap();
        let want: Vec<f32> = case.array("out").unwrap();
        let (mut err, mut norm) = (0.0f64, 0.0f64);
        for (g, w) in got.iter().zip(&want) {
            err += (*g as f64 - *w as f64).powi(2);
            norm += (*w as f64).powi(2);
        }
        let rel = (err / norm).sqrt();
        let tol = case.f64("tol_out_rel").unwrap();
        assert!(rel <= tol, "{name}: out relative error {rel:e} > {tol:e}");
        if let Ok(w13) = case.array::<f32>("w13") {
            let mut row = vec![0f32; h];
            for r in 0..e * 2 * i {
                experts.w13.dequant_row(r, &mut row);
                assert_bits(&name, "w13 (dequantized)", &row, &w13[r * h..(r + 1) * h]);
            }
        }
    }
}

fn random_bf16(next: &mut impl FnMut() -> u64, n: usize, scale: f32) -> Vec<bf16> {
    (0..n).map(|_| bf16::from_f32(((next() >> 40) as f32 / (1u64 << 24) as f32 - 0.5) * scale)).collect()
}

#[test]
fn quantized_values_stay_within_half_a_step() {
    let (rows, cols) = (16, 128);
    let mut next = xorshift(5);
    let mut w = random_bf16(&mut next, rows * cols, 0.2);
    w[..GROUP].fill(bf16::ZERO); // an all-zero group gets scale 1
    let q = quantize(&w, rows, cols).unwrap();
    let m = Int4Matrix { packed: &q.packed, scale: &q.scale, rows, cols };
    assert_eq!(q.scale[0], bf16::ONE);
    let mut row = vec![0f32; cols];
    for r in 0..rows {
        m.dequant_row(r, &mut row);
        for (c, (&d, v)) in row.iter().zip(&w[r * cols..(r + 1) * cols]).enumerate() {
            let step = q.scale[(r * cols + c) / GROUP].to_f32();
            assert!((d - v.to_f32()).abs() <= 0.5 * step + 1e-6, "({r}, {c}): {d} vs {}", v.to_f32());
        }
    }
}

/// A random layer of `e` experts with H 64, I 32.
struct Layer {
    w13: kdtree_engine::cpu::moe_int4::Int4Owned,
    w2: kdtree_engine::cpu::moe_int4::Int4Owned,
    e: usize,
}

const H: usize = 64;
const I: usize = 32;

fn layer(seed: u64, e: usize) -> Layer {
    let mut next = xorshift(seed);
    let w13 = quantize(&random_bf16(&mut next, e * 2 * I * H, 0.1), e * 2 * I, H).unwrap();
    let w2 = quantize(&random_bf16(&mut next, e * H * I, 0.1), e * H, I).unwrap();
    Layer { w13, w2, e }
}

impl Layer {
    fn experts(&self) -> Experts<'_> {
        Experts {
            count: self.e,
            hidden: H,
            inter: I,
            w13: Int4Matrix { packed: &self.w13.packed, scale: &self.w13.scale, rows: self.e * 2 * I, cols: H },
            w2: Int4Matrix { packed: &self.w2.packed, scale: &self.w2.scale, rows: self.e * H, cols: I },
        }
    }
}

#[test]
fn a_token_gives_the_same_bits_alone_and_in_a_batch_of_128() {
    let (t, e, k) = (128, 16, 4);
    let l = layer(7, e);
    let mut next = xorshift(8);
    let x = random_bf16(&mut next, t * H, 2.0);
    let logits: Vec<f32> = (0..t * e).map(|_| ((next() >> 40) as f32 / (1u64 << 24) as f32 - 0.5) * 4.0).collect();
    let bias = vec![0.0f32; e];
    let batch_routing = route(&logits, &bias, e, k, 2.827).unwrap();
    let batch = moe_int4(&x, &batch_routing, &l.experts()).unwrap();
    for tok in [0, 77, 127] {
        let r = route(&logits[tok * e..(tok + 1) * e], &bias, e, k, 2.827).unwrap();
        assert_eq!(r.topk_ids, batch_routing.topk_ids[tok * k..(tok + 1) * k]);
        let alone = moe_int4(&x[tok * H..(tok + 1) * H], &r, &l.experts()).unwrap();
        assert_eq!(alone, batch[tok * H..(tok + 1) * H], "token {tok}");
    }
}

#[test]
fn bad_input_is_a_named_error() {
    let l = layer(9, 4);
    let x = vec![bf16::ONE; 2 * H];
    let r = route(&[0.5; 8], &[0.0; 4], 4, 2, 1.0).unwrap();
    assert!(matches!(route(&[0.5; 8], &[0.0; 4], 4, 5, 1.0), Err(Error::Param { name: "k", .. })));
    assert!(matches!(route(&[0.5; 7], &[0.0; 4], 4, 2, 1.0), Err(Error::Shape { name: "router_logits", .. })));
    assert!(matches!(route(&[f32::NAN; 8], &[0.0; 4], 4, 2, 1.0), Err(Error::Logits { .. })));
    assert!(matches!(quantize(&x[..40], 1, 40), Err(Error::Param { name: "cols", .. })));
    let mut bad = l.experts();
    bad.w13.scale = &l.w13.scale[1..];
    assert!(matches!(moe_int4(&x, &r, &bad), Err(Error::Shape { name: "scale", .. })));
    let mut bad = l.experts();
    bad.hidden = 48;
    assert!(matches!(moe_int4(&x, &r, &bad), Err(Error::Param { name: "hidden", .. })));
    let wrong = Routing { topk_ids: vec![0, 9, 1, 2], ..r.clone() };
    assert!(matches!(moe_int4(&x, &wrong, &l.experts()), Err(Error::Index { name: "topk_ids", .. })));
}
