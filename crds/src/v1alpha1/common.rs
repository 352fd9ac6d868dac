//! Types shared by several kinds.

use k8s_openapi::apimachinery::pkg::apis::meta::v1::Condition;
use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

/// The tier of a node pool: what its nodes are for.
#[derive(Serialize, Deserialize, Clone, Copy, Debug, PartialEq, Eq, Hash, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub enum Tier {
    /// Whole models on dedicated nodes, one replica per node; requests are spread
    /// over replicas and fail over between them.
    Daily,
    /// One large model sharded across several nodes (pipeline or tensor parallel).
    Reasoning,
}

impl std::fmt::Display for Tier {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Tier::Daily => "daily",
            Tier::Reasoning => "reasoning",
        })
    }
}

/// An inference engine a node can run a shard with.
#[derive(Serialize, Deserialize, Clone, Copy, Debug, PartialEq, Eq, Hash, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub enum Engine {
    /// MLX: Metal on Apple Silicon, its CPU backend elsewhere.
    Mlx,
    /// candle: CPU, CUDA or Metal.
    Candle,
}

/// The on-disk format of a model's weights.
#[derive(Serialize, Deserialize, Clone, Copy, Debug, PartialEq, Eq, Hash, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub enum ModelFormat {
    /// One GGUF file carrying weights, tokenizer and chat template.
    Gguf,
    /// A directory in the MLX-community layout: `config.json`, safetensors weights
    /// (possibly quantized, with scales and biases) and `tokenizer.json`.
    Safetensors,
}

/// Where a model's weights come from. Exactly one of the fields is set.
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, Eq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub enum ModelSource {
    /// A Hugging Face repository.
    HuggingFace(HuggingFaceSource),
    /// An HTTP(S) URL of the file.
    Url(UrlSource),
    /// A path present on the nodes (a shared mount or a file copied by hand).
    Path(PathSource),
}

impl ModelSource {
    /// The key a node's cache knows these weights by (`InferenceNode`
    /// `status.cachedModels[].key`).
    pub fn cache_key(&self) -> String {
        match self {
            ModelSource::HuggingFace(hf) => format!(
                "hf:{}/{}@{}",
                hf.repo,
                hf.file.as_deref().unwrap_or_default(),
                hf.revision.as_deref().unwrap_or("main")
            ),
            ModelSource::Url(u) => format!("url:{}", u.url),
            ModelSource::Path(p) => format!("path:{}", p.path),
        }
    }
}

/// A model in a Hugging Face repository.
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, Eq, JsonSchema)]
#[serde(rename_all = "camelCase")]
#[schemars(transform = keep_field_docs)]
pub struct HuggingFaceSource {
    /// Repository id, `owner/name`.
    #[schemars(regex(pattern = r"^[A-Za-z0-9][A-Za-z0-9._-]*/[A-Za-z0-9][A-Za-z0-9._-]*$"))]
    pub repo: String,
    /// The file to fetch, for GGUF repositories that hold several quantizations
    /// (e.g. `model.Q4_K_M.gguf`). Unset for a safetensors repository.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub file: Option<String>,
    /// Branch, tag or commit; `main` when unset. The operator resolves it
    /// once to a commit (the Model's `status.resolvedRevision`) and every
    /// node fetches that commit.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub revision: Option<String>,
    /// The file's SHA-256 as 64 hex digits; downloads that do not match are
    /// discarded. The operator fills it in each Shard from the hub's LFS
    /// metadata; set it here to pin the bytes yourself.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(regex(pattern = r"^[0-9a-f]{64}$"))]
    pub sha256: Option<String>,
    /// The key of a Secret in the Model's namespace that holds a token for
    /// this repository (gated or private), used instead of the operator's
    /// and agents' `--hugging-face-token-file`. The Secret must carry the
    /// label `shardplane.dev/hugging-face-token: "true"`, or it is not read.
    /// The token goes only to the hub and is never written to status,
    /// events or logs.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub token_secret_ref: Option<SecretKeyRef>,
}

