//! Failed Shards heal: a failure is recorded and reported, and the Shard is
//! brought up again after a pause when the failure may pass
//! ([`crate::retry`]); a stage whose thread panicked is unloaded first.
//!
//! ```text
//!  bring_up Err ─┐
//!  stage panic ──┴► fail_shard ─► Failed (reason, nextRetryTime) ─► retry_later ─► ensure
//! ```

use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;
use k8s_openapi::jiff::Timestamp;
use kube::{Api, Client};
use shardplane_crds::{Shard, ShardPhase, ShardStatus};

use super::{Key, ShardSet, Sources, ensure, owned, put_phase, report, set_phase};
use crate::cache::Failure;
use crate::metrics::Metrics;
use crate::retry;

/// Marks Shard `k` (its spec at `generation`) Failed for `f`, and tries it
/// again after a pause when the failure may pass.
pub(super) fn fail_shard(
    client: &Client,
    k: Key,
    generation: Option<i64>,
    f: Failure,
    shards: &ShardSet,
    metrics: &Metrics,
    sources: &Sources,
) {
    let pause = shards
        .failures
        .lock()
        .expect("failure lock")
        .entry(k.clone())
        .or_default()
        .failed(f.reason, &f.message, generation);
    match pause {
        Some(p) => {
            tracing::warn!(shard = %k.1, reason = f.reason, message = %f.message, "shard failed; trying again in {p:?}")
        }
        None => {
            tracing::warn!(shard = %k.1, reason = f.reason, message = %f.message, "shard failed; not trying again until its spec changes")
        }
    }
    let status = ShardStatus {
        phase: Some(ShardPhase::Failed),
        reason: Some(f.reason.into()),
        message: Some(f.message),
        observed_generation: generation,
        next_retry_time: pause
            .and_then(|p| Timestamp::now().checked_add(p).ok())
            .map(Time),
        ..Default::default()
    };
    set_phase(shards, metrics, &k, status.phase);
    report(client, shards, &k, status);
    if let Some(pause) = pause {
        retry_later(client, k, pause, shards, metrics, sources);
    }
}

/// Shard `k`'s stage thread panicked: unless another stage replaced it
/// meanwhile, it is unloaded and the Shard fails (and is retried) like any
/// failure.
pub(super) fn stage_crashed(
    client: &Client,
    k: Key,
    generation: Option<i64>,
    message: String,
    shards: &ShardSet,
    metrics: &Metrics,
    sources: &Sources,
) {
    let crashed = {
        let mut loaded = shards.loaded.lock().expect("shard set lock");
        match loaded.get(&k) {
            Some(s) if s.worker.crashed().is_some() => loaded.remove(&k),
            _ => None,
        }
    };
    let Some(stage) = crashed else {
        return;
    };
    sources.cache.unpin(&stage.spec.source.cache_key());
    metrics.weight_bytes.sub(stage.worker.weight_bytes as i64);
    let f = Failure {
        reason: "StageCrashed",
        message: format!("the stage's thread panicked: {message}"),
    };
    fail_shard(client, k, generation, f, shards, metrics, sources);
}

/// Brings the Shard up again after `pause`, as it then is, unless it was
/// deleted, moved or brought up otherwise meanwhile.
fn retry_later(
    client: &Client,
    k: Key,
    pause: std::time::Duration,
    shards: &ShardSet,
    metrics: &Metrics,
    sources: &Sources,
) {
    let (client, shards, metrics, sources) = owned(client, shards, metrics, sources);
    tokio::spawn(async move {
        let api: Api<Shard> = Api::namespaced(client.clone(), &k.0);
        let mut wait = pause;
        loop {
            tokio::time::sleep(wait).await;
            if shards.phases.lock().expect("phase lock").get(&k) != Some(&ShardPhase::Failed) {
                return;
            }
            match api.get_opt(&k.1).await {
                Ok(Some(shard)) => {
                    {
                        // Still Failed (checked and cleared under one lock):
                        // of two retries due at once, one tries; a load
                        // started meanwhile (a new spec) is left to itself.
                        let mut phases = shards.phases.lock().expect("phase lock");
                        if phases.get(&k) != Some(&ShardPhase::Failed) {
                            return;
                        }
                        put_phase(&mut phases, &metrics, &k, None);
                    }
                    if let Some(r) = shards.failures.lock().expect("failure lock").get_mut(&k) {
                        r.restarts += 1;
                    }
                    tracing::info!(shard = %k.1, "trying the failed shard again");
                    ensure(&client, shard, &shards, &metrics, &sources, false);
                    return;
                }
                Ok(None) => return,
                Err(e) => {
                    tracing::warn!(shard = %k.1, error = %e, "cannot read the shard to try it again");
                    wait = retry::FIRST_PAUSE;
                }
            }
        }
    });
}
