//! The ranks of one tensor-parallel stage behind the ordinary `Stage`
//! contract: rank 0 leads on the caller's thread, the other ranks follow —
//! on threads of this process, or in other processes that receive each
//! command as bytes ([`follow`]).
//!
//! ```text
//!  forward_batch ──► followers (ranks 1..n): Command::Step ──► forward_batch
//!        │                       ║ all-reduces ║
//!        └──────► rank 0, here:  forward_batch ──► its outputs are the group's
//!  then every follower replies: done, refused, or failed
//! ```
//!
//! Every rank runs every step and every release, so their caches stay in
//! step. A rank that fails mid-step may leave the others waiting in a
//! collective (until its deadline) and out of step: the group is then
//! broken, and every later call is refused as unavailable (the shard fails
//! and is placed again) rather than summing mismatched partial results.

use std::sync::mpsc;
use std::thread::JoinHandle;

use super::command::{Command, Reply};
use crate::config::ModelConfig;
use crate::error::{Error, Result};
use crate::stage::{SequenceId, Stage, StageInput, StageLayout, StageOutput};

/// The ranks that follow a leader, wherever they run.
pub trait Followers: Send {
    /// How many there are.
    fn count(&self) -> usize;

    /// Hands `command` to every follower, without waiting for them.
    fn start(&mut self, command: &Command);

    /// Waits for every follower's reply to the last command (one per
    /// follower, in rank order; a follower that could not be reached
    /// replies with why).
    fn finish(&mut self) -> Vec<Reply>;
}

/// Runs one command on a follower's stage.
pub fn obey(stage: &mut dyn Stage, command: Command) -> Reply {
    match command {
        Command::Step(batch) => stage
            .forward_batch(batch)
            .map(drop)
            .map_err(|e| (e.is_callers(), e.to_string())),
        Command::Release(seq) => {
            stage.release(seq);
            Ok(())
        }
    }
}

/// A follower in a process of its own: runs the commands `next` gives
/// (until it gives none: the leader has gone) and answers each with
/// `reply`.
pub fn follow(
    stage: &mut dyn Stage,
    mut next: impl FnMut() -> Result<Option<Command>>,
    mut reply: impl FnMut(&Reply) -> Result<()>,
) -> Result<()> {
    while let Some(command) = next()? {
        reply(&obey(stage, command))?;
    }
    Ok(())
}

/// Followers on threads of this process.
struct Threads(Vec<Worker>);

/// A follower's thread and how to talk to it.
struct Worker {
    commands: Option<mpsc::Sender<Command>>,
    replies: mpsc::Receiver<Reply>,
    thread: Option<JoinHandle<()>>,
    /// Whether it was handed the last command.
    started: bool,
}

impl Threads {
    fn spawn(stages: Vec<Box<dyn Stage>>) -> Result<Self> {
        let mut workers = Vec::new();
        for (i, mut stage) in stages.into_iter().enumerate() {
            let rank = i + 1;
            let (commands, inbox) = mpsc::channel::<Command>();
            let (outbox, replies) = mpsc::channel();
            let thread = std::thread::Builder::new()
                .name(format!("tensor-rank-{rank}"))
                .spawn(move || {
                    for command in inbox {
                        if outbox.send(obey(stage.as_mut(), command)).is_err() {
                            break;
                        }
                    }
                })
                .map_err(|e| Error::Tensor(format!("cannot start rank {rank}'s thread: {e}")))?;
            workers.push(Worker {
                commands: Some(commands),
                replies,
                thread: Some(thread),
                started: false,
            });
        }
        Ok(Threads(workers))
    }
}

impl Followers for Threads {
    fn count(&self) -> usize {
        self.0.len()
    }

    fn start(&mut self, command: &Command) {
        for w in &mut self.0 {
            w.started = w
                .commands
                .as_ref()
                .is_some_and(|c| c.send(command.clone()).is_ok());
        }
    }

