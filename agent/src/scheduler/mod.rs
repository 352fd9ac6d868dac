//! A stage's step loop: every step advances the decoding sequences together
//! (all of them, or one group at a pipeline's head) and takes a bounded slice
//! of waiting prompts (chunked prefill), so a long prompt never stalls the
//! sequences that are decoding.
//!
//! ```text
//!  jobs ──► [decode steps: one token per held sequence¹] ┐
//!       └─► [prefills, oldest first] ── slice ≤ budget ──┴─► one forward_batch ─► replies
//!  a prefill is answered when its last slice has run (hidden rows gathered for
//!  a middle stage; the last slice's logits for a last stage)
//!  ¹ of one group, at a pipeline's head
//! ```
//!
//! A pipeline's head splits its decoding sequences into one group per stage
//! (micro-batches), so that while a later stage runs one group the earlier
//! ones run the others, instead of each stage idling until the whole batch
//! comes round again:
//!
//! ```text
//!  one batch:  stage 0 ▇▇▇▇······▇▇▇▇······      two groups:  stage 0 ▇▇▇▇▇▇▇▇▇▇
//!              stage 1 ····▇▇▇▇······▇▇▇▇                    stage 1 ··▇▇▇▇▇▇▇▇▇▇
//! ```
//!
//! Work nobody waits for (its caller went away) is dropped before it runs.

use std::collections::VecDeque;
use std::sync::atomic::Ordering;
use std::sync::{Arc, mpsc};
use std::time::{Duration, Instant};

use shardplane_engine::{Activations, SequenceId, Stage, StageInput, StageOutput};
use tokio::sync::oneshot;

use crate::shared_prompt;
use crate::stage::{Pass, PassObserver, StageStats};
use crate::step_cost::PassCost;
use crate::step_gather::Gather;

/// What a forward job gives back.
#[derive(Debug)]
pub struct Forwarded {
    /// The stage's output.
    pub output: StageOutput,
    /// Tokens of the input that came from the prefix cache (not computed).
    pub cached: usize,
}

/// A reply to one forward job.
pub type Reply = oneshot::Sender<shardplane_engine::Result<Forwarded>>;

/// What the stage thread is asked to do.
pub enum Job {
    /// Run `input` for `seq`.
    Forward {
        /// The sequence.
        seq: SequenceId,
        /// Its tokens or hidden rows.
        input: StageInput,
        /// Where the output goes.
        reply: Reply,
        /// When it was sent.
        sent: Instant,
    },
    /// Free `seq`'s KV cache.
    Release {
        /// The sequence.
        seq: SequenceId,
    },
    /// Free `seq`'s KV cache and refuse its steps from now on: another
    /// sequence took its place (a recompute after a preemption) while its
    /// stream may still carry a step, which would otherwise start it again
    /// at position 0 (and, kept in the prefix cache, poison it).
    Retire {
        /// The sequence.
        seq: SequenceId,
    },
    /// Start the new sequence `seq` from the prefix cache's longest prefix
    /// of `tokens` (all but the last at most; see `Stage::reuse_prefix`),
    /// before its first rows come: a pipeline's stages take their prompts'
    /// prefixes so. The reply is the tokens it holds.
    Seed {
        /// The sequence.
        seq: SequenceId,
        /// Its prompt, or the part of it to take and one token more.
        tokens: Vec<u32>,
        /// Where the count goes.
        reply: oneshot::Sender<usize>,
    },
}

/// How a step is made up.
#[derive(Debug, Clone, Copy)]
pub struct Budget {
    /// Prompt tokens a step takes at most, besides its decode tokens.
    pub prefill_tokens: usize,
    /// How long a step should take while sequences are decoding: the
    /// prompt slice shrinks (to [`MIN_SLICE`] at least) so that the decode
    /// steps, which wait for the whole step, keep this pace.
    pub decode_step: Duration,
    /// Groups the decoding sequences go round in: a pipeline's head keeps
    /// one per stage, each step taking one group's share of them, so that
    /// every stage has a group to work on; 1 everywhere else.
    pub decode_groups: usize,
}

impl Default for Budget {
    fn default() -> Self {
        Budget {
            prefill_tokens: shardplane_engine::config::PROMPT_STEP,
            decode_step: Duration::from_millis(200),
            decode_groups: 1,
        }
    }
}

/// The fewest prompt tokens a step takes while a prompt waits, however
/// slow the passes: prompts always make progress.
pub const MIN_SLICE: usize = 8;

