//! The ranks of one tensor-parallel stage, run in this process.
//!
//! ```text
//!  forward_batch ──► worker threads (ranks 1..n): forward_batch(copy)
//!        │                       ║ all-reduces ║
//!        └──────► rank 0, here:  forward_batch ──► its outputs are the group's
//! ```
//!
//! Every rank runs every step and every release, so their caches stay in
//! step. A rank that fails mid-step may leave the others waiting in a
//! collective (until its deadline) and out of step: the group is then
//! broken, and every later call is refused as unavailable (the shard fails
//! and is placed again) rather than summing mismatched partial results.

use std::sync::mpsc;
use std::thread::JoinHandle;

use crate::config::ModelConfig;
use crate::error::{Error, Result};
use crate::stage::{SequenceId, Stage, StageInput, StageLayout, StageOutput};

/// What the leader asks of a worker rank.
enum Command {
    Step(Vec<(SequenceId, StageInput)>),
    Release(SequenceId),
}

/// A worker rank: its thread and how to talk to it.
struct Worker {
    commands: mpsc::Sender<Command>,
    replies: mpsc::Receiver<Result<(), (bool, String)>>,
    thread: Option<JoinHandle<()>>,
}

/// A stage computed by the ranks of a tensor group: rank 0 on the caller's
/// thread, the others on threads of their own.
pub struct TensorGroup {
    leader: Box<dyn Stage>,
    workers: Vec<Worker>,
    /// Why the group can no longer run, once a rank failed mid-step.
    broken: Option<String>,
}

impl std::fmt::Debug for TensorGroup {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TensorGroup")
            .field("ranks", &(self.workers.len() + 1))
            .field("layers", &self.leader.layout().layers)
            .field("broken", &self.broken)
            .finish()
    }
}

impl TensorGroup {
    /// Groups `ranks`, rank 0 first, each already joined to the others'
    /// collective. They must be ranks of one stage of one model.
    pub fn new(ranks: Vec<Box<dyn Stage>>) -> Result<Self> {
        let mut ranks = ranks.into_iter();
        let leader = ranks
            .next()
            .ok_or_else(|| Error::Tensor("a tensor group needs at least one rank".into()))?;
        let mut workers = Vec::new();
        for (i, stage) in ranks.enumerate() {
            if stage.layout() != leader.layout() || stage.config() != leader.config() {
                return Err(Error::Tensor(format!(
                    "rank {} runs layers {:?}, rank 0 runs {:?} of another model or range",
                    i + 1,
                    stage.layout().layers,
                    leader.layout().layers
                )));
            }
            workers.push(spawn(i + 1, stage)?);
        }
        Ok(TensorGroup {
            leader,
            workers,
            broken: None,
        })
    }

    fn check(&self) -> Result<()> {
        match &self.broken {
            Some(why) => Err(Error::Unavailable(format!("tensor group broken: {why}"))),
            None => Ok(()),
        }
    }
}

/// Starts the thread of worker rank `rank`.
fn spawn(rank: usize, mut stage: Box<dyn Stage>) -> Result<Worker> {
    let (commands, inbox) = mpsc::channel::<Command>();
    let (outbox, replies) = mpsc::channel();
    let thread = std::thread::Builder::new()
        .name(format!("tensor-rank-{rank}"))
        .spawn(move || {
            for command in inbox {
                let reply = match command {
                    Command::Step(batch) => stage
                        .forward_batch(batch)
                        .map(drop)
                        .map_err(|e| (e.is_callers(), e.to_string())),
                    Command::Release(seq) => {
                        stage.release(seq);
                        Ok(())
                    }
                };
                if outbox.send(reply).is_err() {
                    break;
                }
            }
        })
        .map_err(|e| Error::Tensor(format!("cannot start rank {rank}'s thread: {e}")))?;
    Ok(Worker {
        commands,
        replies,
        thread: Some(thread),
    })
}

impl Drop for TensorGroup {
    fn drop(&mut self) {
        for worker in &mut self.workers {
            // Closing the channel ends the worker's loop.
            let (closed, _) = mpsc::channel();
            drop(std::mem::replace(&mut worker.commands, closed));
            if let Some(thread) = worker.thread.take() {
                let _ = thread.join();
            }
        }
    }
}

impl Stage for TensorGroup {
    fn config(&self) -> &ModelConfig {
        self.leader.config()
    }

    fn layout(&self) -> &StageLayout {
        self.leader.layout()
    }

    fn context_length(&self) -> usize {
        self.leader.context_length()
    }

    fn forward_batch(&mut self, batch: Vec<(SequenceId, StageInput)>) -> Result<Vec<StageOutput>> {
        self.check()?;
        if batch.is_empty() {
            return Ok(Vec::new());
        }
        let mut sent = 0;
        for worker in &self.workers {
            if worker.commands.send(Command::Step(batch.clone())).is_err() {
                break;
            }
            sent += 1;
        }
        let led = self.leader.forward_batch(batch);
        let mut failures = Vec::new();
        for (i, worker) in self.workers.iter().enumerate().take(sent) {
            match worker.replies.recv() {
                Ok(Ok(())) => {}
                Ok(Err((callers, e))) => failures.push((callers, format!("rank {}: {e}", i + 1))),
                Err(_) => failures.push((false, format!("rank {} stopped", i + 1))),
            }
        }
        if sent < self.workers.len() {
            failures.push((false, format!("rank {} stopped", sent + 1)));
        }
        match (led, failures.is_empty()) {
            (Ok(outputs), true) => Ok(outputs),
            // The caller's input, refused alike by every rank before any
            // collective: the ranks are still in step.
            (Err(e), false)
                if e.is_callers()
                    && failures.len() == self.workers.len()
                    && failures.iter().all(|(callers, _)| *callers) =>
            {
                Err(e)
            }
            (led, _) => {
                let mut why: Vec<String> = failures.into_iter().map(|(_, e)| e).collect();
                if let Err(e) = led {
                    why.insert(0, format!("rank 0: {e}"));
                }
                let why = why.join("; ");
                self.broken = Some(why.clone());
                Err(Error::Unavailable(format!("tensor group broken: {why}")))
            }
        }
    }

    fn release(&mut self, seq: SequenceId) -> bool {
        if self.broken.is_none() {
            for worker in &self.workers {
                if worker.commands.send(Command::Release(seq)).is_ok() {
                    let _ = worker.replies.recv();
                }
            }
        }
        self.leader.release(seq)
    }

    fn sequence_len(&self, seq: SequenceId) -> usize {
        self.leader.sequence_len(seq)
    }

    fn sequences(&self) -> usize {
        self.leader.sequences()
    }

    /// Rank 0's weights; the others' live in the same process but are
    /// theirs (each rank would be a machine of its own).
    fn weight_bytes(&self) -> usize {
        self.leader.weight_bytes()
    }

    fn kv_cache_bytes(&self) -> usize {
        self.leader.kv_cache_bytes()
    }
}
