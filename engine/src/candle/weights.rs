//! Loading a stage's weights into candle tensors, from GGUF or from a
//! safetensors directory (see `safetensors.rs`); both are asked for weights
//! by their GGUF names.

use std::fs::File;
use std::io::BufReader;
use std::ops::Range;

use candle_core::quantized::{GgmlDType, QMatMul, QStorage, QTensor};
use candle_core::{DType, Device, Tensor};
use shardplane_formats::GgmlType;

use super::latent::LatentWeights;
use super::moe::{Experts, FeedForward, Shared};
use super::safetensors::SafetensorsDir;
use crate::config::{ModelConfig, Routing};
use crate::error::{Error, Result};
use crate::gguf::GgufFile;
use crate::names::{self, Layout, Weight};
use crate::tensor::RankShare;

/// The part of a matrix a tensor rank holds.
#[derive(Debug, Clone)]
pub(super) enum Part {
    /// Output rows (the matrix's first dimension).
    Rows(Range<usize>),
    /// Input columns (its second).
    Columns(Range<usize>),
}

/// Where a stage's weights come from.
pub(super) enum Source<'a> {
    /// A GGUF file: tensors kept in their quantized types.
    Gguf {
        file: &'a GgufFile,
        reader: BufReader<File>,
    },
    /// A safetensors directory: read as f32, matrices then quantized to
    /// Q8_0 (candle's fast type, and no more memory than the file's bf16 or
    /// 8-bit weights) unless the loader dequantizes.
    Safetensors(SafetensorsDir),
}

/// Reads tensors of one model, re-quantizing slow types when asked.
pub(super) struct TensorLoader<'a> {
    pub source: Source<'a>,
    pub device: Device,
    pub requantize: bool,
    /// Expand matrices to f32.
    pub dequantize: bool,
    /// Bytes of every tensor loaded so far, as held in memory.
    pub bytes: usize,
}

