//! CUDA backend: the device context, the embedded kernel fatbin, and one launcher module per kernel
//! family (named like its `.cu` file and its CPU reference).
//!
//! Launchers follow a plan/run split: a plan allocates its scratch once for a maximum shape, and `run`
//! only launches (no allocation, no host round trip). Each family also offers a host-to-host convenience
//! call used by tests and examples. In debug builds every launch is followed by a synchronize and an
//! error check, so a faulting kernel is reported at its launch site; while the stream is being captured
//! into a CUDA graph (where a synchronize is not allowed) only the capture's status is checked.

pub mod backend;
pub mod gemm_bf16;
pub mod greedy_accept;
pub mod kv_compact;
pub mod mla;
pub mod moe_int4;
pub mod rowops;
pub mod topk;
pub mod tree_build;

use std::ffi::c_void;
use std::sync::Arc;

use cudarc::driver::{
    sys, CudaContext, CudaFunction, CudaModule, CudaSlice, CudaStream, CudaView, DevicePtr, DevicePtrMut, DeviceRepr,
    DriverError, LaunchConfig, ValidAsZeroBits,
};
use cudarc::nvrtc::Ptx;
use half::bf16;

use crate::error::{Error, Result};

/// The fatbin built by build.rs from kernels/*.cu (SASS for sm_90 and sm_120, PTX for compute_120).
static FATBIN: &[u8] = include_bytes!(concat!(env!("OUT_DIR"), "/kernels.fatbin"));

/// Shared memory a block may use on every supported GPU (SM120 allows 99 KB per block).
pub const MAX_SHARED_BYTES: usize = 99 * 1024;

/// Row status bits set by validating kernels (kernels/common.cuh).
const STATUS_NAN: i32 = 1;
const STATUS_POS_INF: i32 = 2;
const STATUS_NO_FINITE: i32 = 4;

/// True when the CUDA driver library loads and reports at least one device. Never panics.
pub fn device_available() -> bool {
    // cudarc panics on first use when libcuda is missing, so probe for the library first.
    if !unsafe { sys::is_culib_present() } {
        return false;
    }
    CudaContext::device_count().map(|n| n > 0).unwrap_or(false)
}

/// Logits on the device, f32 or bf16, row-major: a view, so a prefix of a larger buffer works too.
#[derive(Debug)]
pub enum DeviceLogits<'a> {
    /// 32-bit floats.
    F32(CudaView<'a, f32>),
    /// bfloat16.
    Bf16(CudaView<'a, bf16>),
}

impl DeviceLogits<'_> {
    /// Number of elements.
    pub fn len(&self) -> usize {
        match self {
            DeviceLogits::F32(x) => x.len(),
            DeviceLogits::Bf16(x) => x.len(),
        }
    }

    /// True when there are no elements.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

/// Owned device logits (what the host conveniences upload).
pub enum OwnedDeviceLogits {
    /// 32-bit floats.
    F32(CudaSlice<f32>),
    /// bfloat16.
    Bf16(CudaSlice<bf16>),
}

impl OwnedDeviceLogits {
    /// Borrowed view.
    pub fn view(&self) -> DeviceLogits<'_> {
        match self {
            OwnedDeviceLogits::F32(x) => DeviceLogits::F32(x.as_view()),
            OwnedDeviceLogits::Bf16(x) => DeviceLogits::Bf16(x.as_view()),
        }
    }
}

