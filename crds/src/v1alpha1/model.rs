//! `Model`: weights to run, and (in status) what placement needs to know of them.

use kube::CustomResource;
use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

use super::{Conditions, Engine, ModelFormat, ModelSource, keep_field_docs};

/// Weights to run: where they come from, their format, and the name clients use.
#[derive(CustomResource, Serialize, Deserialize, Clone, Debug, PartialEq, JsonSchema)]
#[kube(
    group = "shardplane.dev",
    version = "v1alpha1",
    kind = "Model",
    namespaced,
    status = "ModelStatus",
    shortname = "mdl",
    category = "shardplane",
    doc = "Weights to run: their source, format and served name. The operator fills status with the metadata placement needs.",
    printcolumn(name = "Served", type_ = "string", json_path = ".spec.servedName"),
    printcolumn(name = "Format", type_ = "string", json_path = ".spec.format"),
    printcolumn(name = "Arch", type_ = "string", json_path = ".status.architecture"),
    printcolumn(name = "Layers", type_ = "integer", json_path = ".status.layers"),
    printcolumn(
        name = "Resolved",
        type_ = "string",
        json_path = ".status.conditions[?(@.type==\"Resolved\")].status"
    ),
    printcolumn(
        name = "Age",
        type_ = "date",
        json_path = ".metadata.creationTimestamp"
    )
)]
#[serde(rename_all = "camelCase")]
#[schemars(transform = keep_field_docs)]
pub struct ModelSpec {
    /// Where the weights come from: exactly one of `huggingFace`, `url` or `path`.
    pub source: ModelSource,
    /// The format of the weights.
    pub format: ModelFormat,
    /// The model name clients ask for (e.g. `smollm2-135m`). Defaults to the
    /// object's name.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(
        length(min = 1, max = 253),
        regex(pattern = r"^[A-Za-z0-9][A-Za-z0-9._:/-]*$")
    )]
    pub served_name: Option<String>,
    /// Caps the context length served, in tokens, below what the model supports.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(range(min = 1, max = crate::limits::MAX_CONTEXT_LENGTH))]
    pub max_context_length: Option<u32>,
    /// A Jinja chat template used instead of the one the weights ship (as
    /// Hugging Face templates are written: `messages`, `tools`,
    /// `add_generation_prompt`, `bos_token`, `eos_token`, and any
    /// `chat_template_kwargs` a request sends). For weights whose template
    /// is missing or wrong; a template that does not compile fails the
    /// first stage's Shard with reason `InvalidChatTemplate`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(length(min = 1, max = 262144))]
    pub chat_template: Option<String>,
}

/// A model's sliding-window layers.
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, JsonSchema)]
#[serde(rename_all = "camelCase")]
#[schemars(transform = keep_field_docs)]
pub struct SlidingWindowStatus {
    /// Positions a query of these layers sees, itself included.
    pub tokens: u32,
    /// Tokens of KV one sequence holds at most in each of these layers, as
    /// the engines keep them (the window, a window more for the prefix
    /// cache, room to grow, and a step of 512 prompt tokens, the agents'
    /// default).
    pub held_tokens: u32,
    /// The layers that slide (0-based, ascending).
    pub layers: Vec<u32>,
}

/// A model in memory as one engine holds it.
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, JsonSchema)]
#[serde(rename_all = "camelCase")]
#[schemars(transform = keep_field_docs)]
pub struct EngineFootprint {
    /// The engine.
    pub engine: Engine,
    /// Bytes of the weights of each layer as the engine holds them, in layer order.
    pub layer_bytes: Vec<u64>,
    /// Bytes of the token embedding as the engine holds it.
    pub embedding_bytes: u64,
    /// Bytes of the final norm and output head as the engine holds them.
    pub output_bytes: u64,
    /// Bytes of KV cache one token needs across all layers, in the
    /// engine's precision.
    pub kv_bytes_per_token: u64,
}

