//! The CUDA backend: device buffers, and the kernels of this module's siblings as its operations. Every
//! operation only queues work on the `Gpu`'s stream; nothing is read back until [`Backend::read`] or
//! [`Backend::check`].
//!
//! The plans (the GEMM's split-K scratch, the MLA split-KV scratch, the MoE routing buffers) live behind
//! a mutex and grow to the largest step seen, so a warmed-up step allocates nothing.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Mutex, MutexGuard, PoisonError};

use std::time::Duration;

use cudarc::driver::{sys, CudaEvent, CudaGraph, CudaSlice, CudaView, CudaViewMut, PinnedHostSlice};
use half::bf16;

use super::gemm_bf16::{DeviceWeight, GemmPlan, Strides};
use super::kv_compact::{self, CompactArgs};
use super::mla::{DeviceCache, DeviceMlaOutput, MlaPlan};
use super::moe_int4::{dequantize_native, random_native, DeviceExperts, DeviceInt4, ExpertsShape, MoePlan};
use super::rowops::{self, KvRowInputs};
use super::topk::{TopKPlan, TopKViews};
use super::{cuda_err, status_error, DeviceLogits, Gpu};
use crate::cpu::mla::ROW;
use crate::cpu::moe_int4::Experts;
use crate::cpu::rowops::QueryShape;
use crate::error::{Error, Result};
use crate::model::backend::{AttentionInputs, Backend, Compaction, Elem, ExpertShare, HeadStrides, KvWrite, TreeRows};
use crate::types::KvLayout;

/// Group scales of the random weights ([`Backend::random_linear`]).
const RANDOM_SCALES: (f32, f32) = (0.002, 0.006);

/// An MLA plan with the maxima it was made for: requests, rows per request, heads, sequence length.
struct SizedMla {
    plan: MlaPlan,
    dims: (usize, usize, usize, usize),
}

impl SizedMla {
    /// The plan in `slot`, remade (with the larger of the old and the asked maxima) unless it covers `dims`.
    fn fit<'a>(
        backend: &CudaBackend,
        slot: &'a mut Option<SizedMla>,
        dims: (usize, usize, usize, usize),
    ) -> Result<&'a mut MlaPlan> {
        let (bs, rows, heads, seq) = dims;
        let covers = |m: &SizedMla| m.dims.0 >= bs && m.dims.1 == rows && m.dims.2 == heads && m.dims.3 >= seq;
        if !slot.as_ref().is_some_and(covers) {
            let keep = slot.as_ref().filter(|m| m.dims.1 == rows && m.dims.2 == heads);
            let dims = keep.map_or(dims, |m| (m.dims.0.max(bs), rows, heads, m.dims.3.max(seq)));
            *slot = None;
            *slot = Some(SizedMla { plan: MlaPlan::new(&backend.gpu, dims.0, heads, dims.3, rows)?, dims });
            backend.bump_epoch();
        }
        Ok(&mut slot.as_mut().expect("made above").plan)
    }
}

/// Tree-verify plans kept at most: more row counts than this in one run remake the oldest.
const MAX_TREE_PLANS: usize = 16;

/// The tree-verify plan of `dims`' rows and heads in `plans` (grown to cover `dims`, or made), moved to
/// the end of the list.
fn fit_tree_plan<'a>(
    backend: &CudaBackend,
    plans: &'a mut Vec<SizedMla>,
    dims: (usize, usize, usize, usize),
) -> Result<&'a mut MlaPlan> {
    let same_shape = plans.iter().position(|m| m.dims.1 == dims.1 && m.dims.2 == dims.2);
    let mut slot = same_shape.map(|i| plans.remove(i));
    if slot.is_none() && plans.len() >= MAX_TREE_PLANS {
        plans.remove(0);
        backend.bump_epoch();
    }
    SizedMla::fit(backend, &mut slot, dims)?;
    plans.extend(slot);
    Ok(&mut plans.last_mut().expect("pushed above").plan)
}

