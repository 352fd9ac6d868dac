//! gpt-oss: what its `config.json` says beyond the common numbers —
//! sliding-window layers alternating with global ones, YaRN-scaled RoPE on
//! every layer, and routed experts with biases (their routing is read in
//! `moe.rs`).
//!
//! ```text
//!  layer:   0   [1]   2   [3]  …        sliding (window 128) / [global]
//!  RoPE:    YaRN on every layer: frequencies blended between the trained
//!           ones and ones slowed by `factor`, scores × attention factor²
//! ```

use super::gemma::{layer_pattern, positive, rope_scaling_kind};
use super::{ModelConfig, SlidingWindow, hf_bad, hf_float, hf_int};
use crate::error::Result;
use crate::gguf::GgufHeader;

/// YaRN ("Yet another RoPE extension"): each RoPE frequency is blended
/// between its trained value (fast rotations, kept) and the value slowed
/// down by `factor` (slow rotations, interpolated), with a linear ramp
/// between the dimensions that make `beta_fast` and `beta_slow` turns over
/// the original context; queries and keys are scaled by `attention_factor`.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Yarn {
    /// How much longer the context is than the one trained on.
    pub factor: f32,
    /// The context length the model was first trained with.
    pub original_context: usize,
    /// Rotations over the original context above which a frequency is kept.
    pub beta_fast: f32,
    /// Rotations below which a frequency is fully interpolated.
    pub beta_slow: f32,
    /// Whether the ramp's ends are rounded to whole dimensions (Hugging
    /// Face's default; gpt-oss says `false`).
    pub truncate: bool,
    /// Factor queries and keys are multiplied by.
    pub attention_factor: f32,
}

impl Yarn {
    /// Reads a `rope_scaling` entry of type `yarn`.
    pub(super) fn from_hf(v: &serde_json::Value, context_length: usize) -> Result<Self> {
        let number = |key: &str, default: f64| -> Result<f64> {
            match v.get(key) {
                None | Some(serde_json::Value::Null) => Ok(default),
                Some(x) => x
                    .as_f64()
                    .ok_or_else(|| hf_bad(&format!("rope_scaling.{key}"), "expected a number")),
            }
        };
        let factor = positive(
            "config.json rope_scaling.factor",
            number("factor", f64::NAN)?,
        )?;
        let original = match v.get("original_max_position_embeddings") {
            None | Some(serde_json::Value::Null) => context_length,
            Some(_) => hf_int(v, "original_max_position_embeddings")?,
        };
        let beta_fast = positive(
            "config.json rope_scaling.beta_fast",
            number("beta_fast", 32.0)?,
        )?;
        let beta_slow = positive(
            "config.json rope_scaling.beta_slow",
            number("beta_slow", 1.0)?,
        )?;
        if original == 0 || beta_slow >= beta_fast {
            return Err(hf_bad(
                "rope_scaling",
                "YaRN needs an original context and beta_fast above beta_slow",
            ));
        }
        // As Hugging Face computes it: an explicit factor, else the ratio of
        // the two mscales when both are given, else 0.1 ln(factor) + 1.
        let mscale = |m: f64| {
            if factor <= 1.0 {
                1.0
            } else {
                0.1 * m * factor.ln() + 1.0
            }
        };
        let attention_factor = match (v.get("mscale"), v.get("mscale_all_dim")) {
            _ if v.get("attention_factor").is_some_and(|a| !a.is_null()) => {
                number("attention_factor", 1.0)?
            }
            (Some(m), Some(all)) if !m.is_null() && !all.is_null() => {
                mscale(number("mscale", 1.0)?) / mscale(number("mscale_all_dim", 0.0)?)
            }
            _ => mscale(1.0),
        };
        Ok(Yarn {
            factor: factor as f32,
            original_context: original,
            beta_fast: beta_fast as f32,
            beta_slow: beta_slow as f32,
            truncate: v
                .get("truncate")
                .and_then(serde_json::Value::as_bool)
                .unwrap_or(true),
            attention_factor: positive(
                "config.json rope_scaling.attention_factor",
                attention_factor,
            )? as f32,
        })
    }

