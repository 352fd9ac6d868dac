//! What a model is, read from its GGUF metadata or its `config.json`: the
//! numbers every backend and the placement planner need.

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
}

impl Architecture {
    /// The name GGUF uses (`general.architecture`).
    pub fn gguf_name(self) -> &'static str {
        match self {
            Architecture::Llama => "llama",
            Architecture::Qwen2 => "qwen2",
            Architecture::Qwen3 => "qwen3",
        }
    }

    fn from_gguf_name(name: &str) -> Result<Self> {
        match name {
            "llama" => Ok(Architecture::Llama),
            "qwen2" => Ok(Architecture::Qwen2),
            "qwen3" => Ok(Architecture::Qwen3),
            other => Err(Error::UnsupportedArchitecture(other.to_string())),
        }
    }

    /// Whether RoPE rotates interleaved pairs (GGUF Llama) rather than halves (NeoX).
    pub fn interleaved_rope(self) -> bool {
        matches!(self, Architecture::Llama)
    }
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
        Ok(ModelConfig {
            architecture,
            layers: header.get_u32(&key("block_count"))? as usize,
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
        })
    }

    /// Reads a Hugging Face `config.json` (the safetensors layouts, MLX-community
    /// included).
    pub fn from_hf_json(v: &serde_json::Value) -> Result<Self> {
        let bad = |key: &str, detail: &str| Error::metadata(format!("config.json {key}"), detail);
        let int = |key: &str| -> Result<usize> {
            v.get(key)
                .and_then(serde_json::Value::as_u64)
                .map(|x| x as usize)
                .ok_or_else(|| bad(key, "expected a non-negative integer"))
        };
        let float = |key: &str, default: f64| -> Result<f64> {
            match v.get(key) {
                None | Some(serde_json::Value::Null) => Ok(default),
                Some(x) => x.as_f64().ok_or_else(|| bad(key, "expected a number")),
            }
        };
        let model_type = v
            .get("model_type")
            .and_then(serde_json::Value::as_str)
            .ok_or_else(|| bad("model_type", "expected a string"))?;
        let architecture = match model_type {
            "llama" | "mistral" => Architecture::Llama,
            other => Architecture::from_gguf_name(other)?,
        };
        let hidden_size = int("hidden_size")?;
        let heads = int("num_attention_heads")?;
        let kv_heads = int("num_key_value_heads").unwrap_or(heads);
        if heads == 0 || kv_heads == 0 || !heads.is_multiple_of(kv_heads) {
            return Err(bad(
                "num_key_value_heads",
                &format!("{heads} heads cannot share {kv_heads} key/value heads"),
            ));
        }
        let head_dim = match int("head_dim") {
            Ok(d) => d,
            Err(_) if hidden_size.is_multiple_of(heads) => hidden_size / heads,
            Err(e) => return Err(e),
        };
        Ok(ModelConfig {
            architecture,
            layers: int("num_hidden_layers")?,
            hidden_size,
            intermediate_size: int("intermediate_size")?,
            heads,
            kv_heads,
            head_dim,
            vocab_size: int("vocab_size")?,
            context_length: int("max_position_embeddings")?,
            rope_theta: float("rope_theta", 10_000.0)? as f32,
            rms_eps: float("rms_norm_eps", 1e-5)?,
        })
    }

    /// The configuration as a Hugging Face `config.json` (what
    /// [`ModelConfig::from_hf_json`] reads back).
    pub fn to_hf_json(&self, tie_word_embeddings: bool) -> serde_json::Value {
        let (model_type, class) = match self.architecture {
            Architecture::Llama => ("llama", "LlamaForCausalLM"),
            Architecture::Qwen2 => ("qwen2", "Qwen2ForCausalLM"),
            Architecture::Qwen3 => ("qwen3", "Qwen3ForCausalLM"),
        };
        serde_json::json!({
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
        })
    }

    /// Bytes of KV cache one token takes in one layer (keys and values, f32).
    pub fn kv_bytes_per_token_per_layer(&self) -> usize {
        2 * self.kv_heads * self.head_dim * std::mem::size_of::<f32>()
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
