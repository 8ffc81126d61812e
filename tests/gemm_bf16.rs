//! The fixed-order bf16 GEMM (src/cpu/gemm_bf16.rs, kernels/gemm_bf16.cu): both against the float64 numpy
//! fixtures token by token (and each fixture's mutants rejected), against exact integer arithmetic, the GPU
//! against the CPU, batch invariance, strided batched operands, bad input.

mod common;

use common::{cases, check_rows, mutants};
use half::bf16;
use kdtree_engine::cpu::gemm_bf16::gemm_bf16;
use kdtree_engine::fixture::Fixture;
use kdtree_engine::Error;

fn fixture_inputs(case: &Fixture) -> (Vec<bf16>, Vec<f32>, usize, usize) {
    let w = case.array::<u16>("w").unwrap().into_iter().map(bf16::from_bits).collect();
    (w, case.array("x").unwrap(), case.usize("N").unwrap(), case.usize("K").unwrap())
}

/// `run`'s output on every fixture within the case's tolerance of the float64 reference, and every mutant of
/// the case (a contract violation applied to the reference) rejected by that tolerance.
fn matches_every_fixture_and_rejects_its_mutants(label: &str, run: impl Fn(&[bf16], usize, usize, &[f32]) -> Vec<f32>) {
    for case in cases("gemm_bf16") {
        let name = format!("{label} gemm_bf16/{}", case.name());
        let (w, x, n, k) = fixture_inputs(&case);
        let got = run(&w, n, k, &x);
        let tol = case.f64("tol_y_rel").unwrap();
        let worst =
            check_rows(&got, &case.array::<f32>("y").unwrap(), n, tol).unwrap_or_else(|e| panic!("{name}: {e}"));
        let observed = case.f64("observed_y_rel").unwrap();
        println!("{name}: worst token y_rel {worst:.2e} (tolerance {tol:.2e}, f32 emulation {observed:.2e})");
        let names = mutants(&case);
        assert!(!names.is_empty(), "{name}: no mutants in the fixture");
        for m in names {
            match check_rows(&got, &case.array::<f32>(&format!("mutant_{m}_y")).unwrap(), n, tol) {
                Ok(e) => panic!("{name}: mutant {m} accepted (worst token error {e:e})"),
                Err(why) => println!("{name}: mutant {m} rejected: {why}"),
            }
        }
    }
}

#[test]
fn cpu_matches_every_fixture_and_rejects_its_mutants() {
    matches_every_fixture_and_rejects_its_mutants("cpu", |w, n, k, x| gemm_bf16(w, n, k, x).unwrap());
}

/// Weights and activations of small integers: every product and partial sum is exact in float32, so any
/// summation order gives the integer result.
fn integer_case(n: usize, k: usize, t: usize, seed: u64) -> (Vec<bf16>, Vec<f32>, Vec<f32>) {
    let mut rng = common::xorshift(seed);
    let w: Vec<i64> = (0..n * k).map(|_| (rng() % 15) as i64 - 7).collect();
    let x: Vec<i64> = (0..t * k).map(|_| (rng() % 9) as i64 - 4).collect();
    let y: Vec<f32> =
        (0..t * n).map(|i| (0..k).map(|j| x[(i / n) * k + j] * w[(i % n) * k + j]).sum::<i64>() as f32).collect();
    (w.iter().map(|&v| bf16::from_f32(v as f32)).collect(), x.iter().map(|&v| v as f32).collect(), y)
}

#[test]
fn cpu_equals_exact_integer_products() {
    for (n, k, t) in [(1, 1, 1), (3, 5, 2), (40, 64, 7), (130, 520, 3)] {
        let (w, x, want) = integer_case(n, k, t, (n * k + t) as u64);
        common::assert_bits(&format!("N {n} K {k} T {t}"), "y", &gemm_bf16(&w, n, k, &x).unwrap(), &want);
    }
}

#[test]
fn cpu_rejects_bad_shapes() {
    let w = vec![bf16::ONE; 12];
    assert!(matches!(gemm_bf16(&w, 3, 5, &[0.0; 5]), Err(Error::Shape { name: "w", .. })));
    assert!(matches!(gemm_bf16(&w, 3, 4, &[0.0; 5]), Err(Error::Shape { name: "x", .. })));
}

#[cfg(feature = "cuda")]
mod gpu {
    use super::*;
    use kdtree_engine::cuda::gemm_bf16::{split_k, tile_for, tile_names, DeviceWeight, GemmPlan, Strides};

    fn random_case(n: usize, k: usize, t: usize, seed: u64) -> (Vec<bf16>, Vec<f32>) {
        let mut rng = common::xorshift(seed);
        let mut uniform = move || (rng() >> 11) as f32 / (1u64 << 53) as f32 * 2.0 - 1.0;
        let w = (0..n * k).map(|_| bf16::from_f32(uniform())).collect();
        let x = (0..t * k).map(|_| 2.0 * uniform()).collect();
        (w, x)
    }