/// One layer's cache for `requests` block-table rows.
fn device_cache<'a>(inputs: &'a AttentionInputs<CudaBackend>, requests: usize) -> Result<DeviceCache<'a>> {
    Ok(DeviceCache {
        rows: inputs.cache.as_view(),
        layout: inputs.layout,
        block_table: view(inputs.block_tables, requests * inputs.layout.pages_per_req, "block_tables")?,
    })
}

/// Rows `first .. first + rows` of a buffer of rows of `width` elements.
fn rows_of<'a, T: Elem>(
    buf: &'a CudaSlice<T>,
    first: usize,
    rows: usize,
    width: usize,
    name: &'static str,
) -> Result<CudaView<'a, T>> {
    view(buf, (first + rows) * width, name)?;
    Ok(buf.slice(first * width..(first + rows) * width))
}

/// The attention outputs of rows `first .. first + rows`.
fn output_rows<'a>(
    o: &'a mut CudaSlice<f32>,
    lse: &'a mut CudaSlice<f32>,
    heads: usize,
    first: usize,
    rows: usize,
) -> Result<DeviceMlaOutput<'a>> {
    let (o_width, end) = (heads * crate::cpu::mla::LATENT, first + rows);
    view_mut(o, end * o_width, "o")?;
    view_mut(lse, end * heads, "lse")?;
    Ok(DeviceMlaOutput {
        o: o.slice_mut(first * o_width..end * o_width),
        lse: lse.slice_mut(first * heads..end * heads),
    })
}

/// The top-K plan of the last K and vocabulary asked for, with the lse and status words its runs write
/// beside the caller's ids and log-probs.
struct SizedTopK {
    plan: TopKPlan,
    lse: CudaSlice<f32>,
    /// Per row; copied out and zeroed by [`Backend::fetch_status`], checked by [`Backend::check`].
    status: CudaSlice<i32>,
    status_host: PinnedHostSlice<i32>,
}

impl SizedTopK {
    fn new(gpu: &Gpu, rows: usize, vocab: usize, k: usize) -> Result<Self> {
        Ok(SizedTopK {
            plan: TopKPlan::new(gpu, rows, vocab, k)?,
            lse: gpu.zeros(rows)?,
            status: gpu.zeros(rows)?,
            // SAFETY: read only after a copy into it has completed (see `Backend::check`).
            status_host: unsafe { gpu.context().alloc_pinned::<i32>(rows) }.map_err(|e| cuda_err("alloc_pinned", e))?,
        })
    }
}

/// A MoE plan with the top-k and tokens it was made for.
struct SizedMoe {
    plan: MoePlan,
    k: usize,
    share: ExpertShare,
    shape: ExpertsShape,
    tokens: usize,
}

struct Plans {
    gemm: GemmPlan,
    mla: Option<SizedMla>,
    /// Tree-verify plans, one per (rows per request, heads): a drafter's block steps and the target's
    /// trees of other sizes alternate, and remaking a plan would drop every recorded graph. The one used
    /// last is at the end.
    tree_mla: Vec<SizedMla>,
    moe: Option<SizedMoe>,
    topk: Option<SizedTopK>,
    /// Status word of the indexing row operations (embedding ids, cache slots, gathered rows).
    status: CudaSlice<i32>,
    /// The argmax's per-row keys (zero between calls).
    argmax_keys: CudaSlice<u64>,
    /// Host copies of the status words, in [`STATUS_WORDS`] order.
    status_host: Vec<PinnedHostSlice<i32>>,
    /// [`Backend::fetch_status`] queued the copies into `status_host` since the last check.
    status_queued: bool,
}

/// The status words a check reads: the row operations', the decode and the tree MLA plans', the MoE plan's.
const STATUS_WORDS: usize = 4;

/// The CUDA backend on one [`Gpu`] (see the module documentation).
pub struct CudaBackend {
    gpu: Gpu,
    plans: Mutex<Plans>,
    /// Bumped whenever a plan is remade or the GEMM scratch grows.
    epoch: AtomicU64,
}

/// A CUDA graph of a recorded step.
pub struct StepGraph(CudaGraph);

