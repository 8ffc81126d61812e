//! Launcher of kernels/moe_int4.cu: routing and alignment, the two grouped INT4 GEMMs and the combine
//! (see [`crate::cpu::moe_int4`]).
//!
//! Weights live on the device as [`DeviceExperts`] in the layout the cargo features choose
//! ([`LAYOUT`]): `int4-native` keeps the checkpoint's `pack-quantized` order, `int4-tiled` repacks it on
//! the device at load time ([`crate::cpu::moe_int4::tile`] documents the order). A [`MoePlan`] owns the
//! routing and intermediate buffers for up to `max_tokens` tokens; its `route` / `set_routing` and
//! `experts_forward` only launch kernels. The kernels after the routing are programmatic dependent
//! launches (on compute capability 9.0 and newer, see [`Gpu`]): each may start while its predecessor
//! finishes, e.g. the down GEMM loads its first weights during the gate/up GEMM's last wave and streams
//! each expert as soon as that expert's gate/up blocks are done (kernels/moe_int4.cu states the rules
//! that keep this exact).

use cudarc::driver::{CudaSlice, CudaView, CudaViewMut, DevicePtr, LaunchConfig, PushKernelArg};
use half::bf16;

use super::{check_aligned, cuda_err, to_i32, Gpu, KernelArgs};
use crate::cpu::moe_int4::{tiled_len, ExpertShare, Experts, Routing, GROUP, PACK, TILE_ROWS};
use crate::error::{check_len, Error, Result};

/// The most experts the routing kernel handles (one CTA; Kimi-K2 has 384, DeepSeek-V3 256).
pub const MAX_EXPERTS: usize = 1024;
/// The largest top-k the routing kernel handles: it keeps at most the k best experts of each warp of
/// 32 as candidates, so k may not exceed a warp.
pub const MAX_TOP_K: usize = 32;
/// The most tokens a plan holds (the combine launches one row of blocks per token).
pub const MAX_TOKENS: usize = 65_535;

/// K slices of each GEMM (kernels/moe_int4.cu GATE_UP_KSPLIT, DOWN_KSPLIT): the warps that split a row
/// group's K and sum their partials in order.
const GATE_UP_KSPLIT: usize = 4;
const DOWN_KSPLIT: usize = 1;
/// Rows of a GEMM's row group: 16 h rows (gate/up) or 32 output rows (down). The narrow down GEMM waits for
/// ceil(I / 16) narrow gate/up blocks per expert (kernels/moe_int4.cu rule H), the narrow gate/up grid's
/// rows: one row group of 16 per block.
const GATE_UP_GROUP_ROWS: usize = 16;
const DOWN_GROUP_ROWS: usize = 32;

/// Warps per GEMM block (kernels/moe_int4.cu gemm_warps): a narrow kernel runs one row group of `ksplit`
/// warps, a wide one 8 warps.
const fn gemm_warps(wide: bool, ksplit: usize) -> usize {
    if wide {
        8
    } else {
        ksplit
    }
}
/// Bytes of one staged (16-row tile, chunk) in shared memory: the tiled layout's chunk image, or the
/// native layout's 16 unpadded rows of 64 bytes, both followed by the 16 rows' scales (kernels/moe_int4.cu
/// StageTile, NativeStage); the native down GEMM stages the rows only (NativeRows) and keeps its scales in
/// scale quads of [`NATIVE_SCALE_QUADS_BYTES`] per tile.
const STAGE_TILE_BYTES: usize = 1152;
const NATIVE_ROWS_BYTES: usize = 1024;
/// The scales of 8 consecutive chunks of one 16-row tile (kernels/moe_int4.cu ScaleQuads).
const NATIVE_SCALE_QUADS_BYTES: usize = 1024;
/// Bytes of one chunk's activations for one n8 tile (kernels/moe_int4.cu ActStage).
const ACT_STAGE_BYTES: usize = 2048;
const ALIGN_THREADS: u32 = 512;
/// Threads of a routing CTA (one token each): one per expert, up to kernels/moe_int4.cu MAX_EXPERTS.
const ROUTE_THREADS: u32 = MAX_EXPERTS as u32;
/// Tokens per expert served by the narrow GEMM kernels (one n8 MMA tile); more go to the wide ones.
const NARROW_TOKENS: usize = 8;

