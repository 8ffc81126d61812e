//! Launcher of kernels/rowops.cu: the per-row operations of the forward pass (see [`crate::cpu::rowops`],
//! whose bits they give). Each call only checks lengths on the host and queues one launch. The ops that
//! index (embedding ids, cache slots, gathered rows) trust the values and report a bad one through a
//! status word instead, which `Backend::check` of the CUDA backend turns into an error.

use std::sync::Arc;

use cudarc::driver::{sys, CudaFunction, CudaModule, CudaSlice, CudaView, CudaViewMut, LaunchConfig, PushKernelArg};
use half::bf16;

use super::{cuda_err, to_i32, Gpu};
use crate::cpu::mla::{LATENT, ROPE, ROW};
use crate::cpu::rowops::{QueryShape, ROPE_TABLE};
use crate::error::{check_len, Error, Result};

/// Longest row RMSNorm takes: the row is staged in shared memory (96 KiB).
pub const MAX_NORM_DIM: usize = 24 * 1024;
/// Threads of an RMSNorm block (kernels/rowops.cu's `NORM_THREADS`).
const NORM_THREADS: u32 = 1024;
/// Threads of an embedding or gather block (kernels/rowops.cu's `COPY_THREADS`).
const COPY_THREADS: u32 = 512;
/// Values of a row each argmax block reduces.
const ARGMAX_CHUNK: usize = 4096;

/// Rows per block of the one-warp-per-row kernels.
const ROWS_PER_BLOCK: usize = 4;
/// Blocks of the elementwise kernels (grid-stride loops): enough to fill a large GPU.
const ELEMENTWISE_BLOCKS: usize = 1024;

/// The kernels of kernels/rowops.cu.
pub(crate) struct Kernels {
    rmsnorm: CudaFunction,
    silu_mul: CudaFunction,
    q_rows: CudaFunction,
    kv_rows: CudaFunction,
    embed: CudaFunction,
    add: CudaFunction,
    to_bf16: CudaFunction,
    gather: CudaFunction,
    argmax_chunk: CudaFunction,
    argmax_finish: CudaFunction,
}

impl Kernels {
    pub(crate) fn load(module: &Arc<CudaModule>) -> Result<Self> {
        let f = |name: &'static str| module.load_function(name).map_err(|e| cuda_err("load_function", e));
        let rmsnorm = f("rowops_rmsnorm")?;
        rmsnorm
            .set_attribute(
                sys::CUfunction_attribute_enum::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
                (MAX_NORM_DIM * 4) as i32,
            )
            .map_err(|e| cuda_err("rowops_rmsnorm shared memory attribute", e))?;
        Ok(Kernels {
            rmsnorm,
            silu_mul: f("rowops_silu_mul")?,
            q_rows: f("rowops_q_rows")?,
            kv_rows: f("rowops_kv_rows")?,
            embed: f("rowops_embed")?,
            add: f("rowops_add")?,
            to_bf16: f("rowops_to_bf16")?,
            gather: f("rowops_gather")?,
            argmax_chunk: f("rowops_argmax_chunk")?,
            argmax_finish: f("rowops_argmax_finish")?,
        })
    }
}

fn warp_rows(rows: usize) -> LaunchConfig {
    LaunchConfig {
        grid_dim: (rows.div_ceil(ROWS_PER_BLOCK) as u32, 1, 1),
        block_dim: ((32 * ROWS_PER_BLOCK) as u32, 1, 1),
        shared_mem_bytes: 0,
    }
}

fn elementwise(n: usize) -> LaunchConfig {
    LaunchConfig {
        grid_dim: (n.div_ceil(256).clamp(1, ELEMENTWISE_BLOCKS) as u32, 1, 1),
        block_dim: (256, 1, 1),
        shared_mem_bytes: 0,
    }
}

fn block_rows(rows: usize, threads: u32) -> Result<LaunchConfig> {
    if rows > i32::MAX as usize {
        return Err(Error::param("rows", rows, "must fit one grid dimension"));
    }
    Ok(LaunchConfig { grid_dim: (rows as u32, 1, 1), block_dim: (threads, 1, 1), shared_mem_bytes: 0 })
}

fn at_least(name: &'static str, len: usize, need: usize, what: String) -> Result<()> {
    if len < need {
        return Err(Error::shape(name, what, need, len));
    }
    Ok(())
}

