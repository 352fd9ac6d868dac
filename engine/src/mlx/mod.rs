//! The MLX backend: a stage computed by libmlx (Metal on Apple Silicon, the
//! CPU elsewhere) through a small C++ shim of our own (`engine/mlx/shim.cpp`).
//!
//! It reads two layouts:
//! - GGUF, through the engine's own reader (`gguf_read`): quantized weights
//!   stay quantized as MLX groups of the same values; GGUF Llama permutes
//!   Q/K for interleaved ("traditional") RoPE;
//! - the MLX-community safetensors layout: a directory with `config.json`,
//!   `*.safetensors` (quantized weights as `weight` / `scales` / `biases`) and
//!   `tokenizer.json`; `shardplane convert` writes it from a GGUF file.
//!
//! Like the candle backend, one code path serves prefill and batched decode:
//! rows of all sequences are stacked for the projections and attention runs per
//! sequence on its own KV cache, with MLX's fused rms_norm, rope and
//! scaled-dot-product attention. Every MLX call runs under one process-wide
//! lock: MLX's graph and streams are not meant to be driven from several
//! threads at once.
//!
//! Layout: this module holds the stage (forward, KV caches); `weights` loads
//! the weights by role; `names` maps roles to each layout's tensor names;
//! `array` and `ffi` wrap the shim; `convert` writes the safetensors layout;
//! `distributed` is MLX's ring backend.

mod array;
pub mod convert;
pub mod distributed;
mod ffi;
mod gguf_read;
mod latent;
mod moe;
mod weights;

use std::collections::{BTreeSet, HashMap};
use std::path::Path;
use std::sync::{Mutex, MutexGuard};

use crate::names::{Layout, Weight};
pub use array::{
    Array, Dtype, Mask, Quant, QuantMode, TensorMap, attention, blas, cache_memory, dequantize,
    quantized_matmul, rms_norm, rope, version,
};
use weights::{LayerWeights, Linear, Loader, Projections};

use crate::config::{ModelConfig, read_dir_config, safetensors_files, sliding_kept};
use crate::error::{Error, Result};
use crate::gguf::GgufFile;
use crate::prefix::{DEFAULT_BLOCK_TOKENS, PrefixCache, PrefixCacheStats};
use crate::stage::{
    Activations, Item, LoadOptions, SequenceId, Stage, StageInput, StageLayout, StageOutput,
    plan_step,
};

/// KV caches grow in steps of this many tokens.
const KV_CHUNK: usize = 256;

static LOCK: Mutex<()> = Mutex::new(());

/// Takes the process-wide MLX lock (a panic elsewhere does not poison MLX).
pub fn lock() -> MutexGuard<'static, ()> {
    LOCK.lock().unwrap_or_else(|p| p.into_inner())
}

/// One sequence's KV cache in one layer: `[1, kv_heads, capacity, head_dim]`
/// each (latent attention: `k` the latent, `v` the rotated key part, one
/// head each). Row 0 is position `start`: a sliding layer, when it needs
/// more room, keeps only the rows its queries can still see and a window
/// more (so it holds a few windows at most, however long the sequence).
struct LayerCache {
    k: Array,
    v: Array,
    start: usize,
    capacity: usize,
}

struct SequenceCache {
    position: usize,
    layers: Vec<Option<LayerCache>>,
    /// The token ids it holds, when it came as tokens (a first stage).
    tokens: Vec<u32>,
}

/// A stage of a model computed with MLX.
pub struct MlxStage {
    config: ModelConfig,
    layout: StageLayout,
    context_length: usize,
    traditional_rope: bool,
    /// Per layer, YaRN's frequencies as the periods MLX divides positions
    /// by (`None`: RoPE from its base).
    rope_periods: Vec<Option<Array>>,
    embedding: Option<Linear>,
    layers: Vec<LayerWeights>,
    head: Option<(Array, Linear)>,
    weight_bytes: usize,
    sequences: HashMap<SequenceId, SequenceCache>,
    /// Blocks of prompts' KV: per layer, `[1, kv_heads, block, head_dim]`
    /// keys and values (copies, not views of a sequence's cache; `None`: a
    /// sliding layer had forgotten the block's rows).
    prefix: PrefixCache<Vec<Option<LayerCache>>>,
}

