//! What a model is, read from its GGUF metadata or its `config.json`: the
//! numbers every backend and the placement planner need.

mod deepseek;
mod gemma;
mod gpt_oss;
mod moe;
mod rope;

pub use deepseek::LatentAttention;
pub use gpt_oss::Yarn;
pub use moe::{Moe, Routing};
pub use rope::Llama3Rope;

use crate::error::{Error, Result};
use crate::gguf::{Array, GgufHeader, Value};

/// The transformer families the engine runs (the Llama family as GGUF names it).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Architecture {
    /// Llama 2/3, SmolLM, Mistral: GGUF permutes Q/K for interleaved RoPE.
    Llama,
    /// Qwen2: biases on Q, K and V; NeoX RoPE.
    Qwen2,
    /// Qwen3: RMS norm on Q and K per head; NeoX RoPE.
    Qwen3,
    /// Gemma 3 (text): Q/K norms, norms after attention and after the
    /// feed-forward block too, a GELU feed-forward, scaled embeddings, and
    /// sliding-window layers with their own RoPE base between global ones.
    Gemma3,
    /// Qwen3-MoE: Qwen3's attention, routed experts (softmax, top k).
    Qwen3Moe,
    /// Qwen2-MoE (Qwen1.5-MoE, Qwen2-57B-A14B): Qwen2's attention, routed
    /// experts beside a shared expert behind a sigmoid gate.
    Qwen2Moe,
    /// Mixtral: Llama's attention (GGUF names it `llama`), routed experts.
    Mixtral,
    /// gpt-oss: biases on Q, K, V and O, a learned "sink" logit per head
    /// that takes part in every softmax, sliding-window layers between
    /// global ones, YaRN RoPE, and routed experts with biases behind a
    /// clamped SwiGLU.
    GptOss,
    /// DeepSeek V2, V3 and Kimi K2: multi-head latent attention (a
    /// compressed KV cache), interleaved RoPE on part of each head, experts
    /// beside shared ones (V2 routes by softmax, V3 and K2 by sigmoid scores
    /// within groups), dense first layers.
    DeepSeekV3,
}

impl Architecture {
    /// The name GGUF uses (`general.architecture`).
    pub fn gguf_name(self) -> &'static str {
        match self {
            Architecture::Llama => "llama",
            Architecture::Qwen2 => "qwen2",
            Architecture::Qwen3 => "qwen3",
            Architecture::Gemma3 => "gemma3",
            Architecture::Qwen3Moe => "qwen3moe",
            Architecture::Qwen2Moe => "qwen2moe",
            Architecture::Mixtral => "llama",
            Architecture::GptOss => "gpt-oss",
            Architecture::DeepSeekV3 => "deepseek2",
        }
    }

    fn from_gguf_name(name: &str) -> Result<Self> {
        match name {
            "llama" => Ok(Architecture::Llama),
            "qwen2" => Ok(Architecture::Qwen2),
            "qwen3" => Ok(Architecture::Qwen3),
            "gemma3" => Ok(Architecture::Gemma3),
            "qwen3moe" => Ok(Architecture::Qwen3Moe),
            "qwen2moe" => Ok(Architecture::Qwen2Moe),
            "gpt-oss" => Ok(Architecture::GptOss),
            "deepseek2" => Ok(Architecture::DeepSeekV3),
            other => Err(Error::UnsupportedArchitecture(other.to_string())),
        }
    }

    /// Whether RoPE rotates interleaved pairs (GGUF Llama) rather than halves (NeoX).
    pub fn interleaved_rope(self) -> bool {
        matches!(self, Architecture::Llama | Architecture::Mixtral)
    }

    /// Whether the family's own definition rotates interleaved pairs (in
    /// every layout, not only in GGUF's permuted Llama weights).
    pub fn traditional_rope(self) -> bool {
        matches!(self, Architecture::DeepSeekV3)
    }

    /// Whether each attention head has a learned sink: one more logit in
    /// its softmax that takes weight but adds no value.
    pub fn attention_sinks(self) -> bool {
        matches!(self, Architecture::GptOss)
    }

    /// Whether Q, K and V always have biases.
    pub fn qkv_bias(self) -> bool {
        matches!(
            self,
            Architecture::Qwen2 | Architecture::Qwen2Moe | Architecture::GptOss
        )
    }

    /// Whether each layer has per-head RMS norms on queries and keys.
    pub fn qk_norm(self) -> bool {
        matches!(
            self,
            Architecture::Qwen3 | Architecture::Qwen3Moe | Architecture::Gemma3
        )
    }

    /// Whether the attention output and the feed-forward output are normed
    /// before they join the residual stream (Gemma's "sandwich" norms).
    pub fn post_norms(self) -> bool {
        matches!(self, Architecture::Gemma3)
    }

    /// The feed-forward gate's activation.
    pub fn activation(self) -> Activation {
        match self {
            Architecture::Gemma3 => Activation::GeluTanh,
            Architecture::GptOss => Activation::SwigluOai,
            _ => Activation::Silu,
        }
    }

    /// Whether Hugging Face checkpoints store RMS-norm weights as offsets
    /// from one (`x * (1 + w)`); GGUF files store `1 + w`.
    pub fn hf_norm_offset(self) -> bool {
        matches!(self, Architecture::Gemma3)
    }
}