impl TensorLoader<'_> {
    /// Whether the model has a tensor GGUF would call `name`.
    pub fn has(&self, name: &str) -> bool {
        match &self.source {
            Source::Gguf { file, .. } => file.has_tensor(name),
            Source::Safetensors(dir) => dir.has(name),
        }
    }

    fn qtensor(&mut self, name: &str) -> Result<QTensor> {
        let t = match &mut self.source {
            Source::Safetensors(dir) => {
                safetensors_matrix(dir, name, &self.device, self.dequantize)?
            }
            Source::Gguf { file, reader } => {
                if file.tensor_type(name) == Some(GgmlType::MXFP4) && !self.dequantize {
                    // Q8_0 keeps them close in a fast type (twice MXFP4's bytes).
                    let t = file.read_tensor_q8_0(reader, name, &self.device)?;
                    self.bytes += t.storage_size_in_bytes();
                    return Ok(t);
                }
                let t = file.read_tensor(reader, name, &self.device)?;
                match t.dtype() {
                    GgmlDType::Q4_1 | GgmlDType::Q5_0 | GgmlDType::Q5_1 if self.requantize => {
                        // candle has no SIMD dot product for these types; Q8_0 has one.
                        QTensor::quantize(&t.dequantize(&self.device)?, GgmlDType::Q8_0)?
                    }
                    GgmlDType::Q8_1 => {
                        return Err(Error::UnsupportedTensorType {
                            tensor: name.to_string(),
                            dtype: format!("{:?}", t.dtype()),
                        });
                    }
                    _ => t,
                }
            }
        };
        self.bytes += t.storage_size_in_bytes();
        Ok(t)
    }

    /// A weight matrix for matmuls.
    pub fn matrix(&mut self, name: &str) -> Result<QMatMul> {
        let dense = match &mut self.source {
            Source::Gguf { file, reader } if self.dequantize => Some(
                file.read_tensor(reader, name, &self.device)?
                    .dequantize(&self.device)?,
            ),
            _ => None,
        };
        if let Some(t) = dense {
            self.bytes += t.elem_count() * 4;
            return Ok(QMatMul::Tensor(t));
        }
        // An f32 QTensor (safetensors dequantized) becomes a plain f32 product.
        let t = self.qtensor(name)?;
        self.product(t)
    }

    /// A product of `t` (already counted as stored), counted as candle
    /// holds it: F32, F16 and BF16 become f32 tensors.
    fn product(&mut self, t: QTensor) -> Result<QMatMul> {
        let stored = t.storage_size_in_bytes();
        let product = QMatMul::from_qtensor(t)?;
        if let QMatMul::Tensor(d) | QMatMul::TensorF16(d) = &product {
            self.bytes = self.bytes + d.elem_count() * d.dtype().size_in_bytes() - stored;
        }
        Ok(product)
    }

    /// Part of a weight matrix (all of it without a part): a tensor rank's
    /// rows or columns, kept in the file's quantized blocks when the part
    /// starts and ends on block boundaries, else expanded to f32.
    pub fn matrix_part(&mut self, name: &str, part: Option<Part>) -> Result<QMatMul> {
        let Some(part) = part else {
            return self.matrix(name);
        };
        let whole = match self.matrix(name)? {
            QMatMul::QTensor(t) => t,
            QMatMul::Tensor(t) | QMatMul::TensorF16(t) => {
                // As `product` counted it.
                self.bytes -= t.elem_count() * t.dtype().size_in_bytes();
                let t = t.to_dtype(DType::F32)?;
                let (rows, cols) = t.dims2()?;
                let (rows, cols) = part.ranges(rows, cols, name)?;
                let t = t
                    .narrow(0, rows.start, rows.len())?
                    .narrow(1, cols.start, cols.len())?
                    .contiguous()?;
                self.bytes += t.elem_count() * 4;
                return Ok(QMatMul::Tensor(t));
            }
        };
        self.bytes -= whole.storage_size_in_bytes();
        let (rows, cols) = whole.shape().dims2()?;
        let (rows, cols) = part.ranges(rows, cols, name)?;
        let t = slice_quantized(&whole, rows, cols, &self.device)?;
        self.bytes += t.storage_size_in_bytes();
        self.product(t)
    }

    /// Part of a vector (a bias): `range`, or all of it.
    pub fn vector_part(&mut self, name: &str, range: Option<Range<usize>>) -> Result<Tensor> {
        let v = self.vector(name)?;
        let Some(range) = range else {
            return Ok(v);
        };
        if range.end > v.elem_count() {
            return Err(Error::Tensor(format!(
                "{name} has {} values, the share needs {range:?}",
                v.elem_count()
            )));
        }
        self.bytes -= (v.elem_count() - range.len()) * 4;
        Ok(v.narrow(0, range.start, range.len())?.contiguous()?)
    }

    /// Stacked `[experts, out, in]` matrices `{prefix}.weight`, one product
    /// per expert (each cut to a tensor rank's `part` when given), with
    /// their `[experts, out]` biases `{prefix}.bias` when `bias` (cut to
    /// the part's rows).
    pub fn experts(
        &mut self,
        prefix: &str,
        experts: usize,
        bias: bool,
        part: Option<Part>,
    ) -> Result<Vec<Linear>> {
        let matrices = self.expert_matrices(&format!("{prefix}.weight"), experts, part.clone())?;
        if !bias {
            return Ok(matrices.into_iter().map(Linear::from).collect());
        }
        let name = format!("{prefix}.bias");
        let mut biases = self.vector(&name)?;
        if let (Some(Part::Rows(rows)), &[_, out]) = (&part, biases.dims()) {
            if rows.end > out || rows.is_empty() {
                return Err(Error::Tensor(format!(
                    "{name} has {out} values per expert, the share needs {rows:?}"
                )));
            }
            self.bytes -= (out - rows.len()) * experts * 4;
            biases = biases.narrow(1, rows.start, rows.len())?.contiguous()?;
        }
        let out = match biases.dims() {
            &[count, out] if count == experts => out,
            dims => {
                return Err(Error::UnsupportedTensorType {
                    tensor: name,
                    dtype: format!("shape {dims:?}, expected [{experts}, out]"),
                });
            }
        };
        matrices
            .into_iter()
            .enumerate()
            .map(|(e, weight)| {
                let bias = biases.get(e)?.reshape(out)?;
                Ok(Linear {
                    weight,
                    bias: Some(bias),
                })
            })
            .collect()
    }

    /// Stacked `[experts, out, in]` matrices, one product per expert (its
    /// `part`, when given).
    fn expert_matrices(
        &mut self,
        name: &str,
        experts: usize,
        part: Option<Part>,
    ) -> Result<Vec<QMatMul>> {
        let dequantize = self.dequantize && matches!(self.source, Source::Gguf { .. });
        let t = self.qtensor(name)?;
        let dims = t.shape().dims().to_vec();
        let bad = |detail: String| Error::UnsupportedTensorType {
            tensor: name.to_string(),
            dtype: detail,
        };
        let [count, out, inp] = dims[..] else {
            return Err(bad(format!("shape {dims:?}, expected [experts, out, in]")));
        };
        if count != experts {
            return Err(bad(format!(
                "{count} experts stacked, the configuration says {experts}"
            )));
        }
        // Quantized blocks run along rows, so each expert is one slab of bytes.
        let data = t.data()?;
        let slab = data.len() / experts.max(1);
        let dtype = t.dtype();
        let mut matrices = Vec::with_capacity(experts);
        let cut = part.map(|p| p.ranges(out, inp, name)).transpose()?;
        for e in 0..experts {
            let bytes = std::borrow::Cow::Borrowed(&data[e * slab..(e + 1) * slab]);
            let storage = QStorage::from_data(bytes, &self.device, dtype)?;
            let mut q = QTensor::new(storage, (out, inp))?;
            if let Some((rows, cols)) = &cut {
                q = slice_quantized(&q, rows.clone(), cols.clone(), &self.device)?;
            }
            matrices.push(if dequantize {
                let dense = q.dequantize(&self.device)?;
                self.bytes += dense.elem_count() * 4;
                QMatMul::Tensor(dense)
            } else {
                self.bytes += q.storage_size_in_bytes();
                self.product(q)?
            });
        }
        // Counted per expert above instead.
        self.bytes -= t.storage_size_in_bytes();
        Ok(matrices)
    }

    /// A weight kept quantized for row lookups (the token embedding).
    pub fn quantized(&mut self, name: &str) -> Result<QTensor> {
        self.qtensor(name)
    }

    /// A small vector (norm weights, biases) as f32.
    pub fn vector(&mut self, name: &str) -> Result<Tensor> {
        let t = match &mut self.source {
            Source::Gguf { file, reader } => file
                .read_tensor(reader, name, &self.device)?
                .dequantize(&self.device)?
                .to_dtype(DType::F32)?,
            Source::Safetensors(dir) => dir.read(name, &self.device)?,
        };
        self.bytes += t.elem_count() * 4;
        Ok(t)
    }
}

