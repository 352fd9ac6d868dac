//! Loading a stage's weights into MLX arrays by role, from GGUF (read by
//! `gguf_read`) or from an MLX-community safetensors directory: quantized
//! matrices stay quantized unless asked otherwise.

use std::collections::BTreeSet;
use std::path::PathBuf;

use super::array::{
    Array, Dtype, Quant, QuantMode, SPREAD_GROUP, TensorMap, dequantize, quantized_matmul,
};
use super::latent::LatentWeights;
use super::moe::{Experts, FeedForward, SharedExpert, Stacked};
use crate::config::{Architecture, ModelConfig, Routing};
use crate::error::{Error, Result};
use crate::names::{Layout, Part, Weight};

/// A weight matrix: MLX-quantized or dense.
pub(super) struct Linear {
    pub(super) w: Array,
    pub(super) quant: Option<Quant>,
    /// A bias added after the product (Qwen2's Q/K/V).
    pub(super) bias: Option<Array>,
}

impl Linear {
    pub(super) fn forward(&self, x: &Array) -> Result<Array> {
        let y = match &self.quant {
            Some(q) => quantized_matmul(x, &self.w, q)?,
            // Dense weights are kept transposed, `[in, out]`.
            None => x.matmul(&self.w)?,
        };
        match &self.bias {
            Some(b) => y.add(b),
            None => Ok(y),
        }
    }

    /// Rows `ids` of the matrix as f32 (an embedding lookup).
    pub(super) fn rows(&self, ids: &Array) -> Result<Array> {
        match &self.quant {
            Some(q) => {
                let rows = Quant {
                    scales: q.scales.take(ids, 0)?,
                    biases: q.biases.as_ref().map(|b| b.take(ids, 0)).transpose()?,
                    ..*q
                };
                dequantize(&self.w.take(ids, 0)?, &rows)?.astype(Dtype::F32)
            }
            None => self.w.transpose(&[1, 0])?.take(ids, 0),
        }
    }

    pub(super) fn bytes(&self) -> usize {
        self.w.nbytes()
            + self.bias.as_ref().map_or(0, Array::nbytes)
            + self.quant.as_ref().map_or(0, Quant::bytes)
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
        q_norm: Option<Array>,
        k_norm: Option<Array>,
    },
    /// Multi-head latent attention (DeepSeek V3).
    Latent(Box<LatentWeights>),
}

/// One transformer layer's weights.
pub(super) struct LayerWeights {
    pub(super) attn_norm: Array,
    pub(super) projections: Projections,
    pub(super) o: Linear,
    pub(super) ffn_norm: Array,
    /// Norms of the attention and feed-forward outputs (Gemma).
    pub(super) post_attn_norm: Option<Array>,
    pub(super) post_ffn_norm: Option<Array>,
    /// Each query head's sink logit (gpt-oss).
    pub(super) sinks: Option<Array>,
    /// The feed-forward block: dense, or routed to experts.
    pub(super) ffn: FeedForward,
}

/// Reads weights by role from one or more tensor maps.
pub(super) struct Loader {
    pub(super) maps: Vec<TensorMap>,
    pub(super) layout: Layout,
    /// The family, for names and norm conventions.
    pub(super) architecture: Architecture,
    pub(super) origin: PathBuf,
    pub(super) bytes: usize,
    /// Expand quantized matrices to f32 (dense products through BLAS).
    pub(super) dequantize: bool,
    /// Weights held spread (see `Quant::spread`), by tensor name.
    pub(super) spread: BTreeSet<String>,
}

impl Loader {
    pub(super) fn find(&self, name: &str) -> Option<&TensorMap> {
        self.maps.iter().find(|m| m.contains(name))
    }

    pub(super) fn missing(&self, name: &str) -> Error {
        Error::MissingMetadata {
            what: format!("tensor {name} in {}", self.origin.display()),
            detail: "the tensor is absent".into(),
        }
    }

    pub(super) fn get(&self, name: &str) -> Result<Array> {
        self.find(name).ok_or_else(|| self.missing(name))?.get(name)
    }

    pub(super) fn has(&self, w: Weight) -> bool {
        self.find(&format!(
            "{}.weight",
            w.prefix(self.layout, self.architecture)
        ))
        .is_some()
    }

