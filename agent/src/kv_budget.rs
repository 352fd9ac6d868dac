//! A head stage's KV budget and the shares of it that its generations
//! hold: admission, growth, and preemption of the youngest.
//!
//! ```text
//!  admit: take(prompt + 16) ─► each step: grow by 16 ─► ok: run it
//!                                                  │ no room (here or on a later stage)
//!                    ask the youngest younger holder to yield, wait for it
//!                    (none younger, or asked to yield itself):
//!                    give_back ─► regain (before new admissions) ─► recompute
//! ```
//!
//! The budget is the Shard's `kvCache` (context length × concurrent
//! sequences, counted by its sequences' [`KvCost`]), what placement made
//! room for on every stage of the instance, capped by each stage machine's
//! free memory at load (`shards::kv_room`, again while it runs). A head
//! keeps one account for its own budget and one for each later stage of a
//! pipeline ([`Later`]: the budget its Shard reports in its status,
//! `kvBudgetTokens`), since the head's generations are all a later stage
//! holds: a share fits when it fits in every account.
//!
//! Each stage counts a sequence by its own layers' [`KvCost`]: tokens at
//! the bytes a token takes in every layer of the stage, where a sliding
//! layer holds at most its kept rows, so on a model with sliding layers
//! (Gemma 3, gpt-oss) a long sequence costs less than its length, and
//! least on a stage of mostly sliding layers.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, OnceLock};

use tokio::sync::Notify;

/// A head's KV budget, what is reserved of it, what its later stages
/// hold, and who waits for room. Its `_tokens` figures are in the
/// budget's units ([`KvLedger::units`]): tokens, or what sequences cost
/// on a stage with sliding layers.
#[derive(Debug, Default)]
pub struct KvLedger {
    /// Tokens of KV the generations admitted here may come to hold, at
    /// most (in the budget's units, [`KvLedger::units`]).
    pub reserved_tokens: AtomicU64,
    /// Tokens of KV the stage holds at most (its Shard's context length ×
    /// concurrent sequences, or their cost, capped by its machine's free
    /// memory; 0: not set).
    pub budget_tokens: AtomicU64,
    /// Generations preempted for room that wait to resume.
    pub preempted_waiting: AtomicU64,
    /// Generations that wait for a younger one to yield them room.
    pub growers_waiting: AtomicU64,
    /// Generations preempted for room so far.
    pub preemptions: AtomicU64,
    /// Woken when reserved KV is given back, when the stage's budget grows
    /// or a later stage's account changes, when no generation waits to grow
    /// any more, and when a generation is asked to yield its room.
    pub room: Notify,
    /// The shares and the later stages' accounts.
    state: Mutex<Shares>,
    /// The next admission's number (its age: lower is older).
    admissions: AtomicU64,
    /// What a sequence costs in the budget (unset: its length).
    cost: OnceLock<KvCost>,
}

/// The generations that hold KV, and the later stages they hold it on.
#[derive(Debug, Default)]
struct Shares {
    holders: Vec<Holder>,
    later: Vec<Later>,
}

/// A later stage of a pipeline, as its head counts it: what a sequence
/// costs there (its layers' [`KvCost`], with its agent's prompt step), and
/// the budget its Shard reports, in those units.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Later {
    /// Its Shard's name.
    pub shard: String,
    /// What a sequence costs in its budget.
    pub cost: KvCost,
    /// Its budget (0: none reported, nothing refused for it).
    pub budget: u64,
}

