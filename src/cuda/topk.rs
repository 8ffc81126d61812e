//! Launcher of kernels/topk.cu: top-K with logsumexp over the vocabulary (see [`crate::cpu::topk`]).

use cudarc::driver::{CudaSlice, CudaViewMut, LaunchConfig, PushKernelArg};

use super::{cuda_err, status_error, to_i32, DeviceLogits, Gpu};
use crate::cpu::topk::LSE_CHUNK;
use crate::error::{check_len, Error, Result};
use crate::types::{check_vocab, Logits, TopK};

/// Threads per CTA of the chunk kernel (kernels/topk.cu CHUNK_THREADS).
const CHUNK_THREADS: u32 = 256;
/// Threads per CTA of the merge kernel (kernels/topk.cu THREADS).
const THREADS: u32 = 512;
/// Largest K the kernels select (their candidate buffers hold 512 keys).
pub const MAX_K: usize = 512;
/// Result slots of a chunk in a row merged inside the chunk kernel, per K: room for the usual candidates
/// (about 1.4 K on random logits), which then go out unselected.
const FUSED_SLOTS_PER_K: usize = 2;
/// Rows whose chunks have at most this many slots in all are merged inside the chunk kernel, by the last
/// CTA of the row to finish; larger ones by the merge kernel (kernels/topk.cu FUSED_SLOTS).
const FUSED_SLOTS: usize = 4096;

/// Device outputs of top-K: `[rows, K]` ids and log-probs, `[rows]` lse and status words.
pub struct DeviceTopK {
    /// Rows the buffers hold (the plan's maximum).
    pub rows: usize,
    /// Rows the last run wrote (bs * L of that run).
    pub valid_rows: usize,
    /// Candidates per row.
    pub k: usize,
    /// Token ids, value descending then id ascending.
    pub ids: CudaSlice<i32>,
    /// `logit - lse`.
    pub logp: CudaSlice<f32>,
    /// logsumexp per row.
    pub lse: CudaSlice<f32>,
    /// Per-row validation bits; nonzero means the row's logits were invalid.
    pub status: CudaSlice<i32>,
}

impl DeviceTopK {
    /// Copies the last run's outputs to the host (`bs * depth` must be its row count), returning an
    /// error if any row had invalid logits.
    pub fn to_host(&self, gpu: &Gpu, bs: usize, depth: usize) -> Result<TopK> {
        check_len("rows", self.valid_rows, &[("bs", bs), ("L", depth)])?;
        let rows = self.valid_rows;
        status_error("draft_logits", &gpu.download(&self.status)?[..rows])?;
        let (ids, logp, lse) = (gpu.download(&self.ids)?, gpu.download(&self.logp)?, gpu.download(&self.lse)?);
        let n = rows * self.k;
        Ok(TopK { bs, depth, k: self.k, ids: ids[..n].to_vec(), logp: logp[..n].to_vec(), lse: lse[..rows].to_vec() })
    }
}

/// Views of one run's outputs, `rows` rows: `[rows, K]` ids and log-probs, `[rows]` lse and status words.
pub struct TopKViews<'a> {
    /// Token ids, value descending then id ascending.
    pub ids: CudaViewMut<'a, i32>,
    /// `logit - lse`.
    pub logp: CudaViewMut<'a, f32>,
    /// logsumexp per row.
    pub lse: CudaViewMut<'a, f32>,
    /// Per-row validation bits; nonzero means the row's logits were invalid.
    pub status: CudaViewMut<'a, i32>,
}

/// Scratch for up to `rows` rows of `vocab` logits and a fixed K: the chunks' candidates and statistics.
pub struct TopKPlan {
    rows: usize,
    vocab: usize,
    k: usize,
    chunks: usize,
    cand: CudaSlice<u64>,
    chunk_max: CudaSlice<f32>,
    chunk_sum: CudaSlice<u64>,
    chunk_kth: CudaSlice<u64>,
    chunk_flags: CudaSlice<i32>,
    /// Per row, how many of its chunks have finished in the running launch; the merging CTA sets it back
    /// to zero, so it is zero between launches.
    arrivals: CudaSlice<u32>,
}

