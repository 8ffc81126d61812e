//! kdtree-engine: speculative decoding with DDTree draft trees for Kimi-K2 / DeepSeek-V3 style models.
//!
//! Every kernel exists three times: an independent numpy reference (`reference/`), the pure-Rust CPU
//! reference in [`cpu`] (also the CPU backend), and the CUDA kernels in `kernels/` launched by `cuda`
//! (feature `cuda`). The kernels here are the discrete DDTree pieces of `DESIGN.md` §4.1–4.2:
//!
//! - top-K with logsumexp over the draft vocabulary ([`cpu::topk`]),
//! - the best-first tree build with visibility bitmask and sibling lists ([`cpu::tree_build`]),
//! - the greedy accept walk over the target's argmax ([`cpu::greedy_accept`]),
//! - the in-place KV-cache compaction after acceptance ([`cpu::kv_compact`]).
//!
//! They are bit-exact across the three implementations; `reference/README.md` states the exact contract.
//!
//! ```
//! use kdtree_engine::{cpu, Logits, TreeShape};
//! // One request, L = 2 draft positions over a 4-token vocabulary.
//! let logits = [2.0f32, 1.0, 0.5, 0.0, /* position 2 */ 0.1, 3.0, 0.2, 0.3];
//! let top = cpu::topk::topk_logsumexp(Logits::F32(&logits), 1, 2, 4, 3).unwrap();
//! assert_eq!(&top.ids[..3], &[0, 1, 2]);
//! let shape = TreeShape::new(1, 2, 3).unwrap();
//! let tree = cpu::tree_build::build_trees(shape, 3, &top.ids, &top.logp, &[7], &[100]).unwrap();
//! assert_eq!(tree.num_nodes[0], 3);
//! assert_eq!(tree.node_token[..4], [7, 0, 1, 1]); // root, token 0, its child 1, then sibling token 1
//! ```

#![warn(missing_docs)]

#[cfg(all(feature = "int4-native", feature = "int4-tiled"))]
compile_error!(
    "features `int4-native` and `int4-tiled` are exclusive; for the tiled layout build with \
     `--no-default-features --features int4-tiled`"
);
#[cfg(not(any(feature = "int4-native", feature = "int4-tiled")))]
compile_error!("enable exactly one INT4 layout feature: `int4-native` (default) or `int4-tiled`");
#[cfg(any(
    all(feature = "cuda-12080", feature = "cuda-12090"),
    all(feature = "cuda-12080", feature = "cuda-13000"),
    all(feature = "cuda-12090", feature = "cuda-13000"),
))]
compile_error!("enable at most one CUDA version feature: `cuda-12080`, `cuda-12090` or `cuda-13000`");

pub mod cpu;
#[cfg(feature = "cuda")]
pub mod cuda;
pub mod error;
pub mod fixture;
pub mod model;
pub mod parallel;
pub mod server;
pub mod spec;
pub mod types;

pub use error::{Error, Result};
pub use types::{Acceptance, DraftTree, KvLayout, Logits, TopK, TreeShape, MAX_TREE_K};

/// Largest tree budget B (draft nodes, root excluded) that every backend supports. The CUDA kernels are
/// sized for it: the tree build's frontier holds 2B + 1 slots in 33 registers per lane, greedy accept
/// keeps up to 520 rows in shared memory.
pub const MAX_BUDGET: usize = 512;
/// Largest number of draft positions L (the tree's depth).
pub const MAX_DEPTH: usize = 63;
/// Vocabulary sizes must stay below this (reference/README.md, top-K contract).
pub const MAX_VOCAB: usize = 1 << 19;
