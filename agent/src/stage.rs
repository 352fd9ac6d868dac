//! A loaded stage runs on a thread of its own, fed by a queue: the async data
//! plane never blocks on a forward pass, and decode steps of different
//! sequences that arrive together run as one batch.
//!
//! ```text
//!  Forward streams ──► queue ──► stage thread: drain queue ─► batch decode steps ─► reply
//!  Release ───────────┘                        └─► prefills one by one
//! ```

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::mpsc;
use std::time::Instant;

use shardplane_engine::{SequenceId, Shard, StageInput, StageOutput};
use tokio::sync::oneshot;

/// What the stage thread is asked to do.
enum Job {
    Forward {
        seq: SequenceId,
        input: StageInput,
        reply: oneshot::Sender<shardplane_engine::Result<StageOutput>>,
    },
    Release {
        seq: SequenceId,
    },
}

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

    /// Records a pass of `rows` tokens that took `seconds`.
    fn record_pass(&self, rows: usize, seconds: f64) {
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
    /// Moves `shard` onto a new thread named after the stage.
    pub fn start(name: &str, shard: Box<dyn Shard>, observe: PassObserver) -> Self {
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
            .spawn(move || run(shard, queue, stats, observe))
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
        let tokens = input.len() as u64;
        self.stats
            .queued_tokens
            .fetch_add(tokens, Ordering::Relaxed);
        if self.jobs.send(Job::Forward { seq, input, reply }).is_err() {
            self.stats
                .queued_tokens
                .fetch_sub(tokens, Ordering::Relaxed);
            return Err(gone());
        }
        answer.await.map_err(|_| gone())?
    }

    /// Frees `seq`'s KV cache (queued behind its pending steps).
    pub fn release(&self, seq: SequenceId) {
        let _ = self.jobs.send(Job::Release { seq });
    }
}

fn run(
    mut shard: Box<dyn Shard>,
    queue: mpsc::Receiver<Job>,
    stats: Arc<StageStats>,
    observe: PassObserver,
) {
    type Reply = oneshot::Sender<shardplane_engine::Result<StageOutput>>;
    // Single-token steps of distinct sequences, run together.
    let mut batch: Vec<(SequenceId, StageInput, Reply)> = Vec::new();
    let flush = |shard: &mut Box<dyn Shard>, batch: &mut Vec<(SequenceId, StageInput, Reply)>| {
        if batch.is_empty() {
            return;
        }
        let started = Instant::now();
        let rows = batch.len();
        stats
            .queued_tokens
            .fetch_sub(rows as u64, Ordering::Relaxed);
        if batch.len() == 1 {
            let (seq, input, reply) = batch.pop().expect("one step");
            let _ = reply.send(shard.forward(seq, input));
        } else {
            let (inputs, replies): (Vec<_>, Vec<_>) =
                batch.drain(..).map(|(s, i, r)| ((s, i), r)).unzip();
            match shard.forward_batch(inputs) {
                Ok(outputs) => {
                    for (reply, out) in replies.into_iter().zip(outputs) {
                        let _ = reply.send(Ok(out));
                    }
                }
                Err(e) => {
                    let message = e.to_string();
                    for reply in replies {
                        let _ = reply
                            .send(Err(shardplane_engine::Error::InvalidInput(message.clone())));
                    }
                }
            }
        }
        let seconds = started.elapsed().as_secs_f64();
        stats.record_pass(rows, seconds);
        stats
            .queued_tokens
            .fetch_sub(rows as u64, Ordering::Relaxed);
        observe(rows, seconds);
    };
    while let Ok(first) = queue.recv() {
        let mut jobs = vec![first];
        while let Ok(more) = queue.try_recv() {
            jobs.push(more);
        }
        for job in jobs {
            match job {
                // Nobody waits for it (the client or the previous stage went
                // away): computing it would only delay the sequences that wait.
                Job::Forward { reply, input, .. } if reply.is_closed() => {
                    stats
                        .queued_tokens
                        .fetch_sub(input.len() as u64, Ordering::Relaxed);
                }
                Job::Forward { seq, input, reply } => {
                    let batchable = input.len() == 1 && shard.sequence_len(seq) > 0;
                    if batchable && !batch.iter().any(|(s, _, _)| *s == seq) {
                        batch.push((seq, input, reply));
                        continue;
                    }
                    flush(&mut shard, &mut batch);
                    if batchable {
                        batch.push((seq, input, reply));
                    } else {
                        let started = Instant::now();
                        let rows = input.len();
                        stats
                            .queued_tokens
                            .fetch_sub(rows as u64, Ordering::Relaxed);
                        let _ = reply.send(shard.forward(seq, input));
                        let seconds = started.elapsed().as_secs_f64();
                        stats.record_pass(rows, seconds);
                        observe(rows, seconds);
                    }
                }
                Job::Release { seq } => {
                    flush(&mut shard, &mut batch);
                    shard.release(seq);
                }
            }
        }
        flush(&mut shard, &mut batch);
        stats
            .sequences
            .store(shard.sequences() as u64, Ordering::Relaxed);
        stats
            .kv_cache_bytes
            .store(shard.kv_cache_bytes() as u64, Ordering::Relaxed);
    }
}
