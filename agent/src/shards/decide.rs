//! What to do with a Shard the watch, a load's end or a retry hands over —
//! keep its loaded stage (taking a change around it in place), pass it over
//! to the load under way, leave it, or claim a load — and how a load ends;
//! both decided under the phase lock.
//!
//! ```text
//!  Shard ─► decide ─┬─ Ready or loading, stage loaded, same weights/layers ─► Kept (rewired in place)
//!                   ├─ Downloading / Loading ─► PassedOver (remembered for the load's end)
//!                   ├─ Failed, retry pending or given up on this spec ─► Left
//!                   ├─ a retry, no longer Failed / a load's end, unloaded ─► Left
//!                   └─ otherwise ─► Load (phase claimed: Downloading)
//!
//!  load ok ─► ended ─┬─ its claim stands, stage (or rank) in place ─► Ready
//!                    ├─ its tensor group broke as it formed ─► Broken
//!                    ├─ its stage's thread panicked meanwhile ─► Crashed
//!                    ├─ the Shard was unloaded (and claimed anew) meanwhile ─► Unloaded
//!                    └─ another phase stands ─► Superseded
//! ```

use std::sync::Arc;

use shardplane_crds::{Shard, ShardPhase, ShardSpec};

use super::{Claim, Key, ServedStage, ShardSet, Taken, key, put_phase, take, tensor};
use crate::metrics::Metrics;

/// Who asks [`decide`] about a Shard.
#[derive(Clone, Copy, Debug, PartialEq)]
pub(super) enum Origin {
    /// The watch: the Shard as the API server has it.
    Watch,
    /// A load's end, with a change passed over during the load: left alone
    /// when the Shard was unloaded meanwhile.
    LoadEnd,
    /// A due retry: loads only while the Shard is still Failed (of two
    /// retries due at once, one loads; a Shard unloaded or loaded otherwise
    /// meanwhile is left alone).
    Retry,
}

/// What [`ensure`] does with a Shard ([`decide`]).
#[derive(Debug, PartialEq)]
pub(super) enum Decision {
    /// Its loaded stage (or tensor rank) serves it; `changed`: the stage
    /// took the new spec in place.
    Kept { changed: bool },
    /// A load of it is under way; the load's end takes this one up.
    PassedOver,
    /// Nothing to do: a retry is pending, the spec failed for good, or
    /// the Shard is no longer what the asker expects (see [`Origin`]).
    Left,
    /// Claimed (Downloading): to be loaded under this claim.
    Load(Claim),
}