// SAFETY: a CUDA graph may be used from any thread as long as calls on it are serialized; the model
// keeps its graphs behind a mutex, and replay only launches it on the backend's stream.
unsafe impl Send for StepGraph {}

impl CudaBackend {
    /// A backend on `gpu`.
    pub fn new(gpu: Gpu) -> Result<Self> {
        let plans = Plans {
            gemm: GemmPlan::new(&gpu, 1, &[])?,
            mla: None,
            tree_mla: Vec::new(),
            moe: None,
            topk: None,
            status: gpu.zeros(1)?,
            argmax_keys: gpu.zeros(1)?,
            status_host: (0..STATUS_WORDS).map(|_| pinned_word(&gpu)).collect::<Result<_>>()?,
            status_queued: false,
        };
        Ok(CudaBackend { gpu, plans: Mutex::new(plans), epoch: AtomicU64::new(0) })
    }

    /// The device it runs on.
    pub fn gpu(&self) -> &Gpu {
        &self.gpu
    }

    fn plans(&self) -> MutexGuard<'_, Plans> {
        self.plans.lock().unwrap_or_else(PoisonError::into_inner)
    }

    fn bump_epoch(&self) {
        self.epoch.fetch_add(1, Ordering::Relaxed);
    }

    /// Runs a GEMM on the plan, bumping the epoch when its scratch grew.
    fn gemm(&self, run: impl FnOnce(&mut GemmPlan) -> Result<()>) -> Result<()> {
        let mut plans = self.plans();
        let before = plans.gemm.footprint();
        let result = run(&mut plans.gemm);
        if plans.gemm.footprint() != before {
            self.bump_epoch();
        }
        result
    }
}

/// One page-locked host word, so that a copy into it is queued rather than waited for.
fn pinned_word(gpu: &Gpu) -> Result<PinnedHostSlice<i32>> {
    // SAFETY: the word is only read after a copy into it has completed (see `Backend::check`).
    unsafe { gpu.context().alloc_pinned::<i32>(1) }.map_err(|e| cuda_err("alloc_pinned", e))
}

fn view<'a, T: Elem>(buf: &'a CudaSlice<T>, len: usize, name: &'static str) -> Result<CudaView<'a, T>> {
    if buf.len() < len {
        return Err(Error::shape(name, format!("at least {len} elements"), len, buf.len()));
    }
    Ok(buf.slice(..len))
}

fn view_mut<'a, T: Elem>(buf: &'a mut CudaSlice<T>, len: usize, name: &'static str) -> Result<CudaViewMut<'a, T>> {
    if buf.len() < len {
        return Err(Error::shape(name, format!("at least {len} elements"), len, buf.len()));
    }
    Ok(buf.slice_mut(..len))
}

impl Backend for CudaBackend {
    type Buf<T: Elem> = CudaSlice<T>;
    type Linear = DeviceWeight;
    type Experts = DeviceExperts;
    type Graph = StepGraph;
    type Mark = CudaEvent;
    const RECORDS_GRAPHS: bool = true;

    fn name(&self) -> String {
        self.gpu.name().unwrap_or_else(|_| "cuda".into())
    }

    fn zeros<T: Elem>(&self, len: usize) -> Result<CudaSlice<T>> {
        self.gpu.zeros(len)
    }

    fn upload<T: Elem>(&self, host: &[T]) -> Result<CudaSlice<T>> {
        if host.is_empty() {
            return self.gpu.zeros(1);
        }
        self.gpu.upload(host)
    }

    fn write<T: Elem>(&self, host: &[T], buf: &mut CudaSlice<T>) -> Result<()> {
        if host.is_empty() {
            return Ok(());
        }
        let mut dst = view_mut(buf, host.len(), "buffer")?;
        self.gpu.stream().memcpy_htod(host, &mut dst).map_err(|e| cuda_err("write", e))
    }

    fn read<T: Elem>(&self, buf: &CudaSlice<T>, len: usize) -> Result<Vec<T>> {
        let mut host = vec![T::default(); len];
        if len > 0 {
            self.gpu.stream().memcpy_dtoh(&view(buf, len, "buffer")?, &mut host).map_err(|e| cuda_err("read", e))?;
            self.gpu.synchronize()?;
        }
        Ok(host)
    }

