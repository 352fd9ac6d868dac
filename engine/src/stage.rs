//! The contract of a stage: one part of a model, layers `[start, end)`.
//!
//! ```text
//!  tokens ──► [embed] ─► layers start..end ─► [final norm + head] ──► logits
//!             first stage only                 last stage only
//!  hidden states flow between stages as `Activations` (f32 rows)
//! ```
//!
//! A stage keeps a KV cache per sequence, so sequences at different positions
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
    /// The token ids the rows stand for, when the sender tells them (a
    /// pipeline's head does, so that later stages can keep the rows' KV in
    /// their prefix caches); empty when not told.
    pub ids: Vec<u32>,
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
            ids: Vec::new(),
        })
    }

    /// The same rows, standing for the tokens `ids` (one per row).
    pub fn with_ids(mut self, ids: Vec<u32>) -> Result<Self> {
        if ids.len() != self.tokens {
            return Err(Error::InvalidInput(format!(
                "{} token ids cannot name {} rows",
                ids.len(),
                self.tokens
            )));
        }
        self.ids = ids;
        Ok(self)
    }

    /// The ids the rows stand for, when told for every row.
    pub fn told_ids(&self) -> Option<&[u32]> {
        (self.ids.len() == self.tokens).then_some(self.ids.as_slice())
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

/// Options for loading a stage.
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
    /// (for checking one engine against another, with `kv_precision` F32).
    /// MLX on a CPU then multiplies through BLAS instead of its slow
    /// quantized CPU kernel (30× the prefill speed here); on Metal, leave it
    /// off.
    pub dequantize: bool,
    /// Bytes of KV the stage keeps for prompts it has run, so a sequence that
    /// starts with the same tokens skips them (0: no prefix cache). A
    /// tensor group's stage does not use it.
    pub prefix_cache_bytes: usize,
    /// How the candle engine holds keys and values: f16 (the default, as
    /// llama.cpp does: half the memory, and half of what a long context
    /// reads per step) or f32 (for checking a model's definition against
    /// an f32 reference). MLX holds them as f32 either way.
    pub kv_precision: KvPrecision,
}

/// The precision of a KV cache's keys and values.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub enum KvPrecision {
    /// Half precision: rounds each key and value to 11 significant bits.
    #[default]
    F16,
    /// Single precision: keeps them as computed.
    F32,
}

impl KvPrecision {
    /// Bytes of one key or value element.
    pub fn bytes(self) -> usize {
        match self {
            KvPrecision::F16 => 2,
            KvPrecision::F32 => 4,
        }
    }
}

impl Default for LoadOptions {
    fn default() -> Self {
        LoadOptions {
            context_length: None,
            requantize_slow_types: true,
            dequantize: false,
            prefix_cache_bytes: 0,
            kv_precision: KvPrecision::default(),
        }
    }
}

/// One stage of a model, loaded and ready to run sequences.
pub trait Stage: Send {
    /// The model's configuration.
    fn config(&self) -> &ModelConfig;

    /// Where this stage sits in the model.
    fn layout(&self) -> &StageLayout;

    /// Bytes of KV cache one token takes in one of this stage's layers, as
    /// this engine holds it (this provided method counts f32, as the
    /// configuration does; candle overrides it).
    fn kv_bytes_per_token_per_layer(&self) -> usize {
        self.config().kv_bytes_per_token_per_layer()
    }

    /// The most tokens one sequence may hold.
    fn context_length(&self) -> usize;

    /// Runs `input` for sequence `seq`, appending to its KV cache (a new
    /// sequence starts at position 0): a batch of one.
    fn forward(&mut self, seq: SequenceId, input: StageInput) -> Result<StageOutput> {
        let mut out = self.forward_batch(vec![(seq, input)])?;
        Ok(out.pop().expect("one output per input"))
    }

    /// Runs one step for several sequences at once: each brings one or more
    /// tokens (or rows of hidden state): a decode step, a slice of a prompt,
    /// or both mixed. The rows are stacked so the weights are read once.
    /// Outputs are in input order, as [`Stage::forward`] gives them.
    fn forward_batch(&mut self, batch: Vec<(SequenceId, StageInput)>) -> Result<Vec<StageOutput>>;

    /// Frees a sequence's KV cache (keeping its blocks of tokens and its tail
    /// in the prefix cache, when there is one); returns whether it existed.
    fn release(&mut self, seq: SequenceId) -> bool;

    /// Starts the new sequence `seq` from the longest cached prefix of its
    /// prompt `tokens`, always leaving the last token to run; returns the
    /// tokens it now holds, which the caller no longer sends (0: nothing
    /// cached, a sequence that exists already, or a stage without a prefix
    /// cache, or a tensor group's). A later stage of a pipeline keeps and
    /// reuses its own layers' blocks as the first does; it knows its rows'
    /// tokens when the stage before tells them (`Activations::ids`), and
    /// starts from as many tokens as the head took: the caller passes
    /// `tokens[..=n]` and checks that it got `n`.
    fn reuse_prefix(&mut self, _seq: SequenceId, _tokens: &[u32]) -> usize {
        0
    }