/// Decides what to do with `shard`. The phase lock is held throughout, so
/// a load's end (which changes the phase, then takes up what was passed
/// over) sees what this passes over, and of two decisions at once (the
/// watch and a load that just ended, or two retries) one claims the load.
pub(super) fn decide(
    shards: &ShardSet,
    metrics: &Metrics,
    shard: &Shard,
    origin: Origin,
) -> Decision {
    let k = key(shard);
    let layers = (shard.spec.layers.start, shard.spec.layers.end);
    // A loaded stage is kept while what it loaded is what the spec names:
    // the same weights (a deployment moved to another Model changes the
    // source in place), layers, template, KV cache (the engine's
    // context and the stage's budget are sized from it) and, on a head, the
    // stage count (it splits its sequences by it). Other changes (the stages
    // around it) are taken in place (`rewired`).
    let same = |loaded: &ShardSpec| {
        (loaded.layers.start, loaded.layers.end) == layers
            && loaded.chat_template == shard.spec.chat_template
            && loaded.source == shard.spec.source
            && loaded.format == shard.spec.format
            && loaded.tensor == shard.spec.tensor
            && loaded.kv_cache == shard.spec.kv_cache
            && (shard.spec.stage != 0 || loaded.stage_count == shard.spec.stage_count)
    };
    // Read before the phase lock: the rank lock is taken before it elsewhere.
    let following = shards
        .ranks
        .lock()
        .expect("rank lock")
        .get(&k)
        .is_some_and(|r| r.follower_bytes.is_some() && r.mesh.broken().is_none() && same(&r.spec));
    let mut phases = shards.phases.lock().expect("phase lock");
    let phase = phases.get(&k).copied();
    match origin {
        Origin::LoadEnd if phase.is_none() => return Decision::Left,
        Origin::Retry if phase != Some(ShardPhase::Failed) => return Decision::Left,
        _ => {}
    }
    // A load of the Shard is under way: this stage's own, still ending, or
    // one of another spec that will replace it. Its end takes this one up
    // (a stage still ending reports the generation it loaded).
    let loading = matches!(phase, Some(ShardPhase::Downloading | ShardPhase::Loading));
    // A stage serves the Shard only while it is Ready or its load ends: a
    // failed Shard's is loaded again. Checked and swapped under the lock of
    // the loaded stages: a stage unloaded meanwhile (its thread crashed) is
    // not put back.
    let kept = match phase {
        Some(ShardPhase::Ready) | Some(ShardPhase::Downloading | ShardPhase::Loading) => {
            let mut loaded = shards.loaded.lock().expect("shard set lock");
            match loaded.get_mut(&k) {
                Some(l) if same(&l.spec) => {
                    let changed = l.spec != shard.spec;
                    if changed {
                        *l = Arc::new(rewired(l, &shard.spec));
                    }
                    Some(changed)
                }
                _ => following.then_some(false),
            }
        }
        _ => None,
    };
    if loading {
        shards.skip(shard.clone());
    }
    if let Some(changed) = kept {
        return Decision::Kept { changed };
    }
    if loading {
        return Decision::PassedOver;
    }
    let mut failures = shards.failures.lock().expect("failure lock");
    if origin == Origin::Retry {
        if let Some(r) = failures.get_mut(&k) {
            r.restarts += 1;
        }
    } else {
        let may_retry = failures
            .get(&k)
            .is_some_and(|r| r.may_try(shard.metadata.generation));
        // A retry is pending, or the spec failed for good: a new spec is tried.
        if phase == Some(ShardPhase::Failed) && !may_retry {
            return Decision::Left;
        }
    }
    drop(failures);
    put_phase(&mut phases, metrics, &k, Some(ShardPhase::Downloading));
    Decision::Load(shards.claim(&k))
}

/// How a load that succeeded ends ([`ended`]).
pub(super) enum End {
    /// Its Ready status was reported and its phase set.
    Ready,
    /// Its tensor group broke as it formed: its rank, if still kept, taken
    /// out to be let go of, and why it broke when known.
    Broken(Option<tensor::Rank>, Option<String>),
    /// Its stage's thread panicked before the load ended (the stage was
    /// let go of then).
    Crashed,
    /// The Shard was unloaded (deleted, moved) during the load: what the
    /// load put in was taken out again, to be let go of (nothing when the
    /// Shard was claimed anew: what the load put in went with the unload).
    Unloaded(Taken),
    /// Another phase stands (set by a failure's handler): left as it is.
    Superseded(ShardPhase),
}

/// Ends Shard `k`'s load (made under `claim`): its status (`ready`,
/// called to report it) and phase become Ready only while its load still
/// stands — its claim still the Shard's, its stage still loaded (a `tensor` rank: its rank still
/// kept, its group whole; a `follower` has no stage). Decided under the
/// rank and phase locks, so that a group's break, a Shard's deletion or a
/// decision cannot come between the check and the write.
pub(super) fn ended(
    shards: &ShardSet,
    metrics: &Metrics,
    (k, claim): (&Key, Claim),
    (tensor, follower): (bool, bool),
    ready: impl FnOnce(),
) -> End {
    let mut ranks = shards.ranks.lock().expect("rank lock");
    let mut phases = shards.phases.lock().expect("phase lock");
    let phase = phases.get(k).copied();
    if phase.is_none() {
        return End::Unloaded(take(k, shards, metrics, &mut ranks, &mut phases));
    }
    // Claimed anew since (unloaded, then back), whatever the new load's
    // phase: nothing of this load is left to take.
    if !shards.owns(k, claim) {
        return End::Unloaded(Taken::none());
    }
    if let Some(other) =
        phase.filter(|p| !matches!(p, ShardPhase::Downloading | ShardPhase::Loading))
    {
        return End::Superseded(other);
    }
    if tensor && ranks.get(k).is_none_or(|r| r.mesh.broken().is_some()) {
        let why = ranks
            .get(k)
            .and_then(|r| r.mesh.broken().map(str::to_string));
        return End::Broken(ranks.remove(k), why);
    }
    if !follower
        && !shards
            .loaded
            .lock()
            .expect("shard set lock")
            .contains_key(k)
    {
        return End::Crashed;
    }
    // Reported before the phase changes: a decision that sees Ready finds
    // the Ready status to update.
    ready();
    put_phase(&mut phases, metrics, k, Some(ShardPhase::Ready));
    End::Ready
}

