//! Mixture of experts: what GGUF metadata and `config.json` say about a
//! family's routed feed-forward blocks (Qwen3-MoE, Mixtral, DeepSeek V3).
//!
//! ```text
//!  h ──► router (hidden → experts) ──► softmax ──► top k ──► renormalise?
//!  │          (DeepSeek: sigmoid; the choice in the best groups, with a bias)
//!  │                                                 │ ids, weights
//!  └──────────► expert e: down(act(gate_e h) · up_e h) ┴─► Σ weight · expert
//! ```
//!
//! A model may keep some layers dense (Qwen3-MoE's `mlp_only_layers` and
//! `decoder_sparse_step`); in GGUF a layer is routed when it has a router
//! tensor (`blk.N.ffn_gate_inp`), so either file says the same.

use super::{Architecture, ModelConfig, hf_bad, hf_int};
use crate::error::{Error, Result};
use crate::gguf::GgufHeader;

/// How a router's logits become the chosen experts and their weights.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Routing {
    /// A softmax over every expert, the top k (renormalised when the
    /// [`Moe`] says so).
    Softmax,
    /// DeepSeek V3's: a sigmoid score per expert; the choice adds a learned
    /// bias per expert and is limited to the `top_groups` best of `groups`
    /// equal groups (a group scored by its two best experts); the weights
    /// are the chosen experts' scores (without the bias), renormalised when
    /// the [`Moe`] says so, times `scale`.
    SigmoidGroups {
        /// Groups the experts fall into, in order.
        groups: usize,
        /// Groups a token may choose from.
        top_groups: usize,
        /// Factor on the routed experts' sum.
        scale: f32,
    },
    /// DeepSeek V2's: a softmax over every expert; the choice is limited to
    /// the `top_groups` best of `groups` equal groups (a group scored by its
    /// best expert; one group: no limit); the weights are the chosen
    /// experts' scores, renormalised when the [`Moe`] says so, times
    /// `scale`.
    SoftmaxGroups {
        /// Groups the experts fall into, in order.
        groups: usize,
        /// Groups a token may choose from.
        top_groups: usize,
        /// Factor on the routed experts' sum.
        scale: f32,
    },
}

impl Routing {
    /// Groups, groups per token, and the factor on the routed sum (one
    /// group of all, and 1, for plain top-k routing).
    pub fn groups(self) -> (usize, usize, f32) {
        match self {
            Routing::Softmax => (1, 1, 1.0),
            Routing::SigmoidGroups {
                groups,
                top_groups,
                scale,
            }
            | Routing::SoftmaxGroups {
                groups,
                top_groups,
                scale,
            } => (groups, top_groups, scale),
        }
    }
}

/// The routed feed-forward blocks of a mixture-of-experts model.
#[derive(Debug, Clone, PartialEq)]
pub struct Moe {
    /// Experts per routed layer.
    pub experts: usize,
    /// Experts each token uses (top k).
    pub experts_per_token: usize,
    /// Width of one expert's feed-forward layer.
    pub expert_intermediate_size: usize,
    /// Whether the chosen experts' weights are renormalised to sum to one.
    pub normalize: bool,
    /// Layers with a dense feed-forward block instead (ascending).
    pub dense_layers: Vec<usize>,
    /// Width of the shared expert every token also goes through, when the
    /// family has one.
    pub shared_expert: Option<usize>,
    /// Whether the shared expert's output is scaled by a sigmoid gate of its
    /// own (Qwen2-MoE; DeepSeek's shared experts are not gated).
    pub shared_gate: bool,
    /// Whether the router and every expert projection add a bias (gpt-oss).
    pub bias: bool,
    /// How the router chooses.
    pub routing: Routing,
}

impl Moe {
    /// Whether layer `layer` routes its tokens to experts.
    pub fn routed(&self, layer: usize) -> bool {
        self.dense_layers.binary_search(&layer).is_err()
    }