/// Dynamic shared memory of the gate/up (`down` false) or down GEMM: each warp's ring of weight stages
/// (2 m16 tiles per stage), for the narrow kernels each warp's ring of activation stages (2 KB each), the
/// native down GEMM's scale quads, and with K split over several warps their partial sums (2 m16 tiles x
/// n8 tiles x 128 floats). Must match BlockShape in the kernel.
pub(crate) const fn gemm_shared_bytes_of(down: bool, wide: bool) -> usize {
    let ksplit = if down { DOWN_KSPLIT } else { GATE_UP_KSPLIT };
    let native = matches!(LAYOUT, Int4Layout::Native);
    // The native narrow gate/up GEMM keeps 2 chunks in flight, the others 3 (kernels/moe_int4.cu GateUp).
    let narrow_stages = if native && !down { 2 } else { 3 };
    let (stages, n_tiles, act_stage) = if wide { (2, 2, 0) } else { (narrow_stages, 1, ACT_STAGE_BYTES) };
    let quads = down && native;
    let (stage, scales) = if quads { (NATIVE_ROWS_BYTES, NATIVE_SCALE_QUADS_BYTES) } else { (STAGE_TILE_BYTES, 0) };
    let warps = gemm_warps(wide, ksplit);
    let partials = if ksplit > 1 { warps * 2 * n_tiles * 128 * 4 } else { 0 };
    let ring = warps * (stages * (2 * stage + act_stage) + 2 * scales) + partials;
    // The native narrow gate/up GEMM serves its one-token experts with the one-token kernel's stages
    // (kernels/moe_int4.cu gate_up_kernel).
    if native && !down && !wide && ring < NATIVE_ONE_TOKEN_GATE_UP_BYTES {
        NATIVE_ONE_TOKEN_GATE_UP_BYTES
    } else {
        ring
    }
}

/// Chunks in flight per warp in the native down GEMM of one token (kernels/moe_int4.cu
/// DIRECT_DOWN_STAGES).
const DIRECT_DOWN_STAGES: usize = 4;
/// Bytes of one chunk's activations of one token (kernels/moe_int4.cu ActStageT<1>).
const ACT_SLOT_BYTES: usize = ACT_STAGE_BYTES / NARROW_TOKENS;

/// Dynamic shared memory of the native down GEMM of one token (one warp, `moe_down_direct_native`): its
/// weight stages (rows only), its one-slot activation stages and as many zeros (kernels/moe_int4.cu
/// ActStageT), and its scale quads. Must match BlockShape in the kernel.
pub(crate) const fn direct_down_shared_bytes() -> usize {
    DIRECT_DOWN_STAGES * (2 * NATIVE_ROWS_BYTES + 2 * ACT_SLOT_BYTES) + 2 * NATIVE_SCALE_QUADS_BYTES
}

/// Dynamic shared memory of the native one-token gate/up stages (kernels/moe_int4.cu DirectGateUp): each of
/// the 4 warps' 2 two-chunk stages of 2 m16 tiles (NativePairStage, twice a one-chunk stage), its 4
/// one-slot activation stages and as many zeros, and the partial sums. Must match BlockShape in the kernel.
const NATIVE_ONE_TOKEN_GATE_UP_BYTES: usize = {
    let (stages, chunks) = (2, 4);
    GATE_UP_KSPLIT * (stages * 2 * (2 * STAGE_TILE_BYTES) + chunks * 2 * ACT_SLOT_BYTES + 2 * 128 * 4)
};

/// Launch geometry of a GEMM over `rows` weight rows: grid rows, threads and shared memory.
fn gemm_geometry(rows: usize, group_rows: usize, down: bool, wide: bool) -> (u32, u32, u32) {
    let ksplit = if down { DOWN_KSPLIT } else { GATE_UP_KSPLIT };
    let warps = gemm_warps(wide, ksplit);
    let block_rows = group_rows * warps / ksplit;
    (rows.div_ceil(block_rows) as u32, (warps * 32) as u32, gemm_shared_bytes_of(down, wide) as u32)
}

const STATUS_BAD_LOGIT: i32 = 1;
const STATUS_BAD_EXPERT: i32 = 2;

/// Device order of INT4 weights.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Int4Layout {
    /// The checkpoint's compressed-tensors `pack-quantized` order.
    Native,
    /// The MMA tile order of [`crate::cpu::moe_int4::tile`].
    Tiled,
}

/// The layout chosen by the cargo features (exactly one of `int4-native` / `int4-tiled`).
pub const LAYOUT: Int4Layout = if cfg!(feature = "int4-tiled") { Int4Layout::Tiled } else { Int4Layout::Native };

/// Sizes of one layer's routed experts.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ExpertsShape {
    /// Number of experts E.
    pub count: usize,
    /// Hidden size H (a multiple of 32).
    pub hidden: usize,
    /// Expert intermediate size I (a multiple of 32).
    pub inter: usize,
}

impl ExpertsShape {
    fn check(&self) -> Result<()> {
        if self.count == 0 || self.count > MAX_EXPERTS {
            return Err(Error::param("experts", self.count, format!("must be in 1..={MAX_EXPERTS}")));
        }
        for (name, v) in [("hidden", self.hidden), ("inter", self.inter)] {
            if v == 0 || !v.is_multiple_of(GROUP) {
                return Err(Error::param(name, v, format!("must be a positive multiple of {GROUP}")));
            }
        }
        Ok(())
    }

