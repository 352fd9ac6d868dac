//! What a stage's machine holds of its Shard's KV cache, in tokens:
//! measured when the stage loads and again every [`INTERVAL`] while it
//! runs, kept in the stage's ledger (a head admits within its own and each
//! of its instance's later stages', see `dataplane::head`) and reported in
//! the Shard's status (`kvBudgetTokens`) when it moves.
//!
//! ```text
//!  memory available + what the stage holds now (its KV, its prefix cache,
//!  and the engine's allocator cache: buffers freed but kept for reuse)
//!    − reserve − prefix-cache budget ─► ÷ bytes a token takes in its layers
//!    ─► at most sequences × cost(context), at least cost(context)
//!  every 15 s ─► ledger.budget_tokens ─► Shard status, when it moved by 1/16
//! ```
//!
//! The figure is in the ledger's units ([`KvCost`]): tokens, but on a
//! stage with sliding layers a sequence costs less than its length.
//!
//! A Mac whose user opens other programs while it serves then makes its
//! instance admit fewer sequences (the youngest are preempted if those
//! running no longer fit) instead of running out of memory, and admits
//! more again when the programs close.

use std::sync::atomic::Ordering;
use std::sync::{Arc, Weak};
use std::time::Duration;

use shardplane_crds::ShardPhase;
use shardplane_engine::pipeline::EngineKind;

use super::{Key, ShardSet};
use crate::kv_budget::KvCost;
use crate::stage::StageStats;

/// How often a running stage measures its machine again.
pub(super) const INTERVAL: Duration = Duration::from_secs(15);

/// A stage's Shard's KV cache and what bounds it on this machine.
#[derive(Debug, Clone)]
pub(super) struct KvRoom {
    /// The Shard's context length.
    pub context: u64,
    /// The Shard's concurrent sequences.
    pub sequences: u64,
    /// Bytes a token takes in the stage's layers.
    pub per_token: u64,
    /// Memory kept free for the rest of the machine (`--memory-reserve`).
    pub reserve: u64,
    /// The stage's prefix cache budget in bytes.
    pub prefix_cache: u64,
    /// What a sequence costs in the budget (its length, unless the stage
    /// has sliding layers).
    pub cost: KvCost,
}

impl KvRoom {
    /// What the Shard asks for: concurrent sequences of its context
    /// length (context × sequences tokens, or less with sliding layers).
    pub fn shard_tokens(&self) -> u64 {
        self.cost.units(self.context).saturating_mul(self.sequences)
    }

    /// Measures the machine now (`available` bytes), counting what the
    /// stage already holds (its KV and prefix cache, and what the engine's
    /// allocator keeps of buffers freed, which the system does not see
    /// freed) as room of its own, and keeps the figure in the stage's
    /// ledger. A figure that grew wakes the generations waiting for room.
    pub fn measure(&self, stats: &StageStats, available: u64) -> u64 {
        let held = stats.kv_cache_bytes.load(Ordering::Relaxed)
            + stats.prefix.lock().unwrap_or_else(|p| p.into_inner()).bytes
            + EngineKind::cached_bytes() as u64;
        let budget = self.tokens(available.saturating_add(held));
        stats.kv.set_budget(budget);
        budget
    }

    /// The Shard's tokens, capped by what `available` bytes hold: less the
    /// reserve and the prefix cache's budget, over the bytes a token takes
    /// in every layer; but never below one whole context, so one sequence
    /// can always run (free memory is an estimate, on macOS a low one).
    pub fn tokens(&self, available: u64) -> u64 {
        let room = available
            .saturating_sub(self.reserve)
            .saturating_sub(self.prefix_cache);
        match room.checked_div(self.per_token) {
            Some(fits) => self
                .shard_tokens()
                .min(fits.max(self.cost.units(self.context))),
            None => self.shard_tokens(),
        }
    }
}

/// Whether a budget moved enough from what the status says to write it
/// again (by a sixteenth or more, either way).
fn moved(reported: u64, now: u64) -> bool {
    reported.abs_diff(now).saturating_mul(16) >= reported.max(1)
}

