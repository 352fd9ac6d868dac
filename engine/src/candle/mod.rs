//! The candle backend: a stage computed with candle's CPU kernels on GGUF
//! weights, or on a safetensors directory's (dense or in MLX's group
//! quantization, read back and quantized to Q8_0).
//!
//! One code path serves prefill and batched decode: the inputs of all
//! sequences are stacked into rows, the matmuls, norms and RoPE run once over
//! all rows (the weights are read once per step, whatever the batch), and
//! attention reads each sequence's own KV cache ([`kv`]): every query row, a
//! prompt's or a decoding one, in one pass per layer. A row's result does
//! not depend on the rows beside it (see `attention.rs` and `dense.rs`).
//!
//! ```text
//!  rows of all sequences ─► norm ─► q k v (one product each) ─► q/k norms, RoPE (all rows)
//!     ─► append k v to each cache ─► attention: every row over the keys it sees
//!     ─► o ─► + ─► norm ─► MLP ─► +
//! ```

mod attention;
mod dense;
mod kv;
mod kv_rows;
mod latent;
mod moe;
mod pool;
mod safetensors;
mod weights;

use std::collections::HashMap;
use std::path::Path;

use candle_core::quantized::{QMatMul, QTensor};
use candle_core::{DType, Device, Tensor};

use crate::config::{LayerAttention, ModelConfig};
use crate::error::{Error, Result};
use crate::gguf::GgufFile;
use crate::prefix::{DEFAULT_BLOCK_TOKENS, PrefixCache, PrefixCacheStats};
use crate::stage::{
    Activations, Item, KvPrecision, LoadOptions, SequenceId, Stage, StageInput, StageLayout,
    StageOutput, plan_step,
};
use crate::tensor::{AllReduce, TensorGroup, TensorRank, TensorSplit};
use attention::{AttentionShape, StepRows, attend_cached};
use kv::LayerKv;
use safetensors::SafetensorsDir;
use weights::{LayerWeights, Projections, Source, TensorLoader};

/// KV caches grow in steps of this many tokens.
const KV_CHUNK: usize = 256;

/// A stage of a model computed with candle.
pub struct CandleStage {
    config: ModelConfig,
    layout: StageLayout,
    context_length: usize,
    device: Device,
    embedding: Option<QTensor>,
    layers: Vec<LayerWeights>,
    head: Option<(Tensor, QMatMul)>,
    /// RoPE tables (cos, sin) of the global layers, and of the sliding ones
    /// when they use another base.
    rope: RopeTables,
    /// RoPE rotates interleaved pairs (GGUF Llama), else the two halves.
    interleaved_rope: bool,
    weight_bytes: usize,
    /// How sequences' caches hold their keys and values.
    kv_precision: KvPrecision,
    sequences: HashMap<SequenceId, SequenceCache>,
    /// Blocks of prompts' KV: per layer, keys and values of the block's
    /// tokens (`None`: a sliding layer had forgotten them).
    prefix: PrefixCache<Vec<Option<BlockRows>>>,
    /// This stage's rank in a tensor group: its share of every layer, and
    /// the collective summing the attention and MLP outputs.
    tensor: Option<TensorRank>,
}

impl std::fmt::Debug for CandleStage {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CandleStage")
            .field("architecture", &self.config.architecture)
            .field("layers", &self.layout.layers)
            .field("total_layers", &self.layout.total_layers)
            .field("sequences", &self.sequences.len())
            .field("weight_bytes", &self.weight_bytes)
            .finish()
    }
}

/// One layer's keys and values of a prefix-cache block.
type BlockRows = (kv_rows::KvRows, kv_rows::KvRows);

/// The KV cache of one sequence in this stage's layers.
struct SequenceCache {
    position: usize,
    layers: Vec<LayerKv>,
    /// The token ids it holds, when it came as tokens (a first stage).
    tokens: Vec<u32>,
}