/// One budget as a sequence of some tokens meets it: the head's own or a
/// later stage's, in its units. A refusal names the one that is short.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Account {
    /// The later stage whose budget it is (`None`: the head's own).
    pub later: Option<String>,
    /// What the sequence's tokens cost there.
    pub units: u64,
    /// What the generations hold there.
    pub reserved: u64,
    /// The budget there.
    pub budget: u64,
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
    /// Tokens of KV the stage itself holds at most (0: not set, nothing is
    /// refused for it); its later stages have their own ([`KvLedger::set_later`]).
    pub fn budget(&self) -> u64 {
        self.budget_tokens.load(Ordering::Relaxed)
    }

    /// Sets the stage's own budget; one that grew (or became unbounded)
    /// wakes the generations waiting for room.
    pub fn set_budget(&self, budget: u64) {
        let before = self.budget_tokens.swap(budget, Ordering::Relaxed);
        if before > 0 && (budget == 0 || budget > before) {
            self.room.notify_waiters();
        }
    }

    /// Sets what the later stages hold (as they report it now); a change
    /// wakes the generations waiting for room, to look again.
    pub fn set_later(&self, later: Vec<Later>) {
        let mut shares = self.shares();
        if shares.later != later {
            shares.later = later;
            drop(shares);
            self.room.notify_waiters();
        }
    }

    /// Sets what a sequence costs in the budget (once, when the stage
    /// loads, before it admits anything); a second cost is ignored.
    pub fn set_cost(&self, cost: KvCost) {
        let _ = self.cost.set(cost);
    }

    /// What a sequence of `tokens` costs in the stage's own budget.
    pub fn units(&self, tokens: u64) -> u64 {
        self.cost.get().map_or(tokens, |c| c.units(tokens))
    }

    /// The first budget, the stage's own or a later stage's, that a
    /// sequence of `tokens` would overflow even alone.
    pub fn beyond(&self, tokens: u64) -> Option<Account> {
        self.accounts(tokens)
            .into_iter()
            .find(|f| f.budget > 0 && f.units > f.budget)
    }

    /// Each later stage's account: its Shard, what the shares hold there
    /// and its budget (in its units).
    pub fn later_usage(&self) -> Vec<(String, u64, u64)> {
        self.accounts(0)
            .into_iter()
            .filter_map(|f| Some((f.later?, f.reserved, f.budget)))
            .collect()
    }

    /// Every account, the stage's own first, for a sequence of `tokens`.
    fn accounts(&self, tokens: u64) -> Vec<Account> {
        let shares = self.shares();
        let later = shares.later.iter().map(|l| Account {
            later: Some(l.shard.clone()),
            units: l.cost.units(tokens),
            reserved: shares.reserved(&l.cost),
            budget: l.budget,
        });
        std::iter::once(self.own_account(tokens))
            .chain(later)
            .collect()
    }

    /// Generations that wait for room (preempted, or to grow): a new one is
    /// not admitted before them.
    pub fn waiting(&self) -> u64 {
        self.preempted_waiting.load(Ordering::Acquire)
            + self.growers_waiting.load(Ordering::Acquire)
    }

    fn shares(&self) -> std::sync::MutexGuard<'_, Shares> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// The account with a budget (the stage's own or a later stage's) that
    /// a sequence of `tokens` would fill most, for a refusal while others
    /// wait for room; the stage's own when none has a budget.
    fn tightest(&self, tokens: u64) -> Account {
        let fill = |f: &Account| {
            (u128::from(f.reserved) + u128::from(f.units)) * 1_000_000 / u128::from(f.budget)
        };
        self.accounts(tokens)
            .into_iter()
            .filter(|f| f.budget > 0)
            .max_by_key(fill)
            .unwrap_or_else(|| self.own_account(tokens))
    }

    /// The stage's own account, for a sequence of `tokens`.
    fn own_account(&self, tokens: u64) -> Account {
        Account {
            later: None,
            units: self.units(tokens),
            reserved: self.reserved_tokens.load(Ordering::Relaxed),
            budget: self.budget(),
        }
    }
}

impl Shares {
    /// What the shares hold in an account where a sequence costs `cost`.
    fn reserved(&self, cost: &KvCost) -> u64 {
        self.holders
            .iter()
            .fold(0u64, |sum, h| sum.saturating_add(cost.units(h.tokens)))
    }
}

/// A generation that holds KV: when it was admitted, how many tokens its
/// share covers, and whether an older one asked it to yield its room.
#[derive(Debug)]
struct Holder {
    admitted: u64,
    tokens: u64,
    yield_asked: Arc<AtomicBool>,
}

/// Counts itself in a counter while it lives; wakes the waiters for room
/// when it goes and the counter falls to 0 (what a preempted generation
/// waits for before it regains: no generation waiting to grow). Waking
/// them at every fall would have two growers waiting for the same yield
/// wake each other in turn until it comes.
struct Counted<'a>(&'a KvLedger, &'a AtomicU64);

impl<'a> Counted<'a> {
    fn new(ledger: &'a KvLedger, counter: &'a AtomicU64) -> Self {
        counter.fetch_add(1, Ordering::AcqRel);
        Counted(ledger, counter)
    }
}

impl Drop for Counted<'_> {
    fn drop(&mut self) {
        if self.1.fetch_sub(1, Ordering::AcqRel) == 1 {
            self.0.room.notify_waiters();
        }
    }
}