/// A key of a Secret in the namespace of the object that names it.
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, Eq, JsonSchema)]
#[serde(rename_all = "camelCase")]
#[schemars(transform = keep_field_docs)]
pub struct SecretKeyRef {
    /// The Secret's name.
    #[schemars(length(min = 1, max = 253))]
    pub name: String,
    /// The key in its data.
    #[schemars(length(min = 1, max = 253))]
    pub key: String,
}

/// A model file at an HTTP(S) URL.
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, Eq, JsonSchema)]
#[serde(rename_all = "camelCase")]
#[schemars(transform = keep_field_docs)]
pub struct UrlSource {
    /// The URL of the file.
    #[schemars(regex(pattern = r"^https?://.+"))]
    pub url: String,
    /// The file's SHA-256 as 64 hex digits; downloads that do not match are discarded.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(regex(pattern = r"^[0-9a-f]{64}$"))]
    pub sha256: Option<String>,
}

/// A model file or directory already present on the nodes.
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, Eq, JsonSchema)]
#[serde(rename_all = "camelCase")]
#[schemars(transform = keep_field_docs)]
pub struct PathSource {
    /// Absolute path of the file (GGUF) or directory (safetensors) on each node.
    #[schemars(regex(pattern = r"^/.*"))]
    pub path: String,
    /// The file's SHA-256 as 64 hex digits, checked before loading when set.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(regex(pattern = r"^[0-9a-f]{64}$"))]
    pub sha256: Option<String>,
}

/// A half-open range of transformer layers, `[start, end)`.
///
/// `start < end` is checked by `validate()` rather than a CEL rule: API servers
/// before 1.25 reject CRDs that carry CEL rules.
#[derive(Serialize, Deserialize, Clone, Copy, Debug, PartialEq, Eq, Hash, JsonSchema)]
#[serde(rename_all = "camelCase")]
#[schemars(transform = keep_field_docs)]
pub struct LayerRange {
    /// The first layer of the range.
    #[schemars(range(min = 0))]
    pub start: u32,
    /// One past the last layer of the range.
    #[schemars(range(min = 1))]
    pub end: u32,
}

impl LayerRange {
    /// The number of layers in the range (0 when reversed).
    pub fn len(&self) -> u32 {
        self.end.saturating_sub(self.start)
    }

    /// Whether the range holds no layer.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

impl std::fmt::Display for LayerRange {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}-{}", self.start, self.end)
    }
}

/// Conditions of an object, keyed by `type`.
pub type Conditions = Vec<Condition>;

/// Condition type: the object is ready for use.
pub const CONDITION_READY: &str = "Ready";
/// Condition type (ModelDeployment): every instance has a placement.
pub const CONDITION_PLACED: &str = "Placed";
/// Condition type (ModelDeployment): shards are being created, fetched or loaded.
pub const CONDITION_PROGRESSING: &str = "Progressing";
/// Condition type (ModelDeployment): fewer instances are ready than requested.
pub const CONDITION_DEGRADED: &str = "Degraded";
/// Condition type (ModelDeployment): another namespace owns a name (served
/// name or alias) the deployment claims; it is not served under that name
/// (see `crate::names`).
pub const CONDITION_CONFLICTED: &str = "Conflicted";
/// Condition type (Model): the model's metadata was read from its source.
pub const CONDITION_RESOLVED: &str = "Resolved";

/// Keeps a field's own doc as its schema description where the field is an
/// `Option` of a documented type. kube's structural rewrite hoists the inner
/// type's schema over the field's, which would otherwise put the type's doc in
/// `kubectl explain` instead of the field's.
pub(crate) fn keep_field_docs(schema: &mut schemars::Schema) {
    let Some(props) = schema.get_mut("properties").and_then(|p| p.as_object_mut()) else {
        return;
    };
    for prop in props.values_mut() {
        let Some(prop) = prop.as_object_mut() else {
            continue;
        };
        if !prop.contains_key("description") {
            continue;
        }
        if let Some(branches) = prop.get_mut("anyOf").and_then(|a| a.as_array_mut()) {
            for branch in branches.iter_mut().filter_map(|b| b.as_object_mut()) {
                branch.remove("description");
            }
        }
    }
}
