//! Multi-head latent attention (DeepSeek V3, Kimi K2) on candle: the cache
//! holds one compressed row per token, and every head attends to it as to
//! one shared key/value head.
//!
//! ```text
//!  h ─► q (low rank, or plain) ─► per head [q_nope │ q_rope]
//!        q_nope ─► embed_q (per head) ─► q_latent;  RoPE(q_rope)
//!        query row per head: [q_latent │ q_rope]
//!  h ─► kv_a ─► [latent │ k_rope] ─► key row: [norm(latent) │ RoPE(k_rope)]
//!        (the cache; a value is the key row's latent part)
//!  attention (one KV head) ─► per head Σ p·latent ─► unembed_out ─► [heads × v]
//! ```
//!
//! Scores are `q_nope · (W_k latent) + q_rope · k_rope`, computed as
//! `(W_kᵀ q_nope) · latent + …`: the same sum, without expanding the cache
//! into per-head keys. A tensor rank computes its own heads; every rank
//! computes and caches the (shared) latent.

use candle_core::Tensor;

use super::attention::StepRows;
use super::weights::{Linear, Part, TensorLoader};
use crate::config::{LatentAttention, ModelConfig};
use crate::error::{Error, Result};
use crate::tensor::RankShare;

/// How queries are made.
enum Query {
    /// One projection (DeepSeek V2 Lite).
    Plain(Linear),
    /// A down projection, its norm, an up projection.
    LowRank { a: Linear, norm: Tensor, b: Linear },
}

/// One layer's latent attention weights.
pub(super) struct LatentWeights {
    query: Query,
    /// hidden → `[latent │ k_rope]`.
    kv_a: Linear,
    kv_norm: Tensor,
    /// `[heads, latent, nope]`: `W_k` per head, for `q_nope · W_kᵀ`.
    embed_q: Tensor,
    /// `[heads, value, latent]`: `W_v` per head, for `latent · W_vᵀ`.
    unembed_out: Tensor,
    widths: LatentAttention,
    heads: usize,
}

impl LatentWeights {
    /// Loads layer `i`'s (the per-head key and value maps from `embed_q`
    /// and `unembed_out`, or split from an older checkpoint's `kv_b_proj`).
    ///
    /// A tensor rank's `share` takes its heads: their query rows and
    /// per-head maps (its output projection's columns are cut by the
    /// caller); the latent is every rank's, each caching it whole.
    pub fn load(
        l: &mut TensorLoader<'_>,
        i: usize,
        config: &ModelConfig,
        share: Option<&RankShare>,
    ) -> Result<Self> {
        let widths = config.latent.ok_or_else(|| {
            Error::InvalidInput("latent attention weights for a model without it".into())
        })?;
        let name = |s: &str| format!("blk.{i}.{s}");
        let all_heads = 0..config.heads;
        let own = share.map_or(all_heads, |s| s.heads.clone());
        let qd = widths.query_dim();
        let q_rows = share.map(|_| Part::Rows(own.start * qd..own.end * qd));
        let query = match widths.q_lora_rank {
            Some(_) => Query::LowRank {
                a: l.matrix(&name("attn_q_a.weight"))?.into(),
                norm: l.vector(&name("attn_q_a_norm.weight"))?,
                b: l.matrix_part(&name("attn_q_b.weight"), q_rows)?.into(),
            },
            None => Query::Plain(l.matrix_part(&name("attn_q.weight"), q_rows)?.into()),
        };
        let heads = config.heads;
        let (nope, value, rank) = (widths.nope_dim, widths.value_dim, widths.kv_lora_rank);
        let shaped = |t: Tensor, want: (usize, usize, usize), what: &str| -> Result<Tensor> {
            if t.dims() != [want.0, want.1, want.2] {
                return Err(Error::Tensor(format!(
                    "layer {i}'s {what} is {:?}, the configuration needs {want:?}",
                    t.dims()
                )));
            }
            Ok(t)
        };
        let (embed_q, unembed_out) = if l.has(&name("attn_k_b.weight")) {
            let k = shaped(
                l.vector(&name("attn_k_b.weight"))?,
                (heads, rank, nope),
                "embed_q",
            )?;
            let v = shaped(
                l.vector(&name("attn_v_b.weight"))?,
                (heads, value, rank),
                "unembed_out",
            )?;
            (k, v)
        } else {
            let kv_b = l.vector(&name("attn_kv_b.weight"))?;
            let kv_b = shaped(
                kv_b.reshape((heads, nope + value, rank)).map_err(|_| {
                    Error::Tensor(format!(
                        "layer {i}'s kv_b_proj is {:?}, the configuration needs [{}, {rank}]",
                        kv_b.dims(),
                        heads * (nope + value)
                    ))
                })?,
                (heads, nope + value, rank),
                "kv_b_proj",
            )?;
            (
                kv_b.narrow(1, 0, nope)?.transpose(1, 2)?.contiguous()?,
                kv_b.narrow(1, nope, value)?.contiguous()?,
            )
        };
        // This rank's heads of the per-head maps.
        let mine =
            |t: Tensor| -> Result<Tensor> { Ok(t.narrow(0, own.start, own.len())?.contiguous()?) };
        Ok(LatentWeights {
            query,
            kv_a: l.matrix(&name("attn_kv_a_mqa.weight"))?.into(),
            kv_norm: l.vector(&name("attn_kv_a_norm.weight"))?,
            embed_q: mine(embed_q)?,
            unembed_out: mine(unembed_out)?,
            widths,
            heads: own.len(),
        })
    }