/// The activation of a gated feed-forward block.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Activation {
    /// `x * sigmoid(x)`.
    Silu,
    /// GELU, tanh approximation.
    GeluTanh,
    /// gpt-oss's: the gate clamped above at 7 and the up projection to
    /// ±7, then `gate · sigmoid(1.702 gate) · (up + 1)`.
    SwigluOai,
}

impl Activation {
    /// gpt-oss's clamp of the gate (above) and the up projection (both ways).
    pub const SWIGLU_LIMIT: f32 = 7.0;
    /// gpt-oss's sigmoid slope.
    pub const SWIGLU_ALPHA: f32 = 1.702;
}

/// The most layers a configuration may claim (the largest models have
/// about 130): per-layer lists are built from the count.
pub const MAX_LAYERS: usize = 4096;

/// Refuses more layers than [`MAX_LAYERS`].
fn check_layers(layers: usize) -> Result<()> {
    if layers > MAX_LAYERS {
        return Err(Error::TooLarge {
            what: "the number of layers".into(),
            found: layers as u64,
            limit: MAX_LAYERS as u64,
        });
    }
    Ok(())
}

/// The hyper-parameters of a model.
#[derive(Debug, Clone, PartialEq)]
pub struct ModelConfig {
    /// The architecture.
    pub architecture: Architecture,
    /// Number of transformer layers.
    pub layers: usize,
    /// Width of the hidden state.
    pub hidden_size: usize,
    /// Width of the feed-forward layer.
    pub intermediate_size: usize,
    /// Attention (query) heads.
    pub heads: usize,
    /// Key/value heads.
    pub kv_heads: usize,
    /// Dimension of one head.
    pub head_dim: usize,
    /// Vocabulary size.
    pub vocab_size: usize,
    /// Context length the model was trained for.
    pub context_length: usize,
    /// RoPE base frequency.
    pub rope_theta: f32,
    /// Epsilon of the RMS norms.
    pub rms_eps: f64,
    /// Scale of the attention scores (`1/sqrt(head_dim)` unless the family
    /// says otherwise; with YaRN, times its attention factor squared).
    pub attention_scale: f32,
    /// Factor the token embeddings are multiplied by (1 unless the family
    /// scales them).
    pub embedding_scale: f32,
    /// Sliding-window attention, when the family has it.
    pub sliding: Option<SlidingWindow>,
    /// Linear RoPE scaling of the global layers: positions are divided by it.
    pub rope_scale: f32,
    /// YaRN RoPE scaling of every layer, when the model has it.
    pub yarn: Option<Yarn>,
    /// What each RoPE frequency of the global layers is divided by, when the
    /// model scales them one by one (Llama 3.1–3.3: from `rope_scaling` of
    /// type `llama3`, or GGUF's `rope_freqs` tensor).
    pub rope_factors: Option<Vec<f32>>,
    /// Routed experts, when the family has them.
    pub moe: Option<Moe>,
    /// Multi-head latent attention's widths (DeepSeek V3), when the family
    /// has it; `head_dim` is then the rotated part of a head.
    pub latent: Option<LatentAttention>,
}

/// Sliding-window attention: every `pattern`-th layer is global, the others
/// let a query see only the last `window` positions (itself included), with
/// RoPE base `rope_theta` and no scaling.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct SlidingWindow {
    /// Positions a query sees, itself included.
    pub window: usize,
    /// Layer `i` is global when `(i + 1) % pattern == 0`.
    pub pattern: usize,
    /// RoPE base of the sliding layers.
    pub rope_theta: f32,
}

