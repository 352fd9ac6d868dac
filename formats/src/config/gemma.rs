//! Gemma 3 (text): what its GGUF metadata and its `config.json` say beyond
//! the common numbers — sliding-window layers with their own RoPE base, the
//! attention scale, scaled embeddings, linear RoPE scaling of global layers.
//!
//! ```text
//!  layer:  0  1  2  3  4  [5]  6  7  8  9  10  [11] …   (pattern 6)
//!          sliding, base 10k  global: base 1M, scaled positions
//! ```

use super::{ModelConfig, SlidingWindow, hf_bad, hf_float, hf_int};
use crate::error::{Error, Result};
use crate::gguf::GgufHeader;

/// Reads Gemma 3's GGUF keys (`key` prefixes the architecture) into `config`.
pub(super) fn from_gguf(
    config: &mut ModelConfig,
    header: &GgufHeader,
    key: &dyn Fn(&str) -> String,
) -> Result<()> {
    // As llama.cpp reads Gemma 3: every sixth layer is global, the
    // others slide with RoPE base 10000; the attention scale follows
    // the head size except on the 62-layer (27B) model.
    config.embedding_scale = (config.hidden_size as f32).sqrt();
    if config.layers == 62 {
        config.attention_scale = 1.0 / ((config.hidden_size / config.heads) as f32).sqrt();
    }
    if let Ok(window) = header.get_u32(&key("attention.sliding_window"))
        && window > 0
    {
        config.sliding = Some(SlidingWindow {
            window: window as usize,
            pattern: 6,
            rope_theta: 10_000.0,
        });
    }
    match header.get_str(&key("rope.scaling.type")) {
        Err(_) | Ok("none") => {}
        Ok("linear") => {
            let factor = header.get_f32(&key("rope.scaling.factor"))?;
            config.rope_scale = positive(&key("rope.scaling.factor"), factor as f64)? as f32;
        }
        Ok(other) => {
            return Err(Error::metadata(
                key("rope.scaling.type"),
                format!("RoPE scaling {other:?} is not supported (linear is)"),
            ));
        }
    }
    if let Ok(cap) = header.get_f32(&key("final_logit_softcapping"))
        && cap != 0.0
    {
        return Err(Error::metadata(
            key("final_logit_softcapping"),
            "final logit soft-capping is not supported",
        ));
    }
    Ok(())
}

/// Reads Gemma 3's `config.json` keys into `config`.
pub(super) fn from_hf(config: &mut ModelConfig, v: &serde_json::Value) -> Result<()> {
    // Defaults as Hugging Face's Gemma3TextConfig has them.
    config.rope_theta = hf_float(v, "rope_theta", 1_000_000.0)? as f32;
    config.rms_eps = hf_float(v, "rms_norm_eps", 1e-6)?;
    let scalar = positive(
        "query_pre_attn_scalar",
        hf_float(v, "query_pre_attn_scalar", 256.0)?,
    )?;
    config.attention_scale = (1.0 / scalar.sqrt()) as f32;
    // Hugging Face and mlx-lm multiply in bfloat16: sqrt(hidden) rounded.
    config.embedding_scale = round_to_bf16((config.hidden_size as f32).sqrt());
    let window = match v.get("sliding_window") {
        None | Some(serde_json::Value::Null) => 4096,
        Some(_) => hf_int(v, "sliding_window")?,
    };
    let pattern = match v.get("layer_types") {
        Some(types) => layer_pattern(types, config.layers)?,
        None => match v.get("sliding_window_pattern") {
            None | Some(serde_json::Value::Null) => 6,
            Some(_) => hf_int(v, "sliding_window_pattern")?,
        },
    };
    if window > 0 && pattern > 1 {
        config.sliding = Some(SlidingWindow {
            window,
            pattern,
            rope_theta: hf_float(v, "rope_local_base_freq", 10_000.0)? as f32,
        });
    }
    config.rope_scale = hf_rope_scaling(v.get("rope_scaling"))?;
    if let Some(cap) = v.get("final_logit_softcapping").and_then(|c| c.as_f64())
        && cap != 0.0
    {
        return Err(hf_bad(
            "final_logit_softcapping",
            "final logit soft-capping is not supported",
        ));
    }
    Ok(())
}

/// A positive, finite number or an error naming `what`.
pub(super) fn positive(what: &str, x: f64) -> Result<f64> {
    if x.is_finite() && x > 0.0 {
        Ok(x)
    } else {
        Err(Error::metadata(
            what,
            format!("{x} is not a positive number"),
        ))
    }
}

/// `x` rounded to the nearest bfloat16 (ties to even), as an f32.
fn round_to_bf16(x: f32) -> f32 {
    let bits = x.to_bits();
    let rounded = bits.wrapping_add(0x7fff + ((bits >> 16) & 1)) & 0xffff_0000;
    f32::from_bits(rounded)
}

/// The period of Gemma's `layer_types` (`sliding_attention` layers with a
/// `full_attention` one every `pattern` layers).
pub(super) fn layer_pattern(types: &serde_json::Value, layers: usize) -> Result<usize> {
    let bad = |detail: String| Error::metadata("config.json layer_types", detail);
    let types = types
        .as_array()
        .ok_or_else(|| bad("expected a list".into()))?;
    let global = types
        .iter()
        .map(|t| match t.as_str() {
            Some("full_attention") => Ok(true),
            Some("sliding_attention") => Ok(false),
            _ => Err(bad(format!(
                "{t} is neither full_attention nor sliding_attention"
            ))),
        })
        .collect::<Result<Vec<bool>>>()?;
    if global.len() != layers {
        return Err(bad(format!("{} entries for {layers} layers", global.len())));
    }
    let pattern = global.iter().position(|&g| g).map_or(layers + 1, |i| i + 1);
    if global
        .iter()
        .enumerate()
        .any(|(i, &g)| g != (i + 1).is_multiple_of(pattern))
    {
        return Err(bad(format!(
            "global layers are not every {pattern}th: only a repeating pattern is supported"
        )));
    }
    Ok(pattern)
}