    /// Bytes of one expert's weights (packed values and scales of gate, up and down).
    pub fn bytes_per_expert(&self) -> usize {
        let elems = 3 * self.hidden * self.inter;
        elems / 2 + elems / GROUP * 2
    }
}

/// One INT4 matrix `[rows, cols]` on the device, in [`LAYOUT`].
pub struct DeviceInt4 {
    packed: CudaSlice<i32>,
    scale: CudaSlice<bf16>,
    rows: usize,
    cols: usize,
}

impl DeviceInt4 {
    /// Takes a matrix in the checkpoint order already on the device and brings it into [`LAYOUT`].
    pub fn from_native(
        gpu: &Gpu,
        packed: CudaSlice<i32>,
        scale: CudaSlice<bf16>,
        rows: usize,
        cols: usize,
    ) -> Result<Self> {
        if cols == 0 || !cols.is_multiple_of(GROUP) || !rows.is_multiple_of(TILE_ROWS) {
            return Err(Error::param(
                "INT4 matrix",
                format!("[{rows}, {cols}]"),
                format!("needs rows a multiple of {TILE_ROWS} and cols a positive multiple of {GROUP}"),
            ));
        }
        check_len("packed", packed.len(), &[("rows", rows), ("cols/8", cols / PACK)])?;
        // The kernels compute row indices in 32 bits.
        to_i32("packed words", packed.len())?;
        check_len("scale", scale.len(), &[("rows", rows), ("cols/32", cols / GROUP)])?;
        let native = DeviceInt4 { packed, scale, rows, cols };
        match LAYOUT {
            Int4Layout::Native => Ok(native),
            Int4Layout::Tiled => native.tiled(gpu),
        }
    }

    fn tiled(&self, gpu: &Gpu) -> Result<Self> {
        let (words, scales) = tiled_len(self.rows, self.cols);
        let mut out =
            DeviceInt4 { packed: gpu.zeros(words)?, scale: gpu.zeros(scales)?, rows: self.rows, cols: self.cols };
        let (rows, cols) = (to_i32("rows", self.rows)?, to_i32("cols", self.cols)?);
        let mut b = gpu.stream().launch_builder(&gpu.kernels.int4_tile);
        b.arg(&self.packed).arg(&self.scale).arg(&rows).arg(&cols).arg(&mut out.packed).arg(&mut out.scale);
        // One thread per (tile, chunk, lane).
        unsafe { b.launch(grid_stride_config(words / 8)) }.map_err(|e| cuda_err("int4_tile", e))?;
        gpu.after_launch("int4_tile")?;
        Ok(out)
    }

    /// The packed words and scales as stored on the device (in [`LAYOUT`]).
    pub fn download(&self, gpu: &Gpu) -> Result<(Vec<i32>, Vec<bf16>)> {
        Ok((gpu.download(&self.packed)?, gpu.download(&self.scale)?))
    }
}

/// Random INT4 weights in the checkpoint order, generated on the device (for benchmarks): uniform
/// nibbles, scales uniform in `[scale_lo, scale_hi)`.
pub fn random_native(
    gpu: &Gpu,
    rows: usize,
    cols: usize,
    seed: u64,
    (scale_lo, scale_hi): (f32, f32),
) -> Result<(CudaSlice<i32>, CudaSlice<bf16>)> {
    if cols == 0 || !cols.is_multiple_of(GROUP) {
        return Err(Error::param("cols", cols, format!("must be a positive multiple of {GROUP}")));
    }
    let words = rows.checked_mul(cols / PACK).ok_or_else(|| Error::param("rows", rows, "size overflows"))?;
    let groups = rows * (cols / GROUP);
    let mut packed = gpu.zeros::<i32>(words)?;
    let mut scale = gpu.zeros::<bf16>(groups)?;
    let (words64, groups64) = (words as u64, groups as u64);
    let mut b = gpu.stream().launch_builder(&gpu.kernels.int4_fill_random);
    b.arg(&mut packed).arg(&words64).arg(&mut scale).arg(&groups64).arg(&seed).arg(&scale_lo).arg(&scale_hi);
    unsafe { b.launch(grid_stride_config(words.max(groups))) }.map_err(|e| cuda_err("int4_fill_random", e))?;
    gpu.after_launch("int4_fill_random")?;
    Ok((packed, scale))
}