    /// Floats of a query or cached key row per head: latent and rotated part.
    pub fn key_width(&self) -> usize {
        self.widths.cache_width()
    }

    /// Floats of the attended value per head: the latent.
    pub fn value_width(&self) -> usize {
        self.widths.kv_lora_rank
    }

    /// The step's query rows (`[q_latent │ RoPE(q_rope)]` per head) and
    /// cache rows (`[norm(latent) │ RoPE(k_rope)]`) for normed rows `h`;
    /// `rotate` applies RoPE to `[rows, heads, 1, rope dims]`.
    pub fn rows(&self, h: &Tensor, rotate: &dyn Fn(&Tensor) -> Result<Tensor>) -> Result<StepRows> {
        let w = &self.widths;
        let rows = h.dim(0)?;
        let q = match &self.query {
            Query::Plain(q) => q.forward(h)?,
            Query::LowRank { a, norm, b } => b.forward(&candle_nn::ops::rms_norm(
                &a.forward(h)?,
                norm,
                LatentAttention::NORM_EPS,
            )?)?,
        };
        let q = q.reshape((rows, self.heads, w.query_dim()))?;
        let q_nope = q.narrow(2, 0, w.nope_dim)?.transpose(0, 1)?.contiguous()?;
        // [heads, rows, nope] × [heads, nope, latent] → [rows, heads, latent].
        let q_latent = super::dense::per_head(&q_nope, &self.embed_q)?.transpose(0, 1)?;
        let q_rope = q
            .narrow(2, w.nope_dim, w.rope_dim)?
            .contiguous()?
            .reshape((rows, self.heads, 1, w.rope_dim))?;
        let q_rope = rotate(&q_rope)?.reshape((rows, self.heads, w.rope_dim))?;
        let q = Tensor::cat(&[&q_latent, &q_rope], 2)?;
        let kv = self.kv_a.forward(h)?;
        let latent = candle_nn::ops::rms_norm(
            &kv.narrow(1, 0, w.kv_lora_rank)?.contiguous()?,
            &self.kv_norm,
            LatentAttention::NORM_EPS,
        )?;
        let k_rope = kv
            .narrow(1, w.kv_lora_rank, w.rope_dim)?
            .contiguous()?
            .reshape((rows, 1, 1, w.rope_dim))?;
        let k_rope = rotate(&k_rope)?.reshape((rows, w.rope_dim))?;
        let k = Tensor::cat(&[&latent, &k_rope], 1)?;
        Ok(StepRows {
            q: q.flatten_all()?.to_vec1::<f32>()?,
            k: k.flatten_all()?.to_vec1::<f32>()?,
            v: Vec::new(),
        })
    }

    /// Each head's attended latent (rows × heads × latent) out to its value:
    /// `[rows, heads × value]`.
    pub fn values(&self, attended: Vec<f32>, device: &candle_core::Device) -> Result<Tensor> {
        let rank = self.widths.kv_lora_rank;
        let rows = attended.len() / (self.heads * rank);
        let by_head = Tensor::from_vec(attended, (rows, self.heads, rank), device)?
            .transpose(0, 1)?
            .contiguous()?;
        let y = super::dense::per_head(&by_head, &self.unembed_out)?;
        Ok(y.transpose(0, 1)?
            .reshape((rows, self.heads * self.widths.value_dim))?)
    }
}