/// A safetensors matrix: Q8_0, or f32 when the loader dequantizes (or its
/// rows do not fill Q8_0 blocks).
fn safetensors_matrix(
    dir: &SafetensorsDir,
    name: &str,
    device: &Device,
    dequantize: bool,
) -> Result<QTensor> {
    let values = dir.read(name, device)?;
    let cols = values.dims().last().copied().unwrap_or(0);
    let dtype = if !dequantize && cols.is_multiple_of(32) {
        GgmlDType::Q8_0
    } else {
        GgmlDType::F32
    };
    Ok(QTensor::quantize(&values, dtype)?)
}

impl Part {
    /// The rows and columns of a `rows × cols` matrix this part keeps.
    fn ranges(&self, rows: usize, cols: usize, name: &str) -> Result<(Range<usize>, Range<usize>)> {
        let (r, c) = match self {
            Part::Rows(r) => (r.clone(), 0..cols),
            Part::Columns(c) => (0..rows, c.clone()),
        };
        if r.end > rows || c.end > cols || r.is_empty() || c.is_empty() {
            return Err(Error::Tensor(format!(
                "{name} is {rows}×{cols}; the share needs rows {r:?} and columns {c:?}"
            )));
        }
        Ok((r, c))
    }
}

/// Rows `rows` and columns `cols` of a quantized matrix: the same blocks
/// when the columns start and end on block boundaries (so products sum the
/// same block products as the whole matrix's), else the exact values in f32.
fn slice_quantized(
    t: &QTensor,
    rows: Range<usize>,
    cols: Range<usize>,
    device: &Device,
) -> Result<QTensor> {
    let (_, width) = t.shape().dims2()?;
    let dtype = t.dtype();
    let block = dtype.block_size();
    if !cols.start.is_multiple_of(block) || !cols.end.is_multiple_of(block) {
        let dense = t
            .dequantize(device)?
            .narrow(0, rows.start, rows.len())?
            .narrow(1, cols.start, cols.len())?
            .contiguous()?;
        return Ok(QTensor::quantize(&dense, GgmlDType::F32)?);
    }
    let data = t.data()?;
    let row_bytes = width / block * dtype.type_size();
    let (from, to) = (
        cols.start / block * dtype.type_size(),
        cols.end / block * dtype.type_size(),
    );
    let mut bytes = Vec::with_capacity(rows.len() * (to - from));
    for r in rows.clone() {
        bytes.extend_from_slice(&data[r * row_bytes + from..r * row_bytes + to]);
    }
    let storage = QStorage::from_data(std::borrow::Cow::Owned(bytes), device, dtype)?;
    Ok(QTensor::new(storage, (rows.len(), cols.len()))?)
}