/// Positions a sliding layer keeps before its window, at least: a prompt
/// that repeats an earlier sequence up to about this far before that
/// sequence's end still finds every row its window needs in the prefix cache.
pub const SLIDING_REACH: usize = 64;

/// Prompt tokens an agent's step takes at most unless told otherwise
/// (`--prefill-tokens-per-step`): what a Model's status assumes of the
/// rows a sliding layer holds.
pub const PROMPT_STEP: usize = 512;

/// Positions a sliding layer of `window` keeps behind its next query: the
/// window, and as much again (at least [`SLIDING_REACH`]).
pub fn sliding_kept(window: usize) -> usize {
    window.saturating_add(window.max(SLIDING_REACH))
}

/// KV rows a sliding layer of `window` holds at most for one sequence,
/// however the engines keep them, when a step takes at most `step` of its
/// prompt's tokens: what it keeps, up to a window (or 256 rows) it has not
/// let go yet, 256 of rounding to whole chunks, and the step's rows (never
/// more than the context, which the caller applies).
pub fn sliding_rows_held(window: usize, step: usize) -> usize {
    sliding_kept(window)
        .saturating_add(window.max(256))
        .saturating_add(256)
        .saturating_add(step)
}

/// How one layer attends: its window and RoPE.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct LayerAttention {
    /// Positions a query sees (itself included), or every earlier one.
    pub window: Option<usize>,
    /// RoPE base frequency.
    pub rope_theta: f32,
    /// Positions are divided by this before RoPE.
    pub rope_scale: f32,
    /// YaRN's frequencies instead, when the model has them.
    pub yarn: Option<Yarn>,
}

impl LayerAttention {
    /// RoPE's inverse frequencies for a head of `head_dim`: `θ^(-2i/d) / scale`,
    /// or YaRN's.
    pub fn inverse_frequencies(&self, head_dim: usize) -> Vec<f32> {
        match &self.yarn {
            Some(yarn) => yarn.inverse_frequencies(self.rope_theta, head_dim),
            None => (0..head_dim / 2)
                .map(|i| {
                    1.0 / self.rope_theta.powf(2.0 * i as f32 / head_dim as f32) / self.rope_scale
                })
                .collect(),
        }
    }
}

/// An error in `config.json`'s `key`.
fn hf_bad(key: &str, detail: &str) -> Error {
    Error::metadata(format!("config.json {key}"), detail)
}

/// `config.json`'s `key` as a non-negative integer.
fn hf_int(v: &serde_json::Value, key: &str) -> Result<usize> {
    v.get(key)
        .and_then(serde_json::Value::as_u64)
        .map(|x| x as usize)
        .ok_or_else(|| hf_bad(key, "expected a non-negative integer"))
}

/// `config.json`'s `key` as a number, `default` when absent or null.
fn hf_float(v: &serde_json::Value, key: &str, default: f64) -> Result<f64> {
    match v.get(key) {
        None | Some(serde_json::Value::Null) => Ok(default),
        Some(x) => x.as_f64().ok_or_else(|| hf_bad(key, "expected a number")),
    }
}