/// RMSNorm of `rows` rows of `w.len()` values, at row strides `x_stride` and `y_stride`.
#[allow(clippy::too_many_arguments)]
pub fn rmsnorm(
    gpu: &Gpu,
    x: &CudaView<f32>,
    x_stride: usize,
    w: &CudaView<f32>,
    eps: f32,
    rows: usize,
    y: &mut CudaViewMut<f32>,
    y_stride: usize,
) -> Result<()> {
    let d = w.len();
    if d == 0 || x_stride < d || y_stride < d {
        return Err(Error::param(
            "rmsnorm",
            format!("d {d}, strides {x_stride} / {y_stride}"),
            "need 1 <= d <= strides",
        ));
    }
    if rows == 0 {
        return Ok(());
    }
    at_least("x", x.len(), (rows - 1) * x_stride + d, format!("[{rows}, {d}] at stride {x_stride}"))?;
    at_least("y", y.len(), (rows - 1) * y_stride + d, format!("[{rows}, {d}] at stride {y_stride}"))?;
    let (xs, dd, ys, r) =
        (to_i32("x stride", x_stride)?, to_i32("d", d)?, to_i32("y stride", y_stride)?, to_i32("rows", rows)?);
    let mut b = gpu.stream().launch_builder(&gpu.kernels.rowops.rmsnorm);
    b.arg(x).arg(&xs).arg(w).arg(&dd).arg(&eps).arg(&r).arg(y).arg(&ys);
    let cfg = LaunchConfig { shared_mem_bytes: (d * 4) as u32, ..block_rows(rows, NORM_THREADS)? };
    unsafe { b.launch(cfg) }.map_err(|e| cuda_err("rowops_rmsnorm", e))?;
    gpu.after_launch("rowops_rmsnorm")
}

/// `out [rows, inter] = SiLU(gate) · up` of `gu [rows, 2·inter]`.
pub fn silu_mul(gpu: &Gpu, gu: &CudaView<f32>, inter: usize, rows: usize, out: &mut CudaViewMut<f32>) -> Result<()> {
    let n = rows * inter;
    if n == 0 {
        return Ok(());
    }
    at_least("gate_up", gu.len(), 2 * n, format!("[{rows}, 2 * {inter}]"))?;
    at_least("out", out.len(), n, format!("[{rows}, {inter}]"))?;
    let (i, nn) = (to_i32("inter", inter)?, n as i64);
    let mut b = gpu.stream().launch_builder(&gpu.kernels.rowops.silu_mul);
    b.arg(gu).arg(&i).arg(&nn).arg(out);
    unsafe { b.launch(elementwise(n)) }.map_err(|e| cuda_err("rowops_silu_mul", e))?;
    gpu.after_launch("rowops_silu_mul")
}

/// The query rows `out [T, heads, 576]` bf16 of `tokens` tokens (see [`crate::cpu::rowops::q_rows`]).
#[allow(clippy::too_many_arguments)]
pub fn q_rows(
    gpu: &Gpu,
    q_latent: &CudaView<f32>,
    q: &CudaView<f32>,
    shape: QueryShape,
    table: &CudaView<f32>,
    tokens: usize,
    interleave: bool,
    out: &mut CudaViewMut<bf16>,
) -> Result<()> {
    let rows = tokens * shape.heads;
    if rows == 0 {
        return Ok(());
    }
    at_least("rope table", table.len(), tokens * ROPE_TABLE, format!("[{tokens}, {ROPE_TABLE}]"))?;
    at_least("q_latent", q_latent.len(), rows * LATENT, format!("[{tokens}, {}, {LATENT}]", shape.heads))?;
    at_least(
        "q",
        q.len(),
        rows * (shape.nope + ROPE),
        format!("[{tokens}, {}, {} + {ROPE}]", shape.heads, shape.nope),
    )?;
    at_least("out", out.len(), rows * ROW, format!("[{tokens}, {}, {ROW}]", shape.heads))?;
    let (h, nope, il, r) =
        (to_i32("heads", shape.heads)?, to_i32("nope", shape.nope)?, i32::from(interleave), to_i32("rows", rows)?);
    let mut b = gpu.stream().launch_builder(&gpu.kernels.rowops.q_rows);
    b.arg(q_latent).arg(q).arg(&h).arg(&nope).arg(table).arg(&il).arg(&r).arg(out);
    unsafe { b.launch(warp_rows(rows)) }.map_err(|e| cuda_err("rowops_q_rows", e))?;
    gpu.after_launch("rowops_q_rows")
}

