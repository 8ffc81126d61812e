//! The per-row operations (src/cpu/rowops.rs, kernels/rowops.cu) against the numpy fixtures of
//! reference/rowops_fixtures.py, bit for bit, through the [`Backend`] trait: one test body runs on the CPU
//! backend and on the CUDA backend. Also: batch invariance of the row ops on random rows, and bad
//! indices reported as errors naming them.

mod common;

use common::{cases, xorshift};
use half::bf16;
use kdtree_engine::cpu::backend::CpuBackend;
use kdtree_engine::cpu::rowops::{self, QueryShape};
use kdtree_engine::fixture::Fixture;
use kdtree_engine::model::backend::{Backend, KvWrite};
use kdtree_engine::Error;

fn bf16s(case: &Fixture, name: &str) -> Vec<bf16> {
    case.array::<u16>(name).unwrap().into_iter().map(bf16::from_bits).collect()
}

fn f32_bits(x: &[f32]) -> Vec<u32> {
    x.iter().map(|v| v.to_bits()).collect()
}

fn bf16_bits(x: &[bf16]) -> Vec<u16> {
    x.iter().map(|v| v.to_bits()).collect()
}

/// Runs one fixture case on `b`; returns the case's output (as bit patterns) and the fixture's.
fn run_case<B: Backend>(b: &B, case: &Fixture) -> (Vec<u32>, Vec<u32>) {
    let u = |k: &str| case.usize(k).unwrap();
    let f = |k: &str| case.array::<f32>(k).unwrap();
    let up = |v: &[f32]| b.upload(v).unwrap();
    let widen16 = |v: Vec<u16>| v.into_iter().map(u32::from).collect::<Vec<u32>>();
    match case.str("op").unwrap().as_str() {
        "rmsnorm" => {
            let (d, t) = (u("d"), u("T"));
            let (x, w) = (up(&f("x")), up(&f("w")));
            let mut y = b.zeros::<f32>(t * d).unwrap();
            b.rmsnorm(&x, d, &w, case.f64("eps").unwrap() as f32, t, &mut y, d).unwrap();
            (f32_bits(&b.read(&y, t * d).unwrap()), f32_bits(&f("y")))
        }
        "silu_mul" => {
            let (i, t) = (u("I"), u("T"));
            let mut out = b.zeros::<f32>(t * i).unwrap();
            b.silu_mul(&up(&f("gu")), i, t, &mut out).unwrap();
            (f32_bits(&b.read(&out, t * i).unwrap()), f32_bits(&f("out")))
        }
        "q_rows" => {
            let (t, heads) = (u("T"), u("heads"));
            let shape = QueryShape { heads, nope: u("nope") };
            let mut out = b.zeros::<bf16>(t * heads * 576).unwrap();
            let interleave = u("interleave") == 1;
            b.q_rows(&up(&f("q_latent")), &up(&f("q")), shape, &up(&f("table")), t, interleave, &mut out).unwrap();
            (widen16(bf16_bits(&b.read(&out, t * heads * 576).unwrap())), widen16(case.array("out").unwrap()))
        }
        "kv_rows" => {
            let (t, rows) = (u("T"), u("rows"));
            let mut cache = b.upload(&bf16s(case, "cache_in")).unwrap();
            let (kv, norm_w, table) = (up(&f("kv")), up(&f("norm_w")), up(&f("table")));
            let slot = b.upload(&case.array::<i32>("slot").unwrap()).unwrap();
            let write = KvWrite {
                kv: &kv,
                norm_w: &norm_w,
                eps: case.f64("eps").unwrap() as f32,
                table: &table,
                interleave: u("interleave") == 1,
                slot: &slot,
            };
            b.kv_rows(&write, t, &mut cache).unwrap();
            b.check().unwrap();
            (widen16(bf16_bits(&b.read(&cache, rows * 576).unwrap())), widen16(case.array("cache_out").unwrap()))
        }
        "embed" => {
            let (h, t) = (u("H"), u("T"));
            let mut out = b.zeros::<f32>(t * h).unwrap();
            let ids = b.upload(&case.array::<i32>("ids").unwrap()).unwrap();
            b.embed(&b.upload(&bf16s(case, "table")).unwrap(), h, &ids, t, &mut out).unwrap();
            b.check().unwrap();
            (f32_bits(&b.read(&out, t * h).unwrap()), f32_bits(&f("out")))
        }
        "argmax" => {
            let (rows, v) = (u("rows"), u("V"));
            let mut out = b.zeros::<i32>(rows).unwrap();
            b.argmax(&up(&f("x")), v, rows, &mut out).unwrap();
            let want = case.array::<i32>("out").unwrap().into_iter().map(|i| i as u32).collect();
            (b.read(&out, rows).unwrap().into_iter().map(|i| i as u32).collect(), want)
        }
        "add" => {
            let n = u("rows") * u("d");
            let mut x = up(&f("x"));
            b.add(&mut x, &up(&f("y")), n).unwrap();
            (f32_bits(&b.read(&x, n).unwrap()), f32_bits(&f("out")))
        }
        "to_bf16" => {
            let n = u("rows") * u("d");
            let mut out = b.zeros::<bf16>(n).unwrap();
            b.to_bf16(&up(&f("x")), n, &mut out).unwrap();
            (widen16(bf16_bits(&b.read(&out, n).unwrap())), widen16(case.array("out").unwrap()))
        }
        "gather" => {
            let (rows, d, r) = (u("rows"), u("d"), u("R"));
            let mut out = b.zeros::<f32>(r * d).unwrap();
            let idx = b.upload(&case.array::<i32>("idx").unwrap()).unwrap();
            b.gather(&up(&f("x")), d, rows, &idx, r, &mut out).unwrap();
            b.check().unwrap();
            (f32_bits(&b.read(&out, r * d).unwrap()), f32_bits(&f("out")))
        }
        op => panic!("{}: unknown op {op}", case.name()),
    }
}

