//! Getting a Shard's weights onto the node: a file or directory already
//! there, a GGUF file from a peer's cache or its source, or the files of a
//! safetensors repository that the stage's layers need.
//!
//! ```text
//!  path ──────────────────────────────► checked (SHA-256 / config.json)
//!  GGUF url / hub ─► peer holding the pinned hash? ─► copy ─► verified
//!                  └─────────────────────────────► download ─► verified
//!  safetensors url / hub ─► repository::fetch (listing, per-file checks)
//! ```

use std::path::PathBuf;
use std::sync::Arc;
use std::sync::atomic::AtomicU64;

use kube::{Client, ResourceExt};
use shardplane_crds::{ModelFormat, ModelSource, Shard, ShardPhase, ShardStatus};

use super::{Claim, ShardSet, Sources, key, report_claimed};
use crate::cache::{Failure, verify_sha256};
use crate::metrics::Metrics;

/// Makes sure the weights are on this node (for the load that made
/// `claim`); returns their path.
pub(super) async fn fetch(
    client: &Client,
    shards: &ShardSet,
    (shard, claim): (&Shard, Claim),
    sources: &Sources,
    metrics: &Metrics,
) -> Result<PathBuf, Failure> {
    if shard.spec.format == ModelFormat::Safetensors {
        return match &shard.spec.source {
            ModelSource::Path(p) => local_directory(p),
            _ => fetch_repository(client, shards, (shard, claim), sources, metrics).await,
        };
    }
    let (url, sha256, hub_client) = match &shard.spec.source {
        ModelSource::Path(p) => return local(p).await,
        ModelSource::Url(u) => (u.url.clone(), u.sha256.clone(), None),
        ModelSource::HuggingFace(hf) => (
            shardplane_models::hugging_face_url(
                &sources.hugging_face_endpoint,
                &hf.repo,
                hf.file.as_deref().unwrap_or_default(),
                hf.revision.as_deref(),
            ),
            // The operator fills it from the hub's LFS metadata.
            hf.sha256.clone(),
            model_hub_client(client, shard, hf).await?,
        ),
    };
    let key = shard.spec.source.cache_key();
    // Another stage of the same model may be fetching it right now: wait for
    // it (the file is then in the cache) rather than write the same file.
    let _one_at_a_time = sources.cache.lock_fetch(&key).await;
    let (done, total, reporter) = progress_reporter(client, shards, (shard, claim));
    // A peer's copy is checked against the SHA-256 the Model pins (its
    // `sha256`, or the hub's LFS hash the operator resolved), never against
    // what the peer says of its own file: without a pin, the source.
    if sources.cache.complete_file(&key).is_none()
        && let Some(peers) = &sources.peers
        && let Some(pinned) = sha256.as_deref()
    {
        // Right after a start the list of nodes may still be loading.
        let _ = tokio::time::timeout(
            std::time::Duration::from_secs(10),
            peers.nodes.wait_until_ready(),
        )
        .await;
        // A peer that lists another hash holds other bytes: not worth a copy.
        let holders = peers.holders(&key).into_iter().filter(|h| {
            h.sha256
                .as_deref()
                .is_none_or(|theirs| theirs.eq_ignore_ascii_case(pinned))
        });
        for holder in holders {
            let Ok(client) = peers.peers.client(&holder.node, &holder.endpoint) else {
                continue;
            };
            sources.cache.make_room(holder.bytes);
            let (done_bytes, counter) = (
                done.clone(),
                metrics.download_bytes.with_label_values(&["peer"]),
            );
            total.store(holder.bytes, std::sync::atomic::Ordering::Relaxed);
            let from = format!("node {} ({})", holder.node, holder.endpoint);
            let copied = sources
                .cache
                .fetch_from_peer(&client, &from, &key, holder.bytes, Some(pinned), move |n| {
                    done_bytes.fetch_add(n, std::sync::atomic::Ordering::Relaxed);
                    counter.inc_by(n);
                })
                .await;
            match copied {
                Ok(path) => {
                    reporter.abort();
                    sources.cache.make_room(0);
                    tracing::info!(%key, %from, "copied from a peer");
                    return Ok(path);
                }
                Err(f) => {
                    tracing::warn!(%key, %from, reason = f.reason, message = %f.message, "peer copy failed; trying the next source");
                    done.store(0, std::sync::atomic::Ordering::Relaxed);
                }
            }
        }
    }
    let counter = metrics.download_bytes.with_label_values(&["url"]);
    let result = sources
        .cache
        .fetch(
            &key,
            &url,
            sha256.as_deref(),
            hub_client.as_ref(),
            counting(&done, &total, counter),
        )
        .await;
    reporter.abort();
    sources.cache.make_room(0);
    result
}

