//! DeepSeek V2, V3 and Kimi K2 (`deepseek_v2`, `deepseek_v3`, `kimi_k2` in
//! `config.json`; `deepseek2` in GGUF): multi-head latent attention, and
//! experts beside shared experts after a few dense layers, chosen by
//! sigmoid scores within the best groups (V3, K2) or by softmax, greedily
//! or within the groups of the best experts (V2).
//!
//! ```text
//!  x ─► q: q_b(norm(q_a x)) (or q_proj x) ─► per head [nope │ rope]
//!  x ─► kv_a x ─► [latent (kv_lora_rank) │ k_rope] ─► norm(latent)
//!  cache per token and layer: [latent │ RoPE'd k_rope]  (one row for all heads)
//!  score_h = scale · ( (W_k,h q_nope,h) · latent + RoPE(q_rope,h) · k_rope )
//!  out_h   = W_v,h Σ softmax · latent         ─► o_proj
//! ```
//!
//! The cache holds the compressed latent, not per-head keys and values: a
//! token costs `kv_lora_rank + qk_rope_head_dim` floats per layer (576 for
//! DeepSeek V3, against 128 heads × 320 uncompressed).

use super::moe::{Moe, Routing};
use super::{ModelConfig, Yarn, hf_bad, hf_float, hf_int};
use crate::error::{Error, Result};
use crate::gguf::GgufHeader;

/// The widest rank or head dimension latent attention may claim (DeepSeek
/// V3's widest is 1536).
const MAX_LATENT_WIDTH: usize = 1 << 16;

/// Multi-head latent attention's widths.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LatentAttention {
    /// Rank of the query's low-rank projection, or `None` for a plain
    /// query projection (DeepSeek V2 Lite).
    pub q_lora_rank: Option<usize>,
    /// Width of the compressed key/value latent.
    pub kv_lora_rank: usize,
    /// Per-head query/key dimensions without RoPE.
    pub nope_dim: usize,
    /// Per-head query/key dimensions with RoPE (shared by all heads on the
    /// key side).
    pub rope_dim: usize,
    /// Per-head value dimension.
    pub value_dim: usize,
}

impl LatentAttention {
    /// Epsilon of the query's and the latent's RMS norms (fixed by the
    /// family, whatever `rms_norm_eps` says).
    pub const NORM_EPS: f32 = 1e-6;

    /// A query head's width: `nope_dim + rope_dim`.
    pub fn query_dim(&self) -> usize {
        self.nope_dim + self.rope_dim
    }

    /// Floats one token keeps in one layer's cache: the latent and the
    /// rotated key part.
    pub fn cache_width(&self) -> usize {
        self.kv_lora_rank + self.rope_dim
    }
}

/// Reads the attention and RoPE of a DeepSeek V3 `config.json` into `config`
/// (whose `head_dim` becomes the rotated width, what RoPE tables need).
pub(super) fn from_hf(config: &mut ModelConfig, v: &serde_json::Value) -> Result<()> {
    let q_lora_rank = match v.get("q_lora_rank") {
        None | Some(serde_json::Value::Null) => None,
        Some(_) => Some(hf_int(v, "q_lora_rank")?),
    };
    let latent = LatentAttention {
        q_lora_rank,
        kv_lora_rank: hf_int(v, "kv_lora_rank")?,
        nope_dim: hf_int(v, "qk_nope_head_dim")?,
        rope_dim: hf_int(v, "qk_rope_head_dim")?,
        value_dim: hf_int(v, "v_head_dim")?,
    };
    if v.get("attention_bias").and_then(serde_json::Value::as_bool) == Some(true) {
        return Err(hf_bad(
            "attention_bias",
            "latent attention with biases is not supported",
        ));
    }
    let mut scale_squared = 1.0;
    match v.get("rope_scaling") {
        None | Some(serde_json::Value::Null) => {}
        Some(scaling) => {
            let kind = scaling
                .get("type")
                .or_else(|| scaling.get("rope_type"))
                .and_then(serde_json::Value::as_str)
                .unwrap_or("default");
            match kind {
                "default" => {}
                "yarn" | "deepseek_yarn" => {
                    let yarn = Yarn::from_hf(scaling, config.context_length)?;
                    // The rotated parts would be scaled apart from the rest.
                    if (yarn.attention_factor - 1.0).abs() > 1e-6 {
                        return Err(hf_bad(
                            "rope_scaling",
                            "YaRN whose mscale differs from mscale_all_dim is not supported \
                             with latent attention",
                        ));
                    }
                    let all_dims = hf_float(scaling, "mscale_all_dim", 0.0)?;
                    if all_dims != 0.0 && yarn.factor > 1.0 {
                        let m = 0.1 * all_dims * f64::from(yarn.factor).ln() + 1.0;
                        scale_squared = m * m;
                    }
                    config.yarn = Some(yarn);
                }
                other => {
                    return Err(hf_bad(
                        "rope_scaling",
                        &format!(
                            "RoPE scaling {other:?} is not supported for deepseek_v3 (yarn is)"
                        ),
                    ));
                }
            }
        }
    }
    apply(config, latent, scale_squared)
}

