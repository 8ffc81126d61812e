//! Launcher of kernels/gemm_bf16.cu: the fixed-order bf16 GEMM of the model's dense projections (see
//! [`crate::cpu::gemm_bf16`]).
//!
//! [`DeviceWeight`] holds `batch` bf16 matrices `[out, in]` (one linear layer, or one matrix per head). A
//! [`GemmPlan`] owns the scratch (the bf16 halves of x and the split-K partials) and only launches.
//! How K is split depends on the weight's shape alone ([`split_k`]), never on the token count, so a token's
//! output has the same bits in any batch.

use cudarc::driver::{CudaSlice, CudaView, CudaViewMut, DevicePtr, LaunchConfig, PushKernelArg};
use half::bf16;

use super::{check_aligned, cuda_err, to_i32, Gpu};
use crate::error::{check_len, Error, Result};

const THREADS: u32 = 256;
/// A tile shape of kernels/gemm_bf16.cu. All shapes run the same operations per output element, so the
/// choice by token count keeps batch invariance.
pub(crate) struct TileShape {
    /// The kernel's name in kernels/gemm_bf16.cu.
    pub(crate) name: &'static str,
    rows: usize,
    tokens: usize,
    k: usize,
    stages: usize,
}

impl TileShape {
    /// Dynamic shared memory: the ring of (W, x hi, x lo) tiles, rows padded by 8 bf16.
    const fn shared_bytes(&self) -> usize {
        self.stages * (self.rows + 2 * self.tokens) * (self.k + 8) * 2
    }
}

/// The shapes from fewest to most tokens; [`tile_for`] picks one per launch.
pub(crate) const SHAPES: [TileShape; 4] = [
    TileShape { name: "gemm_bf16_narrow", rows: 128, tokens: 16, k: 64, stages: 4 },
    TileShape { name: "gemm_bf16_medium", rows: 128, tokens: 32, k: 64, stages: 3 },
    TileShape { name: "gemm_bf16_wide", rows: 128, tokens: 64, k: 32, stages: 4 },
    TileShape { name: "gemm_bf16_tall", rows: 128, tokens: 128, k: 32, stages: 3 },
];
/// Split-K chunks are multiples of every shape's k per stage.
const CHUNK_ALIGN: usize = 64;
/// Dynamic shared memory of each kernel of [`SHAPES`], in order.
pub(crate) const SHARED_BYTES: [usize; SHAPES.len()] =
    [SHAPES[0].shared_bytes(), SHAPES[1].shared_bytes(), SHAPES[2].shared_bytes(), SHAPES[3].shared_bytes()];

/// The split-K aims at this many narrow CTAs (two per SM of a 132-SM GPU), so that a decode step streams
/// the weight with the whole GPU ...
const TARGET_CTAS: usize = 264;
/// ... without cutting K below this many values per chunk or into more chunks than this.
const MIN_CHUNK: usize = 256;
const MAX_SPLIT: usize = 16;
/// Activations and weights are staged in 16-byte pieces of 8 bf16: K and every stride must divide by 8.
const ALIGN: usize = 8;

/// `batch` bf16 matrices `[out, in]` on the device, back to back.
pub struct DeviceWeight {
    w: CudaSlice<bf16>,
    batch: usize,
    out: usize,
    inp: usize,
}

impl DeviceWeight {
    /// Uploads `w [batch, out, inp]`.
    pub fn upload(gpu: &Gpu, w: &[bf16], batch: usize, out: usize, inp: usize) -> Result<Self> {
        check_len("w", w.len(), &[("batch", batch), ("out", out), ("in", inp)])?;
        check_dims(batch, out, inp)?;
        Self::from_device(gpu.upload(w)?, batch, out, inp)
    }

    /// Takes `w [batch, out, inp]` already on the device (made on the `Gpu` that will run it).
    pub fn from_device(w: CudaSlice<bf16>, batch: usize, out: usize, inp: usize) -> Result<Self> {
        check_len("w", w.len(), &[("batch", batch), ("out", out), ("in", inp)])?;
        check_dims(batch, out, inp)?;
        Ok(DeviceWeight { w, batch, out, inp })
    }

    /// Matrices in the weight.
    pub fn batch(&self) -> usize {
        self.batch
    }

    /// Output features of each matrix.
    pub fn out_features(&self) -> usize {
        self.out
    }

    /// Input features of each matrix.
    pub fn in_features(&self) -> usize {
        self.inp
    }
}

/// Element strides of a `[batch, tokens, features]` operand that may live inside a larger tensor.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Strides {
    /// Between consecutive tokens.
    pub row: usize,
    /// Between consecutive batch entries (matrices of the weight).
    pub batch: usize,
}