/// Every fixture case on `b`, bit for bit; every op of the contract has at least one case.
fn matches_every_fixture<B: Backend>(b: &B) {
    let mut ops = std::collections::BTreeSet::new();
    for case in cases("rowops") {
        let (got, want) = run_case(b, &case);
        assert_eq!(got.len(), want.len(), "{}: output length", case.name());
        if let Some(i) = got.iter().zip(&want).position(|(g, w)| g != w) {
            panic!("{} on {}: element {i} has bits {:#x}, the reference {:#x}", case.name(), b.name(), got[i], want[i]);
        }
        ops.insert(case.str("op").unwrap());
    }
    let all = ["add", "argmax", "embed", "gather", "kv_rows", "q_rows", "rmsnorm", "silu_mul", "to_bf16"];
    assert_eq!(ops.into_iter().collect::<Vec<_>>(), all, "ops covered by the fixtures");
}

/// RMSNorm and SiLU·mul of a row alone give the bits of the same row inside a batch of 37.
fn row_alone_equals_row_in_batch<B: Backend>(b: &B) {
    let mut next = xorshift(7);
    let (rows, d) = (37, 7168);
    let x: Vec<f32> = (0..rows * d).map(|_| ((next() >> 40) as f32 / (1u64 << 24) as f32 - 0.5) * 8.0).collect();
    let w: Vec<f32> = (0..d).map(|i| 1.0 + (i % 7) as f32 * 0.1).collect();
    let (xb, wb) = (b.upload(&x).unwrap(), b.upload(&w).unwrap());
    let mut batch = b.zeros::<f32>(rows * d).unwrap();
    b.rmsnorm(&xb, d, &wb, 1e-6, rows, &mut batch, d).unwrap();
    let batch = b.read(&batch, rows * d).unwrap();
    for t in [0, 17, 36] {
        let alone = b.upload(&x[t * d..(t + 1) * d]).unwrap();
        let mut y = b.zeros::<f32>(d).unwrap();
        b.rmsnorm(&alone, d, &wb, 1e-6, 1, &mut y, d).unwrap();
        assert_eq!(f32_bits(&b.read(&y, d).unwrap()), f32_bits(&batch[t * d..(t + 1) * d]), "rmsnorm row {t}");
    }
    let inter = d / 2;
    let mut act = b.zeros::<f32>(rows * inter).unwrap();
    b.silu_mul(&xb, inter, rows, &mut act).unwrap();
    let act = b.read(&act, rows * inter).unwrap();
    let mut one = b.zeros::<f32>(inter).unwrap();
    b.silu_mul(&b.upload(&x[5 * d..6 * d]).unwrap(), inter, 1, &mut one).unwrap();
    assert_eq!(f32_bits(&b.read(&one, inter).unwrap()), f32_bits(&act[5 * inter..6 * inter]), "silu_mul row 5");
}

