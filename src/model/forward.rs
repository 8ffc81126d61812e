//! The DeepSeek-V3 / Kimi-K2 forward pass over a paged latent KV cache: embedding, per layer RMSNorm → MLA
//! (absorbed, through [`Ops::attention`]) → RMSNorm → dense MLP or MoE, final norm, lm_head.
//!
//! One call takes any mix of sequences and new tokens: a prefill is many tokens of one sequence, a decode
//! step one token of each. Every token is its own attention row over its sequence's slots `0 ..= position`
//! (the cache rows of the call's tokens are written first), so a prefill gives the bits of token-by-token
//! decoding and a token's logits do not depend on what else is in the batch.

use std::path::Path;

use half::bf16;
use indicatif::{ProgressBar, ProgressStyle};

use crate::cpu::mla::{PagedCache, LATENT, ROPE, ROW};
use crate::error::{Error, Result};
use crate::model::config::Config;
use crate::model::layers::{Linear, MlaWeights, Mlp, Moe, RmsNorm};
use crate::model::ops::{CpuOps, Ops};
use crate::model::rope::Rope;
use crate::model::weights::Checkpoint;
use crate::types::KvLayout;

/// Checkpoints at least this large show a loading progress bar (on a terminal).
const PROGRESS_BYTES: u64 = 1 << 30;

/// A layer's feed-forward block.
#[derive(Clone, Debug)]
enum FeedForward {
    Dense(Mlp),
    Moe(Box<Moe>),
}

/// One decoder layer's weights.
#[derive(Clone, Debug)]
struct Layer {
    input_norm: RmsNorm,
    attn: MlaWeights,
    post_attn_norm: RmsNorm,
    ffn: FeedForward,
}

/// The model: config, weights and the backend that runs the heavy operations.
pub struct Model {
    config: Config,
    embed: Vec<bf16>,
    layers: Vec<Layer>,
    norm: RmsNorm,
    lm_head: Linear,
    rope: Rope,
    ops: Box<dyn Ops + Send>,
}

/// Which positions of a forward call get logits.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Logits {
    /// Every token of the call, in call order.
    All,
    /// The last token of each sequence in the call (sequences given no tokens get no row).
    Last,
}

impl Model {
    /// Loads `config.json` and the safetensors of a checkpoint directory, for the CPU backend.
    pub fn load(dir: impl AsRef<Path>) -> Result<Self> {
        Self::load_on(dir, Box::new(CpuOps))
    }

    /// Loads a checkpoint directory for the backend `ops` (e.g. `CudaOps` of [`crate::model::ops`] with the
    /// `cuda` feature).
    pub fn load_on(dir: impl AsRef<Path>, ops: Box<dyn Ops + Send>) -> Result<Self> {
        let dir = dir.as_ref();
        let config = Config::from_file(dir.join("config.json"))?;
        let ckpt = Checkpoint::open(dir)?;
        Self::from_checkpoint(config, &ckpt, ops)
    }

    /// Builds the model from a checked config and an open checkpoint, running on `ops`.
    pub fn from_checkpoint(config: Config, ckpt: &Checkpoint, ops: Box<dyn Ops + Send>) -> Result<Self> {
        let c = &config;
        if c.qk_rope_head_dim != ROPE || c.kv_lora_rank != LATENT {
            return Err(Error::param(
                "kv_lora_rank / qk_rope_head_dim",
                c.kv_lora_rank,
                "the MLA kernels need 512 / 64",
            ));
        }
        let bar = if ckpt.size_bytes() >= PROGRESS_BYTES {
            let bar = ProgressBar::new(c.num_hidden_layers as u64);
            if let Ok(style) = ProgressStyle::with_template("loading layers {bar:40} {pos}/{len} {elapsed}") {
                bar.set_style(style);
            }
            bar
        } else {
            ProgressBar::hidden()
        };
        let mut layers = Vec::with_capacity(c.num_hidden_layers);
        for i in 0..c.num_hidden_layers {
            layers.push(load_layer(ckpt, c, i)?);
            bar.inc(1);
        }
        bar.finish_and_clear();
        let (v, h) = (c.vocab_size, c.hidden_size);
        let embed = ckpt.bf16("model.embed_tokens.weight", &[v, h])?;
        let lm_head = if c.tie_word_embeddings {
            Linear::new(embed.clone(), v, h)?
        } else {
            Linear::load(ckpt, "lm_head.weight", v, h)?
        };
        Ok(Model {
            embed,
            norm: RmsNorm::load(ckpt, "model.norm.weight", h, c.rms_norm_eps)?,
            lm_head,
            layers,
            rope: Rope::new(c)?,
            config,
            ops,
        })
    }