/// Reads the attention and RoPE of a DeepSeek V3 GGUF (`deepseek2`, as
/// llama.cpp's converter writes it: one KV head of latent and rotated part,
/// the per-head widths in `key_length_mla` and `value_length_mla`) into
/// `config`.
pub(super) fn from_gguf(
    config: &mut ModelConfig,
    header: &GgufHeader,
    key: &dyn Fn(&str) -> String,
) -> Result<()> {
    let optional = |k: &str| header.get(&key(k)).ok().map(|_| header.get_u32(&key(k)));
    let rope_dim = header.get_u32(&key("rope.dimension_count"))? as usize;
    let kv_lora_rank = header.get_u32(&key("attention.kv_lora_rank"))? as usize;
    if optional("attention.key_length_mla").is_none() {
        return Err(Error::metadata(
            key("attention.key_length_mla"),
            "a deepseek2 file from before llama.cpp split kv_b for latent attention; \
             convert the model again with a current llama.cpp",
        ));
    }
    if header.get_u32(&key("nextn_predict_layers")).unwrap_or(0) > 0 {
        return Err(Error::metadata(
            key("nextn_predict_layers"),
            "multi-token prediction layers counted in block_count are not supported; \
             convert without them",
        ));
    }
    let query_dim = header.get_u32(&key("attention.key_length_mla"))? as usize;
    let latent = LatentAttention {
        q_lora_rank: optional("attention.q_lora_rank")
            .transpose()?
            .map(|r| r as usize),
        kv_lora_rank,
        nope_dim: query_dim.saturating_sub(rope_dim),
        rope_dim,
        value_dim: header.get_u32(&key("attention.value_length_mla"))? as usize,
    };
    let mut scale_squared = 1.0;
    match header.get_str(&key("rope.scaling.type")) {
        Err(_) | Ok("none") => {}
        Ok("yarn") => {
            let mut yarn = Yarn::from_gguf(header, key, config.context_length)?;
            // llama.cpp's deepseek2 scales the rotated parts by 1; the
            // scores by mscale² with mscale = 1 + log_mul · ln factor.
            yarn.attention_factor = 1.0;
            let log_mul = match header.get(&key("rope.scaling.yarn_log_multiplier")) {
                Ok(_) => f64::from(header.get_f32(&key("rope.scaling.yarn_log_multiplier"))?),
                Err(_) => 0.0,
            };
            if yarn.factor > 1.0 {
                let m = 1.0 + log_mul * f64::from(yarn.factor).ln();
                scale_squared = m * m;
            }
            config.yarn = Some(yarn);
        }
        Ok(other) => {
            return Err(Error::metadata(
                key("rope.scaling.type"),
                format!("RoPE scaling {other:?} is not supported for deepseek2 (yarn is)"),
            ));
        }
    }
    apply(config, latent, scale_squared)
}