impl SequenceCache {
    /// Empty, for `layers` layers of `width` key floats per token; with
    /// `values_in_keys`, latent attention's (values are the keys' first
    /// columns).
    fn new(
        layers: usize,
        width: usize,
        values_in_keys: Option<usize>,
        precision: KvPrecision,
    ) -> Self {
        let layer = || match values_in_keys {
            Some(values) => LayerKv::latent(width, values, precision),
            None => LayerKv::new(width, precision),
        };
        SequenceCache {
            position: 0,
            layers: (0..layers).map(|_| layer()).collect(),
            tokens: Vec::new(),
        }
    }
}

impl CandleStage {
    /// Loads layers `layout.layers` of a model on the CPU: a GGUF file, or a
    /// safetensors directory (the MLX-community layout, dense or quantized).
    pub fn load(
        path: impl AsRef<Path>,
        layout: StageLayout,
        options: &LoadOptions,
    ) -> Result<Self> {
        Self::load_part(path.as_ref(), layout, options, None)
    }

    /// Loads one rank of a tensor group: its share of layers
    /// `layout.layers` (the embedding and, on rank 0, the head whole).
    pub fn load_rank(
        path: impl AsRef<Path>,
        layout: StageLayout,
        options: &LoadOptions,
        rank: TensorRank,
    ) -> Result<Self> {
        Self::load_part(path.as_ref(), layout, options, Some(rank))
    }

    /// Loads stage `layout` as a tensor group: one rank per share of
    /// `split`, each summing with its collective in `collectives` (rank
    /// order, already joined to one another).
    pub fn load_group(
        path: impl AsRef<Path>,
        layout: StageLayout,
        options: &LoadOptions,
        split: &TensorSplit,
        collectives: Vec<Box<dyn AllReduce>>,
    ) -> Result<TensorGroup> {
        if collectives.len() != split.shares().len() {
            return Err(Error::Tensor(format!(
                "{} collectives for {} ranks",
                collectives.len(),
                split.shares().len()
            )));
        }
        let ranks = split
            .shares()
            .iter()
            .zip(collectives)
            .map(|(share, collective)| {
                let rank = TensorRank {
                    share: share.clone(),
                    collective,
                };
                let stage = Self::load_rank(path.as_ref(), layout.clone(), options, rank)?;
                Ok(Box::new(stage) as Box<dyn Stage>)
            })
            .collect::<Result<Vec<_>>>()?;
        TensorGroup::new(ranks)
    }

    fn load_part(
        path: &Path,
        layout: StageLayout,
        options: &LoadOptions,
        rank: Option<TensorRank>,
    ) -> Result<Self> {
        if path.is_dir() {
            let (config, json) = crate::config::read_dir_config(path)?;
            let dir = SafetensorsDir::open(path, config.architecture, &json)?;
            let source = Source::Safetensors(dir);
            return Self::build(config, source, layout, options, Device::Cpu, rank);
        }
        let file = GgufFile::open(path)?;
        let source = Source::Gguf {
            file: &file,
            reader: file.reader()?,
        };
        Self::build(
            file.config().clone(),
            source,
            layout,
            options,
            Device::Cpu,
            rank,
        )
    }

    /// Loads a stage from an opened GGUF file onto `device`.
    pub fn load_from(
        file: &GgufFile,
        layout: StageLayout,
        options: &LoadOptions,
        device: Device,
    ) -> Result<Self> {
        let source = Source::Gguf {
            file,
            reader: file.reader()?,
        };
        Self::build(file.config().clone(), source, layout, options, device, None)
    }