/// Measures the stage whose counters are `stats` every `every`
/// ([`INTERVAL`]) until it is unloaded or replaced by another load (a stage
/// served on with a new spec, `rewired`, is the same stage), and puts a
/// figure that moved into its Shard's Ready status.
pub(super) async fn remeasure(
    shards: ShardSet,
    k: Key,
    stats: Weak<StageStats>,
    room: KvRoom,
    every: Duration,
) {
    let Some(mut reported) = stats
        .upgrade()
        .map(|s| s.kv.budget_tokens.load(Ordering::Relaxed))
    else {
        return;
    };
    loop {
        tokio::time::sleep(every).await;
        // Held only while measuring: an unloaded stage goes at once.
        let Some(stats) = stats.upgrade() else {
            return;
        };
        let current = shards
            .loaded
            .lock()
            .expect("shard set lock")
            .get(&k)
            .is_some_and(|s| Arc::ptr_eq(&s.worker.stats, &stats));
        if !current {
            return;
        }
        // Reading memory may run programs (sysctl on macOS): off the async threads.
        let available = tokio::task::spawn_blocking(crate::machine::available_memory)
            .await
            .unwrap_or(0);
        // Memory that could not be read says nothing: keep the last figure.
        if available == 0 {
            continue;
        }
        let budget = room.measure(&stats, available);
        if !moved(reported, budget) {
            continue;
        }
        tracing::info!(shard = %k.1, from = reported, to = budget, "the machine holds another amount of KV");
        reported = budget;
        if let Some(status) = shards.statuses.lock().expect("status lock").get(&k) {
            status.send_if_modified(|s| {
                let ready = s.phase == Some(ShardPhase::Ready);
                let changed = s.kv_budget_tokens != Some(budget);
                if ready && changed {
                    s.kv_budget_tokens = Some(budget);
                }
                ready && changed
            });
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::shards::ServedStage;
    use crate::test_stage::Echo;
    use shardplane_crds::ShardStatus;
    use tokio::sync::watch;

    const GIB: u64 = 1 << 30;
    const EVERY: Duration = Duration::from_millis(10);

    fn room(per_token: u64, reserve: u64, prefix_cache: u64) -> KvRoom {
        // 8 sequences of 1024 tokens.
        KvRoom {
            context: 1024,
            sequences: 8,
            per_token,
            reserve,
            prefix_cache,
            cost: KvCost::default(),
        }
    }

    #[test]
    fn a_stages_kv_is_the_shards_unless_free_memory_holds_less() {
        // Room for far more than the Shard asks: the Shard's.
        assert_eq!(room(100_000, GIB, GIB).tokens(16 * GIB), 8192);
        // 2 GiB free, 1 GiB reserved, 512 MiB of prefix cache: 512 MiB for
        // KV at 128 KiB a token.
        assert_eq!(room(128 << 10, GIB, GIB / 2).tokens(2 * GIB), 4096);
        // Less free than the reserve: one whole context still runs.
        assert_eq!(room(1024, GIB, 0).tokens(GIB / 2), 1024);
        // A stage without KV (no bytes per token) keeps the Shard's.
        assert_eq!(room(0, GIB, 0).tokens(0), 8192);
    }

    #[test]
    fn sliding_layers_make_a_shard_ask_for_less() {
        // Three of four layers hold at most 1092 rows (window 4: 4 + 64
        // kept, 256 not yet let go, 256 of rounding, a 512-token step): 8 sequences of 4096 cost ⌈(4096 + 3 × 1092)
        // / 4⌉ = 1843 each.
        let sliding = KvRoom {
            context: 4096,
            cost: KvCost::of_windows(&[Some(4), Some(4), Some(4), None], 512),
            ..room(1000, 0, 0)
        };
        assert_eq!(sliding.shard_tokens(), 8 * 1843);
        assert_eq!(sliding.tokens(u64::MAX), 8 * 1843);
        // Free memory for 3000 tokens at every layer's bytes: 3000, but
        // never less than one sequence's cost.
        assert_eq!(sliding.tokens(3_000_000), 3000);
        assert_eq!(sliding.tokens(0), 1843);
        // Sequences no longer than what the sliding layers hold cost their
        // length.
        let short = KvRoom {
            cost: KvCost::of_windows(&[Some(4), Some(4), Some(4), None], 512),
            ..room(1000, 0, 0)
        };
        assert_eq!(short.shard_tokens(), 8 * 1024);
    }

    #[test]
    fn what_a_stage_holds_counts_as_its_own_room() {
        let stats = StageStats::default();
        // A terabyte a token: only the one context fits in 16 GiB…
        let huge = room(1 << 40, 0, 0);
        assert_eq!(huge.measure(&stats, 16 * GIB), 1024);
        assert_eq!(stats.kv.budget_tokens.load(Ordering::Relaxed), 1024);
        // …unless the stage itself holds the memory: KV it allocated…
        stats.kv_cache_bytes.store(4096 << 40, Ordering::Relaxed);
        assert_eq!(huge.measure(&stats, 16 * GIB), 4096);
        // …and its prefix cache.
        stats.prefix.lock().unwrap().bytes = 2048 << 40;
        assert_eq!(huge.measure(&stats, 16 * GIB), 6144);
        assert_eq!(stats.kv.budget_tokens.load(Ordering::Relaxed), 6144);
    }

    #[tokio::test]
    async fn a_budget_that_grows_wakes_the_generations_waiting_for_room() {
        let stats = StageStats::default();
        let huge = room(1 << 40, 0, 0);
        huge.measure(&stats, 16 * GIB);
        let woken = stats.kv.room.notified();
        tokio::pin!(woken);
        woken.as_mut().enable();
        // Less: nobody is woken.
        huge.measure(&stats, 16 * GIB);
        assert!(tokio::time::timeout(EVERY, woken.as_mut()).await.is_err());
        // More: they are.
        huge.measure(&stats, 3000 << 40);
        tokio::time::timeout(Duration::from_secs(5), woken)
            .await
            .unwrap();
    }

    #[test]
    fn a_budget_is_written_again_when_it_moves_by_a_sixteenth() {
        assert!(!moved(1600, 1600));
        assert!(!moved(1600, 1550));
        assert!(moved(1600, 1500));
        assert!(moved(1600, 1700));
        assert!(moved(0, 1));
    }

    #[tokio::test]
    async fn a_running_stage_is_measured_again_until_it_is_unloaded() {
        let (echo, _) = Echo::new(true);
        let worker = crate::test_stage::quiet_worker("s", Box::new(echo));
        let shard = shardplane_testkit::fixtures::shard(
            "d",
            "node",
            0,
            1,
            shardplane_crds::LayerRange { start: 0, end: 2 },
        );
        let k: Key = ("ns".into(), "s".into());
        let stage = Arc::new(ServedStage {
            namespace: k.0.clone(),
            name: k.1.clone(),
            spec: shard.spec,
            worker,
            text: None,
        });
        let shards = ShardSet::new("127.0.0.1:1");
        shards
            .loaded
            .lock()
            .unwrap()
            .insert(k.clone(), stage.clone());
        let (tx, mut rx) = watch::channel(ShardStatus {
            phase: Some(ShardPhase::Ready),
            kv_budget_tokens: Some(5),
            ..Default::default()
        });
        shards.statuses.lock().unwrap().insert(k.clone(), tx);
        // Measured as 5 tokens at load; the machine now holds the whole
        // context of a terabyte a token (it holds no more than one).
        stage
            .worker
            .stats
            .kv
            .budget_tokens
            .store(5, Ordering::Relaxed);
        let task = tokio::spawn(remeasure(
            shards.clone(),
            k.clone(),
            Arc::downgrade(&stage.worker.stats),
            room(1 << 40, 0, 0),
            EVERY,
        ));
        tokio::time::timeout(Duration::from_secs(5), rx.changed())
            .await
            .unwrap()
            .unwrap();
        assert_eq!(rx.borrow_and_update().kv_budget_tokens, Some(1024));
        assert_eq!(
            stage.worker.stats.kv.budget_tokens.load(Ordering::Relaxed),
            1024
        );
        // Served on with a new spec (the same worker): still measured.
        let rewired = Arc::new(super::super::decide::rewired(&stage, &stage.spec));
        shards.loaded.lock().unwrap().insert(k.clone(), rewired);
        tokio::time::sleep(EVERY * 5).await;
        assert!(!task.is_finished(), "a rewired stage is no longer measured");
        // Replaced by another load: the measuring ends, and does not keep
        // the old stage alive.
        let (echo, _) = Echo::new(true);
        let other = Arc::new(ServedStage {
            namespace: k.0.clone(),
            name: k.1.clone(),
            spec: stage.spec.clone(),
            worker: crate::test_stage::quiet_worker("s", Box::new(echo)),
            text: None,
        });
        shards.loaded.lock().unwrap().insert(k.clone(), other);
        let weak = Arc::downgrade(&stage);
        drop(stage);
        tokio::time::timeout(INTERVAL * 2, task)
            .await
            .unwrap()
            .unwrap();
        assert!(weak.upgrade().is_none(), "the task keeps the stage");
    }
}
