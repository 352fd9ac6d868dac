//! Reading what placement needs of a model from its weights: the GGUF header
//! (tensor directory and hyper-parameters), never the tensor data — from a
//! path, or from a URL with HTTP range requests.

pub mod safetensors;

use std::collections::BTreeMap;
use std::path::Path;
use std::time::Duration;

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
    let file = GgufFile::open(path).map_err(engine_unresolved)?;
    Ok(status_from_gguf(
        &file,
        spec,
        std::fs::metadata(path).ok().map(|m| m.len()),
    ))
}

fn engine_unresolved(e: shardplane_engine::Error) -> Unresolved {
    Unresolved {
        reason: match e {
            shardplane_engine::Error::Io { .. } => "SourceUnreadable",
            shardplane_engine::Error::UnsupportedArchitecture(_) => "UnsupportedArchitecture",
            _ => "CorruptModel",
        },
        message: e.to_string(),
    }
}

/// The first bytes fetched of a remote file; doubled while the header is longer.
const FIRST_WINDOW: u64 = 4 << 20;
/// The most of a remote file read for its header.
const LARGEST_WINDOW: u64 = 128 << 20;

/// Reads the metadata of a remote GGUF file from its header alone, fetched
/// with HTTP range requests.
pub async fn resolve_gguf_url(
    client: &reqwest::Client,
    url: &str,
    spec: &ModelSpec,
) -> Result<ModelStatus, Unresolved> {
    let unreachable = |message: String| Unresolved {
        reason: "SourceUnreachable",
        message,
    };
    let mut window = FIRST_WINDOW;
    loop {
        let response = client
            .get(url)
            .header(reqwest::header::RANGE, format!("bytes=0-{}", window - 1))
            .send()
            .await
            .map_err(|e| unreachable(format!("GET {url}: {e}")))?;
        let status = response.status();
        if !status.is_success() {
            return Err(unreachable(format!("GET {url}: HTTP {status}")));
        }
        // "bytes 0-N/TOTAL" on a range answer; the whole length otherwise.
        let total = response
            .headers()
            .get(reqwest::header::CONTENT_RANGE)
            .and_then(|v| v.to_str().ok())
            .and_then(|v| v.rsplit('/').next())
            .and_then(|t| t.parse::<u64>().ok())
            .or(response.content_length());
        let mut bytes = Vec::with_capacity(window as usize);
        let mut stream = response.bytes_stream();
        while let Some(chunk) = futures::StreamExt::next(&mut stream).await {
            let chunk = chunk.map_err(|e| unreachable(format!("GET {url}: {e}")))?;
            bytes.extend_from_slice(&chunk);
            if bytes.len() as u64 >= window {
                // A server that ignores ranges sends everything: stop at the window.
                bytes.truncate(window as usize);
                break;
            }
        }
        let whole = total.is_some_and(|t| bytes.len() as u64 >= t);
        match GgufFile::from_header(url, &mut std::io::Cursor::new(&bytes)) {
            Ok(file) => return Ok(status_from_gguf(&file, spec, total)),
            // A header longer than the window: fetch more, unless that was all there is.
            Err(shardplane_engine::Error::CorruptModel { .. })
                if !whole && window < LARGEST_WINDOW =>
            {
                window *= 4;
            }
            Err(e) => return Err(engine_unresolved(e)),
        }
    }
}

/// The URL of a file in a Hugging Face repository, on `endpoint`.
pub fn hugging_face_url(endpoint: &str, repo: &str, file: &str, revision: Option<&str>) -> String {
    format!(
        "{}/{repo}/resolve/{}/{file}",
        endpoint.trim_end_matches('/'),
        revision.unwrap_or("main")
    )
}

/// What placement needs, from an opened GGUF header.
fn status_from_gguf(file: &GgufFile, spec: &ModelSpec, total_bytes: Option<u64>) -> ModelStatus {
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
    ModelStatus {
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
        total_bytes,
        layer_bytes,
        ..Default::default()
    }
}

/// The public Hugging Face hub.
pub const HUGGING_FACE_HUB: &str = "https://huggingface.co";

/// An HTTP client for model sources (rustls with the ring provider, as kube uses).
pub fn http_client() -> Result<reqwest::Client, String> {
    // Several crates bring rustls; name the provider once for the process.
    let _ = rustls::crypto::ring::default_provider().install_default();
    reqwest::Client::builder()
        .user_agent(concat!("shardplane/", env!("CARGO_PKG_VERSION")))
        .connect_timeout(Duration::from_secs(10))
        .timeout(Duration::from_secs(120))
        .build()
        .map_err(|e| format!("cannot build an HTTP client: {e}"))
}