/// A generation's share of a stage's KV budget (and of its later stages'),
/// given back when dropped.
///
/// A share ([`KvReservation::take`]) grows as its generation decodes. One that cannot grow asks the youngest younger
/// holder to yield its room ([`KvReservation::ask_younger_to_yield`]) and
/// waits for it; the youngest yields itself (gives its share back, then
/// [`KvReservation::regain`]s it, keeping its age). So the oldest
/// generations go on and the newest wait, as with vLLM's preemption.
#[derive(Debug)]
pub struct KvReservation {
    ledger: Arc<KvLedger>,
    /// Tokens of its sequence the share covers (0: given back).
    tokens: u64,
    /// What they cost in the stage's own budget.
    units: u64,
    /// When it was admitted.
    admitted: u64,
    /// Set when an older generation asks it to yield.
    yield_asked: Arc<AtomicBool>,
}

impl KvReservation {
    /// Reserves what `tokens` cost in `ledger`'s budget and its later
    /// stages' ([`KvLedger::units`]) as a share that grows and may be asked
    /// to yield, or says where it does not fit (the stage's own budget, to a
    /// new generation while others wait for room: they go first).
    pub fn take(ledger: &Arc<KvLedger>, tokens: u64) -> Result<Self, Account> {
        let mut r = KvReservation {
            ledger: ledger.clone(),
            tokens: 0,
            units: 0,
            admitted: ledger.admissions.fetch_add(1, Ordering::AcqRel),
            yield_asked: Arc::default(),
        };
        if ledger.waiting() > 0 {
            return Err(ledger.tightest(tokens));
        }
        r.grow(tokens)?;
        Ok(r)
    }

    /// Tokens of its sequence the share covers.
    pub fn tokens(&self) -> u64 {
        self.tokens
    }

    /// Grows the share to cover `tokens` of its sequence (never shrinks
    /// it) in every account, or says where it does not fit. A share given
    /// back holds again, not asked to yield.
    pub fn grow(&mut self, tokens: u64) -> Result<(), Account> {
        if tokens <= self.tokens {
            return Ok(());
        }
        let ledger = self.ledger.clone();
        let mut shares = ledger.shares();
        // Past what its sliding layers hold, a share grows only by its full
        // layers' part, and growth that costs nothing more always fits.
        let units = ledger.units(tokens);
        let more = units.saturating_sub(self.units);
        let own = ledger.own_account(tokens);
        if more > 0 && own.budget > 0 && own.reserved.saturating_add(more) > own.budget {
            return Err(own);
        }
        for later in shares.later.iter().filter(|l| l.budget > 0) {
            let (now, then) = (later.cost.units(self.tokens), later.cost.units(tokens));
            let reserved = shares.reserved(&later.cost);
            if then > now && reserved.saturating_add(then - now) > later.budget {
                return Err(Account {
                    later: Some(later.shard.clone()),
                    units: then,
                    reserved,
                    budget: later.budget,
                });
            }
        }
        ledger.reserved_tokens.fetch_add(more, Ordering::AcqRel);
        self.units += more;
        self.tokens = tokens;
        match shares
            .holders
            .iter_mut()
            .find(|h| Arc::ptr_eq(&h.yield_asked, &self.yield_asked))
        {
            Some(h) => h.tokens = tokens,
            None => {
                self.yield_asked.store(false, Ordering::Release);
                shares.holders.push(Holder {
                    admitted: self.admitted,
                    tokens,
                    yield_asked: self.yield_asked.clone(),
                });
            }
        }
        Ok(())
    }

    /// Whether an older generation asked this one to yield its room.
    pub fn yield_asked(&self) -> bool {
        self.yield_asked.load(Ordering::Acquire)
    }