/// A linear layer: quantized weight and optional bias.
pub(super) struct Linear {
    weight: QMatMul,
    bias: Option<Tensor>,
}

impl From<QMatMul> for Linear {
    fn from(weight: QMatMul) -> Self {
        Linear { weight, bias: None }
    }
}

impl Linear {
    pub fn forward(&self, x: &Tensor) -> Result<Tensor> {
        self.biased(super::dense::quantized(&self.weight, x)?)
    }

    /// The product each row of which is the same whatever rows run beside
    /// it, for a float weight too (see `dense.rs`): for the small matrices
    /// that steer a row, such as a router, where candle's float product
    /// would round with the batch. A quantized weight is row-invariant
    /// either way (`forward`); a large float one (a float model's layers)
    /// keeps candle's faster blocked product there.
    pub fn forward_row_invariant(&self, x: &Tensor) -> Result<Tensor> {
        self.biased(super::dense::forward(&self.weight, x)?)
    }

    fn biased(&self, y: Tensor) -> Result<Tensor> {
        Ok(match &self.bias {
            Some(b) => y.broadcast_add(b)?,
            None => y,
        })
    }
}

/// How a layer makes its queries, keys and values.
pub(super) enum Projections {
    /// Query, key and value heads, with per-head query and key norms in
    /// some families.
    Heads {
        q: Linear,
        k: Linear,
        v: Linear,
        q_norm: Option<Tensor>,
        k_norm: Option<Tensor>,
    },
    /// Multi-head latent attention (DeepSeek V3).
    Latent(Box<LatentWeights>),
}

/// The weights of one transformer layer.
pub(super) struct LayerWeights {
    pub attn_norm: Tensor,
    pub projections: Projections,
    pub o: Linear,
    pub ffn_norm: Tensor,
    /// Norms of the attention and feed-forward outputs (Gemma).
    pub post_attn_norm: Option<Tensor>,
    pub post_ffn_norm: Option<Tensor>,
    /// Each query head's sink logit (gpt-oss), on the host: the decode loop
    /// reads it every step.
    pub sinks: Option<Vec<f32>>,
    /// The feed-forward block: dense, or routed to experts.
    pub ffn: FeedForward,
}