/// Checks `latent`'s widths and sets them, with the score scale (times
/// `scale_squared`, YaRN's mscale squared), on `config`, whose `head_dim`
/// becomes the rotated width (what RoPE tables need).
fn apply(config: &mut ModelConfig, latent: LatentAttention, scale_squared: f64) -> Result<()> {
    let bad = |detail: &str| Error::metadata("latent attention", detail);
    let widths = [
        latent.kv_lora_rank,
        latent.nope_dim,
        latent.rope_dim,
        latent.value_dim,
        latent.q_lora_rank.unwrap_or(0),
    ];
    if widths.iter().any(|&w| w > MAX_LATENT_WIDTH) {
        return Err(bad(&format!(
            "kv_lora_rank, q_lora_rank or a head dimension above {MAX_LATENT_WIDTH} is implausible"
        )));
    }
    if latent.kv_lora_rank == 0
        || latent.nope_dim == 0
        || latent.value_dim == 0
        || latent.q_lora_rank == Some(0)
    {
        return Err(bad(
            "kv_lora_rank, q_lora_rank, qk_nope_head_dim and v_head_dim (their GGUF keys \
             likewise) must be above 0",
        ));
    }
    if latent.rope_dim == 0 || !latent.rope_dim.is_multiple_of(2) {
        return Err(bad(
            "qk_rope_head_dim (GGUF rope.dimension_count) must be even and above 0",
        ));
    }
    config.head_dim = latent.rope_dim;
    config.kv_heads = config.heads;
    config.attention_scale = (scale_squared / (latent.query_dim() as f64).sqrt()) as f32;
    config.latent = Some(latent);
    Ok(())
}

/// Reads the experts of a DeepSeek V3 GGUF, or `None` when it has none. A
/// layer is routed when it has a router tensor.
pub(super) fn moe_from_gguf(
    config: &ModelConfig,
    header: &GgufHeader,
    key: &dyn Fn(&str) -> String,
) -> Result<Option<Moe>> {
    let experts = header.get_u32(&key("expert_count")).unwrap_or(0) as usize;
    if experts == 0 {
        return Ok(None);
    }
    let number = |k: &str, default: u32| -> Result<usize> {
        match header.get(&key(k)) {
            Ok(_) => Ok(header.get_u32(&key(k))? as usize),
            Err(_) => Ok(default as usize),
        }
    };
    // 2 (sigmoid) for DeepSeek V3 and Kimi K2; 1 (softmax) or absent for
    // DeepSeek V2, whose older files llama.cpp reads as softmax.
    let sigmoid = match number("expert_gating_func", 1)? {
        1 => false,
        2 => true,
        func => {
            return Err(Error::metadata(
                key("expert_gating_func"),
                format!(
                    "gating function {func} is not supported for deepseek2 (1, softmax, as \
                     DeepSeek V2 routes, and 2, sigmoid, as DeepSeek V3 and Kimi K2 do, are)"
                ),
            ));
        }
    };
    let (groups, top_groups) = (
        number("expert_group_count", 1)?,
        number("expert_group_used_count", 1)?,
    );
    // Softmax gating in deepseek2 is DeepSeek V2, whose groups are scored by
    // their best expert (llama.cpp scores every grouped router by its best
    // two, and so departs from V2's own routing where groups are set).
    let width = header.get_u32(&key("expert_feed_forward_length"))? as usize;
    let shared = number("expert_shared_count", 0)?;
    let normalize = match header.get(&key("expert_weights_norm")) {
        Ok(v) => v.as_bool().unwrap_or(false),
        Err(_) => false,
    };
    let scale = match header.get(&key("expert_weights_scale")) {
        Ok(_) => header.get_f32(&key("expert_weights_scale"))?,
        Err(_) => 1.0,
    };
    let router = |l: usize| format!("blk.{l}.ffn_gate_inp.weight");
    Moe {
        experts,
        experts_per_token: header.get_u32(&key("expert_used_count"))? as usize,
        expert_intermediate_size: width,
        normalize,
        dense_layers: (0..config.layers)
            .filter(|&l| !header.tensors.contains_key(&router(l)))
            .collect(),
        shared_expert: match shared {
            0 => None,
            n => Some(n.checked_mul(width).ok_or_else(|| {
                Error::metadata(key("expert_shared_count"), "shared experts too wide")
            })?),
        },
        shared_gate: false,
        bias: false,
        routing: match sigmoid {
            true => Routing::SigmoidGroups {
                groups,
                top_groups,
                scale,
            },
            false => Routing::SoftmaxGroups {
                groups,
                top_groups,
                scale,
            },
        },
    }
    .check(&key("expert_group_count"))
    .map(Some)
}

