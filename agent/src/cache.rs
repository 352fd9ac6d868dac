//! The model cache: weights downloaded from a URL (or a Hugging Face
//! repository) into a directory, resumable, verified, listed in the node's
//! status.

use std::collections::BTreeMap;
use std::io::{Read, Write};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};

use futures::StreamExt;
use sha2::{Digest, Sha256};
use shardplane_crds::CachedModel;

/// Where downloaded weights live, and what is there.
#[derive(Clone)]
pub struct Cache {
    dir: PathBuf,
    http: reqwest::Client,
    entries: Arc<Mutex<BTreeMap<String, CachedModel>>>,
    changed: Arc<tokio::sync::Notify>,
}

/// Why weights could not be had: a reason for the Shard's status and a message.
#[derive(Debug)]
pub struct Failure {
    /// CamelCase reason.
    pub reason: &'static str,
    /// What happened.
    pub message: String,
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

/// SHA-256 of a file, as hex.
pub fn sha256_file(path: &Path) -> std::io::Result<String> {
    let mut file = std::fs::File::open(path)?;
    let mut hasher = Sha256::new();
    let mut buf = vec![0u8; 1 << 20];
    loop {
        let n = file.read(&mut buf)?;
        if n == 0 {
            break;
        }
        hasher.update(&buf[..n]);
    }
    Ok(hex(&hasher.finalize()))
}

/// Hashes the file at `path` and, when `expected` is given, checks it;
/// `what` names the file in errors. Returns the SHA-256.
pub async fn verify_sha256(
    path: &Path,
    expected: Option<&str>,
    what: &str,
) -> Result<String, Failure> {
    let file = path.to_path_buf();
    let actual = tokio::task::spawn_blocking(move || sha256_file(&file))
        .await
        .map_err(|e| Failure {
            reason: "ChecksumFailed",
            message: e.to_string(),
        })?
        .map_err(|e| Failure {
            reason: "WeightsUnreadable",
            message: format!("{what}: {e}"),
        })?;
    match expected {
        Some(expected) if actual != expected => Err(Failure {
            reason: "ChecksumMismatch",
            message: format!(
                "{what} has SHA-256 {actual}, the Model says {expected}: the file is corrupt or another file"
            ),
        }),
        _ => Ok(actual),
    }
}

impl Cache {
    /// A cache in `dir` (created if missing).
    pub fn new(dir: PathBuf, http: reqwest::Client) -> std::io::Result<Self> {
        std::fs::create_dir_all(&dir)?;
        Ok(Cache {
            dir,
            http,
            entries: Arc::default(),
            changed: Arc::default(),
        })
    }

    /// The models in the cache, for the node's status.
    pub fn listed(&self) -> Vec<CachedModel> {
        self.entries
            .lock()
            .expect("cache lock")
            .values()
            .cloned()
            .collect()
    }

    /// Resolves once the listing changes (a model was added).
    pub async fn changed(&self) {
        self.changed.notified().await;
    }

    /// The file a model's key is cached in (`.partial` while it downloads).
    pub fn file_for(&self, key: &str) -> PathBuf {
        self.dir.join(format!(
            "{}.gguf",
            &hex(&Sha256::digest(key.as_bytes()))[..32]
        ))
    }

    /// The cached file of `key`, when it is whole (not being downloaded).
    pub fn complete_file(&self, key: &str) -> Option<PathBuf> {
        let path = self.file_for(key);
        path.is_file().then_some(path)
    }

    /// Makes sure the file at `url` is in the cache under `key`; returns its
    /// path. An interrupted download resumes where it stopped; `sha256`, when
    /// given, must match. `progress(done, total)` follows the download.
    pub async fn fetch(
        &self,
        key: &str,
        url: &str,
        sha256: Option<&str>,
        mut progress: impl FnMut(u64, Option<u64>),
    ) -> Result<PathBuf, Failure> {
        let path = self.file_for(key);
        let io = |e: std::io::Error| Failure {
            reason: "CacheUnwritable",
            message: format!("{}: {e}", self.dir.display()),
        };
        if !path.is_file() {
            let partial = path.with_extension("gguf.partial");
            let offset = std::fs::metadata(&partial).map(|m| m.len()).unwrap_or(0);
            let mut request = self.http.get(url);
            if offset > 0 {
                request = request.header(reqwest::header::RANGE, format!("bytes={offset}-"));
            }
            let unreachable = |e: String| Failure {
                reason: "DownloadFailed",
                message: format!("GET {url}: {e}"),
            };
            let response = request
                .send()
                .await
                .map_err(|e| unreachable(e.to_string()))?;
            let status = response.status();
            if !status.is_success() {
                return Err(unreachable(format!("HTTP {status}")));
            }
            // 206: the server continues where the partial file stops; 200: from the start.
            let resumed = status == reqwest::StatusCode::PARTIAL_CONTENT;
            let start = if resumed { offset } else { 0 };
            let total = response.content_length().map(|len| len + start);
            let mut file = std::fs::OpenOptions::new()
                .create(true)
                .append(resumed)
                .write(true)
                .truncate(!resumed)
                .open(&partial)
                .map_err(io)?;
            let mut done = start;
            progress(done, total);
            let mut stream = response.bytes_stream();
            let mut last = std::time::Instant::now();
            while let Some(chunk) = stream.next().await {
                let chunk = chunk.map_err(|e| unreachable(e.to_string()))?;
                file.write_all(&chunk).map_err(io)?;
                done += chunk.len() as u64;
                if last.elapsed().as_millis() >= 500 {
                    progress(done, total);
                    last = std::time::Instant::now();
                }
            }
            file.flush().map_err(io)?;
            progress(done, total);
            if total.is_some_and(|t| t != done) {
                return Err(unreachable(format!(
                    "the download stopped at {done} of {} bytes",
                    total.unwrap_or(0)
                )));
            }
            std::fs::rename(&partial, &path).map_err(io)?;
        }
        let actual = match verify_sha256(&path, sha256, url).await {
            Err(mut e) if e.reason == "ChecksumMismatch" => {
                let _ = std::fs::remove_file(&path);
                e.message.push_str(" (the download was discarded)");
                return Err(e);
            }
            other => other?,
        };
        let bytes = std::fs::metadata(&path).map(|m| m.len()).unwrap_or(0);
        self.entries.lock().expect("cache lock").insert(
            key.to_string(),
            CachedModel {
                key: key.to_string(),
                bytes,
                sha256: Some(actual),
            },
        );
        self.changed.notify_waiters();
        Ok(path)
    }
}