impl Strides {
    /// A dense `[tokens, features]` operand of one matrix.
    pub fn dense(features: usize) -> Self {
        Strides { row: features, batch: 0 }
    }

    /// Elements from the first to one past the last element of `tokens` rows of `features` in `batch`
    /// entries.
    fn span(&self, batch: usize, tokens: usize, features: usize) -> usize {
        (batch - 1) * self.batch + (tokens - 1) * self.row + features
    }
}

/// The split of K for a weight: `(chunks, chunk length)`, chosen from its shape alone.
pub fn split_k(w: &DeviceWeight) -> (usize, usize) {
    let tiles = w.out.div_ceil(SHAPES[0].rows) * w.batch;
    let wanted = TARGET_CTAS.div_ceil(tiles).clamp(1, MAX_SPLIT).min(w.inp.div_ceil(MIN_CHUNK));
    let chunk = w.inp.div_ceil(wanted).div_ceil(CHUNK_ALIGN) * CHUNK_ALIGN;
    (w.inp.div_ceil(chunk), chunk)
}

/// Tokens up to which a launch takes Wide tiles: one Wide tile holds 33-64 tokens where Medium needs two
/// side by side, each staging the weight tile. Measured on the H200 at Kimi-K2's nine dense shapes
/// (notes/2026-12-02-verify-gemm.md, 2026-12-04): Wide was faster than Medium at 33 tokens on 7 of 9
/// (lm_head by 21%, the dense MLP by 6-11%; kv_a and o_proj 7% and 1% slower), slower at 65 on all nine
/// (two Wide tiles pad 65 to 128 tokens, three Medium ones to 96).
const WIDE_MAX_TOKENS: usize = 64;
/// Tokens up to which a launch takes Medium tiles, several token tiles side by side (the weight tile
/// comes from HBM once, then from L2), before Tall's 128-token tiles. Measured on the H200 at Kimi-K2's
/// nine dense shapes (notes/2026-12-02-verify-gemm.md): Medium was the fastest tile at 130 tokens on all
/// nine and at 33-65 on 16 of 18, Tall at 192 on 7 of 9 (by 1-16%) and at 260 and 520 on all.
const MEDIUM_MAX_TOKENS: usize = 160;

/// The index in [`SHAPES`] of the tile a launch of `tokens` tokens uses: Narrow up to its 16 tokens,
/// Medium up to Medium's 32, Wide up to [`WIDE_MAX_TOKENS`], Medium again up to [`MEDIUM_MAX_TOKENS`],
/// Tall beyond. Every tile gives the same bits, so the choice only moves time.
pub fn tile_for(tokens: usize) -> usize {
    if tokens <= SHAPES[0].tokens {
        0
    } else if tokens <= SHAPES[1].tokens || (WIDE_MAX_TOKENS < tokens && tokens <= MEDIUM_MAX_TOKENS) {
        1
    } else if tokens <= WIDE_MAX_TOKENS {
        2
    } else {
        3
    }
}

/// The names of the tile shapes, in [`tile_for`]'s numbering.
pub fn tile_names() -> [&'static str; SHAPES.len()] {
    SHAPES.map(|s| s.name)
}

/// Scratch of the GEMM: x split into bf16 hi and lo halves, and the split-K partial sums. Grows to the
/// largest call it has seen, so a warmed-up plan launches without allocating.
pub struct GemmPlan {
    hi: CudaSlice<bf16>,
    lo: CudaSlice<bf16>,
    part: CudaSlice<f32>,
    /// A tile every launch uses instead of [`tile_for`]'s (tests and benches comparing tiles).
    forced_tile: Option<usize>,
}

impl GemmPlan {
    /// Scratch sized for `tokens` tokens through each of `weights` (dense operands).
    pub fn new(gpu: &Gpu, tokens: usize, weights: &[&DeviceWeight]) -> Result<Self> {
        let mut plan = GemmPlan { hi: gpu.zeros(1)?, lo: gpu.zeros(1)?, part: gpu.zeros(1)?, forced_tile: None };
        for w in weights {
            plan.reserve(gpu, w, tokens * w.inp * w.batch, tokens)?;
        }
        Ok(plan)
    }

    /// Makes every later launch use tile `tile` (an index of [`tile_names`]), or [`tile_for`]'s choice
    /// again with `None`.
    pub fn force_tile(&mut self, tile: Option<usize>) -> Result<()> {
        if let Some(i) = tile.filter(|&i| i >= SHAPES.len()) {
            return Err(Error::param("tile", i, format!("must be below {} (the tile shapes)", SHAPES.len())));
        }
        self.forced_tile = tile;
        Ok(())
    }