/// A `rope_scaling` entry that is there and not null, with its type
/// (`rope_type`, or the older `type`; `default` when it names none).
pub(super) fn rope_scaling_kind(
    v: Option<&serde_json::Value>,
) -> Option<(&str, &serde_json::Value)> {
    let v = v.filter(|v| !v.is_null())?;
    let kind = v
        .get("rope_type")
        .or_else(|| v.get("type"))
        .and_then(|t| t.as_str())
        .unwrap_or("default");
    Some((kind, v))
}

/// The linear factor of a `rope_scaling` entry (1 when there is none).
fn hf_rope_scaling(v: Option<&serde_json::Value>) -> Result<f32> {
    let bad = |detail: String| Error::metadata("config.json rope_scaling", detail);
    let Some((kind, v)) = rope_scaling_kind(v) else {
        return Ok(1.0);
    };
    match kind {
        "default" => Ok(1.0),
        "linear" => {
            let factor = v.get("factor").and_then(|f| f.as_f64()).unwrap_or(f64::NAN);
            Ok(positive("config.json rope_scaling.factor", factor)? as f32)
        }
        other => Err(bad(format!(
            "RoPE scaling {other:?} is not supported (linear is)"
        ))),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::Architecture;

    /// Gemma 3 1B's text configuration, as published.
    fn gemma3_1b() -> serde_json::Value {
        serde_json::json!({
            "architectures": ["Gemma3ForCausalLM"],
            "model_type": "gemma3_text",
            "hidden_size": 1152,
            "intermediate_size": 6912,
            "num_attention_heads": 4,
            "num_hidden_layers": 26,
            "num_key_value_heads": 1,
            "head_dim": 256,
            "max_position_embeddings": 32768,
            "query_pre_attn_scalar": 256,
            "rms_norm_eps": 1e-6,
            "rope_local_base_freq": 10000,
            "rope_scaling": null,
            "rope_theta": 1000000,
            "sliding_window": 512,
            "sliding_window_pattern": 6,
            "final_logit_softcapping": null,
            "vocab_size": 262144
        })
    }

    #[test]
    fn gemma3_layers_slide_between_global_ones() {
        let c = ModelConfig::from_hf_json(&gemma3_1b()).unwrap();
        assert_eq!(c.architecture, Architecture::Gemma3);
        assert_eq!(c.attention_scale, 1.0 / 16.0);
        // sqrt(1152) = 33.94 is 34 in bfloat16.
        assert_eq!(c.embedding_scale, 34.0);
        let sliding = c.layer_attention(4);
        assert_eq!((sliding.window, sliding.rope_theta), (Some(512), 10_000.0));
        let global = c.layer_attention(5);
        assert_eq!((global.window, global.rope_theta), (None, 1_000_000.0));
        assert_eq!(c.layer_attention(11).window, None);
        assert_eq!(c.layer_attention(12).window, Some(512));
        // What to_hf_json writes reads back the same.
        let back = ModelConfig::from_hf_json(&c.to_hf_json(true)).unwrap();
        assert_eq!(back.sliding, c.sliding);
        assert_eq!(back.attention_scale, c.attention_scale);
    }

    #[test]
    fn gemma3_layer_types_and_linear_scaling_are_read() {
        let mut v = gemma3_1b();
        let types: Vec<&str> = (0..26)
            .map(|i| {
                if (i + 1_usize).is_multiple_of(6) {
                    "full_attention"
                } else {
                    "sliding_attention"
                }
            })
            .collect();
        v["layer_types"] = serde_json::json!(types);
        v["sliding_window_pattern"] = serde_json::Value::Null;
        v["rope_scaling"] = serde_json::json!({"rope_type": "linear", "factor": 8.0});
        let c = ModelConfig::from_hf_json(&v).unwrap();
        assert_eq!(c.sliding.unwrap().pattern, 6);
        assert_eq!(c.layer_attention(5).rope_scale, 8.0);
        assert_eq!(c.layer_attention(4).rope_scale, 1.0);
    }

    #[test]
    fn gemma3_configurations_it_cannot_run_name_themselves() {
        let refused = |edit: &dyn Fn(&mut serde_json::Value)| {
            let mut v = gemma3_1b();
            edit(&mut v);
            ModelConfig::from_hf_json(&v).unwrap_err().to_string()
        };
        let e = refused(&|v| v["model_type"] = "gemma3".into());
        assert!(e.contains("gemma3_text"), "{e}");
        let e = refused(&|v| v["final_logit_softcapping"] = 30.0.into());
        assert!(e.contains("soft-capping"), "{e}");
        let e =
            refused(&|v| v["rope_scaling"] = serde_json::json!({"rope_type": "yarn", "factor": 4}));
        assert!(e.contains("\"yarn\" is not supported (linear is)"), "{e}");
        let e = refused(&|v| v["query_pre_attn_scalar"] = (-1.0).into());
        assert!(e.contains("not a positive number"), "{e}");
        let e = refused(&|v| {
            let mut types = vec!["sliding_attention"; 26];
            types[3] = "full_attention";
            types[5] = "full_attention";
            v["layer_types"] = serde_json::json!(types);
        });
        assert!(e.contains("only a repeating pattern"), "{e}");
        let e = refused(&|v| v["layer_types"] = serde_json::json!(["sliding_attention"]));
        assert!(e.contains("1 entries for 26 layers"), "{e}");
    }
}
