//! RoPE scaling of the families that have no rules of their own (Llama and
//! Mistral, Qwen 2 and 3, the mixture-of-experts families): from
//! `config.json`'s `rope_scaling`, `linear` (positions divided by the
//! factor), `llama3` (Llama 3.1–3.3: each frequency divided by its own
//! factor) or `yarn` (Qwen 2.5 and 3 for long contexts: see [`Yarn`]); from
//! GGUF, `rope.scaling.type` linear or yarn. Llama 3's factors in a
//! GGUF file are a tensor (`rope_freqs.weight`, as llama.cpp's converter
//! writes them), which the engine reads when it opens the file.
//!
//! ```text
//!  wavelength 2π/f:   < original/high      between             > original/low
//!  divided by:        1                    1/((1−s)/factor+s)  factor
//!                                          s = (original/λ − low)/(high − low)
//! ```
//!
//! Any other scaling (dynamic NTK, LongRoPE) is refused by name
//! rather than run unscaled.

use super::gemma::{positive, rope_scaling_kind};
use super::{ModelConfig, Yarn, hf_bad};
use crate::error::{Error, Result};
use crate::gguf::GgufHeader;

/// Llama 3's frequency-dependent scaling.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Llama3Rope {
    /// What the lowest frequencies are divided by.
    pub factor: f64,
    /// Wavelengths above `original / low_freq_factor` are divided by `factor`.
    pub low_freq_factor: f64,
    /// Wavelengths below `original / high_freq_factor` are kept.
    pub high_freq_factor: f64,
    /// The context the model was first trained for.
    pub original_context: f64,
}

impl Llama3Rope {
    /// Reads a `rope_scaling` entry of type `llama3`.
    fn from_hf(v: &serde_json::Value) -> Result<Self> {
        let number = |key: &str| {
            let x = v
                .get(key)
                .and_then(serde_json::Value::as_f64)
                .ok_or_else(|| hf_bad(&format!("rope_scaling.{key}"), "expected a number"))?;
            positive(&format!("config.json rope_scaling.{key}"), x)
        };
        let scaling = Llama3Rope {
            factor: number("factor")?,
            low_freq_factor: number("low_freq_factor")?,
            high_freq_factor: number("high_freq_factor")?,
            original_context: number("original_max_position_embeddings")?,
        };
        if scaling.high_freq_factor <= scaling.low_freq_factor {
            return Err(hf_bad(
                "rope_scaling.high_freq_factor",
                "must be above low_freq_factor",
            ));
        }
        Ok(scaling)
    }

    /// What each of the `head_dim / 2` frequencies of base `theta` is
    /// divided by.
    pub fn factors(&self, theta: f32, head_dim: usize) -> Vec<f32> {
        let low_wavelength = self.original_context / self.low_freq_factor;
        let high_wavelength = self.original_context / self.high_freq_factor;
        (0..head_dim / 2)
            .map(|i| {
                let frequency = (theta as f64).powf(-2.0 * i as f64 / head_dim as f64);
                let wavelength = 2.0 * std::f64::consts::PI / frequency;
                if wavelength < high_wavelength {
                    1.0
                } else if wavelength > low_wavelength {
                    self.factor as f32
                } else {
                    let smooth = (self.original_context / wavelength - self.low_freq_factor)
                        / (self.high_freq_factor - self.low_freq_factor);
                    (1.0 / ((1.0 - smooth) / self.factor + smooth)) as f32
                }
            })
            .collect()
    }
}

/// Reads `config.json`'s `rope_scaling` for a family without rules of its
/// own.
pub(super) fn from_hf(config: &mut ModelConfig, v: &serde_json::Value) -> Result<()> {
    let Some((kind, entry)) = rope_scaling_kind(v.get("rope_scaling")) else {
        return Ok(());
    };
    match kind {
        "default" => {}
        "linear" => {
            let factor = entry
                .get("factor")
                .and_then(|f| f.as_f64())
                .unwrap_or(f64::NAN);
            config.rope_scale = positive("config.json rope_scaling.factor", factor)? as f32;
        }
        "llama3" => {
            let scaling = Llama3Rope::from_hf(entry)?;
            config.rope_factors = Some(scaling.factors(config.rope_theta, config.head_dim));
        }
        "yarn" => Yarn::from_hf(entry, config.context_length)?.apply(config),
        other => {
            return Err(hf_bad(
                "rope_scaling",
                &format!(
                    "RoPE scaling {other:?} is not supported for {} (linear, llama3 and yarn are)",
                    config.architecture.gguf_name()
                ),
            ));
        }
    }
    Ok(())
}

