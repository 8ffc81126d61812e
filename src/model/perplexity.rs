//! Held-out perplexity: a token stream cut into consecutive windows, each read from its start in one
//! prefill, the negative log-likelihood of every token after a window's first summed in f64. The same
//! windows as `train/common.py`'s `window_nll`, so the engine's number and PyTorch's compare directly.

use crate::error::{Error, Result};
use crate::model::backend::Backend;
use crate::model::{Logits, Model};

/// Windows prefilled together in one step.
const WINDOWS_PER_STEP: usize = 8;

/// Per window of `window` tokens (the tail shorter than a window dropped, at most `max_windows` of them):
/// the summed negative log-likelihood of tokens 1.. given the tokens before them, in nats. Calls
/// `progress(done, total)` after each step.
pub fn window_nll<B: Backend>(
    model: &Model<B>,
    tokens: &[u32],
    window: usize,
    max_windows: Option<usize>,
    progress: impl FnMut(usize, usize),
) -> Result<Vec<f64>> {
    let nll = token_nll(model, tokens, window, max_windows, progress)?;
    Ok(nll.chunks(window - 1).map(|w| w.iter().sum()).collect())
}

/// Like [`window_nll`], but every predicted token's negative log-likelihood: `window - 1` values per
/// window, windows in order.
pub fn token_nll<B: Backend>(
    model: &Model<B>,
    tokens: &[u32],
    window: usize,
    max_windows: Option<usize>,
    mut progress: impl FnMut(usize, usize),
) -> Result<Vec<f64>> {
    let vocab = model.config().vocab_size;
    if window < 2 || window > model.config().max_position_embeddings {
        return Err(Error::param(
            "window",
            window,
            format!("must be in 2..={} (the model's context)", model.config().max_position_embeddings),
        ));
    }
    if let Some(&bad) = tokens.iter().find(|&&t| t as usize >= vocab) {
        return Err(Error::param("tokens", bad, format!("a token id outside the vocabulary of {vocab}")));
    }
    let total = (tokens.len() / window).min(max_windows.unwrap_or(usize::MAX));
    if total == 0 {
        return Err(Error::param("tokens", tokens.len(), format!("fewer than one window of {window} tokens")));
    }
    let page = 16;
    let pages = WINDOWS_PER_STEP * window.div_ceil(page);
    let mut cache = model.new_cache(pages, page, window)?;
    let mut nll = Vec::with_capacity(total * (window - 1));
    for first in (0..total).step_by(WINDOWS_PER_STEP) {
        let group: Vec<&[u32]> =
            (first..(first + WINDOWS_PER_STEP).min(total)).map(|w| &tokens[w * window..(w + 1) * window]).collect();
        let seqs: Vec<usize> = group.iter().map(|_| cache.add_sequence()).collect();
        let batch: Vec<(usize, &[u32])> = seqs.iter().copied().zip(group.iter().copied()).collect();
        let logits = model.forward(&mut cache, &batch, Logits::All)?;
        for (w, ids) in group.iter().enumerate() {
            let rows = &logits[w * window * vocab..(w + 1) * window * vocab];
            nll.extend((1..window).map(|i| -log_softmax_at(&rows[(i - 1) * vocab..i * vocab], ids[i])));
        }
        for s in seqs {
            cache.remove_sequence(s)?;
        }
        progress(nll.len() / (window - 1), total);
    }
    Ok(nll)
}

/// `exp(Σ nll / Σ predicted tokens)` of [`window_nll`]'s windows.
pub fn perplexity(nll: &[f64], window: usize) -> f64 {
    (nll.iter().sum::<f64>() / (nll.len() * (window - 1)) as f64).exp()
}

/// `log softmax(row)[token]` in f64.
fn log_softmax_at(row: &[f32], token: u32) -> f64 {
    let max = row.iter().fold(f32::NEG_INFINITY, |m, &x| m.max(x)) as f64;
    let sum: f64 = row.iter().map(|&x| (x as f64 - max).exp()).sum();
    row[token as usize] as f64 - max - sum.ln()
}