    fn build(
        config: ModelConfig,
        source: Source<'_>,
        layout: StageLayout,
        options: &LoadOptions,
        device: Device,
        tensor: Option<TensorRank>,
    ) -> Result<Self> {
        if let Some(rank) = &tensor {
            check_share(&config, &rank.share)?;
        }
        let share = tensor.as_ref().map(|t| &t.share);
        // The layout was built for the model the caller expected; check it against this one.
        let layout = StageLayout::new(layout.layers, config.layers)?;
        let context_length = options
            .context_length
            .unwrap_or(config.context_length)
            .max(1);
        // GGUF Llama permutes Q/K for interleaved RoPE; Hugging Face keeps
        // the halves layout. DeepSeek rotates pairs in both.
        let interleaved_rope = (matches!(source, Source::Gguf { .. })
            && config.architecture.interleaved_rope())
            || config.architecture.traditional_rope();
        let mut loader = TensorLoader {
            source,
            device: device.clone(),
            requantize: options.requantize_slow_types,
            dequantize: options.dequantize,
            bytes: 0,
        };
        let embedding = if layout.is_first() {
            Some(loader.quantized("token_embd.weight")?)
        } else {
            None
        };
        let layers = layout
            .layers
            .clone()
            .map(|i| LayerWeights::load(&mut loader, i, &config, share))
            .collect::<Result<Vec<_>>>()?;
        // In a tensor group, rank 0 alone computes the logits.
        let head = if layout.is_last() && share.is_none_or(|s| s.is_leader()) {
            let norm = loader.vector("output_norm.weight")?;
            // Tied embeddings: the output head is the embedding matrix.
            let name = if loader.has("output.weight") {
                "output.weight"
            } else {
                "token_embd.weight"
            };
            Some((norm, loader.matrix(name)?))
        } else {
            None
        };
        let rope = RopeTables::new(&config, context_length, &device)?;
        Ok(CandleStage {
            weight_bytes: loader.bytes,
            interleaved_rope,
            config,
            layout,
            context_length,
            device,
            embedding,
            layers,
            head,
            rope,
            kv_precision: options.kv_precision,
            sequences: HashMap::new(),
            prefix: PrefixCache::new(DEFAULT_BLOCK_TOKENS, options.prefix_cache_bytes),
            tensor,
        })
    }

    /// Sums a partial layer output across the tensor group (nothing to do
    /// for a stage of its own).
    fn reduce(tensor: &mut Option<TensorRank>, partial: Tensor) -> Result<Tensor> {
        let Some(rank) = tensor else {
            return Ok(partial);
        };
        let shape = partial.shape().clone();
        let mut values = partial
            .to_dtype(DType::F32)?
            .flatten_all()?
            .to_vec1::<f32>()?;
        rank.collective
            .all_reduce(&mut values)
            .map_err(|e| Error::Unavailable(format!("tensor all-reduce: {e}")))?;
        Ok(Tensor::from_vec(values, shape, partial.device())?)
    }

    /// An empty cache for a new sequence: per token and layer, this stage's
    /// KV heads (its share, in a tensor group) × head dim of keys and of
    /// values, or latent attention's one row.
    fn new_cache(&self) -> SequenceCache {
        let layers = self.layers.len();
        if let Some(latent) = &self.config.latent {
            return SequenceCache::new(
                layers,
                latent.cache_width(),
                Some(latent.kv_lora_rank),
                self.kv_precision,
            );
        }
        let kv_heads = match &self.tensor {
            Some(t) => t.share.kv_heads.len(),
            None => self.config.kv_heads,
        };
        SequenceCache::new(
            layers,
            kv_heads * self.config.head_dim,
            None,
            self.kv_precision,
        )
    }

    /// Stacks the inputs into rows and plans each sequence's share.
    fn stack(&self, batch: &[(SequenceId, StageInput)]) -> Result<(Tensor, Vec<Item>)> {
        let items = plan_step(
            batch,
            &self.config,
            &self.layout,
            self.context_length,
            |seq| self.sequence_len(seq),
        )?;
        let mut rows = batch
            .iter()
            .map(|(_, input)| self.input_rows(input))
            .collect::<Result<Vec<_>>>()?;
        let x = if rows.len() == 1 {
            rows.pop().expect("one row block")
        } else {
            Tensor::cat(&rows, 0)?
        };
        Ok((x, items))
    }