    /// (N, K, T): tails of every tile (of the three tile shapes, Tall with one to three token tiles), one
    /// and several K chunks, Kimi-K2's router and kv_a shapes.
    const SHAPES: [(usize, usize, usize); 12] = [
        (1, 8, 1),
        (200, 96, 29),
        (40, 64, 3),
        (64, 32, 64),
        (65, 40, 65),
        (130, 520, 130),
        (384, 7168, 1),
        (576, 7168, 5),
        (256, 128, 200),
        (7168, 2048, 2),
        (200, 256, 100),
        (136, 1536, 300),
    ];

    #[test]
    fn gpu_equals_exact_integer_products() {
        let Some(gpu) = common::gpu() else { return };
        for (n, k, t) in SHAPES {
            let (w, x, want) = integer_case(n, k, t, (n + k + t) as u64);
            common::assert_bits(&format!("N {n} K {k} T {t}"), "y", &gpu.gemm_bf16(&w, n, k, &x).unwrap(), &want);
        }
    }

    #[test]
    fn gpu_matches_every_fixture_and_rejects_its_mutants() {
        let Some(gpu) = common::gpu() else { return };
        matches_every_fixture_and_rejects_its_mutants("gpu", |w, n, k, x| gpu.gemm_bf16(w, n, k, x).unwrap());
    }

    /// GPU against CPU, per token: each is within its fixture tolerance of float64, so the two are within
    /// twice the widest fixture tolerance of each other.
    fn gpu_vs_cpu_tolerance() -> f64 {
        2.0 * cases("gemm_bf16").iter().map(|c| c.f64("tol_y_rel").unwrap()).fold(0.0, f64::max)
    }

    #[test]
    fn gpu_matches_cpu_on_random_data() {
        let Some(gpu) = common::gpu() else { return };
        for (n, k, t) in SHAPES {
            let (w, x) = random_case(n, k, t, (3 * n + k + t) as u64);
            let want = gemm_bf16(&w, n, k, &x).unwrap();
            let got = gpu.gemm_bf16(&w, n, k, &x).unwrap();
            let ksplit = split_k(&DeviceWeight::upload(gpu, &w, 1, n, k).unwrap()).0;
            let tol = gpu_vs_cpu_tolerance();
            let err = check_rows(&got, &want, n, tol).unwrap_or_else(|e| panic!("N {n} K {k} T {t}: {e}"));
            println!("N {n} K {k} T {t} ({ksplit} K chunks): worst token error vs CPU {err:.2e} (tolerance {tol:.2e})");
        }
    }

    #[test]
    fn gpu_is_batch_invariant() {
        let Some(gpu) = common::gpu() else { return };
        for (n, k) in [(576, 7168), (130, 520), (64, 32)] {
            let (w, x) = random_case(n, k, 150, (n * k) as u64);
            let weight = DeviceWeight::upload(gpu, &w, 1, n, k).unwrap();
            let batch = gpu.gemm_bf16_on(&weight, &x).unwrap();
            assert!(gpu.gemm_bf16_on(&weight, &x).unwrap() == batch, "N {n} K {k}: reruns differ");
            // Alone (narrow tiles), inside the first 24 and 60 tokens and all 150 (one medium tile, one
            // wide tile, five medium tiles; tall tiles are compared in every_tile_gives_the_same_bits).
            for first in [24, 60] {
                let got = gpu.gemm_bf16_on(&weight, &x[..first * k]).unwrap();
                common::assert_bits(&format!("N {n} K {k} {first} tokens"), "y", &got, &batch[..first * n]);
            }
            for t in [0, 23, 77, 149] {
                let alone = gpu.gemm_bf16_on(&weight, &x[t * k..(t + 1) * k]).unwrap();
                common::assert_bits(&format!("N {n} K {k} token {t}"), "y", &alone, &batch[t * n..(t + 1) * n]);
            }
        }
    }

