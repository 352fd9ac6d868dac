//! A head stage's KV budget and the shares of it that its generations
//! hold: admission, growth, and preemption of the youngest.
//!
//! ```text
//!  admit: take(prompt + 16) ─► each step: grow by 16 ─► ok: run it
//!                                                  │ no room
//!                    ask the youngest younger holder to yield, wait for it
//!                    (none younger, or asked to yield itself):
//!                    give_back ─► regain (before new admissions) ─► recompute
//! ```
//!
//! The budget is the Shard's `kvCache` in tokens (context length ×
//! concurrent sequences, or its sequences' [`KvCost`]), what placement made room for on every stage of
//! the instance, capped by each stage machine's free memory at load
//! (`shards::kv_room`, again while it runs): the head's own, and the least the later
//! stages report in their Shards' status (`kvBudgetTokens`), since the
//! head's generations are all that a later stage holds.
//!
//! A whole model with sliding-window layers (Gemma 3, gpt-oss) counts a
//! sequence by its [`KvCost`]: tokens at the bytes a token takes in every
//! layer, where a sliding layer holds at most its kept rows, so a long
//! sequence costs less than its length and more of them fit.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, OnceLock};

use tokio::sync::Notify;

/// A head's KV budget, what is reserved of it, and who waits for room.
/// Its `_tokens` figures are in the budget's units ([`KvLedger::units`]):
/// tokens, or what sequences cost on a whole model with sliding layers.
#[derive(Debug, Default)]
pub struct KvLedger {
    /// Tokens of KV the generations admitted here may come to hold, at
    /// most (in the budget's units, [`KvLedger::units`]).
    pub reserved_tokens: AtomicU64,
    /// Tokens of KV the stage holds at most (its Shard's context length ×
    /// concurrent sequences, or their cost, capped by its machine's free
    /// memory; 0: not set).
    pub budget_tokens: AtomicU64,
    /// The least a later stage of the instance holds (0: none reported).
    pub downstream_tokens: AtomicU64,
    /// Generations preempted for room that wait to resume.
    pub preempted_waiting: AtomicU64,
    /// Generations that wait for a younger one to yield them room.
    pub growers_waiting: AtomicU64,
    /// Generations preempted for room so far.
    pub preemptions: AtomicU64,
    /// Woken when reserved KV is given back, and when a generation is asked
    /// to yield its room.
    pub room: Notify,
    /// The generations that hold KV, with their age.
    holders: Mutex<Vec<Holder>>,
    /// The next admission's number (its age: lower is older).
    admissions: AtomicU64,
    /// What a sequence costs in the budget (unset: its length).
    cost: OnceLock<KvCost>,
}

/// What a sequence of some tokens costs in a stage's KV budget: tokens at
/// the bytes a token takes in all the stage's layers, where a sliding
/// layer holds at most `rows` of any sequence.
///
/// ```text
///  units(t) = ⌈ (full layers × t + Σ sliding layers × min(t, rows)) / layers ⌉
/// ```
///
/// Without sliding layers a sequence costs its length. Gemma 3 27B (62
/// layers, 52 sliding with a window of 1024, holding at most 3840 rows with
/// 512-token prompt steps): a 32k-token sequence costs 8506.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct KvCost {
    /// The stage's layers.
    layers: u64,
    /// Rows held at most, and how many layers hold so few.
    capped: Vec<(u64, u64)>,
}

impl KvCost {
    /// The cost on layers of these windows (`None`: a full layer) when a
    /// step takes at most `step` prompt tokens; see
    /// [`shardplane_engine::config::sliding_rows_held`].
    pub fn of_windows(windows: &[Option<usize>], step: usize) -> Self {
        let mut capped: Vec<(u64, u64)> = Vec::new();
        for window in windows.iter().flatten() {
            let rows = shardplane_engine::config::sliding_rows_held(*window, step) as u64;
            match capped.iter_mut().find(|(r, _)| *r == rows) {
                Some((_, n)) => *n += 1,
                None => capped.push((rows, 1)),
            }
        }
        KvCost {
            layers: windows.len() as u64,
            capped,
        }
    }

    /// What a sequence of `tokens` costs.
    pub fn units(&self, tokens: u64) -> u64 {
        if self.capped.is_empty() || self.layers == 0 {
            return tokens;
        }
        let held: u64 = self.capped.iter().map(|(_, n)| n).sum();
        let full = u128::from(self.layers.saturating_sub(held)) * u128::from(tokens);
        let sliding: u128 = self
            .capped
            .iter()
            .map(|&(rows, n)| u128::from(n) * u128::from(tokens.min(rows)))
            .sum();
        u64::try_from((full + sliding).div_ceil(u128::from(self.layers))).unwrap_or(u64::MAX)
    }
}

