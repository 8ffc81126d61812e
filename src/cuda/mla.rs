//! Launcher of kernels/mla.cu: MLA absorbed attention, `mla_decode` and `tree_verify` (see
//! [`crate::cpu::mla`]; the schedule is described at the top of the .cu file).
//!
//! An [`MlaPlan`] owns the split-KV scratch (one partial output, max and sum per query row and chunk of
//! [`SPLIT`] rows) for a maximum shape; its `run_*` methods only queue kernels, with grids sized from the
//! run's `max_seq_len`. Decode is two launches (chunks, combine); tree verify three (the chunks inside
//! the prefix for all N×H rows of a request, the per-row tail chunks, combine). Large launches fold
//! groups of `FOLD` (4) chunks inside a CTA and write one partial per group, and launches of one wave of
//! chunk pairs run two chunks a CTA (same bits either way; see `chunk_runs`).
//! No memset either: the first chunk launch clears the status word, and the combine moves the chunk
//! launches' bits into it.

use cudarc::driver::{CudaSlice, CudaView, CudaViewMut, DevicePtr, LaunchConfig, PushKernelArg};
use half::bf16;

use super::{check_aligned, cuda_err, to_i32, Gpu};
use crate::cpu::mla::{
    check_decode_inputs, check_shapes, check_tree_inputs, check_visibility_len, MlaOutput, PagedCache, LATENT, ROW,
    SPLIT,
};
use crate::error::{check_len, Error, Result};
use crate::types::KvLayout;

/// Threads of `mla_chunk` (kernels/mla.cu THREADS).
const CHUNK_THREADS: u32 = 256;
/// Query rows per `mla_chunk` CTA (kernels/mla.cu BM).
const TILE_ROWS: usize = 16;
/// Threads of `mla_combine` (kernels/mla.cu COMBINE_THREADS).
const COMBINE_THREADS: u32 = 128;
/// Threads of `mla_combine_rows` (kernels/mla.cu ROWS_THREADS): four output dims each.
const ROWS_COMBINE_THREADS: u32 = 128;
/// Runs of fewer query rows combine with `mla_combine`, larger ones with `mla_combine_rows`. Measured
/// on the H200 (session 9, same chunk kernel): the sliced kernel is faster up to 128 rows (H 8 bs 1
/// prefix 65536: 32.5 µs against 58.8 µs), the two are within 1% at 256 and the plain one is faster from
/// 512 (H 64 bs 64 prefix 65536: 5.72 ms against 6.03 ms; tree verify bs 8, 4160 rows: 398.5 µs against
/// 467.8 µs).
const SLICED_COMBINE_MAX_ROWS: usize = 256;
/// `mla_combine` splits each row's 512 output dims over this many CTAs at least (kernels/mla.cu: a power
/// of two in 4..=32, so that a CTA holds 16 to 128 dims, one per thread) ...
const MIN_COMBINE_SLICES: usize = 4;
/// ... and at most this many.
const MAX_COMBINE_SLICES: usize = 32;
/// The combine aims at this many CTAs (about four per SM of a 132-SM GPU, with its 40 KB of shared
/// memory five fit), so that a small batch's partials are pulled by every SM instead of one CTA per row.
const COMBINE_CTAS: usize = 512;
/// Chunk slots of the tail launch: the chunks holding tree rows start at `seq_len / SPLIT` and span at
/// most two, since `SPLIT - 1 + N <= 2 * SPLIT` for N up to [`MAX_TREE_ROWS`].
const TAIL_CHUNKS: u32 = 2;
/// Largest N (tree rows per request) `tree_verify` takes: budget 256 plus the root.
pub const MAX_TREE_ROWS: usize = SPLIT + 1;

/// Dynamic shared memory of `mla_chunk` (kernels/mla.cu `struct Smem`): 2 stages of 32 unpadded key
/// rows, the four S partial tiles (16 rows of 32 floats), P as bf16 hi and lo (16 rows of 40), the
/// rescale and fold factors and the key offsets of two chunks (this one and the CTA's next): 88768
/// bytes, two CTAs per H200 SM and under the 99 KB a block may take on sm_120.
pub(crate) const CHUNK_SHARED_BYTES: usize =
    2 * 32 * ROW * 2 + 4 * 16 * 32 * 4 + 2 * 16 * 40 * 2 + 3 * 16 * 4 + 2 * SPLIT * 8;
