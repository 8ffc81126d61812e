//! The library's error type: every bad input gets a variant that names the problem.

use std::path::PathBuf;

/// Errors returned by every fallible operation of the crate.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// An array's length does not match the shape it was declared with.
    #[error("shape mismatch for `{name}`: expected {expected} elements ({shape}), got {actual}")]
    Shape {
        /// The argument's name.
        name: &'static str,
        /// The expected shape, e.g. "[bs=2, L=15, V=32000]".
        shape: String,
        /// Expected element count.
        expected: usize,
        /// Actual element count.
        actual: usize,
    },
    /// A size or parameter is outside what the operation supports.
    #[error("invalid parameter `{name}` = {value}: {reason}")]
    Param {
        /// The parameter's name.
        name: &'static str,
        /// Its value, formatted.
        value: String,
        /// What the operation needs instead.
        reason: String,
    },
    /// Logits held NaN, +inf, or no finite value in a row.
    #[error("invalid logits in `{name}` row {row}: {problem}")]
    Logits {
        /// The argument's name.
        name: &'static str,
        /// For top-K, the flattened (request, draft position) row; for tree build and greedy accept, the
        /// request (the CUDA kernels report per request there); for MoE routing on the device, 0 (the
        /// kernel reports that some token's logits were bad, not which).
        row: usize,
        /// What was wrong.
        problem: &'static str,
    },
    /// An index argument (token, row, page) points outside its range.
    #[error("index out of range in `{name}`: {detail}")]
    Index {
        /// The argument's name.
        name: &'static str,
        /// Which entry and what the valid range is.
        detail: String,
    },
    /// A fixture or other data file could not be read or has the wrong dtype.
    #[error("data file {path}: {detail}")]
    Data {
        /// The file.
        path: PathBuf,
        /// What went wrong.
        detail: String,
    },
    /// No CUDA driver or device is available.
    #[error("no CUDA device: {0}")]
    NoDevice(String),
    /// A CUDA driver call failed.
    #[error("CUDA error in {context}: {detail}")]
    Cuda {
        /// The operation that failed.
        context: &'static str,
        /// The driver's message.
        detail: String,
    },
}

/// Result alias used throughout the crate.
pub type Result<T> = std::result::Result<T, Error>;

impl Error {
    /// Shape error helper: `name` should have `expected` elements for `shape`.
    pub fn shape(name: &'static str, shape: String, expected: usize, actual: usize) -> Self {
        Error::Shape { name, shape, expected, actual }
    }

    /// Parameter error helper.
    pub fn param(name: &'static str, value: impl ToString, reason: impl Into<String>) -> Self {
        Error::Param { name, value: value.to_string(), reason: reason.into() }
    }
}

/// Checks that `actual` equals the element count of `dims`, naming the argument and its shape otherwise.
pub fn check_len(name: &'static str, actual: usize, dims: &[(&str, usize)]) -> Result<()> {
    let shape = || format!("[{}]", dims.iter().map(|(n, d)| format!("{n}={d}")).collect::<Vec<_>>().join(", "));
    let expected = dims
        .iter()
        .try_fold(1usize, |acc, (_, d)| acc.checked_mul(*d))
        .ok_or_else(|| Error::param(name, shape(), "the shape's element count overflows usize"))?;
    if actual == expected {
        return Ok(());
    }
    Err(Error::shape(name, shape(), expected, actual))
}