/// Reads the experts of a DeepSeek V3 `config.json`, or `None` when it has
/// none (`n_routed_experts` absent or null).
pub(super) fn moe(config: &ModelConfig, v: &serde_json::Value) -> Result<Option<Moe>> {
    if v.get("n_routed_experts")
        .is_none_or(serde_json::Value::is_null)
    {
        return Ok(None);
    }
    let text = |key: &str, default: &'static str| -> Result<String> {
        match v.get(key) {
            None | Some(serde_json::Value::Null) => Ok(default.to_string()),
            Some(x) => x
                .as_str()
                .map(str::to_string)
                .ok_or_else(|| hf_bad(key, "expected a string")),
        }
    };
    // DeepSeek V2 routes by softmax (greedy, or within the best groups);
    // V3 and Kimi K2 by sigmoid scores within groups, with a choice bias.
    let v2 = v.get("model_type").and_then(|t| t.as_str()) == Some("deepseek_v2");
    let scoring = text("scoring_func", if v2 { "softmax" } else { "sigmoid" })?;
    let method = text("topk_method", if v2 { "greedy" } else { "noaux_tc" })?;
    // Each family routes its own way only: V3's checkpoints hold a choice
    // bias that softmax routing would drop, V2's none that V3's needs.
    let sigmoid = match (v2, scoring.as_str(), method.as_str()) {
        (false, "sigmoid", "noaux_tc") => true,
        // mlx-lm's default spells it "gready".
        (true, "softmax", "greedy" | "gready" | "group_limited_greedy") => false,
        (_, "sigmoid" | "softmax", _) => {
            return Err(hf_bad(
                "topk_method",
                &format!(
                    "{method:?} with {scoring} scores is not how this family routes (DeepSeek V3 \
                     and Kimi K2: noaux_tc with sigmoid; DeepSeek V2: greedy or \
                     group_limited_greedy with softmax)"
                ),
            ));
        }
        _ => {
            return Err(hf_bad(
                "scoring_func",
                &format!("{scoring:?} is not supported (sigmoid and softmax are)"),
            ));
        }
    };
    let optional = |key: &str, default: usize| -> Result<usize> {
        match v.get(key) {
            None | Some(serde_json::Value::Null) => Ok(default),
            Some(_) => hf_int(v, key),
        }
    };
    let first_dense = optional("first_k_dense_replace", 0)?;
    let step = optional("moe_layer_freq", 1)?;
    if step == 0 {
        return Err(hf_bad("moe_layer_freq", "expected at least 1"));
    }
    let expert_width = hf_int(v, "moe_intermediate_size")?;
    let shared = optional("n_shared_experts", 0)?;
    // Absent: the family's default (V3 true, V2 false); null: off, as
    // mlx-lm reads it.
    let normalize = match v.get("norm_topk_prob") {
        None => !v2,
        Some(x) => x.as_bool().unwrap_or(false),
    };
    // DeepSeek V2 renormalises or scales, never both (its own modelling
    // code); V3 renormalises, then scales.
    let scale = match (v2, normalize) {
        (true, true) => 1.0,
        _ => hf_float(v, "routed_scaling_factor", 1.0)? as f32,
    };
    // Group-limited routing needs its groups said.
    let groups = |key: &str| -> Result<usize> {
        match (sigmoid, method.as_str(), v.get(key)) {
            (false, "group_limited_greedy", None | Some(serde_json::Value::Null)) => Err(hf_bad(
                key,
                "group_limited_greedy routing needs n_group and topk_group",
            )),
            _ => optional(key, 1),
        }
    };
    Moe {
        experts: hf_int(v, "n_routed_experts")?,
        experts_per_token: hf_int(v, "num_experts_per_tok")?,
        expert_intermediate_size: expert_width,
        normalize,
        dense_layers: (0..config.layers)
            .filter(|&l| l < first_dense || !l.is_multiple_of(step))
            .collect(),
        shared_expert: match shared {
            0 => None,
            n => Some(
                n.checked_mul(expert_width)
                    .ok_or_else(|| hf_bad("n_shared_experts", "shared experts too wide"))?,
            ),
        },
        shared_gate: false,
        bias: false,
        routing: {
            match (sigmoid, method.as_str()) {
                (true, _) => Routing::SigmoidGroups {
                    groups: groups("n_group")?,
                    top_groups: groups("topk_group")?,
                    scale,
                },
                (false, "group_limited_greedy") => Routing::SoftmaxGroups {
                    groups: groups("n_group")?,
                    top_groups: groups("topk_group")?,
                    scale,
                },
                (false, _) => Routing::SoftmaxGroups {
                    groups: 1,
                    top_groups: 1,
                    scale,
                },
            }
        },
    }
    .check("config.json n_group")
    .map(Some)
}

