//! Launcher of kernels/greedy_accept.cu: argmax over the vocabulary fused with the greedy walk (see
//! [`crate::cpu::greedy_accept`]).

use cudarc::driver::{CudaSlice, LaunchConfig, PushKernelArg};

use super::tree_build::DeviceTree;
use super::{cuda_err, status_error, to_i32, DeviceLogits, Gpu};
use crate::error::{check_len, Error, Result};
use crate::types::{check_target_logits, check_vocab, Acceptance, DraftTree, Logits, TreeShape};

const THREADS: u32 = 256;
/// Logits per CTA (kernels/greedy_accept.cu CHUNK).
const CHUNK: usize = 16_384;

/// Device outputs of greedy accept: the same arrays as [`Acceptance`] plus per-request status words.
pub struct DeviceAcceptance {
    /// The tree batch shape the outputs belong to.
    pub shape: TreeShape,
    /// `[bs, N]` target argmax per valid row, -1 for padding rows.
    pub target_argmax: CudaSlice<i32>,
    /// `[bs]`.
    pub accept_len: CudaSlice<i32>,
    /// `[bs, L+1]`.
    pub accept_rows: CudaSlice<i32>,
    /// `[bs, L+1]`.
    pub emitted: CudaSlice<i32>,
    /// `[bs]` nonzero when a valid row's logits held NaN.
    pub status: CudaSlice<i32>,
}

impl DeviceAcceptance {
    /// Allocates the outputs for `shape`.
    pub fn alloc(gpu: &Gpu, shape: TreeShape) -> Result<Self> {
        let width = shape.bs * (shape.depth + 1);
        Ok(DeviceAcceptance {
            shape,
            target_argmax: gpu.zeros(shape.bs * shape.rows())?,
            accept_len: gpu.zeros(shape.bs)?,
            accept_rows: gpu.zeros(width)?,
            emitted: gpu.zeros(width)?,
            status: gpu.zeros(shape.bs)?,
        })
    }

    /// Checks the buffer lengths against the shape (the fields are public).
    fn check_buffers(&self) -> Result<()> {
        let s = self.shape;
        let width = [("bs", s.bs), ("L+1", s.depth + 1)];
        check_len("target_argmax", self.target_argmax.len(), &[("bs", s.bs), ("N", s.rows())])?;
        check_len("accept_len", self.accept_len.len(), &width[..1])?;
        check_len("accept_rows", self.accept_rows.len(), &width)?;
        check_len("emitted", self.emitted.len(), &width)?;
        check_len("status", self.status.len(), &width[..1])
    }

    /// Copies the outputs to the host, returning an error if a valid row's logits held NaN.
    pub fn to_host(&self, gpu: &Gpu) -> Result<Acceptance> {
        status_error("target_logits", &gpu.download(&self.status)?)?;
        Ok(Acceptance {
            bs: self.shape.bs,
            depth: self.shape.depth,
            target_argmax: gpu.download(&self.target_argmax)?,
            accept_len: gpu.download(&self.accept_len)?,
            accept_rows: gpu.download(&self.accept_rows)?,
            emitted: gpu.download(&self.emitted)?,
        })
    }
}

/// Scratch of the fused kernel for one tree shape and vocabulary: per-chunk partial argmax keys and the
/// arrival counters (zeroed once here, reset by the kernel's last arrivals).
pub struct AcceptPlan {
    shape: TreeShape,
    vocab: usize,
    chunks: usize,
    partial: CudaSlice<u64>,
    row_arrivals: CudaSlice<u32>,
    req_arrivals: CudaSlice<u32>,
}

impl AcceptPlan {
    /// Allocates the scratch for trees of `shape` over `vocab` logits per row.
    pub fn new(gpu: &Gpu, shape: TreeShape, vocab: usize) -> Result<Self> {
        check_vocab(vocab)?;
        shape.validate()?;
        if shape.bs > 65_535 {
            return Err(Error::param("bs", shape.bs, "at most 65535 requests per launch (the grid's z dimension)"));
        }
        let chunks = vocab.div_ceil(CHUNK);
        let rows = shape.bs * shape.rows();
        Ok(AcceptPlan {
            shape,
            vocab,
            chunks,
            partial: gpu.zeros(rows * chunks)?,
            row_arrivals: gpu.zeros(rows)?,
            req_arrivals: gpu.zeros(shape.bs)?,
        })
    }