    /// A norm (or other vector) weight as f32, checked against `len`.
    pub(super) fn vector(&mut self, w: Weight, len: usize) -> Result<Array> {
        let name = w.tensor(self.layout, self.architecture, "weight");
        let a = self.get(&name)?;
        if a.shape() != [len] {
            return Err(self.bad_shape(&name, &a, &format!("[{len}]")));
        }
        let mut a = a.astype(Dtype::F32)?;
        // Gemma's Hugging Face norms hold `w` for `x * (1 + w)`; GGUF holds `1 + w`.
        if w.is_norm() && self.layout == Layout::Mlx && self.architecture.hf_norm_offset() {
            a = a.add(&Array::from_f32(&[1.0], &[1])?)?;
        }
        // Read now, on the loading thread: safetensors arrays are lazy, and
        // MLX binds an unevaluated array to the stream of the thread that
        // made it, which the stage's own thread does not have.
        Array::eval(&[&a])?;
        self.bytes += a.nbytes();
        Ok(a)
    }

    pub(super) fn bad_shape(&self, name: &str, a: &Array, expected: &str) -> Error {
        Error::CorruptModel {
            path: self.origin.clone(),
            reason: format!(
                "tensor {name} has shape {:?} ({:?}), expected {expected}",
                a.shape(),
                a.dtype()
            ),
        }
    }

    /// A `[out, in]` matrix, quantized when the file has `scales` for it.
    pub(super) fn linear(&mut self, w: Weight, out: usize, inp: usize) -> Result<Linear> {
        let (w_, quant) = self.matrix(w, &[], out, inp)?;
        let bias_name = format!("{}.bias", w.prefix(self.layout, self.architecture));
        let bias = match self.find(&bias_name) {
            Some(_) => Some(self.get(&bias_name)?.astype(Dtype::F32)?),
            None => None,
        };
        let linear = Linear { w: w_, quant, bias };
        // Materialize now: a lazy file read or conversion fails here, at load.
        let mut arrays = vec![&linear.w];
        if let Some(q) = &linear.quant {
            arrays.push(&q.scales);
            arrays.extend(q.biases.as_ref());
        }
        arrays.extend(linear.bias.as_ref());
        Array::eval(&arrays)?;
        self.bytes += linear.bytes();
        Ok(linear)
    }

    /// A `[in] → 1` projection, stored as a vector (GGUF) or a one-row
    /// matrix (Hugging Face, perhaps quantized).
    pub(super) fn row(&mut self, w: Weight, inp: usize) -> Result<Linear> {
        let name = format!("{}.weight", w.prefix(self.layout, self.architecture));
        if self.get(&name)?.shape().len() != 1 {
            return self.linear(w, 1, inp);
        }
        let column = self.vector(w, inp)?.reshape(&[inp, 1])?;
        Array::eval(&[&column])?;
        Ok(Linear {
            w: column,
            quant: None,
            bias: None,
        })
    }

    /// `experts` stacked `[out, in]` matrices, quantized when the file has
    /// `scales` for them, with their `[experts, out]` biases when `bias`.
    pub(super) fn stacked(
        &mut self,
        w: Weight,
        (experts, out, inp): (usize, usize, usize),
        bias: bool,
    ) -> Result<Stacked> {
        let (weight, quant) = self.matrix(w, &[experts], out, inp)?;
        let bias = match bias {
            false => None,
            true => {
                let name = w.tensor(self.layout, self.architecture, "bias");
                let b = self.get(&name)?;
                if b.shape() != [experts, out] {
                    return Err(self.bad_shape(&name, &b, &format!("[{experts}, {out}]")));
                }
                Some(b.astype(Dtype::F32)?)
            }
        };
        let stacked = Stacked {
            w: weight,
            quant,
            bias,
        };
        let mut arrays = vec![&stacked.w];
        arrays.extend(stacked.bias.as_ref());
        if let Some(q) = &stacked.quant {
            arrays.push(&q.scales);
            arrays.extend(q.biases.as_ref());
        }
        Array::eval(&arrays)?;
        self.bytes += stacked.bytes();
        Ok(stacked)
    }

