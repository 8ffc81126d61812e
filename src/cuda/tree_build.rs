//! Launcher of kernels/tree_build.cu: the best-first DDTree build (see [`crate::cpu::tree_build`]).

use cudarc::driver::{CudaSlice, LaunchConfig, PushKernelArg};

use super::{cuda_err, status_error, Gpu, MAX_SHARED_BYTES};
use crate::error::{check_len, Error, Result};
use crate::types::{check_seq_len, check_top_logp, check_tree_inputs, check_tree_lengths, DraftTree, TreeShape};

/// Device buffers of a tree batch; the same arrays as [`DraftTree`] plus per-request status words.
pub struct DeviceTree {
    /// The batch shape.
    pub shape: TreeShape,
    /// `[bs]` draft nodes per request.
    pub num_nodes: CudaSlice<i32>,
    /// `[bs, N]`.
    pub node_token: CudaSlice<i32>,
    /// `[bs, N]`.
    pub node_depth: CudaSlice<i32>,
    /// `[bs, N]`.
    pub parent: CudaSlice<i32>,
    /// `[bs, N]`.
    pub first_child: CudaSlice<i32>,
    /// `[bs, N]`.
    pub next_sibling: CudaSlice<i32>,
    /// `[bs, N]`.
    pub position: CudaSlice<i32>,
    /// `[bs, N, W]`.
    pub visibility: CudaSlice<u32>,
    /// `[bs]` nonzero when the request's log-probs held NaN.
    pub status: CudaSlice<i32>,
}

impl DeviceTree {
    /// Allocates the buffers for `shape`.
    pub fn alloc(gpu: &Gpu, shape: TreeShape) -> Result<Self> {
        shape.validate()?;
        let rows = shape.bs * shape.rows();
        Ok(DeviceTree {
            shape,
            num_nodes: gpu.zeros(shape.bs)?,
            node_token: gpu.zeros(rows)?,
            node_depth: gpu.zeros(rows)?,
            parent: gpu.zeros(rows)?,
            first_child: gpu.zeros(rows)?,
            next_sibling: gpu.zeros(rows)?,
            position: gpu.zeros(rows)?,
            visibility: gpu.zeros(rows * shape.words())?,
            status: gpu.zeros(shape.bs)?,
        })
    }

    /// Uploads a host tree (e.g. to run greedy accept on a tree built elsewhere).
    pub fn upload(gpu: &Gpu, tree: &DraftTree) -> Result<Self> {
        tree.check()?;
        Ok(DeviceTree {
            shape: tree.shape,
            num_nodes: gpu.upload(&tree.num_nodes)?,
            node_token: gpu.upload(&tree.node_token)?,
            node_depth: gpu.upload(&tree.node_depth)?,
            parent: gpu.upload(&tree.parent)?,
            first_child: gpu.upload(&tree.first_child)?,
            next_sibling: gpu.upload(&tree.next_sibling)?,
            position: gpu.upload(&tree.position)?,
            visibility: gpu.upload(&tree.visibility)?,
            status: gpu.zeros(tree.shape.bs)?,
        })
    }

    /// Checks the buffer lengths against the shape (the fields are public).
    fn check_buffers(&self) -> Result<()> {
        check_len("status", self.status.len(), &[("bs", self.shape.bs)])?;
        check_tree_lengths(
            self.shape,
            self.num_nodes.len(),
            [
                self.node_token.len(),
                self.node_depth.len(),
                self.parent.len(),
                self.first_child.len(),
                self.next_sibling.len(),
                self.position.len(),
            ],
            self.visibility.len(),
        )
    }

    /// Copies the tree to the host, returning an error if a request's log-probs held NaN.
    pub fn to_host(&self, gpu: &Gpu) -> Result<DraftTree> {
        status_error("top_logp", &gpu.download(&self.status)?)?;
        Ok(DraftTree {
            shape: self.shape,
            num_nodes: gpu.download(&self.num_nodes)?,
            node_token: gpu.download(&self.node_token)?,
            node_depth: gpu.download(&self.node_depth)?,
            parent: gpu.download(&self.parent)?,
            first_child: gpu.download(&self.first_child)?,
            next_sibling: gpu.download(&self.next_sibling)?,
            position: gpu.download(&self.position)?,
            visibility: gpu.download(&self.visibility)?,
        })
    }
}

/// Shared memory the kernel needs: the request's `[L, K]` log-probs, four per-row arrays and the
/// bitmask, all 4-byte words (the frontier lives in registers).
pub fn shared_bytes(shape: TreeShape, k: usize) -> usize {
    4 * (shape.depth * k + 4 * shape.rows() + shape.rows() * shape.words())
}

/// Queues the tree build of every request from device `top_ids` / `top_logp [bs, L, K]`.
pub fn build_trees(
    gpu: &Gpu,
    k: usize,
    top_ids: &CudaSlice<i32>,
    top_logp: &CudaSlice<f32>,
    root_token: &CudaSlice<i32>,
    seq_len: &CudaSlice<i32>,
    out: &mut DeviceTree,
) -> Result<()> {
    let s = out.shape;
    check_tree_inputs(s, k, top_ids.len(), top_logp.len(), root_token.len(), seq_len.len())?;
    out.check_buffers()?;
    let smem = shared_bytes(s, k);
    if smem > MAX_SHARED_BYTES {
        return Err(Error::param(
            "L * K",
            s.depth * k,
            format!(
                "the tree build needs {smem} B of shared memory for L={} K={k} B={}; the limit is {MAX_SHARED_BYTES} B",
                s.depth, s.budget
            ),
        ));
    }
    let f = &gpu.kernels.tree_build;
    let (depth, k_i, budget) = (s.depth as i32, k as i32, s.budget as i32);
    let cfg = LaunchConfig { grid_dim: (s.bs as u32, 1, 1), block_dim: (32, 1, 1), shared_mem_bytes: smem as u32 };
    let mut b = gpu.stream().launch_builder(f);
    b.arg(top_ids).arg(top_logp).arg(root_token).arg(seq_len).arg(&depth).arg(&k_i).arg(&budget);
    b.arg(&mut out.num_nodes).arg(&mut out.node_token).arg(&mut out.node_depth).arg(&mut out.parent);
    b.arg(&mut out.first_child).arg(&mut out.next_sibling).arg(&mut out.position).arg(&mut out.visibility);
    b.arg(&mut out.status);
    unsafe { b.launch(cfg) }.map_err(|e| cuda_err("tree_build", e))?;
    gpu.after_launch("tree_build")
}

impl Gpu {
    /// Builds the trees of host `top_ids` / `top_logp [bs, L, K]`: uploads, runs, checks, downloads.
    pub fn build_trees(
        &self,
        shape: TreeShape,
        k: usize,
        top_ids: &[i32],
        top_logp: &[f32],
        root_token: &[i32],
        seq_len: &[i32],
    ) -> Result<DraftTree> {
        check_tree_inputs(shape, k, top_ids.len(), top_logp.len(), root_token.len(), seq_len.len())?;
        check_top_logp(top_logp, shape.depth * k)?;
        check_seq_len(seq_len, shape.depth)?;
        let mut out = DeviceTree::alloc(self, shape)?;
        let (ids, logp) = (self.upload(top_ids)?, self.upload(top_logp)?);
        let (root, seq) = (self.upload(root_token)?, self.upload(seq_len)?);
        build_trees(self, k, &ids, &logp, &root, &seq, &mut out)?;
        out.to_host(self)
    }
}
