//! Loading a stage's weights from GGUF into candle tensors.

use std::fs::File;
use std::io::BufReader;

use candle_core::quantized::{GgmlDType, QMatMul, QTensor};
use candle_core::{DType, Device, Module, Tensor};

use crate::config::Architecture;
use crate::error::{Error, Result};
use crate::gguf::GgufFile;

/// Reads tensors of one file, re-quantizing slow types when asked.
pub(super) struct TensorLoader<'a> {
    pub file: &'a GgufFile,
    pub reader: BufReader<File>,
    pub device: Device,
    pub requantize: bool,
    /// Expand matrices to f32.
    pub dequantize: bool,
    /// Bytes of every tensor loaded so far, as held in memory.
    pub bytes: usize,
}

impl TensorLoader<'_> {
    fn qtensor(&mut self, name: &str) -> Result<QTensor> {
        let t = self
            .file
            .read_tensor(&mut self.reader, name, &self.device)?;
        let t = match t.dtype() {
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
        };
        self.bytes += t.storage_size_in_bytes();
        Ok(t)
    }

    /// A weight matrix for matmuls.
    pub fn matrix(&mut self, name: &str) -> Result<QMatMul> {
        if self.dequantize {
            let t = self
                .file
                .read_tensor(&mut self.reader, name, &self.device)?
                .dequantize(&self.device)?;
            self.bytes += t.elem_count() * 4;
            return Ok(QMatMul::Tensor(t));
        }
        Ok(QMatMul::from_qtensor(self.qtensor(name)?)?)
    }

    /// A weight kept quantized for row lookups (the token embedding).
    pub fn quantized(&mut self, name: &str) -> Result<QTensor> {
        self.qtensor(name)
    }

    /// A small vector (norm weights, biases) as f32.
    pub fn vector(&mut self, name: &str) -> Result<Tensor> {
        let t = self
            .file
            .read_tensor(&mut self.reader, name, &self.device)?;
        let t = t.dequantize(&self.device)?.to_dtype(DType::F32)?;
        self.bytes += t.elem_count() * 4;
        Ok(t)
    }
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
    pub gate: QMatMul,
    pub up: QMatMul,
    pub down: QMatMul,
}

impl LayerWeights {
    pub fn load(l: &mut TensorLoader<'_>, i: usize, arch: Architecture) -> Result<Self> {
        let name = |s: &str| format!("blk.{i}.{s}");
        // Qwen2 always has Q/K/V biases; elsewhere a bias is used when the file has one.
        let linear =
            |l: &mut TensorLoader<'_>, w: &str, b: &str, required: bool| -> Result<Linear> {
                let bias_name = name(b);
                let bias = if required || l.file.has_tensor(&bias_name) {
                    Some(l.vector(&bias_name)?)
                } else {
                    None
                };
                Ok(Linear {
                    weight: l.matrix(&name(w))?,
                    bias,
                })
            };
        let qkv_bias = arch == Architecture::Qwen2;
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
            gate: l.matrix(&name("ffn_gate.weight"))?,
            up: l.matrix(&name("ffn_up.weight"))?,
            down: l.matrix(&name("ffn_down.weight"))?,
        })
    }
}