/// Dequantizes checkpoint-order INT4 weights to bf16 (each value rounded once), e.g. for a cuBLAS
/// baseline.
pub fn dequantize_native(gpu: &Gpu, packed: &CudaSlice<i32>, scale: &CudaSlice<bf16>) -> Result<CudaSlice<bf16>> {
    check_len("scale", scale.len() * 4, &[("packed words", packed.len())])?;
    let mut out = gpu.zeros::<bf16>(packed.len() * PACK)?;
    let words = packed.len() as u64;
    let mut b = gpu.stream().launch_builder(&gpu.kernels.int4_dequant_bf16);
    b.arg(packed).arg(scale).arg(&words).arg(&mut out);
    unsafe { b.launch(grid_stride_config(packed.len())) }.map_err(|e| cuda_err("int4_dequant_bf16", e))?;
    gpu.after_launch("int4_dequant_bf16")?;
    Ok(out)
}

fn grid_stride_config(items: usize) -> LaunchConfig {
    let blocks = items.div_ceil(256).clamp(1, 65536) as u32;
    LaunchConfig { grid_dim: (blocks, 1, 1), block_dim: (256, 1, 1), shared_mem_bytes: 0 }
}

/// One layer's routed experts on the device: `w13 [E * 2I, H]` (gate rows then up rows per expert) and
/// `w2 [E * H, I]`.
pub struct DeviceExperts {
    /// The sizes.
    pub shape: ExpertsShape,
    w13: DeviceInt4,
    w2: DeviceInt4,
}

impl DeviceExperts {
    /// Uploads host experts (checkpoint order) and brings them into [`LAYOUT`].
    pub fn upload(gpu: &Gpu, experts: &Experts) -> Result<Self> {
        experts.check()?;
        let shape = ExpertsShape { count: experts.count, hidden: experts.hidden, inter: experts.inter };
        let w13 = DeviceInt4::from_native(
            gpu,
            gpu.upload(experts.w13.packed)?,
            gpu.upload(experts.w13.scale)?,
            experts.w13.rows,
            experts.w13.cols,
        )?;
        let w2 = DeviceInt4::from_native(
            gpu,
            gpu.upload(experts.w2.packed)?,
            gpu.upload(experts.w2.scale)?,
            experts.w2.rows,
            experts.w2.cols,
        )?;
        Self::new(shape, w13, w2)
    }

    /// Assembles experts from device matrices, checking their shapes against `shape`.
    pub fn new(shape: ExpertsShape, w13: DeviceInt4, w2: DeviceInt4) -> Result<Self> {
        shape.check()?;
        if (w13.rows, w13.cols) != (shape.count * 2 * shape.inter, shape.hidden) {
            return Err(Error::param("w13", format!("[{}, {}]", w13.rows, w13.cols), "must be [E * 2I, H]"));
        }
        if (w2.rows, w2.cols) != (shape.count * shape.hidden, shape.inter) {
            return Err(Error::param("w2", format!("[{}, {}]", w2.rows, w2.cols), "must be [E * H, I]"));
        }
        Ok(DeviceExperts { shape, w13, w2 })
    }
}

/// Routing, alignment and intermediate buffers for up to `max_tokens` tokens and top-`k` routing.
pub struct MoePlan {
    shape: ExpertsShape,
    /// Where the plan's experts sit among the routing's (an expert-parallel share, or all of them).
    share: ExpertShare,
    k: usize,
    max_tokens: usize,
    /// Tokens of the routing currently held (0 before the first `route` / `set_routing`).
    tokens: usize,
    /// An upper bound on any expert's pair count for the current routing (picks the GEMM kernels).
    max_per_expert: usize,
    topk_ids: CudaSlice<i32>,
    topk_weights: CudaSlice<f32>,
    expert_offsets: CudaSlice<i32>,
    sorted_pairs: CudaSlice<i32>,
    /// Per active expert, in increasing id, its id, first sorted pair, pair count and the token of its first
    /// pair: the 16 bytes a GEMM block loads to find its work.
    active_slices: CudaSlice<i32>,
    /// The narrow gate/up GEMM's per-expert done counts and the narrow down GEMM's counts of blocks past
    /// them (kernels/moe_int4.cu rule H): 2 × MAX_EXPERTS, zero between forwards.
    handoff: CudaSlice<i32>,
    num_active: CudaSlice<i32>,
    status: CudaSlice<i32>,
    /// The native layout's gate/up input: x with each 8 elements in the order 0 4 1 5 2 6 3 7
    /// (kernels/moe_int4.cu moe_pair_acts); empty for the tiled layout, whose GEMMs read x as it is.
    x_pairs: CudaSlice<bf16>,
    h: CudaSlice<bf16>,
    y: CudaSlice<f32>,
}

impl MoePlan {
    /// Allocates every buffer once for `max_tokens` tokens of top-`k` routing over `shape`'s experts.
    pub fn new(gpu: &Gpu, shape: ExpertsShape, k: usize, max_tokens: usize) -> Result<Self> {
        Self::new_share(gpu, shape, ExpertShare { first: 0, total: shape.count }, k, max_tokens)
    }

