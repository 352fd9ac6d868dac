//! One layer's attention over each sequence's cache, once the step's
//! queries, keys and values are made (by query/key/value heads, or by
//! latent attention, see `latent.rs`).
//!
//! ```text
//!  q, k, v rows of every sequence ─► append k, v to each sequence's cache
//!     ─► decoding rows (one per sequence): one pass over all caches (kv.rs)
//!     ─► a prompt's rows: candle's products over its visible keys
//!     ─► out rows: heads × value dim
//! ```

use std::collections::HashMap;

use candle_core::{Device, Tensor};

use super::kv::{self, DecodeRow};
use super::{KV_CHUNK, SequenceCache};
use crate::error::Result;
use crate::stage::{Item, SequenceId};

/// The attention of one layer: head counts, widths, score scale and window.
pub(super) struct AttentionShape {
    pub heads: usize,
    pub kv_heads: usize,
    /// Floats of a query or key head.
    pub head_dim: usize,
    /// Floats of a value head.
    pub value_dim: usize,
    pub scale: f32,
    /// Positions a query sees, itself included (sliding layers).
    pub window: Option<usize>,
}

/// A step's rows for one layer, on the host: `q` is rows × heads × head
/// dim; `k` rows × KV heads × head dim; `v` rows × KV heads × value dim, or
/// empty when the values are the keys' first columns (latent attention).
pub(super) struct StepRows {
    pub q: Vec<f32>,
    pub k: Vec<f32>,
    pub v: Vec<f32>,
}

/// Appends the step's keys and values to layer `l` of each sequence's cache
/// and attends: every decoding row in one pass, each prompt with candle's
/// products. Returns rows × heads × value dim.
pub(super) fn attend_cached(
    sequences: &mut HashMap<SequenceId, SequenceCache>,
    l: usize,
    items: &[Item],
    rows: &StepRows,
    shape: &AttentionShape,
    sinks: Option<&[f32]>,
    device: &Device,
) -> Result<Vec<f32>> {
    let (heads, hd, vd) = (shape.heads, shape.head_dim, shape.value_dim);
    let (q_width, k_width, out_width) = (heads * hd, shape.kv_heads * hd, heads * vd);
    let v_width = if rows.v.is_empty() {
        0
    } else {
        shape.kv_heads * vd
    };
    for item in items {
        let (from, to) = (item.offset, item.offset + item.len);
        sequences
            .get_mut(&item.seq)
            .expect("cache made in run")
            .layers[l]
            .append(
                &rows.k[from * k_width..to * k_width],
                &rows.v[from * v_width..to * v_width],
                KV_CHUNK,
            )?;
    }
    let total: usize = items.iter().map(|i| i.len).sum();
    let mut y = vec![0f32; total * out_width];
    // Every sequence that adds one row, in one pass.
    let decoding: Vec<&Item> = items.iter().filter(|i| i.len == 1).collect();
    if !decoding.is_empty() {
        let queries: Vec<DecodeRow> = decoding
            .iter()
            .map(|i| DecodeRow {
                q: &rows.q[i.offset * q_width..(i.offset + 1) * q_width],
                kv: &sequences[&i.seq].layers[l],
                first: i.first_key(shape.window),
            })
            .collect();
        let mut out = vec![0f32; decoding.len() * out_width];
        let head_shape = kv::HeadShape {
            heads,
            kv_heads: shape.kv_heads,
            head_dim: hd,
            value_dim: vd,
            scale: shape.scale,
        };
        kv::decode_attention(&queries, &head_shape, sinks, &mut out);
        for (i, o) in decoding.iter().zip(out.chunks_exact(out_width)) {
            y[i.offset * out_width..(i.offset + 1) * out_width].copy_from_slice(o);
        }
    }
    // A prompt's rows: candle's products over its visible keys.
    for item in items.iter().filter(|i| i.len > 1) {
        let qi = Tensor::from_slice(
            &rows.q[item.offset * q_width..(item.offset + item.len) * q_width],
            (1, item.len, heads, hd),
            device,
        )?
        .transpose(1, 2)?
        .contiguous()?;
        let first = item.first_key(shape.window);
        let (k_all, v_all) = sequences[&item.seq].layers[l].tensors(first, hd, device)?;
        let yi = attention(&qi, &k_all, &v_all, item, first, shape, sinks)?;
        y[item.offset * out_width..(item.offset + item.len) * out_width]
            .copy_from_slice(&yi.flatten_all()?.to_vec1::<f32>()?);
    }
    Ok(y)
}

/// Grouped-query attention of one sequence's queries against the keys and
/// values from position `first` on (all a sliding layer's window can
/// reach), without copying them per query head: the query heads sharing a
/// KV head are laid out as extra rows.
///
/// With `sinks` (one logit per query head), each head's softmax has one
/// more term that takes weight but adds no value.
fn attention(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    item: &Item,
    first: usize,
    s: &AttentionShape,
    sinks: Option<&[f32]>,
) -> Result<Tensor> {
    let (heads, kv_heads, hd, vd) = (s.heads, s.kv_heads, s.head_dim, s.value_dim);
    let rep = heads / kv_heads;
    let n = item.len;
    let keys = item.position + n - first;
    let q = q.reshape((1, kv_heads, rep * n, hd))?;
    let att = (q.matmul(&k.t()?)? * f64::from(s.scale))?;
    let att = match item.mask(first, s.window) {
        Some(mask) => {
            let mask = Tensor::from_vec(mask, (n, keys), q.device())?;
            att.reshape((1, kv_heads, rep, n, keys))?
                .broadcast_add(&mask)?
                .reshape((1, kv_heads, rep * n, keys))?
        }
        None => att,
    };
    let att = match sinks {
        Some(sinks) => {
            // Heads are laid out KV-head-major (`kv_head · rep + r`), as `q` is.
            let column = Tensor::from_slice(sinks, (1, kv_heads, rep, 1, 1), q.device())?
                .broadcast_as((1, kv_heads, rep, n, 1))?
                .reshape((1, kv_heads, rep * n, 1))?;
            candle_nn::ops::softmax_last_dim(&Tensor::cat(&[&att, &column], 3)?)?
                .narrow(3, 0, keys)?
        }
        None => candle_nn::ops::softmax_last_dim(&att)?,
    };
    let y = att.contiguous()?.matmul(v)?;
    Ok(y.reshape((1, heads, n, vd))?
        .transpose(1, 2)?
        .reshape((n, heads * vd))?)
}