/// A download's progress callback, `(done, total)`: into the Shard's
/// counters, and each new byte once into `counter`.
fn counting(
    done: &Arc<AtomicU64>,
    total: &Arc<AtomicU64>,
    counter: prometheus::IntCounter,
) -> impl FnMut(u64, Option<u64>) + use<> {
    let (done, total) = (done.clone(), total.clone());
    let counted = AtomicU64::new(0);
    move |d, t| {
        use std::sync::atomic::Ordering::Relaxed;
        done.store(d, Relaxed);
        total.store(t.unwrap_or(0), Relaxed);
        let before = counted.swap(d, Relaxed);
        counter.inc_by(d.saturating_sub(before));
    }
}

/// Progress to the Shard's status once a second while a download runs
/// (for the load that made `claim`, while it stands): the counters to
/// update, and the task to abort when it ends.
fn progress_reporter(
    client: &Client,
    shards: &ShardSet,
    (shard, claim): (&Shard, Claim),
) -> (Arc<AtomicU64>, Arc<AtomicU64>, tokio::task::JoinHandle<()>) {
    let done = Arc::new(AtomicU64::new(0));
    let total = Arc::new(AtomicU64::new(0));
    let (client, shards, k, d, t, generation) = (
        client.clone(),
        shards.clone(),
        key(shard),
        done.clone(),
        total.clone(),
        shard.metadata.generation,
    );
    let task = tokio::spawn(async move {
        loop {
            tokio::time::sleep(std::time::Duration::from_secs(1)).await;
            use std::sync::atomic::Ordering::Relaxed;
            let status = ShardStatus {
                phase: Some(ShardPhase::Downloading),
                downloaded_bytes: Some(d.load(Relaxed)),
                total_bytes: Some(t.load(Relaxed)).filter(|t| *t > 0),
                observed_generation: generation,
                ..Default::default()
            };
            report_claimed(&client, &shards, (&k, claim), status);
        }
    });
    (done, total, task)
}