    fn len<T: Elem>(&self, buf: &CudaSlice<T>) -> usize {
        buf.len()
    }

    fn linear(&self, w: &[bf16], batch: usize, out: usize, inp: usize) -> Result<DeviceWeight> {
        DeviceWeight::upload(&self.gpu, w, batch, out, inp)
    }

    fn experts(&self, experts: &Experts) -> Result<DeviceExperts> {
        DeviceExperts::upload(&self.gpu, experts)
    }

    fn random_linear(&self, batch: usize, out: usize, inp: usize, seed: u64) -> Result<DeviceWeight> {
        DeviceWeight::from_device(self.random_table(batch * out, inp, seed)?, batch, out, inp)
    }

    fn random_table(&self, rows: usize, cols: usize, seed: u64) -> Result<CudaSlice<bf16>> {
        let (packed, scale) = random_native(&self.gpu, rows, cols, seed, RANDOM_SCALES)?;
        dequantize_native(&self.gpu, &packed, &scale)
    }

    fn random_experts(&self, count: usize, hidden: usize, inter: usize, seed: u64) -> Result<DeviceExperts> {
        let shape = ExpertsShape { count, hidden, inter };
        let (p13, s13) = random_native(&self.gpu, count * 2 * inter, hidden, seed, RANDOM_SCALES)?;
        let (p2, s2) = random_native(&self.gpu, count * hidden, inter, seed ^ 0x9E37_79B9, RANDOM_SCALES)?;
        let w13 = DeviceInt4::from_native(&self.gpu, p13, s13, count * 2 * inter, hidden)?;
        let w2 = DeviceInt4::from_native(&self.gpu, p2, s2, count * hidden, inter)?;
        DeviceExperts::new(shape, w13, w2)
    }

    fn matmul(&self, w: &DeviceWeight, x: &CudaSlice<f32>, tokens: usize, y: &mut CudaSlice<f32>) -> Result<()> {
        let (inp, out) = (w.in_features(), w.out_features());
        let xv = view(x, tokens * inp, "x")?;
        let mut yv = view_mut(y, tokens * out, "y")?;
        self.gemm(|g| g.run(&self.gpu, w, &xv, Strides::dense(inp), tokens, &mut yv, Strides::dense(out)))
    }

    fn matmul_heads(
        &self,
        w: &DeviceWeight,
        x: &CudaSlice<f32>,
        xs: HeadStrides,
        tokens: usize,
        y: &mut CudaSlice<f32>,
        ys: HeadStrides,
    ) -> Result<()> {
        let (xs, ys) = (Strides { row: xs.row, batch: xs.head }, Strides { row: ys.row, batch: ys.head });
        let (xv, mut yv) = (x.as_view(), y.as_view_mut());
        self.gemm(|g| g.run(&self.gpu, w, &xv, xs, tokens, &mut yv, ys))
    }

    fn rmsnorm(
        &self,
        x: &CudaSlice<f32>,
        x_stride: usize,
        w: &CudaSlice<f32>,
        eps: f32,
        rows: usize,
        y: &mut CudaSlice<f32>,
        y_stride: usize,
    ) -> Result<()> {
        rowops::rmsnorm(&self.gpu, &x.as_view(), x_stride, &w.as_view(), eps, rows, &mut y.as_view_mut(), y_stride)
    }

    fn silu_mul(&self, gu: &CudaSlice<f32>, inter: usize, rows: usize, out: &mut CudaSlice<f32>) -> Result<()> {
        rowops::silu_mul(&self.gpu, &gu.as_view(), inter, rows, &mut out.as_view_mut())
    }

    fn q_rows(
        &self,
        q_latent: &CudaSlice<f32>,
        q: &CudaSlice<f32>,
        shape: QueryShape,
        table: &CudaSlice<f32>,
        tokens: usize,
        interleave: bool,
        out: &mut CudaSlice<bf16>,
    ) -> Result<()> {
        let (ql, qv, tv) = (q_latent.as_view(), q.as_view(), table.as_view());
        rowops::q_rows(&self.gpu, &ql, &qv, shape, &tv, tokens, interleave, &mut out.as_view_mut())
    }