impl KvLedger {
    /// Tokens of KV the head admits at most: the least of its own budget and
    /// its later stages' (0: neither is set, nothing is refused).
    pub fn budget(&self) -> u64 {
        Self::least(
            self.budget_tokens.load(Ordering::Relaxed),
            self.downstream_tokens.load(Ordering::Relaxed),
        )
    }

    fn least(own: u64, downstream: u64) -> u64 {
        match (own, downstream) {
            (0, d) => d,
            (o, 0) => o,
            (o, d) => o.min(d),
        }
    }

    /// Sets the stage's own budget (`own`) or the least of its later
    /// stages' (`downstream`); a budget that grew (or became unbounded)
    /// wakes the generations waiting for room.
    pub fn set(&self, own: Option<u64>, downstream: Option<u64>) {
        let before = self.budget();
        if let Some(own) = own {
            self.budget_tokens.store(own, Ordering::Relaxed);
        }
        if let Some(downstream) = downstream {
            self.downstream_tokens.store(downstream, Ordering::Relaxed);
        }
        let after = self.budget();
        if before > 0 && (after == 0 || after > before) {
            self.room.notify_waiters();
        }
    }

    /// Sets what a sequence costs in the budget (once, when the stage
    /// loads, before it admits anything); a second cost is ignored.
    pub fn set_cost(&self, cost: KvCost) {
        let _ = self.cost.set(cost);
    }

    /// What a sequence of `tokens` costs in the budget.
    pub fn units(&self, tokens: u64) -> u64 {
        self.cost.get().map_or(tokens, |c| c.units(tokens))
    }

    /// Generations that wait for room (preempted, or to grow): a new one is
    /// not admitted before them.
    pub fn waiting(&self) -> u64 {
        self.preempted_waiting.load(Ordering::Acquire)
            + self.growers_waiting.load(Ordering::Acquire)
    }
}

/// A generation that holds KV: when it was admitted, and
/// whether an older one asked it to yield its room.
#[derive(Debug)]
struct Holder {
    admitted: u64,
    yield_asked: Arc<AtomicBool>,
}

/// Counts itself in a counter while it lives; wakes the waiters for room
/// when it goes.
struct Counted<'a>(&'a KvLedger, &'a AtomicU64);

impl<'a> Counted<'a> {
    fn new(ledger: &'a KvLedger, counter: &'a AtomicU64) -> Self {
        counter.fetch_add(1, Ordering::AcqRel);
        Counted(ledger, counter)
    }
}

impl Drop for Counted<'_> {
    fn drop(&mut self) {
        self.1.fetch_sub(1, Ordering::AcqRel);
        self.0.room.notify_waiters();
    }
}

/// A generation's share of a stage's KV budget, given back when dropped.
///
/// A share ([`KvReservation::take`]) grows as its generation decodes. One that cannot grow asks the youngest younger
/// holder to yield its room ([`KvReservation::ask_younger_to_yield`]) and
/// waits for it; the youngest yields itself (gives its share back, then
/// [`KvReservation::regain`]s it, keeping its age). So the oldest
/// generations go on and the newest wait, as with vLLM's preemption.
#[derive(Debug)]
pub struct KvReservation {
    ledger: Arc<KvLedger>,
    /// Tokens of its sequence the share covers.
    tokens: u64,
    /// What they cost in the budget.
    units: u64,
    /// When it was admitted.
    admitted: u64,
    /// Set when an older generation asks it to yield.
    yield_asked: Arc<AtomicBool>,
}

impl KvReservation {
    /// Reserves what `tokens` cost in `ledger`'s budget
    /// ([`KvLedger::units`]) as a share that grows and may
    /// be asked to yield, or says how much is taken (all of it, to a new
    /// generation, while others wait for room: they go first).
    pub fn take(ledger: &Arc<KvLedger>, tokens: u64) -> Result<Self, (u64, u64)> {
        let mut r = KvReservation {
            ledger: ledger.clone(),
            tokens: 0,
            units: 0,
            admitted: ledger.admissions.fetch_add(1, Ordering::AcqRel),
            yield_asked: Arc::default(),
        };
        if ledger.waiting() > 0 {
            return Err((
                ledger.reserved_tokens.load(Ordering::Relaxed),
                ledger.budget(),
            ));
        }
        r.grow(tokens)?;
        r.hold();
        Ok(r)
    }

