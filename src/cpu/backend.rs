//! The CPU backend: host buffers, and the pure-Rust kernels of this module's siblings as its operations.

use half::bf16;

use std::time::{Duration, Instant};

use rayon::prelude::*;

use crate::cpu::gemm_bf16::{dot, gemm_bf16};
use crate::cpu::kv_compact::kv_compact;
use crate::cpu::mla::{mla_decode, tree_verify, MlaOutput, PagedCache, LATENT, ROW};
use crate::cpu::moe_int4::{moe_int4_share, route, Experts, Int4Matrix, Int4Owned, OwnedExperts};
use crate::cpu::rowops::{self, QueryShape};
use crate::cpu::topk;
use crate::error::{check_len, Error, Result};
use crate::model::backend::{AttentionInputs, Backend, Compaction, Elem, ExpertShare, HeadStrides, KvWrite, TreeRows};
use crate::types::{KvLayout, Logits};

/// The CPU backend (see the module documentation).
#[derive(Clone, Copy, Debug, Default)]
pub struct CpuBackend;

/// A bf16 weight `[batch, out, in]` in host memory.
#[derive(Clone, Debug)]
pub struct HostLinear {
    w: Vec<bf16>,
    batch: usize,
    out: usize,
    inp: usize,
}

fn prefix<'a, T>(name: &'static str, buf: &'a [T], len: usize) -> Result<&'a [T]> {
    buf.get(..len).ok_or_else(|| Error::shape(name, format!("at least {len} elements"), len, buf.len()))
}

fn prefix_mut<'a, T>(name: &'static str, buf: &'a mut [T], len: usize) -> Result<&'a mut [T]> {
    let have = buf.len();
    buf.get_mut(..len).ok_or_else(|| Error::shape(name, format!("at least {len} elements"), len, have))
}

/// Copies `rows` rows of `features` from `src` (rows `xs.row` apart, starting at `offset`) into a dense block.
fn gather_strided(src: &[f32], offset: usize, row: usize, rows: usize, features: usize) -> Result<Vec<f32>> {
    let mut out = Vec::with_capacity(rows * features);
    for t in 0..rows {
        let start = offset + t * row;
        out.extend_from_slice(prefix("x", src.get(start..).unwrap_or(&[]), features)?);
    }
    Ok(out)
}

/// Query rows `first_row .. first_row + rows` of `q [.., heads, 576]`.
fn query_rows(q: &[bf16], heads: usize, first_row: usize, rows: usize) -> Result<&[bf16]> {
    let width = heads * ROW;
    let all = prefix("q", q, (first_row + rows) * width)?;
    Ok(&all[first_row * width..])
}

/// Writes an attention output into rows `first_row ..` of `o` and `lse`.
fn write_rows(got: &MlaOutput, heads: usize, first_row: usize, o: &mut [f32], lse: &mut [f32]) -> Result<()> {
    let (o_start, lse_start) = (first_row * heads * LATENT, first_row * heads);
    prefix_mut("o", o, o_start + got.o.len())?[o_start..].copy_from_slice(&got.o);
    prefix_mut("lse", lse, lse_start + got.lse.len())?[lse_start..].copy_from_slice(&got.lse);
    Ok(())
}

/// A xorshift64 stream (`seed` 0 is mapped to 1).
fn xorshift(seed: u64) -> impl FnMut() -> u64 {
    let mut s = seed | 1;
    move || {
        s ^= s << 13;
        s ^= s >> 7;
        s ^= s << 17;
        s
    }
}

/// A group scale in [0.002, 0.006).
fn random_scale(next: &mut impl FnMut() -> u64) -> f32 {
    0.002 + 0.004 * ((next() >> 40) as f32 / (1u64 << 24) as f32)
}

impl Backend for CpuBackend {
    type Buf<T: Elem> = Vec<T>;
    type Linear = HostLinear;
    type Experts = OwnedExperts;
    type Graph = ();
    type Mark = Instant;
    const RECORDS_GRAPHS: bool = false;

    fn name(&self) -> String {
        "cpu".into()
    }

    fn zeros<T: Elem>(&self, len: usize) -> Result<Vec<T>> {
        Ok(vec![T::default(); len])
    }

