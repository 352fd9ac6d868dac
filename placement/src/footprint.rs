//! What a model needs in memory, stage by stage.

use std::ops::Range;

/// A model's memory, as placement counts it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Footprint {
    /// Bytes of each layer's weights, in layer order.
    pub layer_bytes: Vec<u64>,
    /// Bytes of the token embedding (first stage).
    pub embedding_bytes: u64,
    /// Bytes of the final norm and output head (last stage).
    pub output_bytes: u64,
    /// Bytes of KV cache one token takes in one layer.
    pub kv_bytes_per_token_per_layer: u64,
    /// KV heads per layer, when known: a tensor group has at most this
    /// many ranks, each with whole heads.
    pub kv_heads: Option<u32>,
    /// Per layer, the most tokens of KV one sequence holds there however
    /// long it grows (sliding-window layers); empty, or `None` for a layer:
    /// every token up to the context.
    pub kv_token_caps: Vec<Option<u64>>,
}

/// The KV cache an instance reserves.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct KvBudget {
    /// Tokens per sequence.
    pub context_length: u64,
    /// Sequences at once.
    pub sequences: u64,
}

impl Footprint {
    /// Number of layers.
    pub fn layers(&self) -> u32 {
        self.layer_bytes.len() as u32
    }

    /// Bytes one layer needs: its weights and its KV cache for the budget.
    pub fn layer_cost(&self, layer: u32, kv: KvBudget) -> u64 {
        self.layer_bytes[layer as usize].saturating_add(self.layer_kv_bytes(layer, kv))
    }

    /// Bytes of KV cache one layer needs for the budget: a sliding layer's
    /// capped tokens, every other layer's whole context, per sequence.
    pub fn layer_kv_bytes(&self, layer: u32, kv: KvBudget) -> u64 {
        let tokens = match self.kv_token_caps.get(layer as usize).copied().flatten() {
            Some(cap) => kv.context_length.min(cap),
            None => kv.context_length,
        };
        // Saturating: a hostile model or budget reads as "too big", never wraps.
        self.kv_bytes_per_token_per_layer
            .saturating_mul(tokens)
            .saturating_mul(kv.sequences)
    }

    /// Bytes of KV cache of `layers` for the budget.
    pub fn layers_kv_bytes(&self, layers: &Range<u32>, kv: KvBudget) -> u64 {
        layers.clone().fold(0u64, |sum, l| {
            sum.saturating_add(self.layer_kv_bytes(l, kv))
        })
    }

    /// Bytes a stage running `layers` needs, with `overhead` on top.
    pub fn stage_bytes(&self, layers: &Range<u32>, kv: KvBudget, overhead: u64) -> u64 {
        let mut bytes = layers.clone().fold(overhead, |sum, l| {
            sum.saturating_add(self.layer_cost(l, kv))
        });
        if layers.start == 0 {
            bytes = bytes.saturating_add(self.embedding_bytes);
        }
        if layers.end == self.layers() {
            bytes = bytes.saturating_add(self.output_bytes);
        }
        bytes
    }

    /// Bytes of weights of the whole model.
    pub fn weight_bytes(&self) -> u64 {
        self.layer_bytes
            .iter()
            .fold(self.embedding_bytes, |sum, b| sum.saturating_add(*b))
            .saturating_add(self.output_bytes)
    }

    /// Bytes of KV cache of the whole model for the budget.
    pub fn kv_bytes(&self, kv: KvBudget) -> u64 {
        self.layers_kv_bytes(&(0..self.layers()), kv)
    }
}