/// A safetensors repository from the hub (at the commit the operator
/// pinned, each file checked against the hub's listing) or a URL base: the
/// files of the stage's layers, into the cache.
async fn fetch_repository(
    client: &Client,
    shards: &ShardSet,
    (shard, claim): (&Shard, Claim),
    sources: &Sources,
    metrics: &Metrics,
) -> Result<PathBuf, Failure> {
    let own = match &shard.spec.source {
        ModelSource::HuggingFace(hf) => model_hub_client(client, shard, hf).await?,
        _ => None,
    };
    let (base, listing) = match &shard.spec.source {
        ModelSource::Url(u) if u.sha256.is_some() => {
            return Err(Failure {
                reason: "InvalidSpec",
                message: "a sha256 pins one file; a safetensors repository has several: \
                          remove the Model's sha256 (files from the hub are checked against \
                          its listing)"
                    .into(),
            });
        }
        ModelSource::Url(u) => (u.url.trim_end_matches('/').to_string(), None),
        ModelSource::HuggingFace(hf) => {
            let endpoint = &sources.hugging_face_endpoint;
            let revision = hf.revision.as_deref();
            let base = shardplane_models::hugging_face_url(endpoint, &hf.repo, "", revision);
            let base = base.trim_end_matches('/').to_string();
            let http = sources.cache.client_for(&base, own.as_ref());
            let listing =
                shardplane_models::hub::resolve_revision(http, endpoint, &hf.repo, revision)
                    .await
                    .map_err(|u| Failure {
                        // Unreachable now may be reachable in a while.
                        reason: match u.reason {
                            "SourceUnreachable" => "DownloadFailed",
                            other => other,
                        },
                        message: u.message,
                    })?;
            (base, Some(listing))
        }
        ModelSource::Path(p) => return local_directory(p),
    };
    let source = crate::repository::Source {
        http: sources.cache.client_for(&base, own.as_ref()),
        base,
        listing,
    };
    let stage = shardplane_engine::StageLayout::new(
        shard.spec.layers.start as usize..shard.spec.layers.end as usize,
        shard.spec.total_layers as usize,
    )
    .map_err(|e| Failure {
        reason: "LayerRangeDoesNotFit",
        message: e.to_string(),
    })?;
    let (done, total, reporter) = progress_reporter(client, shards, (shard, claim));
    let counter = metrics.download_bytes.with_label_values(&["url"]);
    let key = shard.spec.source.cache_key();
    let progress = counting(&done, &total, counter);
    let result = crate::repository::fetch(&sources.cache, &key, &source, &stage, progress).await;
    reporter.abort();
    sources.cache.make_room(0);
    result
}

/// A hub client carrying the Model's own token, when its source names a
/// Secret holding one (read from the Shard's namespace, the Model's).
async fn model_hub_client(
    client: &Client,
    shard: &Shard,
    hf: &shardplane_crds::HuggingFaceSource,
) -> Result<Option<reqwest::Client>, Failure> {
    let Some(r) = &hf.token_secret_ref else {
        return Ok(None);
    };
    let ns = shard.namespace().unwrap_or_default();
    let label = shardplane_crds::HUGGING_FACE_TOKEN_LABEL;
    let token = shardplane_cluster::secrets::read_opted_in(client, &ns, &r.name, &r.key, label)
        .await
        .map_err(|e| Failure {
            reason: e.reason(),
            message: format!("the Model's tokenSecretRef: {e}"),
        })?;
    shardplane_models::hub::download_client(crate::cache::DOWNLOAD_IDLE, Some(&token))
        .map(Some)
        .map_err(|e| Failure {
            reason: "InvalidToken",
            message: format!("the Model's tokenSecretRef: {e}"),
        })
}

/// A safetensors model directory already on the node (its `config.json`
/// present; the engine names any weight file that is missing).
fn local_directory(p: &shardplane_crds::PathSource) -> Result<PathBuf, Failure> {
    let path = PathBuf::from(&p.path);
    if !path.join("config.json").is_file() {
        return Err(Failure {
            reason: "WeightsNotFound",
            message: format!(
                "{} is not a model directory on this node (no config.json): copy the model \
                 there or fix the Model's path",
                p.path
            ),
        });
    }
    if p.sha256.is_some() {
        return Err(Failure {
            reason: "InvalidSpec",
            message: "a sha256 pins one file; a safetensors directory cannot be checked \
                      against it: remove the Model's sha256"
                .into(),
        });
    }
    Ok(path)
}

/// A model file already on the node, checked against its SHA-256 when given.
async fn local(p: &shardplane_crds::PathSource) -> Result<PathBuf, Failure> {
    let path = PathBuf::from(&p.path);
    if !path.is_file() {
        return Err(Failure {
            reason: "WeightsNotFound",
            message: format!(
                "{} is not a file on this node: copy the model there or fix the Model's path",
                p.path
            ),
        });
    }
    if let Some(expected) = &p.sha256 {
        verify_sha256(&path, Some(expected), &p.path).await?;
    }
    Ok(path)
}
