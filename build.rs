//! Compiles `kernels/*.cu` into one fatbin (only with the `cuda` feature) that `src/cuda` embeds.
//!
//! nvcc comes from `$NVCC`, else `nvcc` on `PATH` (`scripts/install-nvcc.sh` installs the pinned wheels).
//! Architectures come from `$KDTREE_CUDA_ARCHS` (default `90,120`): SASS for each, PTX for the last one,
//! never from the local GPU, so that machines without one build the same fatbin.

use std::env;
use std::fs;
use std::path::{Path, PathBuf};
use std::process::Command;

const DEFAULT_ARCHS: &str = "90,120";

fn main() {
    println!("cargo:rerun-if-changed=build.rs");
    if env::var_os("CARGO_FEATURE_CUDA").is_none() {
        return;
    }
    println!("cargo:rerun-if-changed=kernels");
    println!("cargo:rerun-if-env-changed=NVCC");
    println!("cargo:rerun-if-env-changed=KDTREE_CUDA_ARCHS");

    let out_dir = PathBuf::from(env::var("OUT_DIR").expect("cargo sets OUT_DIR"));
    // Read when the script runs, not baked in when it is compiled: cargo may reuse one compiled build
    // script for checkouts of the crate in other places (worktrees sharing a target folder).
    let manifest_dir = PathBuf::from(env::var("CARGO_MANIFEST_DIR").expect("cargo sets CARGO_MANIFEST_DIR"));
    let kernels = manifest_dir.join("kernels");
    let unity = write_unity_source(&kernels, &out_dir);
    let fatbin = out_dir.join("kernels.fatbin");
    let archs = env::var("KDTREE_CUDA_ARCHS").unwrap_or_else(|_| DEFAULT_ARCHS.to_string());

    let nvcc = env::var("NVCC").unwrap_or_else(|_| "nvcc".to_string());
    let mut cmd = Command::new(&nvcc);
    cmd.arg("-fatbin")
        .args(["-O3", "-std=c++17", "-Xptxas", "-warn-spills", "-lineinfo"])
        .arg(format!("-I{}", kernels.display()))
        .args(gencode_flags(&archs))
        .arg("-o")
        .arg(&fatbin)
        .arg(&unity);
    let status = cmd.status().unwrap_or_else(|e| {
        panic!(
            "could not run nvcc ({nvcc}): {e}.\nThe `cuda` feature compiles kernels/*.cu with nvcc. Install the \
             pinned toolchain with `scripts/install-nvcc.sh` and set NVCC to the path it prints."
        )
    });
    assert!(status.success(), "nvcc failed ({status}) compiling kernels/*.cu");
}

/// One translation unit that includes every kernel family, so that a single nvcc call yields one fatbin.
fn write_unity_source(kernels: &Path, out_dir: &Path) -> PathBuf {
    let mut sources: Vec<PathBuf> = fs::read_dir(kernels)
        .expect("kernels/ exists")
        .map(|entry| entry.expect("readable kernels/ entry").path())
        .filter(|path| path.extension().is_some_and(|ext| ext == "cu"))
        .collect();
    sources.sort();
    let body: String = sources.iter().map(|path| format!("#include \"{}\"\n", path.display())).collect();
    let unity = out_dir.join("kernels_all.cu");
    fs::write(&unity, body).expect("write the unity source to OUT_DIR");
    unity
}

/// SASS for every listed architecture plus PTX for the newest, e.g. "90,120".
fn gencode_flags(archs: &str) -> Vec<String> {
    let list: Vec<&str> = archs.split(',').map(str::trim).filter(|a| !a.is_empty()).collect();
    assert!(!list.is_empty(), "KDTREE_CUDA_ARCHS is empty; expected e.g. \"90,120\"");
    let mut flags: Vec<String> = list.iter().map(|a| format!("-gencode=arch=compute_{a},code=sm_{a}")).collect();
    let newest = list.last().expect("non-empty list");
    flags.push(format!("-gencode=arch=compute_{newest},code=compute_{newest}"));
    flags
}
