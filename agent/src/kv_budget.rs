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
//! concurrent sequences), what placement made room for on every stage of
//! the instance, capped by each stage machine's free memory at load
//! (`shards::kv_room`, again while it runs): the head's own, and the least the later
//! stages report in their Shards' status (`kvBudgetTokens`), since the
//! head's generations are all that a later stage holds.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use tokio::sync::Notify;

/// A head's KV budget, what is reserved of it, and who waits for room.
#[derive(Debug, Default)]
pub struct KvLedger {
    /// Tokens of KV the generations admitted here may come to hold, at most.
    pub reserved_tokens: AtomicU64,
    /// Tokens of KV the stage holds at most (its Shard's context length ×
    /// concurrent sequences, capped by its machine's free memory; 0: not
    /// set).
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
    tokens: u64,
    /// When it was admitted.
    admitted: u64,
    /// Set when an older generation asks it to yield.
    yield_asked: Arc<AtomicBool>,
}

impl KvReservation {
    /// Reserves `tokens` of `ledger`'s budget as a share that grows and may
    /// be asked to yield, or says how much is taken (all of it, to a new
    /// generation, while others wait for room: they go first).
    pub fn take(ledger: &Arc<KvLedger>, tokens: u64) -> Result<Self, (u64, u64)> {
        let mut r = KvReservation {
            ledger: ledger.clone(),
            tokens: 0,
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

    /// Tokens held.
    pub fn tokens(&self) -> u64 {
        self.tokens
    }

    /// Grows the share to `tokens` (never shrinks it), or says how much of
    /// the budget is taken.
    pub fn grow(&mut self, tokens: u64) -> Result<(), (u64, u64)> {
        let more = tokens.saturating_sub(self.tokens);
        let budget = self.ledger.budget();
        self.ledger
            .reserved_tokens
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |reserved| {
                (budget == 0 || reserved + more <= budget).then_some(reserved + more)
            })
            .map(|_| self.tokens += more)
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
        let tokens = std::mem::take(&mut self.tokens);
        let _ = self.ledger.reserved_tokens.fetch_update(
            Ordering::AcqRel,
            Ordering::Acquire,
            |reserved| Some(reserved.saturating_sub(tokens)),
        );
        if tokens > 0 {
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