/// An embedding id, a cache slot or a gathered row outside its table is an error naming it (on CUDA at
/// the backend's next check), never a silent read.
fn bad_indices_are_errors<B: Backend>(b: &B) {
    let table = b.upload(&[bf16::ONE; 4 * 8]).unwrap();
    let mut out = b.zeros::<f32>(8).unwrap();
    let ids = b.upload(&[4i32]).unwrap();
    let err = b.embed(&table, 8, &ids, 1, &mut out).and_then(|()| b.check()).unwrap_err();
    assert!(matches!(err, Error::Index { .. }), "embed: {err}");
    let x = b.upload(&[1f32; 16]).unwrap();
    let idx = b.upload(&[-1i32]).unwrap();
    let err = b.gather(&x, 8, 2, &idx, 1, &mut out).and_then(|()| b.check()).unwrap_err();
    assert!(matches!(err, Error::Index { .. }), "gather: {err}");
    let (kv, norm_w, rope) =
        (b.upload(&[0.5f32; 576]).unwrap(), b.upload(&[1f32; 512]).unwrap(), b.upload(&[1f32; 64]).unwrap());
    let slot = b.upload(&[3i32]).unwrap();
    let write = KvWrite { kv: &kv, norm_w: &norm_w, eps: 1e-6, table: &rope, interleave: true, slot: &slot };
    let mut cache = b.zeros::<bf16>(3 * 576).unwrap();
    let err = b.kv_rows(&write, 1, &mut cache).and_then(|()| b.check()).unwrap_err();
    assert!(matches!(err, Error::Index { .. }), "kv_rows: {err}");
    assert!(b.read(&cache, 3 * 576).unwrap().iter().all(|v| v.to_bits() == 0), "kv_rows wrote a row for a bad slot");
    b.check().unwrap();
}

#[test]
fn cpu_matches_every_fixture() {
    matches_every_fixture(&CpuBackend);
}

#[test]
fn cpu_row_alone_equals_row_in_batch() {
    row_alone_equals_row_in_batch(&CpuBackend);
}

#[test]
fn cpu_bad_indices_are_errors() {
    bad_indices_are_errors(&CpuBackend);
}

/// The slice functions check their shapes too.
#[test]
fn mis_shaped_inputs_are_errors_naming_them() {
    let mut out = vec![0f32; 3];
    let err = rowops::rmsnorm(&[1.0; 5], &[1.0; 2], 1e-6, &mut out).unwrap_err();
    assert!(matches!(err, Error::Shape { name: "x", .. }), "{err}");
    let err = rowops::silu_mul(&[1.0; 8], 4, &mut out).unwrap_err();
    assert!(matches!(err, Error::Shape { name: "out", .. }), "{err}");
    let err = rowops::argmax(&[1.0; 8], 0, &mut [0]).unwrap_err();
    assert!(matches!(err, Error::Param { name: "vocab", .. }), "{err}");
}

#[cfg(feature = "cuda")]
mod gpu {
    use super::*;

    #[test]
    fn gpu_matches_every_fixture() {
        let Some(b) = common::cuda_backend() else { return };
        matches_every_fixture(&b);
    }

    #[test]
    fn gpu_row_alone_equals_row_in_batch() {
        let Some(b) = common::cuda_backend() else { return };
        row_alone_equals_row_in_batch(&b);
    }

    #[test]
    fn gpu_bad_indices_are_errors() {
        let Some(b) = common::cuda_backend() else { return };
        bad_indices_are_errors(&b);
    }
}
