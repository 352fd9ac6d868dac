//! The model cache: weights downloaded from a URL (or a Hugging Face
//! repository) into a directory, resumable, verified, listed in the node's
//! status.

use std::collections::BTreeMap;
use std::io::Read;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};

use sha2::{Digest, Sha256};
use shardplane_crds::CachedModel;

/// How long a download may go without a byte before it counts as stalled
/// (there is no total deadline).
pub const DOWNLOAD_IDLE: std::time::Duration = std::time::Duration::from_secs(30);

/// Where downloaded weights live, and what is there.
#[derive(Clone)]
pub struct Cache {
    dir: PathBuf,
    http: reqwest::Client,
    /// The Hugging Face hub's endpoint and the client carrying its token,
    /// used for URLs on that endpoint only.
    hub: Option<(String, reqwest::Client)>,
    entries: Arc<Mutex<BTreeMap<String, CachedModel>>>,
    changed: Arc<tokio::sync::Notify>,
    budget: Option<u64>,
    pins: Arc<Mutex<BTreeMap<String, usize>>>,
    /// One lock per model key: two stages of one model starting at once (two
    /// deployments of it on this node, or a stage reloading while the old
    /// fetch runs) fetch one after the other, never into the same `.partial`
    /// — a GGUF file from a peer or its source, or a repository's files.
    fetch_locks: Arc<Mutex<BTreeMap<String, Arc<tokio::sync::Mutex<()>>>>>,
}

/// What the cache knows of a file, kept beside it (`<file>.json`) so the
/// listing survives restarts.
#[derive(serde::Serialize, serde::Deserialize)]
struct Sidecar {
    key: String,
    sha256: Option<String>,
}

/// Why weights could not be had: a reason for the Shard's status and a message.
#[derive(Debug)]
pub struct Failure {
    /// CamelCase reason.
    pub reason: &'static str,
    /// What happened.
    pub message: String,
}

/// Bytes of the files under `dir`.
fn dir_bytes(dir: &Path) -> u64 {
    let Ok(entries) = std::fs::read_dir(dir) else {
        return 0;
    };
    entries
        .filter_map(Result::ok)
        .map(|e| match e.file_type() {
            Ok(t) if t.is_dir() => dir_bytes(&e.path()),
            _ => e.metadata().map(|m| m.len()).unwrap_or(0),
        })
        .sum()
}

