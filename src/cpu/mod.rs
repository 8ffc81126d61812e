//! Pure-Rust reference of every kernel, also the CPU backend. Rows are independent, so the big loops
//! run in parallel over rows with rayon; each row's arithmetic is sequential and fixed, so the results
//! do not depend on the thread count.

pub mod backend;
pub mod gemm_bf16;
pub mod greedy_accept;
pub mod kv_compact;
pub mod mla;
pub mod moe_int4;
pub mod rowops;
pub mod topk;
pub mod tree_build;

/// Maps f32 bits to a u32 whose unsigned order is the float order (-inf lowest); same as the kernels.
/// Adding +0.0 first reads -0.0 as +0.0, as the contract says.
#[inline]
pub fn order_key(v: f32) -> u32 {
    let b = (v + 0.0).to_bits();
    if b & 0x8000_0000 != 0 {
        !b
    } else {
        b | 0x8000_0000
    }
}

/// Composite key that orders by value descending, then index ascending, when compared as u64.
#[inline]
pub fn composite_key(v: f32, index: u32) -> u64 {
    ((order_key(v) as u64) << 32) | (!index) as u64
}