impl LayerWeights {
    /// Loads layer `i`, or a tensor rank's `share` of it.
    pub fn load(
        l: &mut TensorLoader<'_>,
        i: usize,
        config: &ModelConfig,
        share: Option<&RankShare>,
    ) -> Result<Self> {
        let arch = config.architecture;
        let name = |s: &str| format!("blk.{i}.{s}");
        let hd = config.head_dim;
        let rows = |heads: fn(&RankShare) -> &Range<usize>| {
            share.map(|s| heads(s).start * hd..heads(s).end * hd)
        };
        let (q_rows, kv_rows) = (rows(|s| &s.heads), rows(|s| &s.kv_heads));
        // Qwen2 always has Q/K/V biases; elsewhere a bias is used when the file has one.
        let linear = |l: &mut TensorLoader<'_>,
                      w: &str,
                      b: &str,
                      required: bool,
                      rows: Option<Range<usize>>|
         -> Result<Linear> {
            let bias_name = name(b);
            let bias = if required || l.has(&bias_name) {
                Some(l.vector_part(&bias_name, rows.clone())?)
            } else {
                None
            };
            Ok(Linear {
                weight: l.matrix_part(&name(w), rows.map(Part::Rows))?,
                bias,
            })
        };
        let projections = if config.latent.is_some() {
            Projections::Latent(Box::new(LatentWeights::load(l, i, config, share)?))
        } else {
            let qkv_bias = arch.qkv_bias();
            let (q_norm, k_norm) = if arch.qk_norm() {
                (
                    Some(l.vector(&name("attn_q_norm.weight"))?),
                    Some(l.vector(&name("attn_k_norm.weight"))?),
                )
            } else {
                (None, None)
            };
            Projections::Heads {
                q: linear(l, "attn_q.weight", "attn_q.bias", qkv_bias, q_rows.clone())?,
                k: linear(l, "attn_k.weight", "attn_k.bias", qkv_bias, kv_rows.clone())?,
                v: linear(l, "attn_v.weight", "attn_v.bias", qkv_bias, kv_rows)?,
                q_norm,
                k_norm,
            }
        };
        // Latent attention's output takes heads × value dims.
        let o_columns = match config.latent {
            Some(latent) => {
                share.map(|s| s.heads.start * latent.value_dim..s.heads.end * latent.value_dim)
            }
            None => q_rows,
        };
        let o = Linear {
            weight: l.matrix_part(&name("attn_output.weight"), o_columns.map(Part::Columns))?,
            // Added once to the sum: by rank 0.
            bias: match l.has(&name("attn_output.bias")) && share.is_none_or(|s| s.is_leader()) {
                true => Some(l.vector(&name("attn_output.bias"))?),
                false => None,
            },
        };
        let columns = share.map(|s| s.intermediate.clone());
        let expert_columns = share.map(|s| s.expert_intermediate.clone());
        let shared_columns = share.map(|s| s.shared_intermediate.clone());
        let leader = share.is_none_or(|s| s.is_leader());
        let (post_attn_norm, post_ffn_norm) = if arch.post_norms() {
            (
                Some(l.vector(&name("post_attention_norm.weight"))?),
                Some(l.vector(&name("post_ffw_norm.weight"))?),
            )
        } else {
            (None, None)
        };
        let sinks = if arch.attention_sinks() {
            let sinks =
                l.vector_part(&name("attn_sinks.weight"), share.map(|s| s.heads.clone()))?;
            Some(sinks.to_vec1::<f32>()?)
        } else {
            None
        };
        Ok(LayerWeights {
            attn_norm: l.vector(&name("attn_norm.weight"))?,
            projections,
            o,
            ffn_norm: l.vector(&Weight::Layer(i, names::Part::FfnNorm).tensor(
                Layout::Gguf,
                arch,
                "weight",
            ))?,
            post_attn_norm,
            post_ffn_norm,
            sinks,
            ffn: match &config.moe {
                Some(moe) if moe.routed(i) => FeedForward::Experts(Box::new(Experts {
                    router: linear(
                        l,
                        "ffn_gate_inp.weight",
                        "ffn_gate_inp.bias",
                        moe.bias,
                        None,
                    )?,
                    gate: l.experts(
                        &name("ffn_gate_exps"),
                        moe.experts,
                        moe.bias,
                        expert_columns.clone().map(Part::Rows),
                    )?,
                    up: l.experts(
                        &name("ffn_up_exps"),
                        moe.experts,
                        moe.bias,
                        expert_columns.clone().map(Part::Rows),
                    )?,
                    // Each rank's sums add up: the bias goes in once.
                    down: l.experts(
                        &name("ffn_down_exps"),
                        moe.experts,
                        moe.bias && leader,
                        expert_columns.clone().map(Part::Columns),
                    )?,
                    per_token: moe.experts_per_token,
                    normalize: moe.normalize,
                    routing: moe.routing,
                    choice_bias: match moe.routing {
                        Routing::SigmoidGroups { .. } => {
                            let bias = l
                                .vector(&name("exp_probs_b.bias"))?
                                .flatten_all()?
                                .to_vec1::<f32>()?;
                            if bias.len() != moe.experts {
                                return Err(Error::Tensor(format!(
                                    "layer {i}'s expert choice bias has {} values for {} experts",
                                    bias.len(),
                                    moe.experts
                                )));
                            }
                            Some(bias)
                        }
                        Routing::Softmax | Routing::SoftmaxGroups { .. } => None,
                    },
                    shared: match moe.shared_expert {
                        Some(_) => Some(Shared {
                            // `[hidden]` in GGUF, `[1, hidden]` from Hugging Face.
                            gate_inp: match moe.shared_gate {
                                true => Some(
                                    l.vector(&name("ffn_gate_inp_shexp.weight"))?
                                        .flatten_all()?,
                                ),
                                false => None,
                            },
                            gate: l
                                .matrix_part(
                                    &name("ffn_gate_shexp.weight"),
                                    shared_columns.clone().map(Part::Rows),
                                )?
                                .into(),
                            up: l
                                .matrix_part(
                                    &name("ffn_up_shexp.weight"),
                                    shared_columns.clone().map(Part::Rows),
                                )?
                                .into(),
                            down: l
                                .matrix_part(
                                    &name("ffn_down_shexp.weight"),
                                    shared_columns.clone().map(Part::Columns),
                                )?
                                .into(),
                        }),
                        None => None,
                    },
                })),
                _ => FeedForward::Dense {
                    gate: l
                        .matrix_part(&name("ffn_gate.weight"), columns.clone().map(Part::Rows))?
                        .into(),
                    up: l
                        .matrix_part(&name("ffn_up.weight"), columns.clone().map(Part::Rows))?
                        .into(),
                    down: l
                        .matrix_part(&name("ffn_down.weight"), columns.map(Part::Columns))?
                        .into(),
                },
            },
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::Module;

    fn max_gap(a: &Tensor, b: &Tensor) -> f32 {
        (a - b)
            .unwrap()
            .abs()
            .unwrap()
            .max_all()
            .unwrap()
            .to_scalar::<f32>()
            .unwrap()
    }

    /// A matrix split by columns on block boundaries: the parts' products
    /// add up to the whole's (the same block products, summed in another
    /// order); off the boundaries, the parts are the exact values.
    #[test]
    fn column_parts_of_a_quantized_matrix_sum_to_its_product() {
        let dev = Device::Cpu;
        let w = Tensor::randn(0f32, 1.0, (64, 768), &dev).unwrap();
        let x = Tensor::randn(0f32, 1.0, (3, 768), &dev).unwrap();
        let part = |q: &QTensor, cols: Range<usize>| {
            let x = x
                .narrow(1, cols.start, cols.len())
                .unwrap()
                .contiguous()
                .unwrap();
            let t = slice_quantized(q, 0..64, cols, &dev).unwrap();
            (QMatMul::from_qtensor(t).unwrap().forward(&x).unwrap(), x)
        };
        for dtype in [GgmlDType::Q8_0, GgmlDType::Q4_1, GgmlDType::Q4K] {
            let q = QTensor::quantize(&w, dtype).unwrap();
            let whole = QMatMul::from_qtensor(QTensor::quantize(&w, dtype).unwrap())
                .unwrap()
                .forward(&x)
                .unwrap();
            let (a, _) = part(&q, 0..512);
            let (b, _) = part(&q, 512..768);
            let gap = max_gap(&(a + b).unwrap(), &whole);
            assert!(
                gap < 1e-4,
                "{dtype:?}: parts differ from the whole by {gap}"
            );
        }
        // 384 is no multiple of Q4K's 256: that part holds the exact values.
        let q = QTensor::quantize(&w, GgmlDType::Q4K).unwrap();
        let (a, xa) = part(&q, 0..384);
        let exact = q.dequantize(&dev).unwrap().narrow(1, 0, 384).unwrap();
        let gap = max_gap(&a, &xa.matmul(&exact.t().unwrap()).unwrap());
        assert!(
            gap < 1e-4,
            "an f32 part differs from the exact product by {gap}"
        );
    }
}
