//! Safetensors models (the MLX-community layout): `config.json` for the
//! hyper-parameters and each weights file's header for tensor sizes. Only
//! headers are read: a local directory, or a Hugging Face repository with
//! HTTP range requests.

use std::collections::BTreeMap;
use std::path::Path;

use serde_json::Value;
use shardplane_crds::{ModelSpec, ModelStatus};
use shardplane_formats::held::HeldBytes;
use shardplane_formats::safetensors::HeaderError;
pub use shardplane_formats::safetensors::{
    MAX_HEADER, TensorEntry, header_len, parse_header, parse_tensors,
};

use crate::{Error, MAX_LAYERS, Unresolved, check_shape, format_unresolved, off_runtime};

/// The longest `config.json` or index accepted.
const MAX_JSON: u64 = 16 << 20;
/// The most weight files one model may list.
const MAX_FILES: usize = 4096;

fn field(config: &Value, key: &str) -> Option<u64> {
    config.get(key).and_then(Value::as_u64)
}

/// What placement needs, from `config.json` and the tensors' directory.
pub fn status_from(
    config: &Value,
    tensors: &BTreeMap<String, TensorEntry>,
    spec: &ModelSpec,
) -> Result<ModelStatus, Unresolved> {
    let bad = |message: String| Unresolved {
        reason: "CorruptModel",
        message,
    };
    // The engines' own reading of config.json: the same families, and the
    // same refusals. An unknown family first, before any number is asked for.
    let parsed = shardplane_formats::ModelConfig::from_hf_json(config);
    if let Err(e @ shardplane_formats::Error::UnsupportedArchitecture(_)) = parsed {
        return Err(format_unresolved("config.json", e));
    }
    let need =
        |key: &str| field(config, key).ok_or_else(|| bad(format!("config.json has no {key}")));
    let layers = need("num_hidden_layers")?;
    let hidden = need("hidden_size")?;
    let heads = need("num_attention_heads")?;
    let kv_heads = field(config, "num_key_value_heads").unwrap_or(heads);
    let head_dim = field(config, "head_dim").unwrap_or(hidden / heads.max(1));
    check_shape(
        layers,
        [
            ("hidden_size", hidden),
            ("num_attention_heads", heads),
            ("num_key_value_heads", kv_heads),
            ("head_dim", head_dim),
        ],
    )
    .map_err(|e| bad(format!("config.json: {e}")))?;
    // Then whatever else the engines would refuse (impossible routing, say).
    let parsed = parsed.map_err(|e| format_unresolved("config.json", e))?;
    let architecture = parsed.architecture.gguf_name();
    let context = field(config, "max_position_embeddings")
        .unwrap_or(4096)
        .min(u32::MAX.into()) as u32;
    debug_assert!(layers <= MAX_LAYERS);
    let stored = grouped(tensors, layers as usize, &|_, e| {
        e.offsets.1.saturating_sub(e.offsets.0)
    });
    let bits = |module: &str| quantized_bits(config, module);
    // Bounded by check_shape and the reader.
    let kv_per_layer = parsed.kv_bytes_per_token_per_layer() as u64;
    let engine_footprints = crate::engine_footprints(kv_per_layer, layers, |holder| {
        grouped(tensors, layers as usize, &|name, e| {
            holder.safetensors_bytes(name, e, tensors, &bits)
        })
    });
    let quantization = config
        .get("quantization")
        .and_then(|q| q.get("bits"))
        .and_then(Value::as_u64)
        .map(|bits| format!("{bits}bit"))
        .or_else(|| {
            config
                .get("torch_dtype")
                .and_then(Value::as_str)
                .map(str::to_uppercase)
        });
    Ok(ModelStatus {
        architecture: Some(architecture.into()),
        layers: Some(layers as u32),
        hidden_size: Some(hidden as u32),
        attention_heads: Some(heads as u32),
        kv_heads: Some(kv_heads as u32),
        head_dim: Some(head_dim as u32),
        experts: parsed.moe.as_ref().map(|m| m.experts as u32),
        experts_per_token: parsed.moe.as_ref().map(|m| m.experts_per_token as u32),
        vocab_size: field(config, "vocab_size").map(|v| v as u32),
        context_length: Some(spec.max_context_length.map_or(context, |m| m.min(context))),
        quantization,
        embedding_bytes: Some(stored.embedding_bytes),
        output_bytes: Some(stored.output_bytes),
        // As MLX holds it (f32; latent attention's compressed row).
        kv_bytes_per_token: Some(kv_per_layer.saturating_mul(layers)),
        engine_footprints,
        sliding_window: crate::sliding_window(&parsed, layers as usize),
        total_bytes: Some(tensors.values().fold(0u64, |sum, e| {
            sum.saturating_add(e.offsets.1.saturating_sub(e.offsets.0))
        })),
        layer_bytes: stored.layer_bytes,
        ..Default::default()
    })
}