impl TopKPlan {
    /// Allocates the scratch for at most `rows` rows.
    pub fn new(gpu: &Gpu, rows: usize, vocab: usize, k: usize) -> Result<Self> {
        check_vocab(vocab)?;
        if k == 0 || k > vocab.min(MAX_K) {
            return Err(Error::param(
                "k",
                k,
                format!("must be in 1..={} (min of vocab and {MAX_K})", vocab.min(MAX_K)),
            ));
        }
        if rows == 0 || rows > 65_535 {
            return Err(Error::param("rows", rows, "bs * L must be in 1..=65535 (the grid's y dimension)"));
        }
        let chunks = vocab.div_ceil(LSE_CHUNK);
        Ok(TopKPlan {
            rows,
            vocab,
            k,
            chunks,
            cand: gpu.zeros(rows * chunks * Self::slots(chunks, k))?,
            chunk_max: gpu.zeros(rows * chunks)?,
            chunk_sum: gpu.zeros(rows * chunks)?,
            chunk_kth: gpu.zeros(rows * chunks)?,
            chunk_flags: gpu.zeros(rows * chunks)?,
            arrivals: gpu.zeros(rows)?,
        })
    }

    /// Result slots of each chunk: 2K in rows merged inside the chunk kernel, else K.
    fn slots(chunks: usize, k: usize) -> usize {
        if Self::fused(chunks, k) {
            FUSED_SLOTS_PER_K * k
        } else {
            k
        }
    }

    fn fused(chunks: usize, k: usize) -> bool {
        chunks * FUSED_SLOTS_PER_K * k <= FUSED_SLOTS
    }

    /// Device buffers for this plan's outputs.
    pub fn alloc_output(&self, gpu: &Gpu) -> Result<DeviceTopK> {
        Ok(DeviceTopK {
            rows: self.rows,
            valid_rows: 0,
            k: self.k,
            ids: gpu.zeros(self.rows * self.k)?,
            logp: gpu.zeros(self.rows * self.k)?,
            lse: gpu.zeros(self.rows)?,
            status: gpu.zeros(self.rows)?,
        })
    }

    /// Whether the plan serves `rows` rows of `vocab` logits with this K.
    pub fn fits(&self, rows: usize, vocab: usize, k: usize) -> bool {
        rows <= self.rows && vocab == self.vocab && k == self.k
    }

    /// Queues top-K of `rows` rows (at most the plan's) of `logits [rows, vocab]` into `out`.
    pub fn run(&mut self, gpu: &Gpu, logits: &DeviceLogits, rows: usize, out: &mut DeviceTopK) -> Result<()> {
        if out.rows < rows || out.k != self.k {
            return Err(Error::param(
                "rows",
                rows,
                format!("must be in 1..={} with outputs from this plan", self.rows),
            ));
        }
        check_len("top_ids", out.ids.len(), &[("rows", out.rows), ("K", self.k)])?;
        check_len("top_logp", out.logp.len(), &[("rows", out.rows), ("K", self.k)])?;
        check_len("lse", out.lse.len(), &[("rows", out.rows)])?;
        check_len("status", out.status.len(), &[("rows", out.rows)])?;
        let n = rows * self.k;
        let mut views = TopKViews {
            ids: out.ids.slice_mut(..n),
            logp: out.logp.slice_mut(..n),
            lse: out.lse.slice_mut(..rows),
            status: out.status.slice_mut(..rows),
        };
        self.run_into(gpu, logits, rows, &mut views)?;
        out.valid_rows = rows;
        Ok(())
    }

