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

use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, OnceLock, mpsc};

use shardplane_engine::{SequenceId, Stage, StageInput, StageOutput};
use tokio::sync::oneshot;

use crate::kv_budget::KvLedger;
use crate::scheduler::{self, Budget, Job};
use crate::step_cost::{CostFit, PassCost};

/// Counters the stage thread keeps up to date.
#[derive(Debug, Default)]
pub struct StageStats {
    /// Sequences with a KV cache.
    pub sequences: AtomicU64,
    /// Bytes of KV cache allocated.
    pub kv_cache_bytes: AtomicU64,
    /// Tokens of the forward jobs waiting in the queue or running.
    pub queued_tokens: AtomicU64,
    /// What a pass costs, fitted from the recent passes.
    pub cost: Mutex<CostFit>,
    /// How the stage's steps are made up (set when its thread starts).
    pub budget: OnceLock<Budget>,
    /// Sequences decoding: those of the step about to run, and those
    /// answered and not back yet.
    pub decoding: AtomicUsize,
    /// Of those, the ones back with their next token (counted in
    /// `queued_tokens`).
    pub decodes_back: AtomicUsize,
    /// What the stage's prefix cache did and holds (after the last step).
    pub prefix: Mutex<shardplane_engine::prefix::PrefixCacheStats>,
    /// Prompt tokens of the sequences started after a look in the prefix
    /// cache, and of those the tokens taken from it: once per sequence that
    /// starts (a pipeline's asks that a later stage refused are not
    /// counted; see [`StageStats::count_look`]).
    pub looked_up: AtomicU64,
    /// See `looked_up`.
    pub reused: AtomicU64,
    /// Until when a pipeline's head runs new prompts whole without looking
    /// in its prefix cache: a later stage held none of what it took (it
    /// keeps no cache, say), so looking would only cost.
    pub seeding_paused_until: Mutex<Option<std::time::Instant>>,
    /// The head's KV budget and the generations' shares of it.
    pub kv: Arc<KvLedger>,
}

impl StageStats {
    /// Whether a pipeline's head should start a new sequence from its
    /// prefix cache: it keeps one, and no later stage held none of its prefix
    /// lately.
    pub fn seeds(&self) -> bool {
        let keeps = self
            .prefix
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .budget_bytes
            > 0;
        let paused = self
            .seeding_paused_until
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .is_some_and(|until| std::time::Instant::now() < until);
        keeps && !paused
    }

    /// Counts a sequence that started after a look in the prefix cache:
    /// its `prompt` tokens, of which it took `reused` from the cache.
    pub fn count_look(&self, prompt: usize, reused: usize) {
        self.looked_up.fetch_add(prompt as u64, Ordering::Relaxed);
        self.reused.fetch_add(reused as u64, Ordering::Relaxed);
    }

    /// The stage's `looked_up` and `reused` so far.
    pub fn looks(&self) -> (u64, u64) {
        (
            self.looked_up.load(Ordering::Relaxed),
            self.reused.load(Ordering::Relaxed),
        )
    }

    /// A later stage held none of the prefix the head took: the head runs
    /// new prompts whole for `pause`.
    pub fn pause_seeding(&self, pause: std::time::Duration) {
        *self
            .seeding_paused_until
            .lock()
            .unwrap_or_else(|p| p.into_inner()) = Some(std::time::Instant::now() + pause);
    }

    /// How long work queued now waits before it starts, as the recent
    /// passes suggest: its rows, and the passes it takes in prompt slices —
    /// each with its fixed part and, while sequences decode, their rows, and
    /// with the smaller slices the step loop then takes (zero before the
    /// first pass).
    pub fn estimated_wait(&self) -> std::time::Duration {
        // The decoding sequences' own rows are charged per pass below, not
        // as queued tokens (those out have none queued).
        let decoding = self.decoding.load(Ordering::Relaxed);
        let tokens = self
            .queued_tokens
            .load(Ordering::Relaxed)
            .saturating_sub(self.decodes_back.load(Ordering::Relaxed) as u64);
        let Some(cost) = self.pass_cost().filter(|_| tokens > 0) else {
            return std::time::Duration::ZERO;
        };
        let budget = self.budget.get().copied().unwrap_or_default();
        // Each step takes one group's share of the decoding sequences.
        let decodes = budget.decode_rows(decoding).min(decoding);
        let slice = budget.prefill_room(decodes, Some(cost)).max(1);
        let passes = tokens.div_ceil(slice as u64);
        let seconds = passes as f64 * cost.seconds(decodes) + tokens as f64 * cost.per_row;
        std::time::Duration::try_from_secs_f64(seconds).unwrap_or(std::time::Duration::MAX)
    }