/// What the operator read from the model's source: everything placement needs.
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, JsonSchema)]
#[serde(rename_all = "camelCase")]
#[schemars(transform = keep_field_docs)]
pub struct ModelStatus {
    /// Architecture as the weights name it (`llama`, `qwen2`, `qwen3`, …).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub architecture: Option<String>,
    /// Number of transformer layers (blocks).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub layers: Option<u32>,
    /// Width of the hidden state passed between layers (and between stages).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub hidden_size: Option<u32>,
    /// Number of attention (query) heads.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub attention_heads: Option<u32>,
    /// Number of key/value heads (fewer than `attentionHeads` under grouped-query attention).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub kv_heads: Option<u32>,
    /// Dimension of one attention head.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub head_dim: Option<u32>,
    /// Experts in each routed layer of a mixture-of-experts model (all of
    /// them counted in `layerBytes`: a stage holds every expert of its layers).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub experts: Option<u32>,
    /// Experts each token is routed to.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub experts_per_token: Option<u32>,
    /// Size of the vocabulary.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub vocab_size: Option<u32>,
    /// Context length the model was trained for, in tokens (capped by `spec.maxContextLength`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub context_length: Option<u32>,
    /// Predominant weight type (`Q4_1`, `Q8_0`, `F16`, …).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub quantization: Option<String>,
    /// Bytes of the weights of each layer, in layer order.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub layer_bytes: Vec<u64>,
    /// Bytes of the token embedding (held by the first stage).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub embedding_bytes: Option<u64>,
    /// Bytes of the final norm and output head (held by the last stage). With tied
    /// embeddings the head reuses the embedding matrix and this counts it again,
    /// because a last stage on another node needs its own copy.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub output_bytes: Option<u64>,
    /// Bytes of KV cache one token needs across all layers (keys and values,
    /// counted as f32: MLX holds them so; candle holds f16 by default, and
    /// its figure in `engineFootprints` says so).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub kv_bytes_per_token: Option<u64>,
    /// What each engine holds of the model in memory with its default
    /// options (GGUF and MLX-community safetensors): weights in the types
    /// it computes with, KV in its precision. Placement counts a node's
    /// stages by the figures of the engine its agent runs (the first it
    /// reports), a tensor rank by candle's (ranks run on candle), and by
    /// the file's figures above where an engine has none.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub engine_footprints: Vec<EngineFootprint>,
    /// The layers that attend within a sliding window (Gemma 3, gpt-oss):
    /// their KV cache holds a bounded number of tokens however long a
    /// sequence grows, and placement counts them so.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub sliding_window: Option<SlidingWindowStatus>,
    /// Total bytes of the weights as stored.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub total_bytes: Option<u64>,
    /// The commit a Hugging Face `revision` resolved to: every node fetches
    /// this commit, so no two stages run different weights.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub resolved_revision: Option<String>,
    /// SHA-256 of the weights file, when known.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub sha256: Option<String>,
    /// The node whose file the metadata was read from (a `path` source). Only
    /// that node may report it again while its InferenceNode exists; once it
    /// is deleted the operator clears this, and another node holding the
    /// file reports.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub reported_by: Option<String>,
    /// The generation of the spec this status describes.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub observed_generation: Option<i64>,
    /// `Resolved` (metadata read from the source) and `Ready`.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub conditions: Conditions,
}

impl Model {
    /// The name clients ask for: `spec.servedName`, else the object's name.
    pub fn served_name(&self) -> &str {
        self.spec
            .served_name
            .as_deref()
            .or(self.metadata.name.as_deref())
            .unwrap_or_default()
    }

    /// The source as the nodes fetch it: a Hugging Face revision pinned to
    /// the commit it resolved to, with the file's SHA-256 from the hub when
    /// the spec gives none. Before it is resolved, the spec's source.
    pub fn pinned_source(&self) -> ModelSource {
        let mut source = self.spec.source.clone();
        if let (ModelSource::HuggingFace(hf), Some(status)) = (&mut source, &self.status)
            && let Some(commit) = &status.resolved_revision
        {
            hf.revision = Some(commit.clone());
            if hf.sha256.is_none() && self.spec.format == ModelFormat::Gguf {
                hf.sha256 = status.sha256.clone();
            }
        }
        source
    }
}
