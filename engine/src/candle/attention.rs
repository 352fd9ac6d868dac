//! One layer's attention over each sequence's cache, once the step's
//! queries, keys and values are made (by query/key/value heads, or by
//! latent attention, see `latent.rs`).
//!
//! ```text
//!  q, k, v rows of every sequence ─► (a sliding layer: forget the rows no
//!     query sees any more, but a window) ─► append k, v to each sequence's cache
//!     ─► every query row (a prompt's or a decoding one) over the keys it
//!        sees, one pass over all rows (kv.rs)
//!     ─► out rows: heads × value dim
//! ```
//!
//! A row's result depends only on its query and the keys it sees: not on
//! how many rows run beside it, nor on whether its prompt ran whole, in
//! slices or after cached blocks. So the prefix cache, chunked prefill and
//! batching give bit-identical output (candle's matrix products, used here
//! before, rounded differently with the number of rows and keys).

use std::collections::HashMap;

use super::kv::{self, QueryRow};
use super::{KV_CHUNK, SequenceCache};
use crate::config::sliding_kept;
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
/// and attends, every row in one pass. Returns rows × heads × value dim.
pub(super) fn attend_cached(
    sequences: &mut HashMap<SequenceId, SequenceCache>,
    l: usize,
    items: &[Item],
    rows: &StepRows,
    shape: &AttentionShape,
    sinks: Option<&[f32]>,
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
        let kv = &mut sequences
            .get_mut(&item.seq)
            .expect("cache made in run")
            .layers[l];
        // A sliding layer forgets, a window's worth at a time, what neither
        // this step's queries nor a later one see, but for a window more
        // (`sliding_kept`) that a repeated prompt may start from.
        if let Some(window) = shape.window {
            kv.forget_before(item.first_key(Some(sliding_kept(window))), window);
        }
        kv.append(
            &rows.k[from * k_width..to * k_width],
            &rows.v[from * v_width..to * v_width],
            KV_CHUNK,
        )?;
    }
    let total: usize = items.iter().map(|i| i.len).sum();
    // Every query row, of a prompt or decoding, against the keys it sees:
    // its own position and those before it (within the window).
    let queries: Vec<QueryRow> = items
        .iter()
        .flat_map(|item| {
            let kv = &sequences[&item.seq].layers[l];
            (0..item.len).map(move |i| {
                let query = item.position + i;
                QueryRow {
                    q: &rows.q[(item.offset + i) * q_width..(item.offset + i + 1) * q_width],
                    kv,
                    first: shape.window.map_or(0, |w| (query + 1).saturating_sub(w)),
                    end: query + 1,
                }
            })
        })
        .collect();
    let mut y = vec![0f32; total * out_width];
    let head_shape = kv::HeadShape {
        heads,
        kv_heads: shape.kv_heads,
        head_dim: hd,
        value_dim: vd,
        scale: shape.scale,
    };
    kv::attend_rows(&queries, &head_shape, sinks, &mut y);
    Ok(y)
}