    /// An input's rows (checked by `plan_step`).
    fn input_rows(&self, input: &StageInput) -> Result<Tensor> {
        match (input, &self.embedding) {
            (StageInput::Tokens(ids), Some(embedding)) => {
                let ids = Tensor::new(ids.as_slice(), &self.device)?;
                let rows = embedding.embedding(&ids)?.to_dtype(DType::F32)?;
                match self.config.embedding_scale {
                    1.0 => Ok(rows),
                    scale => Ok((rows * f64::from(scale))?),
                }
            }
            (StageInput::Tokens(_), None) => Err(Error::InvalidInput(
                "token ids for a stage without the embedding".into(),
            )),
            (StageInput::Hidden(a), _) => Ok(Tensor::from_slice(
                &a.data,
                (a.tokens, a.hidden),
                &self.device,
            )?),
        }
    }

    fn run(&mut self, batch: Vec<(SequenceId, StageInput)>) -> Result<Vec<StageOutput>> {
        let (mut x, items) = self.stack(&batch)?;
        for item in &items {
            if !self.sequences.contains_key(&item.seq) {
                let cache = self.new_cache();
                self.sequences.insert(item.seq, cache);
            }
        }
        let result = (|| {
            // Each row's RoPE angles, gathered once for every layer.
            let rope = self.rope.rows(&items, self.config.head_dim, &self.device)?;
            for l in 0..self.layers.len() {
                x = self.layer(l, &x, &items, &rope)?;
            }
            self.outputs(&x, &items)
        })();
        match result {
            Ok(outputs) => {
                for (item, (_, input)) in items.iter().zip(&batch) {
                    if let Some(cache) = self.sequences.get_mut(&item.seq) {
                        cache.position += item.len;
                        match input {
                            StageInput::Tokens(ids) => cache.tokens.extend_from_slice(ids),
                            // Rows whose tokens are not told leave the
                            // tokens short: such a sequence keeps no blocks.
                            StageInput::Hidden(a) => cache
                                .tokens
                                .extend_from_slice(a.told_ids().unwrap_or_default()),
                        }
                    }
                }
                Ok(outputs)
            }
            Err(e) => {
                // A failed step leaves these caches half-written: drop them.
                for item in &items {
                    self.sequences.remove(&item.seq);
                }
                Err(e)
            }
        }
    }