/// The tensors' bytes (`bytes_of` each) grouped as placement counts them:
/// per layer (`model.layers.<i>.…`), the embedding, the head and final norm
/// (the embedding again when tied: a last stage elsewhere holds its own).
fn grouped(
    tensors: &BTreeMap<String, TensorEntry>,
    layers: usize,
    bytes_of: &dyn Fn(&str, &TensorEntry) -> u64,
) -> HeldBytes {
    let sum = |prefix: &str| {
        tensors
            .iter()
            .filter(|(n, _)| n.starts_with(prefix))
            .fold(0u64, |sum, (n, e)| sum.saturating_add(bytes_of(n, e)))
    };
    let mut layer_bytes = vec![0u64; layers];
    for (name, entry) in tensors {
        let layer = name
            .strip_prefix("model.layers.")
            .and_then(|rest| rest.split_once('.'))
            .and_then(|(i, _)| i.parse::<usize>().ok());
        if let Some(slot) = layer.and_then(|i| layer_bytes.get_mut(i)) {
            *slot = slot.saturating_add(bytes_of(name, entry));
        }
    }
    let embedding = sum("model.embed_tokens.");
    let head = match sum("lm_head.") {
        0 => embedding, // tied embeddings
        b => b,
    };
    HeldBytes {
        layer_bytes,
        embedding_bytes: embedding,
        output_bytes: head.saturating_add(sum("model.norm.")),
    }
}

/// The bits of a quantized module's codes: its own entry in
/// `config.json`'s `quantization`, else the default there.
fn quantized_bits(config: &Value, module: &str) -> Option<u64> {
    let q = config.get("quantization")?;
    q.get(module)
        .and_then(|own| own.get("bits"))
        .or_else(|| q.get("bits"))
        .and_then(Value::as_u64)
}

/// Reads a local safetensors model directory.
pub fn resolve_dir(dir: &Path, spec: &ModelSpec) -> Result<ModelStatus, Unresolved> {
    let unreadable = |message: String| Unresolved {
        reason: "SourceUnreadable",
        message,
    };
    let config_path = dir.join("config.json");
    let config: Value = serde_json::from_slice(
        &std::fs::read(&config_path)
            .map_err(|e| unreadable(format!("{}: {e}", config_path.display())))?,
    )
    .map_err(|e| Unresolved {
        reason: "CorruptModel",
        message: format!("{}: {e}", config_path.display()),
    })?;
    let mut tensors = BTreeMap::new();
    let entries =
        std::fs::read_dir(dir).map_err(|e| unreadable(format!("{}: {e}", dir.display())))?;
    for entry in entries.flatten() {
        let path = entry.path();
        if path.extension().and_then(|e| e.to_str()) != Some("safetensors") {
            continue;
        }
        let header = read_header_file(&path).map_err(|e| Unresolved {
            reason: "CorruptModel",
            message: format!("{}: {e}", path.display()),
        })?;
        tensors.extend(header);
    }
    if tensors.is_empty() {
        return Err(unreadable(format!(
            "{} holds no .safetensors file",
            dir.display()
        )));
    }
    status_from(&config, &tensors, spec)
}

/// The size a safetensors file at `path` must have: its header and every
/// tensor's bytes (the format leaves no holes), so a truncated download is
/// told from a whole one.
pub fn expected_file_size(path: &Path) -> Result<u64, Error> {
    let tensors = read_header_file(path)?;
    let mut first = [0u8; 8];
    std::io::Read::read_exact(&mut std::fs::File::open(path)?, &mut first)?;
    let header = header_len(&first).unwrap_or(0);
    Ok(tensors.values().fold(header, |sum, e| {
        sum.saturating_add(e.offsets.1.saturating_sub(e.offsets.0))
    }))
}