    fn upload<T: Elem>(&self, host: &[T]) -> Result<Vec<T>> {
        Ok(host.to_vec())
    }

    fn write<T: Elem>(&self, host: &[T], buf: &mut Vec<T>) -> Result<()> {
        prefix_mut("buffer", buf, host.len())?.copy_from_slice(host);
        Ok(())
    }

    fn read<T: Elem>(&self, buf: &Vec<T>, len: usize) -> Result<Vec<T>> {
        Ok(prefix("buffer", buf, len)?.to_vec())
    }

    fn len<T: Elem>(&self, buf: &Vec<T>) -> usize {
        buf.len()
    }

    fn linear(&self, w: &[bf16], batch: usize, out: usize, inp: usize) -> Result<HostLinear> {
        check_len("w", w.len(), &[("batch", batch), ("out", out), ("in", inp)])?;
        Ok(HostLinear { w: w.to_vec(), batch, out, inp })
    }

    fn experts(&self, experts: &Experts) -> Result<OwnedExperts> {
        experts.check()?;
        let owned = |m: &Int4Matrix| Int4Owned { packed: m.packed.to_vec(), scale: m.scale.to_vec() };
        Ok(OwnedExperts {
            count: experts.count,
            hidden: experts.hidden,
            inter: experts.inter,
            w13: owned(&experts.w13),
            w2: owned(&experts.w2),
        })
    }

    fn random_linear(&self, batch: usize, out: usize, inp: usize, seed: u64) -> Result<HostLinear> {
        Ok(HostLinear { w: self.random_table(batch * out, inp, seed)?, batch, out, inp })
    }

    fn random_table(&self, rows: usize, cols: usize, seed: u64) -> Result<Vec<bf16>> {
        let mut next = xorshift(seed);
        let scales: Vec<f32> = (0..rows * cols.div_ceil(32)).map(|_| random_scale(&mut next)).collect();
        Ok((0..rows * cols)
            .map(|i| {
                let q = (next() >> 60) as f32 - 8.0;
                bf16::from_f32(q * scales[(i / cols) * cols.div_ceil(32) + (i % cols) / 32])
            })
            .collect())
    }

    fn random_experts(&self, count: usize, hidden: usize, inter: usize, seed: u64) -> Result<OwnedExperts> {
        let random = |rows: usize, cols: usize, seed: u64| -> Result<Int4Owned> {
            if cols == 0 || !cols.is_multiple_of(32) {
                return Err(Error::param("expert input features", cols, "must be a positive multiple of 32"));
            }
            let mut next = xorshift(seed);
            let packed = (0..rows * cols / 8).map(|_| (next() >> 32) as i32).collect();
            let scale = (0..rows * cols / 32).map(|_| bf16::from_f32(random_scale(&mut next))).collect();
            Ok(Int4Owned { packed, scale })
        };
        Ok(OwnedExperts {
            count,
            hidden,
            inter,
            w13: random(count * 2 * inter, hidden, seed)?,
            w2: random(count * hidden, inter, seed ^ 0x9E37_79B9)?,
        })
    }

    fn matmul(&self, w: &HostLinear, x: &Vec<f32>, tokens: usize, y: &mut Vec<f32>) -> Result<()> {
        if w.batch != 1 {
            return Err(Error::param("weight batch", w.batch, "matmul takes a one-matrix weight"));
        }
        let got = gemm_bf16(&w.w, w.out, w.inp, prefix("x", x, tokens * w.inp)?)?;
        prefix_mut("y", y, tokens * w.out)?.copy_from_slice(&got);
        Ok(())
    }