    fn kv_rows(&self, x: &KvWrite<Self>, tokens: usize, cache: &mut CudaSlice<bf16>) -> Result<()> {
        let (kv, norm_w, table, slot) = (x.kv.as_view(), x.norm_w.as_view(), x.table.as_view(), x.slot.as_view());
        let inputs =
            KvRowInputs { kv: &kv, norm_w: &norm_w, eps: x.eps, table: &table, interleave: x.interleave, slot: &slot };
        let mut plans = self.plans();
        rowops::kv_rows(&self.gpu, &inputs, tokens, &mut cache.as_view_mut(), &mut plans.status)
    }

    fn kv_compact(&self, caches: &mut [CudaSlice<bf16>], layout: KvLayout, m: &Compaction) -> Result<()> {
        if m.seq_len.is_empty() {
            return Ok(());
        }
        let block_table = self.gpu.upload(&m.block_tables)?;
        let seq_len = self.gpu.upload(&m.seq_len)?;
        let accept_len = self.gpu.upload(&m.accept_len)?;
        let accept_rows = self.gpu.upload(&m.accept_rows)?;
        let args = CompactArgs {
            block_table: &block_table,
            seq_len: &seq_len,
            accept_len: &accept_len,
            accept_rows: &accept_rows,
            depth: m.depth,
            n_rows: m.n_rows,
        };
        let mut plans = self.plans();
        for cache in caches {
            kv_compact::kv_compact(&self.gpu, cache, &layout, &args, &mut plans.status)?;
        }
        Ok(())
    }

    fn embed(
        &self,
        table: &CudaSlice<bf16>,
        hidden: usize,
        ids: &CudaSlice<i32>,
        tokens: usize,
        out: &mut CudaSlice<f32>,
    ) -> Result<()> {
        let mut plans = self.plans();
        rowops::embed(
            &self.gpu,
            &table.as_view(),
            hidden,
            &ids.as_view(),
            tokens,
            &mut out.as_view_mut(),
            &mut plans.status,
        )
    }

    fn add(&self, x: &mut CudaSlice<f32>, y: &CudaSlice<f32>, n: usize) -> Result<()> {
        rowops::add(&self.gpu, &mut x.as_view_mut(), &y.as_view(), n)
    }

    fn to_bf16(&self, x: &CudaSlice<f32>, n: usize, out: &mut CudaSlice<bf16>) -> Result<()> {
        rowops::to_bf16(&self.gpu, &x.as_view(), n, &mut out.as_view_mut())
    }

    fn gather(
        &self,
        x: &CudaSlice<f32>,
        dim: usize,
        rows: usize,
        idx: &CudaSlice<i32>,
        picked: usize,
        out: &mut CudaSlice<f32>,
    ) -> Result<()> {
        let mut plans = self.plans();
        let (xv, iv) = (x.as_view(), idx.as_view());
        rowops::gather(&self.gpu, &xv, dim, rows, &iv, picked, &mut out.as_view_mut(), &mut plans.status)
    }

    fn argmax(&self, x: &CudaSlice<f32>, vocab: usize, rows: usize, out: &mut CudaSlice<i32>) -> Result<()> {
        let mut plans = self.plans();
        if plans.argmax_keys.len() < rows {
            plans.argmax_keys = self.gpu.zeros(rows)?;
            self.bump_epoch();
        }
        rowops::argmax(&self.gpu, &x.as_view(), vocab, rows, &mut out.as_view_mut(), &mut plans.argmax_keys)
    }