    fn finish(&mut self) -> Vec<Reply> {
        self.0
            .iter()
            .map(|w| match w.started {
                true => w
                    .replies
                    .recv()
                    .unwrap_or_else(|_| Err((false, "its thread stopped".into()))),
                false => Err((false, "its thread stopped".into())),
            })
            .collect()
    }
}

impl Drop for Threads {
    fn drop(&mut self) {
        for w in &mut self.0 {
            // Closing the channel ends the worker's loop.
            w.commands = None;
            if let Some(thread) = w.thread.take() {
                let _ = thread.join();
            }
        }
    }
}

/// A stage computed by the ranks of a tensor group.
pub struct TensorGroup {
    leader: Box<dyn Stage>,
    followers: Box<dyn Followers>,
    /// Why the group can no longer run, once a rank failed mid-step.
    broken: Option<String>,
}

impl std::fmt::Debug for TensorGroup {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TensorGroup")
            .field("ranks", &(self.followers.count() + 1))
            .field("layers", &self.leader.layout().layers)
            .field("broken", &self.broken)
            .finish()
    }
}

impl TensorGroup {
    /// Groups `ranks`, rank 0 first, each already joined to the others'
    /// collective, the followers on threads of their own. They must be
    /// ranks of one stage of one model.
    pub fn new(ranks: Vec<Box<dyn Stage>>) -> Result<Self> {
        let mut ranks = ranks.into_iter();
        let leader = ranks
            .next()
            .ok_or_else(|| Error::Tensor("a tensor group needs at least one rank".into()))?;
        let rest: Vec<_> = ranks.collect();
        for (i, stage) in rest.iter().enumerate() {
            if stage.layout() != leader.layout() || stage.config() != leader.config() {
                return Err(Error::Tensor(format!(
                    "rank {} runs layers {:?} of another model or range than rank 0's {:?}",
                    i + 1,
                    stage.layout().layers,
                    leader.layout().layers
                )));
            }
        }
        Ok(Self::led(leader, Box::new(Threads::spawn(rest)?)))
    }

    /// Rank 0's `leader` stage with followers elsewhere (other processes).
    pub fn led(leader: Box<dyn Stage>, followers: Box<dyn Followers>) -> Self {
        TensorGroup {
            leader,
            followers,
            broken: None,
        }
    }

    fn check(&self) -> Result<()> {
        match &self.broken {
            Some(why) => Err(Error::Unavailable(format!("tensor group broken: {why}"))),
            None => Ok(()),
        }
    }
}

impl Stage for TensorGroup {
    fn config(&self) -> &ModelConfig {
        self.leader.config()
    }

    fn kv_bytes_per_token_per_layer(&self) -> usize {
        self.leader.kv_bytes_per_token_per_layer()
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
        let command = Command::Step(batch);
        self.followers.start(&command);
        let Command::Step(batch) = command else {
            unreachable!("a step was built above")
        };
        let led = self.leader.forward_batch(batch);
        let failures: Vec<(bool, String)> = self
            .followers
            .finish()
            .into_iter()
            .enumerate()
            .filter_map(|(i, r)| r.err().map(|(c, e)| (c, format!("rank {}: {e}", i + 1))))
            .collect();
        let count = self.followers.count();
        match led {
            Ok(outputs) if failures.is_empty() => Ok(outputs),
            // The caller's input, refused alike by every rank before any
            // collective: the ranks are still in step.
            Err(e)
                if e.is_callers()
                    && failures.len() == count
                    && failures.iter().all(|(callers, _)| *callers) =>
            {
                Err(e)
            }
            led => {
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
            self.followers.start(&Command::Release(seq));
            if let Some(e) = self.followers.finish().into_iter().find_map(Result::err) {
                self.broken = Some(format!("a release failed: {}", e.1));
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

    /// Rank 0's weights; the others' are theirs (each rank would be a
    /// machine of its own).
    fn weight_bytes(&self) -> usize {
        self.leader.weight_bytes()
    }

    fn kv_cache_bytes(&self) -> usize {
        self.leader.kv_cache_bytes()
    }
}