    /// Like [`MoePlan::new`] for experts `share.first ..` of a routing over `share.total` experts (an
    /// expert-parallel share): its output leaves out the pairs routed to the others, as
    /// [`crate::cpu::moe_int4::moe_int4_share`].
    pub fn new_share(gpu: &Gpu, shape: ExpertsShape, share: ExpertShare, k: usize, max_tokens: usize) -> Result<Self> {
        shape.check()?;
        share.check(shape.count)?;
        if share.total > MAX_EXPERTS {
            return Err(Error::param("experts", share.total, format!("the routing takes at most {MAX_EXPERTS}")));
        }
        if k == 0 || k > share.total.min(MAX_TOP_K) {
            return Err(Error::param("k", k, format!("top-k must be in 1..={}", share.total.min(MAX_TOP_K))));
        }
        if max_tokens == 0 {
            return Err(Error::param("max_tokens", 0, "must be at least 1"));
        }
        // The combine's grid has one row of blocks per token.
        if max_tokens > MAX_TOKENS {
            return Err(Error::param("max_tokens", max_tokens, format!("must be at most {MAX_TOKENS}")));
        }
        let pairs = max_tokens * k;
        let elems = pairs
            .checked_mul(shape.hidden.max(shape.inter))
            .ok_or_else(|| Error::param("max_tokens", max_tokens, "the plan's buffer sizes overflow"))?;
        to_i32("max_tokens * k * max(H, I)", elems)?;
        Ok(MoePlan {
            shape,
            share,
            k,
            max_tokens,
            tokens: 0,
            max_per_expert: 0,
            topk_ids: gpu.zeros(pairs)?,
            topk_weights: gpu.zeros(pairs)?,
            expert_offsets: gpu.zeros(shape.count + 1)?,
            sorted_pairs: gpu.zeros(pairs)?,
            active_slices: gpu.zeros(4 * shape.count)?,
            handoff: gpu.zeros(2 * MAX_EXPERTS)?,
            num_active: gpu.zeros(1)?,
            status: gpu.zeros(1)?,
            x_pairs: gpu.zeros(if LAYOUT == Int4Layout::Native { max_tokens * shape.hidden } else { 1 })?,
            h: gpu.zeros(pairs * shape.inter)?,
            y: gpu.zeros(pairs * shape.hidden)?,
        })
    }

    fn check_tokens(&self, tokens: usize) -> Result<()> {
        if tokens == 0 || tokens > self.max_tokens {
            return Err(Error::param("tokens", tokens, format!("must be in 1..={} (the plan's)", self.max_tokens)));
        }
        Ok(())
    }

    /// Queues the routing of `router_logits [tokens, E]` with the correction `bias [E]` and the
    /// alignment by expert. Non-finite logits set the status that [`MoePlan::check_status`] reports.
    pub fn route(
        &mut self,
        gpu: &Gpu,
        router_logits: &CudaView<f32>,
        bias: &CudaView<f32>,
        scaling: f64,
        tokens: usize,
    ) -> Result<()> {
        self.check_tokens(tokens)?;
        check_len("router_logits", router_logits.len(), &[("T", tokens), ("E", self.share.total)])?;
        check_len("bias", bias.len(), &[("E", self.share.total)])?;
        if !scaling.is_finite() {
            return Err(Error::param("routed_scaling_factor", scaling, "must be finite"));
        }
        self.launch_route_align(gpu, Some((router_logits, bias)), scaling, tokens)?;
        // Routing picks k distinct experts per token, so no expert gets more than one pair per token.
        self.max_per_expert = tokens;
        Ok(())
    }

    /// Takes a routing computed elsewhere (`topk_ids`, `topk_weights`, both `[tokens, k]`) and queues its
    /// alignment. Expert ids out of range set the status that [`MoePlan::check_status`] reports.
    pub fn set_routing(
        &mut self,
        gpu: &Gpu,
        topk_ids: &CudaView<i32>,
        topk_weights: &CudaView<f32>,
        tokens: usize,
    ) -> Result<()> {
        self.check_tokens(tokens)?;
        check_len("topk_ids", topk_ids.len(), &[("T", tokens), ("k", self.k)])?;
        check_len("topk_weights", topk_weights.len(), &[("T", tokens), ("k", self.k)])?;
        let pairs = tokens * self.k;
        let stream = gpu.stream();
        stream
            .memcpy_dtod(topk_ids, &mut self.topk_ids.slice_mut(..pairs))
            .map_err(|e| cuda_err("copy topk_ids", e))?;
        stream
            .memcpy_dtod(topk_weights, &mut self.topk_weights.slice_mut(..pairs))
            .map_err(|e| cuda_err("copy topk_weights", e))?;
        self.launch_route_align(gpu, None, 0.0, tokens)?;
        self.max_per_expert = pairs;
        Ok(())
    }