impl std::fmt::Debug for MlxStage {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("MlxStage")
            .field("architecture", &self.config.architecture)
            .field("layers", &self.layout.layers)
            .field("total_layers", &self.layout.total_layers)
            .field("sequences", &self.sequences.len())
            .field("weight_bytes", &self.weight_bytes)
            .finish()
    }
}

impl Drop for MlxStage {
    fn drop(&mut self) {
        let _guard = lock();
        drop(std::mem::take(&mut self.sequences));
        self.prefix.clear();
        drop(std::mem::take(&mut self.layers));
        drop(self.embedding.take());
        drop(self.head.take());
    }
}

impl MlxStage {
    /// Loads layers `layout.layers` of a model: a GGUF file, or a directory in
    /// the MLX-community layout.
    pub fn load(
        path: impl AsRef<Path>,
        layout: StageLayout,
        options: &LoadOptions,
    ) -> Result<Self> {
        let path = path.as_ref();
        if path.is_dir() {
            let (config, _) = read_dir_config(path)?;
            let files = safetensors_files(path)?;
            let _guard = lock();
            let maps = files
                .iter()
                .map(|f| TensorMap::load_safetensors(f))
                .collect::<Result<Vec<_>>>()?;
            Self::build(
                config,
                (maps, BTreeSet::new()),
                Layout::Mlx,
                path,
                layout,
                options,
            )
        } else {
            let file = GgufFile::open(path)?;
            Self::load_gguf(&file, layout, options)
        }
    }

    /// Loads a stage from a GGUF file whose header is already read.
    pub fn load_gguf(file: &GgufFile, layout: StageLayout, options: &LoadOptions) -> Result<Self> {
        let total = file.config().layers;
        StageLayout::new(layout.layers.clone(), total)?;
        let _guard = lock();
        let read = gguf_read::load(file, layout.layers.clone(), total)?;
        Self::build(
            file.config().clone(),
            (vec![read.map], read.spread),
            Layout::Gguf,
            file.path(),
            layout,
            options,
        )
    }

    /// A stage from `maps` (with the weights of them held spread).
    fn build(
        config: ModelConfig,
        (maps, spread): (Vec<TensorMap>, BTreeSet<String>),
        file_layout: Layout,
        origin: &Path,
        layout: StageLayout,
        options: &LoadOptions,
    ) -> Result<Self> {
        let layout = StageLayout::new(layout.layers, config.layers)?;
        // Naming the BLAS also keeps OpenBLAS linked ahead of the wheel's own.
        tracing::debug!(mlx = %version(), blas = %blas(), "loading an MLX stage");
        let context_length = options
            .context_length
            .unwrap_or(config.context_length)
            .max(1);
        let mut loader = Loader {
            maps,
            layout: file_layout,
            architecture: config.architecture,
            origin: origin.to_path_buf(),
            bytes: 0,
            dequantize: options.dequantize,
            spread,
        };
        let (v, h) = (config.vocab_size, config.hidden_size);
        let embedding = if layout.is_first() {
            Some(loader.linear(Weight::Embedding, v, h)?)
        } else {
            None
        };
        let layers = layout
            .layers
            .clone()
            .map(|n| loader.layer(n, &config))
            .collect::<Result<Vec<_>>>()?;
        let head = if layout.is_last() {
            let norm = loader.vector(Weight::FinalNorm, h)?;
            // Tied embeddings: the head is the embedding matrix.
            let which = if loader.has(Weight::Head) {
                Weight::Head
            } else {
                Weight::Embedding
            };
            Some((norm, loader.linear(which, v, h)?))
        } else {
            None
        };
        let rope_periods = layout
            .layers
            .clone()
            .map(|l| {
                let shape = config.layer_attention(l);
                if !config.rope_frequencies_scaled() {
                    return Ok(None);
                }
                let periods: Vec<f32> = config
                    .inverse_frequencies(&shape)
                    .iter()
                    .map(|f| 1.0 / f)
                    .collect();
                let a = Array::from_f32(&periods, &[periods.len()])?;
                // Made on the loading thread: evaluate it here (see `Loader::vector`).
                Array::eval(&[&a])?;
                Ok(Some(a))
            })
            .collect::<Result<Vec<_>>>()?;
        Ok(MlxStage {
            rope_periods,
            // GGUF Llama permutes Q/K for interleaved RoPE; the converter (and
            // Hugging Face) keep the halves layout.
            // DeepSeek rotates pairs in both.
            traditional_rope: (file_layout == Layout::Gguf
                && config.architecture.interleaved_rope())
                || config.architecture.traditional_rope(),
            weight_bytes: loader.bytes,
            config,
            layout,
            context_length,
            embedding,
            layers,
            head,
            sequences: HashMap::new(),
            prefix: PrefixCache::new(DEFAULT_BLOCK_TOKENS, options.prefix_cache_bytes),
        })
    }