fn read_header_file(path: &Path) -> Result<BTreeMap<String, TensorEntry>, Error> {
    use std::io::Read;
    let mut file = std::fs::File::open(path)?;
    let mut first = [0u8; 8];
    file.read_exact(&mut first)?;
    let len = header_len(&first).ok_or(HeaderError::HeaderTooLarge(u64::MAX))?;
    if len > MAX_HEADER {
        return Err(HeaderError::HeaderTooLarge(len).into());
    }
    let mut bytes = first.to_vec();
    bytes.resize(len as usize, 0);
    file.read_exact(&mut bytes[8..])
        .map_err(|_| HeaderError::HeaderCutShort(len))?;
    Ok(parse_tensors(&bytes)?)
}

/// A weights file's name as an index lists it: a relative path inside the
/// repository, never `..`, an absolute path or a URL's query.
pub fn is_plain_file_name(name: &str) -> bool {
    !name.is_empty()
        && name.len() <= 255
        && name
            .split('/')
            .all(|part| !part.is_empty() && part != "." && part != "..")
        && name
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b"._-/".contains(&b))
}

/// Reads a safetensors model in a Hugging Face repository at `base`
/// (`<endpoint>/<repo>/resolve/<revision>`): `config.json`, the index of
/// weight files (or the single `model.safetensors`), and each file's header.
pub async fn resolve_repo(
    client: &reqwest::Client,
    base: &str,
    spec: &ModelSpec,
) -> Result<ModelStatus, Unresolved> {
    let unreachable = |message: String| Unresolved {
        reason: "SourceUnreachable",
        message,
    };
    // Every answer is read up to a limit: a server that ignores the range
    // (or lies about a length) cannot make the operator hold more.
    let get = |path: &str, range: Option<(u64, u64)>, limit: u64| {
        let url = format!("{base}/{path}");
        let mut req = client.get(&url);
        if let Some((a, b)) = range {
            req = req.header(reqwest::header::RANGE, format!("bytes={a}-{b}"));
        }
        async move {
            let resp = req.send().await.map_err(|e| format!("GET {url}: {e}"))?;
            let status = resp.status();
            let mut bytes = Vec::new();
            let mut stream = resp.bytes_stream();
            while let Some(chunk) = futures::StreamExt::next(&mut stream).await {
                let chunk = chunk.map_err(|e| format!("GET {url}: {e}"))?;
                let room = (limit as usize).saturating_sub(bytes.len());
                bytes.extend_from_slice(&chunk[..chunk.len().min(room)]);
                if bytes.len() as u64 >= limit {
                    break;
                }
            }
            Ok::<_, String>((status, bytes))
        }
    };
    let (status, config) = get("config.json", None, MAX_JSON)
        .await
        .map_err(unreachable)?;
    if !status.is_success() {
        return Err(unreachable(format!(
            "GET {base}/config.json: HTTP {status}"
        )));
    }
    let config: Value = serde_json::from_slice(&config).map_err(|e| Unresolved {
        reason: "CorruptModel",
        message: format!("config.json: {e}"),
    })?;
    let (status, index) = get("model.safetensors.index.json", None, MAX_JSON)
        .await
        .map_err(unreachable)?;
    let files: Vec<String> = if status.is_success() {
        let index: Value = serde_json::from_slice(&index).map_err(|e| Unresolved {
            reason: "CorruptModel",
            message: format!("model.safetensors.index.json: {e}"),
        })?;
        let mut files: Vec<String> = index["weight_map"]
            .as_object()
            .map(|m| {
                m.values()
                    .filter_map(Value::as_str)
                    .map(str::to_string)
                    .collect()
            })
            .unwrap_or_default();
        files.sort();
        files.dedup();
        files
    } else {
        vec!["model.safetensors".into()]
    };
    let corrupt = |message: String| Unresolved {
        reason: "CorruptModel",
        message,
    };
    if files.len() > MAX_FILES {
        return Err(corrupt(format!(
            "model.safetensors.index.json lists {} weight files, more than the {MAX_FILES} accepted",
            files.len()
        )));
    }
    if let Some(odd) = files.iter().find(|f| !is_plain_file_name(f)) {
        return Err(corrupt(format!(
            "model.safetensors.index.json names {odd:?}, which is not a file of the repository"
        )));
    }
    let mut tensors = BTreeMap::new();
    for file in &files {
        let (status, first) = get(file, Some((0, 7)), 8).await.map_err(unreachable)?;
        if !status.is_success() {
            return Err(unreachable(format!("GET {base}/{file}: HTTP {status}")));
        }
        let len = header_len(&first).ok_or_else(|| corrupt(format!("{file}: no header length")))?;
        if len > MAX_HEADER {
            return Err(corrupt(format!(
                "{file}: {}",
                HeaderError::HeaderTooLarge(len)
            )));
        }
        let (_, header) = get(file, Some((0, len - 1)), len)
            .await
            .map_err(unreachable)?;
        let parsed = off_runtime(file, move || parse_tensors(&header))
            .await?
            .map_err(|e| corrupt(format!("{file}: {e}")))?;
        tensors.extend(parsed);
    }
    status_from(&config, &tensors, spec)
}