    /// Tokens of its sequence the share covers.
    pub fn tokens(&self) -> u64 {
        self.tokens
    }

    /// Grows the share to cover `tokens` of its sequence (never shrinks
    /// it), or says how much of the budget is taken (in the budget's
    /// units, [`KvLedger::units`]).
    pub fn grow(&mut self, tokens: u64) -> Result<(), (u64, u64)> {
        if tokens <= self.tokens {
            return Ok(());
        }
        let units = self.ledger.units(tokens);
        let more = units.saturating_sub(self.units);
        if more == 0 {
            // Past what its sliding layers hold, nothing more.
            self.tokens = tokens;
            return Ok(());
        }
        let budget = self.ledger.budget();
        self.ledger
            .reserved_tokens
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |reserved| {
                (budget == 0 || reserved + more <= budget).then_some(reserved + more)
            })
            .map(|_| {
                self.tokens = tokens;
                self.units += more;
            })
            .map_err(|reserved| (reserved, budget))
    }

    /// Whether an older generation asked this one to yield its room.
    pub fn yield_asked(&self) -> bool {
        self.yield_asked.load(Ordering::Acquire)
    }

    /// Asks the youngest holder younger than this one to yield its room
    /// (unless one already is); false when there is none, and this one
    /// should yield itself.
    pub fn ask_younger_to_yield(&self) -> bool {
        let holders = self.ledger.holders.lock().expect("holders lock");
        let younger = holders.iter().filter(|h| h.admitted > self.admitted);
        if younger
            .clone()
            .any(|h| h.yield_asked.load(Ordering::Acquire))
        {
            return true;
        }
        let Some(youngest) = younger.max_by_key(|h| h.admitted) else {
            return false;
        };
        youngest.yield_asked.store(true, Ordering::Release);
        drop(holders);
        // It may be waiting for room itself.
        self.ledger.room.notify_waiters();
        true
    }

    /// Waits for room (or for a reason to look again), counted among the
    /// generations that wait to grow.
    pub async fn wait_to_grow(&self, room: std::pin::Pin<&mut tokio::sync::futures::Notified<'_>>) {
        let _growing = Counted::new(&self.ledger, &self.ledger.growers_waiting);
        room.await;
    }

    fn hold(&self) {
        self.yield_asked.store(false, Ordering::Release);
        self.ledger
            .holders
            .lock()
            .expect("holders lock")
            .push(Holder {
                admitted: self.admitted,
                yield_asked: self.yield_asked.clone(),
            });
    }

    /// Gives the whole share back.
    pub fn give_back(&mut self) {
        self.ledger
            .holders
            .lock()
            .expect("holders lock")
            .retain(|h| !Arc::ptr_eq(&h.yield_asked, &self.yield_asked));
        self.tokens = 0;
        let units = std::mem::take(&mut self.units);
        let _ = self.ledger.reserved_tokens.fetch_update(
            Ordering::AcqRel,
            Ordering::Acquire,
            |reserved| Some(reserved.saturating_sub(units)),
        );
        if units > 0 {
            self.ledger.room.notify_waiters();
        }
    }

    /// Waits until the share, given back, can grow to `tokens` again while
    /// no generation waits to grow; counted meanwhile among the preempted
    /// generations that wait. It keeps its age.
    pub async fn regain(&mut self, tokens: u64) {
        let ledger = self.ledger.clone();
        let _waiting = Counted::new(&ledger, &ledger.preempted_waiting);
        loop {
            let room = ledger.room.notified();
            tokio::pin!(room);
            room.as_mut().enable();
            if ledger.growers_waiting.load(Ordering::Acquire) == 0 && self.grow(tokens).is_ok() {
                self.hold();
                return;
            }
            room.await;
        }
    }
}