/// The `config.json` keys of DeepSeek V3's experts (one shared expert of
/// the whole shared width).
pub(super) fn moe_to_hf_json(moe: &Moe) -> serde_json::Value {
    let (groups, top_groups, scale) = moe.routing.groups();
    let (scoring, method) = match moe.routing {
        Routing::SoftmaxGroups { groups: 1, .. } => ("softmax", "greedy"),
        Routing::SoftmaxGroups { .. } => ("softmax", "group_limited_greedy"),
        Routing::SigmoidGroups { .. } | Routing::Softmax => ("sigmoid", "noaux_tc"),
    };
    let first_dense = (moe.dense_layers.iter().enumerate())
        .take_while(|&(i, &l)| i == l)
        .count();
    serde_json::json!({
        "n_routed_experts": moe.experts,
        "num_experts_per_tok": moe.experts_per_token,
        "moe_intermediate_size": moe.expert_intermediate_size,
        "n_shared_experts": moe.shared_expert.map_or(0, |w| w / moe.expert_intermediate_size),
        "norm_topk_prob": moe.normalize,
        "first_k_dense_replace": first_dense,
        "n_group": groups,
        "topk_group": top_groups,
        "routed_scaling_factor": scale,
        "topk_method": method,
        "scoring_func": scoring,
    })
}

/// DeepSeek's `rope_scaling` for `yarn`: its own keys, and `mscale` and
/// `mscale_all_dim` as the attention scale implies them.
pub(super) fn yarn_to_hf_json(
    yarn: Yarn,
    attention_scale: f32,
    latent: &LatentAttention,
) -> serde_json::Value {
    let mut json = yarn.to_hf_json();
    let squared = f64::from(attention_scale) * (latent.query_dim() as f64).sqrt();
    let ln = f64::from(yarn.factor).ln();
    let all_dims = if ln > 0.0 {
        (squared.sqrt() - 1.0) / (0.1 * ln)
    } else {
        0.0
    };
    json["mscale"] = all_dims.into();
    json["mscale_all_dim"] = all_dims.into();
    json
}

/// The `config.json` keys of latent attention.
pub(super) fn latent_to_hf_json(latent: &LatentAttention) -> serde_json::Value {
    serde_json::json!({
        "q_lora_rank": latent.q_lora_rank,
        "kv_lora_rank": latent.kv_lora_rank,
        "qk_nope_head_dim": latent.nope_dim,
        "qk_rope_head_dim": latent.rope_dim,
        "v_head_dim": latent.value_dim,
    })
}

#[cfg(test)]
mod tests {
    use crate::config::{Architecture, ModelConfig, Routing};

    /// DeepSeek V3's own configuration (671B).
    fn v3() -> serde_json::Value {
        serde_json::json!({
            "model_type": "deepseek_v3",
            "hidden_size": 7168, "num_hidden_layers": 61, "intermediate_size": 18432,
            "num_attention_heads": 128, "num_key_value_heads": 128,
            "vocab_size": 129280, "max_position_embeddings": 163840,
            "q_lora_rank": 1536, "kv_lora_rank": 512, "qk_nope_head_dim": 128,
            "qk_rope_head_dim": 64, "v_head_dim": 128,
            "n_routed_experts": 256, "n_shared_experts": 1, "num_experts_per_tok": 8,
            "moe_intermediate_size": 2048, "first_k_dense_replace": 3, "moe_layer_freq": 1,
            "n_group": 8, "topk_group": 4, "routed_scaling_factor": 2.5,
            "norm_topk_prob": true, "scoring_func": "sigmoid", "topk_method": "noaux_tc",
            "rms_norm_eps": 1e-6, "rope_theta": 10000,
            "rope_scaling": {"beta_fast": 32, "beta_slow": 1, "factor": 40, "mscale": 1.0,
                "mscale_all_dim": 1.0, "original_max_position_embeddings": 4096, "type": "yarn"},
        })
    }