    /// The model's configuration.
    pub fn config(&self) -> &Config {
        &self.config
    }

    /// A KV cache for this model: `num_pages` pages of `page_size` slots per layer, at most
    /// `max_seq_len` slots per sequence.
    pub fn new_cache(&self, num_pages: usize, page_size: usize, max_seq_len: usize) -> Result<KvCache> {
        KvCache::new(self.config.num_hidden_layers, num_pages, page_size, max_seq_len)
    }

    /// Runs `batch` (sequence id in `cache`, its new tokens) one step: appends the tokens' latent rows to
    /// the cache and returns `[rows, vocab]` float32 logits for the positions `which` asks for.
    pub fn forward(&self, cache: &mut KvCache, batch: &[(usize, &[u32])], which: Logits) -> Result<Vec<f32>> {
        let c = &self.config;
        let mut tokens = Vec::new();
        let mut rows = Vec::new(); // (sequence, position) of every token
        for (i, &(seq, ids)) in batch.iter().enumerate() {
            if batch[..i].iter().any(|&(other, _)| other == seq) {
                return Err(Error::param("batch", seq, "a sequence may appear only once per forward call"));
            }
            let start = cache.len(seq)?;
            cache.reserve(seq, start + ids.len())?;
            for (j, &id) in ids.iter().enumerate() {
                if id as usize >= c.vocab_size {
                    return Err(Error::Index {
                        name: "tokens",
                        detail: format!("token id {id} is outside the vocabulary 0..{}", c.vocab_size),
                    });
                }
                tokens.push(id as usize);
                rows.push((seq, start + j));
            }
        }
        let h = c.hidden_size;
        let mut x: Vec<f32> =
            tokens.iter().flat_map(|&t| self.embed[t * h..(t + 1) * h].iter().map(|v| v.to_f32())).collect();
        for (l, layer) in self.layers.iter().enumerate() {
            let attn = self.attention(layer, l, &layer.input_norm.forward(&x), &rows, cache)?;
            add(&mut x, &attn);
            let normed = layer.post_attn_norm.forward(&x);
            let ffn = match &layer.ffn {
                FeedForward::Dense(mlp) => mlp.forward(&*self.ops, &normed)?,
                FeedForward::Moe(moe) => moe.forward(&*self.ops, &normed)?,
            };
            add(&mut x, &ffn);
        }
        for &(seq, ids) in batch {
            cache.advance(seq, ids.len());
        }
        let picked: Vec<usize> = match which {
            Logits::All => (0..tokens.len()).collect(),
            Logits::Last => {
                let mut end = 0;
                batch
                    .iter()
                    .filter(|(_, ids)| !ids.is_empty())
                    .map(|(_, ids)| {
                        end += ids.len();
                        end - 1
                    })
                    .collect()
            }
        };
        let last: Vec<f32> = picked.iter().flat_map(|&t| x[t * h..(t + 1) * h].iter().copied()).collect();
        self.ops.linear(&self.lm_head, &self.norm.forward(&last))
    }

