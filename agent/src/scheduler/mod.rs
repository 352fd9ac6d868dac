//! A stage's step loop: every step advances all decoding sequences together
//! and takes a bounded slice of waiting prompts (chunked prefill), so a long
//! prompt never stalls the sequences that are decoding.
//!
//! ```text
//!  jobs ──► [decode steps: one token per held sequence] ─┐
//!       └─► [prefills, oldest first] ── slice ≤ budget ──┴─► one forward_batch ─► replies
//!  a prefill is answered when its last slice has run (hidden rows gathered for
//!  a middle stage; the last slice's logits for a last stage)
//! ```
//!
//! Work nobody waits for (its caller went away) is dropped before it runs.

use std::collections::VecDeque;
use std::sync::atomic::Ordering;
use std::sync::mpsc;
use std::time::{Duration, Instant};

use shardplane_engine::{Activations, SequenceId, Stage, StageInput, StageOutput};
use tokio::sync::oneshot;

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
}

impl Default for Budget {
    fn default() -> Self {
        Budget {
            prefill_tokens: shardplane_engine::config::PROMPT_STEP,
            decode_step: Duration::from_millis(200),
        }
    }
}

/// The fewest prompt tokens a step takes while a prompt waits, however
/// slow the passes: prompts always make progress.
pub const MIN_SLICE: usize = 8;

impl Budget {
    /// Prompt tokens the next step may take beside `decodes` decode steps,
    /// when a pass costs `cost` (`None`: not known yet).
    pub fn prefill_room(&self, decodes: usize, cost: Option<PassCost>) -> usize {
        let most = self.prefill_tokens.max(1);
        let Some(cost) = cost.filter(|_| decodes > 0) else {
            return most;
        };
        let rows = cost.rows_within(self.decode_step.as_secs_f64());
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
    stats: std::sync::Arc<StageStats>,
    observe: PassObserver,
    budget: Budget,
) {
    let mut decodes: Vec<(SequenceId, StageInput, Reply)> = Vec::new();
    let mut prefills: VecDeque<Prefill> = VecDeque::new();
    let mut releases: Vec<SequenceId> = Vec::new();
    let mut gather = Gather::default();
    stats
        .prompt_step
        .store(budget.prefill_tokens, Ordering::Relaxed);
    loop {
        // Idle, the stage waits for a job; then it takes whatever is queued,
        // and waits a moment for the sequences the last step answered when
        // they come back quickly (see `step_gather`).
        let first = if decodes.is_empty() && prefills.is_empty() {
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
                Job::Release { seq } => gather.gone(*seq),
            }
            take(
                job,
                &mut *shard,
                &mut decodes,
                &mut prefills,
                &mut releases,
                &stats,
            );
        };
        for job in first.into_iter().chain(queued) {
            file(job, &mut gather);
        }
        while let Some(left) = gather.wait_left(Instant::now()) {
            match queue.recv_timeout(left) {
                Ok(job) => file(job, &mut gather),
                Err(mpsc::RecvTimeoutError::Timeout) => break,
                Err(mpsc::RecvTimeoutError::Disconnected) => gather.closed(),
            }
        }
        for seq in releases.drain(..) {
            shard.release(seq);
        }
        drop_abandoned(&mut decodes, &mut prefills, &stats);
        let ran = step(&mut *shard, &mut decodes, &mut prefills, budget, &stats);
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
            waiting: prefills.len(),
            queue_waits: ran.queue_waits,
            kv_tokens: (
                stats.kv.reserved_tokens.load(Ordering::Relaxed),
                stats.kv.budget(),
            ),
            prefix,
        });
    }
}

