//! The backend a model runs on: it owns the tensors (host memory on the CPU, device buffers on CUDA) and
//! provides every operation of a forward step on them, so that [`crate::model::Model`] is one code path
//! for both and a step moves nothing between host and device but its inputs and the rows it returns.
//!
//! Buffers may be longer than an operation needs: every operation takes its row counts and reads and
//! writes prefixes. Every operation gives a row's result independently of the other rows (batch
//! invariance, DESIGN.md §4.5), and the per-row operations of [`crate::cpu::rowops`] give the same bits
//! on both backends.

use half::bf16;

pub use crate::cpu::moe_int4::ExpertShare;
use crate::cpu::moe_int4::Experts;
use crate::cpu::rowops::QueryShape;
use crate::error::Result;
use crate::types::KvLayout;

/// An element type a backend buffer holds.
#[cfg(not(feature = "cuda"))]
pub trait Elem: Copy + Default + Send + Sync + 'static {}
/// An element type a backend buffer holds.
#[cfg(feature = "cuda")]
pub trait Elem:
    Copy + Default + Send + Sync + 'static + cudarc::driver::DeviceRepr + cudarc::driver::ValidAsZeroBits
{
}
impl Elem for f32 {}
impl Elem for i32 {}
impl Elem for u32 {}
impl Elem for bf16 {}

/// Element strides of a per-head operand `[tokens, heads, features]` that may sit inside a larger row.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct HeadStrides {
    /// Between consecutive tokens.
    pub row: usize,
    /// Between consecutive heads.
    pub head: usize,
}

/// One layer's latent cache and the per-row attention inputs of a step.
pub struct AttentionInputs<'a, B: Backend + ?Sized> {
    /// `[num_pages, page_size, 576]` bf16 rows.
    pub cache: &'a B::Buf<bf16>,
    /// Page geometry (`layers` 1).
    pub layout: KvLayout,
    /// `[rows, pages_per_req]` page ids: each query row's sequence.
    pub block_tables: &'a B::Buf<i32>,
    /// `[rows]` visible slots of each query row (`0 .. seq_len`).
    pub seq_len: &'a B::Buf<i32>,
    /// A bound on every `seq_len` that the host knows.
    pub max_seq_len: usize,
}

/// The shape of a step's tree rows: `bs` requests of `n_rows` rows each.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct TreeRows {
    /// Requests with a tree.
    pub bs: usize,
    /// Rows of each tree (root included).
    pub n_rows: usize,
}

/// The inputs of a step's cache-row write ([`Backend::kv_rows`]).
pub struct KvWrite<'a, B: Backend + ?Sized> {
    /// `[T, 576]` f32: `kv_a_proj_with_mqa`'s output.
    pub kv: &'a B::Buf<f32>,
    /// `[512]` f32 `kv_a_layernorm` weight.
    pub norm_w: &'a B::Buf<f32>,
    /// Its epsilon.
    pub eps: f32,
    /// `[T, 64]` rotary table.
    pub table: &'a B::Buf<f32>,
    /// Interleaved rotary pairs.
    pub interleave: bool,
    /// `[T]` cache rows.
    pub slot: &'a B::Buf<i32>,
}

/// The accepted tree rows of a batch, for [`Backend::kv_compact`] (the arrays of
/// [`crate::cpu::kv_compact::kv_compact`]).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Compaction {
    /// `[bs, pages_per_req]` block tables.
    pub block_tables: Vec<i32>,
    /// `[bs]` committed lengths: tree row i sits at slot `seq_len + i`.
    pub seq_len: Vec<i32>,
    /// `[bs]` accepted draft rows (root excluded).
    pub accept_len: Vec<i32>,
    /// `[bs, depth + 1]` accepted rows, root (0) first; -1 padding.
    pub accept_rows: Vec<i32>,
    /// Draft depth L.
    pub depth: usize,
    /// Tree rows N written after each prefix.
    pub n_rows: usize,
}

/// The operations and storage of a backend (see the module documentation).
pub trait Backend: Send + Sync {
    /// A buffer of `T` on this backend.
    type Buf<T: Elem>: Send + Sync;
    /// A bf16 weight `[batch, out, in]` placed on this backend.
    type Linear: Send + Sync;
    /// One layer's INT4 routed experts placed on this backend.
    type Experts: Send + Sync;
    /// A recorded sequence of operations that replays without the host launching each one.
    type Graph: Send;
    /// A point in the backend's queue of work, for timing what ran between two ([`Backend::elapsed`]).
    type Mark;
    /// Whether [`Backend::capture`] records graphs (CUDA) or none (the CPU).
    const RECORDS_GRAPHS: bool;

    /// A short name for messages ("cpu", or the GPU's name).
    fn name(&self) -> String;