/// A load that failed. A Failed Shard serves nothing, so what serves the
/// spec it was to replace (a stage, a tensor rank) is taken out, to be let
/// go of; returns it and whether the Shard is still here to fail — when it
/// was unloaded during the load, all of it is taken out again instead, and
/// nothing when it was claimed anew since (the new load stands for it).
pub(super) fn load_failed(
    shards: &ShardSet,
    metrics: &Metrics,
    (k, claim): (&Key, Claim),
) -> (Taken, bool) {
    let mut ranks = shards.ranks.lock().expect("rank lock");
    let mut phases = shards.phases.lock().expect("phase lock");
    if !phases.contains_key(k) {
        return (take(k, shards, metrics, &mut ranks, &mut phases), false);
    }
    if !shards.claimed(&phases, k, claim) {
        return (Taken::none(), false);
    }
    let old = Taken {
        rank: ranks.remove(k),
        stage: shards.loaded.lock().expect("shard set lock").remove(k),
    };
    (old, true)
}

/// A loaded stage whose Shard changed around what it loaded — the stage
/// after or before it was re-placed (a new Shard, so `next` or `previous`
/// names another) — served on with the new `spec`, for the calls that start
/// from now on (sequences under way keep the streams they opened).
pub(super) fn rewired(loaded: &ServedStage, spec: &ShardSpec) -> ServedStage {
    ServedStage {
        namespace: loaded.namespace.clone(),
        name: loaded.name.clone(),
        spec: spec.clone(),
        worker: loaded.worker.clone(),
        text: loaded.text.clone(),
    }
}

#[cfg(test)]
mod tests {
    use shardplane_crds::LayerRange;

    use super::super::{Key, set_phase, unload};
    use super::*;
    use crate::cache::Cache;
    use crate::retry::Record;

    fn at(generation: i64) -> Shard {
        let mut s = shardplane_testkit::fixtures::shard(
            "d",
            "node-0",
            0,
            2,
            LayerRange { start: 0, end: 8 },
        );
        s.metadata.namespace = Some("ns".into());
        s.metadata.generation = Some(generation);
        s
    }

    fn phase(shards: &ShardSet, k: &Key) -> Option<ShardPhase> {
        shards.phases.lock().unwrap().get(k).copied()
    }

    /// The claim `d` made; it must be a load's.
    fn claimed(d: Decision) -> Claim {
        match d {
            Decision::Load(claim) => claim,
            d => panic!("not claimed: {d:?}"),
        }
    }

    #[test]
    fn a_shard_is_claimed_once_and_changes_during_its_load_pass_to_its_end() {
        let (shards, metrics) = (ShardSet::new("127.0.0.1:1"), Metrics::new());
        let k = key(&at(1));
        claimed(decide(&shards, &metrics, &at(1), Origin::Watch));
        assert_eq!(phase(&shards, &k), Some(ShardPhase::Downloading));
        // The same spec again (the watch restarted), then changes: passed
        // over to the running load, the newest remembered.
        assert_eq!(
            decide(&shards, &metrics, &at(1), Origin::Watch),
            Decision::PassedOver
        );
        assert_eq!(
            decide(&shards, &metrics, &at(2), Origin::Watch),
            Decision::PassedOver
        );
        set_phase(&shards, &metrics, &k, Some(ShardPhase::Loading));
        assert_eq!(
            decide(&shards, &metrics, &at(3), Origin::Watch),
            Decision::PassedOver
        );
        let taken = shards.take_skipped(&k, Some(1)).expect("passed over");
        assert_eq!(taken.metadata.generation, Some(3));
        // A load's end asks again for a Shard unloaded meanwhile: left alone.
        let cache_dir = tempfile::tempdir().unwrap();
        let http = shardplane_models::http_client().unwrap();
        let cache = Cache::new(cache_dir.path().into(), http).unwrap();
        unload(&k, &shards, &metrics, &cache);
        assert_eq!(
            decide(&shards, &metrics, &at(3), Origin::LoadEnd),
            Decision::Left
        );
        assert_eq!(phase(&shards, &k), None);
    }