    fn launch_route_align(
        &mut self,
        gpu: &Gpu,
        logits: Option<(&CudaView<f32>, &CudaView<f32>)>,
        scaling: f64,
        tokens: usize,
    ) -> Result<()> {
        let stream = gpu.stream();
        stream.memset_zeros(&mut self.status).map_err(|e| cuda_err("memset status", e))?;
        let (t, e, k) = (tokens as i32, self.shape.count as i32, self.k as i32);
        // Only a routing of this plan's own names -1 for another share's expert.
        let skip_others = i32::from(logits.is_some());
        if let Some((l, bias)) = logits {
            let cfg =
                LaunchConfig { grid_dim: (tokens as u32, 1, 1), block_dim: (ROUTE_THREADS, 1, 1), shared_mem_bytes: 0 };
            let (total, first, held) = (self.share.total as i32, self.share.first as i32, e);
            let mut b = stream.launch_builder(&gpu.kernels.moe_route);
            b.arg(l).arg(bias).arg(&scaling).arg(&total).arg(&k).arg(&first).arg(&held);
            b.arg(&mut self.topk_ids).arg(&mut self.topk_weights).arg(&mut self.status);
            unsafe { b.launch(cfg) }.map_err(|e| cuda_err("moe_route", e))?;
            gpu.after_launch("moe_route")?;
        }
        let cfg = LaunchConfig { grid_dim: (1, 1, 1), block_dim: (ALIGN_THREADS, 1, 1), shared_mem_bytes: 0 };
        let mut a = KernelArgs::new(gpu);
        a.ptr(&self.topk_ids).val(t).val(e).val(k).val(skip_others);
        a.ptr_mut(&mut self.expert_offsets).ptr_mut(&mut self.sorted_pairs);
        a.ptr_mut(&mut self.active_slices).ptr_mut(&mut self.num_active);
        a.ptr_mut(&mut self.status);
        // Dependent launch only right behind the routing kernel (after the copies of set_routing there is
        // no kernel to overlap).
        gpu.launch_ex("moe_align", &gpu.kernels.moe_align, cfg, &mut a, logits.is_some())?;
        self.tokens = tokens;
        Ok(())
    }

    /// Queues the routed-experts output `out [tokens, H]` (f32) of `x [tokens, H]` (bf16, 16-byte aligned:
    /// the kernels read it in 16-byte vectors) for the routing held by the plan: gate/up GEMM with SiLU,
    /// down GEMM, and the weighted combine in slot order. After a routing that set the status (see
    /// [`MoePlan::check_status`]) no expert runs and `out` holds no valid result.
    pub fn experts_forward(
        &mut self,
        gpu: &Gpu,
        experts: &DeviceExperts,
        x: &CudaView<bf16>,
        out: &mut CudaViewMut<f32>,
    ) -> Result<()> {
        if experts.shape != self.shape {
            return Err(Error::param("experts", format!("{:?}", experts.shape), "differ from the plan's shape"));
        }
        if self.tokens == 0 {
            return Err(Error::param("tokens", 0, "route or set a routing before experts_forward"));
        }
        let (tokens, h_dim) = (self.tokens, self.shape.hidden);
        check_len("x", x.len(), &[("T", tokens), ("H", h_dim)])?;
        check_len("out", out.len(), &[("T", tokens), ("H", h_dim)])?;
        check_aligned("x", x.device_ptr(gpu.stream()).0, 16)?;
        // A block per active expert, or with one token per routing slot (an expert-parallel share may
        // hold fewer experts than k, its own in any of the slots).
        let blocks = if self.direct() { self.k } else { self.shape.count.min(tokens * self.k) } as u32;
        if LAYOUT == Int4Layout::Native {
            self.pair_acts(gpu, x)?;
        }
        // With one token each routing slot is one expert with one pair, so only the narrow GEMMs run.
        let widths: &[bool] =
            if self.max_per_expert > NARROW_TOKENS && !self.direct() { &[false, true] } else { &[false] };
        // The narrow gate/up GEMM goes last and the narrow down GEMM right after it, so that the down GEMM
        // stages its first weights during the gate/up GEMM's tail: at a few tokens the wide kernels have
        // few or no experts, and one between them would hold the down GEMM back until the gate/up GEMM
        // completes. The kernels serve disjoint experts, so the order changes no result.
        let launched = widths.iter().rev().try_for_each(|&wide| self.launch_gate_up(gpu, experts, x, blocks, wide));
        let launched =
            launched.and_then(|()| widths.iter().try_for_each(|&wide| self.launch_down(gpu, experts, blocks, wide)));
        if launched.is_err() {
            // A narrow gate/up GEMM without its down GEMM would leave its per-expert counts set, and the
            // next forward's down GEMM would read h before it is written: clear them (should that fail
            // too, the launch error below is still the one to report).
            let _ = gpu.stream().memset_zeros(&mut self.handoff);
        }
        launched?;
        let (h, k) = (h_dim as i32, self.k as i32);
        let cfg = LaunchConfig {
            grid_dim: (h_dim.div_ceil(256) as u32, tokens as u32, 1),
            block_dim: (256, 1, 1),
            shared_mem_bytes: 0,
        };
        let mut a = KernelArgs::new(gpu);
        a.ptr(&self.y).ptr(&self.topk_weights).ptr(&self.topk_ids).val(h).val(k).ptr_mut(out);
        gpu.launch_ex("moe_combine", &gpu.kernels.moe_combine, cfg, &mut a, true)
    }

