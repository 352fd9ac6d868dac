//! Loading a stage's weights into candle tensors, from GGUF or from a
//! safetensors directory (see `safetensors.rs`); both are asked for weights
//! by their GGUF names.

use std::fs::File;
use std::io::BufReader;

use candle_core::quantized::{GgmlDType, QMatMul, QStorage, QTensor};
use candle_core::{DType, Device, Module, Tensor};

use super::moe::{Experts, FeedForward, Shared};
use super::safetensors::SafetensorsDir;
use crate::config::{Architecture, ModelConfig};
use crate::error::{Error, Result};
use crate::gguf::GgufFile;

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
        Ok(QMatMul::from_qtensor(self.qtensor(name)?)?)
    }

    /// Stacked `[experts, out, in]` matrices, one product per expert.
    pub fn experts(&mut self, name: &str, experts: usize) -> Result<Vec<QMatMul>> {
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
        for e in 0..experts {
            let bytes = std::borrow::Cow::Borrowed(&data[e * slab..(e + 1) * slab]);
            let storage = QStorage::from_data(bytes, &self.device, dtype)?;
            let q = QTensor::new(storage, (out, inp))?;
            matrices.push(if dequantize {
                let dense = q.dequantize(&self.device)?;
                self.bytes += dense.elem_count() * 4;
                QMatMul::Tensor(dense)
            } else {
                QMatMul::from_qtensor(q)?
            });
        }
        if dequantize {
            // Counted as f32 above instead.
            self.bytes -= t.storage_size_in_bytes();
        }
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

/// A linear layer: quantized weight and optional bias.
pub(super) struct Linear {
    weight: QMatMul,
    bias: Option<Tensor>,
}

impl Linear {
    pub fn forward(&self, x: &Tensor) -> Result<Tensor> {
        let y = self.weight.forward(x)?;
        Ok(match &self.bias {
            Some(b) => y.broadcast_add(b)?,
            None => y,
        })
    }
}

/// The weights of one transformer layer.
pub(super) struct LayerWeights {
    pub attn_norm: Tensor,
    pub q: Linear,
    pub k: Linear,
    pub v: Linear,
    pub o: Linear,
    pub q_norm: Option<Tensor>,
    pub k_norm: Option<Tensor>,
    pub ffn_norm: Tensor,
    /// Norms of the attention and feed-forward outputs (Gemma).
    pub post_attn_norm: Option<Tensor>,
    pub post_ffn_norm: Option<Tensor>,
    /// The feed-forward block: dense, or routed to experts.
    pub ffn: FeedForward,
}

impl LayerWeights {
    pub fn load(l: &mut TensorLoader<'_>, i: usize, config: &ModelConfig) -> Result<Self> {
        let arch = config.architecture;
        let name = |s: &str| format!("blk.{i}.{s}");
        // Qwen2 always has Q/K/V biases; elsewhere a bias is used when the file has one.
        let linear =
            |l: &mut TensorLoader<'_>, w: &str, b: &str, required: bool| -> Result<Linear> {
                let bias_name = name(b);
                let bias = if required || l.has(&bias_name) {
                    Some(l.vector(&bias_name)?)
                } else {
                    None
                };
                Ok(Linear {
                    weight: l.matrix(&name(w))?,
                    bias,
                })
            };
        let qkv_bias = matches!(arch, Architecture::Qwen2 | Architecture::Qwen2Moe);
        let q = linear(l, "attn_q.weight", "attn_q.bias", qkv_bias)?;
        let k = linear(l, "attn_k.weight", "attn_k.bias", qkv_bias)?;
        let v = linear(l, "attn_v.weight", "attn_v.bias", qkv_bias)?;
        let o = linear(l, "attn_output.weight", "attn_output.bias", false)?;
        let (q_norm, k_norm) = if arch.qk_norm() {
            (
                Some(l.vector(&name("attn_q_norm.weight"))?),
                Some(l.vector(&name("attn_k_norm.weight"))?),
            )
        } else {
            (None, None)
        };
        let (post_attn_norm, post_ffn_norm) = if arch.post_norms() {
            (
                Some(l.vector(&name("post_attention_norm.weight"))?),
                Some(l.vector(&name("post_ffw_norm.weight"))?),
            )
        } else {
            (None, None)
        };
        Ok(LayerWeights {
            attn_norm: l.vector(&name("attn_norm.weight"))?,
            q,
            k,
            v,
            o,
            q_norm,
            k_norm,
            ffn_norm: l.vector(&name("ffn_norm.weight"))?,
            post_attn_norm,
            post_ffn_norm,
            ffn: match &config.moe {
                Some(moe) if moe.routed(i) => FeedForward::Experts(Box::new(Experts {
                    router: l.matrix(&name("ffn_gate_inp.weight"))?,
                    gate: l.experts(&name("ffn_gate_exps.weight"), moe.experts)?,
                    up: l.experts(&name("ffn_up_exps.weight"), moe.experts)?,
                    down: l.experts(&name("ffn_down_exps.weight"), moe.experts)?,
                    per_token: moe.experts_per_token,
                    normalize: moe.normalize,
                    shared: match moe.shared_expert {
                        Some(_) => Some(Shared {
                            // `[hidden]` in GGUF, `[1, hidden]` from Hugging Face.
                            gate_inp: l
                                .vector(&name("ffn_gate_inp_shexp.weight"))?
                                .flatten_all()?,
                            gate: l.matrix(&name("ffn_gate_shexp.weight"))?,
                            up: l.matrix(&name("ffn_up_shexp.weight"))?,
                            down: l.matrix(&name("ffn_down_shexp.weight"))?,
                        }),
                        None => None,
                    },
                })),
                _ => FeedForward::Dense {
                    gate: l.matrix(&name("ffn_gate.weight"))?,
                    up: l.matrix(&name("ffn_up.weight"))?,
                    down: l.matrix(&name("ffn_down.weight"))?,
                },
            },
        })
    }
}