impl Budget {
    /// The decode steps one step takes at most while `decoding` sequences
    /// decode (those back and those still going round): one group's share.
    /// With stages of like cost (a fixed part and a part per row) and no
    /// prompts waiting, the split never lengthens the time between tokens:
    /// each stage runs `groups` passes of `decoding / groups` rows while the
    /// others run the other groups, where one batch would leave each stage
    /// idle for the others' passes.
    pub fn decode_rows(&self, decoding: usize) -> usize {
        decoding.div_ceil(self.decode_groups.max(1)).max(1)
    }

    /// Prompt tokens the next step may take beside `decodes` decode steps,
    /// when a pass costs `cost` (`None`: not known yet). A sequence's token
    /// takes one step per group, so a step is paced to `decode_step` ÷
    /// groups.
    pub fn prefill_room(&self, decodes: usize, cost: Option<PassCost>) -> usize {
        let most = self.prefill_tokens.max(1);
        let Some(cost) = cost.filter(|_| decodes > 0) else {
            return most;
        };
        let step = self.decode_step.as_secs_f64() / self.decode_groups.max(1) as f64;
        let rows = cost.rows_within(step);
        rows.saturating_sub(decodes)
            .clamp(MIN_SLICE.min(most), most)
    }
}

/// A prompt being run in slices.
struct Prefill {
    seq: SequenceId,
    rest: StageInput,
    /// Hidden rows of the slices already run (stages that pass them on).
    rows: Vec<f32>,
    reply: Reply,
    /// When it reached the stage, until its first slice runs.
    queued: Option<Instant>,
    /// Its tokens that came from the prefix cache.
    cached: usize,
    /// The whole prompt, on a stage with a prefix cache (prompts that begin
    /// alike wait for it: see `shared_prompt`).
    prompt: Option<Arc<[u32]>>,
}

/// A new prompt waiting for a running one it begins like, to take the
/// shared part from the prefix cache once that one has run.
struct Parked {
    leader: SequenceId,
    seq: SequenceId,
    input: StageInput,
    reply: Reply,
    sent: Instant,
}

/// Retired sequences a stage remembers (a stray step comes within moments).
const RETIRED: usize = 256;

/// What the stage holds between steps.
#[derive(Default)]
struct Work {
    decodes: Vec<(SequenceId, StageInput, Reply)>,
    prefills: VecDeque<Prefill>,
    parked: Vec<Parked>,
    releases: Vec<SequenceId>,
    /// The latest retired sequences, whose steps are refused.
    retired: VecDeque<SequenceId>,
}

impl Work {
    /// Whether `seq` has a decode step or a prompt waiting to run.
    fn runs(&self, seq: SequenceId) -> bool {
        self.decodes.iter().any(|(s, _, _)| *s == seq) || self.prefills.iter().any(|p| p.seq == seq)
    }
}

/// One sequence's part in a step.
enum Part {
    Decode(SequenceId, Reply),
    Slice { prefill: usize, last: bool },
}

