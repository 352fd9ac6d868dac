//! Safetensors repositories (the MLX-community layout) fetched into the
//! cache: the small files every stage reads, and only the weight files that
//! hold the stage's own layers.
//!
//! ```text
//!  base = <hub>/<repo>/resolve/<commit>  or a URL source
//!  config.json, model.safetensors.index.json?, tokenizer.json | tiktoken.model, … ──► <cache>/<key>.safetensors/
//!  index weight_map ──► files with model.layers.{stage's}.*  (+ embedding / norm / head)
//!  each file: resumable download ──► size and SHA-256 the hub lists (LFS)
//!                                ──► safetensors header = file size (no truncation)
//! ```
//!
//! A later stage of other layers on the same node fetches only the files it
//! still lacks; two stages starting at once fetch one after the other. Files
//! already there are checked against the listing's sizes, not hashed again.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

use serde_json::Value;
use shardplane_engine::StageLayout;
use shardplane_engine::tokenizer::TOKENIZER_FILES;
use shardplane_models::hub::Revision;
use shardplane_models::safetensors::{expected_file_size, is_plain_file_name};

use crate::cache::{Cache, Failure, verify_sha256};

/// Files every stage reads beside the weights: they must be there.
const REQUIRED: &[&str] = &["config.json"];
/// Files read when the repository has them.
const OPTIONAL: &[&str] = &[
    "model.safetensors.index.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "generation_config.json",
    "chat_template.jinja",
    "chat_template.json",
];
/// The largest small file accepted (tokenizer.json of large vocabularies is
/// tens of MB).
const MAX_SMALL: u64 = 128 << 20;
/// The tokenizer's settings (one of [`OPTIONAL`], but for tiktoken ranks).
const TOKENIZER_CONFIG: &str = "tokenizer_config.json";
/// The index of a sharded model's weight files (one of [`OPTIONAL`]).
const INDEX: &str = "model.safetensors.index.json";

/// Whether `stage` reads tensor `name` (Hugging Face names).
fn reads(stage: &StageLayout, name: &str, tied: bool) -> bool {
    if let Some(rest) = name.strip_prefix("model.layers.") {
        return rest
            .split('.')
            .next()
            .and_then(|n| n.parse::<usize>().ok())
            .is_some_and(|n| stage.layers.contains(&n));
    }
    if name.starts_with("model.embed_tokens.") {
        return stage.is_first() || (stage.is_last() && tied);
    }
    if name.starts_with("model.norm.") || name.starts_with("lm_head.") {
        return stage.is_last();
    }
    // Anything else (vision towers and the like) is not read by the engines.
    false
}

/// The weight files of `index` (`model.safetensors.index.json`) that hold
/// the tensors `stage` reads, in name order; `model.safetensors` without an
/// index.
pub fn weight_files(index: Option<&Value>, stage: &StageLayout) -> Result<Vec<String>, Failure> {
    let Some(index) = index else {
        return Ok(vec!["model.safetensors".into()]);
    };
    let corrupt = |message: String| Failure {
        reason: "CorruptWeights",
        message: format!("{INDEX}: {message}"),
    };
    let map = index
        .get("weight_map")
        .and_then(Value::as_object)
        .ok_or_else(|| corrupt("no weight_map".into()))?;
    let tied = !map.keys().any(|k| k.starts_with("lm_head."));
    let mut files = BTreeSet::new();
    for (tensor, file) in map {
        let file = file
            .as_str()
            .filter(|f| is_plain_file_name(f) && f.ends_with(".safetensors"))
            .ok_or_else(|| corrupt(format!("{tensor} lies in {file}, not a weights file")))?;
        if reads(stage, tensor, tied) {
            files.insert(file.to_string());
        }
    }
    if files.is_empty() {
        return Err(corrupt(format!(
            "no file holds the tensors of layers {:?}",
            stage.layers
        )));
    }
    Ok(files.into_iter().collect())
}

/// Where the files come from and what is known of them.
pub struct Source<'a> {
    /// Files are `{base}/{name}`.
    pub base: String,
    /// The client for `base` (the hub's carries its token).
    pub http: &'a reqwest::Client,
    /// The hub's listing of the pinned commit (sizes, LFS SHA-256), when the
    /// source is the hub.
    pub listing: Option<Revision>,
}

