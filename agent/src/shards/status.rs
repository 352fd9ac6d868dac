//! A Shard's status as this node reports it: one writer task per Shard
//! applies the latest status it was given, retried until it lands.
//!
//! ```text
//!  report(status) ─► watch channel ─► status_writer ─► apply status (retried, newest wins)
//!  report_seen(generation) ─► Ready status's observedGeneration, in place
//!  reassert ─► the last status again, when the operator marked it Unknown
//! ```

use kube::{Api, Client};
use shardplane_crds::{AGENT_MANAGER, Shard, ShardPhase, ShardStatus};
use tokio::sync::watch;

use super::{Claim, Key, ShardSet};

/// Sets the status Shard `k` should show. Its one writer applies the latest
/// status in order; one superseded before it could be written is skipped.
pub(super) fn report(client: &Client, shards: &ShardSet, k: &Key, status: ShardStatus) {
    let mut statuses = shards.statuses.lock().expect("status lock");
    match statuses.get(k) {
        Some(tx) => {
            tx.send_replace(status);
        }
        None => {
            let (tx, rx) = watch::channel(status);
            statuses.insert(k.clone(), tx);
            tokio::spawn(status_writer(client.clone(), shards.clone(), k.clone(), rx));
        }
    }
}

/// [`report`], while the load that made `claim` still stands for Shard
/// `k`: a load whose Shard went (or was claimed anew) meanwhile reports
/// nothing over what is there now.
pub(super) fn report_claimed(
    client: &Client,
    shards: &ShardSet,
    (k, claim): (&Key, Claim),
    status: ShardStatus,
) {
    let phases = shards.phases.lock().expect("phase lock");
    if shards.claimed(&phases, k, claim) {
        report(client, shards, k, status);
    }
}

/// The one writer of Shard `k`'s status: writes each status it is given
/// (the latest when several came meanwhile), until the Shard is unloaded.
/// A write that fails (the API server or the admission webhook away) is
/// retried with backoff until it lands or a newer status replaces it; a
/// Shard that is gone is not written.
async fn status_writer(
    client: Client,
    shards: ShardSet,
    k: Key,
    mut statuses: watch::Receiver<ShardStatus>,
) {
    'statuses: loop {
        let status = statuses.borrow_and_update().clone();
        let mut wait = STATUS_RETRY_FIRST;
        loop {
            match write_status(&client, &shards, &k, &status).await {
                Ok(()) => break,
                Err(kube::Error::Api(e)) if e.code == 404 => break,
                Err(e) => {
                    tracing::warn!(shard = %k.1, error = %e, retry_in = ?wait, "cannot report shard status");
                    tokio::select! {
                        changed = statuses.changed() => match changed {
                            Ok(()) => continue 'statuses,
                            Err(_) => return,
                        },
                        () = tokio::time::sleep(wait) => {}
                    }
                    wait = (wait * 2).min(STATUS_RETRY_MAX);
                }
            }
        }
        if statuses.changed().await.is_err() {
            return;
        }
    }
}

/// The first wait before a failed status write is retried; it doubles up to
/// [`STATUS_RETRY_MAX`].
const STATUS_RETRY_FIRST: std::time::Duration = std::time::Duration::from_secs(1);
/// The longest wait between retries of a status write.
const STATUS_RETRY_MAX: std::time::Duration = std::time::Duration::from_secs(30);

/// Writes the Shard's status, with its failure record (every write carries
/// it: fields the agent leaves out of an apply are removed).
async fn write_status(
    client: &Client,
    shards: &ShardSet,
    k: &Key,
    status: &ShardStatus,
) -> kube::Result<()> {
    let api: Api<Shard> = Api::namespaced(client.clone(), &k.0);
    let mut status = status.clone();
    if let Some(r) = shards.failures.lock().expect("failure lock").get(k) {
        status.restarts = (r.restarts > 0).then_some(r.restarts);
        status.last_failure.clone_from(&r.last_failure);
    }
    shardplane_cluster::apply_status(&api, &k.1, AGENT_MANAGER, &status).await
}

/// Writes the status last given for `k` again when the Shard shows
/// `Unknown`: the operator marked it so while this node was cut off.
pub(super) fn reassert(shards: &ShardSet, k: &Key, shown: Option<ShardPhase>) {
    let local = shards.phases.lock().expect("phase lock").get(k).copied();
    if shown == Some(ShardPhase::Unknown)
        && local.is_some()
        && let Some(tx) = shards.statuses.lock().expect("status lock").get(k)
    {
        tracing::info!(shard = %k.1, ?local, "reporting the shard's status again");
        tx.send_modify(|_| ());
    }
}

/// A kept stage serves Shard `k`'s spec of `generation`: its Ready status
/// says so (in place, so a status set meanwhile — a crash's Failed — is
/// neither overwritten nor given this generation).
pub(super) fn report_seen(shards: &ShardSet, k: &Key, generation: Option<i64>) {
    if let Some(status) = shards.statuses.lock().expect("status lock").get(k) {
        status.send_if_modified(|s| {
            let behind = s.phase == Some(ShardPhase::Ready) && s.observed_generation < generation;
            if behind {
                s.observed_generation = generation;
            }
            behind
        });
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_kept_stage_reports_a_newer_generation_only_on_its_ready_status() {
        let shards = ShardSet::new("127.0.0.1:1");
        let k: Key = ("ns".into(), "s".into());
        let (tx, rx) = watch::channel(ShardStatus {
            phase: Some(ShardPhase::Ready),
            observed_generation: Some(1),
            ..Default::default()
        });
        shards.statuses.lock().unwrap().insert(k.clone(), tx);
        report_seen(&shards, &k, Some(2));
        assert_eq!(rx.borrow().observed_generation, Some(2));
        // Never backwards.
        report_seen(&shards, &k, Some(1));
        assert_eq!(rx.borrow().observed_generation, Some(2));
        // A status set meanwhile (the stage crashed) is left as it is.
        shards.statuses.lock().unwrap()[&k].send_modify(|s| {
            s.phase = Some(ShardPhase::Failed);
            s.reason = Some("StageCrashed".into());
        });
        report_seen(&shards, &k, Some(3));
        let shown = rx.borrow();
        assert_eq!(
            (shown.phase, shown.observed_generation),
            (Some(ShardPhase::Failed), Some(2))
        );
    }
}