/// Runs jobs from `queue` on `shard` until every sender is gone.
pub fn run(
    mut shard: Box<dyn Stage>,
    queue: mpsc::Receiver<Job>,
    stats: Arc<StageStats>,
    observe: PassObserver,
    budget: Budget,
) {
    let mut work = Work::default();
    // A whole model takes a new prompt's prefix as it comes; a pipeline's
    // stages are told what to take (`Job::Seed`), so that all take alike.
    let caching = shard.prefix_cache().budget_bytes > 0
        && shard.layout().is_first()
        && shard.layout().is_last();
    let mut gather = Gather::default();
    let _ = stats.budget.set(budget);
    loop {
        // Idle, the stage waits for a job; then it takes whatever is queued,
        // and waits a moment for the sequences the last step answered when
        // they come back quickly (see `step_gather`).
        let first = if work.decodes.is_empty() && work.prefills.is_empty() {
            count_decoding(&stats, &work, &gather);
            match queue.recv() {
                Ok(job) => Some(job),
                Err(_) => return,
            }
        } else {
            None
        };
        let queued = std::iter::from_fn(|| queue.try_recv().ok());
        let mut file = |job: Job, gather: &mut Gather| {
            match &job {
                Job::Forward { seq, sent, .. } => gather.arrived(*seq, *sent),
                Job::Release { seq } | Job::Retire { seq } => gather.gone(*seq),
                Job::Seed { .. } => {}
            }
            take(job, &mut *shard, &mut work, caching, &stats);
        };
        for job in first.into_iter().chain(queued) {
            file(job, &mut gather);
        }
        // A pipeline's head takes its groups as they come round: waiting
        // for the rest of the ring never pays.
        while budget.decode_groups <= 1
            && let Some(left) = gather.wait_left(Instant::now())
        {
            match queue.recv_timeout(left) {
                Ok(job) => file(job, &mut gather),
                Err(mpsc::RecvTimeoutError::Timeout) => break,
                Err(mpsc::RecvTimeoutError::Disconnected) => gather.closed(),
            }
        }
        for seq in std::mem::take(&mut work.releases) {
            shard.release(seq);
        }
        drop_abandoned(&mut work, &stats);
        unpark(&mut *shard, &mut work, caching, &stats);
        let decoding = count_decoding(&stats, &work, &gather);
        let ran = step(
            &mut *shard,
            &mut work.decodes,
            &mut work.prefills,
            budget,
            budget.decode_rows(decoding),
            &stats,
        );
        unpark(&mut *shard, &mut work, caching, &stats);
        if let Some(at) = ran.finished {
            // Whether waiting pays is judged against a pass of the answered
            // sequences alone (not a long prompt slice's pass).
            let pass = stats
                .pass_cost()
                .map_or(ran.seconds, |c| c.seconds(ran.answered.len()));
            gather.answered(ran.answered.iter().copied(), at, pass);
        }
        stats
            .sequences
            .store(shard.sequences() as u64, Ordering::Relaxed);
        stats
            .kv_cache_bytes
            .store(shard.kv_cache_bytes() as u64, Ordering::Relaxed);
        let prefix = shard.prefix_cache();
        *stats.prefix.lock().unwrap_or_else(|p| p.into_inner()) = prefix;
        observe(&Pass {
            rows: ran.rows,
            seconds: ran.seconds,
            sequences: ran.sequences,
            waiting: work.prefills.len() + work.parked.len(),
            queue_waits: ran.queue_waits,
            kv_tokens: (
                stats.kv.reserved_tokens.load(Ordering::Relaxed),
                stats.kv.budget(),
            ),
            prefix,
            looks: stats.looks(),
        });
    }
}

/// Tells the stage's queue-wait estimate which sequences decode: those back
/// for the next step and those answered and still to come back (they decode
/// here again). Returns their number.
fn count_decoding(stats: &StageStats, work: &Work, gather: &Gather) -> usize {
    let back = work.decodes.len();
    let decoding = back + gather.out();
    stats.decoding.store(decoding, Ordering::Relaxed);
    stats.decodes_back.store(back, Ordering::Relaxed);
    decoding
}

/// Files a job: a single token for a sequence the stage holds is a decode
/// step; anything else is a prefill, run in slices. A new sequence's prompt
/// first takes what the prefix cache holds of it, or waits for a running
/// prompt it begins like (`shared_prompt`).
fn take(job: Job, shard: &mut dyn Stage, work: &mut Work, caching: bool, stats: &StageStats) {
    match job {
        Job::Forward {
            seq,
            mut input,
            reply,
            sent,
        } => {
            if work.retired.contains(&seq) {
                stats.unqueue_tokens(input.len());
                let _ = reply.send(Err(shardplane_engine::Error::InvalidInput(format!(
                    "sequence {seq} was replaced by another"
                ))));
                return;
            }
            let busy = work.runs(seq);
            let (mut new_prompt, mut cached, mut prompt) = (false, 0, None);
            if let StageInput::Tokens(ids) = &input
                && !busy
                && shard.sequence_len(seq) == 0
            {
                new_prompt = true;
                if caching {
                    let running = work.prefills.iter().filter_map(|p| {
                        Some((p.seq, p.prompt.as_deref()?, p.cached, p.rest.len()))
                    });
                    if let Some(leader) = shared_prompt::leader(ids, running) {
                        // Taken again, whole, once the leader has run.
                        work.parked.push(Parked {
                            leader,
                            seq,
                            input,
                            reply,
                            sent,
                        });
                        return;
                    }
                    prompt = Some(Arc::from(ids.as_slice()));
                    cached = shard.reuse_prefix(seq, ids);
                    stats.count_look(ids.len(), cached);
                    if cached > 0 {
                        split_front(&mut input, cached);
                        stats.unqueue_tokens(cached);
                    }
                }
            }
            if input.len() == 1 && shard.sequence_len(seq) > 0 && !busy && !new_prompt {
                work.decodes.push((seq, input, reply));
            } else {
                work.prefills.push_back(Prefill {
                    seq,
                    rest: input,
                    rows: Vec::new(),
                    reply,
                    queued: Some(sent),
                    cached,
                    prompt,
                });
            }
        }
        Job::Release { seq } => {
            // Its caller is gone: so is what it still waited for.
            work.decodes.retain(|(s, _, _)| {
                let keep = *s != seq;
                if !keep {
                    stats.unqueue_tokens(1);
                }
                keep
            });
            work.prefills.retain(|p| {
                let keep = p.seq != seq;
                if !keep {
                    stats.unqueue_tokens(p.rest.len());
                }
                keep
            });
            work.parked.retain(|p| {
                let keep = p.seq != seq;
                if !keep {
                    stats.unqueue_tokens(p.input.len());
                }
                keep
            });
            work.releases.push(seq);
        }
        Job::Retire { seq } => {
            // Each ask of a recompute names it again.
            if !work.retired.contains(&seq) {
                if work.retired.len() == RETIRED {
                    work.retired.pop_front();
                }
                work.retired.push_back(seq);
            }
            take(Job::Release { seq }, shard, work, caching, stats);
        }
        Job::Seed { seq, tokens, reply } => {
            // Sequences released before it keep their blocks first: a
            // preempted generation's old sequence, say, holds what the new
            // one takes.
            for released in std::mem::take(&mut work.releases) {
                shard.release(released);
            }
            let busy = work.runs(seq);
            let held = match busy {
                true => 0,
                false => shard.reuse_prefix(seq, &tokens),
            };
            let _ = reply.send(held);
        }
    }
}