    /// A weight of shape `lead + [out, in]`: MLX-quantized as the file holds
    /// it (or expanded when the loader dequantizes), else f32 with its last
    /// two axes swapped (`lead + [in, out]`) for plain products.
    fn matrix(
        &mut self,
        w: Weight,
        lead: &[usize],
        out: usize,
        inp: usize,
    ) -> Result<(Array, Option<Quant>)> {
        let prefix = w.prefix(self.layout, self.architecture);
        let name = format!("{prefix}.weight");
        let weight = self.get(&name)?;
        let shape = weight.shape();
        let n = lead.len();
        let scales_name = format!("{prefix}.scales");
        let quant = if self.find(&scales_name).is_some() {
            let scales = self.get(&scales_name)?;
            let s = scales.shape();
            let packed = shape.get(n + 1).copied().unwrap_or(0);
            let groups = s.get(n + 1).copied().unwrap_or(0);
            // GGUF's scale groups of 16 (Q6_K, Q3_K, Q2_K) arrive spread to
            // 32, twice as wide (see `gguf_read`, which names them).
            let spread = self.spread.contains(&name);
            let width = if spread { 2 * inp } else { inp };
            let bits = packed * 32 / width.max(1);
            let ok = weight.dtype() == Some(Dtype::U32)
                && shape.len() == n + 2
                && shape[..n] == *lead
                && shape[n] == out
                && packed * 32 == bits * width
                && [2, 3, 4, 5, 6, 8].contains(&bits)
                && s.len() == n + 2
                && s[..n] == *lead
                && s[n] == out
                && groups > 0
                && inp.is_multiple_of(groups)
                && (!spread || groups * SPREAD_GROUP == inp);
            if !ok {
                return Err(self.bad_shape(
                    &name,
                    &weight,
                    &format!(
                        "u32 {lead:?} + [{out}, {width} × bits / 32] with scales {lead:?} + [{out}, groups] (scales {s:?}){}",
                        if spread { ", spread to twice the width" } else { "" }
                    ),
                ));
            }
            let biases_name = format!("{prefix}.biases");
            let biases = match self.find(&biases_name) {
                Some(_) => Some(self.get(&biases_name)?.astype(Dtype::F32)?),
                None => None,
            };
            // MXFP4 keeps byte scales (powers of two) and no biases; affine
            // scales are floats.
            let (mode, scales) = match scales.dtype() {
                Some(Dtype::U8) => (QuantMode::Mxfp4, scales),
                _ => (QuantMode::Affine, scales.astype(Dtype::F32)?),
            };
            let group_size = width / groups;
            let fits = match mode {
                QuantMode::Mxfp4 => bits == 4 && group_size == 32 && biases.is_none(),
                QuantMode::Affine => biases.is_some() && [32, 64, 128].contains(&group_size),
            };
            if !fits {
                return Err(Error::UnsupportedTensorType {
                    tensor: name,
                    dtype: format!(
                        "MLX {mode:?} {bits}-bit groups of {group_size}{} (MLX multiplies affine \
                         groups of 32, 64 or 128 with biases, and MXFP4 as 4 bits in groups of 32 \
                         without)",
                        if biases.is_some() {
                            " with biases"
                        } else {
                            " without biases"
                        }
                    ),
                });
            }
            Some(Quant {
                scales,
                biases,
                group_size,
                bits,
                mode,
                spread,
            })
        } else {
            let expected: Vec<usize> = lead.iter().copied().chain([out, inp]).collect();
            if shape != expected {
                return Err(self.bad_shape(&name, &weight, &format!("{expected:?}")));
            }
            None
        };
        // The last two axes swapped.
        let swap: Vec<usize> = (0..n).chain([n + 1, n]).collect();
        Ok(match quant {
            Some(q) if self.dequantize => {
                let dense = dequantize(&weight, &q)?;
                (dense.astype(Dtype::F32)?.transpose(&swap)?, None)
            }
            Some(q) => (weight, Some(q)),
            None => (weight.astype(Dtype::F32)?.transpose(&swap)?, None),
        })
    }