    fn topk(
        &self,
        x: &CudaSlice<f32>,
        vocab: usize,
        rows: usize,
        k: usize,
        ids: &mut CudaSlice<i32>,
        logp: &mut CudaSlice<f32>,
    ) -> Result<()> {
        let mut plans = self.plans();
        if !plans.topk.as_ref().is_some_and(|t| t.plan.fits(rows, vocab, k)) {
            let rows = plans.topk.as_ref().map_or(rows, |t| rows.max(t.status.len()));
            plans.topk = None;
            plans.topk = Some(SizedTopK::new(&self.gpu, rows, vocab, k)?);
            self.bump_epoch();
        }
        let t = plans.topk.as_mut().expect("made above");
        let logits = DeviceLogits::F32(view(x, rows * vocab, "x")?);
        let mut out = TopKViews {
            ids: view_mut(ids, rows * k, "ids")?,
            logp: view_mut(logp, rows * k, "logp")?,
            lse: t.lse.slice_mut(..rows),
            status: t.status.slice_mut(..rows),
        };
        t.plan.run_into(&self.gpu, &logits, rows, &mut out)
    }

    fn attention(
        &self,
        q: &CudaSlice<bf16>,
        heads: usize,
        first_row: usize,
        rows: usize,
        inputs: &AttentionInputs<Self>,
        softmax_scale: f32,
        o: &mut CudaSlice<f32>,
        lse: &mut CudaSlice<f32>,
    ) -> Result<()> {
        let mut plans = self.plans();
        let mla = SizedMla::fit(self, &mut plans.mla, (rows, 1, heads, inputs.max_seq_len))?;
        let cache = device_cache(inputs, rows)?;
        let q = rows_of(q, first_row, rows, heads * ROW, "q")?;
        let seq_len = view(inputs.seq_len, rows, "seq_len")?;
        let mut out = output_rows(o, lse, heads, first_row, rows)?;
        mla.run_decode(&self.gpu, &q, &cache, &seq_len, inputs.max_seq_len, softmax_scale, &mut out)
    }

    fn tree_attention(
        &self,
        q: &CudaSlice<bf16>,
        heads: usize,
        first_row: usize,
        shape: TreeRows,
        inputs: &AttentionInputs<Self>,
        visibility: &CudaSlice<u32>,
        softmax_scale: f32,
        o: &mut CudaSlice<f32>,
        lse: &mut CudaSlice<f32>,
    ) -> Result<()> {
        let TreeRows { bs, n_rows } = shape;
        let mut plans = self.plans();
        let mla = fit_tree_plan(self, &mut plans.tree_mla, (bs, n_rows, heads, inputs.max_seq_len))?;
        let cache = device_cache(inputs, bs)?;
        let q = rows_of(q, first_row, bs * n_rows, heads * ROW, "q")?;
        let seq_len = view(inputs.seq_len, bs, "seq_len")?;
        let vis = view(visibility, bs * n_rows * n_rows.div_ceil(32), "visibility")?;
        let mut out = output_rows(o, lse, heads, first_row, bs * n_rows)?;
        mla.run_tree_verify(&self.gpu, &q, n_rows, &cache, &seq_len, inputs.max_seq_len, &vis, softmax_scale, &mut out)
    }

    fn moe(
        &self,
        router_logits: &CudaSlice<f32>,
        bias: &CudaSlice<f32>,
        k: usize,
        scaling: f64,
        x: &CudaSlice<bf16>,
        experts: &DeviceExperts,
        share: ExpertShare,
        tokens: usize,
        out: &mut CudaSlice<f32>,
    ) -> Result<()> {
        let mut plans = self.plans();
        let fits = |m: &SizedMoe| m.k == k && m.share == share && m.shape == experts.shape && m.tokens >= tokens;
        if !plans.moe.as_ref().is_some_and(fits) {
            let t = plans.moe.as_ref().map_or(tokens, |m| m.tokens.max(tokens));
            plans.moe = None;
            let plan = MoePlan::new_share(&self.gpu, experts.shape, share, k, t)?;
            plans.moe = Some(SizedMoe { plan, k, share, shape: experts.shape, tokens: t });
            self.bump_epoch();
        }
        let moe = plans.moe.as_mut().expect("made above");
        let h = experts.shape.hidden;
        moe.plan.route(
            &self.gpu,
            &view(router_logits, tokens * share.total, "router_logits")?,
            &view(bias, share.total, "bias")?,
            scaling,
            tokens,
        )?;
        moe.plan.experts_forward(&self.gpu, experts, &view(x, tokens * h, "x")?, &mut view_mut(out, tokens * h, "out")?)
    }