/// Chunks per fold group (kernels/mla.cu FOLD).
const FOLD: usize = 4;
/// `mla_chunk` CTAs resident at once on an H200: 132 SMs, two CTAs each (launch bounds and shared memory).
const CHUNK_SLOTS: usize = 264;
/// Cost of a last, partial wave of chunk CTAs, in chunk times of a full wave, however few CTAs it has:
/// one CTA alone takes about 15 µs (the latency chain of its 8 sub-tiles) against about 21.7 µs per chunk
/// in a full, memory-bound wave (H8 bs 64 prefix 65536: 16384 chunks in 1.35 ms). Measured in session 9;
/// the shorter per-sub-tile chain since then should lower the lone CTA's time, so re-measure.
const PARTIAL_WAVE: f64 = 0.7;
/// The fewest folded CTAs a launch folds into: 90% of [`CHUNK_SLOTS`], rounded up (see [`folds`]).
const MIN_FOLDED_CTAS: usize = (CHUNK_SLOTS * 9).div_ceil(10);
/// Cache bytes a chunk reads: [`SPLIT`] rows of 576 bf16.
const CHUNK_BYTES: usize = SPLIT * ROW * 2;
/// Bytes of one query row's partial output and (max, sum).
const PARTIAL_BYTES: usize = (LATENT + 2) * 4;

/// Kernel modes (kernels/mla.cu MODE_*).
const MODE_DECODE: i32 = 0;
const MODE_PREFIX: i32 = 1;
const MODE_TAIL: i32 = 2;

/// Status bits (kernels/mla.cu STATUS_*).
const STATUS_BAD_PAGE: i32 = 1;
const STATUS_TOO_LONG: i32 = 2;

/// One layer's paged latent cache on the device: `[num_pages, page_size, 576]` bf16 rows and
/// `[bs, pages_per_req]` block tables, as [`PagedCache`] on the host.
#[derive(Debug)]
pub struct DeviceCache<'a> {
    /// The cache rows (16-byte aligned).
    pub rows: CudaView<'a, bf16>,
    /// Page geometry (`layers` 1, `row_elems` 576).
    pub layout: KvLayout,
    /// `[bs, pages_per_req]` page ids.
    pub block_table: CudaView<'a, i32>,
}

/// Device outputs of one run: `o [rows, 512]` and `lse [rows]` f32, `rows = bs * N * H` (N = 1 for a
/// decode). Views, so that they can be parts of larger buffers.
#[derive(Debug)]
pub struct DeviceMlaOutput<'a> {
    /// Latent outputs (16-byte aligned).
    pub o: CudaViewMut<'a, f32>,
    /// logsumexp per row and head.
    pub lse: CudaViewMut<'a, f32>,
}

/// Split-KV scratch for up to `max_bs` requests of `heads` heads, `max_rows` query rows per request
/// (1 for decode, N for tree verify) and sequences of up to `max_seq_len` visible rows (prefix plus
/// tree rows). Partial outputs take `max_bs * max_rows * heads * ceil(max_seq_len / 256) * 2 KiB`.
pub struct MlaPlan {
    max_bs: usize,
    heads: usize,
    max_rows: usize,
    max_seq_len: usize,
    max_chunks: usize,
    part_o: CudaSlice<f32>,
    part_ml: CudaSlice<f32>,
    /// `[run's status word, chunk launches' bits]`: the first chunk launch of a run clears word 0, the
    /// chunk launches OR their bits into word 1, and the combine ORs word 1 into word 0 and clears it.
    status: CudaSlice<i32>,
    /// A run queued its chunk launches but not its combine (a launch failed), so word 1 of `status` may
    /// hold stale bits: the next run clears both words first.
    status_dirty: bool,
}

impl MlaPlan {
    /// Allocates the scratch; `heads` must be one of [`crate::cpu::mla::SUPPORTED_HEADS`].
    pub fn new(gpu: &Gpu, max_bs: usize, heads: usize, max_seq_len: usize, max_rows: usize) -> Result<Self> {
        check_shapes(0, 0, 1, heads, &plan_layout(), 0, 0, 1.0)?;
        if max_bs == 0 || max_seq_len == 0 || max_rows == 0 || max_rows > MAX_TREE_ROWS {
            return Err(Error::param(
                "MlaPlan",
                format!("max_bs {max_bs}, max_seq_len {max_seq_len}, max_rows {max_rows}"),
                format!("every maximum must be >= 1 and max_rows <= {MAX_TREE_ROWS}"),
            ));
        }
        let max_chunks = max_seq_len.div_ceil(SPLIT);
        let rows = max_bs
            .checked_mul(max_rows * heads * max_chunks)
            .filter(|&r| r.checked_mul(LATENT).is_some())
            .ok_or_else(|| Error::param("MlaPlan", max_bs, "scratch size overflows usize"))?;
        to_i32("max_chunks", max_chunks)?;
        to_i32("max_seq_len", max_seq_len)?;
        to_i32("bs * N", max_bs * max_rows)?;
        Ok(MlaPlan {
            max_bs,
            heads,
            max_rows,
            max_seq_len,
            max_chunks,
            part_o: gpu.zeros(rows * LATENT)?,
            part_ml: gpu.zeros(rows * 2)?,
            status: gpu.zeros(2)?,
            status_dirty: false,
        })
    }

