//! Multi-head latent attention (DeepSeek V3, Kimi K2) on MLX, as mlx-lm
//! computes it: every head attends to one shared latent row per token, and
//! the rotated parts' scores join as an additive mask.
//!
//! ```text
//!  q rows ─► per head [q_nope │ q_rope] ─► q_latent = q_nope · W_k (per head)
//!  kv_a rows ─► [latent │ k_rope] ─► cache: k ← norm(latent), v ← RoPE(k_rope)
//!  mask = scale · RoPE(q_rope) · k_ropeᵀ (+ causal)
//!  sdpa(q_latent, latent, latent, mask) ─► · W_v (per head) ─► [n, heads × v]
//! ```

use super::LayerCache;
use super::array::{Array, Dtype, Mask, attention, dequantize, quantized_matmul, rms_norm};
use super::moe::Stacked;
use super::weights::{Linear, Loader};
use crate::config::{LatentAttention, ModelConfig};
use crate::error::Result;
use crate::names::{Part, Weight};
use crate::stage::Item;

/// How queries are made.
enum Query {
    /// One projection (DeepSeek V2 Lite).
    Plain(Linear),
    /// A down projection, its norm, an up projection.
    LowRank { a: Linear, norm: Array, b: Linear },
}

/// One layer's latent attention weights.
pub(super) struct LatentWeights {
    query: Query,
    /// hidden → `[latent │ k_rope]`.
    kv_a: Linear,
    kv_norm: Array,
    /// Per head, `q_nope → latent`.
    embed_q: Stacked,
    /// Per head, `latent → value`.
    unembed_out: Stacked,
    widths: LatentAttention,
    heads: usize,
}

impl LatentWeights {
    /// Loads layer `n`'s (the per-head maps from `embed_q` and
    /// `unembed_out`, or split from an older checkpoint's `kv_b_proj`).
    pub(super) fn load(
        loader: &mut Loader,
        n: usize,
        c: &ModelConfig,
        widths: &LatentAttention,
    ) -> Result<Self> {
        let l = |p| Weight::Layer(n, p);
        let (h, heads) = (c.hidden_size, c.heads);
        let (nope, value, rank) = (widths.nope_dim, widths.value_dim, widths.kv_lora_rank);
        let query = match widths.q_lora_rank {
            Some(r) => Query::LowRank {
                a: loader.linear(l(Part::QA), r, h)?,
                norm: loader.vector(l(Part::QANorm), r)?,
                b: loader.linear(l(Part::QB), heads * widths.query_dim(), r)?,
            },
            None => Query::Plain(loader.linear(l(Part::Q), heads * widths.query_dim(), h)?),
        };
        let (embed_q, unembed_out) = if loader.has(l(Part::EmbedQ)) {
            (
                loader.stacked(l(Part::EmbedQ), (heads, rank, nope), false)?,
                loader.stacked(l(Part::UnembedOut), (heads, value, rank), false)?,
            )
        } else {
            // `[heads × (nope + value), latent]`, kept as `[latent, out]`.
            let kv_b = loader.linear(l(Part::KvB), heads * (nope + value), rank)?;
            let dense = match &kv_b.quant {
                Some(q) => dequantize(&kv_b.w, q)?.astype(Dtype::F32)?,
                None => kv_b.w.transpose(&[1, 0])?,
            }
            .reshape(&[heads, nope + value, rank])?;
            let k = dense.slice(&[0, 0, 0], &[heads, nope, rank])?;
            let v = dense
                .slice(&[0, nope, 0], &[heads, nope + value, rank])?
                .transpose(&[0, 2, 1])?;
            Array::eval(&[&k, &v])?;
            // Held in f32 beside (not instead of) what the loader counted.
            loader.bytes += k.nbytes() + v.nbytes();
            let plain = |w: Array| Stacked {
                w,
                quant: None,
                bias: None,
            };
            (plain(k), plain(v))
        };
        Ok(LatentWeights {
            query,
            kv_a: loader.linear(l(Part::KvA), widths.cache_width(), h)?,
            kv_norm: loader.vector(l(Part::KvANorm), rank)?,
            embed_q,
            unembed_out,
            widths: *widths,
            heads,
        })
    }