    pub(super) fn check(self, what: &str) -> Result<Self> {
        if self.experts == 0 || self.experts_per_token == 0 {
            return Err(Error::metadata(
                what,
                "a mixture of experts needs at least one expert, and one per token",
            ));
        }
        if self.experts_per_token > self.experts {
            return Err(Error::metadata(
                what,
                format!(
                    "{} experts per token, but only {} experts",
                    self.experts_per_token, self.experts
                ),
            ));
        }
        if self.expert_intermediate_size == 0 {
            return Err(Error::metadata(what, "experts of width 0"));
        }
        if self.routing != Routing::Softmax {
            let (groups, top_groups, _) = self.routing.groups();
            // Sigmoid groups are scored by their best two experts.
            let least = match self.routing {
                Routing::SigmoidGroups { .. } => 2,
                _ => 1,
            };
            let per_group = self.experts.checked_div(groups).unwrap_or(0);
            if groups == 0
                || !self.experts.is_multiple_of(groups)
                || top_groups == 0
                || top_groups > groups
                || per_group < least
                || top_groups * per_group < self.experts_per_token
            {
                return Err(Error::metadata(
                    what,
                    format!(
                        "{} experts in {groups} groups, {top_groups} groups per token and \
                         {} experts per token cannot be routed (groups must divide the \
                         experts, hold {least} or more each, and the chosen groups hold \
                         enough experts)",
                        self.experts, self.experts_per_token
                    ),
                ));
            }
        }
        Ok(self)
    }
}

/// Reads the experts from GGUF metadata (`key` prefixes the architecture),
/// or `None` when the model has none.
pub(super) fn from_gguf(
    config: &ModelConfig,
    header: &GgufHeader,
    key: &dyn Fn(&str) -> String,
) -> Result<Option<Moe>> {
    let experts = header.get_u32(&key("expert_count")).unwrap_or(0) as usize;
    if experts == 0 {
        return Ok(None);
    }
    let router = |l: usize| format!("blk.{l}.ffn_gate_inp.weight");
    let dense_layers: Vec<usize> = (0..config.layers)
        .filter(|&l| !header.tensors.contains_key(&router(l)))
        .collect();
    // Mixtral-style files from before the experts were merged into one
    // tensor per projection.
    if header.tensors.contains_key("blk.0.ffn_gate.0.weight") {
        return Err(Error::metadata(
            key("expert_count"),
            "experts stored one tensor each (blk.N.ffn_gate.E) are not supported; \
             convert the model again with a current llama.cpp (blk.N.ffn_gate_exps)",
        ));
    }
    let expert_intermediate_size = header
        .get_u32(&key("expert_feed_forward_length"))
        .map(|n| n as usize)
        .unwrap_or(config.intermediate_size);
    // llama.cpp renormalises for Mixtral and Qwen3-MoE, not for Qwen2-MoE.
    let qwen2 = header.get_str("general.architecture").ok() == Some("qwen2moe");
    let normalize = match header.get(&key("expert_weights_norm")) {
        Ok(v) => v.as_bool().unwrap_or(!qwen2),
        Err(_) => !qwen2,
    };
    let shared_expert = header
        .get_u32(&key("expert_shared_feed_forward_length"))
        .ok()
        .map(|n| n as usize)
        .filter(|_| qwen2);
    if qwen2 && shared_expert.is_none() {
        return Err(Error::metadata(
            key("expert_shared_feed_forward_length"),
            "a qwen2moe model names the width of its shared expert",
        ));
    }
    // gpt-oss: biases on the router and every expert; a softmax over the
    // chosen experts' logits (llama.cpp's gating 3), which renormalising a
    // softmax over all of them gives too.
    let gpt_oss = config.architecture == Architecture::GptOss;
    if let Ok(func) = header.get_u32(&key("expert_gating_func"))
        && func != 1
        && !(gpt_oss && func == 3)
    {
        return Err(Error::metadata(
            key("expert_gating_func"),
            format!("gating function {func} is not supported (1, softmax, is)"),
        ));
    }
    if header.get_u32(&key("expert_shared_count")).unwrap_or(0) > 1 {
        return Err(Error::metadata(
            key("expert_shared_count"),
            "more than one shared expert is not supported yet (one gated shared expert, as Qwen2-MoE has, is)",
        ));
    }
    Moe {
        experts,
        experts_per_token: header.get_u32(&key("expert_used_count"))? as usize,
        expert_intermediate_size,
        normalize: normalize || gpt_oss,
        shared_gate: shared_expert.is_some(),
        dense_layers,
        shared_expert,
        bias: gpt_oss,
        routing: Routing::Softmax,
    }
    .check(&key("expert_used_count"))
    .map(Some)
}