    /// Queues `mla_decode` of `bs = seq_len.len()` requests: `q [bs, H, 576]` bf16 into `out`.
    ///
    /// `max_seq_len` (in `1..=` the plan's) is a bound the caller knows on the host: every
    /// `seq_len[b] <= max_seq_len`. It sizes the launches, so a bound close to the real lengths saves the
    /// CTAs that would find nothing to do; the results do not depend on it.
    ///
    /// Only lengths are checked here (no host round trip): the values of `seq_len` and of the block
    /// tables are trusted. A slot past a request's block table or a page id out of range reads cache row
    /// 0, and a request longer than `max_seq_len` gets `o = 0` and `lse = -inf`; both set a status bit
    /// that [`MlaPlan::check_status`] reports. A request with `seq_len <= 0` gets `o = 0` and
    /// `lse = -inf`.
    #[allow(clippy::too_many_arguments)]
    pub fn run_decode(
        &mut self,
        gpu: &Gpu,
        q: &CudaView<bf16>,
        cache: &DeviceCache,
        seq_len: &CudaView<i32>,
        max_seq_len: usize,
        softmax_scale: f32,
        out: &mut DeviceMlaOutput,
    ) -> Result<()> {
        let x = Inputs { q, cache, seq_len, max_seq_len, visibility: None, n_rows: 1, scale: softmax_scale };
        self.check_run(gpu, &x, out)?;
        self.reset_status(gpu)?;
        let (tiles, chunks) = (self.heads.div_ceil(TILE_ROWS), max_seq_len.div_ceil(SPLIT));
        let runs = chunk_runs(tiles * x.bs(), chunks, self.heads.min(TILE_ROWS));
        let grid = (tiles as u32, x.bs() as u32, runs.ctas(chunks) as u32);
        self.launch_chunks(gpu, MODE_DECODE, runs, grid, &x)?;
        self.launch_combine(gpu, &x, runs.fold, out)
    }

    /// Queues `tree_verify` of `bs = seq_len.len()` requests of `n_rows` tree rows: `q [bs, N, H, 576]`
    /// bf16 and `visibility [bs, N, ceil(N / 32)]` into `out`. `max_seq_len` bounds every row's visible
    /// sequence, prefix plus visible tree rows (`seq_len[b] + n_rows <= max_seq_len` is always enough),
    /// as in [`MlaPlan::run_decode`]. Trusts the values of its inputs as [`MlaPlan::run_decode`] does; a
    /// padding row (no visibility bit) over an empty prefix gets `o = 0` and `lse = -inf`.
    #[allow(clippy::too_many_arguments)]
    pub fn run_tree_verify(
        &mut self,
        gpu: &Gpu,
        q: &CudaView<bf16>,
        n_rows: usize,
        cache: &DeviceCache,
        seq_len: &CudaView<i32>,
        max_seq_len: usize,
        visibility: &CudaView<u32>,
        softmax_scale: f32,
        out: &mut DeviceMlaOutput,
    ) -> Result<()> {
        let x = Inputs { q, cache, seq_len, max_seq_len, visibility: Some(visibility), n_rows, scale: softmax_scale };
        self.check_run(gpu, &x, out)?;
        check_visibility_len(visibility.len(), x.bs(), n_rows)?;
        self.reset_status(gpu)?;
        let bs = x.bs();
        // The prefix launch covers the chunks wholly inside a prefix: none when max_seq_len < SPLIT.
        let (prefix_tiles, full_chunks) = ((n_rows * self.heads).div_ceil(TILE_ROWS), max_seq_len / SPLIT);
        let runs = chunk_runs(prefix_tiles * bs, full_chunks, (n_rows * self.heads).min(TILE_ROWS));
        if full_chunks > 0 {
            let grid = (prefix_tiles as u32, bs as u32, runs.ctas(full_chunks) as u32);
            self.launch_chunks(gpu, MODE_PREFIX, runs, grid, &x)?;
        }
        let tail_grid = (self.heads.div_ceil(TILE_ROWS) as u32, (bs * n_rows) as u32, TAIL_CHUNKS);
        self.launch_chunks(gpu, MODE_TAIL, Runs::SINGLE, tail_grid, &x)?;
        self.launch_combine(gpu, &x, runs.fold, out)
    }