    /// Reads GGUF's YaRN keys (`key` makes the architecture's keys): the
    /// factor, the original context (else `context_length`), and the betas
    /// when given. GGUF has no `truncate`: llama.cpp rounds the ramp.
    pub(super) fn from_gguf(
        header: &GgufHeader,
        key: &dyn Fn(&str) -> String,
        context_length: usize,
    ) -> Result<Self> {
        let number = |k: &str, default: f32| -> Result<f64> {
            match header.get(&key(k)) {
                Err(_) => Ok(f64::from(default)),
                Ok(_) => Ok(f64::from(header.get_f32(&key(k))?)),
            }
        };
        let factor = positive(
            &key("rope.scaling.factor"),
            number("rope.scaling.factor", f32::NAN)?,
        )?;
        let original = match header.get_u32(&key("rope.scaling.original_context_length")) {
            Ok(n) if n > 0 => n as usize,
            _ => context_length,
        };
        let beta_fast = positive(
            &key("rope.scaling.yarn_beta_fast"),
            number("rope.scaling.yarn_beta_fast", 32.0)?,
        )?;
        let beta_slow = positive(
            &key("rope.scaling.yarn_beta_slow"),
            number("rope.scaling.yarn_beta_slow", 1.0)?,
        )?;
        if beta_slow >= beta_fast {
            return Err(crate::error::Error::metadata(
                key("rope.scaling.yarn_beta_fast"),
                "YaRN needs beta_fast above beta_slow",
            ));
        }
        Ok(Yarn {
            factor: factor as f32,
            original_context: original,
            beta_fast: beta_fast as f32,
            beta_slow: beta_slow as f32,
            truncate: true,
            attention_factor: if factor <= 1.0 {
                1.0
            } else {
                (0.1 * factor.ln() + 1.0) as f32
            },
        })
    }

    /// Makes `config` use this scaling: its frequencies on every layer, and
    /// queries and keys scaled by the attention factor (so the scores by
    /// its square).
    pub(super) fn apply(self, config: &mut ModelConfig) {
        config.attention_scale *= self.attention_factor * self.attention_factor;
        config.yarn = Some(self);
    }

    /// The inverse frequencies of a head of `head_dim` with RoPE base `theta`.
    pub fn inverse_frequencies(&self, theta: f32, head_dim: usize) -> Vec<f32> {
        let (theta, dims) = (f64::from(theta), head_dim as f64);
        let turns = |rotations: f64| {
            dims * (self.original_context as f64 / (rotations * 2.0 * std::f64::consts::PI)).ln()
                / (2.0 * theta.ln())
        };
        let (mut low, mut high) = (
            turns(f64::from(self.beta_fast)),
            turns(f64::from(self.beta_slow)),
        );
        if self.truncate {
            (low, high) = (low.floor(), high.ceil());
        }
        let (low, mut high) = (low.max(0.0), high.min(dims - 1.0));
        if low == high {
            high += 0.001;
        }
        (0..head_dim / 2)
            .map(|i| {
                let kept = 1.0 / theta.powf(2.0 * i as f64 / dims);
                let slowed = kept / f64::from(self.factor);
                let ramp = ((i as f64 - low) / (high - low)).clamp(0.0, 1.0);
                (slowed * ramp + kept * (1.0 - ramp)) as f32
            })
            .collect()
    }

    /// The `rope_scaling` entry that reads back as this.
    pub(super) fn to_hf_json(self) -> serde_json::Value {
        serde_json::json!({
            "rope_type": "yarn",
            "factor": self.factor,
            "original_max_position_embeddings": self.original_context,
            "beta_fast": self.beta_fast,
            "beta_slow": self.beta_slow,
            "truncate": self.truncate,
            "attention_factor": self.attention_factor,
        })
    }
}