/// Reads the experts from `config.json`, or `None` when the model has none.
pub(super) fn from_hf(
    architecture: Architecture,
    config: &ModelConfig,
    v: &serde_json::Value,
) -> Result<Option<Moe>> {
    // Qwen's keys, both generations.
    let qwen = |dense_layers: Vec<usize>, shared_expert: Option<usize>| -> Result<Moe> {
        Ok(Moe {
            experts: hf_int(v, "num_experts")?,
            experts_per_token: hf_int(v, "num_experts_per_tok")?,
            expert_intermediate_size: hf_int(v, "moe_intermediate_size")?,
            normalize: v
                .get("norm_topk_prob")
                .and_then(serde_json::Value::as_bool)
                .unwrap_or(false),
            shared_gate: shared_expert.is_some(),
            dense_layers,
            shared_expert,
            bias: false,
            routing: Routing::Softmax,
        })
    };
    let moe = match architecture {
        Architecture::Qwen3Moe => {
            let step = match v.get("decoder_sparse_step") {
                None | Some(serde_json::Value::Null) => 1,
                Some(_) => hf_int(v, "decoder_sparse_step")?,
            };
            if step == 0 {
                return Err(hf_bad("decoder_sparse_step", "expected at least 1"));
            }
            let only: Vec<usize> = match v.get("mlp_only_layers") {
                None | Some(serde_json::Value::Null) => Vec::new(),
                Some(serde_json::Value::Array(a)) => a
                    .iter()
                    .map(|x| x.as_u64().map(|x| x as usize))
                    .collect::<Option<_>>()
                    .ok_or_else(|| hf_bad("mlp_only_layers", "expected layer numbers"))?,
                Some(_) => return Err(hf_bad("mlp_only_layers", "expected a list")),
            };
            let dense = (0..config.layers)
                .filter(|l| only.contains(l) || !(l + 1).is_multiple_of(step))
                .collect();
            qwen(dense, None)?
        }
        // Every layer routed (as mlx-lm and llama.cpp build it), beside the
        // gated shared expert.
        Architecture::Qwen2Moe => qwen(
            Vec::new(),
            Some(hf_int(v, "shared_expert_intermediate_size")?),
        )?,
        Architecture::Mixtral => Moe {
            experts: hf_int(v, "num_local_experts")?,
            experts_per_token: hf_int(v, "num_experts_per_tok")?,
            expert_intermediate_size: config.intermediate_size,
            // A softmax over the chosen experts' logits.
            normalize: true,
            dense_layers: Vec::new(),
            shared_expert: None,
            shared_gate: false,
            bias: false,
            routing: Routing::Softmax,
        },
        // Every layer routed; a softmax over the chosen experts' logits.
        Architecture::GptOss => Moe {
            experts: hf_int(v, "num_local_experts")?,
            experts_per_token: hf_int(v, "num_experts_per_tok")
                .or_else(|_| hf_int(v, "experts_per_token"))?,
            expert_intermediate_size: config.intermediate_size,
            normalize: true,
            dense_layers: Vec::new(),
            shared_expert: None,
            shared_gate: false,
            bias: true,
            routing: Routing::Softmax,
        },
        Architecture::DeepSeekV3 => match super::deepseek::moe(config, v)? {
            Some(moe) => moe,
            None => return Ok(None),
        },
        _ => return Ok(None),
    };
    moe.check("config.json num_experts_per_tok").map(Some)
}