/// The kernels of the fatbin, looked up once.
struct Kernels {
    topk_chunk_f32: CudaFunction,
    topk_chunk_bf16: CudaFunction,
    topk_merge: CudaFunction,
    tree_build: CudaFunction,
    greedy_accept_f32: CudaFunction,
    greedy_accept_bf16: CudaFunction,
    greedy_accept_argmax: CudaFunction,
    kv_compact: CudaFunction,
    moe_route: CudaFunction,
    moe_align: CudaFunction,
    /// The INT4 GEMMs of the compiled-in layout: [narrow, wide].
    moe_gate_up: [(&'static str, CudaFunction); 2],
    /// The narrow gate/up GEMM of one token, which takes its experts from the routing.
    moe_gate_up_direct: (&'static str, CudaFunction),
    moe_down: [(&'static str, CudaFunction); 2],
    /// The down GEMM of one token, which takes its experts from the routing (the native layout only).
    moe_down_direct: Option<(&'static str, CudaFunction)>,
    moe_combine: CudaFunction,
    moe_pair_acts: CudaFunction,
    int4_tile: CudaFunction,
    int4_fill_random: CudaFunction,
    int4_dequant_bf16: CudaFunction,
    mla_chunk: CudaFunction,
    /// `mla_chunk` for launches whose tiles hold at most 8 query rows (kernels/mla.cu run_chunk's HALF).
    mla_chunk_half: CudaFunction,
    mla_combine: CudaFunction,
    mla_combine_rows: CudaFunction,
    /// The GEMM's tile shapes, in the order of `gemm_bf16::SHAPES`.
    gemm_bf16: [CudaFunction; gemm_bf16::SHAPES.len()],
    gemm_reduce: CudaFunction,
    gemm_split_bf16: CudaFunction,
    rowops: rowops::Kernels,
}

impl Kernels {
    fn load(module: &Arc<CudaModule>) -> Result<Self> {
        let f = |name: &'static str| module.load_function(name).map_err(|e| cuda_err("load_function", e));
        Ok(Kernels {
            topk_chunk_f32: f("topk_chunk_f32")?,
            topk_chunk_bf16: f("topk_chunk_bf16")?,
            topk_merge: f("topk_merge")?,
            tree_build: f("tree_build")?,
            greedy_accept_f32: f("greedy_accept_f32")?,
            greedy_accept_bf16: f("greedy_accept_bf16")?,
            greedy_accept_argmax: f("greedy_accept_argmax")?,
            kv_compact: f("kv_compact")?,
            moe_route: f("moe_route")?,
            moe_align: f("moe_align")?,
            moe_gate_up: Self::int4_pair(module, INT4_NAMES.gate_up, false)?,
            moe_gate_up_direct: Self::int4_gemm(module, INT4_NAMES.gate_up_direct, false, false)?,
            moe_down: Self::int4_pair(module, INT4_NAMES.down, true)?,
            moe_down_direct: INT4_NAMES
                .down_direct
                .map(|name| Self::int4_kernel(module, name, moe_int4::direct_down_shared_bytes()))
                .transpose()?,
            moe_combine: f("moe_combine")?,
            moe_pair_acts: f("moe_pair_acts")?,
            int4_tile: f("int4_tile")?,
            int4_fill_random: f("int4_fill_random")?,
            int4_dequant_bf16: f("int4_dequant_bf16")?,
            mla_chunk: f("mla_chunk")?,
            mla_chunk_half: f("mla_chunk_half")?,
            mla_combine: f("mla_combine")?,
            mla_combine_rows: f("mla_combine_rows")?,
            gemm_bf16: [
                f(gemm_bf16::SHAPES[0].name)?,
                f(gemm_bf16::SHAPES[1].name)?,
                f(gemm_bf16::SHAPES[2].name)?,
                f(gemm_bf16::SHAPES[3].name)?,
            ],
            gemm_reduce: f("gemm_reduce")?,
            gemm_split_bf16: f("gemm_split_bf16")?,
            rowops: rowops::Kernels::load(module)?,
        })
    }

    /// The narrow and wide variants (`names`) of the gate/up (`down` false) or down INT4 GEMM.
    fn int4_pair(
        module: &Arc<CudaModule>,
        names: [&'static str; 2],
        down: bool,
    ) -> Result<[(&'static str, CudaFunction); 2]> {
        Ok([Self::int4_gemm(module, names[0], down, false)?, Self::int4_gemm(module, names[1], down, true)?])
    }

    /// An INT4 GEMM kernel, allowed the dynamic shared memory of its geometry.
    fn int4_gemm(
        module: &Arc<CudaModule>,
        name: &'static str,
        down: bool,
        wide: bool,
    ) -> Result<(&'static str, CudaFunction)> {
        Self::int4_kernel(module, name, moe_int4::gemm_shared_bytes_of(down, wide))
    }

    /// An INT4 GEMM kernel allowed `shared` bytes of dynamic shared memory.
    fn int4_kernel(
        module: &Arc<CudaModule>,
        name: &'static str,
        shared: usize,
    ) -> Result<(&'static str, CudaFunction)> {
        let f = module.load_function(name).map_err(|e| cuda_err("load_function", e))?;
        f.set_attribute(sys::CUfunction_attribute_enum::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES, shared as i32)
            .map_err(|e| cuda_err("INT4 GEMM shared memory attribute", e))?;
        Ok((name, f))
    }

    fn moe_gate_up(&self, wide: bool) -> (&'static str, &CudaFunction) {
        let (name, f) = &self.moe_gate_up[wide as usize];
        (name, f)
    }

    fn moe_gate_up_direct(&self) -> (&'static str, &CudaFunction) {
        let (name, f) = &self.moe_gate_up_direct;
        (name, f)
    }

    fn moe_down(&self, wide: bool) -> (&'static str, &CudaFunction) {
        let (name, f) = &self.moe_down[wide as usize];
        (name, f)
    }

    fn moe_down_direct(&self) -> Option<(&'static str, &CudaFunction)> {
        self.moe_down_direct.as_ref().map(|(name, f)| (*name, f))
    }
}

/// The INT4 GEMM kernels of one layout (kernels/moe_int4.cu KDT_MOE_GEMMS, KDT_MOE_GATE_UP_DIRECT and
/// moe_down_direct_native).
struct Int4Names {
    /// gate/up: [narrow, wide]
    gate_up: [&'static str; 2],
    /// down: [narrow, wide]
    down: [&'static str; 2],
    /// the narrow gate/up GEMM of one token
    gate_up_direct: &'static str,
    /// the down GEMM of one token (the native layout only; the tiled one uses its narrow down GEMM)
    down_direct: Option<&'static str>,
}

/// The INT4 GEMM kernels of the layout the features choose.
const INT4_NAMES: Int4Names = match moe_int4::LAYOUT {
    moe_int4::Int4Layout::Native => Int4Names {
        gate_up: ["moe_gate_up_native", "moe_gate_up_wide_native"],
        down: ["moe_down_native", "moe_down_wide_native"],
        gate_up_direct: "moe_gate_up_direct_native",
        down_direct: Some("moe_down_direct_native"),
    },
    moe_int4::Int4Layout::Tiled => Int4Names {
        gate_up: ["moe_gate_up_tiled", "moe_gate_up_wide_tiled"],
        down: ["moe_down_tiled", "moe_down_wide_tiled"],
        gate_up_direct: "moe_gate_up_direct_tiled",
        down_direct: None,
    },
};

/// A CUDA device with the kernels loaded and one stream that every launch and copy goes to. Buffers
/// made by a `Gpu` must only be used on its stream.
///
/// On compute capability 9.0 and newer, the MoE kernels after the routing are programmatic dependent
/// launches (they overlap their predecessor's tail; see [`moe_int4`]); the environment variable
/// `KDTREE_PDL=0`, read when the `Gpu` is opened, launches them plainly instead.
pub struct Gpu {
    ctx: Arc<CudaContext>,
    stream: Arc<CudaStream>,
    kernels: Kernels,
    /// Whether [`Gpu::launch_ex`] may use programmatic dependent launch (see above).
    pdl: bool,
    /// Kernel launches queued (or recorded into a graph) so far.
    launches: std::sync::atomic::AtomicU64,
}

/// The arguments of a kernel for [`Gpu::launch_ex`], in the kernel's order. Each value is copied into an
/// 8-byte slot (every argument of these kernels is a pointer or a scalar of at most 8 bytes) whose
/// address the driver reads, as `cuLaunchKernelEx` expects.
pub(crate) struct KernelArgs<'a> {
    stream: &'a CudaStream,
    slots: Vec<u64>,
}

impl<'a> KernelArgs<'a> {
    pub(crate) fn new(gpu: &'a Gpu) -> Self {
        KernelArgs { stream: &gpu.stream, slots: Vec::with_capacity(16) }
    }

    /// A scalar argument.
    pub(crate) fn val<T: DeviceRepr>(&mut self, v: T) -> &mut Self {
        const { assert!(std::mem::size_of::<T>() <= 8 && std::mem::align_of::<T>() <= 8) };
        let mut slot = 0u64;
        // SAFETY: T fits the slot (checked above) and is plain data the kernel reads by value.
        unsafe {
            std::ptr::copy_nonoverlapping(&v as *const T as *const u8, &mut slot as *mut u64 as *mut u8, size_of::<T>())
        };
        self.slots.push(slot);
        self
    }

    /// A buffer the kernel reads. The `Gpu` turns cudarc's event tracking off, so the returned guard
    /// has nothing to record and is dropped at once.
    pub(crate) fn ptr<T, B: DevicePtr<T>>(&mut self, buf: &B) -> &mut Self {
        let (ptr, _sync) = buf.device_ptr(self.stream);
        self.slots.push(ptr);
        self
    }

    /// A buffer the kernel writes (see [`KernelArgs::ptr`]).
    pub(crate) fn ptr_mut<T, B: DevicePtrMut<T>>(&mut self, buf: &mut B) -> &mut Self {
        let (ptr, _sync) = buf.device_ptr_mut(self.stream);
        self.slots.push(ptr);
        self
    }
}

impl Gpu {
    /// Opens device `ordinal` and loads the kernels; `Error::NoDevice` when there is no driver or device.
    pub fn new(ordinal: usize) -> Result<Self> {
        if !device_available() {
            return Err(Error::NoDevice("no CUDA driver library or no device found".into()));
        }
        let ctx = CudaContext::new(ordinal).map_err(|e| cuda_err("CudaContext::new", e))?;
        // Every launch and copy of a `Gpu` goes to its one stream, in order, so cudarc's per-buffer event
        // tracking (meant for several streams) would only add work to each launch.
        unsafe { ctx.disable_event_tracking() };
        let module = ctx.load_module(Ptx::from_binary(FATBIN.to_vec())).map_err(|e| cuda_err("load_module", e))?;
        let kernels = Kernels::load(&module)?;
        kernels
            .tree_build
            .set_attribute(
                sys::CUfunction_attribute_enum::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
                MAX_SHARED_BYTES as i32,
            )
            .map_err(|e| cuda_err("tree_build shared memory attribute", e))?;
        for f in [&kernels.mla_chunk, &kernels.mla_chunk_half] {
            f.set_attribute(
                sys::CUfunction_attribute_enum::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
                mla::CHUNK_SHARED_BYTES as i32,
            )
            .map_err(|e| cuda_err("mla_chunk shared memory attribute", e))?;
        }
        for (f, bytes) in kernels.gemm_bf16.iter().zip(gemm_bf16::SHARED_BYTES) {
            f.set_attribute(
                sys::CUfunction_attribute_enum::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
                bytes as i32,
            )
            .map_err(|e| cuda_err("gemm_bf16 shared memory attribute", e))?;
        }
        // A stream of our own (not the legacy default stream), so that launches can be captured in graphs.
        let stream = ctx.new_stream().map_err(|e| cuda_err("new_stream", e))?;
        let (major, _) = ctx.compute_capability().map_err(|e| cuda_err("compute capability", e))?;
        let pdl = major >= 9 && std::env::var("KDTREE_PDL").map_or(true, |v| v != "0");
        Ok(Gpu { ctx, stream, kernels, pdl, launches: Default::default() })
    }

    /// Launches `f` on the stream through `cuLaunchKernelEx`. With `pdl` (where the `Gpu` allows it), as a
    /// programmatic dependent launch: the kernel may overlap the stream's previous kernel once that one
    /// executes `griddepcontrol.launch_dependents`, so it must execute `griddepcontrol.wait` before it
    /// reads that kernel's output and before it writes or exits (kernels/moe_int4.cu states the rules).
    /// The attribute only relaxes the order between two kernels: after a copy or a memset the launch waits
    /// as usual. Under graph capture it becomes a programmatic edge between the two kernel nodes.
    pub(crate) fn launch_ex(
        &self,
        name: &'static str,
        f: &CudaFunction,
        cfg: LaunchConfig,
        args: &mut KernelArgs<'_>,
        pdl: bool,
    ) -> Result<()> {
        let mut params: Vec<*mut c_void> = args.slots.iter_mut().map(|s| s as *mut u64 as *mut c_void).collect();
        // SAFETY: CUlaunchAttribute is plain C data; all zeros is a valid value (and zeroes its padding).
        let mut attr: sys::CUlaunchAttribute = unsafe { std::mem::zeroed() };
        attr.id = sys::CUlaunchAttributeID::CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION;
        attr.value.programmaticStreamSerializationAllowed = 1;
        let config = sys::CUlaunchConfig {
            gridDimX: cfg.grid_dim.0,
            gridDimY: cfg.grid_dim.1,
            gridDimZ: cfg.grid_dim.2,
            blockDimX: cfg.block_dim.0,
            blockDimY: cfg.block_dim.1,
            blockDimZ: cfg.block_dim.2,
            sharedMemBytes: cfg.shared_mem_bytes,
            hStream: self.stream.cu_stream(),
            attrs: &mut attr,
            numAttrs: u32::from(pdl && self.pdl),
        };
        self.ctx.bind_to_thread().map_err(|e| cuda_err(name, e))?;
        // SAFETY: `params` holds one pointer per kernel argument, each to a live slot of `args` holding
        // the argument's value; the caller passes them in the kernel's order and types.
        unsafe { sys::cuLaunchKernelEx(&config, f.cu_function(), params.as_mut_ptr(), std::ptr::null_mut()) }
            .result()
            .map_err(|e| cuda_err(name, e))?;
        self.after_launch(name)
    }

    /// The device's name, e.g. "NVIDIA H200".
    pub fn name(&self) -> Result<String> {
        self.ctx.name().map_err(|e| cuda_err("device name", e))
    }

    /// Kernel launches queued or recorded on this `Gpu` so far (every launcher counts through its
    /// launch check), e.g. to count the launches of a step.
    pub fn launches(&self) -> u64 {
        self.launches.load(std::sync::atomic::Ordering::Relaxed)
    }

    /// The context of the device.
    pub fn context(&self) -> &Arc<CudaContext> {
        &self.ctx
    }

    /// The stream every launch of this `Gpu` goes to.
    pub fn stream(&self) -> &Arc<CudaStream> {
        &self.stream
    }

    /// Waits for all queued work.
    pub fn synchronize(&self) -> Result<()> {
        self.stream.synchronize().map_err(|e| cuda_err("synchronize", e))
    }

    /// Copies a host slice to a new device buffer.
    pub fn upload<T: DeviceRepr>(&self, host: &[T]) -> Result<CudaSlice<T>> {
        self.stream.clone_htod(host).map_err(|e| cuda_err("upload", e))
    }

    /// Copies a device buffer back to the host (synchronizes).
    pub fn download<T: DeviceRepr>(&self, dev: &CudaSlice<T>) -> Result<Vec<T>> {
        self.stream.clone_dtoh(dev).map_err(|e| cuda_err("download", e))
    }

    /// A zeroed device buffer of `len` elements.
    pub fn zeros<T: DeviceRepr + ValidAsZeroBits>(&self, len: usize) -> Result<CudaSlice<T>> {
        self.stream.alloc_zeros(len.max(1)).map_err(|e| cuda_err("alloc_zeros", e))
    }

    /// Uploads host logits.
    pub fn upload_logits(&self, logits: crate::types::Logits) -> Result<OwnedDeviceLogits> {
        Ok(match logits {
            crate::types::Logits::F32(x) => OwnedDeviceLogits::F32(self.upload(x)?),
            crate::types::Logits::Bf16(x) => OwnedDeviceLogits::Bf16(self.upload(x)?),
        })
    }

    /// Counts the launch just queued; in debug builds, waits for it and reports any fault under the kernel's
    /// name.
    ///
    /// While the stream is being captured into a CUDA graph the launch was only recorded, not run, and a
    /// synchronize is not allowed (it fails and invalidates the capture), so it is skipped: the launch's
    /// own result (checked by the caller) says whether the capture took the launch, and the capture status
    /// read here must still be active, since a rejected operation invalidates it. A fault of the kernel
    /// itself shows when the graph is replayed. In release builds nothing is checked here.
    fn after_launch(&self, kernel: &'static str) -> Result<()> {
        use sys::CUstreamCaptureStatus as Capture;
        self.launches.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        if !cfg!(debug_assertions) {
            return Ok(());
        }
        // cuStreamIsCapturing is one of the calls allowed during a capture (it does not invalidate it).
        match self.stream.capture_status().map_err(|e| cuda_err(kernel, e))? {
            Capture::CU_STREAM_CAPTURE_STATUS_NONE => self.stream.synchronize().map_err(|e| cuda_err(kernel, e)),
            Capture::CU_STREAM_CAPTURE_STATUS_ACTIVE => Ok(()),
            Capture::CU_STREAM_CAPTURE_STATUS_INVALIDATED => Err(Error::Cuda {
                context: kernel,
                detail: "the stream's graph capture was invalidated (an operation the capture does not allow)".into(),
            }),
        }
    }
}

/// Maps a driver error to the crate's error, naming the operation.
pub(crate) fn cuda_err(context: &'static str, e: DriverError) -> Error {
    Error::Cuda { context, detail: e.to_string() }
}

/// Turns the per-row status words of a validating kernel into the first error they report.
pub(crate) fn status_error(name: &'static str, status: &[i32]) -> Result<()> {
    let Some((row, &bits)) = status.iter().enumerate().find(|(_, &s)| s != 0) else { return Ok(()) };
    let problem = if bits & STATUS_NAN != 0 {
        "NaN logit"
    } else if bits & STATUS_POS_INF != 0 {
        "+inf logit"
    } else if bits & STATUS_NO_FINITE != 0 {
        "no finite logit in the row"
    } else {
        "invalid value"
    };
    Err(Error::Logits { name, row, problem })
}

/// Checks that a device pointer is `align`-byte aligned (for kernels that load in vectors), naming it.
pub(crate) fn check_aligned(name: &'static str, ptr: u64, align: u64) -> Result<()> {
    if ptr.is_multiple_of(align) {
        return Ok(());
    }
    Err(Error::param(name, format!("{ptr:#x}"), format!("device pointer must be {align}-byte aligned")))
}

/// Converts a size to the i32 the kernels take, naming it when it does not fit.
pub(crate) fn to_i32(name: &'static str, v: usize) -> Result<i32> {
    i32::try_from(v).map_err(|_| Error::param(name, v, "does not fit the kernels' 32-bit sizes"))
}