#[cfg(test)]
mod tests {
    use super::*;
    use shardplane_crds::Engine;

    /// A directory of one 10×10 BF16 tensor (200 bytes).
    fn one_tensor(name: &str) -> BTreeMap<String, TensorEntry> {
        let entry = TensorEntry {
            dtype: "BF16".into(),
            shape: vec![10, 10],
            offsets: (0, 200),
        };
        BTreeMap::from([(name.to_string(), entry)])
    }

    /// What each engine holds of a 4-bit MLX-community model: candle the
    /// values as Q8_0 (scales and biases folded in), MLX the codes as
    /// stored with f32 scales and biases; both the norms as f32.
    #[test]
    fn each_engine_s_bytes_follow_its_reading_of_the_layout() {
        let config = serde_json::json!({
            "model_type": "llama", "hidden_size": 64, "num_hidden_layers": 1,
            "intermediate_size": 128, "num_attention_heads": 4, "num_key_value_heads": 2,
            "vocab_size": 256, "max_position_embeddings": 512,
            "quantization": {"bits": 4, "group_size": 32,
                             "model.layers.0.mlp.down_proj": {"bits": 8, "group_size": 32}},
        });
        let entry = |dtype: &str, shape: &[u64], bytes: u64| TensorEntry {
            dtype: dtype.into(),
            shape: shape.to_vec(),
            offsets: (0, bytes),
        };
        let tensors = BTreeMap::from([
            // 128 × 64 at 4 bits: 8 words a row; 2 groups a row.
            (
                "model.layers.0.mlp.up_proj.weight".to_string(),
                entry("U32", &[128, 8], 4096),
            ),
            (
                "model.layers.0.mlp.up_proj.scales".to_string(),
                entry("BF16", &[128, 2], 512),
            ),
            (
                "model.layers.0.mlp.up_proj.biases".to_string(),
                entry("BF16", &[128, 2], 512),
            ),
            // 64 × 128 at 8 bits: 32 words a row; 4 groups a row.
            (
                "model.layers.0.mlp.down_proj.weight".to_string(),
                entry("U32", &[64, 32], 8192),
            ),
            (
                "model.layers.0.mlp.down_proj.scales".to_string(),
                entry("BF16", &[64, 4], 512),
            ),
            (
                "model.layers.0.mlp.down_proj.biases".to_string(),
                entry("BF16", &[64, 4], 512),
            ),
            (
                "model.layers.0.input_layernorm.weight".to_string(),
                entry("BF16", &[64], 128),
            ),
            (
                "model.embed_tokens.weight".to_string(),
                entry("BF16", &[256, 64], 32768),
            ),
            ("model.norm.weight".to_string(), entry("BF16", &[64], 128)),
        ]);
        let spec: ModelSpec = serde_json::from_value(serde_json::json!({
            "source": {"path": {"path": "/models/tiny"}}, "format": "safetensors",
        }))
        .unwrap();
        let status = status_from(&config, &tensors, &spec).unwrap();
        assert_eq!(status.layer_bytes, [4096 + 512 * 4 + 8192 + 128]);
        let held = |engine| {
            status
                .engine_footprints
                .iter()
                .find(|e| e.engine == engine)
                .unwrap()
                .clone()
        };
        let (candle, mlx) = (held(Engine::Candle), held(Engine::Mlx));
        // Two 8192-value matrices as Q8_0 (34 bytes a block of 32), a norm in f32.
        assert_eq!(candle.layer_bytes, [2 * 8192 / 32 * 34 + 256]);
        // The codes as stored, 2 × 256 + 2 × 256 scales and biases as f32, the norm.
        assert_eq!(mlx.layer_bytes, [4096 + 8192 + 1024 * 4 + 256]);
        // Tied: the head is the embedding again, with the final norm.
        assert_eq!(candle.embedding_bytes, 256 * 64 / 32 * 34);
        assert_eq!(candle.output_bytes, 256 * 64 / 32 * 34 + 256);
        assert_eq!(mlx.embedding_bytes, 256 * 64 * 4);
        // KV: 2 heads × 16 × keys and values, f16 on candle, f32 on MLX.
        assert_eq!(candle.kv_bytes_per_token, 2 * 2 * 16 * 2);
        assert_eq!(mlx.kv_bytes_per_token, 2 * 2 * 16 * 4);
    }

