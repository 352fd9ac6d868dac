//! Reading what placement needs of a model from its weights: the GGUF header
//! (tensor directory and hyper-parameters), never the tensor data — from a
//! path, or from a URL with HTTP range requests.

pub mod hub;
pub mod safetensors;

use std::collections::BTreeMap;
use std::path::Path;
use std::time::Duration;

use shardplane_crds::{Engine, EngineFootprint, ModelSpec, ModelStatus, SlidingWindowStatus};
use shardplane_formats::held::{HeldBytes, Holder};
use shardplane_formats::{GgufHeader, ModelConfig};

/// What can go wrong below a model's resolution: clients, tokens, headers.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// The HTTP client cannot be built (no TLS provider, bad settings).
    #[error("cannot build an HTTP client: {0}")]
    HttpClient(#[source] reqwest::Error),
    /// A Hugging Face token that cannot go in a header.
    #[error("the Hugging Face token holds characters a header cannot")]
    TokenNotAHeader,
    /// The Hugging Face token file cannot be read.
    #[error("cannot read the Hugging Face token file {}: {source}", path.display())]
    TokenUnreadable {
        /// The file.
        path: std::path::PathBuf,
        /// Why.
        source: std::io::Error,
    },
    /// A safetensors header that cannot be read.
    #[error(transparent)]
    Header(#[from] shardplane_formats::safetensors::HeaderError),
    /// A weights file that cannot be read.
    #[error("{0}")]
    Io(#[from] std::io::Error),
}

/// Why a model could not be resolved: a condition reason and a message.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{reason}: {message}")]
pub struct Unresolved {
    /// CamelCase reason.
    pub reason: &'static str,
    /// What to do.
    pub message: String,
}

/// The most layers a model may claim (the largest models have about 130).
pub const MAX_LAYERS: u64 = 4096;
/// The widest hidden state, head count or head dimension a model may claim
/// (the largest models are about 16k wide with 128 heads).
pub const MAX_WIDTH: u64 = 1 << 20;

/// Refuses a shape no real model has, before anything is sized by it.
fn check_shape(layers: u64, widths: [(&str, u64); 4]) -> Result<(), shardplane_formats::Error> {
    let too_large = |what: &str, found, limit| shardplane_formats::Error::TooLarge {
        what: what.into(),
        found,
        limit,
    };
    if layers == 0 || layers > MAX_LAYERS {
        return Err(too_large("the number of layers", layers, MAX_LAYERS));
    }
    match widths.into_iter().find(|(_, w)| *w > MAX_WIDTH) {
        Some((what, found)) => Err(too_large(what, found, MAX_WIDTH)),
        None => Ok(()),
    }
}

/// Runs `read` (a header's parse, which a hostile file can make slow) on a
/// blocking thread, off the async runtime, so no controller or lease renewal
/// waits on it; a panic in it becomes a `CorruptModel` reason, never a
/// stopped operator.
pub async fn off_runtime<T: Send + 'static>(
    origin: &str,
    read: impl FnOnce() -> T + Send + 'static,
) -> Result<T, Unresolved> {
    tokio::task::spawn_blocking(read).await.map_err(|e| {
        let why = match e.try_into_panic() {
            Ok(panic) => panic
                .downcast_ref::<&str>()
                .map(|s| s.to_string())
                .or_else(|| panic.downcast_ref::<String>().cloned())
                .unwrap_or_else(|| "a panic".into()),
            Err(e) => e.to_string(),
        };
        Unresolved {
            reason: "CorruptModel",
            message: format!("{origin}: reading the header failed: {why}"),
        }
    })
}

/// Reads the model's metadata from a GGUF file at `path`.
pub fn resolve_gguf(path: &Path, spec: &ModelSpec) -> Result<ModelStatus, Unresolved> {
    let unreadable = |e: std::io::Error| Unresolved {
        reason: "SourceUnreadable",
        message: format!("cannot read model file {}: {e}", path.display()),
    };
    let file = std::fs::File::open(path).map_err(unreadable)?;
    let size = file.metadata().map_err(unreadable)?.len();
    let header = GgufHeader::read(std::io::BufReader::new(file))
        .map_err(|e| format_unresolved(&path.display().to_string(), e))?;
    status_from_gguf(&header, spec, Some(size))
        .map_err(|e| format_unresolved(&path.display().to_string(), e))
}

/// Reads the model at a local `path`: a GGUF file, or a safetensors directory.
/// Blocking (run it with [`off_runtime`]).
pub fn resolve_path(
    path: &Path,
    format: shardplane_crds::ModelFormat,
    spec: &ModelSpec,
) -> Result<ModelStatus, Unresolved> {
    match format {
        shardplane_crds::ModelFormat::Gguf => resolve_gguf(path, spec),
        shardplane_crds::ModelFormat::Safetensors => safetensors::resolve_dir(path, spec),
    }
}

/// Each engine's figures: its weights as `held` counts them for it, and
/// the KV cache (`kv_per_layer` bytes a token and layer counted as f32,
/// over `layers` layers) in its precision.
pub(crate) fn engine_footprints(
    kv_per_layer: u64,
    layers: u64,
    held: impl Fn(Holder) -> HeldBytes,
) -> Vec<EngineFootprint> {
    [(Engine::Candle, Holder::Candle), (Engine::Mlx, Holder::Mlx)]
        .into_iter()
        .map(|(engine, holder)| {
            let held = held(holder);
            EngineFootprint {
                engine,
                layer_bytes: held.layer_bytes,
                embedding_bytes: held.embedding_bytes,
                output_bytes: held.output_bytes,
                kv_bytes_per_token: (kv_per_layer / 4)
                    .saturating_mul(holder.kv_element_bytes())
                    .saturating_mul(layers),
            }
        })
        .collect()
}

/// The sliding-window layers of a model of `layers` layers, as the status
/// reports them (`None`: it has none). `held_tokens` is the bound the
/// engines keep whatever the context; placement takes the least of it and
/// the context.
pub(crate) fn sliding_window(c: &ModelConfig, layers: usize) -> Option<SlidingWindowStatus> {
    let window = c.sliding?.window;
    let sliding: Vec<u32> = (0u32..)
        .zip(c.layer_windows(0..layers))
        .filter_map(|(l, w)| w.map(|_| l))
        .collect();
    if sliding.is_empty() {
        return None;
    }
    // Prompts go `PROMPT_STEP` tokens a step by default
    // (`--prefill-tokens-per-step`); an agent set to take more holds that
    // much more for a moment (its own KV budget counts its own step: the
    // agent's `KvCost`).
    let held = shardplane_formats::config::sliding_rows_held(
        window,
        shardplane_formats::config::PROMPT_STEP,
    );
    Some(SlidingWindowStatus {
        tokens: u32::try_from(window).unwrap_or(u32::MAX),
        held_tokens: u32::try_from(held).unwrap_or(u32::MAX),
        layers: sliding,
    })
}

pub(crate) fn format_unresolved(origin: &str, e: shardplane_formats::Error) -> Unresolved {
    Unresolved {
        reason: match e {
            shardplane_formats::Error::Io(_) => "SourceUnreadable",
            shardplane_formats::Error::UnsupportedArchitecture(_) => "UnsupportedArchitecture",
            _ => "CorruptModel",
        },
        message: format!("{origin}: {e}"),
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
        let owned_spec = spec.clone();
        let read = off_runtime(url, move || {
            GgufHeader::read(&bytes[..]).map(|h| status_from_gguf(&h, &owned_spec, total))
        })
        .await?;
        match read {
            Ok(status) => return status.map_err(|e| format_unresolved(url, e)),
            // A header longer than the window: fetch more, unless that was all there is.
            Err(shardplane_formats::Error::Corrupt(_)) if !whole && window < LARGEST_WINDOW => {
                window *= 4;
            }
            Err(e) => return Err(format_unresolved(url, e)),
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

/// What placement needs, from a GGUF header.
fn status_from_gguf(
    header: &GgufHeader,
    spec: &ModelSpec,
    total_bytes: Option<u64>,
) -> Result<ModelStatus, shardplane_formats::Error> {
    let c = ModelConfig::from_gguf(header)?;
    let layers = c.layers;
    check_shape(
        layers as u64,
        [
            ("the hidden size", c.hidden_size as u64),
            ("the number of attention heads", c.heads as u64),
            ("the number of key/value heads", c.kv_heads as u64),
            ("the head dimension", c.head_dim as u64),
        ],
    )?;
    let stored = Holder::Stored.held(header, layers);
    // The weight type holding the most bytes names the quantization.
    let mut by_type: BTreeMap<&str, u64> = BTreeMap::new();
    for info in header.tensors.values() {
        let sum = by_type.entry(info.dtype.name()).or_default();
        *sum = sum.saturating_add(info.bytes);
    }
    let quantization = by_type
        .into_iter()
        .max_by_key(|(_, b)| *b)
        .map(|(t, _)| t.to_string());
    let context = spec
        .max_context_length
        .map_or(c.context_length as u32, |max| {
            max.min(c.context_length as u32)
        });
    // Bounded by check_shape (and the latent widths by the reader).
    let kv_per_layer = c.kv_bytes_per_token_per_layer() as u64;
    Ok(ModelStatus {
        architecture: Some(c.architecture.gguf_name().to_string()),
        layers: Some(layers as u32),
        hidden_size: Some(c.hidden_size as u32),
        attention_heads: Some(c.heads as u32),
        kv_heads: Some(c.kv_heads as u32),
        head_dim: Some(c.head_dim as u32),
        experts: c.moe.as_ref().map(|m| m.experts as u32),
        experts_per_token: c.moe.as_ref().map(|m| m.experts_per_token as u32),
        vocab_size: Some(c.vocab_size as u32),
        context_length: Some(context),
        quantization,
        embedding_bytes: Some(stored.embedding_bytes),
        output_bytes: Some(stored.output_bytes),
        kv_bytes_per_token: Some(kv_per_layer.saturating_mul(layers as u64)),
        engine_footprints: engine_footprints(kv_per_layer, layers as u64, |holder| {
            holder.held(header, layers)
        }),
        sliding_window: sliding_window(&c, layers),
        total_bytes,
        layer_bytes: stored.layer_bytes,
        ..Default::default()
    })
}

/// The public Hugging Face hub.
pub const HUGGING_FACE_HUB: &str = "https://huggingface.co";

/// An HTTP client for model sources (rustls with the ring provider, as kube uses).
pub fn http_client() -> Result<reqwest::Client, Error> {
    client(reqwest::Client::builder().timeout(Duration::from_secs(120)))
}

/// An HTTP client for downloading weights: a connect timeout and an idle
/// timeout (`idle` without a byte read), never a total deadline, so a 50 GB
/// file at 30 MB/s finishes.
pub fn download_client(idle: Duration) -> Result<reqwest::Client, Error> {
    client(reqwest::Client::builder().read_timeout(idle))
}

/// An HTTP client from `builder`, with this crate's user agent, a connect
/// timeout and the process's TLS provider.
pub fn client(builder: reqwest::ClientBuilder) -> Result<reqwest::Client, Error> {
    // Several crates bring rustls; name the provider once for the process.
    let _ = rustls::crypto::ring::default_provider().install_default();
    builder
        .user_agent(concat!("shardplane/", env!("CARGO_PKG_VERSION")))
        .connect_timeout(Duration::from_secs(10))
        .build()
        .map_err(Error::HttpClient)
}