    fn matmul_heads(
        &self,
        w: &HostLinear,
        x: &Vec<f32>,
        xs: HeadStrides,
        tokens: usize,
        y: &mut Vec<f32>,
        ys: HeadStrides,
    ) -> Result<()> {
        let per_head = w.out * w.inp;
        let inputs: Vec<Vec<f32>> =
            (0..w.batch).map(|h| gather_strided(x, h * xs.head, xs.row, tokens, w.inp)).collect::<Result<_>>()?;
        // One parallel pass over the heads; each output is the dot product gemm_bf16 computes.
        let outputs: Vec<Vec<f32>> = inputs
            .par_iter()
            .enumerate()
            .map(|(h, xh)| {
                let wh = &w.w[h * per_head..(h + 1) * per_head];
                xh.chunks(w.inp).flat_map(|row| wh.chunks(w.inp).map(move |wr| dot(row, wr))).collect()
            })
            .collect();
        for (h, got) in outputs.iter().enumerate() {
            for (t, row) in got.chunks(w.out).enumerate() {
                let start = h * ys.head + t * ys.row;
                prefix_mut("y", y.get_mut(start..).unwrap_or(&mut []), w.out)?.copy_from_slice(row);
            }
        }
        Ok(())
    }

    fn rmsnorm(
        &self,
        x: &Vec<f32>,
        x_stride: usize,
        w: &Vec<f32>,
        eps: f32,
        rows: usize,
        y: &mut Vec<f32>,
        y_stride: usize,
    ) -> Result<()> {
        let d = w.len();
        for t in 0..rows {
            let xr = prefix("x", x.get(t * x_stride..).unwrap_or(&[]), d)?;
            let yr = prefix_mut("y", y.get_mut(t * y_stride..).unwrap_or(&mut []), d)?;
            rowops::rmsnorm_row(xr, w, eps, yr);
        }
        Ok(())
    }

    fn silu_mul(&self, gu: &Vec<f32>, inter: usize, rows: usize, out: &mut Vec<f32>) -> Result<()> {
        rowops::silu_mul(prefix("gate_up", gu, rows * 2 * inter)?, inter, prefix_mut("out", out, rows * inter)?)
    }

    fn q_rows(
        &self,
        q_latent: &Vec<f32>,
        q: &Vec<f32>,
        shape: QueryShape,
        table: &Vec<f32>,
        tokens: usize,
        interleave: bool,
        out: &mut Vec<bf16>,
    ) -> Result<()> {
        let rows = tokens * shape.heads;
        rowops::q_rows(
            prefix("q_latent", q_latent, rows * LATENT)?,
            prefix("q", q, rows * (shape.nope + rowops::ROPE_TABLE))?,
            shape,
            prefix("rope table", table, tokens * rowops::ROPE_TABLE)?,
            interleave,
            prefix_mut("out", out, rows * ROW)?,
        )
    }

    fn kv_compact(&self, caches: &mut [Vec<bf16>], layout: KvLayout, m: &Compaction) -> Result<()> {
        for cache in caches {
            kv_compact(cache, &layout, &m.block_tables, &m.seq_len, &m.accept_len, &m.accept_rows, m.depth, m.n_rows)?;
        }
        Ok(())
    }

    fn kv_rows(&self, x: &KvWrite<Self>, tokens: usize, cache: &mut Vec<bf16>) -> Result<()> {
        rowops::kv_rows(
            prefix("kv", x.kv, tokens * ROW)?,
            x.norm_w,
            x.eps,
            prefix("rope table", x.table, tokens * rowops::ROPE_TABLE)?,
            x.interleave,
            prefix("slot", x.slot, tokens)?,
            cache,
        )
    }

    fn embed(&self, table: &Vec<bf16>, hidden: usize, ids: &Vec<i32>, tokens: usize, out: &mut Vec<f32>) -> Result<()> {
        rowops::embed(table, hidden, prefix("ids", ids, tokens)?, prefix_mut("out", out, tokens * hidden)?)
    }

    fn add(&self, x: &mut Vec<f32>, y: &Vec<f32>, n: usize) -> Result<()> {
        rowops::add(prefix_mut("x", x, n)?, prefix("y", y, n)?)
    }

    fn to_bf16(&self, x: &Vec<f32>, n: usize, out: &mut Vec<bf16>) -> Result<()> {
        rowops::to_bf16(prefix("x", x, n)?, prefix_mut("out", out, n)?)
    }

    fn gather(
        &self,
        x: &Vec<f32>,
        dim: usize,
        rows: usize,
        idx: &Vec<i32>,
        picked: usize,
        out: &mut Vec<f32>,
    ) -> Result<()> {
        rowops::gather(
            prefix("x", x, rows * dim)?,
            dim,
            prefix("idx", idx, picked)?,
            prefix_mut("out", out, picked * dim)?,
        )
    }