    /// One layer over all rows; `rope` holds each row's angles
    /// ([`RopeTables::rows`]).
    fn layer(&mut self, l: usize, x: &Tensor, items: &[Item], rope: &RopeTables) -> Result<Tensor> {
        let cfg = &self.config;
        let (heads, kv_heads) = match &self.tensor {
            Some(t) => (t.share.heads.len(), t.share.kv_heads.len()),
            None => (cfg.heads, cfg.kv_heads),
        };
        let hd = cfg.head_dim;
        let eps = cfg.rms_eps as f32;
        let w = &self.layers[l];
        let shape = cfg.layer_attention(self.layout.layers.start + l);
        let (cos, sin) = rope.for_layer(&shape);
        let rows = x.dim(0)?;
        let h = candle_nn::ops::rms_norm(x, &w.attn_norm, eps)?;
        // RoPE of every row at its own position, in one operation.
        let rotate = |t: &Tensor| -> Result<Tensor> {
            Ok(match self.interleaved_rope {
                true => candle_nn::rotary_emb::rope_i(t, cos, sin)?,
                false => candle_nn::rotary_emb::rope(t, cos, sin)?,
            })
        };
        let (step, heads_shape) = match &w.projections {
            Projections::Heads {
                q,
                k,
                v,
                q_norm,
                k_norm,
            } => {
                let mut q = q.forward(&h)?.reshape((rows, heads, hd))?;
                let mut k = k.forward(&h)?.reshape((rows, kv_heads, hd))?;
                let v = v.forward(&h)?;
                if let (Some(qn), Some(kn)) = (q_norm, k_norm) {
                    q = candle_nn::ops::rms_norm(&q, qn, eps)?;
                    k = candle_nn::ops::rms_norm(&k, kn, eps)?;
                }
                let q = rotate(&q.reshape((rows, heads, 1, hd))?)?;
                let k = rotate(&k.reshape((rows, kv_heads, 1, hd))?)?;
                let step = StepRows {
                    q: q.flatten_all()?.to_vec1::<f32>()?,
                    k: k.flatten_all()?.to_vec1::<f32>()?,
                    v: v.flatten_all()?.to_vec1::<f32>()?,
                };
                let shape = AttentionShape {
                    heads,
                    kv_heads,
                    head_dim: hd,
                    value_dim: hd,
                    scale: cfg.attention_scale,
                    window: shape.window,
                };
                (step, shape)
            }
            // Every head attends to one shared latent row per token.
            Projections::Latent(latent) => {
                let shape = AttentionShape {
                    heads,
                    kv_heads: 1,
                    head_dim: latent.key_width(),
                    value_dim: latent.value_width(),
                    scale: cfg.attention_scale,
                    window: shape.window,
                };
                (latent.rows(&h, &rotate)?, shape)
            }
        };
        let attended = attend_cached(
            &mut self.sequences,
            l,
            items,
            &step,
            &heads_shape,
            w.sinks.as_deref(),
        )?;
        let y = match &w.projections {
            Projections::Latent(latent) => latent.values(attended, &self.device)?,
            Projections::Heads { .. } => {
                Tensor::from_vec(attended, (rows, heads * hd), &self.device)?
            }
        };
        let post = |t: Tensor, norm: &Option<Tensor>| -> Result<Tensor> {
            match norm {
                Some(n) => Ok(candle_nn::ops::rms_norm(&t, n, eps)?),
                None => Ok(t),
            }
        };
        let attended = Self::reduce(&mut self.tensor, w.o.forward(&y)?)?;
        let x = (x + post(attended, &w.post_attn_norm)?)?;
        let h = candle_nn::ops::rms_norm(&x, &w.ffn_norm, eps)?;
        let ffn = w.ffn.forward(&h, cfg.architecture.activation())?;
        let ffn = Self::reduce(&mut self.tensor, ffn)?;
        Ok((x + post(ffn, &w.post_ffn_norm)?)?)
    }

    fn outputs(&self, x: &Tensor, items: &[Item]) -> Result<Vec<StageOutput>> {
        if self.layout.is_last() && self.head.is_none() {
            // A tensor rank other than 0: the leader gives the logits.
            return Ok(vec![StageOutput::Logits(Vec::new()); items.len()]);
        }
        match &self.head {
            Some((norm, head)) => {
                let last_rows: Vec<u32> = items
                    .iter()
                    .map(|i| (i.offset + i.len - 1) as u32)
                    .collect();
                let rows = x.index_select(&Tensor::new(last_rows.as_slice(), &self.device)?, 0)?;
                let rows = candle_nn::ops::rms_norm(&rows, norm, self.config.rms_eps as f32)?;
                let logits = dense::forward(head, &rows)?.to_dtype(DType::F32)?;
                Ok(logits
                    .to_vec2::<f32>()?
                    .into_iter()
                    .map(StageOutput::Logits)
                    .collect())
            }
            None => items
                .iter()
                .map(|i| {
                    let data = x
                        .narrow(0, i.offset, i.len)?
                        .flatten_all()?
                        .to_vec1::<f32>()?;
                    Ok(StageOutput::Hidden(Activations::new(
                        i.len,
                        self.config.hidden_size,
                        data,
                    )?))
                })
                .collect(),
        }
    }
}