/// Files again the parked prompts whose leader has run (or left).
fn unpark(shard: &mut dyn Stage, work: &mut Work, caching: bool, stats: &StageStats) {
    let (ready, waiting): (Vec<Parked>, Vec<Parked>) = std::mem::take(&mut work.parked)
        .into_iter()
        .partition(|p| !work.prefills.iter().any(|f| f.seq == p.leader));
    work.parked = waiting;
    for p in ready {
        let job = Job::Forward {
            seq: p.seq,
            input: p.input,
            reply: p.reply,
            sent: p.sent,
        };
        take(job, shard, work, caching, stats);
    }
}

/// Drops work whose caller went away (the client or the previous stage).
fn drop_abandoned(work: &mut Work, stats: &StageStats) {
    work.decodes.retain(|(_, input, reply)| {
        let keep = !reply.is_closed();
        if !keep {
            stats.unqueue_tokens(input.len());
        }
        keep
    });
    work.prefills.retain(|p| {
        let keep = !p.reply.is_closed();
        if !keep {
            stats.unqueue_tokens(p.rest.len());
        }
        keep
    });
    work.parked.retain(|p| {
        let keep = !p.reply.is_closed();
        if !keep {
            stats.unqueue_tokens(p.input.len());
        }
        keep
    });
}

/// Splits the first `n` rows off `input`.
fn split_front(input: &mut StageInput, n: usize) -> StageInput {
    match input {
        StageInput::Tokens(ids) => StageInput::Tokens(ids.drain(..n).collect()),
        StageInput::Hidden(a) => {
            let front: Vec<f32> = a.data.drain(..n * a.hidden).collect();
            let ids = match a.told_ids() {
                Some(_) => a.ids.drain(..n).collect(),
                None => Vec::new(),
            };
            a.tokens -= n;
            StageInput::Hidden(Activations {
                tokens: n,
                hidden: a.hidden,
                data: front,
                ids,
            })
        }
    }
}

/// What one step ran.
#[derive(Default)]
struct Ran {
    rows: usize,
    seconds: f64,
    sequences: usize,
    /// Seconds each prompt whose first slice ran had waited for it.
    queue_waits: Vec<f64>,
    /// Sequences the step answered with a row (their callers still there).
    answered: Vec<SequenceId>,
    /// When its pass ended (`None`: no pass).
    finished: Option<Instant>,
}