    /// DeepSeek V3's KV bytes are its compressed row's: 576 floats per token
    /// and layer, not 128 heads' keys and values.
    #[test]
    fn latent_attention_counts_its_compressed_row() {
        let config = serde_json::json!({
            "model_type": "deepseek_v3",
            "hidden_size": 7168, "num_hidden_layers": 61, "intermediate_size": 18432,
            "num_attention_heads": 128, "num_key_value_heads": 128,
            "vocab_size": 129280, "max_position_embeddings": 163840,
            "q_lora_rank": 1536, "kv_lora_rank": 512, "qk_nope_head_dim": 128,
            "qk_rope_head_dim": 64, "v_head_dim": 128,
            "n_routed_experts": 256, "n_shared_experts": 1, "num_experts_per_tok": 8,
            "moe_intermediate_size": 2048, "first_k_dense_replace": 3,
            "n_group": 8, "topk_group": 4, "routed_scaling_factor": 2.5,
        });
        let tensors = one_tensor("model.layers.0.mlp.gate.weight");
        let spec: ModelSpec = serde_json::from_value(serde_json::json!({
            "source": {"path": {"path": "/models/deepseek-v3"}},
            "format": "safetensors",
        }))
        .unwrap();
        let status = status_from(&config, &tensors, &spec).unwrap();
        assert_eq!(status.kv_bytes_per_token, Some(61 * 576 * 4));
        assert_eq!(status.experts, Some(256));
    }

    /// Gemma 3 27B's shape: 62 layers, every sixth global, the others in a
    /// window of 1024; the status names the sliding ones and what they hold.
    #[test]
    fn sliding_layers_are_reported_with_what_they_hold() {
        let config = serde_json::json!({
            "model_type": "gemma3_text",
            "hidden_size": 5376, "num_hidden_layers": 62, "intermediate_size": 21504,
            "num_attention_heads": 32, "num_key_value_heads": 16, "head_dim": 128,
            "vocab_size": 262208, "max_position_embeddings": 131072,
            "sliding_window": 1024, "sliding_window_pattern": 6,
            "rope_theta": 1_000_000.0, "rope_local_base_freq": 10_000.0,
            "query_pre_attn_scalar": 168,
        });
        let tensors = one_tensor("model.layers.0.mlp.gate_proj.weight");
        let spec: ModelSpec = serde_json::from_value(serde_json::json!({
            "source": {"path": {"path": "/models/gemma-3-27b"}},
            "format": "safetensors",
        }))
        .unwrap();
        let status = status_from(&config, &tensors, &spec).unwrap();
        let sliding = status.sliding_window.expect("Gemma 3 slides");
        assert_eq!(sliding.tokens, 1024);
        // The window, one more for the prefix cache, one not let go yet, a
        // chunk of rounding and a step's prompt rows.
        assert_eq!(sliding.held_tokens, 1024 * 3 + 256 + 512);
        assert_eq!(
            sliding.layers.len(),
            62 - 10,
            "layers 5, 11, …, 59 are global"
        );
        assert!(!sliding.layers.contains(&5) && sliding.layers.contains(&61));
        // A model without a window reports none.
        let mut dense = config.clone();
        dense["model_type"] = "llama".into();
        let status = status_from(&dense, &tensors, &spec).unwrap();
        assert_eq!(status.sliding_window, None);
    }
}