    /// Each tile shape, forced on every launch, gives the bits of [`tile_for`]'s choice: the choice by
    /// token count and grid size cannot change a token's output.
    #[test]
    fn every_tile_gives_the_same_bits() {
        let Some(gpu) = common::gpu() else { return };
        for (n, k, t) in
            [(576, 7168, 65), (130, 520, 150), (200, 256, 100), (7168, 2048, 17), (300, 1024, 40), (40, 64, 3)]
        {
            let (w, x) = random_case(n, k, t, (5 * n + k + t) as u64);
            let weight = DeviceWeight::upload(gpu, &w, 1, n, k).unwrap();
            let run = |tile: Option<usize>| {
                let mut plan = GemmPlan::new(gpu, t, &[&weight]).unwrap();
                plan.force_tile(tile).unwrap();
                let x_dev = gpu.upload(&x).unwrap();
                let mut y = gpu.zeros::<f32>(t * n).unwrap();
                plan.run(gpu, &weight, &x_dev.as_view(), Strides::dense(k), t, &mut y.as_view_mut(), Strides::dense(n))
                    .unwrap();
                gpu.download(&y).unwrap()
            };
            let chosen = run(None);
            let pick = tile_names()[tile_for(t)];
            for (i, name) in tile_names().iter().enumerate() {
                common::assert_bits(
                    &format!("N {n} K {k} T {t}, {name} (chosen: {pick})"),
                    "y",
                    &run(Some(i)),
                    &chosen,
                );
            }
        }
        let mut plan = GemmPlan::new(gpu, 1, &[]).unwrap();
        let err = plan.force_tile(Some(tile_names().len())).err().unwrap();
        assert!(matches!(err, Error::Param { name: "tile", .. }), "{err}");
    }

    /// Narrow tiles up to 16 tokens, Medium up to 32, Wide up to 64, Medium up to 160, Tall beyond.
    #[test]
    fn tiles_follow_the_token_count() {
        let names = tile_names();
        let picks: Vec<_> = [1, 16, 17, 32, 33, 64, 65, 160, 161, 2080].map(|t| names[tile_for(t)]).into();
        let want = ["narrow", "narrow", "medium", "medium", "wide", "wide", "medium", "medium", "tall", "tall"];
        assert_eq!(picks, want.map(|n| format!("gemm_bf16_{n}")));
    }

    /// MLA's per-head products: 4 matrices `[24, 32]`, x the first 32 features of each head's 48 in
    /// `[T, 4, 48]`, y each head's 24 outputs in `[T, 4, 40]`.
    #[test]
    fn strided_batched_operands_match_the_cpu_per_matrix() {
        let Some(gpu) = common::gpu() else { return };
        let (heads, n, k, t, x_head, y_head) = (4, 24, 32, 9, 48, 40);
        let (w, x) = random_case(heads * n, k, t * heads * x_head / k, 11);
        let weight = DeviceWeight::upload(gpu, &w, heads, n, k).unwrap();
        let mut plan = GemmPlan::new(gpu, t, &[&weight]).unwrap();
        let x_dev = gpu.upload(&x).unwrap();
        let mut y_dev = gpu.zeros::<f32>(t * heads * y_head).unwrap();
        let xs = Strides { row: heads * x_head, batch: x_head };
        let ys = Strides { row: heads * y_head, batch: y_head };
        plan.run(gpu, &weight, &x_dev.as_view(), xs, t, &mut y_dev.as_view_mut(), ys).unwrap();
        let y = gpu.download(&y_dev).unwrap();
        for h in 0..heads {
            let xh: Vec<f32> = (0..t).flat_map(|r| x[r * xs.row + h * x_head..][..k].iter().copied()).collect();
            let want = gemm_bf16(&w[h * n * k..(h + 1) * n * k], n, k, &xh).unwrap();
            let got: Vec<f32> = (0..t).flat_map(|r| y[r * ys.row + h * y_head..][..n].iter().copied()).collect();
            check_rows(&got, &want, n, gpu_vs_cpu_tolerance()).unwrap_or_else(|e| panic!("head {h}: {e}"));
        }
        assert!(y.chunks(y_head).all(|row| row[n..].iter().all(|&v| v == 0.0)), "wrote past a head's outputs");
    }

    #[test]
    fn bad_input_is_named() {
        let Some(gpu) = common::gpu() else { return };
        let w = vec![bf16::ONE; 3 * 12];
        let err = DeviceWeight::upload(gpu, &w, 1, 3, 12).err().unwrap();
        assert!(matches!(err, Error::Param { name: "in", .. }), "{err}");
        let weight = DeviceWeight::upload(gpu, &w[..24], 1, 3, 8).unwrap();
        assert!(matches!(gpu.gemm_bf16_on(&weight, &[0.0; 12]), Err(Error::Shape { name: "x", .. })));
        let mut plan = GemmPlan::new(gpu, 2, &[&weight]).unwrap();
        let x = gpu.zeros::<f32>(16).unwrap();
        let mut y = gpu.zeros::<f32>(5).unwrap();
        let err = plan
            .run(gpu, &weight, &x.as_view(), Strides::dense(8), 2, &mut y.as_view_mut(), Strides::dense(3))
            .err()
            .unwrap();
        assert!(matches!(err, Error::Shape { name: "y", .. }), "{err}");
        let err = plan
            .run(gpu, &weight, &x.as_view(), Strides { row: 6, batch: 0 }, 2, &mut y.as_view_mut(), Strides::dense(3))
            .err()
            .unwrap();
        assert!(matches!(err, Error::Param { .. }), "{err}");
    }
}