    /// MLA of one layer for `x [T, h]` (already normed): writes the tokens' `[c_kv | k_pe]` rows to the
    /// cache, attends each token over its sequence's slots up to its own, returns `o_proj`'s output.
    fn attention(
        &self,
        layer: &Layer,
        l: usize,
        x: &[f32],
        rows: &[(usize, usize)],
        cache: &mut KvCache,
    ) -> Result<Vec<f32>> {
        let c = &self.config;
        let w = &layer.attn;
        self.write_latent_rows(w, l, x, rows, cache)?;
        let q_rows = self.absorbed_queries(w, x, rows)?;
        let tables: Vec<i32> =
            rows.iter().map(|&(seq, _)| cache.block_table(seq)).collect::<Result<Vec<_>>>()?.concat();
        let seq_len: Vec<i32> = rows.iter().map(|&(_, pos)| pos as i32 + 1).collect();
        let paged = PagedCache { rows: &cache.layers[l], layout: cache.layout, block_table: &tables };
        let att = self.ops.attention(&q_rows, c.num_attention_heads, &paged, &seq_len, c.softmax_scale() as f32)?;
        // Each (token, head)'s latent output through the head's value rows of kv_b.
        let v = c.v_head_dim;
        let mut o = vec![0f32; att.o.len() / LATENT * v];
        for (r, (out, o_latent)) in o.chunks_mut(v).zip(att.o.chunks(LATENT)).enumerate() {
            w.head_values(o_latent, r % c.num_attention_heads, c, out);
        }
        self.ops.linear(&w.o_proj, &o)
    }

    /// The latent cache rows of the call's tokens: `kv_a_layernorm(c_kv)` and the rotated `k_pe`, in bf16.
    fn write_latent_rows(
        &self,
        w: &MlaWeights,
        l: usize,
        x: &[f32],
        rows: &[(usize, usize)],
        cache: &mut KvCache,
    ) -> Result<()> {
        let kv = self.ops.linear(&w.kv_a, x)?; // [T, 512 + 64]
        let latent: Vec<f32> = kv.chunks(ROW).flat_map(|r| r[..LATENT].iter().copied()).collect();
        let latent = w.kv_a_norm.forward(&latent);
        let mut k_pe = vec![0f32; ROPE];
        for (t, &(seq, pos)) in rows.iter().enumerate() {
            self.rope.apply(&kv[t * ROW + LATENT..(t + 1) * ROW], pos, &mut k_pe);
            let row: Vec<bf16> =
                latent[t * LATENT..(t + 1) * LATENT].iter().chain(&k_pe).map(|&f| bf16::from_f32(f)).collect();
            cache.write_row(l, seq, pos, &row)?;
        }
        Ok(())
    }

    /// The attention's query rows `[T, heads, 512 + 64]` bf16: each head's `q_nope` absorbed through its
    /// key rows of kv_b, then its rotated `q_pe`.
    fn absorbed_queries(&self, w: &MlaWeights, x: &[f32], rows: &[(usize, usize)]) -> Result<Vec<bf16>> {
        let c = &self.config;
        let (heads, nope) = (c.num_attention_heads, c.qk_nope_head_dim);
        let q = w.q.forward(&*self.ops, x)?; // [T, heads, nope + rope]
        let mut q_rows = vec![bf16::ZERO; rows.len() * heads * ROW];
        let mut row = vec![0f32; ROW];
        for (r, (qh, out)) in q.chunks(nope + ROPE).zip(q_rows.chunks_mut(ROW)).enumerate() {
            w.absorb_query(&qh[..nope], r % heads, c, &mut row[..LATENT]);
            self.rope.apply(&qh[nope..], rows[r / heads].1, &mut row[LATENT..]);
            out.iter_mut().zip(&row).for_each(|(o, &f)| *o = bf16::from_f32(f));
        }
        Ok(q_rows)
    }
}

fn load_layer(ckpt: &Checkpoint, c: &Config, i: usize) -> Result<Layer> {
    let p = format!("model.layers.{i}");
    let h = c.hidden_size;
    let ffn = if c.is_moe_layer(i) {
        FeedForward::Moe(Box::new(Moe::load(ckpt, &format!("{p}.mlp"), c)?))
    } else {
        FeedForward::Dense(Mlp::load(ckpt, &format!("{p}.mlp"), h, c.intermediate_size)?)
    };
    Ok(Layer {
        input_norm: RmsNorm::load(ckpt, &format!("{p}.input_layernorm.weight"), h, c.rms_norm_eps)?,
        attn: MlaWeights::load(ckpt, &format!("{p}.self_attn"), c)?,
        post_attn_norm: RmsNorm::load(ckpt, &format!("{p}.post_attention_layernorm.weight"), h, c.rms_norm_eps)?,
        ffn,
    })
}

fn add(x: &mut [f32], y: &[f32]) {
    x.iter_mut().zip(y).for_each(|(a, b)| *a += b);
}

/// One sequence's place in the cache.
#[derive(Clone, Debug, Default)]
struct Sequence {
    pages: Vec<i32>,
    len: usize,
}