/// Checks that a tensor rank's share fits the model (it was planned for
/// the model the caller expected).
fn check_share(config: &ModelConfig, share: &crate::tensor::RankShare) -> Result<()> {
    let fits = share.kv_heads.end <= config.kv_heads
        && !share.kv_heads.is_empty()
        && share.heads.len() * config.kv_heads == share.kv_heads.len() * config.heads
        && share.intermediate.end <= config.intermediate_size
        && !share.intermediate.is_empty();
    let fits = fits
        && match &config.moe {
            Some(moe) => {
                share.expert_intermediate.end <= moe.expert_intermediate_size
                    && !share.expert_intermediate.is_empty()
                    && match moe.shared_expert {
                        Some(width) => {
                            share.shared_intermediate.end <= width
                                && !share.shared_intermediate.is_empty()
                        }
                        None => true,
                    }
            }
            None => true,
        };
    if !fits {
        return Err(Error::Tensor(format!(
            "rank {}'s share (KV heads {:?}, columns {:?}, expert columns {:?}, shared expert \
             columns {:?}) does not fit a model of {} KV heads, {} columns and experts of {}",
            share.rank,
            share.kv_heads,
            share.intermediate,
            share.expert_intermediate,
            share.shared_intermediate,
            config.kv_heads,
            config.intermediate_size,
            config
                .moe
                .as_ref()
                .map_or(0, |m| m.expert_intermediate_size),
        )));
    }
    Ok(())
}

/// RoPE tables: the global layers', and the sliding layers' when their
/// base differs.
struct RopeTables {
    global: (Tensor, Tensor),
    sliding: Option<(Tensor, Tensor)>,
}

impl RopeTables {
    fn new(cfg: &ModelConfig, context: usize, device: &Device) -> Result<Self> {
        let table = |a: LayerAttention| rope_table(&cfg.inverse_frequencies(&a), context, device);
        Ok(RopeTables {
            global: table(cfg.global_attention())?,
            sliding: cfg
                .sliding
                .map(|s| table(cfg.sliding_attention(s)))
                .transpose()?,
        })
    }

    /// The angles of each row of a step, `[rows, 1, head dim / 2]` per
    /// table: row `i` at its sequence's position.
    fn rows(&self, items: &[Item], head_dim: usize, device: &Device) -> Result<RopeTables> {
        let positions: Vec<u32> = items
            .iter()
            .flat_map(|i| (i.position..i.position + i.len).map(|p| p as u32))
            .collect();
        let rows = positions.len();
        let positions = Tensor::new(positions.as_slice(), device)?;
        let gather = |(cos, sin): &(Tensor, Tensor)| -> Result<(Tensor, Tensor)> {
            let pick = |t: &Tensor| -> Result<Tensor> {
                Ok(t.index_select(&positions, 0)?
                    .reshape((rows, 1, head_dim / 2))?)
            };
            Ok((pick(cos)?, pick(sin)?))
        };
        Ok(RopeTables {
            global: gather(&self.global)?,
            sliding: self.sliding.as_ref().map(gather).transpose()?,
        })
    }

    fn for_layer(&self, shape: &LayerAttention) -> (&Tensor, &Tensor) {
        let (cos, sin) = match (&self.sliding, shape.window) {
            (Some(t), Some(_)) => t,
            _ => &self.global,
        };
        (cos, sin)
    }
}

/// cos and sin of `position × inverse frequency`, for every position.
fn rope_table(inv: &[f32], context: usize, device: &Device) -> Result<(Tensor, Tensor)> {
    let inv = Tensor::from_slice(inv, (1, inv.len()), device)?;
    let positions = Tensor::arange(0u32, context as u32, device)?
        .to_dtype(DType::F32)?
        .reshape((context, 1))?;
    let freqs = positions.broadcast_mul(&inv)?;
    Ok((freqs.cos()?.contiguous()?, freqs.sin()?.contiguous()?))
}

impl Stage for CandleStage {
    fn config(&self) -> &ModelConfig {
        &self.config
    }

    /// Keys and values in the precision the stage was loaded with.
    fn kv_bytes_per_token_per_layer(&self) -> usize {
        let floats = self.config.kv_bytes_per_token_per_layer() / std::mem::size_of::<f32>();
        floats * self.kv_precision.bytes()
    }

    fn layout(&self) -> &StageLayout {
        &self.layout
    }

    fn context_length(&self) -> usize {
        self.context_length
    }