    fn capture(&self, record: &mut dyn FnMut() -> Result<()>) -> Result<Option<StepGraph>> {
        let stream = self.gpu.stream();
        stream
            .begin_capture(sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL)
            .map_err(|e| cuda_err("begin graph capture", e))?;
        let recorded = record();
        // The capture must end whatever happened, or the stream stays in capture mode.
        let graph = stream.end_capture(sys::CUgraphInstantiate_flags(0)).map_err(|e| cuda_err("end graph capture", e));
        recorded?;
        Ok(graph?.map(StepGraph))
    }

    fn replay(&self, graph: &StepGraph) -> Result<()> {
        graph.0.launch().map_err(|e| cuda_err("graph replay", e))
    }

    fn plan_epoch(&self) -> u64 {
        self.epoch.load(Ordering::Relaxed)
    }

    fn launches(&self) -> u64 {
        self.gpu.launches()
    }

    fn mark(&self) -> Result<CudaEvent> {
        self.gpu
            .stream()
            .record_event(Some(sys::CUevent_flags::CU_EVENT_DEFAULT))
            .map_err(|e| cuda_err("record event", e))
    }

    fn elapsed(&self, from: &CudaEvent, to: &CudaEvent) -> Result<Duration> {
        to.synchronize().map_err(|e| cuda_err("event synchronize", e))?;
        let ms = from.elapsed_ms(to).map_err(|e| cuda_err("event elapsed", e))?;
        Ok(Duration::from_secs_f64(f64::from(ms) * 1e-3))
    }

    fn fetch_status(&self) -> Result<()> {
        let mut guard = self.plans();
        let plans = &mut *guard;
        let stream = self.gpu.stream();
        let words = [
            Some(plans.status.slice(0..1)),
            plans.mla.as_ref().map(|m| m.plan.status_word()),
            plans.tree_mla.last().map(|m| m.plan.status_word()),
            plans.moe.as_ref().map(|m| m.plan.status_word()),
        ];
        for (word, host) in words.iter().zip(plans.status_host.iter_mut()) {
            match word {
                Some(word) => stream.memcpy_dtoh(word, host),
                None => host.as_mut_slice().map(|h| h[0] = 0),
            }
            .map_err(|e| cuda_err("copy status", e))?;
        }
        stream.memset_zeros(&mut plans.status).map_err(|e| cuda_err("memset status", e))?;
        // Every check, not only after a `topk` call: a replayed graph runs the kernel without one.
        if let Some(t) = &mut plans.topk {
            stream.memcpy_dtoh(&t.status, &mut t.status_host).map_err(|e| cuda_err("copy status", e))?;
            stream.memset_zeros(&mut t.status).map_err(|e| cuda_err("memset status", e))?;
        }
        plans.status_queued = true;
        Ok(())
    }

    fn check(&self) -> Result<()> {
        if !self.plans().status_queued {
            self.fetch_status()?;
        }
        self.gpu.synchronize()?;
        let mut plans = self.plans();
        plans.status_queued = false;
        let mut bits = [0; STATUS_WORDS];
        for (b, host) in bits.iter_mut().zip(&plans.status_host) {
            *b = host.as_slice().map_err(|e| cuda_err("read status", e))?[0];
        }
        if bits[0] != 0 {
            return Err(Error::Index {
                name: "tokens / cache slots / rows",
                detail: "an index was outside its table; its row was zeroed".into(),
            });
        }
        MlaPlan::status_error(bits[1])?;
        MlaPlan::status_error(bits[2])?;
        if let Some(t) = &plans.topk {
            status_error("topk logits", t.status_host.as_slice().map_err(|e| cuda_err("read status", e))?)?;
        }
        match &plans.moe {
            Some(moe) => moe.plan.status_error(bits[3]),
            None => Ok(()),
        }
    }
}
