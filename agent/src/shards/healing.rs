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

use super::{Claim, Key, Origin, ShardSet, Sources, ensure, owned, put_phase, report};
use crate::cache::Failure;
use crate::metrics::Metrics;
use crate::retry;

/// The phase a failure replaces ([`fail_shard`]).
#[derive(Clone, Copy, Debug)]
pub(super) enum Over {
    /// The failing load's own (Downloading, Loading), while its claim
    /// stands.
    Load(Claim),
    /// Ready: a loaded stage or rank failed.
    Ready,
}

/// Marks Shard `k` (its spec at `generation`) Failed for `f` over the phase
/// `over` names, and tries it again after a pause when the failure may
/// pass. Recorded and set under the phase lock only while that phase
/// stands: a Shard unloaded (deleted, moved) or claimed by a new load
/// meanwhile (even one of the same phase) is not failed.
pub(super) fn fail_shard(
    client: &Client,
    k: Key,
    generation: Option<i64>,
    (f, over): (Failure, Over),
    shards: &ShardSet,
    metrics: &Metrics,
    sources: &Sources,
) {
    let pause = {
        let mut phases = shards.phases.lock().expect("phase lock");
        let phase = phases.get(&k).copied();
        let stands = match over {
            Over::Load(claim) => shards.claimed(&phases, &k, claim),
            Over::Ready => phase == Some(ShardPhase::Ready),
        };
        if !stands {
            tracing::info!(shard = %k.1, reason = f.reason, message = %f.message, ?phase, "the shard changed as it failed; not failed");
            return;
        }
        let pause = shards
            .failures
            .lock()
            .expect("failure lock")
            .entry(k.clone())
            .or_default()
            .failed(f.reason, &f.message, generation);
        put_phase(&mut phases, metrics, &k, Some(ShardPhase::Failed));
        pause
    };
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
    // A load of the Shard under way stands for it: the crashed stage was
    // the one it replaces (only let go of), or its own, just loaded (the
    // load's end then finds its stage gone and fails the Shard).
    let (crashed, loading) = {
        let phases = shards.phases.lock().expect("phase lock");
        let loading = matches!(
            phases.get(&k),
            Some(ShardPhase::Downloading | ShardPhase::Loading)
        );
        let mut loaded = shards.loaded.lock().expect("shard set lock");
        let crashed = match loaded.get(&k) {
            Some(s) if s.worker.crashed().is_some() => loaded.remove(&k),
            _ => None,
        };
        (crashed, loading)
    };
    let Some(stage) = crashed else {
        return;
    };
    sources.cache.unpin(&stage.spec.source.cache_key());
    metrics.weight_bytes.sub(stage.worker.weight_bytes as i64);
    if loading {
        tracing::warn!(shard = %k.1, message, "a stage's thread panicked while the shard loaded");
        return;
    }
    let f = Failure {
        reason: "StageCrashed",
        message: format!("the stage's thread panicked: {message}"),
    };
    fail_shard(
        client,
        k,
        generation,
        (f, Over::Ready),
        shards,
        metrics,
        sources,
    );
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
                    tracing::info!(shard = %k.1, "trying the failed shard again");
                    ensure(&client, shard, &shards, &metrics, &sources, Origin::Retry);
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

#[cfg(test)]
mod tests {
    use shardplane_crds::LayerRange;
    use shardplane_engine::StageInput;

    use super::super::{ServedStage, set_phase, test_set};
    use super::*;
    use crate::test_stage::Echo;

    /// A client of an API server that is not there: the paths tested
    /// decide before they write.
    fn client() -> Client {
        let config = kube::Config::new("http://127.0.0.1:9".parse().unwrap());
        Client::try_from(config).unwrap()
    }

    fn phase(shards: &ShardSet, k: &Key) -> Option<ShardPhase> {
        shards.phases.lock().unwrap().get(k).copied()
    }

    fn failure(reason: &'static str) -> Failure {
        Failure {
            reason,
            message: "x".into(),
        }
    }

    #[tokio::test]
    async fn a_failure_replaces_only_the_phase_it_names() {
        let (_dir, shards, metrics, sources) = test_set();
        let k: Key = ("ns".into(), "s".into());
        let fail = |over| {
            let f = (failure("StageCrashed"), over);
            fail_shard(
                &client(),
                k.clone(),
                Some(1),
                f,
                &shards,
                &metrics,
                &sources,
            );
        };
        // Unloaded meanwhile: nothing recorded, nothing retried.
        let stale = shards.claim(&k);
        set_phase(&shards, &metrics, &k, None);
        fail(Over::Load(stale));
        assert_eq!(phase(&shards, &k), None);
        assert!(shards.failures.lock().unwrap().is_empty());
        // A crash seen while Ready, reported after a new load claimed the
        // Shard: the load stands.
        set_phase(&shards, &metrics, &k, Some(ShardPhase::Downloading));
        let claim = shards.claim(&k);
        fail(Over::Ready);
        assert_eq!(phase(&shards, &k), Some(ShardPhase::Downloading));
        assert!(shards.failures.lock().unwrap().is_empty());
        // The failure of the load the new one replaced (the Shard was
        // unloaded and claimed anew meanwhile): the new load stands.
        fail(Over::Load(stale));
        assert_eq!(phase(&shards, &k), Some(ShardPhase::Downloading));
        assert!(shards.failures.lock().unwrap().is_empty());
        // The load's own failure: Failed, recorded.
        fail(Over::Load(claim));
        assert_eq!(phase(&shards, &k), Some(ShardPhase::Failed));
        let record = shards.failures.lock().unwrap()[&k].clone();
        assert_eq!(record.last_failure.as_deref(), Some("StageCrashed: x"));
    }

    #[tokio::test]
    async fn a_stage_that_crashes_while_its_shard_loads_is_only_let_go_of() {
        let (_dir, shards, metrics, sources) = test_set();
        let mut shard = shardplane_testkit::fixtures::shard(
            "d",
            "node-0",
            0,
            2,
            LayerRange { start: 0, end: 8 },
        );
        shard.metadata.namespace = Some("ns".into());
        let k: Key = ("ns".into(), shard.metadata.name.clone().unwrap());
        let crashed = || async {
            let (mut echo, _) = Echo::new(false);
            echo.panics = true;
            let worker = crate::test_stage::quiet_worker(&k.1, Box::new(echo));
            let _ = worker.forward(1, StageInput::Tokens(vec![1])).await;
            // The caller hears of the panic before the thread records it.
            for _ in 0..500 {
                if worker.crashed().is_some() {
                    break;
                }
                tokio::time::sleep(std::time::Duration::from_millis(10)).await;
            }
            assert!(worker.crashed().is_some());
            shards.insert(ServedStage {
                namespace: k.0.clone(),
                name: k.1.clone(),
                spec: shard.spec.clone(),
                worker,
                text: None,
            });
        };
        let handle = || {
            stage_crashed(
                &client(),
                k.clone(),
                Some(1),
                "boom".into(),
                &shards,
                &metrics,
                &sources,
            )
        };
        // A load of a new spec under way: the crashed stage (the one it
        // replaces) goes; the load stands for the Shard.
        crashed().await;
        set_phase(&shards, &metrics, &k, Some(ShardPhase::Loading));
        handle();
        assert!(shards.served(&k.0, &k.1).is_none());
        assert_eq!(phase(&shards, &k), Some(ShardPhase::Loading));
        assert!(shards.failures.lock().unwrap().is_empty());
        // Ready: the Shard fails, to be tried again.
        crashed().await;
        set_phase(&shards, &metrics, &k, Some(ShardPhase::Ready));
        handle();
        assert!(shards.served(&k.0, &k.1).is_none());
        assert_eq!(phase(&shards, &k), Some(ShardPhase::Failed));
        let record = shards.failures.lock().unwrap()[&k].clone();
        let last = record.last_failure.unwrap_or_default();
        assert!(
            last.starts_with("StageCrashed: the stage's thread panicked: boom"),
            "{last}"
        );
    }
}