/// The `config.json` keys of `moe` for a model of `architecture`.
pub(super) fn to_hf_json(
    architecture: Architecture,
    moe: &Moe,
    layers: usize,
) -> serde_json::Value {
    match architecture {
        Architecture::Mixtral | Architecture::GptOss => serde_json::json!({
            "num_local_experts": moe.experts,
            "num_experts_per_tok": moe.experts_per_token,
        }),
        Architecture::DeepSeekV3 => super::deepseek::moe_to_hf_json(moe),
        Architecture::Qwen2Moe => serde_json::json!({
            "num_experts": moe.experts,
            "num_experts_per_tok": moe.experts_per_token,
            "moe_intermediate_size": moe.expert_intermediate_size,
            "shared_expert_intermediate_size": moe.shared_expert.unwrap_or(0),
            "norm_topk_prob": moe.normalize,
        }),
        _ => serde_json::json!({
            "num_experts": moe.experts,
            "num_experts_per_tok": moe.experts_per_token,
            "moe_intermediate_size": moe.expert_intermediate_size,
            "norm_topk_prob": moe.normalize,
            "decoder_sparse_step": 1,
            "mlp_only_layers": moe.dense_layers.iter().filter(|&&l| l < layers).collect::<Vec<_>>(),
        }),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::ModelConfig;

    fn qwen3_moe() -> serde_json::Value {
        serde_json::json!({
            "model_type": "qwen3_moe",
            "hidden_size": 64, "num_hidden_layers": 4, "intermediate_size": 96,
            "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
            "vocab_size": 256, "max_position_embeddings": 128,
            "num_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 32,
            "norm_topk_prob": true, "decoder_sparse_step": 1, "mlp_only_layers": [1],
        })
    }

    #[test]
    fn qwen3_moe_config_reads_and_round_trips() {
        let c = ModelConfig::from_hf_json(&qwen3_moe()).unwrap();
        assert_eq!(c.architecture, Architecture::Qwen3Moe);
        let moe = c.moe.clone().unwrap();
        assert_eq!((moe.experts, moe.experts_per_token), (8, 2));
        assert_eq!(moe.expert_intermediate_size, 32);
        assert_eq!(moe.dense_layers, vec![1]);
        assert!(moe.routed(0) && !moe.routed(1) && moe.routed(3));
        let back = ModelConfig::from_hf_json(&c.to_hf_json(true)).unwrap();
        assert_eq!(back.moe, c.moe);
        assert_eq!(back.architecture, Architecture::Qwen3Moe);
    }

    #[test]
    fn a_sparse_step_keeps_the_other_layers_dense() {
        let mut v = qwen3_moe();
        v["decoder_sparse_step"] = 2.into();
        v["mlp_only_layers"] = serde_json::json!([]);
        let c = ModelConfig::from_hf_json(&v).unwrap();
        assert_eq!(c.moe.unwrap().dense_layers, vec![0, 2]);
    }

    #[test]
    fn impossible_routing_names_itself() {
        let mut v = qwen3_moe();
        v["num_experts_per_tok"] = 9.into();
        let e = ModelConfig::from_hf_json(&v).unwrap_err().to_string();
        assert!(e.contains("9 experts per token, but only 8 experts"), "{e}");
        v["num_experts_per_tok"] = 0.into();
        let e = ModelConfig::from_hf_json(&v).unwrap_err().to_string();
        assert!(e.contains("at least one expert"), "{e}");
        let mut m = serde_json::json!({
            "model_type": "mixtral",
            "hidden_size": 64, "num_hidden_layers": 2, "intermediate_size": 96,
            "num_attention_heads": 4, "num_key_value_heads": 2,
            "vocab_size": 256, "max_position_embeddings": 128,
            "num_experts_per_tok": 2,
        });
        let e = ModelConfig::from_hf_json(&m).unwrap_err().to_string();
        assert!(e.contains("num_local_experts"), "{e}");
        m["num_local_experts"] = 4.into();
        let c = ModelConfig::from_hf_json(&m).unwrap();
        assert_eq!(c.architecture, Architecture::Mixtral);
        assert_eq!(c.moe.as_ref().unwrap().expert_intermediate_size, 96);
        let back = ModelConfig::from_hf_json(&c.to_hf_json(false)).unwrap();
        assert_eq!(back.moe, c.moe);
    }
}