    #[test]
    fn deepseek_v3_reads_its_latent_attention_routing_and_yarn() {
        let c = ModelConfig::from_hf_json(&v3()).unwrap();
        assert_eq!(c.architecture, Architecture::DeepSeekV3);
        let latent = c.latent.unwrap();
        assert_eq!(
            (latent.q_lora_rank, latent.cache_width()),
            (Some(1536), 576)
        );
        assert_eq!(c.head_dim, 64);
        // 576 f32 per token and layer.
        assert_eq!(c.kv_bytes_per_token_per_layer(), 576 * 4);
        let m = 0.1 * 40f32.ln() + 1.0;
        assert!((c.attention_scale - m * m / 192f32.sqrt()).abs() < 1e-6);
        assert_eq!(c.yarn.unwrap().original_context, 4096);
        let moe = c.moe.clone().unwrap();
        assert_eq!(moe.dense_layers, vec![0, 1, 2]);
        assert_eq!(moe.shared_expert, Some(2048));
        assert!(!moe.shared_gate);
        assert_eq!(
            moe.routing,
            Routing::SigmoidGroups {
                groups: 8,
                top_groups: 4,
                scale: 2.5
            }
        );
        let back = ModelConfig::from_hf_json(&c.to_hf_json(false)).unwrap();
        assert_eq!(back.moe, c.moe);
        assert_eq!(back.latent, c.latent);
        assert_eq!(back.yarn, c.yarn);
        assert!((back.attention_scale - c.attention_scale).abs() < 1e-7);
        // Kimi K2 names itself so, with the same classes.
        let mut k2 = v3();
        k2["model_type"] = "kimi_k2".into();
        let k2 = ModelConfig::from_hf_json(&k2).unwrap();
        assert_eq!(k2.architecture, Architecture::DeepSeekV3);
    }

    /// DeepSeek-V2-Lite's configuration (16B): no low-rank query, softmax
    /// routing without groups, no renormalisation.
    fn v2_lite() -> serde_json::Value {
        let mut v = v3();
        let lite = serde_json::json!({
            "model_type": "deepseek_v2",
            "hidden_size": 2048, "num_hidden_layers": 27, "intermediate_size": 10944,
            "num_attention_heads": 16, "num_key_value_heads": 16, "vocab_size": 102400,
            "q_lora_rank": null, "n_routed_experts": 64, "n_shared_experts": 2,
            "num_experts_per_tok": 6, "moe_intermediate_size": 1408, "first_k_dense_replace": 1,
            "n_group": 1, "topk_group": 1, "routed_scaling_factor": 1.0,
            "norm_topk_prob": false, "scoring_func": "softmax", "topk_method": "greedy",
        });
        for (key, value) in lite.as_object().unwrap() {
            v[key] = value.clone();
        }
        v["rope_scaling"]["mscale"] = 0.707.into();
        v["rope_scaling"]["mscale_all_dim"] = 0.707.into();
        v
    }