    /// Reads the status of the last run (a host round trip): an error if a slot mapped outside the block
    /// table or the cache, or a sequence had more chunks than the plan holds.
    pub fn check_status(&self, gpu: &Gpu) -> Result<()> {
        Self::status_error(gpu.download(&self.status)?[0])
    }

    /// The status word of the last run, for a caller that gathers several status words in one read.
    pub fn status_word(&self) -> CudaView<'_, i32> {
        self.status.slice(0..1)
    }

    /// The error that the status bits `bits` (of [`MlaPlan::status_word`]) stand for, if any.
    pub fn status_error(bits: i32) -> Result<()> {
        if bits & STATUS_BAD_PAGE != 0 {
            return Err(Error::Index {
                name: "block_table",
                detail: "a visible slot maps past the block table or to a page id outside the cache".into(),
            });
        }
        if bits & STATUS_TOO_LONG != 0 {
            return Err(Error::param(
                "seq_len",
                "> max_seq_len",
                "a sequence is longer than the run's max_seq_len (its rows got o = 0, lse = -inf)",
            ));
        }
        Ok(())
    }

    /// Length, shape, plan-fit and alignment checks of a run.
    fn check_run(&self, gpu: &Gpu, x: &Inputs, out: &DeviceMlaOutput) -> Result<()> {
        let (l, bs, n_rows) = (&x.cache.layout, x.bs(), x.n_rows);
        let (cache_len, table_len) = (x.cache.rows.len(), x.cache.block_table.len());
        check_shapes(x.q.len(), bs, n_rows, self.heads, l, cache_len, table_len, x.scale)?;
        if bs == 0 || bs > self.max_bs || n_rows == 0 || n_rows > self.max_rows || bs * n_rows > 65_535 {
            return Err(Error::param(
                "bs, N",
                format!("{bs}, {n_rows}"),
                format!(
                    "must be in 1..={} and 1..={} (the plan's maxima), bs * N <= 65535",
                    self.max_bs, self.max_rows
                ),
            ));
        }
        if x.max_seq_len == 0 || x.max_seq_len > self.max_seq_len {
            return Err(Error::param(
                "max_seq_len",
                x.max_seq_len,
                format!("must be in 1..={} (the plan's max_seq_len)", self.max_seq_len),
            ));
        }
        let rows = bs * n_rows * self.heads;
        check_len("o", out.o.len(), &[("rows", rows), ("latent", LATENT)])?;
        check_len("lse", out.lse.len(), &[("rows", rows)])?;
        to_i32("num_pages", l.num_pages)?;
        to_i32("page_size", l.page_size)?;
        to_i32("pages_per_req", l.pages_per_req)?;
        // A bad page id reads row 0 of the cache (and sets the status), so there must be one.
        if l.num_pages == 0 {
            return Err(Error::param("num_pages", 0, "the cache needs at least one page"));
        }
        let stream = gpu.stream();
        check_aligned("cache", x.cache.rows.device_ptr(stream).0, 16)?;
        check_aligned("q", x.q.device_ptr(stream).0, 4)?;
        check_aligned("o", out.o.device_ptr(stream).0, 16)
    }

    /// Before a run's launches: the kernels keep the status words themselves (see `status`), unless a
    /// previous run stopped between its chunk launches and its combine.
    fn reset_status(&mut self, gpu: &Gpu) -> Result<()> {
        if self.status_dirty {
            gpu.stream().memset_zeros(&mut self.status).map_err(|e| cuda_err("memset mla status", e))?;
        }
        self.status_dirty = true;
        Ok(())
    }

    /// One `mla_chunk` launch in `mode` over `grid` (m-tiles, request groups, runs of `runs.per_cta`
    /// chunks). The MLA kernels are launched plainly: as programmatic dependent launches,
    /// each waiting before its first load, they measured 35-40% slower on the H200 at H 8 bs 8 prefix
    /// 4096 and H 16 bs 1 prefix 16384 (4% faster at H 8 bs 1 prefix 1024, within 1% elsewhere).
    /// Decode and tail launches of at most 8 heads (tiles of at most 8 rows) take `mla_chunk_half`,
    /// which leaves out the work of the tiles' empty rows (H 8 decodes up to 3% faster on the H200).
    fn launch_chunks(&mut self, gpu: &Gpu, mode: i32, runs: Runs, grid: (u32, u32, u32), x: &Inputs) -> Result<()> {
        let l = &x.cache.layout;
        let geometry = [l.num_pages as i32, l.page_size as i32, l.pages_per_req as i32];
        let shape = [x.n_rows as i32, x.n_rows.div_ceil(32) as i32, self.heads as i32, self.max_chunks as i32];
        let cfg = LaunchConfig {
            grid_dim: grid,
            block_dim: (CHUNK_THREADS, 1, 1),
            shared_mem_bytes: CHUNK_SHARED_BYTES as u32,
        };
        let null: u64 = 0;
        let half_tiles = self.heads <= 8 && mode != MODE_PREFIX;
        let kernel = if half_tiles { &gpu.kernels.mla_chunk_half } else { &gpu.kernels.mla_chunk };
        let mut b = gpu.stream().launch_builder(kernel);
        b.arg(x.q).arg(&x.cache.rows).arg(&x.cache.block_table).arg(x.seq_len);
        match x.visibility {
            Some(v) => b.arg(v),
            None => b.arg(&null),
        };
        let (per_cta, fold) = (runs.per_cta as i32, runs.fold as i32);
        b.arg(&mode).arg(&per_cta).arg(&fold).arg(&geometry[0]).arg(&geometry[1]).arg(&geometry[2]);
        b.arg(&shape[0]).arg(&shape[1]).arg(&shape[2]).arg(&shape[3]);
        b.arg(&x.scale).arg(&mut self.part_o).arg(&mut self.part_ml).arg(&mut self.status);
        unsafe { b.launch(cfg) }.map_err(|e| cuda_err("mla_chunk", e))?;
        gpu.after_launch("mla_chunk")
    }

    /// The combine launch: `mla_combine` ([`combine_slices`] CTAs per query row) for fewer than
    /// [`SLICED_COMBINE_MAX_ROWS`] rows, else `mla_combine_rows` (one CTA per row); both fold in the same
    /// order, so the choice never changes the bits. `folded`: the chunk launch before it folded its fold
    /// groups. Ends the run (the status words are consistent again).
    fn launch_combine(&mut self, gpu: &Gpu, x: &Inputs, folded: bool, out: &mut DeviceMlaOutput) -> Result<()> {
        let rows = x.bs() * x.n_rows * self.heads;
        let sliced = rows < SLICED_COMBINE_MAX_ROWS;
        let (kernel, slices, threads) = if sliced {
            (&gpu.kernels.mla_combine, combine_slices(rows), COMBINE_THREADS)
        } else {
            (&gpu.kernels.mla_combine_rows, 1, ROWS_COMBINE_THREADS)
        };
        let shape = [x.n_rows as i32, x.n_rows.div_ceil(32) as i32, self.heads as i32, self.max_chunks as i32];
        let ctas = u32::try_from(rows * slices)
            .map_err(|_| Error::param("bs * N * H", rows, "too many rows for one combine launch"))?;
        let cfg = LaunchConfig { grid_dim: (ctas, 1, 1), block_dim: (threads, 1, 1), shared_mem_bytes: 0 };
        let null: u64 = 0;
        let mut b = gpu.stream().launch_builder(kernel);
        b.arg(x.seq_len);
        match x.visibility {
            Some(v) => b.arg(v),
            None => b.arg(&null),
        };
        let (max_seq_len, folded, slices) = (x.max_seq_len as i32, folded as i32, slices as i32);
        b.arg(&shape[0]).arg(&shape[1]).arg(&shape[2]).arg(&shape[3]).arg(&max_seq_len).arg(&folded);
        if sliced {
            b.arg(&slices);
        }
        b.arg(&self.part_o).arg(&self.part_ml).arg(&mut out.o).arg(&mut out.lse).arg(&mut self.status);
        let name = if sliced { "mla_combine" } else { "mla_combine_rows" };
        unsafe { b.launch(cfg) }.map_err(|e| cuda_err(name, e))?;
        self.status_dirty = false;
        gpu.after_launch(name)
    }
}