    /// A zeroed buffer of `len` elements.
    fn zeros<T: Elem>(&self, len: usize) -> Result<Self::Buf<T>>;
    /// A buffer holding `host`.
    fn upload<T: Elem>(&self, host: &[T]) -> Result<Self::Buf<T>>;
    /// Copies `host` into the first `host.len()` elements of `buf`.
    fn write<T: Elem>(&self, host: &[T], buf: &mut Self::Buf<T>) -> Result<()>;
    /// The first `len` elements of `buf`, on the host (on CUDA: waits for the queued work).
    fn read<T: Elem>(&self, buf: &Self::Buf<T>, len: usize) -> Result<Vec<T>>;
    /// Elements in `buf`.
    fn len<T: Elem>(&self, buf: &Self::Buf<T>) -> usize;

    /// Places `w [batch, out, inp]`.
    fn linear(&self, w: &[bf16], batch: usize, out: usize, inp: usize) -> Result<Self::Linear>;
    /// Places one layer's routed experts.
    fn experts(&self, experts: &Experts) -> Result<Self::Experts>;
    /// A random weight `[batch, out, inp]` made where the backend lives (for models without a checkpoint,
    /// e.g. a benchmark at real dimensions): INT4-grid values `(q - 8) · s` with per-32 scales `s` in
    /// [0.002, 0.006), bf16, deterministic in `seed`. `inp` must be a multiple of 32 on CUDA.
    fn random_linear(&self, batch: usize, out: usize, inp: usize, seed: u64) -> Result<Self::Linear>;
    /// A random bf16 table `[rows, cols]` made like [`Backend::random_linear`]'s values.
    fn random_table(&self, rows: usize, cols: usize, seed: u64) -> Result<Self::Buf<bf16>>;
    /// Random INT4 routed experts of the given sizes (values and scales as [`Backend::random_linear`]).
    fn random_experts(&self, count: usize, hidden: usize, inter: usize, seed: u64) -> Result<Self::Experts>;

    /// `y [tokens, out] = x [tokens, in] · wᵀ` for a one-matrix weight.
    fn matmul(&self, w: &Self::Linear, x: &Self::Buf<f32>, tokens: usize, y: &mut Self::Buf<f32>) -> Result<()>;
    /// Per head h: `y[t][h] = w[h] · x[t][h]` with the operands laid out by `xs` and `ys`.
    #[allow(clippy::too_many_arguments)]
    fn matmul_heads(
        &self,
        w: &Self::Linear,
        x: &Self::Buf<f32>,
        xs: HeadStrides,
        tokens: usize,
        y: &mut Self::Buf<f32>,
        ys: HeadStrides,
    ) -> Result<()>;

    /// RMSNorm of `rows` rows of `w`'s length at the given row strides.
    #[allow(clippy::too_many_arguments)]
    fn rmsnorm(
        &self,
        x: &Self::Buf<f32>,
        x_stride: usize,
        w: &Self::Buf<f32>,
        eps: f32,
        rows: usize,
        y: &mut Self::Buf<f32>,
        y_stride: usize,
    ) -> Result<()>;
    /// `out [rows, inter] = SiLU(gate) · up` of `gu [rows, 2·inter]`.
    fn silu_mul(&self, gu: &Self::Buf<f32>, inter: usize, rows: usize, out: &mut Self::Buf<f32>) -> Result<()>;
    /// The attention's bf16 query rows `[tokens, heads, 576]`.
    #[allow(clippy::too_many_arguments)]
    fn q_rows(
        &self,
        q_latent: &Self::Buf<f32>,
        q: &Self::Buf<f32>,
        shape: QueryShape,
        table: &Self::Buf<f32>,
        tokens: usize,
        interleave: bool,
        out: &mut Self::Buf<bf16>,
    ) -> Result<()>;
    /// Writes `tokens` cache rows into `cache`.
    fn kv_rows(&self, x: &KvWrite<Self>, tokens: usize, cache: &mut Self::Buf<bf16>) -> Result<()>;
    /// Moves each request's accepted tree rows to the slots right after its committed length, in every
    /// layer's cache of `layout` (one layer per buffer), as if every row were read before any is written.
    fn kv_compact(&self, caches: &mut [Self::Buf<bf16>], layout: KvLayout, moves: &Compaction) -> Result<()>;
    /// `out [tokens, hidden]` = rows `ids` of the embedding `table`.
    fn embed(
        &self,
        table: &Self::Buf<bf16>,
        hidden: usize,
        ids: &Self::Buf<i32>,
        tokens: usize,
        out: &mut Self::Buf<f32>,
    ) -> Result<()>;
    /// `x[..n] += y[..n]`.
    fn add(&self, x: &mut Self::Buf<f32>, y: &Self::Buf<f32>, n: usize) -> Result<()>;
    /// `out[..n] = bf16(x[..n])`.
    fn to_bf16(&self, x: &Self::Buf<f32>, n: usize, out: &mut Self::Buf<bf16>) -> Result<()>;
    /// `out [picked, dim]` = rows `idx[..picked]` of `x [rows, dim]`.
    #[allow(clippy::too_many_arguments)]
    fn gather(
        &self,
        x: &Self::Buf<f32>,
        dim: usize,
        rows: usize,
        idx: &Self::Buf<i32>,
        picked: usize,
        out: &mut Self::Buf<f32>,
    ) -> Result<()>;
    /// `out[r]` = argmax of row r of `x [rows, vocab]`.
    fn argmax(&self, x: &Self::Buf<f32>, vocab: usize, rows: usize, out: &mut Self::Buf<i32>) -> Result<()>;
    /// The `k` best tokens of each row of `x [rows, vocab]` with their log-probabilities, the contract
    /// and bits of [`crate::cpu::topk::topk_logsumexp`]: `ids [rows, k]` (value descending, then id
    /// ascending) and `logp [rows, k]` (`logit - logsumexp`). A row of invalid logits (a NaN, a +inf,
    /// all -inf) is an error, from this call or from the next [`Backend::check`].
    #[allow(clippy::too_many_arguments)]
    fn topk(
        &self,
        x: &Self::Buf<f32>,
        vocab: usize,
        rows: usize,
        k: usize,
        ids: &mut Self::Buf<i32>,
        logp: &mut Self::Buf<f32>,
    ) -> Result<()>;