    /// Like [`TopKPlan::run`], into views of exactly `rows` rows: a caller's own buffers.
    pub fn run_into(&mut self, gpu: &Gpu, logits: &DeviceLogits, rows: usize, out: &mut TopKViews) -> Result<()> {
        if rows == 0 || rows > self.rows {
            return Err(Error::param("rows", rows, format!("must be in 1..={} (the plan's rows)", self.rows)));
        }
        check_len("logits", logits.len(), &[("rows", rows), ("V", self.vocab)])?;
        check_len("top_ids", out.ids.len(), &[("rows", rows), ("K", self.k)])?;
        check_len("top_logp", out.logp.len(), &[("rows", rows), ("K", self.k)])?;
        check_len("lse", out.lse.len(), &[("rows", rows)])?;
        check_len("status", out.status.len(), &[("rows", rows)])?;
        let (vocab, k, chunks) = (to_i32("vocab", self.vocab)?, self.k as i32, self.chunks as i32);
        let fused = Self::fused(self.chunks, self.k);
        let fused_slots = if fused { Self::slots(self.chunks, self.k) as i32 } else { 0 };
        let chunk_cfg = LaunchConfig {
            grid_dim: (self.chunks as u32, rows as u32, 1),
            block_dim: (CHUNK_THREADS, 1, 1),
            shared_mem_bytes: 0,
        };
        let stream = gpu.stream();
        let kernels = &gpu.kernels;
        match logits {
            DeviceLogits::F32(x) => {
                let mut b = stream.launch_builder(&kernels.topk_chunk_f32);
                b.arg(x).arg(&vocab).arg(&k);
                b.arg(&mut self.cand).arg(&mut self.chunk_max).arg(&mut self.chunk_sum);
                b.arg(&mut self.chunk_kth).arg(&mut self.chunk_flags).arg(&fused_slots).arg(&mut self.arrivals);
                b.arg(&mut out.ids).arg(&mut out.logp).arg(&mut out.lse).arg(&mut out.status);
                unsafe { b.launch(chunk_cfg) }.map_err(|e| cuda_err("topk_chunk_f32", e))?;
            }
            DeviceLogits::Bf16(x) => {
                let mut b = stream.launch_builder(&kernels.topk_chunk_bf16);
                b.arg(x).arg(&vocab).arg(&k);
                b.arg(&mut self.cand).arg(&mut self.chunk_max).arg(&mut self.chunk_sum);
                b.arg(&mut self.chunk_kth).arg(&mut self.chunk_flags).arg(&fused_slots).arg(&mut self.arrivals);
                b.arg(&mut out.ids).arg(&mut out.logp).arg(&mut out.lse).arg(&mut out.status);
                unsafe { b.launch(chunk_cfg) }.map_err(|e| cuda_err("topk_chunk_bf16", e))?;
            }
        }
        gpu.after_launch("topk_chunk")?;
        if !fused {
            let merge_cfg =
                LaunchConfig { grid_dim: (rows as u32, 1, 1), block_dim: (THREADS, 1, 1), shared_mem_bytes: 0 };
            let mut b = stream.launch_builder(&kernels.topk_merge);
            b.arg(&self.cand).arg(&self.chunk_max).arg(&self.chunk_sum).arg(&self.chunk_kth).arg(&self.chunk_flags);
            b.arg(&chunks).arg(&k);
            b.arg(&mut out.ids).arg(&mut out.logp).arg(&mut out.lse).arg(&mut out.status);
            unsafe { b.launch(merge_cfg) }.map_err(|e| cuda_err("topk_merge", e))?;
            gpu.after_launch("topk_merge")?;
        }
        Ok(())
    }
}

impl Gpu {
    /// Top-K with logsumexp of host `logits [bs, depth, vocab]`: uploads, runs, checks, downloads.
    pub fn topk_logsumexp(&self, logits: Logits, bs: usize, depth: usize, vocab: usize, k: usize) -> Result<TopK> {
        check_vocab(vocab)?;
        check_len("logits", logits.len(), &[("bs", bs), ("L", depth), ("V", vocab)])?;
        let rows = bs * depth;
        let mut plan = TopKPlan::new(self, rows, vocab, k)?;
        let mut out = plan.alloc_output(self)?;
        let dev = self.upload_logits(logits)?;
        plan.run(self, &dev.view(), rows, &mut out)?;
        out.to_host(self, bs, depth)
    }
}