impl ModelConfig {
    /// Reads the configuration from GGUF metadata.
    pub fn from_gguf(header: &GgufHeader) -> Result<Self> {
        let arch_name = header.get_str("general.architecture")?;
        let architecture = Architecture::from_gguf_name(arch_name)?;
        let key = |k: &str| format!("{arch_name}.{k}");
        let hidden_size = header.get_u32(&key("embedding_length"))? as usize;
        let heads = header.get_u32(&key("attention.head_count"))? as usize;
        let kv_heads = header
            .get_u32(&key("attention.head_count_kv"))
            .unwrap_or(heads as u32) as usize;
        if heads == 0 || kv_heads == 0 || !heads.is_multiple_of(kv_heads) {
            return Err(Error::metadata(
                key("attention.head_count_kv"),
                format!("{heads} heads cannot share {kv_heads} key/value heads"),
            ));
        }
        let head_dim = match header.get_u32(&key("attention.key_length")) {
            Ok(d) => d as usize,
            Err(_) if hidden_size.is_multiple_of(heads) => hidden_size / heads,
            Err(e) => return Err(e),
        };
        let vocab_size = match header.get("tokenizer.ggml.tokens") {
            Ok(Value::Array(tokens @ Array::String(_))) => tokens.len(),
            // The embedding's outer dimension (GGUF lists dimensions innermost first).
            _ => header
                .tensor("token_embd.weight")?
                .dims
                .last()
                .map(|&d| d as usize)
                .unwrap_or(0),
        };
        let layers = header.get_u32(&key("block_count"))? as usize;
        check_layers(layers)?;
        let mut config = ModelConfig {
            architecture,
            layers,
            hidden_size,
            intermediate_size: header.get_u32(&key("feed_forward_length"))? as usize,
            heads,
            kv_heads,
            head_dim,
            vocab_size,
            context_length: header.get_u32(&key("context_length"))? as usize,
            rope_theta: header.get_f32(&key("rope.freq_base")).unwrap_or(10_000.0),
            rms_eps: header
                .get_f32(&key("attention.layer_norm_rms_epsilon"))
                .unwrap_or(1e-5) as f64,
            attention_scale: 1.0 / (head_dim as f32).sqrt(),
            embedding_scale: 1.0,
            sliding: None,
            rope_scale: 1.0,
            yarn: None,
            rope_factors: None,
            moe: None,
            latent: None,
        };
        match architecture {
            Architecture::Gemma3 => gemma::from_gguf(&mut config, header, &key)?,
            Architecture::GptOss => gpt_oss::from_gguf(&mut config, header, &key)?,
            Architecture::DeepSeekV3 => deepseek::from_gguf(&mut config, header, &key)?,
            _ => rope::from_gguf(&mut config, header, &key)?,
        }
        config.moe = match architecture {
            Architecture::DeepSeekV3 => deepseek::moe_from_gguf(&config, header, &key)?,
            _ => moe::from_gguf(&config, header, &key)?,
        };
        if config.moe.is_some() && architecture == Architecture::Llama {
            config.architecture = Architecture::Mixtral;
        } else if config.moe.is_none() && architecture == Architecture::Qwen3Moe {
            return Err(Error::metadata(
                key("expert_count"),
                "a qwen3moe model without experts",
            ));
        }
        Ok(config)
    }

    /// Reads a Hugging Face `config.json` (the safetensors layouts, MLX-community
    /// included).
    pub fn from_hf_json(v: &serde_json::Value) -> Result<Self> {
        let int = |key: &str| hf_int(v, key);
        let float = |key: &str, default: f64| hf_float(v, key, default);
        let model_type = v
            .get("model_type")
            .and_then(serde_json::Value::as_str)
            .ok_or_else(|| hf_bad("model_type", "expected a string"))?;
        let architecture = match model_type {
            "llama" | "mistral" => Architecture::Llama,
            "gemma3_text" => Architecture::Gemma3,
            "qwen3_moe" => Architecture::Qwen3Moe,
            "qwen2_moe" => Architecture::Qwen2Moe,
            "mixtral" => Architecture::Mixtral,
            "gpt_oss" => Architecture::GptOss,
            "deepseek_v2" | "deepseek_v3" | "kimi_k2" => Architecture::DeepSeekV3,
            // `gemma3` in config.json is the multimodal wrapper (`text_config`,
            // `language_model.` weights).
            "gemma3" => return Err(Error::UnsupportedArchitecture(
                "gemma3 (the multimodal checkpoint; its text-only form, gemma3_text, is supported)"
                    .into(),
            )),
            other => Architecture::from_gguf_name(other)?,
        };
        let hidden_size = int("hidden_size")?;
        let heads = int("num_attention_heads")?;
        let kv_heads = int("num_key_value_heads").unwrap_or(heads);
        if heads == 0 || kv_heads == 0 || !heads.is_multiple_of(kv_heads) {
            return Err(hf_bad(
                "num_key_value_heads",
                &format!("{heads} heads cannot share {kv_heads} key/value heads"),
            ));
        }
        let head_dim = match int("head_dim") {
            Ok(d) => d,
            Err(_) if hidden_size.is_multiple_of(heads) => hidden_size / heads,
            Err(e) => return Err(e),
        };
        let layers = int("num_hidden_layers")?;
        check_layers(layers)?;
        let mut config = ModelConfig {
            architecture,
            layers,
            hidden_size,
            intermediate_size: int("intermediate_size")?,
            heads,
            kv_heads,
            head_dim,
            vocab_size: int("vocab_size")?,
            context_length: int("max_position_embeddings")?,
            rope_theta: float("rope_theta", 10_000.0)? as f32,
            rms_eps: float("rms_norm_eps", 1e-5)?,
            attention_scale: 1.0 / (head_dim as f32).sqrt(),
            embedding_scale: 1.0,
            sliding: None,
            rope_scale: 1.0,
            yarn: None,
            rope_factors: None,
            moe: None,
            latent: None,
        };
        match architecture {
            Architecture::Gemma3 => gemma::from_hf(&mut config, v)?,
            Architecture::GptOss => gpt_oss::from_hf(&mut config, v)?,
            Architecture::DeepSeekV3 => deepseek::from_hf(&mut config, v)?,
            _ => rope::from_hf(&mut config, v)?,
        }
        config.moe = moe::from_hf(architecture, &config, v)?;
        Ok(config)
    }