/// Reads what gpt-oss's GGUF metadata says beyond the common numbers
/// (`key` makes the architecture's keys): the sliding window, with sliding
/// and global layers in turn from the first (as llama.cpp fixes them), and
/// YaRN.
pub(super) fn from_gguf(
    config: &mut ModelConfig,
    header: &GgufHeader,
    key: &dyn Fn(&str) -> String,
) -> Result<()> {
    let window = header.get_u32(&key("attention.sliding_window"))? as usize;
    if window > 0 {
        config.sliding = Some(SlidingWindow {
            window,
            pattern: 2,
            rope_theta: config.rope_theta,
        });
    }
    match header.get_str(&key("rope.scaling.type")) {
        Err(_) | Ok("none") => {}
        Ok("yarn") => Yarn::from_gguf(header, key, config.context_length)?.apply(config),
        Ok(other) => {
            return Err(crate::error::Error::metadata(
                key("rope.scaling.type"),
                format!("RoPE scaling {other:?} is not supported for gpt-oss (yarn is)"),
            ));
        }
    }
    Ok(())
}

/// Reads gpt-oss's `config.json` keys into `config`.
pub(super) fn from_hf(config: &mut ModelConfig, v: &serde_json::Value) -> Result<()> {
    // Defaults as mlx-lm's gpt-oss arguments have them.
    config.rope_theta = hf_float(v, "rope_theta", 150_000.0)? as f32;
    let window = match v.get("sliding_window") {
        None | Some(serde_json::Value::Null) => 128,
        Some(_) => hf_int(v, "sliding_window")?,
    };
    let pattern = match v.get("layer_types") {
        None | Some(serde_json::Value::Null) => 2,
        Some(types) => layer_pattern(types, config.layers)?,
    };
    // mlx-lm and Hugging Face fix the activation's constants; a checkpoint
    // that names others is a different model.
    if let Some(limit) = v.get("swiglu_limit").filter(|l| !l.is_null())
        && limit.as_f64() != Some(7.0)
    {
        return Err(hf_bad(
            "swiglu_limit",
            &format!("{limit} is not supported (gpt-oss's 7.0 is)"),
        ));
    }
    if window > 0 && pattern > 1 {
        config.sliding = Some(SlidingWindow {
            window,
            pattern,
            rope_theta: config.rope_theta,
        });
    }
    match rope_scaling_kind(v.get("rope_scaling")) {
        None | Some(("default", _)) => {}
        Some(("yarn", s)) => Yarn::from_hf(s, config.context_length)?.apply(config),
        Some((other, _)) => {
            return Err(hf_bad(
                "rope_scaling",
                &format!("RoPE scaling {other:?} is not supported for gpt-oss (yarn is)"),
            ));
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::Architecture;

    /// gpt-oss-20b's configuration, as published.
    fn gpt_oss_20b() -> serde_json::Value {
        let types: Vec<&str> = (0..24)
            .map(|i| {
                if i % 2 == 0 {
                    "sliding_attention"
                } else {
                    "full_attention"
                }
            })
            .collect();
        serde_json::json!({
            "architectures": ["GptOssForCausalLM"],
            "model_type": "gpt_oss",
            "hidden_size": 2880,
            "intermediate_size": 2880,
            "head_dim": 64,
            "num_attention_heads": 64,
            "num_key_value_heads": 8,
            "num_hidden_layers": 24,
            "num_local_experts": 32,
            "num_experts_per_tok": 4,
            "experts_per_token": 4,
            "layer_types": types,
            "max_position_embeddings": 131072,
            "rms_norm_eps": 1e-5,
            "rope_scaling": {
                "beta_fast": 32.0, "beta_slow": 1.0, "factor": 32.0,
                "original_max_position_embeddings": 4096, "rope_type": "yarn", "truncate": false
            },
            "rope_theta": 150000,
            "sliding_window": 128,
            "swiglu_limit": 7.0,
            "vocab_size": 201088
        })
    }

    #[test]
    fn gpt_oss_alternates_sliding_and_global_layers_with_yarn_everywhere() {
        let c = ModelConfig::from_hf_json(&gpt_oss_20b()).unwrap();
        assert_eq!(c.architecture, Architecture::GptOss);
        let (sliding, global) = (c.layer_attention(0), c.layer_attention(1));
        assert_eq!(sliding.window, Some(128));
        assert_eq!(global.window, None);
        assert_eq!(c.layer_attention(22).window, Some(128));
        assert_eq!(sliding.rope_theta, 150_000.0);
        let yarn = c.yarn.unwrap();
        assert_eq!(sliding.yarn, Some(yarn));
        assert_eq!(global.yarn, Some(yarn));
        assert!(!yarn.truncate);
        assert!((yarn.attention_factor - (0.1 * 32f32.ln() + 1.0)).abs() < 1e-6);
        let moe = c.moe.clone().unwrap();
        assert_eq!((moe.experts, moe.experts_per_token), (32, 4));
        assert_eq!(moe.expert_intermediate_size, 2880);
        assert!(moe.normalize && moe.bias);
        let back = ModelConfig::from_hf_json(&c.to_hf_json(false)).unwrap();
        assert_eq!(back, c);
    }

    /// YaRN as Hugging Face defines it: the fastest frequencies kept, the
    /// slowest divided by the factor, a linear blend between.
    #[test]
    fn yarn_keeps_fast_frequencies_and_slows_the_slow_ones() {
        let yarn = Yarn {
            factor: 32.0,
            original_context: 4096,
            beta_fast: 32.0,
            beta_slow: 1.0,
            truncate: true,
            attention_factor: 1.0,
        };
        let (theta, dims) = (150_000f32, 64);
        let inv = yarn.inverse_frequencies(theta, dims);
        let plain = |i: usize| 1.0 / theta.powf(2.0 * i as f32 / dims as f32);
        // The ramp runs from dimension 8 to 18 (floor of 8.09, ceil of 17.40).
        for (i, &f) in inv.iter().enumerate() {
            let want = match i {
                0..=8 => plain(i),
                18.. => plain(i) / 32.0,
                _ => continue,
            };
            assert!((f - want).abs() <= 1e-6 * plain(i), "{i}");
        }
        let ramp = 0.5;
        let mid = plain(13) / 32.0 * ramp + plain(13) * (1.0 - ramp);
        assert!((inv[13] - mid).abs() <= 1e-6 * plain(13));
        // Without truncation the ends stay fractional.
        let exact = Yarn {
            truncate: false,
            ..yarn
        }
        .inverse_frequencies(theta, dims);
        assert!(exact[9] > inv[9] && exact[17] < inv[17]);
    }

    #[test]
    fn gpt_oss_configurations_it_cannot_run_name_themselves() {
        let refused = |edit: &dyn Fn(&mut serde_json::Value)| {
            let mut v = gpt_oss_20b();
            edit(&mut v);
            ModelConfig::from_hf_json(&v).unwrap_err().to_string()
        };
        let e = refused(&|v| v["rope_scaling"]["rope_type"] = "longrope".into());
        assert!(
            e.contains("\"longrope\" is not supported for gpt-oss"),
            "{e}"
        );
        let e = refused(&|v| v["rope_scaling"]["factor"] = (-2.0).into());
        assert!(e.contains("not a positive number"), "{e}");
        let e = refused(&|v| v["num_experts_per_tok"] = 33.into());
        assert!(e.contains("33 experts per token, but only 32"), "{e}");
        let e = refused(&|v| v["swiglu_limit"] = 8.0.into());
        assert!(e.contains("swiglu_limit"), "{e}");
    }
}