/// A paged latent KV cache for every layer: per layer `[num_pages, page_size, 576]` bf16 rows, pages
/// handed to sequences as they grow and returned when they are removed.
pub struct KvCache {
    layers: Vec<Vec<bf16>>,
    layout: KvLayout,
    free: Vec<i32>,
    seqs: Vec<Option<Sequence>>,
}

impl KvCache {
    /// `layers` layers of `num_pages` pages of `page_size` slots; sequences of at most `max_seq_len` slots.
    pub fn new(layers: usize, num_pages: usize, page_size: usize, max_seq_len: usize) -> Result<Self> {
        for (name, v) in [("num_pages", num_pages), ("page_size", page_size), ("max_seq_len", max_seq_len)] {
            if v == 0 {
                return Err(Error::param(name, v, "the KV cache needs every size >= 1"));
            }
        }
        if num_pages > i32::MAX as usize {
            return Err(Error::param("num_pages", num_pages, "page ids are i32"));
        }
        let layout = KvLayout {
            layers: 1,
            num_pages,
            page_size,
            row_elems: ROW,
            pages_per_req: max_seq_len.div_ceil(page_size),
        };
        Ok(KvCache {
            layers: vec![vec![bf16::ZERO; num_pages * page_size * ROW]; layers],
            layout,
            free: (0..num_pages as i32).rev().collect(),
            seqs: Vec::new(),
        })
    }

    /// Starts an empty sequence; returns its id.
    pub fn add_sequence(&mut self) -> usize {
        match self.seqs.iter().position(Option::is_none) {
            Some(id) => {
                self.seqs[id] = Some(Sequence::default());
                id
            }
            None => {
                self.seqs.push(Some(Sequence::default()));
                self.seqs.len() - 1
            }
        }
    }

    /// Ends a sequence and frees its pages.
    pub fn remove_sequence(&mut self, id: usize) -> Result<()> {
        let seq = self.seqs.get_mut(id).and_then(Option::take).ok_or_else(|| unknown(id))?;
        self.free.extend(seq.pages.iter().rev());
        Ok(())
    }

    /// Tokens cached for sequence `id`.
    pub fn len(&self, id: usize) -> Result<usize> {
        Ok(self.seq(id)?.len)
    }

    fn seq(&self, id: usize) -> Result<&Sequence> {
        self.seqs.get(id).and_then(Option::as_ref).ok_or_else(|| unknown(id))
    }

    /// Makes room for `len` slots in sequence `id`.
    fn reserve(&mut self, id: usize, len: usize) -> Result<()> {
        let max = self.layout.pages_per_req * self.layout.page_size;
        if len > max {
            return Err(Error::param("sequence length", len, format!("sequence {id} exceeds max_seq_len {max}")));
        }
        let need = len.div_ceil(self.layout.page_size);
        let have = self.seq(id)?.pages.len();
        if need > have + self.free.len() {
            return Err(Error::param("num_pages", self.layout.num_pages, "the KV cache is out of pages"));
        }
        let new: Vec<i32> = (have..need).filter_map(|_| self.free.pop()).collect();
        if let Some(seq) = self.seqs[id].as_mut() {
            seq.pages.extend(new);
        }
        Ok(())
    }

    fn advance(&mut self, id: usize, n: usize) {
        if let Some(seq) = self.seqs.get_mut(id).and_then(Option::as_mut) {
            seq.len += n;
        }
    }

    /// Sequence `id`'s block table, padded with -1 to `pages_per_req`.
    fn block_table(&self, id: usize) -> Result<Vec<i32>> {
        let mut table = self.seq(id)?.pages.clone();
        table.resize(self.layout.pages_per_req, -1);
        Ok(table)
    }

    fn write_row(&mut self, layer: usize, id: usize, slot: usize, row: &[bf16]) -> Result<()> {
        let table = self.block_table(id)?;
        let off = self.layout.slot_offset(&table, 0, slot)?;
        self.layers[layer][off..off + ROW].copy_from_slice(row);
        Ok(())
    }
}

fn unknown(id: usize) -> Error {
    Error::Index { name: "sequence", detail: format!("no sequence {id} in the KV cache") }
}