/// One step: the decodes (the first `most` back; the rest wait for the next
/// step), then prompt slices up to the budget.
fn step(
    shard: &mut dyn Stage,
    decodes: &mut Vec<(SequenceId, StageInput, Reply)>,
    prefills: &mut VecDeque<Prefill>,
    budget: Budget,
    most: usize,
    stats: &StageStats,
) -> Ran {
    let mut batch: Vec<(SequenceId, StageInput)> = Vec::new();
    let mut parts: Vec<Part> = Vec::new();
    for (seq, input, reply) in decodes.drain(..most.min(decodes.len())) {
        batch.push((seq, input));
        parts.push(Part::Decode(seq, reply));
    }
    let mut queue_waits = Vec::new();
    let mut room = budget.prefill_room(batch.len(), stats.pass_cost());
    for (i, p) in prefills.iter_mut().enumerate() {
        if room == 0 {
            break;
        }
        let n = p.rest.len().min(room);
        room -= n;
        if let Some(queued) = p.queued.take() {
            queue_waits.push(queued.elapsed().as_secs_f64());
        }
        let last = n == p.rest.len();
        batch.push((p.seq, split_front(&mut p.rest, n)));
        parts.push(Part::Slice { prefill: i, last });
    }
    if batch.is_empty() {
        return Ran::default();
    }
    let sequences = batch.len();
    let rows: usize = batch.iter().map(|(_, input)| input.len()).sum();
    let started = Instant::now();
    // Fault injection for tests of a crashing stage (`FAILPOINTS=stage-pass=…`).
    fail::fail_point!("stage-pass");
    let result = shard.forward_batch(batch);
    let finished = Instant::now();
    let seconds = finished.duration_since(started).as_secs_f64();
    stats.record_pass(rows, seconds);
    stats.unqueue_tokens(rows);
    let mut done: Vec<usize> = Vec::new();
    // Prompts that ran to their end: kept for the sequences that share them.
    let mut ran: Vec<SequenceId> = Vec::new();
    // Sequences answered with a row: their next one is on its way.
    let mut answered: Vec<SequenceId> = Vec::new();
    match result {
        Ok(outputs) => {
            for (part, out) in parts.into_iter().zip(outputs) {
                match part {
                    Part::Decode(seq, reply) => {
                        let sent = reply.send(Ok(Forwarded {
                            output: out,
                            cached: 0,
                        }));
                        if sent.is_ok() {
                            answered.push(seq);
                        }
                    }
                    Part::Slice { prefill, last } => {
                        let p = &mut prefills[prefill];
                        match (last, out) {
                            (false, StageOutput::Hidden(a)) => p.rows.extend(a.data),
                            // A last stage's logits only matter at the prompt's end.
                            (false, StageOutput::Logits(_)) => {}
                            (true, out) => {
                                let out = match out {
                                    StageOutput::Hidden(a) if !p.rows.is_empty() => {
                                        let mut rows = std::mem::take(&mut p.rows);
                                        rows.extend(a.data);
                                        Activations::new(rows.len() / a.hidden, a.hidden, rows)
                                            .map(StageOutput::Hidden)
                                    }
                                    out => Ok(out),
                                };
                                done.push(prefill);
                                ran.push(p.seq);
                                let cached = p.cached;
                                let (seq, reply) = take_reply(p);
                                let ok = out.is_ok();
                                let sent =
                                    reply.send(out.map(|output| Forwarded { output, cached }));
                                if ok && sent.is_ok() {
                                    answered.push(seq);
                                }
                            }
                        }
                    }
                }
            }
        }
        Err(e) => {
            // The engine dropped these sequences' caches: every caller hears
            // why, as its own fault only when the input was at fault.
            let message = e.to_string();
            let callers = e.is_callers();
            let fail = || match callers {
                true => shardplane_engine::Error::InvalidInput(message.clone()),
                false => shardplane_engine::Error::Unavailable(message.clone()),
            };
            for part in parts {
                match part {
                    Part::Decode(_, reply) => {
                        let _ = reply.send(Err(fail()));
                    }
                    Part::Slice { prefill, .. } => {
                        let p = &mut prefills[prefill];
                        stats.unqueue_tokens(p.rest.len());
                        done.push(prefill);
                        let (_, reply) = take_reply(p);
                        let _ = reply.send(Err(fail()));
                    }
                }
            }
        }
    }
    done.sort_unstable();
    for i in done.into_iter().rev() {
        prefills.remove(i);
    }
    for seq in ran {
        shard.retain_prefix(seq);
    }
    Ran {
        rows,
        seconds,
        sequences,
        queue_waits,
        answered,
        finished: Some(finished),
    }
}

/// Swaps the reply out of a finished prefill (it is removed afterwards).
fn take_reply(p: &mut Prefill) -> (SequenceId, Reply) {
    let (placeholder, _) = oneshot::channel();
    (p.seq, std::mem::replace(&mut p.reply, placeholder))
}

#[cfg(test)]
mod tests;