/// Files a job: a single token for a sequence the stage holds is a decode
/// step; anything else is a prefill, run in slices. A new sequence's prompt
/// first takes what the prefix cache holds of it.
fn take(
    job: Job,
    shard: &mut dyn Stage,
    decodes: &mut Vec<(SequenceId, StageInput, Reply)>,
    prefills: &mut VecDeque<Prefill>,
    releases: &mut Vec<SequenceId>,
    stats: &StageStats,
) {
    match job {
        Job::Forward {
            seq,
            mut input,
            reply,
            sent: _,
        } => {
            let busy =
                decodes.iter().any(|(s, _, _)| *s == seq) || prefills.iter().any(|p| p.seq == seq);
            let (mut new_prompt, mut cached) = (false, 0);
            if let StageInput::Tokens(ids) = &input
                && !busy
                && shard.sequence_len(seq) == 0
            {
                new_prompt = true;
                cached = shard.reuse_prefix(seq, ids);
                if cached > 0 {
                    split_front(&mut input, cached);
                    stats.unqueue_tokens(cached);
                }
            }
            if input.len() == 1 && shard.sequence_len(seq) > 0 && !busy && !new_prompt {
                decodes.push((seq, input, reply));
            } else {
                prefills.push_back(Prefill {
                    seq,
                    rest: input,
                    rows: Vec::new(),
                    reply,
                    queued: Some(Instant::now()),
                    cached,
                });
            }
        }
        Job::Release { seq } => {
            // Its caller is gone: so is what it still waited for.
            decodes.retain(|(s, _, _)| {
                let keep = *s != seq;
                if !keep {
                    stats.unqueue_tokens(1);
                }
                keep
            });
            prefills.retain(|p| {
                let keep = p.seq != seq;
                if !keep {
                    stats.unqueue_tokens(p.rest.len());
                }
                keep
            });
            releases.push(seq);
        }
    }
}