    /// Asks the youngest holder younger than this one to yield its room
    /// (unless one already is); false when there is none, and this one
    /// should yield itself.
    pub fn ask_younger_to_yield(&self) -> bool {
        let shares = self.ledger.shares();
        let younger = shares.holders.iter().filter(|h| h.admitted > self.admitted);
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
        drop(shares);
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

    /// Gives the whole share back, in every account.
    pub fn give_back(&mut self) {
        let mut shares = self.ledger.shares();
        shares
            .holders
            .retain(|h| !Arc::ptr_eq(&h.yield_asked, &self.yield_asked));
        let units = std::mem::take(&mut self.units);
        let held = std::mem::take(&mut self.tokens);
        let _ = self.ledger.reserved_tokens.fetch_update(
            Ordering::AcqRel,
            Ordering::Acquire,
            |reserved| Some(reserved.saturating_sub(units)),
        );
        drop(shares);
        if held > 0 {
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
        let full = KvReservation::take(&ledger, 1).unwrap_err();
        assert_eq!((full.reserved, full.budget), (2 * 8506, 2 * 8506));
        drop((a, b));
        assert_eq!(ledger.reserved_tokens.load(Ordering::Relaxed), 0);
    }

    #[test]
    fn a_share_fits_every_later_stage_by_what_it_costs_there() {
        let windows: Vec<_> = (0..62).map(|l| (l % 6 != 5).then_some(1024)).collect();
        // A later stage of sliding layers only: a 32k sequence holds 3840
        // rows there.
        let cost = KvCost::of_windows(&windows[0..5], 512);
        assert_eq!(cost.units(32768), 3840);
        let later = |budget| Later {
            shard: "d-0-1".into(),
            cost: cost.clone(),
            budget,
        };
        let ledger = Arc::new(KvLedger::default());
        ledger.set_later(vec![later(3 * 3840)]);
        // Three long sequences fit, each counted 3840 there.
        let a = KvReservation::take(&ledger, 32768).unwrap();
        let mut b = KvReservation::take(&ledger, 1000).unwrap();
        b.grow(32768).unwrap();
        let c = KvReservation::take(&ledger, 40_000).unwrap();
        // The head's own account (no cost set: tokens, no budget).
        assert_eq!(
            ledger.reserved_tokens.load(Ordering::Relaxed),
            2 * 32768 + 40_000
        );
        let full = KvReservation::take(&ledger, 1).unwrap_err();
        assert_eq!(
            full,
            Account {
                later: Some("d-0-1".into()),
                units: 1,
                reserved: 3 * 3840,
                budget: 3 * 3840
            }
        );
        // Growth that costs the later stage nothing more still fits.
        let mut c = c;
        c.grow(50_000).unwrap();
        // Too long even alone: the head's own budget, or the later stage's.
        ledger.set_budget(45_000);
        assert_eq!(ledger.beyond(45_001).unwrap().later, None);
        assert_eq!(ledger.beyond(45_000), None);
        ledger.set_later(vec![later(3000)]);
        let beyond = ledger.beyond(3001).unwrap();
        assert_eq!(
            (beyond.later.as_deref(), beyond.units),
            (Some("d-0-1"), 3001)
        );
        drop((a, b, c));
        assert_eq!(ledger.reserved_tokens.load(Ordering::Relaxed), 0);
        assert!(KvReservation::take(&ledger, 3000).is_ok());
    }

    #[tokio::test]
    async fn a_later_stage_that_fills_up_makes_the_youngest_yield_and_its_change_wakes_waiters() {
        let ledger = Arc::new(KvLedger::default());
        let later = |budget| {
            vec![Later {
                shard: "d-0-1".into(),
                cost: KvCost::default(),
                budget,
            }]
        };
        ledger.set_later(later(30));
        let mut a = KvReservation::take(&ledger, 10).unwrap();
        let mut b = KvReservation::take(&ledger, 10).unwrap();
        // The head has no budget of its own; the later stage is full.
        let full = a.grow(25).unwrap_err();
        assert_eq!((full.later.as_deref(), full.reserved), (Some("d-0-1"), 20));
        assert!(a.ask_younger_to_yield());
        assert!(b.yield_asked());
        b.give_back();
        a.grow(25).unwrap();
        let regained = tokio::spawn(async move {
            b.regain(10).await;
            b
        });
        tokio::task::yield_now().await;
        assert_eq!(ledger.waiting(), 1);
        // Meanwhile a new generation is refused, naming the later stage.
        let refused = KvReservation::take(&ledger, 1).unwrap_err();
        assert_eq!(
            (refused.later.as_deref(), refused.reserved, refused.budget),
            (Some("d-0-1"), 25, 30)
        );
        // The same report again wakes nobody; more room does.
        ledger.set_later(later(30));
        tokio::task::yield_now().await;
        assert!(!regained.is_finished());
        ledger.set_later(later(40));
        let b = regained.await.unwrap();
        assert_eq!((b.tokens(), ledger.waiting()), (10, 0));
        assert!(!b.yield_asked());
    }

    #[tokio::test]
    async fn the_youngest_younger_holder_yields_and_regains_its_room_keeping_its_age() {
        let ledger = Arc::new(KvLedger::default());
        ledger.budget_tokens.store(30, Ordering::Relaxed);
        let mut a = KvReservation::take(&ledger, 10).unwrap();
        let b = KvReservation::take(&ledger, 10).unwrap();
        let mut c = KvReservation::take(&ledger, 10).unwrap();
        let full = KvReservation::take(&ledger, 1).unwrap_err();
        assert_eq!((full.later, full.reserved, full.budget), (None, 30, 30));
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