    /// Queues argmax + walk over `target_logits [bs, N, V]` for the trees in `tree`.
    pub fn run(
        &mut self,
        gpu: &Gpu,
        tree: &DeviceTree,
        logits: &DeviceLogits,
        out: &mut DeviceAcceptance,
    ) -> Result<()> {
        let s = self.shape;
        if tree.shape != s || out.shape != s {
            return Err(Error::param("tree", format!("{:?}", tree.shape), format!("the plan was made for {s:?}")));
        }
        check_len("target_logits", logits.len(), &[("bs", s.bs), ("N", s.rows()), ("V", self.vocab)])?;
        out.check_buffers()?;
        gpu.stream().memset_zeros(&mut out.status).map_err(|e| cuda_err("memset status", e))?;
        let (vocab, n_rows, depth) = (to_i32("vocab", self.vocab)?, s.rows() as i32, s.depth as i32);
        let cfg = LaunchConfig {
            grid_dim: (self.chunks as u32, s.rows() as u32, s.bs as u32),
            block_dim: (THREADS, 1, 1),
            shared_mem_bytes: 0,
        };
        let (f, name) = match logits {
            DeviceLogits::F32(_) => (&gpu.kernels.greedy_accept_f32, "greedy_accept_f32"),
            DeviceLogits::Bf16(_) => (&gpu.kernels.greedy_accept_bf16, "greedy_accept_bf16"),
        };
        let mut b = gpu.stream().launch_builder(f);
        match logits {
            DeviceLogits::F32(x) => b.arg(x),
            DeviceLogits::Bf16(x) => b.arg(x),
        };
        b.arg(&vocab).arg(&n_rows).arg(&depth);
        b.arg(&tree.num_nodes).arg(&tree.node_token).arg(&tree.first_child).arg(&tree.next_sibling);
        b.arg(&mut self.partial).arg(&mut self.row_arrivals).arg(&mut self.req_arrivals);
        b.arg(&mut out.target_argmax).arg(&mut out.accept_len).arg(&mut out.accept_rows).arg(&mut out.emitted);
        b.arg(&mut out.status);
        unsafe { b.launch(cfg) }.map_err(|e| cuda_err(name, e))?;
        gpu.after_launch(name)
    }
}

/// Queues the walk alone from a device `target_argmax [bs, N]` (its padding rows are ignored).
pub fn accept_from_argmax(
    gpu: &Gpu,
    tree: &DeviceTree,
    argmax: &CudaSlice<i32>,
    out: &mut DeviceAcceptance,
) -> Result<()> {
    let s = tree.shape;
    if out.shape != s {
        return Err(Error::param("out", format!("{:?}", out.shape), format!("must match the tree's {s:?}")));
    }
    check_len("target_argmax", argmax.len(), &[("bs", s.bs), ("N", s.rows())])?;
    out.check_buffers()?;
    gpu.stream().memcpy_dtod(argmax, &mut out.target_argmax).map_err(|e| cuda_err("copy argmax", e))?;
    let (n_rows, depth) = (s.rows() as i32, s.depth as i32);
    let cfg = LaunchConfig { grid_dim: (s.bs as u32, 1, 1), block_dim: (128, 1, 1), shared_mem_bytes: 0 };
    let mut b = gpu.stream().launch_builder(&gpu.kernels.greedy_accept_argmax);
    b.arg(argmax).arg(&n_rows).arg(&depth);
    b.arg(&tree.num_nodes).arg(&tree.node_token).arg(&tree.first_child).arg(&tree.next_sibling);
    b.arg(&mut out.accept_len).arg(&mut out.accept_rows).arg(&mut out.emitted);
    unsafe { b.launch(cfg) }.map_err(|e| cuda_err("greedy_accept_argmax", e))?;
    gpu.after_launch("greedy_accept_argmax")
}

impl Gpu {
    /// Greedy accept of host `target_logits [bs, N, V]` over a host tree: uploads, runs, checks, downloads.
    pub fn greedy_accept(&self, tree: &DraftTree, target_logits: Logits, vocab: usize) -> Result<Acceptance> {
        check_target_logits(tree, target_logits.len(), vocab)?;
        let s = tree.shape;
        let dev_tree = DeviceTree::upload(self, tree)?;
        let mut plan = AcceptPlan::new(self, s, vocab)?;
        let mut out = DeviceAcceptance::alloc(self, s)?;
        let logits = self.upload_logits(target_logits)?;
        plan.run(self, &dev_tree, &logits.view(), &mut out)?;
        out.to_host(self)
    }

    /// Greedy accept from a host `target_argmax [bs, N]` over a host tree.
    pub fn accept_from_argmax(&self, tree: &DraftTree, argmax: &[i32]) -> Result<Acceptance> {
        tree.check()?;
        let dev_tree = DeviceTree::upload(self, tree)?;
        let mut out = DeviceAcceptance::alloc(self, tree.shape)?;
        accept_from_argmax(self, &dev_tree, &self.upload(argmax)?, &mut out)?;
        out.to_host(self)
    }
}