impl Source<'_> {
    fn listed(&self, name: &str) -> Option<&shardplane_models::hub::HubFile> {
        self.listing
            .as_ref()
            .and_then(|r| r.files.iter().find(|f| f.path == name))
    }

    /// Whether the source has `name`: the listing says, else a request.
    async fn has(&self, name: &str) -> Result<bool, Failure> {
        if let Some(listing) = &self.listing {
            return Ok(listing.files.iter().any(|f| f.path == name));
        }
        let url = format!("{}/{name}", self.base);
        let response = self.http.head(&url).send().await.map_err(|e| Failure {
            reason: "DownloadFailed",
            message: format!("HEAD {url}: {e}"),
        })?;
        match response.status() {
            s if s.is_success() => Ok(true),
            reqwest::StatusCode::NOT_FOUND => Ok(false),
            s => Err(Failure {
                reason: "DownloadFailed",
                message: format!("HEAD {url}: HTTP {s}"),
            }),
        }
    }
}

/// Makes sure the files of `key`'s repository that `stage` needs are in the
/// cache; returns the directory. `progress(done, total)` follows the
/// weight files' download.
pub async fn fetch(
    cache: &Cache,
    key: &str,
    source: &Source<'_>,
    stage: &StageLayout,
    mut progress: impl FnMut(u64, Option<u64>),
) -> Result<PathBuf, Failure> {
    let _one_at_a_time = cache.lock_fetch(key).await;
    let dir = cache.repository_dir(key);
    std::fs::create_dir_all(&dir).map_err(|e| unwritable(&dir, e))?;
    let mut names: Vec<&str> = Vec::new();
    for &name in REQUIRED {
        if !source.has(name).await? {
            return Err(Failure {
                reason: "WeightsNotFound",
                message: format!(
                    "{}/{name} is missing: the repository is not a model in the MLX-community (Hugging Face) layout",
                    source.base
                ),
            });
        }
        names.push(name);
    }
    // The tokenizer: the first of its files the repository has.
    let mut tokenizer = None;
    for name in TOKENIZER_FILES {
        if source.has(name).await? {
            tokenizer = Some(name);
            break;
        }
    }
    let Some(tokenizer) = tokenizer else {
        return Err(Failure {
            reason: "WeightsNotFound",
            message: format!(
                "{}/{} is missing (nor is there {}): the repository is not a model in the \
                 MLX-community (Hugging Face) layout",
                source.base, TOKENIZER_FILES[0], TOKENIZER_FILES[1]
            ),
        });
    };
    names.push(tokenizer);
    // Tiktoken ranks name their code and special tokens there.
    if tokenizer == TOKENIZER_FILES[1] && !source.has(TOKENIZER_CONFIG).await? {
        return Err(Failure {
            reason: "WeightsNotFound",
            message: format!(
                "{}/{TOKENIZER_CONFIG} is missing: a tokenizer kept as {tokenizer} needs it (its \
                 code and special tokens)",
                source.base
            ),
        });
    }
    for &name in OPTIONAL {
        if source.has(name).await? {
            names.push(name);
        }
    }
    for name in &names {
        get(cache, source, &dir, name, &mut |_, _| {}).await?;
    }
    let index = match dir.join(INDEX).is_file() {
        true => {
            let text = std::fs::read(dir.join(INDEX)).map_err(|e| unwritable(&dir, e))?;
            Some(serde_json::from_slice::<Value>(&text).map_err(|e| Failure {
                reason: "CorruptWeights",
                message: format!("{INDEX}: {e}"),
            })?)
        }
        false => None,
    };
    let weights = weight_files(index.as_ref(), stage)?;
    for name in &weights {
        if !source.has(name).await? {
            return Err(Failure {
                reason: "WeightsNotFound",
                message: format!(
                    "{}/{name} is missing (the stage's layers {:?} lie in it)",
                    source.base, stage.layers
                ),
            });
        }
    }
    // Progress over the weight files: what is there, then each download.
    let sizes: BTreeMap<&str, Option<u64>> = weights
        .iter()
        .map(|n| (n.as_str(), source.listed(n).and_then(|f| f.size)))
        .collect();
    let total = sizes
        .values()
        .try_fold(0u64, |sum, s| s.map(|s| sum.saturating_add(s)));
    let mut done = 0u64;
    for name in &weights {
        let before = done;
        get(cache, source, &dir, name, &mut |d, _| {
            progress(before + d, total)
        })
        .await?;
        let path = dir.join(name);
        let size = std::fs::metadata(&path).map(|m| m.len()).unwrap_or(0);
        let expected = expected_file_size(&path).map_err(|e| Failure {
            reason: "CorruptWeights",
            message: format!("{}/{name}: {e}", source.base),
        })?;
        if expected != size {
            let _ = std::fs::remove_file(&path);
            return Err(Failure {
                reason: "CorruptWeights",
                message: format!(
                    "{}/{name} holds {size} bytes, its header promises {expected}: \
                     the download was cut short or the file is damaged (removed)",
                    source.base
                ),
            });
        }
        done += size;
        progress(done, total);
    }
    cache.admit_repository(key, &dir);
    Ok(dir)
}