/// Drops work whose caller went away (the client or the previous stage).
fn drop_abandoned(
    decodes: &mut Vec<(SequenceId, StageInput, Reply)>,
    prefills: &mut VecDeque<Prefill>,
    stats: &StageStats,
) {
    decodes.retain(|(_, input, reply)| {
        let keep = !reply.is_closed();
        if !keep {
            stats.unqueue_tokens(input.len());
        }
        keep
    });
    prefills.retain(|p| {
        let keep = !p.reply.is_closed();
        if !keep {
            stats.unqueue_tokens(p.rest.len());
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
            a.tokens -= n;
            StageInput::Hidden(Activations {
                tokens: n,
                hidden: a.hidden,
                data: front,
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

/// One step: every decode, then prompt slices up to the budget.
fn step(
    shard: &mut dyn Stage,
    decodes: &mut Vec<(SequenceId, StageInput, Reply)>,
    prefills: &mut VecDeque<Prefill>,
    budget: Budget,
    stats: &StageStats,
) -> Ran {
    let mut batch: Vec<(SequenceId, StageInput)> = Vec::new();
    let mut parts: Vec<Part> = Vec::new();
    for (seq, input, reply) in decodes.drain(..) {
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
mod tests {
    use std::sync::Arc;

    use super::*;
    use crate::test_stage::Echo;

    /// Where a job's answer arrives.
    struct Answer(oneshot::Receiver<shardplane_engine::Result<Forwarded>>);

    impl Answer {
        /// The output alone.
        fn blocking_recv(
            self,
        ) -> Result<shardplane_engine::Result<StageOutput>, oneshot::error::RecvError> {
            Ok(self.0.blocking_recv()?.map(|f| f.output))
        }

        /// The output and its cached tokens.
        fn counted(self) -> Forwarded {
            self.0.blocking_recv().unwrap().unwrap()
        }
    }

    fn forward(seq: SequenceId, input: StageInput) -> (Job, Answer) {
        let (reply, answer) = oneshot::channel();
        (
            Job::Forward {
                seq,
                input,
                reply,
                sent: Instant::now(),
            },
            Answer(answer),
        )
    }

    fn tokens(n: usize) -> StageInput {
        StageInput::Tokens((0..n as u32).collect())
    }

    /// Runs `jobs` through a scheduler over `shard` (all queued before it
    /// starts, as a burst arrives) and returns the answers.
    fn run_jobs(shard: Echo, jobs: Vec<Job>, budget: usize) -> Arc<StageStats> {
        run_jobs_observed(shard, jobs, budget, Arc::new(|_| {}))
    }

    /// [`run_jobs`], telling `observe` of every turn.
    fn run_jobs_observed(
        shard: Echo,
        jobs: Vec<Job>,
        budget: usize,
        observe: PassObserver,
    ) -> Arc<StageStats> {
        let (send, queue) = mpsc::channel();
        let stats = Arc::new(StageStats::default());
        for job in jobs {
            if let Job::Forward { input, .. } = &job {
                stats
                    .queued_tokens
                    .fetch_add(input.len() as u64, Ordering::Relaxed);
            }
            send.send(job).unwrap();
        }
        drop(send);
        run(
            Box::new(shard),
            queue,
            stats.clone(),
            observe,
            Budget {
                prefill_tokens: budget,
                ..Budget::default()
            },
        );
        stats
    }

    #[test]
    fn a_long_prompt_runs_in_slices_beside_the_decoding_sequences() {
        let (mut shard, steps) = Echo::new(false);
        // Sequence 1 is decoding already.
        shard.forward(1, tokens(3)).unwrap();
        steps.lock().unwrap().clear();
        let (prompt, prompt_answer) = forward(2, tokens(10));
        let (decode, decode_answer) = forward(1, tokens(1));
        let passes = Arc::new(std::sync::Mutex::new(Vec::new()));
        let seen = passes.clone();
        let stats = run_jobs_observed(
            shard,
            vec![prompt, decode],
            4,
            Arc::new(move |p: &Pass| seen.lock().unwrap().push(p.clone())),
        );
        // The decode step went in the first step, beside the first slice.
        assert_eq!(
            *steps.lock().unwrap(),
            vec![vec![(1, 1), (2, 4)], vec![(2, 4)], vec![(2, 2)]]
        );
        let Ok(Ok(StageOutput::Hidden(a))) = prompt_answer.blocking_recv() else {
            panic!("the prompt's hidden rows");
        };
        assert_eq!(a.data, (0..10).map(|p| p as f32).collect::<Vec<_>>());
        let Ok(Ok(StageOutput::Hidden(d))) = decode_answer.blocking_recv() else {
            panic!("the decode step's row");
        };
        assert_eq!(d.data, vec![3.0]);
        assert_eq!(stats.queued_tokens.load(Ordering::Relaxed), 0);
        assert!(stats.estimated_wait().is_zero());
        // What the metrics hear: 2, 1 and 1 sequences in the passes; the
        // prompt waited once (before its first slice), then no prompt waits.
        let passes = passes.lock().unwrap();
        let ran: Vec<_> = passes.iter().filter(|p| p.rows > 0).collect();
        assert_eq!(
            ran.iter()
                .map(|p| (p.rows, p.sequences))
                .collect::<Vec<_>>(),
            vec![(5, 2), (4, 1), (2, 1)]
        );
        assert_eq!(ran.iter().map(|p| p.queue_waits.len()).sum::<usize>(), 1);
        assert_eq!(
            ran.iter().map(|p| p.waiting).collect::<Vec<_>>(),
            vec![1, 1, 0]
        );
    }

    #[test]
    fn a_last_stage_answers_a_sliced_prompt_with_its_last_logits() {
        let (shard, steps) = Echo::new(true);
        let (prompt, answer) = forward(
            7,
            StageInput::Hidden(Activations::new(5, 1, vec![0.0; 5]).unwrap()),
        );
        run_jobs(shard, vec![prompt], 2);
        assert_eq!(steps.lock().unwrap().len(), 3);
        let Ok(Ok(StageOutput::Logits(l))) = answer.blocking_recv() else {
            panic!("logits");
        };
        assert_eq!(l, vec![4.0], "the logits at the prompt's last token");
    }

    #[test]
    fn work_whose_caller_left_and_released_prompts_never_run() {
        let (shard, steps) = Echo::new(false);
        let (gone, answer) = forward(1, tokens(8));
        drop(answer);
        let (released, _answer) = forward(2, tokens(8));
        let (kept, kept_answer) = forward(3, tokens(2));
        let stats = run_jobs(
            shard,
            vec![gone, released, Job::Release { seq: 2 }, kept],
            64,
        );
        assert_eq!(*steps.lock().unwrap(), vec![vec![(3, 2)]]);
        assert!(matches!(kept_answer.blocking_recv(), Ok(Ok(_))));
        assert_eq!(stats.queued_tokens.load(Ordering::Relaxed), 0);
    }

    #[test]
    fn a_prompt_runs_only_what_the_prefix_cache_lacks_and_is_kept_when_it_has_run() {
        let (mut shard, steps) = Echo::new(true);
        shard.cached = 8;
        let retained = shard.retained.clone();
        // A new prompt of 10 tokens: 8 cached, 2 to run, in slices of 4.
        let (prompt, answer) = forward(1, tokens(10));
        // A prompt of 3 tokens: 2 cached, its last token runs.
        let (short, short_answer) = forward(2, tokens(3));
        let stats = run_jobs(shard, vec![prompt, short], 4);
        assert_eq!(*steps.lock().unwrap(), vec![vec![(1, 2), (2, 1)]]);
        let Forwarded {
            output: StageOutput::Logits(l),
            cached: 8,
        } = answer.counted()
        else {
            panic!("logits, 8 tokens cached");
        };
        assert_eq!(l, vec![9.0], "the logits at the prompt's last position");
        assert_eq!(short_answer.counted().cached, 2);
        assert_eq!(*retained.lock().unwrap(), vec![1, 2]);
        assert_eq!(stats.queued_tokens.load(Ordering::Relaxed), 0);
    }

    #[test]
    fn a_step_waits_for_the_decoding_sequences_its_head_sends_back_quickly() {
        // Three sequences decode on a stage whose passes take 100 ms; their
        // head sends each one's next token 0, 1 and 2 ms after its answer.
        // Starting a step on the first one back would split them for good
        // (1 alone, then 2 and 3 together, and so on).
        let (mut shard, steps) = Echo::new(true);
        shard.pass = Duration::from_millis(100);
        let (send, queue) = mpsc::channel();
        let stats = Arc::new(StageStats::default());
        let stage = {
            let stats = stats.clone();
            std::thread::spawn(move || {
                run(
                    Box::new(shard),
                    queue,
                    stats,
                    Arc::new(|_| {}),
                    Budget::default(),
                )
            })
        };
        let heads: Vec<_> = (0..3u64)
            .map(|seq| {
                let send = send.clone();
                std::thread::spawn(move || {
                    for token in 0..20 {
                        let input = if token == 0 { tokens(4) } else { tokens(1) };
                        let (job, answer) = forward(seq, input);
                        send.send(job).unwrap();
                        answer.blocking_recv().unwrap().unwrap();
                        std::thread::sleep(Duration::from_millis(seq));
                    }
                    send.send(Job::Release { seq }).unwrap();
                })
            })
            .collect();
        drop(send);
        for head in heads {
            head.join().unwrap();
        }
        stage.join().unwrap();
        let steps = steps.lock().unwrap();
        // Once the stage has seen a few rounds, its steps carry all three.
        let later = &steps[8..];
        let full = later.iter().filter(|s| s.len() == 3).count();
        assert!(
            full * 2 >= later.len(),
            "{full} of {} steps carried all three: {later:?}",
            later.len()
        );
    }

    #[test]
    fn prompt_slices_shrink_while_sequences_decode_on_a_slow_stage() {
        let budget = Budget {
            prefill_tokens: 512,
            decode_step: Duration::from_millis(200),
        };
        let cost = |fixed_ms: f64, row_ms: f64| {
            Some(PassCost {
                fixed: fixed_ms / 1e3,
                per_row: row_ms / 1e3,
            })
        };
        // Nothing decodes, or the cost is not known yet: the whole budget.
        assert_eq!(budget.prefill_room(0, cost(0.0, 36.0)), 512);
        assert_eq!(budget.prefill_room(3, None), 512);
        // 1 ms a row: 200 rows a step, 3 of them decode steps.
        assert_eq!(budget.prefill_room(3, cost(0.0, 1.0)), 197);
        // A pass's fixed 20 ms leave 180 rows.
        assert_eq!(budget.prefill_room(3, cost(20.0, 1.0)), 177);
        // Fast: capped by the budget.
        assert_eq!(budget.prefill_room(3, cost(0.0, 0.01)), 512);
        // 36 ms a row: 5 rows fit; prompts still move by MIN_SLICE.
        assert_eq!(budget.prefill_room(3, cost(0.0, 36.0)), MIN_SLICE);
        assert_eq!(budget.prefill_room(50, cost(0.0, 1.0)), 150);
        assert_eq!(budget.prefill_room(250, cost(0.0, 1.0)), MIN_SLICE);
        // A pass slower than a step on its own: still MIN_SLICE.
        assert_eq!(budget.prefill_room(3, cost(300.0, 1.0)), MIN_SLICE);
        // A budget below MIN_SLICE is kept.
        let tiny = Budget {
            prefill_tokens: 2,
            ..budget
        };
        assert_eq!(tiny.prefill_room(3, cost(0.0, 36.0)), 2);
    }
}