    /// Queues `x_pairs` = `x` in the native GEMMs' activation order.
    fn pair_acts(&mut self, gpu: &Gpu, x: &CudaView<bf16>) -> Result<()> {
        let pieces = self.tokens * self.shape.hidden / 8;
        let cfg =
            LaunchConfig { grid_dim: (pieces.div_ceil(256) as u32, 1, 1), block_dim: (256, 1, 1), shared_mem_bytes: 0 };
        let mut a = KernelArgs::new(gpu);
        a.ptr(x).val(pieces as i32).ptr_mut(&mut self.x_pairs);
        gpu.launch_ex("moe_pair_acts", &gpu.kernels.moe_pair_acts, cfg, &mut a, true)
    }

    fn launch_gate_up(
        &mut self,
        gpu: &Gpu,
        experts: &DeviceExperts,
        x: &CudaView<bf16>,
        blocks: u32,
        wide: bool,
    ) -> Result<()> {
        let direct = self.direct();
        let (name, f) = if direct { gpu.kernels.moe_gate_up_direct() } else { gpu.kernels.moe_gate_up(wide) };
        let (h, i, k) = (self.shape.hidden as i32, self.shape.inter as i32, self.k as i32);
        // The one-token kernel has the narrow kernel's geometry, its shared memory too (the native narrow
        // kernel's is that of its one-token path).
        let (grid_rows, threads, shared) = gemm_geometry(self.shape.inter, GATE_UP_GROUP_ROWS, false, wide);
        let cfg =
            LaunchConfig { grid_dim: (grid_rows, blocks, 1), block_dim: (threads, 1, 1), shared_mem_bytes: shared };
        let mut a = KernelArgs::new(gpu);
        if LAYOUT == Int4Layout::Native {
            a.ptr(&self.x_pairs);
        } else {
            a.ptr(x);
        }
        a.ptr(&experts.w13.packed).ptr(&experts.w13.scale).val(h).val(i);
        if direct {
            a.ptr(&self.topk_ids).val(self.shape.count as i32);
        } else {
            a.val(k).ptr(&self.active_slices).ptr(&self.num_active).ptr(&self.sorted_pairs);
        }
        a.ptr_mut(&mut self.h).ptr_mut(&mut self.handoff);
        gpu.launch_ex(name, f, cfg, &mut a, true)
    }

    /// Whether the GEMMs take their experts straight from the routing (one token: each slot is one expert
    /// with one pair; kernels/moe_int4.cu direct_expert), so that the gate/up GEMM stages its first
    /// weights before the alignment has completed.
    fn direct(&self) -> bool {
        self.tokens == 1
    }

    /// Where the down GEMM's blocks find their experts (kernels/moe_int4.cu BlockRouting): the alignment's
    /// active slices, or with one token the routing's slots (see [`MoePlan::direct`]).
    fn routing_args(&self, a: &mut KernelArgs<'_>) {
        let direct = i32::from(self.direct());
        a.ptr(&self.active_slices).ptr(&self.num_active).ptr(&self.topk_ids);
        a.val(self.shape.count as i32).val(direct);
    }

    /// The down GEMM: with one token the layout's one-token kernel where it has one (the native layout:
    /// kernels/moe_int4.cu down_direct_kernel), else the narrow or wide kernel.
    fn launch_down(&mut self, gpu: &Gpu, experts: &DeviceExperts, blocks: u32, wide: bool) -> Result<()> {
        let direct_kernel = if self.direct() { gpu.kernels.moe_down_direct() } else { None };
        let direct = direct_kernel.is_some();
        let (name, f) = direct_kernel.unwrap_or_else(|| gpu.kernels.moe_down(wide));
        let (h, i) = (self.shape.hidden as i32, self.shape.inter as i32);
        let (grid_rows, threads, mut shared) = gemm_geometry(self.shape.hidden, DOWN_GROUP_ROWS, true, wide);
        if direct {
            shared = direct_down_shared_bytes() as u32;
        }
        let cfg =
            LaunchConfig { grid_dim: (grid_rows, blocks, 1), block_dim: (threads, 1, 1), shared_mem_bytes: shared };
        let mut a = KernelArgs::new(gpu);
        a.ptr(&self.h).ptr(&experts.w2.packed).ptr(&experts.w2.scale).val(h).val(i);
        if direct {
            a.ptr(&self.topk_ids).val(self.shape.count as i32);
        } else {
            self.routing_args(&mut a);
            a.ptr(&self.sorted_pairs);
        }
        a.ptr_mut(&mut self.y).ptr_mut(&mut self.handoff);
        gpu.launch_ex(name, f, cfg, &mut a, true)
    }