/// Reads GGUF's `rope.scaling.type` for a family without rules of its own
/// (`key` makes the architecture's keys).
pub(super) fn from_gguf(
    config: &mut ModelConfig,
    header: &GgufHeader,
    key: &dyn Fn(&str) -> String,
) -> Result<()> {
    let Ok(kind) = header.get_str(&key("rope.scaling.type")) else {
        return Ok(());
    };
    match kind {
        "none" => {}
        "linear" => {
            let factor = header.get_f32(&key("rope.scaling.factor"))?;
            config.rope_scale = positive(&key("rope.scaling.factor"), factor as f64)? as f32;
        }
        "yarn" => Yarn::from_gguf(header, key, config.context_length)?.apply(config),
        other => {
            return Err(Error::metadata(
                key("rope.scaling.type"),
                format!(
                    "RoPE scaling {other:?} is not supported for {} (linear and yarn are; \
                     Llama 3's comes as the rope_freqs tensor)",
                    config.architecture.gguf_name()
                ),
            ));
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Llama 3.1 8B's scaling, as its config.json gives it.
    fn llama31() -> Llama3Rope {
        Llama3Rope {
            factor: 8.0,
            low_freq_factor: 1.0,
            high_freq_factor: 4.0,
            original_context: 8192.0,
        }
    }

    #[test]
    fn llama3_factors_keep_high_frequencies_and_divide_low_ones() {
        let f = llama31().factors(500_000.0, 128);
        assert_eq!(f.len(), 64);
        // Wavelengths below 2048 kept, above 8192 divided by 8, blended between.
        let wavelength = |i: usize| 2.0 * std::f64::consts::PI * 500_000f64.powf(i as f64 / 64.0);
        for (i, &x) in f.iter().enumerate() {
            let w = wavelength(i);
            if w < 2048.0 {
                assert_eq!(x, 1.0, "{i}");
            } else if w > 8192.0 {
                assert_eq!(x, 8.0, "{i}");
            } else {
                assert!(x > 1.0 && x < 8.0, "{i}: {x}");
            }
        }
        assert!(f.windows(2).all(|w| w[0] <= w[1]), "{f:?}");
    }

    fn llama(rope_scaling: serde_json::Value) -> Result<ModelConfig> {
        ModelConfig::from_hf_json(&serde_json::json!({
            "model_type": "llama", "hidden_size": 64, "num_attention_heads": 4,
            "num_hidden_layers": 2, "intermediate_size": 128, "vocab_size": 256,
            "max_position_embeddings": 1024, "rope_theta": 500000.0,
            "rope_scaling": rope_scaling,
        }))
    }

    #[test]
    fn plain_families_read_linear_llama3_and_yarn_scaling_and_refuse_the_rest() {
        let c = llama(serde_json::Value::Null).unwrap();
        assert_eq!((c.rope_scale, c.rope_factors.is_none()), (1.0, true));
        let c = llama(serde_json::json!({"type": "linear", "factor": 4.0})).unwrap();
        assert_eq!(c.rope_scale, 4.0);
        assert_eq!(
            ModelConfig::from_hf_json(&c.to_hf_json(false))
                .unwrap()
                .rope_scale,
            4.0
        );
        let c = llama(serde_json::json!({"rope_type": "llama3", "factor": 8.0,
            "low_freq_factor": 1.0, "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8192}))
        .unwrap();
        assert_eq!(c.rope_factors, Some(llama31().factors(500_000.0, 16)));
        // Global layers' frequencies are divided by the factors.
        let plain = c.global_attention().inverse_frequencies(16);
        let scaled = c.inverse_frequencies(&c.global_attention());
        assert_eq!(scaled[0], plain[0]);
        assert_eq!(scaled[7], plain[7] / 8.0);
        // YaRN: its frequencies, and the scores scaled by its factor squared.
        let c = llama(serde_json::json!({"rope_type": "yarn", "factor": 4.0,
            "original_max_position_embeddings": 256}))
        .unwrap();
        let yarn = c.yarn.unwrap();
        assert_eq!((yarn.original_context, yarn.truncate), (256, true));
        let back = ModelConfig::from_hf_json(&c.to_hf_json(false)).unwrap();
        assert_eq!(
            (back.yarn, back.attention_scale),
            (c.yarn, c.attention_scale)
        );
        let f = 0.1 * 4f32.ln() + 1.0;
        assert!(
            (c.attention_scale - f * f / 4.0).abs() < 1e-6,
            "{}",
            c.attention_scale
        );
        for (bad, says) in [
            (
                serde_json::json!({"rope_type": "longrope", "factor": 4.0}),
                "\"longrope\" is not supported for llama",
            ),
            (
                serde_json::json!({"rope_type": "dynamic", "factor": 2.0}),
                "\"dynamic\"",
            ),
            (
                serde_json::json!({"rope_type": "llama3", "factor": 8.0}),
                "low_freq_factor",
            ),
            (
                serde_json::json!({"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 4.0,
                "high_freq_factor": 1.0, "original_max_position_embeddings": 8192}),
                "above",
            ),
        ] {
            let e = llama(bad).unwrap_err().to_string();
            assert!(e.contains(says), "{e}");
        }
    }
}