    /// The stacked input rows `[tokens, hidden]` (f32).
    fn stack(&self, batch: &[(SequenceId, StageInput)]) -> Result<Array> {
        let tokens: Vec<u32> = batch
            .iter()
            .filter_map(|(_, i)| match i {
                StageInput::Tokens(t) => Some(t.as_slice()),
                StageInput::Hidden(_) => None,
            })
            .flatten()
            .copied()
            .collect();
        if tokens.len() == batch.iter().map(|(_, i)| i.len()).sum::<usize>() {
            let embedding = self
                .embedding
                .as_ref()
                .expect("a first stage has the embedding (plan_step)");
            let rows = embedding.rows(&Array::from_u32(&tokens, &[tokens.len()])?)?;
            return match self.config.embedding_scale {
                1.0 => Ok(rows),
                scale => rows.scale(scale),
            };
        }
        let mut data = Vec::new();
        let mut rows = 0;
        for (_, input) in batch {
            match input {
                StageInput::Hidden(a) => {
                    data.extend_from_slice(&a.data);
                    rows += a.tokens;
                }
                StageInput::Tokens(_) => {
                    return Err(Error::InvalidInput(
                        "one step mixes token ids and hidden states".into(),
                    ));
                }
            }
        }
        Array::from_f32(&data, &[rows, self.config.hidden_size])
    }