    /// Absorbed MLA attention of `rows` query rows, rows `first_row ..` of `q [.., heads, 576]`, each over
    /// its own sequence (`inputs` row r for query row `first_row + r`), into the same rows of
    /// `o [.., heads, 512]` and `lse [.., heads]`.
    #[allow(clippy::too_many_arguments)]
    fn attention(
        &self,
        q: &Self::Buf<bf16>,
        heads: usize,
        first_row: usize,
        rows: usize,
        inputs: &AttentionInputs<Self>,
        softmax_scale: f32,
        o: &mut Self::Buf<f32>,
        lse: &mut Self::Buf<f32>,
    ) -> Result<()>;

    /// Tree verify of `bs` requests of `n_rows` tree rows each, rows `first_row ..` of `q`, `o` and `lse`:
    /// request b's row i attends to its prefix (`inputs.seq_len[b]` slots) and to the tree rows set in
    /// its row of `visibility [bs, n_rows, ceil(n_rows / 32)]`, which sit at slots `seq_len[b] + j`.
    #[allow(clippy::too_many_arguments)]
    fn tree_attention(
        &self,
        q: &Self::Buf<bf16>,
        heads: usize,
        first_row: usize,
        shape: TreeRows,
        inputs: &AttentionInputs<Self>,
        visibility: &Self::Buf<u32>,
        softmax_scale: f32,
        o: &mut Self::Buf<f32>,
        lse: &mut Self::Buf<f32>,
    ) -> Result<()>;

    /// The routed experts of `tokens` tokens: routing of `router_logits [tokens, share.total]` with `bias`
    /// (top `k`, weights times `scaling`), then the INT4 experts over `x [tokens, H]` bf16 into `out`; of a
    /// share of the experts, the part of the output its experts give
    /// ([`crate::cpu::moe_int4::moe_int4_share`]).
    #[allow(clippy::too_many_arguments)]
    fn moe(
        &self,
        router_logits: &Self::Buf<f32>,
        bias: &Self::Buf<f32>,
        k: usize,
        scaling: f64,
        x: &Self::Buf<bf16>,
        experts: &Self::Experts,
        share: ExpertShare,
        tokens: usize,
        out: &mut Self::Buf<f32>,
    ) -> Result<()>;

    /// Records the operations `record` queues into a graph instead of running them; `None` where the
    /// backend has no graphs (the CPU), without calling `record`. Buffers the operations use must stay
    /// where they are while the graph lives, and the backend's plans must not grow
    /// ([`Backend::plan_epoch`]).
    fn capture(&self, record: &mut dyn FnMut() -> Result<()>) -> Result<Option<Self::Graph>>;
    /// Queues a recorded graph: the operations it holds, on the buffers they were recorded on.
    fn replay(&self, graph: &Self::Graph) -> Result<()>;
    /// Changes whenever one of the backend's internal plans reallocates its scratch, so that a graph
    /// recorded before knows it holds stale addresses.
    fn plan_epoch(&self) -> u64;

    /// Operations launched so far: kernel launches on CUDA (a replayed graph counts as none), 0 on the CPU.
    fn launches(&self) -> u64;

    /// Marks the current end of the queued work.
    fn mark(&self) -> Result<Self::Mark>;
    /// Time the backend spent between two marks (on CUDA: waits for the second).
    fn elapsed(&self, from: &Self::Mark, to: &Self::Mark) -> Result<std::time::Duration>;

    /// Queues the copy of the device's status words to the host behind the work queued so far, so that
    /// the next read brings them along and [`Backend::check`] needs no round trip of its own. Nothing to
    /// do on the CPU.
    fn fetch_status(&self) -> Result<()> {
        Ok(())
    }

    /// Reports what the operations since the last check found wrong on the device (a bad index, a page
    /// outside the cache); on the CPU every operation reports at once, so this is always Ok. On CUDA it
    /// waits for the queued work and reads the words [`Backend::fetch_status`] queued (fetching them first
    /// if it was not called).
    fn check(&self) -> Result<()>;
}