    /// Reads the status of the last routing: an error naming non-finite router logits or expert ids out
    /// of range (synchronizes).
    pub fn check_status(&self, gpu: &Gpu) -> Result<()> {
        self.status_error(gpu.download(&self.status)?[0])
    }

    /// The status word of the last routing, for a caller that gathers several status words in one read.
    pub fn status_word(&self) -> CudaView<'_, i32> {
        self.status.slice(0..1)
    }

    /// The error that the status bits `status` (of [`MoePlan::status_word`]) stand for, if any.
    pub fn status_error(&self, status: i32) -> Result<()> {
        if status & STATUS_BAD_LOGIT != 0 {
            return Err(Error::Logits { name: "router_logits / bias", row: 0, problem: "non-finite value" });
        }
        if status & STATUS_BAD_EXPERT != 0 {
            return Err(Error::Index {
                name: "topk_ids",
                detail: format!("an expert id is outside 0..{}", self.shape.count),
            });
        }
        Ok(())
    }

    /// The routing held by the plan, read back (synchronizes).
    pub fn routing(&self, gpu: &Gpu) -> Result<Routing> {
        let pairs = self.tokens * self.k;
        let take = |v: Vec<i32>, n: usize| v.into_iter().take(n).collect::<Vec<_>>();
        Ok(Routing {
            k: self.k,
            topk_ids: take(gpu.download(&self.topk_ids)?, pairs),
            topk_weights: gpu.download(&self.topk_weights)?.into_iter().take(pairs).collect(),
            expert_offsets: gpu.download(&self.expert_offsets)?,
            sorted_pairs: take(gpu.download(&self.sorted_pairs)?, pairs),
        })
    }

    /// The experts that received at least one pair in the current routing, in increasing id (synchronizes).
    pub fn active_experts(&self, gpu: &Gpu) -> Result<Vec<i32>> {
        let n = gpu.download(&self.num_active)?[0] as usize;
        Ok(gpu.download(&self.active_slices)?.chunks(4).take(n).map(|slice| slice[0]).collect())
    }
}

impl Gpu {
    /// Routing of host `router_logits [T, E]` on the device (see [`crate::cpu::moe_int4::route`]).
    pub fn moe_route(
        &self,
        router_logits: &[f32],
        bias: &[f32],
        experts: usize,
        k: usize,
        scaling: f64,
    ) -> Result<Routing> {
        if experts == 0 || !router_logits.len().is_multiple_of(experts) || router_logits.is_empty() {
            return Err(Error::shape("router_logits", format!("[T, E={experts}]"), experts, router_logits.len()));
        }
        let tokens = router_logits.len() / experts;
        let shape = ExpertsShape { count: experts, hidden: GROUP, inter: GROUP };
        let mut plan = MoePlan::new(self, shape, k, tokens)?;
        let (logits, bias) = (self.upload(router_logits)?, self.upload(bias)?);
        plan.route(self, &logits.as_view(), &bias.as_view(), scaling, tokens)?;
        plan.check_status(self)?;
        plan.routing(self)
    }

    /// The routed-experts output of host `x [T, H]` for a host routing, through the device (see
    /// [`crate::cpu::moe_int4::moe_int4`]).
    pub fn moe_int4(&self, x: &[bf16], routing: &Routing, experts: &Experts) -> Result<Vec<f32>> {
        let dev = DeviceExperts::upload(self, experts)?;
        self.moe_int4_on(x, routing, &dev)
    }

    /// Like [`Gpu::moe_int4`] with experts already on the device.
    pub fn moe_int4_on(&self, x: &[bf16], routing: &Routing, experts: &DeviceExperts) -> Result<Vec<f32>> {
        let h = experts.shape.hidden;
        if x.is_empty() || !x.len().is_multiple_of(h) {
            return Err(Error::shape("x", format!("[T, H={h}]"), h, x.len()));
        }
        let tokens = x.len() / h;
        let mut plan = MoePlan::new(self, experts.shape, routing.k, tokens)?;
        let (ids, weights) = (self.upload(&routing.topk_ids)?, self.upload(&routing.topk_weights)?);
        plan.set_routing(self, &ids.as_view(), &weights.as_view(), tokens)?;
        let x_dev = self.upload(x)?;
        let mut out = self.zeros::<f32>(tokens * h)?;
        plan.experts_forward(self, experts, &x_dev.as_view(), &mut out.as_view_mut())?;
        plan.check_status(self)?;
        self.download(&out)
    }
}