    /// RoPE's inverse frequencies of a layer that attends as `attention`:
    /// its own ([`LayerAttention::inverse_frequencies`]), each divided by
    /// the model's factor on a global layer when it has them.
    pub fn inverse_frequencies(&self, attention: &LayerAttention) -> Vec<f32> {
        let mut frequencies = attention.inverse_frequencies(self.head_dim);
        if let (None, Some(factors)) = (attention.window, &self.rope_factors) {
            for (f, d) in frequencies.iter_mut().zip(factors) {
                *f /= d;
            }
        }
        frequencies
    }

    /// Whether some layer's RoPE frequencies are not the plain ones of its
    /// base and linear scale (YaRN, or per-frequency factors).
    pub fn rope_frequencies_scaled(&self) -> bool {
        self.yarn.is_some() || self.rope_factors.is_some()
    }

    /// The window of each of `layers` (`None`: the layer sees every
    /// position).
    pub fn layer_windows(&self, layers: std::ops::Range<usize>) -> Vec<Option<usize>> {
        layers.map(|l| self.layer_attention(l).window).collect()
    }

    /// How layer `layer` attends: its window and its RoPE.
    pub fn layer_attention(&self, layer: usize) -> LayerAttention {
        match self.sliding {
            Some(s) if !(layer + 1).is_multiple_of(s.pattern) => self.sliding_attention(s),
            _ => self.global_attention(),
        }
    }

    /// How a global layer attends.
    pub fn global_attention(&self) -> LayerAttention {
        LayerAttention {
            window: None,
            rope_theta: self.rope_theta,
            rope_scale: self.rope_scale,
            yarn: self.yarn,
        }
    }

    /// How a sliding layer attends: its own RoPE base, no linear scaling,
    /// the model's YaRN when it has one.
    pub fn sliding_attention(&self, s: SlidingWindow) -> LayerAttention {
        LayerAttention {
            window: Some(s.window),
            rope_theta: s.rope_theta,
            rope_scale: 1.0,
            yarn: self.yarn,
        }
    }

