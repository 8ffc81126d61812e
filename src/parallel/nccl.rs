//! The rank-order sum over GPUs through NCCL, loaded at run time like the driver.
//!
//! NCCL's own all-reduce may add the ranks' values in an order that depends on the algorithm it picks
//! (ring, tree) and so on the message size, which is the batch size here. To keep a row's result
//! independent of its batch, [`NcclGroup`] instead gathers every rank's partial sums (an all-gather,
//! which moves the same bytes as the two halves of a ring all-reduce) and adds them on each GPU in rank
//! order with the backend's own `add` kernel.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Mutex, PoisonError};

use cudarc::driver::CudaSlice;
use cudarc::nccl::safe::Comm;

use super::{aborted, Collective, Shard};
use crate::cuda::backend::CudaBackend;
use crate::cuda::rowops;
use crate::error::{Error, Result};
use crate::model::backend::Backend;

/// One GPU's place in a group of GPUs of this process that sum through NCCL.
pub struct NcclGroup {
    shard: Shard,
    state: Mutex<State>,
    /// Bumped whenever `gathered` is reallocated (a recorded graph holds its address).
    epoch: AtomicU64,
    aborted: AtomicBool,
}

struct State {
    comm: Comm,
    /// Every rank's `x[..n]`, rank 0 first: `[world, capacity]` used as `[world, n]`.
    gathered: Option<CudaSlice<f32>>,
}

// SAFETY: an NCCL communicator may be used from any thread as long as calls on it are not made from two
// threads at once; every use of `comm` is behind the mutex.
unsafe impl Send for State {}

fn nccl_err(context: &'static str, e: cudarc::nccl::result::NcclError) -> Error {
    Error::Cuda { context, detail: format!("{e:?}") }
}

impl NcclGroup {
    /// One communicator per backend (each on its own GPU, rank order = slice order), on the backends'
    /// streams; `Error::NoDevice` when the NCCL library cannot be loaded (it is looked for as
    /// `libnccl.so` and `libnccl.so.<CUDA major>` on the loader's path).
    pub fn new(backends: &[CudaBackend]) -> Result<Vec<NcclGroup>> {
        if backends.is_empty() {
            return Err(Error::param("backends", 0, "a group needs at least one GPU"));
        }
        // SAFETY: only tries to open the library.
        if !unsafe { cudarc::nccl::sys::is_culib_present() } {
            return Err(Error::NoDevice("the NCCL library (libnccl.so) is not on the loader's path".into()));
        }
        let streams = backends.iter().map(|b| b.gpu().stream().clone()).collect();
        let comms = Comm::from_devices(streams).map_err(|e| nccl_err("ncclCommInitAll", e))?;
        let world = comms.len();
        Ok(comms
            .into_iter()
            .enumerate()
            .map(|(rank, comm)| NcclGroup {
                shard: Shard { rank, world },
                state: Mutex::new(State { comm, gathered: None }),
                epoch: AtomicU64::new(0),
                aborted: AtomicBool::new(false),
            })
            .collect())
    }
}

impl Collective<CudaBackend> for NcclGroup {
    fn shard(&self) -> Shard {
        self.shard
    }

    fn all_reduce(&self, backend: &CudaBackend, x: &mut CudaSlice<f32>, n: usize) -> Result<()> {
        if self.aborted.load(Ordering::Acquire) {
            return Err(aborted());
        }
        if n == 0 {
            return Ok(());
        }
        if x.len() < n {
            return Err(Error::param("x", x.len(), format!("must hold the {n} elements to sum")));
        }
        let world = self.shard.world;
        let mut state = self.state.lock().unwrap_or_else(PoisonError::into_inner);
        let State { comm, gathered } = &mut *state;
        if gathered.as_ref().is_none_or(|g| g.len() < world * n) {
            *gathered = None; // free the old buffer before allocating the new one
            *gathered = Some(backend.zeros(world * n)?);
            self.epoch.fetch_add(1, Ordering::Relaxed);
        }
        let gathered = gathered.as_mut().expect("allocated above");
        comm.all_gather(&x.slice(..n), &mut gathered.slice_mut(..world * n))
            .map_err(|e| nccl_err("ncclAllGather", e))?;
        let gpu = backend.gpu();
        gpu.stream()
            .memcpy_dtod(&gathered.slice(..n), &mut x.slice_mut(..n))
            .map_err(|e| crate::cuda::cuda_err("copy rank 0's part", e))?;
        for rank in 1..world {
            rowops::add(gpu, &mut x.slice_mut(..n), &gathered.slice(rank * n..(rank + 1) * n), n)?;
        }
        Ok(())
    }

    fn all_gather(&self, _backend: &CudaBackend, x: &CudaSlice<f32>, n: usize, out: &mut CudaSlice<f32>) -> Result<()> {
        if self.aborted.load(Ordering::Acquire) {
            return Err(aborted());
        }
        let world = self.shard.world;
        if n == 0 {
            return Ok(());
        }
        if x.len() < n || out.len() < world * n {
            return Err(Error::param(
                "x / out",
                format!("{} / {}", x.len(), out.len()),
                format!("must hold {n} / {world} × {n} elements"),
            ));
        }
        let state = self.state.lock().unwrap_or_else(PoisonError::into_inner);
        state
            .comm
            .all_gather(&x.slice(..n), &mut out.slice_mut(..world * n))
            .map_err(|e| nccl_err("ncclAllGather", e))?;
        Ok(())
    }

    fn epoch(&self) -> u64 {
        self.epoch.load(Ordering::Relaxed)
    }

    /// Later sums on this rank fail at once. A peer already inside NCCL keeps waiting for this rank:
    /// NCCL's only way out of a posted collective is `ncclCommAbort`, which ends the communicator for
    /// good. The ranks run the same checks on the same shapes, so an input error fails every rank before
    /// the same sum; what this does not cover is a failure of one GPU alone (out of memory, a fault).
    fn abort(&self) {
        self.aborted.store(true, Ordering::Release);
    }

    fn reset(&self) {
        self.aborted.store(false, Ordering::Release);
    }
}