    pub(super) fn layer(&mut self, n: usize, c: &ModelConfig) -> Result<LayerWeights> {
        let l = |p| Weight::Layer(n, p);
        let (h, q, kv) = (c.hidden_size, c.heads * c.head_dim, c.kv_heads * c.head_dim);
        let norms = c.architecture.qk_norm() || self.has(l(Part::QNorm));
        let sandwich = c.architecture.post_norms();
        let (projections, o) = match &c.latent {
            Some(latent) => (
                Projections::Latent(Box::new(LatentWeights::load(self, n, c, latent)?)),
                self.linear(l(Part::O), h, c.heads * latent.value_dim)?,
            ),
            None => (
                Projections::Heads {
                    q: self.linear(l(Part::Q), q, h)?,
                    k: self.linear(l(Part::K), kv, h)?,
                    v: self.linear(l(Part::V), kv, h)?,
                    q_norm: norms
                        .then(|| self.vector(l(Part::QNorm), c.head_dim))
                        .transpose()?,
                    k_norm: norms
                        .then(|| self.vector(l(Part::KNorm), c.head_dim))
                        .transpose()?,
                },
                self.linear(l(Part::O), h, q)?,
            ),
        };
        Ok(LayerWeights {
            attn_norm: self.vector(l(Part::AttnNorm), h)?,
            projections,
            o,
            ffn_norm: self.vector(l(Part::FfnNorm), h)?,
            post_attn_norm: sandwich
                .then(|| self.vector(l(Part::PostAttnNorm), h))
                .transpose()?,
            post_ffn_norm: sandwich
                .then(|| self.vector(l(Part::PostFfnNorm), h))
                .transpose()?,
            sinks: c
                .architecture
                .attention_sinks()
                .then(|| self.vector(l(Part::Sinks), c.heads))
                .transpose()?,
            ffn: match &c.moe {
                Some(moe) if moe.routed(n) => {
                    let (e, width) = (moe.experts, moe.expert_intermediate_size);
                    let router = self.linear(l(Part::Router), e, h)?;
                    if moe.bias && router.bias.is_none() {
                        return Err(self.missing(&l(Part::Router).tensor(
                            self.layout,
                            self.architecture,
                            "bias",
                        )));
                    }
                    FeedForward::Experts(Box::new(Experts {
                        router,
                        gate: self.stacked(l(Part::ExpertGate), (e, width, h), moe.bias)?,
                        up: self.stacked(l(Part::ExpertUp), (e, width, h), moe.bias)?,
                        down: self.stacked(l(Part::ExpertDown), (e, h, width), moe.bias)?,
                        per_token: moe.experts_per_token,
                        normalize: moe.normalize,
                        routing: moe.routing,
                        choice_bias: match moe.routing {
                            Routing::SigmoidGroups { .. } => {
                                let name = l(Part::ExpertBias).tensor(
                                    self.layout,
                                    self.architecture,
                                    "bias",
                                );
                                let b = self.get(&name)?;
                                if b.shape() != [e] {
                                    return Err(self.bad_shape(&name, &b, &format!("[{e}]")));
                                }
                                let bias = b.astype(Dtype::F32)?.to_f32()?;
                                // Held on the host, counted all the same.
                                self.bytes += std::mem::size_of_val(bias.as_slice());
                                Some(bias)
                            }
                            Routing::Softmax | Routing::SoftmaxGroups { .. } => None,
                        },
                        shared: match moe.shared_expert {
                            Some(w) => Some(SharedExpert {
                                gate_inp: match moe.shared_gate {
                                    true => Some(self.row(l(Part::SharedGateInp), h)?),
                                    false => None,
                                },
                                gate: self.linear(l(Part::SharedGate), w, h)?,
                                up: self.linear(l(Part::SharedUp), w, h)?,
                                down: self.linear(l(Part::SharedDown), h, w)?,
                            }),
                            None => None,
                        },
                    }))
                }
                _ => FeedForward::Dense {
                    gate: self.linear(l(Part::Gate), c.intermediate_size, h)?,
                    up: self.linear(l(Part::Up), c.intermediate_size, h)?,
                    down: self.linear(l(Part::Down), h, c.intermediate_size)?,
                },
            },
        })
    }
}