/// Downloads `name` into `dir` unless it is there (and of the listed size),
/// then checks the listing's size and SHA-256.
async fn get(
    cache: &Cache,
    source: &Source<'_>,
    dir: &Path,
    name: &str,
    progress: &mut impl FnMut(u64, Option<u64>),
) -> Result<(), Failure> {
    if !is_plain_file_name(name) {
        return Err(Failure {
            reason: "CorruptWeights",
            message: format!("{name:?} is not a file name inside a repository"),
        });
    }
    let path = dir.join(name);
    let listed = source.listed(name);
    let on_disk = std::fs::metadata(&path).map(|m| m.len()).ok();
    if let Some(have) = on_disk
        && listed.and_then(|f| f.size).is_none_or(|size| size == have)
    {
        return Ok(());
    }
    if let Some(parent) = path.parent() {
        std::fs::create_dir_all(parent).map_err(|e| unwritable(parent, e))?;
    }
    let partial = PathBuf::from(format!("{}.partial", path.display()));
    let url = format!("{}/{name}", source.base);
    let small = !name.ends_with(".safetensors");
    let room = |size: u64, remaining: u64| {
        if small && size > MAX_SMALL {
            return Err(Failure {
                reason: "CorruptWeights",
                message: format!("{url} is {size} bytes, more than a {name} should be"),
            });
        }
        cache.room(size, remaining)
    };
    crate::download::download(source.http, &url, &partial, room, progress).await?;
    let got = std::fs::metadata(&partial).map(|m| m.len()).unwrap_or(0);
    if let Some(size) = listed.and_then(|f| f.size)
        && size != got
    {
        let _ = std::fs::remove_file(&partial);
        return Err(Failure {
            reason: "ChecksumMismatch",
            message: format!("{url} is {got} bytes, the hub lists {size} (discarded)"),
        });
    }
    if let Some(sha256) = listed.and_then(|f| f.sha256.as_deref())
        && let Err(mut e) = verify_sha256(&partial, Some(sha256), &url).await
    {
        let _ = std::fs::remove_file(&partial);
        e.message.push_str(" (the download was discarded)");
        return Err(e);
    }
    std::fs::rename(&partial, &path).map_err(|e| unwritable(&path, e))
}

fn unwritable(path: &Path, e: std::io::Error) -> Failure {
    Failure {
        reason: "CacheUnwritable",
        message: format!("{}: {e}", path.display()),
    }
}

#[cfg(test)]
mod tests {
    use std::ops::Range;

    use super::*;

    fn index(tied: bool) -> Value {
        let mut map = serde_json::Map::new();
        map.insert("model.embed_tokens.weight".into(), "a.safetensors".into());
        for l in 0..4 {
            let file = if l < 2 {
                "a.safetensors"
            } else {
                "b.safetensors"
            };
            map.insert(format!("model.layers.{l}.mlp.up_proj.weight"), file.into());
        }
        map.insert("model.norm.weight".into(), "c.safetensors".into());
        if !tied {
            map.insert("lm_head.weight".into(), "c.safetensors".into());
        }
        serde_json::json!({ "weight_map": map })
    }

    fn wanted(layers: Range<usize>) -> StageLayout {
        StageLayout::new(layers, 4).unwrap()
    }

    #[test]
    fn a_stage_fetches_the_files_of_its_own_layers() {
        let untied = index(false);
        let files = |w| weight_files(Some(&untied), &w).unwrap();
        assert_eq!(files(wanted(0..2)), ["a.safetensors"]);
        assert_eq!(files(wanted(2..4)), ["b.safetensors", "c.safetensors"]);
        assert_eq!(files(wanted(1..3)), ["a.safetensors", "b.safetensors"]);
        // Tied embeddings: the last stage's head is the embedding.
        let tied = index(true);
        assert_eq!(
            weight_files(Some(&tied), &wanted(3..4)).unwrap(),
            ["a.safetensors", "b.safetensors", "c.safetensors"]
        );
        assert_eq!(
            weight_files(None, &wanted(0..4)).unwrap(),
            ["model.safetensors"]
        );
    }

    #[test]
    fn an_index_pointing_outside_the_repository_is_refused() {
        let bad = serde_json::json!({"weight_map": {"model.layers.0.x": "../../etc/passwd"}});
        let e = weight_files(Some(&bad), &wanted(0..1)).unwrap_err();
        assert_eq!(e.reason, "CorruptWeights");
        assert!(e.message.contains("not a weights file"), "{}", e.message);
        let none = serde_json::json!({"metadata": {}});
        assert!(weight_files(Some(&none), &wanted(0..1)).is_err());
    }
}