    /// The scratch's sizes in elements; they change exactly when a run had to reallocate.
    pub fn footprint(&self) -> (usize, usize) {
        (self.hi.len(), self.part.len())
    }

    fn reserve(&mut self, gpu: &Gpu, w: &DeviceWeight, x_span: usize, tokens: usize) -> Result<()> {
        if self.hi.len() < x_span {
            self.hi = gpu.zeros(x_span)?;
            self.lo = gpu.zeros(x_span)?;
        }
        let (ksplit, _) = split_k(w);
        let part = if ksplit > 1 { w.batch * ksplit * tokens * w.out } else { 0 };
        if self.part.len() < part {
            self.part = gpu.zeros(part)?;
        }
        Ok(())
    }

    /// Queues `y[b][t][n] = Σ_k w[b][n][k] · x[b][t][k]` for `tokens` tokens, with the operands laid out by
    /// `xs` and `ys` (element strides; `x` and `y` start at batch 0, token 0).
    #[allow(clippy::too_many_arguments)]
    pub fn run(
        &mut self,
        gpu: &Gpu,
        w: &DeviceWeight,
        x: &CudaView<f32>,
        xs: Strides,
        tokens: usize,
        y: &mut CudaViewMut<f32>,
        ys: Strides,
    ) -> Result<()> {
        if tokens == 0 {
            return Err(Error::param("tokens", 0, "must be at least 1"));
        }
        check_strides("x", xs, w.batch, w.inp)?;
        check_strides("y", ys, w.batch, w.out)?;
        if !xs.row.is_multiple_of(ALIGN) || !xs.batch.is_multiple_of(ALIGN) {
            return Err(Error::param(
                "x strides",
                format!("{xs:?}"),
                format!("must divide by {ALIGN} (16-byte staging of bf16 activations)"),
            ));
        }
        let (x_span, y_span) = (xs.span(w.batch, tokens, w.inp), ys.span(w.batch, tokens, w.out));
        if x.len() < x_span {
            return Err(Error::shape(
                "x",
                format!("[batch={}, T={tokens}, in={}] {xs:?}", w.batch, w.inp),
                x_span,
                x.len(),
            ));
        }
        if y.len() < y_span {
            return Err(Error::shape(
                "y",
                format!("[batch={}, T={tokens}, out={}] {ys:?}", w.batch, w.out),
                y_span,
                y.len(),
            ));
        }
        let (ksplit, chunk) = split_k(w);
        let n_tiles = w.out.div_ceil(SHAPES.iter().map(|s| s.rows).min().unwrap_or(1));
        if n_tiles > 65_535 || w.batch * ksplit > 65_535 {
            return Err(Error::param("w", w.out, "too many output rows or matrices for one launch's grid"));
        }
        to_i32("tokens", tokens)?;
        self.reserve(gpu, w, x_span, tokens)?;
        self.split(gpu, x, x_span)?;
        self.gemm(gpu, w, xs, tokens, (ksplit, chunk), y, ys)?;
        if ksplit > 1 {
            self.reduce(gpu, w, tokens, ksplit, y, ys)?;
        }
        Ok(())
    }

    fn split(&mut self, gpu: &Gpu, x: &CudaView<f32>, n: usize) -> Result<()> {
        let cfg =
            LaunchConfig { grid_dim: (n.div_ceil(256) as u32, 1, 1), block_dim: (256, 1, 1), shared_mem_bytes: 0 };
        let n64 = n as i64;
        let mut launch = gpu.stream.launch_builder(&gpu.kernels.gemm_split_bf16);
        launch.arg(x).arg(&n64).arg(&mut self.hi).arg(&mut self.lo);
        unsafe { launch.launch(cfg) }.map_err(|e| cuda_err("gemm_split_bf16 launch", e))?;
        gpu.after_launch("gemm_split_bf16")
    }