    /// The step's query rows (`[rows, heads × (nope + rope)]`) and latent
    /// rows (`[rows, latent + rope]`) of normed rows `h`.
    pub(super) fn project(&self, h: &Array) -> Result<(Array, Array)> {
        let q = match &self.query {
            Query::Plain(q) => q.forward(h)?,
            Query::LowRank { a, norm, b } => {
                b.forward(&rms_norm(&a.forward(h)?, norm, LatentAttention::NORM_EPS)?)?
            }
        };
        Ok((q, self.kv_a.forward(h)?))
    }

    /// One sequence's rows of the step: writes its cache rows (`cache.k`
    /// the latent, `cache.v` the rotated key part) and attends; `rotate`
    /// applies RoPE at the sequence's positions. Returns `[n, heads × v]`.
    pub(super) fn attend(
        &self,
        (q, kv): (&Array, &Array),
        item: &Item,
        cache: &mut LayerCache,
        rotate: &dyn Fn(&Array) -> Result<Array>,
        scale: f32,
    ) -> Result<Array> {
        let w = &self.widths;
        let (n, pos, heads) = (item.len, item.position, self.heads);
        debug_assert_eq!(cache.start, 0, "latent attention has no window");
        let (rank, rope, qd) = (w.kv_lora_rank, w.rope_dim, w.query_dim());
        let qi = q
            .slice(&[item.offset, 0], &[item.offset + n, heads * qd])?
            .reshape(&[1, n, heads, qd])?
            .transpose(&[0, 2, 1, 3])?;
        let q_nope = qi.slice(&[0, 0, 0, 0], &[1, heads, n, w.nope_dim])?;
        let q_rope = rotate(&qi.slice(&[0, 0, 0, w.nope_dim], &[1, heads, n, qd])?)?;
        let kvi = kv.slice(&[item.offset, 0], &[item.offset + n, rank + rope])?;
        let latent = rms_norm(
            &kvi.slice(&[0, 0], &[n, rank])?,
            &self.kv_norm,
            LatentAttention::NORM_EPS,
        )?
        .reshape(&[1, 1, n, rank])?;
        let k_rope = rotate(
            &kvi.slice(&[0, rank], &[n, rank + rope])?
                .reshape(&[1, 1, n, rope])?,
        )?;
        cache.k = cache
            .k
            .slice_update(&latent, &[0, 0, pos, 0], &[1, 1, pos + n, rank])?;
        cache.v = cache
            .v
            .slice_update(&k_rope, &[0, 0, pos, 0], &[1, 1, pos + n, rope])?;
        let keys = cache.k.slice(&[0, 0, 0, 0], &[1, 1, pos + n, rank])?;
        let ropes = cache.v.slice(&[0, 0, 0, 0], &[1, 1, pos + n, rope])?;
        let mut mask = q_rope
            .scale(scale)?
            .matmul(&ropes.transpose(&[0, 1, 3, 2])?)?;
        if let Some(causal) = item.mask(0, None) {
            mask = mask.add(&Array::from_f32(&causal, &[n, pos + n])?)?;
        }
        let q_latent = per_head(&self.embed_q, &q_nope)?;
        let y = attention(&q_latent, &keys, &keys, scale, Mask::Array(&mask), None)?;
        per_head(&self.unembed_out, &y)?
            .transpose(&[0, 2, 1, 3])?
            .reshape(&[n, heads * w.value_dim])
    }
}

/// `x` (`[1, heads, n, in]`) through each head's own matrix: `[1, heads, n, out]`.
fn per_head(w: &Stacked, x: &Array) -> Result<Array> {
    match &w.quant {
        Some(q) => quantized_matmul(x, &w.w, q),
        None => x.matmul(&w.w),
    }
}