/// The inputs of [`kv_rows`] besides the cache.
pub struct KvRowInputs<'a, 'b> {
    /// `[T, 576]` f32: `kv_a_proj_with_mqa`'s output.
    pub kv: &'a CudaView<'b, f32>,
    /// `[512]` f32: `kv_a_layernorm`'s weight.
    pub norm_w: &'a CudaView<'b, f32>,
    /// `kv_a_layernorm`'s epsilon.
    pub eps: f32,
    /// `[T, 64]` rotary table.
    pub table: &'a CudaView<'b, f32>,
    /// Whether the rotary pairs are interleaved.
    pub interleave: bool,
    /// `[T]` cache rows to write.
    pub slot: &'a CudaView<'b, i32>,
}

/// Writes the cache rows of `tokens` tokens into `cache [rows, 576]` (see [`crate::cpu::rowops::kv_rows`]);
/// a slot outside the cache sets `status`.
pub fn kv_rows(
    gpu: &Gpu,
    x: &KvRowInputs,
    tokens: usize,
    cache: &mut CudaViewMut<bf16>,
    status: &mut CudaSlice<i32>,
) -> Result<()> {
    if tokens == 0 {
        return Ok(());
    }
    at_least("kv", x.kv.len(), tokens * ROW, format!("[{tokens}, {ROW}]"))?;
    check_len("kv_a_layernorm weight", x.norm_w.len(), &[("512", LATENT)])?;
    at_least("rope table", x.table.len(), tokens * ROPE_TABLE, format!("[{tokens}, {ROPE_TABLE}]"))?;
    at_least("slot", x.slot.len(), tokens, format!("[{tokens}]"))?;
    let (il, t, cache_rows) = (i32::from(x.interleave), to_i32("tokens", tokens)?, (cache.len() / ROW) as i64);
    let mut b = gpu.stream().launch_builder(&gpu.kernels.rowops.kv_rows);
    b.arg(x.kv).arg(x.norm_w).arg(&x.eps).arg(x.table).arg(&il).arg(x.slot).arg(&t).arg(cache).arg(&cache_rows);
    b.arg(status);
    unsafe { b.launch(warp_rows(tokens)) }.map_err(|e| cuda_err("rowops_kv_rows", e))?;
    gpu.after_launch("rowops_kv_rows")
}

/// `out [tokens, hidden]` = rows `ids` of the bf16 `table [vocab, hidden]`; an id outside the vocabulary
/// sets `status`.
pub fn embed(
    gpu: &Gpu,
    table: &CudaView<bf16>,
    hidden: usize,
    ids: &CudaView<i32>,
    tokens: usize,
    out: &mut CudaViewMut<f32>,
    status: &mut CudaSlice<i32>,
) -> Result<()> {
    if hidden == 0 || !table.len().is_multiple_of(hidden) {
        return Err(Error::shape("embedding", format!("[vocab, {hidden}]"), hidden, table.len()));
    }
    if tokens == 0 {
        return Ok(());
    }
    at_least("ids", ids.len(), tokens, format!("[{tokens}]"))?;
    at_least("out", out.len(), tokens * hidden, format!("[{tokens}, {hidden}]"))?;
    let (h, v) = (to_i32("hidden", hidden)?, to_i32("vocab", table.len() / hidden)?);
    let mut b = gpu.stream().launch_builder(&gpu.kernels.rowops.embed);
    b.arg(table).arg(&h).arg(&v).arg(ids).arg(out).arg(status);
    unsafe { b.launch(block_rows(tokens, COPY_THREADS)?) }.map_err(|e| cuda_err("rowops_embed", e))?;
    gpu.after_launch("rowops_embed")
}

/// `x[..n] += y[..n]`.
pub fn add(gpu: &Gpu, x: &mut CudaViewMut<f32>, y: &CudaView<f32>, n: usize) -> Result<()> {
    if n == 0 {
        return Ok(());
    }
    at_least("x", x.len(), n, format!("[{n}]"))?;
    at_least("y", y.len(), n, format!("[{n}]"))?;
    let nn = n as i64;
    let mut b = gpu.stream().launch_builder(&gpu.kernels.rowops.add);
    b.arg(x).arg(y).arg(&nn);
    unsafe { b.launch(elementwise(n)) }.map_err(|e| cuda_err("rowops_add", e))?;
    gpu.after_launch("rowops_add")
}

