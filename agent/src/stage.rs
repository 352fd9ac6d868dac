//! A loaded stage runs on a thread of its own, fed by a queue: the async data
//! plane never blocks on a forward pass. The thread runs the step loop of
//! [`crate::scheduler`].
//!
//! ```text
//!  Forward streams ──► queue ──► stage thread: steps of all decodes + prompt slices ─► replies
//!  Release ───────────┘                │ panics
//!                                      ▼
//!                      every waiting caller: Unavailable; on_crash(message)
//! ```
//!
//! A thread that panics (a bug, or a backend that aborts a pass) is caught:
//! the callers waiting on it and every later one hear `Unavailable` (the
//! gateway then tries another instance), and `on_crash` tells the Shard's
//! owner, which marks it Failed and loads it again later.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, OnceLock, mpsc};

use shardplane_engine::{SequenceId, Stage, StageInput, StageOutput};
use tokio::sync::oneshot;

use crate::scheduler::{self, Budget, Job};

/// Counters the stage thread keeps up to date.
#[derive(Debug, Default)]
pub struct StageStats {
    /// Sequences with a KV cache.
    pub sequences: AtomicU64,
    /// Bytes of KV cache allocated.
    pub kv_cache_bytes: AtomicU64,
    /// Tokens of the forward jobs waiting in the queue or running.
    pub queued_tokens: AtomicU64,
    /// Recent nanoseconds per token of a pass (a moving average; 0 before
    /// the first pass).
    pub nanos_per_token: AtomicU64,
    /// What the stage's prefix cache did and holds (after the last step).
    pub prefix: std::sync::Mutex<shardplane_engine::prefix::PrefixCacheStats>,
    /// Tokens of KV the generations admitted here may come to hold, at most.
    pub kv_reserved_tokens: AtomicU64,
    /// Tokens of KV the stage admits at most (its Shard's context length ×
    /// concurrent sequences; 0: not set, nothing is refused).
    pub kv_budget_tokens: AtomicU64,
    /// Generations preempted for room that wait to resume.
    pub kv_preempted_waiting: AtomicU64,
    /// Generations that wait for a younger one to yield them room.
    pub kv_growers_waiting: AtomicU64,
    /// Generations preempted for room so far.
    pub kv_preemptions: AtomicU64,
    /// Woken when reserved KV is given back, and when a generation is asked
    /// to yield its room.
    pub kv_room: tokio::sync::Notify,
    /// The preemptible generations that hold KV, with their age.
    kv_holders: std::sync::Mutex<Vec<Holder>>,
    /// The next admission's number (its age: lower is older).
    kv_admissions: AtomicU64,
}

/// A preemptible generation that holds KV: when it was admitted, and
/// whether an older one asked it to yield its room.
#[derive(Debug)]
struct Holder {
    admitted: u64,
    yield_asked: Arc<std::sync::atomic::AtomicBool>,
}

/// Counts itself in a counter while it lives; wakes the waiters for room
/// when it goes.
struct Counted<'a>(&'a StageStats, &'a AtomicU64);

impl<'a> Counted<'a> {
    fn new(stats: &'a StageStats, counter: &'a AtomicU64) -> Self {
        counter.fetch_add(1, Ordering::AcqRel);
        Counted(stats, counter)
    }
}

impl Drop for Counted<'_> {
    fn drop(&mut self) {
        self.1.fetch_sub(1, Ordering::AcqRel);
        self.0.kv_room.notify_waiters();
    }
}

/// A generation's share of a stage's KV budget, given back when dropped.
///
/// A preemptible share ([`KvReservation::take_preemptible`]) grows as its
/// generation decodes. One that cannot grow asks the youngest younger
/// holder to yield its room ([`KvReservation::ask_younger_to_yield`]) and
/// waits for it; the youngest yields itself (gives its share back, then
/// [`KvReservation::regain`]s it, keeping its age). So the oldest
/// generations go on and the newest wait, as with vLLM's preemption.
#[derive(Debug)]
pub struct KvReservation {
    stats: Arc<StageStats>,
    tokens: u64,
    /// When it was admitted (preemptible shares).
    admitted: u64,
    /// Set when an older generation asks it to yield (preemptible shares).
    yield_asked: Option<Arc<std::sync::atomic::AtomicBool>>,
}