/// The device inputs of one run.
struct Inputs<'r, 'v> {
    q: &'r CudaView<'v, bf16>,
    cache: &'r DeviceCache<'v>,
    seq_len: &'r CudaView<'v, i32>,
    max_seq_len: usize,
    visibility: Option<&'r CudaView<'v, u32>>,
    n_rows: usize,
    scale: f32,
}

impl Inputs<'_, '_> {
    fn bs(&self) -> usize {
        self.seq_len.len()
    }
}

/// Whether a launch of `groups` (m-tiles × request groups) × `chunks` CTAs, each over `tile_rows` valid
/// query rows, folds its chunks by groups of [`FOLD`] inside a CTA (one partial per group instead of one
/// per chunk). The bits do not depend on it; the time does, by two effects that this weighs in chunk
/// times of a full wave (about 21.7 µs on an H200, where the launch is memory-bound):
/// - waves: C CTAs of k chunks run as C / S full waves of S = [`CHUNK_SLOTS`] CTAs and a last wave of
///   the rest, which costs its share of a wave but never less than [`PARTIAL_WAVE`] (a CTA's chunk has a
///   latency floor): k · (⌊C / S⌋ + max((C mod S) / S, PARTIAL_WAVE)). Folding makes the CTAs four
///   times longer, so its last wave weighs four times as much;
/// - partials: an unfolded chunk writes `tile_rows` partials (2 KiB each) that the combine reads back,
///   2 · 16 KiB per 288 KiB chunk at H 8 (+11% traffic), 2 · 32 KiB at 16 rows (+22%); folded, a quarter.
///   (Stored evict-last, the partials of a small launch stay in L2; never folding was still 3-10% slower
///   on the H 8 / H 16 decode rows this folds, 1-4% at H 64, and 2% faster on tree prefixes (H200, session 18).)
///
/// Folding also needs the folded launch to fill about one wave ([`MIN_FOLDED_CTAS`]): below that, each
/// CTA runs its four chunks back to back at the latency floor (60 µs or more), where this estimate is
/// the least reliable. 256 folded CTAs (1024 chunks: H 16 at bs 64 × prefix 4096) leave 8 of the 264
/// slots idle and fold.
/// H 8 on an H200: bs 8 × prefix 65536 (2048 chunks, 512 folded CTAs) folds: 7.76 · 1.03 = 7.97 against
/// 7.76 · 1.11 = 8.62 chunk times (about 173 µs against 187 µs); bs 1 × 65536 (256 chunks) and bs 8 ×
/// 16384 (512 chunks) do not (64 and 128 folded CTAs, below a wave); 2200 chunks do not either
/// (550 folded CTAs leave a last wave of 22: 10.8 · 1.03 against 8.7 · 1.11).
fn folds(groups: usize, chunks: usize, tile_rows: usize) -> bool {
    let folded_ctas = groups.saturating_mul(chunks.div_ceil(FOLD));
    if chunks <= 1 || folded_ctas < MIN_FOLDED_CTAS {
        return false;
    }
    let waves = |ctas: usize, per_cta: usize| {
        let (full, rest) = (ctas / CHUNK_SLOTS, ctas % CHUNK_SLOTS);
        let last = if rest == 0 { 0.0 } else { (rest as f64 / CHUNK_SLOTS as f64).max(PARTIAL_WAVE) };
        per_cta as f64 * (full as f64 + last)
    };
    let traffic = 2.0 * (tile_rows * PARTIAL_BYTES) as f64 / CHUNK_BYTES as f64;
    let unfolded = waves(groups.saturating_mul(chunks), 1) * (1.0 + traffic);
    let per_cta = chunks.min(FOLD);
    let folded = waves(folded_ctas, per_cta) * (1.0 + traffic / per_cta as f64);
    folded < unfolded
}