pub(crate) fn hex(bytes: &[u8]) -> String {
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
    /// A cache in `dir` (created if missing) without a size budget; the
    /// models already there are listed.
    pub fn new(dir: PathBuf, http: reqwest::Client) -> std::io::Result<Self> {
        std::fs::create_dir_all(&dir)?;
        let mut entries = BTreeMap::new();
        for entry in std::fs::read_dir(&dir)? {
            let path = entry?.path();
            if path.extension().is_none_or(|e| e != "json") {
                continue;
            }
            let model = path.with_extension("gguf");
            let repository = path.with_extension("safetensors");
            let bytes = match std::fs::metadata(&model) {
                Ok(meta) => meta.len(),
                Err(_) if repository.is_dir() => dir_bytes(&repository),
                Err(_) => continue,
            };
            let Ok(text) = std::fs::read_to_string(&path) else {
                continue;
            };
            if let Ok(side) = serde_json::from_str::<Sidecar>(&text) {
                entries.insert(
                    side.key.clone(),
                    CachedModel {
                        key: side.key,
                        bytes,
                        sha256: side.sha256,
                    },
                );
            }
        }
        Ok(Cache {
            dir,
            http,
            hub: None,
            entries: Arc::new(Mutex::new(entries)),
            changed: Arc::default(),
            budget: None,
            pins: Arc::default(),
            fetch_locks: Arc::default(),
        })
    }

    /// Keeps the cache within `bytes`: least recently used models no shard
    /// uses are evicted to make room.
    pub fn with_budget(mut self, bytes: Option<u64>) -> Self {
        self.budget = bytes;
        self
    }

    /// Downloads from the Hugging Face hub at `endpoint` with `client` (the
    /// one carrying the hub token); every other URL keeps the plain client.
    pub fn with_hub(mut self, endpoint: &str, client: reqwest::Client) -> Self {
        self.hub = Some((endpoint.to_string(), client));
        self
    }

    /// The client for `url`: on the hub only, the hub's (with the node's
    /// token), or `own` (with a Model's token) when given.
    pub(crate) fn client_for<'a>(
        &'a self,
        url: &str,
        own: Option<&'a reqwest::Client>,
    ) -> &'a reqwest::Client {
        match &self.hub {
            Some((endpoint, client)) if shardplane_models::hub::is_on(endpoint, url) => {
                own.unwrap_or(client)
            }
            _ => &self.http,
        }
    }

    /// Marks `key` as used by a shard: it is never evicted while pinned.
    pub fn pin(&self, key: &str) {
        *self
            .pins
            .lock()
            .expect("pin lock")
            .entry(key.to_string())
            .or_default() += 1;
    }

    /// Undoes one [`Cache::pin`].
    pub fn unpin(&self, key: &str) {
        let mut pins = self.pins.lock().expect("pin lock");
        if let Some(n) = pins.get_mut(key) {
            *n -= 1;
            if *n == 0 {
                pins.remove(key);
            }
        }
    }

    /// Bytes of the models in the cache.
    pub fn total_bytes(&self) -> u64 {
        self.entries
            .lock()
            .expect("cache lock")
            .values()
            .map(|m| m.bytes)
            .sum()
    }

    /// Evicts least recently used, unpinned models until `needed` more bytes
    /// fit the budget; returns the evicted keys. Pinned models stay even when
    /// the budget cannot be met.
    pub fn make_room(&self, needed: u64) -> Vec<String> {
        let Some(budget) = self.budget else {
            return Vec::new();
        };
        let pins = self.pins.lock().expect("pin lock").clone();
        let mut entries = self.entries.lock().expect("cache lock");
        let mut total: u64 = entries.values().map(|m| m.bytes).sum();
        let mut idle: Vec<(std::time::SystemTime, String)> = entries
            .keys()
            .filter(|k| !pins.contains_key(*k))
            .map(|k| {
                let used = std::fs::metadata(self.file_for(k))
                    .or_else(|_| std::fs::metadata(self.repository_dir(k)))
                    .and_then(|m| m.modified())
                    .unwrap_or(std::time::UNIX_EPOCH);
                (used, k.clone())
            })
            .collect();
        idle.sort();
        let mut evicted = Vec::new();
        for (_, key) in idle {
            if total + needed <= budget {
                break;
            }
            let path = self.file_for(&key);
            let repository = self.repository_dir(&key);
            let removed = if repository.is_dir() {
                std::fs::remove_dir_all(&repository).is_ok()
            } else {
                std::fs::remove_file(&path).is_ok() || !path.exists()
            };
            if removed {
                let _ = std::fs::remove_file(path.with_extension("json"));
                if let Some(m) = entries.remove(&key) {
                    total -= m.bytes;
                }
                tracing::info!(%key, "evicted from the cache (least recently used)");
                evicted.push(key);
            }
        }
        if total + needed > budget {
            tracing::warn!(
                total,
                needed,
                budget,
                "the cache is over its budget: every remaining model is in use"
            );
        }
        drop(entries);
        if !evicted.is_empty() {
            self.changed.notify_waiters();
        }
        evicted
    }

    /// Removes the partial downloads (and peer-copy records, and repository
    /// directories never completed) of models neither in `wanted` nor
    /// pinned: what an interrupted download left of a model whose Shards are
    /// gone. Returns the removed files' names.
    pub fn sweep_partials<'a>(&self, wanted: impl IntoIterator<Item = &'a str>) -> Vec<String> {
        let mut keep: std::collections::BTreeSet<PathBuf> = wanted
            .into_iter()
            .map(|k| self.file_for(k).with_extension("gguf.partial"))
            .collect();
        for key in self.pins.lock().expect("pin lock").keys() {
            keep.insert(self.file_for(key).with_extension("gguf.partial"));
        }
        // Repository directories no listed entry, wanted key or pin owns:
        // a fetch that never completed.
        let mut owned: std::collections::BTreeSet<PathBuf> = keep
            .iter()
            .map(|p| p.with_extension("").with_extension("safetensors"))
            .collect();
        for key in self.entries.lock().expect("cache lock").keys() {
            owned.insert(self.repository_dir(key));
        }
        let Ok(dir) = std::fs::read_dir(&self.dir) else {
            return Vec::new();
        };
        let mut removed = Vec::new();
        for path in dir.filter_map(|e| e.ok().map(|e| e.path())) {
            if path.is_dir() {
                if path.extension().is_some_and(|e| e == "safetensors")
                    && !owned.contains(&path)
                    && std::fs::remove_dir_all(&path).is_ok()
                {
                    let name = path.file_name().unwrap_or_default().to_string_lossy();
                    tracing::info!(dir = %name, "removed an incomplete repository no Shard wants");
                    removed.push(name.into_owned());
                }
                continue;
            }
            let name = path.to_string_lossy();
            let partial = match name.strip_suffix(".pieces") {
                Some(p) if p.ends_with(".gguf.partial") => PathBuf::from(p),
                _ if name.ends_with(".gguf.partial") => path.clone(),
                _ => continue,
            };
            if keep.contains(&partial) {
                continue;
            }
            match std::fs::remove_file(&path) {
                Ok(()) => {
                    let file = path.file_name().unwrap_or_default().to_string_lossy();
                    tracing::info!(%file, "removed a partial download no Shard wants");
                    removed.push(file.into_owned());
                }
                Err(e) => {
                    tracing::warn!(file = %path.display(), error = %e, "cannot remove a partial download")
                }
            }
        }
        removed
    }

    /// Makes room for a model of `size` bytes of which `remaining` are still
    /// to be written: refused when it exceeds the budget on its own or the
    /// free disk, else idle models are evicted to fit the budget.
    pub(crate) fn room(&self, size: u64, remaining: u64) -> Result<(), Failure> {
        crate::download::within_budget(size, self.budget)?;
        self.make_room(size);
        let free = crate::download::free_space(&self.dir).map_err(|e| Failure {
            reason: "CacheUnwritable",
            message: format!("{}: {e}", self.dir.display()),
        })?;
        crate::download::on_disk(remaining, free, &self.dir)
    }

    /// Records that `key`'s file was just used (its modification time orders
    /// eviction).
    fn touch(&self, key: &str) {
        if let Ok(f) = std::fs::File::options()
            .append(true)
            .open(self.file_for(key))
        {
            let _ = f.set_modified(std::time::SystemTime::now());
        }
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

    /// Holds `key`'s files for one fetch (see `fetch_locks`).
    pub(crate) async fn lock_fetch(&self, key: &str) -> tokio::sync::OwnedMutexGuard<()> {
        let lock = self
            .fetch_locks
            .lock()
            .expect("fetch locks")
            .entry(key.to_string())
            .or_default()
            .clone();
        lock.lock_owned().await
    }

    /// The directory a safetensors repository's files are cached in.
    pub fn repository_dir(&self, key: &str) -> PathBuf {
        self.file_for(key).with_extension("safetensors")
    }

    /// Lists `key`'s repository directory (its bytes so far) once a stage's
    /// files are all there.
    pub(crate) fn admit_repository(&self, key: &str, dir: &Path) {
        let side = Sidecar {
            key: key.to_string(),
            sha256: None,
        };
        let _ = std::fs::write(
            self.file_for(key).with_extension("json"),
            serde_json::to_vec(&side).unwrap_or_default(),
        );
        self.entries.lock().expect("cache lock").insert(
            key.to_string(),
            CachedModel {
                key: key.to_string(),
                bytes: dir_bytes(dir),
                sha256: None,
            },
        );
        self.changed.notify_waiters();
    }

    /// The cached file of `key`, when it is whole (not being downloaded).
    pub fn complete_file(&self, key: &str) -> Option<PathBuf> {
        let path = self.file_for(key);
        path.is_file().then_some(path)
    }

    /// Makes sure the file at `url` is in the cache under `key`; returns its
    /// path. An interrupted download resumes where it stopped; `sha256`, when
    /// given, must match. `progress(done, total)` follows the download.
    /// `hub_client`, when given, replaces the node's hub client for a URL on
    /// the hub (it carries the Model's own token).
    pub async fn fetch(
        &self,
        key: &str,
        url: &str,
        sha256: Option<&str>,
        hub_client: Option<&reqwest::Client>,
        mut progress: impl FnMut(u64, Option<u64>),
    ) -> Result<PathBuf, Failure> {
        let path = self.file_for(key);
        let io = |e: std::io::Error| Failure {
            reason: "CacheUnwritable",
            message: format!("{}: {e}", self.dir.display()),
        };
        if !path.is_file() {
            let partial = path.with_extension("gguf.partial");
            // A peer copy left pieces here: keep what runs on from the start.
            crate::peer_copy::contiguous_prefix(&partial).map_err(io)?;
            let room = |size, remaining| self.room(size, remaining);
            let http = self.client_for(url, hub_client);
            crate::download::download(http, url, &partial, room, &mut progress).await?;
            std::fs::rename(&partial, &path).map_err(io)?;
        }
        self.admit(key, &path, sha256, url).await
    }

    /// Verifies a file that has just arrived in the cache and lists it.
    pub(crate) async fn admit(
        &self,
        key: &str,
        path: &Path,
        sha256: Option<&str>,
        from: &str,
    ) -> Result<PathBuf, Failure> {
        self.admit_hashed(key, path, sha256, None, from).await
    }

    /// As [`Cache::admit`], with the file's SHA-256 already computed when `hashed`.
    pub(crate) async fn admit_hashed(
        &self,
        key: &str,
        path: &Path,
        sha256: Option<&str>,
        hashed: Option<String>,
        from: &str,
    ) -> Result<PathBuf, Failure> {
        let checked = match hashed {
            Some(actual) => match sha256 {
                Some(expected) if actual != expected => Err(Failure {
                    reason: "ChecksumMismatch",
                    message: format!(
                        "{from} has SHA-256 {actual}, expected {expected}: the file is corrupt or another file"
                    ),
                }),
                _ => Ok(actual),
            },
            None => verify_sha256(path, sha256, from).await,
        };
        let actual = match checked {
            Err(mut e) if e.reason == "ChecksumMismatch" => {
                let _ = std::fs::remove_file(path);
                e.message.push_str(" (the download was discarded)");
                return Err(e);
            }
            other => other?,
        };
        let bytes = std::fs::metadata(path).map(|m| m.len()).unwrap_or(0);
        let side = Sidecar {
            key: key.to_string(),
            sha256: Some(actual.clone()),
        };
        let _ = std::fs::write(
            path.with_extension("json"),
            serde_json::to_vec(&side).unwrap_or_default(),
        );
        self.touch(key);
        self.entries.lock().expect("cache lock").insert(
            key.to_string(),
            CachedModel {
                key: key.to_string(),
                bytes,
                sha256: Some(actual),
            },
        );
        self.changed.notify_waiters();
        Ok(path.to_path_buf())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::peer_copy::pieces_file;

    fn http() -> reqwest::Client {
        shardplane_models::http_client().unwrap()
    }

    fn put(cache: &Cache, key: &str, bytes: usize, age_secs: u64) {
        let path = cache.file_for(key);
        std::fs::write(&path, vec![7u8; bytes]).unwrap();
        let side = Sidecar {
            key: key.into(),
            sha256: None,
        };
        std::fs::write(
            path.with_extension("json"),
            serde_json::to_vec(&side).unwrap(),
        )
        .unwrap();
        let when = std::time::SystemTime::now() - std::time::Duration::from_secs(age_secs);
        std::fs::File::options()
            .append(true)
            .open(&path)
            .unwrap()
            .set_modified(when)
            .unwrap();
    }

    #[test]
    fn the_budget_evicts_the_least_recently_used_models_no_shard_uses() {
        let dir = tempfile::tempdir().unwrap();
        let setup = Cache::new(dir.path().into(), http()).unwrap();
        put(&setup, "old", 400, 300);
        put(&setup, "older-but-pinned", 400, 600);
        put(&setup, "recent", 400, 10);
        // A restart lists what is there.
        let cache = Cache::new(dir.path().into(), http())
            .unwrap()
            .with_budget(Some(1000));
        let mut keys: Vec<_> = cache.listed().into_iter().map(|m| m.key).collect();
        keys.sort();
        assert_eq!(keys, ["old", "older-but-pinned", "recent"]);
        assert_eq!(cache.total_bytes(), 1200);

        cache.pin("older-but-pinned");
        assert_eq!(cache.make_room(0), ["old"]);
        assert!(!cache.file_for("old").exists());
        assert!(!cache.file_for("old").with_extension("json").exists());
        assert_eq!(cache.total_bytes(), 800);
        // Room for 500 more: the unpinned one goes, the pinned one stays even
        // though the budget cannot be met.
        assert_eq!(cache.make_room(500), ["recent"]);
        assert_eq!(cache.make_room(500), Vec::<String>::new());
        assert!(cache.complete_file("older-but-pinned").is_some());
        cache.unpin("older-but-pinned");
        assert_eq!(cache.make_room(700), ["older-but-pinned"]);
        // Without a budget nothing is evicted.
        put(&setup, "kept", 5000, 0);
        let unlimited = Cache::new(dir.path().into(), http()).unwrap();
        assert!(unlimited.make_room(1 << 40).is_empty());
    }

    #[test]
    fn partial_downloads_of_models_no_shard_wants_are_swept() {
        let dir = tempfile::tempdir().unwrap();
        let cache = Cache::new(dir.path().into(), http()).unwrap();
        let partial = |key: &str| cache.file_for(key).with_extension("gguf.partial");
        for key in ["wanted", "pinned", "abandoned", "abandoned-copy"] {
            std::fs::write(partial(key), b"some bytes").unwrap();
        }
        std::fs::write(pieces_file(&partial("abandoned-copy")), b"0\n").unwrap();
        put(&cache, "whole", 10, 0);
        cache.pin("pinned");
        // Repository directories: one wanted, one pinned, one listed whole,
        // one a fetch left behind.
        for key in ["wanted", "pinned", "listed-repo", "abandoned-repo"] {
            let dir = cache.repository_dir(key);
            std::fs::create_dir_all(&dir).unwrap();
            std::fs::write(dir.join("config.json"), b"{}").unwrap();
        }
        cache.admit_repository("listed-repo", &cache.repository_dir("listed-repo"));
        let mut removed = cache.sweep_partials(["wanted"]);
        removed.sort();
        let mut expected = vec![
            partial("abandoned"),
            partial("abandoned-copy"),
            pieces_file(&partial("abandoned-copy")),
            cache.repository_dir("abandoned-repo"),
        ]
        .into_iter()
        .map(|p| p.file_name().unwrap().to_string_lossy().into_owned())
        .collect::<Vec<_>>();
        expected.sort();
        assert_eq!(removed, expected);
        assert!(partial("wanted").exists() && partial("pinned").exists());
        assert!(!partial("abandoned").exists());
        for key in ["wanted", "pinned", "listed-repo"] {
            assert!(
                cache.repository_dir(key).join("config.json").exists(),
                "{key}"
            );
        }
        // Whole models are the budget's business, not the sweep's.
        assert!(cache.complete_file("whole").is_some());
        assert!(cache.sweep_partials(["wanted"]).is_empty());
    }
}
