//! The step loop's tests, on the echoing test stage.

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
    let budget = Budget {
        prefill_tokens: budget,
        ..Budget::default()
    };
    run_jobs_observed(shard, jobs, budget, Arc::new(|_| {}))
}

/// [`run_jobs`], telling `observe` of every turn.
fn run_jobs_observed(
    shard: Echo,
    jobs: Vec<Job>,
    budget: Budget,
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
    run(Box::new(shard), queue, stats.clone(), observe, budget);
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
    let budget = Budget {
        prefill_tokens: 4,
        ..Budget::default()
    };
    let stats = run_jobs_observed(
        shard,
        vec![prompt, decode],
        budget,
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
fn a_pipelines_head_runs_its_decoding_sequences_in_one_group_per_stage() {
    let (mut shard, steps) = Echo::new(false);
    // Five sequences decode; a prompt arrives with their next tokens.
    for seq in 1..=5 {
        shard.forward(seq, tokens(3)).unwrap();
    }
    steps.lock().unwrap().clear();
    let mut jobs = Vec::new();
    let mut answers = Vec::new();
    for seq in 1..=5 {
        let (job, answer) = forward(seq, tokens(1));
        jobs.push(job);
        answers.push(answer);
    }
    let (prompt, prompt_answer) = forward(9, tokens(4));
    jobs.push(prompt);
    // The head of a 2-stage pipeline: groups of ⌈5 / 2⌉ = 3, oldest first;
    // the prompt rides with the first step.
    let budget = Budget {
        decode_groups: 2,
        ..Budget::default()
    };
    run_jobs_observed(shard, jobs, budget, Arc::new(|_| {}));
    assert_eq!(
        *steps.lock().unwrap(),
        vec![
            vec![(1, 1), (2, 1), (3, 1), (9, 4)],
            // Four are out by now (three decodes and the prompt): ⌈(2 back
            // + 4 out) / 2⌉ = 3 may go.
            vec![(4, 1), (5, 1)],
        ]
    );
    for answer in answers {
        let Ok(Ok(StageOutput::Hidden(d))) = answer.blocking_recv() else {
            panic!("a decode step's row");
        };
        assert_eq!(d.data, vec![3.0]);
    }
    assert!(matches!(prompt_answer.blocking_recv(), Ok(Ok(_))));
    // Groups of whole sequences, never none: a lone sequence still runs,
    // and one group (not a pipeline's head) takes every decode.
    assert_eq!(budget.decode_rows(1), 1);
    assert_eq!(budget.decode_rows(0), 1);
    assert_eq!(budget.decode_rows(6), 3);
    assert_eq!(Budget::default().decode_rows(6), 6);
    let three = Budget {
        decode_groups: 3,
        ..budget
    };
    assert_eq!(three.decode_rows(8), 3);
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
fn prompts_that_begin_like_a_running_one_wait_and_run_only_their_own_part() {
    let (mut shard, steps) = Echo::new(true);
    shard.remember = true;
    let retained = shard.retained.clone();
    // Three prompts of 100 tokens arrive together; they share the first
    // 80. A fourth shares nothing.
    let prompt = |own: u32| {
        StageInput::Tokens(
            (0..100)
                .map(|i| if i < 80 { i } else { own * 1000 + i })
                .collect(),
        )
    };
    let (a, a_answer) = forward(1, prompt(1));
    let (b, b_answer) = forward(2, prompt(2));
    let (c, c_answer) = forward(3, prompt(3));
    let (d, d_answer) = forward(4, StageInput::Tokens((5_000..5_050).collect()));
    let stats = run_jobs(shard, vec![a, b, c, d], 512);
    // The first runs whole (beside the unrelated one); the other two
    // wait for it, then run their last 20 tokens.
    assert_eq!(
        *steps.lock().unwrap(),
        vec![vec![(1, 100), (4, 50)], vec![(2, 20), (3, 20)]]
    );
    assert_eq!(a_answer.counted().cached, 0);
    assert_eq!(b_answer.counted().cached, 80);
    assert_eq!(c_answer.counted().cached, 80);
    assert_eq!(d_answer.counted().cached, 0);
    assert_eq!(*retained.lock().unwrap(), vec![1, 4, 2, 3]);
    assert_eq!(stats.queued_tokens.load(Ordering::Relaxed), 0);
    // Each counted once, the waiting ones when they were taken again.
    assert_eq!(stats.looks(), (350, 160));
}

#[test]
fn a_parked_prompt_whose_leader_is_released_runs_whole() {
    let (mut shard, steps) = Echo::new(true);
    shard.remember = true;
    let shared: Vec<u32> = (0..100).collect();
    let (a, _a_answer) = forward(1, StageInput::Tokens(shared.clone()));
    let (b, b_answer) = forward(2, StageInput::Tokens(shared));
    let stats = run_jobs(shard, vec![a, b, Job::Release { seq: 1 }], 512);
    assert_eq!(*steps.lock().unwrap(), vec![vec![(2, 100)]]);
    assert_eq!(b_answer.counted().cached, 0);
    assert_eq!(stats.queued_tokens.load(Ordering::Relaxed), 0);
    // Each counted when taken: the leader too, though it left before its
    // first pass.
    assert_eq!(stats.looks(), (200, 0));
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
            let stats = stats.clone();
            std::thread::spawn(move || {
                // What the stage counts as decoding while this one is out.
                let mut seen = Vec::new();
                for token in 0..20 {
                    let input = if token == 0 { tokens(4) } else { tokens(1) };
                    let (job, answer) = forward(seq, input);
                    send.send(job).unwrap();
                    answer.blocking_recv().unwrap().unwrap();
                    if token > 0 {
                        seen.push(stats.decoding.load(Ordering::Relaxed));
                    }
                    std::thread::sleep(Duration::from_millis(seq));
                }
                send.send(Job::Release { seq }).unwrap();
                seen
            })
        })
        .collect();
    drop(send);
    let mut seen = Vec::new();
    for head in heads {
        seen.extend(head.join().unwrap());
    }
    stage.join().unwrap();
    // The decoding sequences count whether back or out, never twice; none
    // once all are released.
    assert!(seen.iter().all(|&n| n <= 3), "{seen:?}");
    let three = seen.iter().filter(|&&n| n == 3).count();
    assert!(three * 2 >= seen.len(), "{seen:?}");
    assert_eq!(stats.decoding.load(Ordering::Relaxed), 0);
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
        decode_groups: 1,
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
    // A 2-stage pipeline's head runs two steps per token: 100 ms each.
    let head = Budget {
        decode_groups: 2,
        ..budget
    };
    assert_eq!(head.prefill_room(3, cost(0.0, 1.0)), 97);
    assert_eq!(head.prefill_room(0, cost(0.0, 1.0)), 512, "nothing decodes");
    // A budget below MIN_SLICE is kept.
    let tiny = Budget {
        prefill_tokens: 2,
        ..budget
    };
    assert_eq!(tiny.prefill_room(3, cost(0.0, 36.0)), 2);
}

#[test]
fn a_retired_sequence_s_later_steps_are_refused_not_started_again() {
    let (mut shard, steps) = Echo::new(false);
    // Sequence 1 ran its prompt; then another took its place, and a step
    // of it still on its way comes after.
    shard.forward(1, tokens(3)).unwrap();
    steps.lock().unwrap().clear();
    let (stray, stray_answer) = forward(1, tokens(1));
    let (other, other_answer) = forward(2, tokens(2));
    let stats = run_jobs(shard, vec![Job::Retire { seq: 1 }, stray, other], 512);
    let refused = stray_answer.blocking_recv().unwrap().err().unwrap();
    assert!(refused.to_string().contains("replaced"), "{refused}");
    assert!(other_answer.blocking_recv().unwrap().is_ok());
    assert_eq!(*steps.lock().unwrap(), vec![vec![(2, 2)]]);
    assert_eq!(stats.queued_tokens.load(Ordering::Relaxed), 0);
}