/// How a chunk launch deals its chunks to CTAs: runs of `per_cta` consecutive chunks of a row group, each
/// chunk's result in its own slot, or (`fold`) fold groups folded inside the CTA.
#[derive(Clone, Copy, Debug, PartialEq)]
struct Runs {
    per_cta: usize,
    fold: bool,
}

impl Runs {
    const SINGLE: Runs = Runs { per_cta: 1, fold: false };
    const PAIRS: Runs = Runs { per_cta: 2, fold: false };
    const FOLDED: Runs = Runs { per_cta: FOLD, fold: true };

    /// CTAs along the chunk axis for `chunks` chunks.
    fn ctas(self, chunks: usize) -> usize {
        chunks.div_ceil(self.per_cta)
    }
}

/// The runs of a launch of `groups` (m-tiles × request groups) × `chunks` chunks over `tile_rows` valid
/// query rows: fold groups where [`folds`] says so; else chunk pairs where one-chunk CTAs take more than a
/// wave and pairs fill one ([`MIN_FOLDED_CTAS`] to [`CHUNK_SLOTS`]: 512 chunks, as at H 8 / H 16 bs 8 ×
/// prefix 16384 or bs 32 × prefix 4096). A CTA streams its run's chunks without a break (the next chunk's
/// first sub-tile loads while one ends), so the pair costs what its second wave would, without the
/// second wave's start: its key lists and first loads with nothing else in flight.
fn chunk_runs(groups: usize, chunks: usize, tile_rows: usize) -> Runs {
    if folds(groups, chunks, tile_rows) {
        return Runs::FOLDED;
    }
    let pairs = groups.saturating_mul(chunks.div_ceil(2));
    // One chunk per row group gives as many "pairs" as CTAs, more than a wave: such a launch stays single.
    if groups.saturating_mul(chunks) > CHUNK_SLOTS && (MIN_FOLDED_CTAS..=CHUNK_SLOTS).contains(&pairs) {
        Runs::PAIRS
    } else {
        Runs::SINGLE
    }
}

