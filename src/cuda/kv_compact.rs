//! Launcher of kernels/kv_compact.cu: in-place KV compaction over all layers (see
//! [`crate::cpu::kv_compact`]).

use cudarc::driver::{CudaSlice, LaunchConfig, PushKernelArg};
use half::bf16;

use super::{cuda_err, to_i32, Gpu, MAX_SHARED_BYTES};
use crate::error::{check_len, Error, Result};
use crate::types::KvLayout;

/// Device inputs of one compaction: block tables, prefix lengths and the accepted paths.
pub struct CompactArgs<'a> {
    /// `[bs, pages_per_req]` page ids.
    pub block_table: &'a CudaSlice<i32>,
    /// `[bs]` prefix lengths (the tree rows start at slot `seq_len`).
    pub seq_len: &'a CudaSlice<i32>,
    /// `[bs]` accepted draft rows.
    pub accept_len: &'a CudaSlice<i32>,
    /// `[bs, L+1]` accepted rows (0 first).
    pub accept_rows: &'a CudaSlice<i32>,
    /// Draft depth L.
    pub depth: usize,
    /// Tree rows N written after each prefix.
    pub n_rows: usize,
}

/// Queues the compaction of `cache` (`layout`) in place. `status[0]` becomes nonzero when a path row, a
/// slot or a page id is out of range; that request is then left untouched. Requests must not share
/// pages (their CTAs run concurrently). A negative `accept_len` counts as 0 on the device; the host entry
/// [`Gpu::kv_compact`] rejects it, and negative `seq_len`, before anything runs.
pub fn kv_compact(
    gpu: &Gpu,
    cache: &mut CudaSlice<bf16>,
    layout: &KvLayout,
    args: &CompactArgs,
    status: &mut CudaSlice<i32>,
) -> Result<()> {
    let bs = args.seq_len.len();
    layout.check_compact_inputs(
        bs,
        cache.len(),
        args.block_table.len(),
        args.accept_len.len(),
        args.accept_rows.len(),
        args.depth,
    )?;
    check_len("status", status.len(), &[("words", 1)])?;
    if bs == 0 {
        return Ok(());
    }
    let smem = args.depth * layout.row_elems * 2;
    if smem > MAX_SHARED_BYTES.min(48 * 1024) {
        return Err(Error::param(
            "row_elems",
            layout.row_elems,
            format!("L * row bytes = {smem} B exceeds 48 KB of staging"),
        ));
    }
    gpu.stream().memset_zeros(status).map_err(|e| cuda_err("memset status", e))?;
    let p = (
        to_i32("num_pages", layout.num_pages)?,
        to_i32("page_size", layout.page_size)?,
        to_i32("row_elems", layout.row_elems)?,
        to_i32("pages_per_req", layout.pages_per_req)?,
        args.depth as i32,
        to_i32("n_rows", args.n_rows)?,
    );
    let cfg = LaunchConfig {
        grid_dim: (layout.layers as u32, bs as u32, 1),
        block_dim: (128, 1, 1),
        shared_mem_bytes: smem as u32,
    };
    let mut b = gpu.stream().launch_builder(&gpu.kernels.kv_compact);
    b.arg(cache).arg(&p.0).arg(&p.1).arg(&p.2).arg(args.block_table).arg(&p.3);
    b.arg(args.seq_len).arg(args.accept_len).arg(args.accept_rows).arg(&p.4).arg(&p.5).arg(status);
    unsafe { b.launch(cfg) }.map_err(|e| cuda_err("kv_compact", e))?;
    gpu.after_launch("kv_compact")
}

impl Gpu {
    /// Compacts a host cache through the device: uploads, runs, checks, downloads into `cache`.
    #[allow(clippy::too_many_arguments)]
    pub fn kv_compact(
        &self,
        cache: &mut [bf16],
        layout: &KvLayout,
        block_table: &[i32],
        seq_len: &[i32],
        accept_len: &[i32],
        accept_rows: &[i32],
        depth: usize,
        n_rows: usize,
    ) -> Result<()> {
        if let Some(b) = seq_len.iter().position(|&s| s < 0) {
            return Err(Error::param("seq_len", seq_len[b], format!("request {b}: must be >= 0")));
        }
        if let Some(b) = accept_len.iter().position(|&a| a < 0 || a as usize > depth) {
            return Err(Error::param("accept_len", accept_len[b], format!("request {b}: must be in 0..={depth}")));
        }
        let mut dev = self.upload(cache)?;
        let (table, seq, alen, arows) =
            (self.upload(block_table)?, self.upload(seq_len)?, self.upload(accept_len)?, self.upload(accept_rows)?);
        let args =
            CompactArgs { block_table: &table, seq_len: &seq, accept_len: &alen, accept_rows: &arows, depth, n_rows };
        let mut status = self.zeros::<i32>(1)?;
        kv_compact(self, &mut dev, layout, &args, &mut status)?;
        if self.download(&status)?[0] != 0 {
            return Err(Error::Index {
                name: "accept_rows / block_table",
                detail: "a path row, slot or page id is out of range; the request was left unchanged".into(),
            });
        }
        cache.copy_from_slice(&self.download(&dev)?);
        Ok(())
    }
}