    /// Keeps the blocks of tokens `seq` holds, and its tail, in the prefix
    /// cache (a prompt, once run, is there for the sequences that follow
    /// it), when it knows the tokens of all it holds. Only a stage that
    /// reuses prefixes keeps them.
    fn retain_prefix(&mut self, _seq: SequenceId) {}

    /// What the prefix cache did and holds.
    fn prefix_cache(&self) -> crate::prefix::PrefixCacheStats {
        crate::prefix::PrefixCacheStats::default()
    }

    /// Tokens held for `seq` (0 for an unknown sequence).
    fn sequence_len(&self, seq: SequenceId) -> usize;

    /// Sequences with a KV cache.
    fn sequences(&self) -> usize;

    /// Bytes of the loaded weights.
    fn weight_bytes(&self) -> usize;

    /// Bytes of KV cache currently allocated.
    fn kv_cache_bytes(&self) -> usize;
}

/// One sequence's share of a step: its rows in the stacked input.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Item {
    /// The sequence.
    pub seq: SequenceId,
    /// Its first row in the stacked input.
    pub offset: usize,
    /// Its rows (tokens) in this step.
    pub len: usize,
    /// Tokens it held before this step.
    pub position: usize,
}

impl Item {
    /// The first cached position any of this step's queries may see: 0, or
    /// later in a sliding-window layer of `window` positions.
    pub fn first_key(&self, window: Option<usize>) -> usize {
        window.map_or(0, |w| (self.position + 1).saturating_sub(w))
    }

    /// The additive attention mask `[len, keys]` of this step's queries
    /// over keys `first..position + len`: causal, and within `window`
    /// positions (the query's own included) when the layer slides. `None`
    /// when nothing is masked (one query whose window covers every key).
    pub fn mask(&self, first: usize, window: Option<usize>) -> Option<Vec<f32>> {
        let total = self.position + self.len;
        if self.len == 1 && window.is_none_or(|w| total - first <= w) {
            return None;
        }
        let mask = (0..self.len)
            .flat_map(|i| {
                let query = self.position + i;
                (first..total).map(move |key| {
                    let hidden = key > query || window.is_some_and(|w| query - key >= w);
                    if hidden { f32::NEG_INFINITY } else { 0.0 }
                })
            })
            .collect();
        Some(mask)
    }
}

/// Checks a step for a stage and plans each sequence's rows: every input
/// non-empty and of the kind the stage takes (token ids inside the vocabulary
/// for a first stage, hidden states of the model's width otherwise), each
/// sequence once, none past `context` tokens. `position` gives the tokens a
/// sequence already holds.
pub(crate) fn plan_step(
    batch: &[(SequenceId, StageInput)],
    config: &ModelConfig,
    layout: &StageLayout,
    context: usize,
    position: impl Fn(SequenceId) -> usize,
) -> Result<Vec<Item>> {
    let mut items: Vec<Item> = Vec::with_capacity(batch.len());
    let mut offset = 0;
    for (seq, input) in batch {
        if input.is_empty() {
            return Err(Error::InvalidInput(format!("sequence {seq}: no tokens")));
        }
        if items.iter().any(|i| i.seq == *seq) {
            return Err(Error::InvalidInput(format!(
                "sequence {seq} appears twice in one step"
            )));
        }
        let start = position(*seq);
        let needed = start + input.len();
        if needed > context {
            return Err(Error::ContextOverflow { needed, context });
        }
        match input {
            StageInput::Tokens(_) if !layout.is_first() => {
                return Err(Error::InvalidInput(format!(
                    "stage with layers {:?} does not start the model: it takes hidden states, not tokens",
                    layout.layers
                )));
            }
            StageInput::Tokens(ids) => {
                if let Some(bad) = ids.iter().find(|&&id| id as usize >= config.vocab_size) {
                    return Err(Error::InvalidInput(format!(
                        "token id {bad} is outside the vocabulary of {} tokens",
                        config.vocab_size
                    )));
                }
            }
            StageInput::Hidden(a) => {
                if a.hidden != config.hidden_size || a.data.len() != a.tokens * a.hidden {
                    return Err(Error::InvalidInput(format!(
                        "hidden states of width {} for a model of width {}",
                        a.hidden, config.hidden_size
                    )));
                }
            }
        }
        items.push(Item {
            seq: *seq,
            offset,
            len: input.len(),
            position: start,
        });
        offset += input.len();
    }
    Ok(items)
}