/// CTAs per query row of `mla_combine`: the fewest (a power of two in
/// [`MIN_COMBINE_SLICES`]..=[`MAX_COMBINE_SLICES`]) that give [`COMBINE_CTAS`] CTAs.
fn combine_slices(rows: usize) -> usize {
    COMBINE_CTAS.div_ceil(rows.max(1)).next_power_of_two().clamp(MIN_COMBINE_SLICES, MAX_COMBINE_SLICES)
}

/// A layout that passes the layout checks, for checking a plan's head count alone.
fn plan_layout() -> KvLayout {
    KvLayout { layers: 1, num_pages: 0, page_size: 1, row_elems: ROW, pages_per_req: 1 }
}

/// Host buffers uploaded for one host-to-host call.
struct Uploaded {
    q: CudaSlice<bf16>,
    rows: CudaSlice<bf16>,
    table: CudaSlice<i32>,
    seq_len: CudaSlice<i32>,
    o: CudaSlice<f32>,
    lse: CudaSlice<f32>,
}

impl Uploaded {
    fn new(gpu: &Gpu, q: &[bf16], cache: &PagedCache, seq_len: &[i32], out_rows: usize) -> Result<Self> {
        Ok(Uploaded {
            q: gpu.upload(q)?,
            rows: gpu.upload(cache.rows)?,
            table: gpu.upload(cache.block_table)?,
            seq_len: gpu.upload(seq_len)?,
            o: gpu.zeros(out_rows * LATENT)?,
            lse: gpu.zeros(out_rows)?,
        })
    }

    /// Downloads the outputs (`o` and `lse` are allocated with at least one element, so trim to `rows`).
    fn output(&self, gpu: &Gpu, rows: usize) -> Result<MlaOutput> {
        let (mut o, mut lse) = (gpu.download(&self.o)?, gpu.download(&self.lse)?);
        o.truncate(rows * LATENT);
        lse.truncate(rows);
        Ok(MlaOutput { o, lse })
    }
}

/// Longest sequence of a host batch, for sizing a one-off plan.
fn longest(seq_len: &[i32], extra: usize) -> usize {
    seq_len.iter().map(|&s| s.max(0) as usize + extra).max().unwrap_or(0).max(1)
}

impl Gpu {
    /// [`crate::cpu::mla::mla_decode`] on the device, with the same arguments and checks: uploads, runs,
    /// downloads.
    pub fn mla_decode(
        &self,
        q: &[bf16],
        heads: usize,
        cache: &PagedCache,
        seq_len: &[i32],
        softmax_scale: f32,
    ) -> Result<MlaOutput> {
        check_decode_inputs(q, heads, cache, seq_len, softmax_scale)?;
        let bs = seq_len.len();
        if bs == 0 {
            return Ok(MlaOutput { o: Vec::new(), lse: Vec::new() });
        }
        let max_seq_len = longest(seq_len, 0);
        let mut plan = MlaPlan::new(self, bs, heads, max_seq_len, 1)?;
        let mut up = Uploaded::new(self, q, cache, seq_len, bs * heads)?;
        let rows = bs * heads;
        let (q_dev, seq_dev) = (up.q.as_view(), up.seq_len.as_view());
        let dev_cache = DeviceCache { rows: up.rows.as_view(), layout: cache.layout, block_table: up.table.as_view() };
        let mut out = DeviceMlaOutput { o: up.o.slice_mut(..rows * LATENT), lse: up.lse.slice_mut(..rows) };
        plan.run_decode(self, &q_dev, &dev_cache, &seq_dev, max_seq_len, softmax_scale, &mut out)?;
        plan.check_status(self)?;
        up.output(self, rows)
    }