    #[allow(clippy::too_many_arguments)]
    fn gemm(
        &mut self,
        gpu: &Gpu,
        w: &DeviceWeight,
        xs: Strides,
        tokens: usize,
        (ksplit, chunk): (usize, usize),
        y: &mut CudaViewMut<f32>,
        ys: Strides,
    ) -> Result<()> {
        let (hi_ptr, _g) = self.hi.device_ptr(&gpu.stream);
        check_aligned("x (bf16 halves)", hi_ptr, 16)?;
        let i = self.forced_tile.unwrap_or_else(|| tile_for(tokens));
        let (shape, kernel) = (&SHAPES[i], &gpu.kernels.gemm_bf16[i]);
        // Token tiles innermost: the CTAs that read one weight tile run side by side.
        let cfg = LaunchConfig {
            grid_dim: (
                tokens.div_ceil(shape.tokens) as u32,
                w.out.div_ceil(shape.rows) as u32,
                (w.batch * ksplit) as u32,
            ),
            block_dim: (THREADS, 1, 1),
            shared_mem_bytes: SHARED_BYTES[i] as u32,
        };
        let w_batch = (w.out * w.inp) as i64;
        let (x_row, x_batch, y_row, y_batch) = (xs.row as i64, xs.batch as i64, ys.row as i64, ys.batch as i64);
        let (n, t, k) = (w.out as i32, tokens as i32, w.inp as i32);
        let (ks, ch) = (ksplit as i32, chunk as i32);
        let mut launch = gpu.stream.launch_builder(kernel);
        launch
            .arg(&w.w)
            .arg(&w_batch)
            .arg(&self.hi)
            .arg(&self.lo)
            .arg(&x_row)
            .arg(&x_batch)
            .arg(&n)
            .arg(&t)
            .arg(&k)
            .arg(&ks)
            .arg(&ch)
            .arg(y)
            .arg(&y_row)
            .arg(&y_batch)
            .arg(&mut self.part);
        unsafe { launch.launch(cfg) }.map_err(|e| cuda_err(shape.name, e))?;
        gpu.after_launch(shape.name)
    }

    fn reduce(
        &mut self,
        gpu: &Gpu,
        w: &DeviceWeight,
        tokens: usize,
        ksplit: usize,
        y: &mut CudaViewMut<f32>,
        ys: Strides,
    ) -> Result<()> {
        let total = w.batch * tokens * w.out;
        let cfg =
            LaunchConfig { grid_dim: (total.div_ceil(256) as u32, 1, 1), block_dim: (256, 1, 1), shared_mem_bytes: 0 };
        let (b, ks, t, n) = (w.batch as i32, ksplit as i32, tokens as i32, w.out as i32);
        let (y_row, y_batch) = (ys.row as i64, ys.batch as i64);
        let mut launch = gpu.stream.launch_builder(&gpu.kernels.gemm_reduce);
        launch.arg(&self.part).arg(&b).arg(&ks).arg(&t).arg(&n).arg(y).arg(&y_row).arg(&y_batch);
        unsafe { launch.launch(cfg) }.map_err(|e| cuda_err("gemm_reduce launch", e))?;
        gpu.after_launch("gemm_reduce")
    }
}

fn check_dims(batch: usize, out: usize, inp: usize) -> Result<()> {
    if batch == 0 || out == 0 || inp == 0 {
        return Err(Error::param("w", format!("[{batch}, {out}, {inp}]"), "every dimension must be >= 1"));
    }
    if !inp.is_multiple_of(ALIGN) {
        return Err(Error::param("in", inp, format!("the bf16 GEMM needs in features divisible by {ALIGN}")));
    }
    to_i32("out", out)?;
    to_i32("in", inp)?;
    Ok(())
}

/// An operand's rows must hold its features, and batch entries must not overlap.
fn check_strides(name: &'static str, s: Strides, batch: usize, features: usize) -> Result<()> {
    if s.row < features || (batch > 1 && s.batch < features) {
        return Err(Error::param(name, format!("{s:?}"), format!("strides too small for {features} features per row")));
    }
    Ok(())
}

impl Gpu {
    /// `x [T, k] · w[n, k]ᵀ` from and to the host, through the device (see
    /// [`crate::cpu::gemm_bf16::gemm_bf16`]).
    pub fn gemm_bf16(&self, w: &[bf16], n: usize, k: usize, x: &[f32]) -> Result<Vec<f32>> {
        let weight = DeviceWeight::upload(self, w, 1, n, k)?;
        self.gemm_bf16_on(&weight, x)
    }

    /// Like [`Gpu::gemm_bf16`] with the weight (one matrix) already on the device.
    pub fn gemm_bf16_on(&self, w: &DeviceWeight, x: &[f32]) -> Result<Vec<f32>> {
        let (n, k) = (w.out, w.inp);
        if w.batch != 1 {
            return Err(Error::param("w", w.batch, "expected a single matrix (batch 1)"));
        }
        if x.is_empty() || !x.len().is_multiple_of(k) {
            return Err(Error::shape("x", format!("[T, K={k}]"), k, x.len()));
        }
        let tokens = x.len() / k;
        let mut plan = GemmPlan::new(self, tokens, &[w])?;
        let x_dev = self.upload(x)?;
        let mut y = self.zeros::<f32>(tokens * n)?;
        plan.run(self, w, &x_dev.as_view(), Strides::dense(k), tokens, &mut y.as_view_mut(), Strides::dense(n))?;
        self.download(&y)
    }
}