    #[test]
    fn a_failed_spec_is_left_until_a_new_one_comes_unless_a_retry_is_pending() {
        let (shards, metrics) = (ShardSet::new("127.0.0.1:1"), Metrics::new());
        let k = key(&at(1));
        let fail = |reason: &'static str| {
            shards
                .failures
                .lock()
                .unwrap()
                .entry(k.clone())
                .or_default()
                .failed(reason, "x", Some(1));
            set_phase(&shards, &metrics, &k, Some(ShardPhase::Failed));
        };
        // For good: that spec is left; a new one is loaded.
        fail("ArchitectureUnsupported");
        assert_eq!(
            decide(&shards, &metrics, &at(1), Origin::Watch),
            Decision::Left
        );
        claimed(decide(&shards, &metrics, &at(2), Origin::LoadEnd));
        // A retry pending: it reads the Shard as it then is; nothing now.
        fail("DownloadFailed");
        assert_eq!(
            decide(&shards, &metrics, &at(3), Origin::Watch),
            Decision::Left
        );
        assert_eq!(phase(&shards, &k), Some(ShardPhase::Failed));
    }

    #[test]
    fn a_loaded_stage_takes_a_change_around_it_in_place() {
        let (shards, metrics) = (ShardSet::new("127.0.0.1:1"), Metrics::new());
        let loaded = at(1);
        let k = key(&loaded);
        shards.insert(ServedStage {
            namespace: k.0.clone(),
            name: k.1.clone(),
            spec: loaded.spec.clone(),
            worker: crate::test_stage::quiet_worker(
                &k.1,
                Box::new(crate::test_stage::Echo::middle()),
            ),
            text: None,
        });
        set_phase(&shards, &metrics, &k, Some(ShardPhase::Ready));
        let mut moved = at(2);
        moved.spec.next = Some("d-0-1-elsewhere".into());
        assert_eq!(
            decide(&shards, &metrics, &moved, Origin::Watch),
            Decision::Kept { changed: true }
        );
        let served = shards.served(&k.0, &k.1).unwrap();
        assert_eq!(served.spec.next.as_deref(), Some("d-0-1-elsewhere"));
        assert!(
            shards.take_skipped(&k, Some(1)).is_none(),
            "nothing to take up"
        );
        // Its load still ending: served on, and passed to the load's end
        // too (its Ready status is still to come).
        set_phase(&shards, &metrics, &k, Some(ShardPhase::Loading));
        let mut again = at(3);
        again.spec.next = Some("d-0-1-third".into());
        assert_eq!(
            decide(&shards, &metrics, &again, Origin::Watch),
            Decision::Kept { changed: true }
        );
        let taken = shards.take_skipped(&k, Some(1)).expect("passed over");
        assert_eq!(taken.metadata.generation, Some(3));
        // Other layers: loaded again.
        set_phase(&shards, &metrics, &k, Some(ShardPhase::Ready));
        let mut other = at(4);
        other.spec.layers = LayerRange { start: 0, end: 4 };
        claimed(decide(&shards, &metrics, &other, Origin::Watch));
    }

    #[test]
    fn a_change_passed_over_during_a_load_is_taken_up_once_when_newer() {
        let shards = ShardSet::new("127.0.0.1:1");
        let k = key(&at(1));
        // Nothing passed over: the load ends with nothing to take up.
        assert!(shards.take_skipped(&k, Some(1)).is_none());
        shards.skip(at(3));
        // An older generation arriving late does not replace the newest.
        shards.skip(at(2));
        let newer = shards.take_skipped(&k, Some(1)).expect("the newest spec");
        assert_eq!(newer.metadata.generation, Some(3));
        // Taken once.
        assert!(shards.take_skipped(&k, Some(1)).is_none());
        // What the load itself ran as (the watch and the load saw the same
        // spec) is not loaded again, and is forgotten.
        shards.skip(at(4));
        assert!(shards.take_skipped(&k, Some(4)).is_none());
        assert!(shards.skipped.lock().unwrap().is_empty());
        // An unloaded Shard forgets what was passed over.
        shards.skip(at(5));
        let metrics = Metrics::new();
        let dir = tempfile::tempdir().unwrap();
        let http = shardplane_models::http_client().unwrap();
        let cache = Cache::new(dir.path().into(), http).unwrap();
        unload(&k, &shards, &metrics, &cache);
        assert!(shards.take_skipped(&k, Some(1)).is_none());
    }

    /// A stage serving Shard `at(1)` (a middle stage; its thread idle).
    fn serve(shards: &ShardSet) -> Key {
        let shard = at(1);
        let k = key(&shard);
        shards.insert(ServedStage {
            namespace: k.0.clone(),
            name: k.1.clone(),
            spec: shard.spec.clone(),
            worker: crate::test_stage::quiet_worker(
                &k.1,
                Box::new(crate::test_stage::Echo::middle()),
            ),
            text: None,
        });
        k
    }

    fn failed(shards: &ShardSet, metrics: &Metrics, k: &Key, reason: &'static str) {
        let mut record = Record::default();
        record.failed(reason, "x", Some(1));
        shards.failures.lock().unwrap().insert(k.clone(), record);
        set_phase(shards, metrics, k, Some(ShardPhase::Failed));
    }

    #[test]
    fn a_retry_loads_only_a_shard_still_failed_and_once() {
        let (shards, metrics) = (ShardSet::new("127.0.0.1:1"), Metrics::new());
        let k = key(&at(1));
        // Unloaded (deleted, moved) before the retry was due: left alone.
        assert_eq!(
            decide(&shards, &metrics, &at(1), Origin::Retry),
            Decision::Left
        );
        assert_eq!(phase(&shards, &k), None);
        // Still Failed: claimed, the restart counted; a second retry due
        // at once, or the watch, finds the load under way.
        failed(&shards, &metrics, &k, "DownloadFailed");
        claimed(decide(&shards, &metrics, &at(1), Origin::Retry));
        assert_eq!(phase(&shards, &k), Some(ShardPhase::Downloading));
        assert_eq!(shards.failures.lock().unwrap()[&k].restarts, 1);
        assert_eq!(
            decide(&shards, &metrics, &at(1), Origin::Retry),
            Decision::Left
        );
        assert_eq!(
            decide(&shards, &metrics, &at(1), Origin::Watch),
            Decision::PassedOver
        );
        assert_eq!(shards.failures.lock().unwrap()[&k].restarts, 1);
    }

    #[test]
    fn a_failed_shards_stage_is_not_kept_serving() {
        let (shards, metrics) = (ShardSet::new("127.0.0.1:1"), Metrics::new());
        let k = serve(&shards);
        // A stage of the same spec is loaded, but the Shard failed: the
        // stage is not taken as serving it (its status says Failed); the
        // retry loads it again.
        failed(&shards, &metrics, &k, "DownloadFailed");
        assert_eq!(
            decide(&shards, &metrics, &at(1), Origin::Watch),
            Decision::Left
        );
        claimed(decide(&shards, &metrics, &at(1), Origin::Retry));
    }

    #[test]
    fn a_load_ends_ready_only_while_it_still_stands() {
        let (shards, metrics) = (ShardSet::new("127.0.0.1:1"), Metrics::new());
        let reported = std::cell::Cell::new(0);
        let ready = || reported.set(reported.get() + 1);
        let k = key(&at(1));
        // Its stage in place: Ready, reported before the phase changed.
        let claim = claimed(decide(&shards, &metrics, &at(1), Origin::Watch));
        serve(&shards);
        assert!(matches!(
            ended(&shards, &metrics, (&k, claim), (false, false), ready),
            End::Ready
        ));
        assert_eq!(
            (reported.get(), phase(&shards, &k)),
            (1, Some(ShardPhase::Ready))
        );
        // Its stage's thread panicked before the end (the crash's handler
        // let go of the stage): not Ready.
        set_phase(&shards, &metrics, &k, Some(ShardPhase::Loading));
        shards.loaded.lock().unwrap().remove(&k);
        assert!(matches!(
            ended(&shards, &metrics, (&k, claim), (false, false), ready),
            End::Crashed
        ));
        assert_eq!(
            (reported.get(), phase(&shards, &k)),
            (1, Some(ShardPhase::Loading))
        );
        // A follower has no stage; its rank gone (its group broke and the
        // break's handler let go of it): broken.
        assert!(matches!(
            ended(&shards, &metrics, (&k, claim), (true, true), ready),
            End::Broken(None, None)
        ));
        // Another phase stands: left as it is.
        set_phase(&shards, &metrics, &k, Some(ShardPhase::Failed));
        assert!(matches!(
            ended(&shards, &metrics, (&k, claim), (false, false), ready),
            End::Superseded(ShardPhase::Failed)
        ));
        // Unloaded during the load (deleted): what the load put in and
        // reported is taken out again.
        serve(&shards);
        let (tx, _rx) = tokio::sync::watch::channel(Default::default());
        shards.statuses.lock().unwrap().insert(k.clone(), tx);
        set_phase(&shards, &metrics, &k, None);
        match ended(&shards, &metrics, (&k, claim), (false, false), ready) {
            End::Unloaded(taken) => assert!(taken.stage.is_some()),
            _ => panic!("not unloaded"),
        }
        assert_eq!(reported.get(), 1);
        assert!(shards.served(&k.0, &k.1).is_none());
        assert!(shards.statuses.lock().unwrap().is_empty());
        assert_eq!(phase(&shards, &k), None);
    }

    #[test]
    fn a_failed_load_lets_go_of_the_stage_it_was_to_replace() {
        let (shards, metrics) = (ShardSet::new("127.0.0.1:1"), Metrics::new());
        let k = serve(&shards);
        set_phase(&shards, &metrics, &k, Some(ShardPhase::Loading));
        let claim = shards.claim(&k);
        let (old, here) = load_failed(&shards, &metrics, (&k, claim));
        assert!(here && old.stage.is_some());
        assert!(shards.served(&k.0, &k.1).is_none());
        // The phase is the failure's to set.
        assert_eq!(phase(&shards, &k), Some(ShardPhase::Loading));
        // Unloaded during the load: nothing to fail.
        set_phase(&shards, &metrics, &k, None);
        let (_, here) = load_failed(&shards, &metrics, (&k, claim));
        assert!(!here);
    }

    #[test]
    fn a_load_of_a_shard_unloaded_and_claimed_anew_ends_over_nothing() {
        let (shards, metrics) = (ShardSet::new("127.0.0.1:1"), Metrics::new());
        let reported = std::cell::Cell::new(0);
        let ready = || reported.set(reported.get() + 1);
        let k = key(&at(1));
        let old = claimed(decide(&shards, &metrics, &at(1), Origin::Watch));
        // Deleted and created again under its name (or moved away and
        // back) while the old load ran: unloaded, then claimed anew.
        let cache_dir = tempfile::tempdir().unwrap();
        let http = shardplane_models::http_client().unwrap();
        let cache = Cache::new(cache_dir.path().into(), http).unwrap();
        unload(&k, &shards, &metrics, &cache);
        let new = claimed(decide(&shards, &metrics, &at(1), Origin::Watch));
        assert_ne!(old, new);
        let stands = |claim| shards.claimed(&shards.phases.lock().unwrap(), &k, claim);
        assert!(stands(new) && !stands(old));
        // The new load's stage is in place; the old load ends (or fails)
        // over nothing of it: not Ready, nothing taken, nothing failed.
        serve(&shards);
        match ended(&shards, &metrics, (&k, old), (false, false), ready) {
            End::Unloaded(taken) => assert!(taken.stage.is_none() && taken.rank.is_none()),
            _ => panic!("the old load ended over the new claim"),
        }
        let (taken, here) = load_failed(&shards, &metrics, (&k, old));
        assert!(!here && taken.stage.is_none());
        assert_eq!(
            (reported.get(), phase(&shards, &k)),
            (0, Some(ShardPhase::Downloading))
        );
        assert!(shards.served(&k.0, &k.1).is_some());
        // The new load's own end: Ready.
        assert!(matches!(
            ended(&shards, &metrics, (&k, new), (false, false), ready),
            End::Ready
        ));
        assert_eq!(reported.get(), 1);
        // The old load ending only now, over the new one's Ready: still
        // nothing of it (not taken as a load superseded by a phase, whose
        // end would take up what the new one passed over).
        match ended(&shards, &metrics, (&k, old), (false, false), ready) {
            End::Unloaded(taken) => assert!(taken.stage.is_none() && taken.rank.is_none()),
            _ => panic!("the old load ended over the new one's Ready"),
        }
        assert_eq!(phase(&shards, &k), Some(ShardPhase::Ready));
    }
}
