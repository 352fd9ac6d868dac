//! A loaded stage runs on a thread of its own, fed by a queue: the async data
//! plane never blocks on a forward pass. The thread runs the step loop of
//! [`crate::scheduler`].
//!
//! ```text
//!  Forward streams ──► queue ──► stage thread: steps of all decodes + prompt slices ─► replies
//!  Release ───────────┘
//! ```

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::mpsc;

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
}

impl StageStats {
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

/// Observes each forward pass: (rows in the pass, seconds).
pub type PassObserver = Arc<dyn Fn(usize, f64) + Send + Sync>;

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
}

impl StageWorker {
    /// Moves `shard` onto a new thread named after the stage, whose steps
    /// are made up as `budget` says.
    pub fn start(name: &str, shard: Box<dyn Stage>, observe: PassObserver, budget: Budget) -> Self {
        let (jobs, queue) = mpsc::channel();
        let stats = Arc::new(StageStats::default());
        let worker = StageWorker {
            jobs,
            stats: stats.clone(),
            weight_bytes: shard.weight_bytes(),
            context_length: shard.context_length(),
            hidden: shard.config().hidden_size,
        };
        std::thread::Builder::new()
            .name(format!("stage {name}"))
            .spawn(move || scheduler::run(shard, queue, stats, observe, budget))
            .expect("spawn a stage thread");
        worker
    }

    /// Runs `input` for `seq` on the stage.
    pub async fn forward(
        &self,
        seq: SequenceId,
        input: StageInput,
    ) -> shardplane_engine::Result<StageOutput> {
        let (reply, answer) = oneshot::channel();
        let gone = || shardplane_engine::Error::InvalidInput("the stage was unloaded".into());
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