impl Drop for KvReservation {
    fn drop(&mut self) {
        self.give_back();
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use shardplane_engine::config::sliding_kept;

    /// Gemma 3 27B's layers: every sixth global, the others a window of 1024.
    fn gemma3_27b() -> KvCost {
        let windows: Vec<_> = (0..62).map(|l| (l % 6 != 5).then_some(1024)).collect();
        KvCost::of_windows(&windows, 512)
    }

    #[test]
    fn a_sequence_costs_its_length_in_full_layers_and_its_held_rows_in_sliding_ones() {
        // No sliding layers: its length.
        assert_eq!(KvCost::default().units(5000), 5000);
        assert_eq!(KvCost::of_windows(&[None; 4], 512).units(5000), 5000);
        assert_eq!(KvCost::of_windows(&[], 512).units(5000), 5000);
        // 52 of 62 layers hold at most 2048 kept + 1024 not let go + 256 of
        // rounding + 512 of a step = 3840 rows.
        let gemma = gemma3_27b();
        assert_eq!(gemma.units(1000), 1000);
        assert_eq!(gemma.units(3840), 3840);
        assert_eq!(
            gemma.units(32768),
            (10 * 32768 + 52 * 3840_u64).div_ceil(62)
        );
        assert_eq!(gemma.units(32768), 8506);
        // Never less than the full layers' share, and no overflow.
        assert!(gemma.units(u64::MAX) > u64::MAX / 62 * 10);
        // Windows of two sizes (and bigger prompt steps) each hold their own.
        let two = KvCost::of_windows(&[Some(128), None, Some(4096), Some(128)], 2048);
        let (small, big): (u64, u64) = (2816, 14592);
        assert_eq!(small, sliding_kept(128) as u64 + 256 + 256 + 2048);
        assert_eq!(big, sliding_kept(4096) as u64 + 4096 + 256 + 2048);
        assert_eq!(two.units(20_000), (20_000 + 2 * small + big).div_ceil(4));
        assert_eq!(two.units(10_000), (10_000 + 2 * small + 10_000).div_ceil(4));
    }

    #[test]
    fn sequences_on_sliding_layers_reserve_what_they_cost() {
        let ledger = Arc::new(KvLedger::default());
        ledger.set_cost(gemma3_27b());
        // Room for two 32k-token sequences, not the 65536 tokens they are.
        ledger.budget_tokens.store(2 * 8506, Ordering::Relaxed);
        let mut a = KvReservation::take(&ledger, 1000).unwrap();
        assert_eq!(
            (a.tokens(), ledger.reserved_tokens.load(Ordering::Relaxed)),
            (1000, 1000)
        );
        // Growing past the held rows costs only the full layers' share.
        a.grow(32768).unwrap();
        assert_eq!(
            (a.tokens(), ledger.reserved_tokens.load(Ordering::Relaxed)),
            (32768, 8506)
        );
        // Shrinking is not growing.
        a.grow(5).unwrap();
        assert_eq!(a.tokens(), 32768);
        let b = KvReservation::take(&ledger, 32768).unwrap();
        assert_eq!(
            KvReservation::take(&ledger, 1).unwrap_err(),
            (2 * 8506, 2 * 8506)
        );
        drop((a, b));
        assert_eq!(ledger.reserved_tokens.load(Ordering::Relaxed), 0);
    }

    #[tokio::test]
    async fn the_youngest_younger_holder_yields_and_regains_its_room_keeping_its_age() {
        let ledger = Arc::new(KvLedger::default());
        ledger.budget_tokens.store(30, Ordering::Relaxed);
        let mut a = KvReservation::take(&ledger, 10).unwrap();
        let b = KvReservation::take(&ledger, 10).unwrap();
        let mut c = KvReservation::take(&ledger, 10).unwrap();
        assert_eq!(KvReservation::take(&ledger, 1).unwrap_err(), (30, 30));
        // The youngest has none younger to ask: it yields itself.
        assert!(!c.ask_younger_to_yield());
        // The oldest asks the youngest, not the one between.
        assert!(a.ask_younger_to_yield());
        assert!(c.yield_asked() && !b.yield_asked());
        // One already asked: nobody else is.
        assert!(b.ask_younger_to_yield());
        assert!(!b.yield_asked());
        c.give_back();
        assert_eq!(ledger.reserved_tokens.load(Ordering::Relaxed), 20);
        a.grow(20).unwrap();
        // Back when there is room, and no sooner.
        let regained = tokio::spawn(async move {
            c.regain(10).await;
            c
        });
        tokio::task::yield_now().await;
        assert_eq!(ledger.waiting(), 1);
        assert!(!regained.is_finished());
        drop(a);
        let c = regained.await.unwrap();
        assert_eq!(ledger.waiting(), 0);
        assert_eq!(ledger.reserved_tokens.load(Ordering::Relaxed), 20);
        // Still younger than b, and no longer asked to yield.
        assert!(!c.yield_asked());
        assert!(b.ask_younger_to_yield());
        assert!(c.yield_asked());
        drop((b, c));
        assert_eq!(ledger.reserved_tokens.load(Ordering::Relaxed), 0);
    }
}
