//! The contract of a shard: one stage of a model, layers `[start, end)`.
//!
//! ```text
//!  tokens ──► [embed] ─► layers start..end ─► [final norm + head] ──► logits
//!             first stage only                 last stage only
//!  hidden states flow between stages as `Activations` (f32 rows)
//! ```
//!
//! A shard keeps a KV cache per sequence, so sequences at different positions
//! run through it concurrently. Activations are plain f32 rows so stages of one
//! pipeline may run on different backends.

use std::ops::Range;

use crate::config::ModelConfig;
use crate::error::{Error, Result};

/// Identifies a sequence (one generation) across the stages of a pipeline.
pub type SequenceId = u64;

/// Hidden states between stages: `tokens` rows of `hidden` values each.
#[derive(Debug, Clone, PartialEq)]
pub struct Activations {
    /// Number of rows (tokens).
    pub tokens: usize,
    /// Width of a row.
    pub hidden: usize,
    /// Row-major values, `tokens * hidden` long.
    pub data: Vec<f32>,
}

impl Activations {
    /// Wraps row-major values, checking the length.
    pub fn new(tokens: usize, hidden: usize, data: Vec<f32>) -> Result<Self> {
        if data.len() != tokens * hidden {
            return Err(Error::InvalidInput(format!(
                "{} values cannot be {tokens} rows of {hidden}",
                data.len()
            )));
        }
        Ok(Activations {
            tokens,
            hidden,
            data,
        })
    }
}

/// What a stage takes in.
#[derive(Debug, Clone, PartialEq)]
pub enum StageInput {
    /// Token ids (first stage only).
    Tokens(Vec<u32>),
    /// Hidden states from the previous stage.
    Hidden(Activations),
}

impl StageInput {
    /// Number of tokens in the input.
    pub fn len(&self) -> usize {
        match self {
            StageInput::Tokens(t) => t.len(),
            StageInput::Hidden(a) => a.tokens,
        }
    }

    /// Whether the input holds no token.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

/// What a stage gives out.
#[derive(Debug, Clone, PartialEq)]
pub enum StageOutput {
    /// Hidden states for the next stage (every stage but the last).
    Hidden(Activations),
    /// Logits over the vocabulary at the last input position (last stage).
    Logits(Vec<f32>),
}

/// Where a stage sits in the model.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StageLayout {
    /// The layers this stage runs.
    pub layers: Range<usize>,
    /// The model's number of layers.
    pub total_layers: usize,
}

impl StageLayout {
    /// Checks `layers` against a model of `total_layers`.
    pub fn new(layers: Range<usize>, total_layers: usize) -> Result<Self> {
        if layers.start >= layers.end || layers.end > total_layers {
            return Err(Error::LayerRange {
                start: layers.start,
                end: layers.end,
                layers: total_layers,
            });
        }
        Ok(StageLayout {
            layers,
            total_layers,
        })
    }

    /// The whole model as one stage.
    pub fn whole(total_layers: usize) -> Self {
        StageLayout {
            layers: 0..total_layers,
            total_layers,
        }
    }

    /// Whether this stage embeds tokens.
    pub fn is_first(&self) -> bool {
        self.layers.start == 0
    }

    /// Whether this stage applies the final norm and output head.
    pub fn is_last(&self) -> bool {
        self.layers.end == self.total_layers
    }
}

/// Options for loading a shard.
#[derive(Debug, Clone, PartialEq)]
pub struct LoadOptions {
    /// The most tokens one sequence may hold (prompt and generated); the model's
    /// context length when unset.
    pub context_length: Option<usize>,
    /// Re-quantize weight types that have no fast kernel on this machine
    /// (Q4_1, Q5_0, Q5_1) to Q8_0 at load: about twice their memory, several
    /// times their speed.
    pub requantize_slow_types: bool,
    /// Expand quantized weight matrices to f32 at load: about 7× the memory
    /// of Q4 weights. candle then computes products in f32 from the exact
    /// weights, as MLX does, instead of rounding activations to 8 bits first
    /// (for checking one engine against another). MLX on a CPU then multiplies
    /// through BLAS instead of its slow quantized CPU kernel (30× the prefill
    /// speed here); on Metal, leave it off.
    pub dequantize: bool,
}

impl Default for LoadOptions {
    fn default() -> Self {
        LoadOptions {
            context_length: None,
            requantize_slow_types: true,
            dequantize: false,
        }
    }
}

/// One stage of a model, loaded and ready to run sequences.
pub trait Shard: Send {
    /// The model's configuration.
    fn config(&self) -> &ModelConfig;

    /// Where this stage sits in the model.
    fn layout(&self) -> &StageLayout;

    /// The most tokens one sequence may hold.
    fn context_length(&self) -> usize;

    /// Runs `input` for sequence `seq`, appending to its KV cache (a new
    /// sequence starts at position 0).
    fn forward(&mut self, seq: SequenceId, input: StageInput) -> Result<StageOutput>;

    /// Runs one decode step for several sequences at once: each input is one
    /// token (or one row of hidden state). Outputs are in input order.
    fn forward_batch(&mut self, batch: Vec<(SequenceId, StageInput)>) -> Result<Vec<StageOutput>>;

    /// Frees a sequence's KV cache; returns whether it existed.
    fn release(&mut self, seq: SequenceId) -> bool;

    /// Tokens held for `seq` (0 for an unknown sequence).
    fn sequence_len(&self, seq: SequenceId) -> usize;

    /// Sequences with a KV cache.
    fn sequences(&self) -> usize;

    /// Bytes of the loaded weights.
    fn weight_bytes(&self) -> usize;

    /// Bytes of KV cache currently allocated.
    fn kv_cache_bytes(&self) -> usize;
}