    /// The configuration as a Hugging Face `config.json` (what
    /// [`ModelConfig::from_hf_json`] reads back). Per-frequency RoPE factors
    /// have no place in it and are left out: callers refuse such models.
    pub fn to_hf_json(&self, tie_word_embeddings: bool) -> serde_json::Value {
        let (model_type, class) = match self.architecture {
            Architecture::Llama => ("llama", "LlamaForCausalLM"),
            Architecture::Qwen2 => ("qwen2", "Qwen2ForCausalLM"),
            Architecture::Qwen3 => ("qwen3", "Qwen3ForCausalLM"),
            Architecture::Gemma3 => ("gemma3_text", "Gemma3ForCausalLM"),
            Architecture::Qwen3Moe => ("qwen3_moe", "Qwen3MoeForCausalLM"),
            Architecture::Qwen2Moe => ("qwen2_moe", "Qwen2MoeForCausalLM"),
            Architecture::Mixtral => ("mixtral", "MixtralForCausalLM"),
            Architecture::GptOss => ("gpt_oss", "GptOssForCausalLM"),
            Architecture::DeepSeekV3 => match self.moe.as_ref().map(|m| m.routing) {
                Some(Routing::SoftmaxGroups { .. }) => ("deepseek_v2", "DeepseekV2ForCausalLM"),
                _ => ("deepseek_v3", "DeepseekV3ForCausalLM"),
            },
        };
        let mut json = serde_json::json!({
            "architectures": [class],
            "model_type": model_type,
            "num_hidden_layers": self.layers,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_attention_heads": self.heads,
            "num_key_value_heads": self.kv_heads,
            "head_dim": self.head_dim,
            "vocab_size": self.vocab_size,
            "max_position_embeddings": self.context_length,
            "rope_theta": self.rope_theta,
            "rms_norm_eps": self.rms_eps,
            "hidden_act": "silu",
            "tie_word_embeddings": tie_word_embeddings,
        });
        if let (Some(moe), Some(json)) = (&self.moe, json.as_object_mut())
            && let serde_json::Value::Object(extra) =
                moe::to_hf_json(self.architecture, moe, self.layers)
        {
            json.extend(extra);
        }
        if self.architecture == Architecture::Gemma3 {
            let gemma = serde_json::json!({
                "hidden_act": "gelu_pytorch_tanh",
                "hidden_activation": "gelu_pytorch_tanh",
                "query_pre_attn_scalar": 1.0 / (self.attention_scale as f64).powi(2),
                "sliding_window": self.sliding.map_or(0, |s| s.window),
                "sliding_window_pattern": self.sliding.map_or(1, |s| s.pattern),
                "rope_local_base_freq": self.sliding.map_or(10_000.0, |s| s.rope_theta),
                "rope_scaling": (self.rope_scale != 1.0)
                    .then(|| serde_json::json!({"rope_type": "linear", "factor": self.rope_scale})),
            });
            if let (Some(json), serde_json::Value::Object(extra)) = (json.as_object_mut(), gemma) {
                json.extend(extra);
            }
        }
        if let (Some(latent), Some(object)) = (&self.latent, json.as_object_mut()) {
            if let serde_json::Value::Object(extra) = deepseek::latent_to_hf_json(latent) {
                object.extend(extra);
            }
            if let Some(yarn) = self.yarn {
                json["rope_scaling"] =
                    deepseek::yarn_to_hf_json(yarn, self.attention_scale, latent);
            }
        } else if !matches!(
            self.architecture,
            Architecture::Gemma3 | Architecture::GptOss
        ) {
            if self.rope_scale != 1.0 {
                json["rope_scaling"] =
                    serde_json::json!({"rope_type": "linear", "factor": self.rope_scale});
            }
            if let Some(yarn) = self.yarn {
                json["rope_scaling"] = yarn.to_hf_json();
            }
        }
        if self.architecture == Architecture::GptOss
            && let Some(json) = json.as_object_mut()
        {
            let types: Vec<&str> = (0..self.layers)
                .map(|l| match self.layer_attention(l).window {
                    Some(_) => "sliding_attention",
                    None => "full_attention",
                })
                .collect();
            json.insert("layer_types".into(), serde_json::json!(types));
            json.insert(
                "sliding_window".into(),
                self.sliding.map_or(0, |s| s.window).into(),
            );
            json.insert(
                "rope_scaling".into(),
                self.yarn.map_or(serde_json::Value::Null, Yarn::to_hf_json),
            );
        }
        json
    }

    /// Whether layer `layer` routes its tokens to experts.
    pub fn routed(&self, layer: usize) -> bool {
        self.moe.as_ref().is_some_and(|m| m.routed(layer))
    }

    /// Bytes of KV cache one token takes in one layer (keys and values, or
    /// latent attention's compressed row; f32).
    pub fn kv_bytes_per_token_per_layer(&self) -> usize {
        let floats = match &self.latent {
            Some(latent) => latent.cache_width(),
            None => 2 * self.kv_heads * self.head_dim,
        };
        floats * std::mem::size_of::<f32>()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn hf_config_round_trips() {
        let c = ModelConfig {
            architecture: Architecture::Qwen3,
            layers: 28,
            hidden_size: 1024,
            intermediate_size: 3072,
            heads: 16,
            kv_heads: 8,
            head_dim: 128,
            vocab_size: 151_936,
            context_length: 40_960,
            rope_theta: 1_000_000.0,
            rms_eps: 1e-6,
            attention_scale: 1.0 / 128f32.sqrt(),
            embedding_scale: 1.0,
            sliding: None,
            rope_scale: 1.0,
            yarn: None,
            rope_factors: None,
            moe: None,
            latent: None,
        };
        let back = ModelConfig::from_hf_json(&c.to_hf_json(true)).unwrap();
        assert_eq!(back.architecture, c.architecture);
        assert_eq!(back.head_dim, 128);
        assert_eq!(back.kv_heads, 8);
        assert!((back.rms_eps - 1e-6).abs() < 1e-12);
        let bad = ModelConfig::from_hf_json(&serde_json::json!({"model_type": "llama"}));
        assert!(
            bad.unwrap_err()
                .to_string()
                .contains("config.json hidden_size")
        );
        let gpt = ModelConfig::from_hf_json(&serde_json::json!({"model_type": "gpt2"}));
        assert!(matches!(gpt, Err(Error::UnsupportedArchitecture(_))));
    }
}