    #[test]
    fn deepseek_v2_routes_by_softmax_greedily_or_within_groups() {
        let c = ModelConfig::from_hf_json(&v2_lite()).unwrap();
        assert_eq!(c.architecture, Architecture::DeepSeekV3);
        assert_eq!(c.latent.unwrap().q_lora_rank, None);
        let moe = c.moe.clone().unwrap();
        assert!(!moe.normalize);
        assert_eq!(moe.dense_layers, vec![0]);
        assert_eq!(moe.shared_expert, Some(2 * 1408));
        assert_eq!(
            moe.routing,
            Routing::SoftmaxGroups {
                groups: 1,
                top_groups: 1,
                scale: 1.0
            }
        );
        // Written back as DeepSeek V2, and read the same.
        let json = c.to_hf_json(false);
        assert_eq!(json["model_type"], "deepseek_v2");
        assert_eq!(json["topk_method"], "greedy");
        let back = ModelConfig::from_hf_json(&json).unwrap();
        assert_eq!(back.moe, c.moe);
        assert_eq!(back.latent, c.latent);
        // DeepSeek V2 (236B) limits each token to the experts of its 3 best
        // of 8 groups, the sum scaled by 16; its defaults are V2's.
        let mut v2 = v2_lite();
        v2["topk_method"] = "group_limited_greedy".into();
        v2["n_group"] = 8.into();
        v2["topk_group"] = 3.into();
        v2["routed_scaling_factor"] = 16.0.into();
        for key in ["scoring_func", "norm_topk_prob"] {
            v2.as_object_mut().unwrap().remove(key);
        }
        let moe = ModelConfig::from_hf_json(&v2).unwrap().moe.unwrap();
        assert!(!moe.normalize);
        assert_eq!(
            moe.routing,
            Routing::SoftmaxGroups {
                groups: 8,
                top_groups: 3,
                scale: 16.0
            }
        );
        // One expert per group is enough when a group is scored by its best.
        v2["n_group"] = 64.into();
        v2["topk_group"] = 6.into();
        assert!(ModelConfig::from_hf_json(&v2).is_ok());
        v2["topk_group"] = 5.into();
        let e = ModelConfig::from_hf_json(&v2).unwrap_err().to_string();
        assert!(e.contains("cannot be routed"), "{e}");
        // Group-limited routing without its groups is refused, not run greedily.
        v2["n_group"] = serde_json::Value::Null;
        let e = ModelConfig::from_hf_json(&v2).unwrap_err().to_string();
        assert!(e.contains("n_group"), "{e}");
        // V2 renormalises or scales, never both; sigmoid routing is V3's.
        let mut v = v2_lite();
        v["norm_topk_prob"] = true.into();
        v["routed_scaling_factor"] = 16.0.into();
        let moe = ModelConfig::from_hf_json(&v).unwrap().moe.unwrap();
        assert!(moe.normalize);
        assert_eq!(moe.routing.groups().2, 1.0);
        v["scoring_func"] = "sigmoid".into();
        v["topk_method"] = "noaux_tc".into();
        let e = ModelConfig::from_hf_json(&v).unwrap_err().to_string();
        assert!(e.contains("not how this family routes"), "{e}");
    }

    #[test]
    fn impossible_deepseek_configurations_name_themselves() {
        let bad = |key: &str, value: serde_json::Value, want: &str| {
            let mut v = v3();
            v[key] = value;
            let e = ModelConfig::from_hf_json(&v).unwrap_err().to_string();
            assert!(e.contains(want), "{key}: {e}");
        };
        bad("n_group", 7.into(), "cannot be routed");
        bad(
            "num_hidden_layers",
            (1u64 << 40).into(),
            "the number of layers is",
        );
        bad("topk_group", 9.into(), "cannot be routed");
        bad("num_experts_per_tok", 300.into(), "experts per token");
        bad("scoring_func", "tanh".into(), "scoring_func");
        bad("topk_method", "greedy".into(), "topk_method");
        // V3 routes by sigmoid scores only (its checkpoints hold a choice bias).
        bad(
            "scoring_func",
            "softmax".into(),
            "not how this family routes",
        );
        bad("topk_method", "noaux_tc_v2".into(), "topk_method");
        bad("qk_rope_head_dim", 63.into(), "qk_rope_head_dim");
        bad("kv_lora_rank", 0.into(), "kv_lora_rank");
        bad(
            "rope_scaling",
            serde_json::json!({"type": "yarn", "factor": 40, "mscale": 0.707, "mscale_all_dim": 1.0,
                "original_max_position_embeddings": 4096}),
            "mscale",
        );
        bad(
            "rope_scaling",
            serde_json::json!({"type": "dynamic", "factor": 2}),
            "\"dynamic\" is not supported",
        );
    }
}