    fn forward_batch(&mut self, batch: Vec<(SequenceId, StageInput)>) -> Result<Vec<StageOutput>> {
        if batch.is_empty() {
            return Ok(Vec::new());
        }
        self.run(batch)
    }

    fn release(&mut self, seq: SequenceId) -> bool {
        self.retain_prefix(seq);
        self.sequences.remove(&seq).is_some()
    }

    fn reuse_prefix(&mut self, seq: SequenceId, tokens: &[u32]) -> usize {
        if self.tensor.is_some() || !self.prefix.enabled() || self.sequences.contains_key(&seq) {
            return 0;
        }
        let mut cache = self.new_cache();
        let block_tokens = self.prefix.block_tokens();
        let windows = self.config.layer_windows(self.layout.layers.clone());
        let hit = self.prefix.lookup(tokens, tokens.len().saturating_sub(1));
        if hit.blocks.is_empty() {
            return 0;
        }
        // Each layer from the first block it needs: a sliding layer's rows
        // before its window may not have been kept.
        let Some(firsts) = hit.layer_firsts(block_tokens, &windows) else {
            let unused = hit.tokens;
            self.prefix.unused_hit(unused);
            return 0;
        };
        let seeded = (|| -> Result<SequenceCache> {
            for (l, kv) in cache.layers.iter_mut().enumerate() {
                let first = firsts[l];
                kv.start_at(first * block_tokens);
                for block in &hit.blocks[first..] {
                    let (k, v) = block[l].as_ref().expect("checked by layer_firsts");
                    kv.append_rows(k, v, KV_CHUNK)?;
                }
            }
            cache.position = hit.tokens;
            cache.tokens = tokens[..cache.position].to_vec();
            Ok(cache)
        })();
        match seeded {
            Ok(cache) => {
                let n = cache.position;
                self.sequences.insert(seq, cache);
                n
            }
            // Out of memory or the like: the sequence runs its whole prompt.
            Err(e) => {
                tracing::warn!(error = %e, "cannot start a sequence from the prefix cache");
                0
            }
        }
    }

    fn retain_prefix(&mut self, seq: SequenceId) {
        // Only a stage that reuses prefixes keeps them (see `reuse_prefix`).
        if self.tensor.is_some() {
            return;
        }
        let Some(cache) = self.sequences.get(&seq) else {
            return;
        };
        if cache.tokens.len() != cache.position {
            return;
        }
        let stored = self.prefix.insert(
            &cache.tokens,
            |range| {
                let mut layers = Vec::with_capacity(cache.layers.len());
                let mut bytes = 0;
                for kv in &cache.layers {
                    if kv.len() < range.end {
                        return Err(Error::InvalidInput(
                            "a KV cache shorter than its tokens".into(),
                        ));
                    }
                    // A sliding layer's forgotten rows are missing from the block.
                    let rows = kv.rows(range.clone());
                    if let Some((k, v)) = &rows {
                        bytes += k.held_bytes() + v.held_bytes();
                    }
                    layers.push(rows);
                }
                Ok::<_, Error>((layers, bytes))
            },
            |block, range| {
                block.iter().any(Option::is_none)
                    && cache.layers.iter().all(|kv| kv.start() <= range.start)
            },
        );
        if let Err(e) = stored {
            tracing::warn!(error = %e, "cannot keep a sequence's blocks in the prefix cache");
        }
    }

    fn prefix_cache(&self) -> PrefixCacheStats {
        self.prefix.stats()
    }

    fn sequence_len(&self, seq: SequenceId) -> usize {
        self.sequences.get(&seq).map_or(0, |s| s.position)
    }

    fn sequences(&self) -> usize {
        self.sequences.len()
    }

    fn weight_bytes(&self) -> usize {
        self.weight_bytes
    }

    fn kv_cache_bytes(&self) -> usize {
        self.sequences
            .values()
            .flat_map(|s| &s.layers)
            .map(LayerKv::bytes)
            .sum()
    }
}
