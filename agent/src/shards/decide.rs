//! What to do with a Shard the watch (or a load's end, or a retry) hands
//! over: keep its loaded stage (taking a change around it in place), pass it
//! over to the load under way, leave it, or claim a load — decided under the
//! phase lock.
//!
//! ```text
//!  Shard ─► decide ─┬─ stage loaded, same weights/layers ─► Kept (rewired in place)
//!                   ├─ Downloading / Loading ─► PassedOver (remembered for the load's end)
//!                   ├─ Failed, retry pending or given up on this spec ─► Left
//!                   └─ otherwise ─► Load (phase claimed: Downloading)
//! ```

use std::sync::Arc;

use shardplane_crds::{Shard, ShardPhase, ShardSpec};

use super::{ServedStage, ShardSet, key, put_phase};
use crate::metrics::Metrics;

/// What [`ensure`] does with a Shard ([`decide`]).
#[derive(Debug, PartialEq)]
pub(super) enum Decision {
    /// Its loaded stage (or tensor rank) serves it; `changed`: the stage
    /// took the new spec in place.
    Kept { changed: bool },
    /// A load of it is under way; the load's end takes this one up.
    PassedOver,
    /// Nothing to do: a retry is pending, the spec failed for good, or
    /// (after a load) the Shard was unloaded meanwhile.
    Left,
    /// Claimed (Downloading): to be loaded.
    Load,
}

/// Decides what to do with `shard`. The phase lock is held throughout, so
/// a load's end (which changes the phase, then takes up what was passed
/// over) sees what this passes over, and of two decisions at once (the
/// watch and a load that just ended) one claims the load. `after_load`: a
/// load's end asks; a Shard unloaded meanwhile is left alone.
pub(super) fn decide(
    shards: &ShardSet,
    metrics: &Metrics,
    shard: &Shard,
    after_load: bool,
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
    if after_load && phase.is_none() {
        return Decision::Left;
    }
    // A load of the Shard is under way: this stage's own, still ending, or
    // one of another spec that will replace it. Its end takes this one up
    // (a stage still ending reports the generation it loaded).
    let loading = matches!(phase, Some(ShardPhase::Downloading | ShardPhase::Loading));
    // Checked and swapped under the lock of the loaded stages: a stage
    // unloaded meanwhile (its thread crashed) is not put back.
    let kept = {
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
    let may_retry = shards
        .failures
        .lock()
        .expect("failure lock")
        .get(&k)
        .is_some_and(|r| r.may_try(shard.metadata.generation));
    // A retry is pending, or the spec failed for good: a new spec is tried.
    if phase == Some(ShardPhase::Failed) && !may_retry {
        return Decision::Left;
    }
    put_phase(&mut phases, metrics, &k, Some(ShardPhase::Downloading));
    Decision::Load
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

    #[test]
    fn a_shard_is_claimed_once_and_changes_during_its_load_pass_to_its_end() {
        let (shards, metrics) = (ShardSet::new("127.0.0.1:1"), Metrics::new());
        let k = key(&at(1));
        assert_eq!(decide(&shards, &metrics, &at(1), false), Decision::Load);
        assert_eq!(phase(&shards, &k), Some(ShardPhase::Downloading));
        // The same spec again (the watch restarted), then changes: passed
        // over to the running load, the newest remembered.
        assert_eq!(
            decide(&shards, &metrics, &at(1), false),
            Decision::PassedOver
        );
        assert_eq!(
            decide(&shards, &metrics, &at(2), false),
            Decision::PassedOver
        );
        set_phase(&shards, &metrics, &k, Some(ShardPhase::Loading));
        assert_eq!(
            decide(&shards, &metrics, &at(3), false),
            Decision::PassedOver
        );
        let taken = shards.take_skipped(&k, Some(1)).expect("passed over");
        assert_eq!(taken.metadata.generation, Some(3));
        // A load's end asks again for a Shard unloaded meanwhile: left alone.
        let cache_dir = tempfile::tempdir().unwrap();
        let http = shardplane_models::http_client().unwrap();
        let cache = Cache::new(cache_dir.path().into(), http).unwrap();
        unload(&k, &shards, &metrics, &cache);
        assert_eq!(decide(&shards, &metrics, &at(3), true), Decision::Left);
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
        assert_eq!(decide(&shards, &metrics, &at(1), false), Decision::Left);
        assert_eq!(decide(&shards, &metrics, &at(2), true), Decision::Load);
        // A retry pending: it reads the Shard as it then is; nothing now.
        fail("DownloadFailed");
        assert_eq!(decide(&shards, &metrics, &at(3), false), Decision::Left);
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
            decide(&shards, &metrics, &moved, false),
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
            decide(&shards, &metrics, &again, false),
            Decision::Kept { changed: true }
        );
        let taken = shards.take_skipped(&k, Some(1)).expect("passed over");
        assert_eq!(taken.metadata.generation, Some(3));
        // Other layers: loaded again.
        set_phase(&shards, &metrics, &k, Some(ShardPhase::Ready));
        let mut other = at(4);
        other.spec.layers = LayerRange { start: 0, end: 4 };
        assert_eq!(decide(&shards, &metrics, &other, false), Decision::Load);
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
}