impl KvReservation {
    /// Reserves `tokens` of `stats`'s budget for good, or says how much is taken.
    pub fn take(stats: &Arc<StageStats>, tokens: u64) -> Result<Self, (u64, u64)> {
        let mut r = KvReservation {
            stats: stats.clone(),
            tokens: 0,
            admitted: 0,
            yield_asked: None,
        };
        r.grow(tokens).map(|()| r)
    }

    /// Reserves `tokens` of `stats`'s budget as a share that grows and may
    /// be asked to yield, or says how much is taken.
    pub fn take_preemptible(stats: &Arc<StageStats>, tokens: u64) -> Result<Self, (u64, u64)> {
        let mut r = Self::take(stats, tokens)?;
        r.admitted = stats.kv_admissions.fetch_add(1, Ordering::AcqRel);
        r.yield_asked = Some(Arc::default());
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
        let budget = self.stats.kv_budget_tokens.load(Ordering::Relaxed);
        self.stats
            .kv_reserved_tokens
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |reserved| {
                (budget == 0 || reserved + more <= budget).then_some(reserved + more)
            })
            .map(|_| self.tokens += more)
            .map_err(|reserved| (reserved, budget))
    }

    /// Whether an older generation asked this one to yield its room.
    pub fn yield_asked(&self) -> bool {
        self.yield_asked
            .as_ref()
            .is_some_and(|f| f.load(Ordering::Acquire))
    }

    /// Asks the youngest holder younger than this one to yield its room
    /// (unless one already is); false when there is none, and this one
    /// should yield itself.
    pub fn ask_younger_to_yield(&self) -> bool {
        let holders = self.stats.kv_holders.lock().expect("holders lock");
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
        self.stats.kv_room.notify_waiters();
        true
    }

    /// Waits for room (or for a reason to look again), counted among the
    /// generations that wait to grow.
    pub async fn wait_to_grow(&self, room: std::pin::Pin<&mut tokio::sync::futures::Notified<'_>>) {
        let _growing = Counted::new(&self.stats, &self.stats.kv_growers_waiting);
        room.await;
    }

    fn hold(&self) {
        if let Some(flag) = &self.yield_asked {
            flag.store(false, Ordering::Release);
            self.stats
                .kv_holders
                .lock()
                .expect("holders lock")
                .push(Holder {
                    admitted: self.admitted,
                    yield_asked: flag.clone(),
                });
        }
    }

    /// Gives the whole share back.
    pub fn give_back(&mut self) {
        if let Some(flag) = &self.yield_asked {
            self.stats
                .kv_holders
                .lock()
                .expect("holders lock")
                .retain(|h| !Arc::ptr_eq(&h.yield_asked, flag));
        }
        let tokens = std::mem::take(&mut self.tokens);
        let _ = self.stats.kv_reserved_tokens.fetch_update(
            Ordering::AcqRel,
            Ordering::Acquire,
            |reserved| Some(reserved.saturating_sub(tokens)),
        );
        if tokens > 0 {
            self.stats.kv_room.notify_waiters();
        }
    }

    /// Waits until the share, given back, can grow to `tokens` again while
    /// no generation waits to grow; counted meanwhile among the preempted
    /// generations that wait. It keeps its age.
    pub async fn regain(&mut self, tokens: u64) {
        let stats = self.stats.clone();
        let _waiting = Counted::new(&stats, &stats.kv_preempted_waiting);
        loop {
            let room = stats.kv_room.notified();
            tokio::pin!(room);
            room.as_mut().enable();
            if stats.kv_growers_waiting.load(Ordering::Acquire) == 0 && self.grow(tokens).is_ok() {
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

impl StageStats {
    /// Generations that wait for room (preempted, or to grow): a new one is
    /// not admitted before them.
    pub fn kv_waiting(&self) -> u64 {
        self.kv_preempted_waiting.load(Ordering::Acquire)
            + self.kv_growers_waiting.load(Ordering::Acquire)
    }

    /// How long work queued now waits before it starts, as the recent
    /// passes suggest.
    pub fn estimated_wait(&self) -> std::time::Duration {
        let tokens = self.queued_tokens.load(Ordering::Relaxed);
        let per_token = self.nanos_per_token.load(Ordering::Relaxed);
        std::time::Duration::from_nanos(tokens.saturating_mul(per_token))
    }

    /// Counts `tokens` as queued.
    pub(crate) fn queue_tokens(&self, tokens: usize) {
        self.queued_tokens
            .fetch_add(tokens as u64, Ordering::Relaxed);
    }

    /// Counts `tokens` as no longer queued (run or dropped). Never wraps
    /// below zero, so a miscount cannot make the stage look busy forever.
    pub(crate) fn unqueue_tokens(&self, tokens: usize) {
        let _ = self
            .queued_tokens
            .fetch_update(Ordering::Relaxed, Ordering::Relaxed, |q| {
                Some(q.saturating_sub(tokens as u64))
            });
    }

    /// Records a pass of `rows` tokens that took `seconds`.
    pub(crate) fn record_pass(&self, rows: usize, seconds: f64) {
        if rows == 0 {
            return;
        }
        let now = (seconds * 1e9 / rows as f64) as u64;
        let old = self.nanos_per_token.load(Ordering::Relaxed);
        let new = if old == 0 { now } else { (old * 4 + now) / 5 };
        self.nanos_per_token.store(new, Ordering::Relaxed);
    }
}

/// What a turn of the stage's loop did: a forward pass (`rows` > 0), the
/// queue, and the prefix cache as it stands after it.
#[derive(Debug, Clone, Default)]
pub struct Pass {
    /// Rows in the pass (0: no pass this turn).
    pub rows: usize,
    /// Seconds the pass took.
    pub seconds: f64,
    /// Sequences in the pass (decoding ones and prompt slices).
    pub sequences: usize,
    /// Prompts waiting for their first slice or part-way through.
    pub waiting: usize,
    /// Seconds each prompt that started in this pass had waited.
    pub queue_waits: Vec<f64>,
    /// KV tokens reserved by admitted generations, and the budget.
    pub kv_tokens: (u64, u64),
    /// The prefix cache's counts.
    pub prefix: shardplane_engine::prefix::PrefixCacheStats,
}

/// Observes each turn of a stage's loop.
pub type PassObserver = Arc<dyn Fn(&Pass) + Send + Sync>;

/// Told once, with the panic's message, when the stage's thread panics.
pub type OnCrash = Box<dyn FnOnce(String) + Send>;

/// A handle on a stage thread. The thread ends, and the weights are freed,
/// when the last handle is dropped.
#[derive(Clone)]
pub struct StageWorker {
    jobs: mpsc::Sender<Job>,
    /// The stage's counters.
    pub stats: Arc<StageStats>,
    /// Bytes of the loaded weights.
    pub weight_bytes: usize,
    /// The most tokens one sequence may hold.
    pub context_length: usize,
    /// Width of the hidden states.
    pub hidden: usize,
    /// Why the thread stopped, once it panicked.
    crashed: Arc<OnceLock<String>>,
}

impl StageWorker {
    /// Moves `shard` onto a new thread named after the stage, whose steps
    /// are made up as `budget` says; `on_crash` hears if the thread panics.
    pub fn start(
        name: &str,
        shard: Box<dyn Stage>,
        observe: PassObserver,
        budget: Budget,
        on_crash: OnCrash,
    ) -> Self {
        let (jobs, queue) = mpsc::channel();
        let stats = Arc::new(StageStats::default());
        let crashed = Arc::new(OnceLock::new());
        let worker = StageWorker {
            jobs,
            stats: stats.clone(),
            weight_bytes: shard.weight_bytes(),
            context_length: shard.context_length(),
            hidden: shard.config().hidden_size,
            crashed: crashed.clone(),
        };
        let thread = format!("stage {name}");
        std::thread::Builder::new()
            .name(thread.clone())
            .spawn(move || {
                let run = std::panic::AssertUnwindSafe(|| {
                    scheduler::run(shard, queue, stats, observe, budget)
                });
                // Unwinding dropped the queue and every waiting reply: their
                // callers already hear that the stage is gone.
                if let Err(panic) = std::panic::catch_unwind(run) {
                    let message = panic_message(panic.as_ref());
                    tracing::error!(stage = %thread, panic = %message, "the stage's thread panicked");
                    let _ = crashed.set(message.clone());
                    on_crash(message);
                }
            })
            .expect("spawn a stage thread");
        worker
    }

    /// Why the stage's thread stopped, if it panicked.
    pub fn crashed(&self) -> Option<&str> {
        self.crashed.get().map(String::as_str)
    }

    /// Runs `input` for `seq` on the stage.
    pub async fn forward(
        &self,
        seq: SequenceId,
        input: StageInput,
    ) -> shardplane_engine::Result<StageOutput> {
        Ok(self.forward_counted(seq, input).await?.output)
    }

    /// [`StageWorker::forward`], also telling how many of the input's tokens
    /// came from the prefix cache.
    pub async fn forward_counted(
        &self,
        seq: SequenceId,
        input: StageInput,
    ) -> shardplane_engine::Result<crate::scheduler::Forwarded> {
        let (reply, answer) = oneshot::channel();
        // Not the caller's fault: another instance may serve it.
        let gone = || {
            shardplane_engine::Error::Unavailable(match self.crashed() {
                Some(why) => format!("the stage's thread panicked: {why}"),
                None => "the stage was unloaded".into(),
            })
        };
        let tokens = input.len();
        self.stats.queue_tokens(tokens);
        if self.jobs.send(Job::Forward { seq, input, reply }).is_err() {
            self.stats.unqueue_tokens(tokens);
            return Err(gone());
        }
        answer.await.map_err(|_| gone())?
    }

    /// Frees `seq`'s KV cache (queued behind its pending steps).
    pub fn release(&self, seq: SequenceId) {
        let _ = self.jobs.send(Job::Release { seq });
    }
}

/// The text of a caught panic.
pub fn panic_message(panic: &(dyn std::any::Any + Send)) -> String {
    panic
        .downcast_ref::<&str>()
        .map(|s| s.to_string())
        .or_else(|| panic.downcast_ref::<String>().cloned())
        .unwrap_or_else(|| "a panic without a message".into())
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use shardplane_engine::{Error, StageInput};

    use super::*;
    use crate::test_stage::Echo;

    #[tokio::test]
    async fn a_thread_that_panics_is_unavailable_to_every_caller_and_told_once() {
        let (told, heard) = std::sync::mpsc::channel();
        let (mut echo, _) = Echo::new(false);
        echo.panics = true;
        let worker = StageWorker::start(
            "breaks",
            Box::new(echo),
            Arc::new(|_| {}),
            Budget::default(),
            Box::new(move |why| told.send(why).unwrap()),
        );
        // The caller in flight, and every later one, hear a server's fault.
        let first = worker.forward(1, StageInput::Tokens(vec![1, 2])).await;
        assert!(matches!(first, Err(Error::Unavailable(_))), "{first:?}");
        let why = heard.recv_timeout(Duration::from_secs(5)).unwrap();
        assert!(why.contains("the test stage broke"), "{why}");
        assert_eq!(worker.crashed(), Some(why.as_str()));
        let later = worker.forward(2, StageInput::Tokens(vec![1])).await;
        match later {
            Err(Error::Unavailable(m)) => {
                assert!(m.contains("panicked: the test stage broke"), "{m}")
            }
            other => panic!("{other:?}"),
        }
        assert!(heard.try_recv().is_err(), "told once");
    }
}