    /// [`crate::cpu::mla::tree_verify`] on the device, with the same arguments and checks: uploads, runs,
    /// downloads.
    #[allow(clippy::too_many_arguments)]
    pub fn tree_verify(
        &self,
        q: &[bf16],
        n_rows: usize,
        heads: usize,
        cache: &PagedCache,
        seq_len: &[i32],
        visibility: &[u32],
        softmax_scale: f32,
    ) -> Result<MlaOutput> {
        check_tree_inputs(q, n_rows, heads, cache, seq_len, visibility, softmax_scale)?;
        if n_rows > MAX_TREE_ROWS {
            return Err(Error::param("N", n_rows, format!("tree_verify takes at most {MAX_TREE_ROWS} rows")));
        }
        let bs = seq_len.len();
        if bs == 0 || n_rows == 0 {
            return Ok(MlaOutput { o: Vec::new(), lse: Vec::new() });
        }
        let max_seq_len = longest(seq_len, n_rows);
        let mut plan = MlaPlan::new(self, bs, heads, max_seq_len, n_rows)?;
        let mut up = Uploaded::new(self, q, cache, seq_len, bs * n_rows * heads)?;
        let vis = self.upload(visibility)?;
        let rows = bs * n_rows * heads;
        let (q_dev, seq_dev, vis_dev) = (up.q.as_view(), up.seq_len.as_view(), vis.as_view());
        let dev_cache = DeviceCache { rows: up.rows.as_view(), layout: cache.layout, block_table: up.table.as_view() };
        let mut out = DeviceMlaOutput { o: up.o.slice_mut(..rows * LATENT), lse: up.lse.slice_mut(..rows) };
        let (n, scale) = (n_rows, softmax_scale);
        plan.run_tree_verify(self, &q_dev, n, &dev_cache, &seq_dev, max_seq_len, &vis_dev, scale, &mut out)?;
        plan.check_status(self)?;
        up.output(self, rows)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fold_choices_follow_the_wave_arithmetic() {
        // H 8 decodes (one m-tile of 8 valid rows per request).
        assert!(!folds(1, 256, 8), "bs 1 prefix 65536: 64 folded CTAs, below a wave");
        assert!(!folds(8, 64, 8), "bs 8 prefix 16384: 128 folded CTAs");
        assert!(folds(8, 256, 8), "bs 8 prefix 65536");
        assert!(folds(64, 256, 8), "bs 64 prefix 65536");
        assert!(folds(64, 16, 16), "H 16 bs 64 prefix 4096: 256 folded CTAs, 97% of a wave");
        assert!(!folds(2200, 1, 8) && !folds(1, 1, 8), "a single chunk never folds");
        assert!(!folds(550, 4, 8), "550 folded CTAs: a last wave of 22 CTAs of four chunks");
        // The GPU test of folded decodes (H 64, bs 64, 8 chunks) must fold.
        assert!(folds(4 * 64, 8, 16));
        assert_eq!(chunk_runs(4 * 64, 8, 16), Runs::FOLDED);
    }

    #[test]
    fn pairs_serve_launches_whose_pairs_fill_one_wave() {
        assert_eq!(chunk_runs(8, 64, 8), Runs::PAIRS, "H 8 bs 8 prefix 16384: 256 pairs");
        assert_eq!(chunk_runs(32, 16, 16), Runs::PAIRS, "H 16 bs 32 prefix 4096");
        assert_eq!(chunk_runs(1, 256, 8), Runs::SINGLE, "bs 1 prefix 65536: one wave of single chunks");
        assert_eq!(chunk_runs(64, 4, 8), Runs::SINGLE, "bs 64 prefix 1024: 256 chunks");
        assert_eq!(chunk_runs(8, 80, 8), Runs::SINGLE, "320 pairs: more than a wave");
        assert_eq!(chunk_runs(300, 1, 8), Runs::SINGLE, "one chunk per row group: no pairs");
        assert_eq!(chunk_runs(64, 16, 16), Runs::FOLDED, "folding comes first");
        assert_eq!(chunk_runs(64, 8, 8), Runs::PAIRS, "the GPU test of chunk pairs: H 8, bs 64, 8 chunks");
        assert_eq!(chunk_runs(33, 16, 16), Runs::PAIRS, "the GPU test of a tree prefix 4096 in pairs (N 65, H 8)");
        assert_eq!(Runs::PAIRS.ctas(65), 33);
    }

    #[test]
    fn combine_slices_are_powers_of_two_in_range() {
        assert_eq!(combine_slices(8), 32);
        assert_eq!(combine_slices(64), 8);
        assert_eq!(combine_slices(128), 4);
        assert_eq!(combine_slices(1 << 20), 4);
        for rows in 1..2000 {
            let s = combine_slices(rows);
            assert!(s.is_power_of_two() && (MIN_COMBINE_SLICES..=MAX_COMBINE_SLICES).contains(&s));
        }
    }
}
