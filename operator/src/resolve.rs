//! Reading what placement needs of a model from its weights: the GGUF header
//! (tensor directory and hyper-parameters), never the tensor data.

use std::collections::BTreeMap;
use std::path::Path;

use shardplane_crds::{ModelSpec, ModelStatus};
use shardplane_engine::gguf::GgufFile;

/// Why a model could not be resolved: a condition reason and a message.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Unresolved {
    /// CamelCase reason.
    pub reason: &'static str,
    /// What to do.
    pub message: String,
}

/// Bytes of KV cache one token takes in one layer, as the engines hold it (f32
/// keys and values).
pub fn kv_bytes_per_token_per_layer(kv_heads: u64, head_dim: u64) -> u64 {
    2 * kv_heads * head_dim * 4
}

/// Reads the model's metadata from a GGUF file at `path`.
pub fn resolve_gguf(path: &Path, spec: &ModelSpec) -> Result<ModelStatus, Unresolved> {
    let file = GgufFile::open(path).map_err(|e| Unresolved {
        reason: match e {
            shardplane_engine::Error::Io { .. } => "SourceUnreadable",
            shardplane_engine::Error::UnsupportedArchitecture(_) => "UnsupportedArchitecture",
            _ => "CorruptModel",
        },
        message: e.to_string(),
    })?;
    let c = file.config();
    let layers = c.layers;
    let layer_bytes: Vec<u64> = (0..layers)
        .map(|i| {
            let prefix = format!("blk.{i}.");
            file.content()
                .tensor_infos
                .keys()
                .filter(|n| n.starts_with(&prefix))
                .map(|n| file.tensor_bytes(n))
                .sum()
        })
        .collect();
    let embedding = file.tensor_bytes("token_embd.weight");
    let head = if file.has_tensor("output.weight") {
        file.tensor_bytes("output.weight")
    } else {
        embedding
    };
    // The weight type holding the most bytes names the quantization.
    let mut by_type: BTreeMap<String, u64> = BTreeMap::new();
    for (name, info) in &file.content().tensor_infos {
        *by_type.entry(format!("{:?}", info.ggml_dtype)).or_default() += file.tensor_bytes(name);
    }
    let quantization = by_type.into_iter().max_by_key(|(_, b)| *b).map(|(t, _)| t);
    let context = spec
        .max_context_length
        .map_or(c.context_length as u32, |max| {
            max.min(c.context_length as u32)
        });
    let kv_per_layer = kv_bytes_per_token_per_layer(c.kv_heads as u64, c.head_dim as u64);
    Ok(ModelStatus {
        architecture: Some(c.architecture.gguf_name().to_string()),
        layers: Some(layers as u32),
        hidden_size: Some(c.hidden_size as u32),
        attention_heads: Some(c.heads as u32),
        kv_heads: Some(c.kv_heads as u32),
        head_dim: Some(c.head_dim as u32),
        vocab_size: Some(c.vocab_size as u32),
        context_length: Some(context),
        quantization,
        embedding_bytes: Some(embedding),
        output_bytes: Some(head + file.tensor_bytes("output_norm.weight")),
        kv_bytes_per_token: Some(kv_per_layer * layers as u64),
        total_bytes: std::fs::metadata(path).ok().map(|m| m.len()),
        layer_bytes,
        ..Default::default()
    })
}