    fn run(&mut self, batch: Vec<(SequenceId, StageInput)>) -> Result<Vec<StageOutput>> {
        let items = plan_step(
            &batch,
            &self.config,
            &self.layout,
            self.context_length,
            |seq| self.sequence_len(seq),
        )?;
        let ids: Vec<Option<Vec<u32>>> = batch
            .iter()
            .map(|(_, input)| match input {
                StageInput::Tokens(t) => Some(t.clone()),
                // Rows whose tokens are not told leave the tokens short:
                // such a sequence keeps no blocks.
                StageInput::Hidden(a) => a.told_ids().map(<[u32]>::to_vec),
            })
            .collect();
        let _guard = lock();
        let result = (|| {
            let mut x = self.stack(&batch)?;
            drop(batch);
            for item in &items {
                self.reserve(item)?;
            }
            for l in 0..self.layers.len() {
                x = self.layer(l, &x, &items)?;
            }
            self.outputs(&x, &items)
        })();
        match result {
            Ok(outputs) => {
                for (item, ids) in items.iter().zip(ids) {
                    if let Some(cache) = self.sequences.get_mut(&item.seq) {
                        cache.position += item.len;
                        cache.tokens.extend(ids.unwrap_or_default());
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

    /// A layer cache's KV heads, and the floats per head of its keys and of
    /// its values (latent attention: one head of latent and rotated key).
    fn cache_widths(&self) -> (usize, usize, usize) {
        match &self.config.latent {
            Some(latent) => (1, latent.kv_lora_rank, latent.rope_dim),
            None => (
                self.config.kv_heads,
                self.config.head_dim,
                self.config.head_dim,
            ),
        }
    }

    /// Each of the stage's layers' window (`None`: it sees every position).
    fn windows(&self) -> Vec<Option<usize>> {
        self.config.layer_windows(self.layout.layers.clone())
    }

    /// Makes room in `item`'s caches for its new tokens: a layer that is
    /// full grows by whole chunks; a sliding one moves to new arrays that
    /// keep only the rows from the step's first key on (and a window more,
    /// `sliding_kept`, for the prefix cache), with room for a window (or a
    /// chunk) more.
    fn reserve(&mut self, item: &Item) -> Result<()> {
        let (kvh, kw, vw) = self.cache_widths();
        let windows = self.windows();
        let cache = self
            .sequences
            .entry(item.seq)
            .or_insert_with(|| SequenceCache {
                position: 0,
                layers: windows.iter().map(|_| None).collect(),
                tokens: Vec::new(),
            });
        let (position, needed) = (item.position, item.position + item.len);
        for (slot, window) in cache.layers.iter_mut().zip(windows) {
            let (start, capacity) = slot.as_ref().map_or((0, 0), |c| (c.start, c.capacity));
            if needed <= start + capacity {
                continue;
            }
            let (keep, room) = match window {
                Some(w) => (
                    item.first_key(Some(sliding_kept(w))).max(start),
                    w.max(KV_CHUNK),
                ),
                None => (start, 0),
            };
            let capacity = (needed - keep + room).div_ceil(KV_CHUNK) * KV_CHUNK;
            let grown = |old: Option<&Array>, hd: usize| -> Result<Array> {
                let fresh = Array::zeros(&[1, kvh, capacity, hd], Dtype::F32)?;
                match old {
                    Some(old) if position > keep => {
                        let kept =
                            old.slice(&[0, 0, keep - start, 0], &[1, kvh, position - start, hd])?;
                        fresh.slice_update(&kept, &[0, 0, 0, 0], &[1, kvh, position - keep, hd])
                    }
                    _ => Ok(fresh),
                }
            };
            let k = grown(slot.as_ref().map(|c| &c.k), kw)?;
            let v = grown(slot.as_ref().map(|c| &c.v), vw)?;
            *slot = Some(LayerCache {
                k,
                v,
                start: keep,
                capacity,
            });
        }
        Ok(())
    }

    fn layer(&mut self, l: usize, x: &Array, items: &[Item]) -> Result<Array> {
        let cfg = &self.config;
        let (heads, kvh, hd) = (cfg.heads, cfg.kv_heads, cfg.head_dim);
        let eps = cfg.rms_eps as f32;
        let w = &self.layers[l];
        let shape = cfg.layer_attention(self.layout.layers.start + l);
        let h = rms_norm(x, &w.attn_norm, eps)?;
        let scale = cfg.attention_scale;
        let periods = self.rope_periods[l].as_ref();
        // Periods made at load hold the linear scale already.
        let rope_scale = match periods {
            Some(_) => 1.0,
            None => 1.0 / shape.rope_scale,
        };
        let mut ys = Vec::with_capacity(items.len());
        let rotate_at = |t: &Array, pos: usize| {
            rope(
                t,
                hd,
                self.traditional_rope,
                shape.rope_theta,
                rope_scale,
                pos,
                periods,
            )
        };
        let (q, k, v, q_norm, k_norm) = match &w.projections {
            Projections::Heads {
                q,
                k,
                v,
                q_norm,
                k_norm,
            } => (
                q.forward(&h)?,
                k.forward(&h)?,
                v.forward(&h)?,
                q_norm.as_ref(),
                k_norm.as_ref(),
            ),
            Projections::Latent(latent) => {
                let rows = latent.project(&h)?;
                for item in items {
                    let cache = self
                        .sequences
                        .get_mut(&item.seq)
                        .and_then(|s| s.layers[l].as_mut())
                        .expect("reserved before the layers");
                    let rotate = |t: &Array| rotate_at(t, item.position);
                    ys.push(latent.attend((&rows.0, &rows.1), item, cache, &rotate, scale)?);
                }
                return self.finish_layer(l, x, items, ys);
            }
        };
        for item in items {
            let (n, pos) = (item.len, item.position);
            // Rows of this sequence as [1, heads, n, head_dim].
            let split = |t: &Array, nh: usize, norm: Option<&Array>| -> Result<Array> {
                let rows = t.slice(&[item.offset, 0], &[item.offset + n, nh * hd])?;
                let mut r = rows.reshape(&[1, n, nh, hd])?;
                if let Some(norm) = norm {
                    r = rms_norm(&r, norm, eps)?;
                }
                r.transpose(&[0, 2, 1, 3])
            };
            let qi = split(&q, heads, q_norm)?;
            let ki = split(&k, kvh, k_norm)?;
            let vi = split(&v, kvh, None)?;
            let (qi, ki) = (rotate_at(&qi, pos)?, rotate_at(&ki, pos)?);
            let cache = self
                .sequences
                .get_mut(&item.seq)
                .and_then(|s| s.layers[l].as_mut())
                .expect("reserved before the layers");
            // Row 0 of the arrays is position `cache.start`.
            let base = cache.start;
            let at = |p: usize| p - base;
            let (from, to) = ([0, 0, at(pos), 0], [1, kvh, at(pos + n), hd]);
            cache.k = cache.k.slice_update(&ki, &from, &to)?;
            cache.v = cache.v.slice_update(&vi, &from, &to)?;
            // A sliding layer reads only the keys its window reaches.
            let first = item.first_key(shape.window);
            let keys = cache
                .k
                .slice(&[0, 0, at(first), 0], &[1, kvh, at(pos + n), hd])?;
            let values = cache
                .v
                .slice(&[0, 0, at(first), 0], &[1, kvh, at(pos + n), hd])?;
            let window_mask = match shape.window {
                Some(_) => item
                    .mask(first, shape.window)
                    .map(|m| Array::from_f32(&m, &[n, pos + n - first]))
                    .transpose()?,
                None => None,
            };
            let mask = match (&window_mask, n) {
                (Some(m), _) => Mask::Array(m),
                (None, 1) => Mask::None,
                (None, _) => Mask::Causal,
            };
            let y = attention(&qi, &keys, &values, scale, mask, w.sinks.as_ref())?;
            ys.push(y.transpose(&[0, 2, 1, 3])?.reshape(&[n, heads * hd])?);
        }
        self.finish_layer(l, x, items, ys)
    }

    /// The rest of layer `l` once each sequence's attention rows `ys` are
    /// made: the output projection, the feed-forward block, and the
    /// evaluation that writes the caches.
    fn finish_layer(
        &self,
        l: usize,
        x: &Array,
        items: &[Item],
        mut ys: Vec<Array>,
    ) -> Result<Array> {
        let cfg = &self.config;
        let eps = cfg.rms_eps as f32;
        let w = &self.layers[l];
        let y = if ys.len() == 1 {
            ys.pop().expect("one item")
        } else {
            Array::concatenate(&ys.iter().collect::<Vec<_>>(), 0)?
        };
        let post = |t: Array, norm: &Option<Array>| -> Result<Array> {
            match norm {
                Some(n) => rms_norm(&t, n, eps),
                None => Ok(t),
            }
        };
        let x = x.add(&post(w.o.forward(&y)?, &w.post_attn_norm)?)?;
        let h = rms_norm(&x, &w.ffn_norm, eps)?;
        let ffn = w.ffn.forward(&h, cfg.architecture.activation())?;
        let out = x.add(&post(ffn, &w.post_ffn_norm)?)?;
        // Evaluate layer by layer: the graph stays small and the caches are
        // written before the next step reads them.
        let mut arrays = vec![&out];
        for item in items {
            if let Some(c) = self.sequences[&item.seq].layers[l].as_ref() {
                arrays.push(&c.k);
                arrays.push(&c.v);
            }
        }
        Array::eval(&arrays)?;
        Ok(out)
    }

    fn outputs(&self, x: &Array, items: &[Item]) -> Result<Vec<StageOutput>> {
        match &self.head {
            Some((norm, head)) => {
                let last: Vec<u32> = items
                    .iter()
                    .map(|i| (i.offset + i.len - 1) as u32)
                    .collect();
                let rows = x.take(&Array::from_u32(&last, &[last.len()])?, 0)?;
                let rows = rms_norm(&rows, norm, self.config.rms_eps as f32)?;
                let logits = head.forward(&rows)?.to_f32()?;
                let v = self.config.vocab_size;
                Ok(logits
                    .chunks(v)
                    .map(|c| StageOutput::Logits(c.to_vec()))
                    .collect())
            }
            None => {
                let all = x.to_f32()?;
                let h = self.config.hidden_size;
                items
                    .iter()
                    .map(|i| {
                        let data = all[i.offset * h..(i.offset + i.len) * h].to_vec();
                        Ok(StageOutput::Hidden(Activations::new(i.len, h, data)?))
                    })
                    .collect()
            }
        }
    }
}

impl Stage for MlxStage {
    fn config(&self) -> &ModelConfig {
        &self.config
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
        let _guard = lock();
        self.sequences.remove(&seq).is_some()
    }

    fn reuse_prefix(&mut self, seq: SequenceId, tokens: &[u32]) -> usize {
        if !self.prefix.enabled() || self.sequences.contains_key(&seq) {
            return 0;
        }
        let (kvh, kw, vw) = self.cache_widths();
        let windows = self.windows();
        let block_tokens = self.prefix.block_tokens();
        let _guard = lock();
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
        let (blocks, held) = (hit.blocks, hit.tokens);
        let seeded = (|| -> Result<Vec<Option<LayerCache>>> {
            let mut layers = Vec::with_capacity(self.layers.len());
            for (l, &first) in firsts.iter().enumerate() {
                let start = first * block_tokens;
                let rows = held - start;
                let capacity = rows.div_ceil(KV_CHUNK).max(1) * KV_CHUNK;
                let fill = |part: fn(&LayerCache) -> &Array, hd: usize| -> Result<Array> {
                    let fresh = Array::zeros(&[1, kvh, capacity, hd], Dtype::F32)?;
                    let parts: Vec<&Array> = blocks[first..]
                        .iter()
                        .map(|b| part(b[l].as_ref().expect("checked by layer_firsts")))
                        .collect();
                    if parts.is_empty() {
                        return Ok(fresh);
                    }
                    fresh.slice_update(
                        &Array::concatenate(&parts, 2)?,
                        &[0, 0, 0, 0],
                        &[1, kvh, rows, hd],
                    )
                };
                let (k, v) = (fill(|c| &c.k, kw)?, fill(|c| &c.v, vw)?);
                Array::eval(&[&k, &v])?;
                layers.push(Some(LayerCache {
                    k,
                    v,
                    start,
                    capacity,
                }));
            }
            Ok(layers)
        })();
        match seeded {
            Ok(layers) => {
                self.sequences.insert(
                    seq,
                    SequenceCache {
                        position: held,
                        layers,
                        tokens: tokens[..held].to_vec(),
                    },
                );
                held
            }
            // Out of memory or the like: the sequence runs its whole prompt.
            Err(e) => {
                tracing::warn!(error = %e, "cannot start a sequence from the prefix cache");
                0
            }
        }
    }

    fn retain_prefix(&mut self, seq: SequenceId) {
        let Some(cache) = self.sequences.get(&seq) else {
            return;
        };
        if cache.tokens.len() != cache.position {
            return;
        }
        let (kvh, kw, vw) = self.cache_widths();
        let _guard = lock();
        let stored = self.prefix.insert(
            &cache.tokens,
            |range| {
                let n = range.len();
                let mut layers = Vec::with_capacity(cache.layers.len());
                let mut bytes = 0;
                for c in &cache.layers {
                    // A sliding layer's forgotten rows are missing from the block.
                    let Some(c) = c.as_ref().filter(|c| c.start <= range.start) else {
                        layers.push(None);
                        continue;
                    };
                    // A copy of the block, so the sequence's whole cache is not kept.
                    let (from, to) = (range.start - c.start, range.end - c.start);
                    let copy = |a: &Array, hd: usize| -> Result<Array> {
                        let part = a.slice(&[0, 0, from, 0], &[1, kvh, to, hd])?;
                        Array::zeros(&[1, kvh, n, hd], Dtype::F32)?.slice_update(
                            &part,
                            &[0, 0, 0, 0],
                            &[1, kvh, n, hd],
                        )
                    };
                    let (k, v) = (copy(&c.k, kw)?, copy(&c.v, vw)?);
                    Array::eval(&[&k, &v])?;
                    bytes += k.nbytes() + v.nbytes();
                    layers.push(Some(LayerCache {
                        k,
                        v,
                        start: range.start,
                        capacity: n,
                    }));
                }
                Ok::<_, Error>((layers, bytes))
            },
            |block, range| {
                block.iter().any(Option::is_none)
                    && cache
                        .layers
                        .iter()
                        .flatten()
                        .all(|c| c.start <= range.start)
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
            .flat_map(|s| s.layers.iter().flatten())
            .map(|c| c.k.nbytes() + c.v.nbytes())
            .sum()
    }
}
