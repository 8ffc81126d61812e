//! Builds DDTree draft trees from drafter logits and prints them: top-K with logsumexp over the
//! vocabulary, then the best-first tree, on the CPU or (with `--features cuda` and `--gpu`) the GPU.
//!
//! ```text
//! cargo run --release --example build_tree -- --budget 24
//! cargo run --release --features cuda --example build_tree -- --gpu
//! ```
//! The logits come from a top-K fixture (`fixtures/topk/<case>`, default a bs 2, L 15, V 4096 case).

use std::path::PathBuf;
use std::time::Instant;

use clap::Parser;
use kdtree_engine::cpu;
use kdtree_engine::fixture::Fixture;
use kdtree_engine::types::top_k_for;
use kdtree_engine::{DraftTree, Result, TopK, TreeShape};

#[derive(Parser, Debug)]
#[command(about = "Build DDTree draft trees from drafter logits and print them")]
struct Args {
    /// A top-K fixture directory holding `logits.npy` and `meta.json`.
    #[arg(long, default_value = "fixtures/topk/real_bs2_l15_v4096_b16")]
    fixture: PathBuf,
    /// Tree budget B (draft nodes, root excluded).
    #[arg(long, default_value_t = 16)]
    budget: usize,
    /// Token of the root (the bonus token of the previous step).
    #[arg(long, default_value_t = 0)]
    root_token: i32,
    /// Tokens already in the cache (positions start here).
    #[arg(long, default_value_t = 100)]
    seq_len: i32,
    /// Run on the GPU (needs `--features cuda` and a CUDA device).
    #[arg(long)]
    gpu: bool,
}

fn main() {
    if let Err(e) = run(Args::parse()) {
        eprintln!("error: {e}");
        std::process::exit(1);
    }
}

fn run(args: Args) -> Result<()> {
    let case = Fixture::open(&args.fixture)?;
    let (bs, depth, vocab) = (case.usize("bs")?, case.usize("L")?, case.usize("V")?);
    let logits = case.logits("logits")?;
    let shape = TreeShape::new(bs, depth, args.budget)?;
    let k = top_k_for(args.budget, vocab, None);
    let (root, seq) = (vec![args.root_token; bs], vec![args.seq_len; bs]);
    let start = Instant::now();
    let (top, tree, backend) = if args.gpu {
        gpu_build(&logits, shape, vocab, k, &root, &seq)?
    } else {
        let top = cpu::topk::topk_logsumexp(logits.view(), bs, depth, vocab, k)?;
        let tree = cpu::tree_build::build_trees(shape, k, &top.ids, &top.logp, &root, &seq)?;
        (top, tree, "cpu")
    };
    let elapsed = start.elapsed();
    println!(
        "{} ({}): bs {bs}, L {depth}, V {vocab}, B {}, K {k}: top-K + tree in {:.2} ms on the {backend}",
        args.fixture.display(),
        logits.view().dtype(),
        args.budget,
        elapsed.as_secs_f64() * 1e3
    );
    for b in 0..bs {
        print_tree(&tree, &top, b);
    }
    Ok(())
}

#[cfg(feature = "cuda")]
fn gpu_build(
    logits: &kdtree_engine::fixture::OwnedLogits,
    shape: TreeShape,
    vocab: usize,
    k: usize,
    root: &[i32],
    seq: &[i32],
) -> Result<(TopK, DraftTree, &'static str)> {
    let gpu = kdtree_engine::cuda::Gpu::new(0)?;
    let top = gpu.topk_logsumexp(logits.view(), shape.bs, shape.depth, vocab, k)?;
    let tree = gpu.build_trees(shape, k, &top.ids, &top.logp, root, seq)?;
    Ok((top, tree, "gpu"))
}

#[cfg(not(feature = "cuda"))]
fn gpu_build(
    _: &kdtree_engine::fixture::OwnedLogits,
    _: TreeShape,
    _: usize,
    _: usize,
    _: &[i32],
    _: &[i32],
) -> Result<(TopK, DraftTree, &'static str)> {
    Err(kdtree_engine::Error::NoDevice("this build has no CUDA backend; rebuild with `--features cuda`".into()))
}

/// Prints request `b`'s tree depth-first: each node's row, token, draft log-prob and path probability.
fn print_tree(tree: &DraftTree, top: &TopK, b: usize) {
    let rows = tree.request_rows(b);
    let n = tree.num_nodes[b];
    let expected: f64 = (1..=n as usize).map(|i| path_logp(tree, top, b, i).exp()).sum();
    println!("request {b}: {n} draft nodes, expected accepted length under the draft {expected:.3}");
    let mut stack = vec![(0usize, 0usize)];
    while let Some((row, indent)) = stack.pop() {
        let token = tree.node_token[rows.start + row];
        if row == 0 {
            println!("  [0] root token {token}");
        } else {
            let p = path_logp(tree, top, b, row).exp();
            let pad = "  ".repeat(indent + 1);
            println!("{pad}[{row}] token {token:>6}  depth {}  path prob {p:.4}", tree.node_depth[rows.start + row]);
        }
        let mut children = vec![];
        let mut c = tree.first_child[rows.start + row];
        while c >= 0 {
            children.push(c as usize);
            c = tree.next_sibling[rows.start + c as usize];
        }
        stack.extend(children.into_iter().rev().map(|c| (c, indent + 1)));
    }
}

/// Sum of the draft log-probs along the path to `row` (the score the tree was built by).
fn path_logp(tree: &DraftTree, top: &TopK, b: usize, mut row: usize) -> f64 {
    let base = tree.request_rows(b).start;
    let mut sum = 0.0;
    while row > 0 {
        let d = tree.node_depth[base + row] as usize;
        let token = tree.node_token[base + row];
        let at = (b * top.depth + d - 1) * top.k;
        let rank = top.ids[at..at + top.k].iter().position(|&t| t == token).unwrap_or(0);
        sum += top.logp[at + rank] as f64;
        row = tree.parent[base + row] as usize;
    }
    sum
}