/// `out[..n] = bf16(x[..n])`.
pub fn to_bf16(gpu: &Gpu, x: &CudaView<f32>, n: usize, out: &mut CudaViewMut<bf16>) -> Result<()> {
    if n == 0 {
        return Ok(());
    }
    at_least("x", x.len(), n, format!("[{n}]"))?;
    at_least("out", out.len(), n, format!("[{n}]"))?;
    let nn = n as i64;
    let mut b = gpu.stream().launch_builder(&gpu.kernels.rowops.to_bf16);
    b.arg(x).arg(&nn).arg(out);
    unsafe { b.launch(elementwise(n)) }.map_err(|e| cuda_err("rowops_to_bf16", e))?;
    gpu.after_launch("rowops_to_bf16")
}

/// `out [picked, dim]` = rows `idx[..picked]` of `x [rows, dim]`; an index outside sets `status`.
#[allow(clippy::too_many_arguments)]
pub fn gather(
    gpu: &Gpu,
    x: &CudaView<f32>,
    dim: usize,
    rows: usize,
    idx: &CudaView<i32>,
    picked: usize,
    out: &mut CudaViewMut<f32>,
    status: &mut CudaSlice<i32>,
) -> Result<()> {
    if picked == 0 || dim == 0 {
        return Ok(());
    }
    at_least("x", x.len(), rows * dim, format!("[{rows}, {dim}]"))?;
    at_least("idx", idx.len(), picked, format!("[{picked}]"))?;
    at_least("out", out.len(), picked * dim, format!("[{picked}, {dim}]"))?;
    let (d, r) = (to_i32("dim", dim)?, to_i32("rows", rows)?);
    let mut b = gpu.stream().launch_builder(&gpu.kernels.rowops.gather);
    b.arg(x).arg(&d).arg(&r).arg(idx).arg(out).arg(status);
    unsafe { b.launch(block_rows(picked, COPY_THREADS)?) }.map_err(|e| cuda_err("rowops_gather", e))?;
    gpu.after_launch("rowops_gather")
}

/// `out[r]` = the argmax of row r of `x [rows, vocab]` (the contract's order), through `keys` (`[rows]`,
/// zero before the call and left zero after it).
pub fn argmax(
    gpu: &Gpu,
    x: &CudaView<f32>,
    vocab: usize,
    rows: usize,
    out: &mut CudaViewMut<i32>,
    keys: &mut CudaSlice<u64>,
) -> Result<()> {
    if vocab == 0 {
        return Err(Error::param("vocab", 0, "must be at least 1"));
    }
    if rows == 0 {
        return Ok(());
    }
    at_least("x", x.len(), rows * vocab, format!("[{rows}, {vocab}]"))?;
    at_least("out", out.len(), rows, format!("[{rows}]"))?;
    at_least("argmax keys", keys.len(), rows, format!("[{rows}]"))?;
    if rows > 65_535 {
        return Err(Error::param("rows", rows, "argmax takes at most 65535 rows a call"));
    }
    let (v, chunk, r) = (to_i32("vocab", vocab)?, ARGMAX_CHUNK as i32, rows as i32);
    let cfg = LaunchConfig {
        grid_dim: (vocab.div_ceil(ARGMAX_CHUNK) as u32, rows as u32, 1),
        block_dim: (256, 1, 1),
        shared_mem_bytes: 0,
    };
    let mut b = gpu.stream().launch_builder(&gpu.kernels.rowops.argmax_chunk);
    b.arg(x).arg(&v).arg(&chunk).arg(&mut *keys);
    unsafe { b.launch(cfg) }.map_err(|e| cuda_err("rowops_argmax_chunk", e))?;
    gpu.after_launch("rowops_argmax_chunk")?;
    let mut b = gpu.stream().launch_builder(&gpu.kernels.rowops.argmax_finish);
    b.arg(&mut *keys).arg(&r).arg(out);
    unsafe { b.launch(elementwise(rows)) }.map_err(|e| cuda_err("rowops_argmax_finish", e))?;
    gpu.after_launch("rowops_argmax_finish")
}