    /// What a pass costs, as the recent passes suggest (`None` before the
    /// first).
    pub fn pass_cost(&self) -> Option<PassCost> {
        self.cost.lock().unwrap_or_else(|p| p.into_inner()).cost()
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
        self.cost
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .add(rows, seconds);
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
    /// The prefix cache's counts (its bytes, budget and evictions).
    pub prefix: shardplane_engine::prefix::PrefixCacheStats,
    /// The stage's `looked_up` and `reused` so far.
    pub looks: (u64, u64),
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
    /// The sliding window of each of the model's layers (`None`: a full
    /// layer), all of them: a head counts its later stages' KV by theirs.
    pub windows: Arc<[Option<usize>]>,
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
        // Known before the thread's first step: whether a head looks in
        // its cache depends on it.
        *stats.prefix.lock().unwrap_or_else(|p| p.into_inner()) = shard.prefix_cache();
        let crashed = Arc::new(OnceLock::new());
        let worker = StageWorker {
            jobs,
            stats: stats.clone(),
            weight_bytes: shard.weight_bytes(),
            context_length: shard.context_length(),
            hidden: shard.config().hidden_size,
            windows: shard
                .config()
                .layer_windows(0..shard.config().layers)
                .into(),
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
        let job = Job::Forward {
            seq,
            input,
            reply,
            sent: std::time::Instant::now(),
        };
        if self.jobs.send(job).is_err() {
            self.stats.unqueue_tokens(tokens);
            return Err(gone());
        }
        answer.await.map_err(|_| gone())?
    }

    /// Frees `seq`'s KV cache (queued behind its pending steps).
    pub fn release(&self, seq: SequenceId) {
        let _ = self.jobs.send(Job::Release { seq });
    }

    /// Frees `seq`'s KV cache and refuses its steps from then on (those
    /// already queued are dropped): another sequence took its place.
    pub fn retire(&self, seq: SequenceId) {
        let _ = self.jobs.send(Job::Retire { seq });
    }

    /// Starts the new sequence `seq` from the prefix cache's longest prefix
    /// of `tokens`, all but the last token at most; returns the tokens it
    /// holds (0 when the stage keeps no cache or is gone).
    pub async fn seed(&self, seq: SequenceId, tokens: Vec<u32>) -> usize {
        let (reply, held) = oneshot::channel();
        if self.jobs.send(Job::Seed { seq, tokens, reply }).is_err() {
            return 0;
        }
        held.await.unwrap_or(0)
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

    #[test]
    fn queued_prompts_wait_longer_while_sequences_decode() {
        let stats = StageStats::default();
        assert!(stats.estimated_wait().is_zero(), "no pass yet");
        // 20 ms a pass and 1 ms a row.
        for i in 0..50 {
            let rows = [1, 64, 512][i % 3];
            stats.record_pass(rows, 0.020 + 0.001 * rows as f64);
        }
        let budget = Budget {
            prefill_tokens: 512,
            decode_step: Duration::from_millis(200),
            decode_groups: 1,
        };
        stats.budget.set(budget).unwrap();
        stats.queue_tokens(1024);
        // Idle: two slices of 512, 2 × 20 ms + 1024 × 1 ms.
        let idle = stats.estimated_wait().as_secs_f64();
        assert!((idle - 1.064).abs() < 1e-6, "{idle}");
        // 8 sequences decoding, 5 of them back (their tokens queued too):
        // slices of 200 − 20 − 8 = 172 rows, so 6 passes, each with the
        // fixed part and the 8 decode rows.
        stats.decoding.store(8, Ordering::Relaxed);
        stats.decodes_back.store(5, Ordering::Relaxed);
        stats.queue_tokens(5);
        let busy = stats.estimated_wait().as_secs_f64();
        assert!((busy - (6.0 * 0.028 + 1.024)).abs() < 1e-6, "{busy}");
    }
}