    fn argmax(&self, x: &Vec<f32>, vocab: usize, rows: usize, out: &mut Vec<i32>) -> Result<()> {
        rowops::argmax(prefix("x", x, rows * vocab)?, vocab, prefix_mut("out", out, rows)?)
    }

    fn topk(
        &self,
        x: &Vec<f32>,
        vocab: usize,
        rows: usize,
        k: usize,
        ids: &mut Vec<i32>,
        logp: &mut Vec<f32>,
    ) -> Result<()> {
        let top = topk::topk_logsumexp(Logits::F32(prefix("x", x, rows * vocab)?), 1, rows, vocab, k)?;
        prefix_mut("ids", ids, rows * k)?.copy_from_slice(&top.ids);
        prefix_mut("logp", logp, rows * k)?.copy_from_slice(&top.logp);
        Ok(())
    }

    fn attention(
        &self,
        q: &Vec<bf16>,
        heads: usize,
        first_row: usize,
        rows: usize,
        inputs: &AttentionInputs<Self>,
        softmax_scale: f32,
        o: &mut Vec<f32>,
        lse: &mut Vec<f32>,
    ) -> Result<()> {
        let tables = prefix("block_tables", inputs.block_tables, rows * inputs.layout.pages_per_req)?;
        let cache = PagedCache { rows: inputs.cache, layout: inputs.layout, block_table: tables };
        let seq_len = prefix("seq_len", inputs.seq_len, rows)?;
        let got = mla_decode(query_rows(q, heads, first_row, rows)?, heads, &cache, seq_len, softmax_scale)?;
        write_rows(&got, heads, first_row, o, lse)
    }

    fn tree_attention(
        &self,
        q: &Vec<bf16>,
        heads: usize,
        first_row: usize,
        shape: TreeRows,
        inputs: &AttentionInputs<Self>,
        visibility: &Vec<u32>,
        softmax_scale: f32,
        o: &mut Vec<f32>,
        lse: &mut Vec<f32>,
    ) -> Result<()> {
        let TreeRows { bs, n_rows } = shape;
        let tables = prefix("block_tables", inputs.block_tables, bs * inputs.layout.pages_per_req)?;
        let cache = PagedCache { rows: inputs.cache, layout: inputs.layout, block_table: tables };
        let seq_len = prefix("seq_len", inputs.seq_len, bs)?;
        let vis = prefix("visibility", visibility, bs * n_rows * n_rows.div_ceil(32))?;
        let q = query_rows(q, heads, first_row, bs * n_rows)?;
        let got = tree_verify(q, n_rows, heads, &cache, seq_len, vis, softmax_scale)?;
        write_rows(&got, heads, first_row, o, lse)
    }

    fn moe(
        &self,
        router_logits: &Vec<f32>,
        bias: &Vec<f32>,
        k: usize,
        scaling: f64,
        x: &Vec<bf16>,
        experts: &OwnedExperts,
        share: ExpertShare,
        tokens: usize,
        out: &mut Vec<f32>,
    ) -> Result<()> {
        share.check(experts.count)?;
        let logits = prefix("router_logits", router_logits, tokens * share.total)?;
        let routing = route(logits, bias, share.total, k, scaling)?;
        let got = moe_int4_share(prefix("x", x, tokens * experts.hidden)?, &routing, &experts.view(), share.first)?;
        prefix_mut("out", out, got.len())?.copy_from_slice(&got);
        Ok(())
    }

    fn capture(&self, _record: &mut dyn FnMut() -> Result<()>) -> Result<Option<()>> {
        Ok(None)
    }

    fn replay(&self, _graph: &()) -> Result<()> {
        Err(Error::param("graph", "replay", "the CPU backend records no graphs"))
    }

    fn plan_epoch(&self) -> u64 {
        0
    }

    fn launches(&self) -> u64 {
        0
    }

    fn mark(&self) -> Result<Instant> {
        Ok(Instant::now())
    }

    fn elapsed(&self, from: &Instant, to: &Instant) -> Result<Duration> {
        Ok(to.saturating_duration_since(*from))
    }

    fn check(&self) -> Result<()> {
        Ok(())
    }
}
