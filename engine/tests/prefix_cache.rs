//! The prefix cache on the real test model (SmolLM2-135M-Instruct, GGUF
//! Q4_1): sequences that start from cached blocks give the same greedy
//! tokens as sequences that compute their whole prompt, also when they run
//! batched beside others, join at different steps and take their prompts in
//! slices; and the cache skips what it says it skips.

use shardplane_engine::chat::ChatMessage;
use shardplane_engine::gguf::GgufFile;
use shardplane_engine::pipeline::{EngineKind, TextModel, load_stage};
use shardplane_engine::{LoadOptions, SequenceId, Stage, StageInput, StageLayout, StageOutput};

const SYSTEM: &str = "You are a careful assistant for a team of software engineers. \
    Answer in plain English, briefly and precisely. When a question is about code, \
    name the language first, then give the answer in one or two sentences. Never \
    invent facts: when you do not know, say so. Prefer short words to long ones, \
    and do not repeat the question. Units are metric. Dates are written as year, \
    month and day. Lists have at most five items.";

fn stage(file: &GgufFile, engine: EngineKind, prefix_cache_bytes: usize) -> Box<dyn Stage> {
    let options = LoadOptions {
        prefix_cache_bytes,
        // MLX's quantized kernels are slow on a CPU; its BLAS path is not.
        dequantize: engine == EngineKind::Mlx,
        ..Default::default()
    };
    load_stage(file, StageLayout::whole(30), engine, &options).unwrap()
}

fn prompt(text: &TextModel, question: &str) -> Vec<u32> {
    text.chat_prompt(&[
        ChatMessage::new("system", SYSTEM),
        ChatMessage::new("user", question),
    ])
    .unwrap()
}

/// The greedy choice and its lead over the runner-up.
fn argmax(logits: &[f32]) -> (u32, f32) {
    let mut best = (0usize, f32::NEG_INFINITY);
    let mut second = f32::NEG_INFINITY;
    for (i, &l) in logits.iter().enumerate() {
        if l > best.1 {
            second = best.1;
            best = (i, l);
        } else if l > second {
            second = l;
        }
    }
    (best.0 as u32, best.1 - second)
}

/// A sequence driven step by step: its prompt still to run, its tokens.
struct Run {
    seq: SequenceId,
    start_step: usize,
    rest: Vec<u32>,
    out: Vec<u32>,
    reused: usize,
    /// Each token's lead over the runner-up.
    margins: Vec<f32>,
}

impl Run {
    /// Tokens before the first near-tie (a lead under 0.05): the ones any
    /// correct computation must choose alike.
    fn clear_tokens(&self) -> &[u32] {
        let k = self
            .margins
            .iter()
            .position(|&m| m < 0.05)
            .unwrap_or(self.out.len());
        &self.out[..k]
    }
}

/// Runs `prompts` (each joining at its step) together through `stage`:
/// every step carries the next `slice` prompt tokens of each sequence still
/// in its prompt and one token of each decoding one, until each has `n`
/// tokens. A joining sequence first takes what the prefix cache holds.
fn run_together(
    stage: &mut dyn Stage,
    prompts: &[(SequenceId, usize, Vec<u32>)],
    n: usize,
    slice: usize,
) -> Vec<Run> {
    let mut runs: Vec<Run> = prompts
        .iter()
        .map(|(seq, start_step, p)| Run {
            seq: *seq,
            start_step: *start_step,
            rest: p.clone(),
            out: Vec::new(),
            reused: 0,
            margins: Vec::new(),
        })
        .collect();
    for step in 0.. {
        let mut batch = Vec::new();
        let mut who = Vec::new();
        for (i, r) in runs.iter_mut().enumerate() {
            if step < r.start_step || r.out.len() == n {
                continue;
            }
            if step == r.start_step {
                r.reused = stage.reuse_prefix(r.seq, &r.rest);
                r.rest.drain(..r.reused);
            }
            let input = if r.rest.is_empty() {
                vec![*r.out.last().expect("a decoding sequence has a token")]
            } else {
                let k = slice.min(r.rest.len());
                r.rest.drain(..k).collect()
            };
            batch.push((r.seq, StageInput::Tokens(input)));
            who.push(i);
        }
        if batch.is_empty() {
            if runs.iter().all(|r| r.out.len() == n) {
                break;
            }
            continue;
        }
        let outs = stage.forward_batch(batch).unwrap();
        for (i, out) in who.into_iter().zip(outs) {
            let r = &mut runs[i];
            let StageOutput::Logits(logits) = out else {
                panic!("a whole model gives logits");
            };
            if r.rest.is_empty() {
                let (token, margin) = argmax(&logits);
                r.out.push(token);
                r.margins.push(margin);
            }
        }
    }
    for r in &runs {
        stage.release(r.seq);
    }
    runs
}

#[test]
fn cached_prefixes_give_the_same_greedy_tokens_as_whole_prompts_candle() {
    cached_prefixes_give_the_same_greedy_tokens_as_whole_prompts(EngineKind::Candle);
}

#[cfg(feature = "mlx")]
#[test]
fn cached_prefixes_give_the_same_greedy_tokens_as_whole_prompts_mlx() {
    cached_prefixes_give_the_same_greedy_tokens_as_whole_prompts(EngineKind::Mlx);
}

#[test]
fn a_small_cache_evicts_and_stays_within_its_budget_candle() {
    a_small_cache_evicts_and_stays_within_its_budget(EngineKind::Candle);
}

#[cfg(feature = "mlx")]
#[test]
fn a_small_cache_evicts_and_stays_within_its_budget_mlx() {
    a_small_cache_evicts_and_stays_within_its_budget(EngineKind::Mlx);
}

fn cached_prefixes_give_the_same_greedy_tokens_as_whole_prompts(engine: EngineKind) {
    let file = GgufFile::open(shardplane_testkit::test_model()).unwrap();
    let text = TextModel::from_gguf(&file).unwrap();
    let a = prompt(&text, "What is the capital of France?");
    let b = prompt(&text, "Which programming language uses Cargo?");
    let c = prompt(&text, "How many days are in a week?");
    let n = 12;

    // Each prompt alone, whole, on a stage without a cache: the reference.
    let mut plain = stage(&file, engine, 0);
    let reference: Vec<Run> = [&a, &b, &c]
        .iter()
        .enumerate()
        .map(|(i, p)| {
            run_together(
                &mut *plain,
                &[(i as u64 + 1, 0, (*p).clone())],
                n,
                usize::MAX,
            )
            .pop()
            .unwrap()
        })
        .collect();
    for r in &reference {
        assert_eq!(r.reused, 0, "no cache, nothing reused");
        assert!(
            r.clear_tokens().len() >= 6,
            "a near-tie early in prompt {}'s reference (leads {:?}): pick other prompts",
            r.seq,
            r.margins
        );
    }
    assert_eq!(plain.prefix_cache().hit_tokens, 0);

    let mut cached = stage(&file, engine, 256 << 20);
    let block = shardplane_engine::prefix::DEFAULT_BLOCK_TOKENS;
    // A first, alone: nothing cached yet; its prompt and answer are kept.
    let first = run_together(&mut *cached, &[(1, 0, a.clone())], n, 40)
        .pop()
        .unwrap();
    assert_eq!(first.reused, 0);
    assert!(first.out.starts_with(reference[0].clear_tokens()));
    let kept = cached.prefix_cache();
    let ran = a.len() + n - 1;
    assert_eq!(
        kept.blocks as usize,
        ran / block + usize::from(!(ran - 1).is_multiple_of(block)),
        "every whole block of the prompt and the answer it ran, and the tail after them \
         (all but the last token)"
    );
    assert!(kept.bytes > 0 && kept.bytes <= kept.budget_bytes);

    // Then B, A again and C together, joining at steps 0, 1 and 3, prompts
    // in slices of 40 tokens, decoding beside each other.
    let runs = run_together(
        &mut *cached,
        &[(2, 0, b.clone()), (3, 1, a.clone()), (4, 3, c.clone())],
        n,
        40,
    );
    let shared = a.iter().zip(&b).take_while(|(x, y)| x == y).count();
    assert!(shared > 2 * block, "the prompts share the system prompt");
    // B and C share A's whole blocks of the system prompt; A shares all its
    // whole blocks but the last token.
    assert_eq!(runs[0].reused, shared / block * block);
    assert_eq!(runs[1].reused, (a.len() - 1) / block * block);
    assert_eq!(runs[2].reused, shared / block * block);
    for (run, reference) in runs
        .iter()
        .zip([&reference[1], &reference[0], &reference[2]])
    {
        assert!(
            run.out.starts_with(reference.clear_tokens()),
            "sequence {}: {:?} where the whole prompt gave {:?}",
            run.seq,
            run.out,
            reference.out
        );
    }
    let stats = cached.prefix_cache();
    assert_eq!(
        stats.hit_tokens as usize,
        runs.iter().map(|r| r.reused).sum::<usize>()
    );
    assert_eq!(
        stats.lookup_tokens as usize,
        a.len() * 2 + b.len() + c.len()
    );
    assert_eq!(cached.sequences(), 0, "released sequences hold no KV");
    assert!(cached.kv_cache_bytes() == 0);

    // A's prompt and answer again, as one prompt (what the next turn of a
    // conversation starts with): all but its last token come from the
    // cache, the tail after the last whole block included, and it goes on
    // as the whole prompt does.
    let again: Vec<u32> = a.iter().chain(&first.out[..n - 1]).copied().collect();
    let whole = run_together(&mut *plain, &[(9, 0, again.clone())], n, usize::MAX)
        .pop()
        .unwrap();
    let tail = run_together(&mut *cached, &[(10, 0, again.clone())], n, 40)
        .pop()
        .unwrap();
    assert_eq!(tail.reused, again.len() - 1);
    assert!(
        tail.out.starts_with(whole.clear_tokens()),
        "{:?} where the whole prompt gave {:?}",
        tail.out,
        whole.out
    );
}

fn a_small_cache_evicts_and_stays_within_its_budget(engine: EngineKind) {
    let file = GgufFile::open(shardplane_testkit::test_model()).unwrap();
    let text = TextModel::from_gguf(&file).unwrap();
    // One block of this model: 30 layers × (K + V) × 3 KV heads × 32 tokens
    // × 64 dims × 2 bytes on candle (its cache holds f16), 4 on MLX.
    let bytes = match engine {
        EngineKind::Candle => 2,
        _ => 4,
    };
    let block_bytes = 30 * 2 * 3 * 32 * 64 * bytes;
    let mut s = stage(&file, engine, 2 * block_bytes);
    let a = prompt(&text, "What is the capital of France?");
    let b = prompt(&text, "Name a prime number.");
    assert!(
        (a.len() + 1) / 32 > 2,
        "the prompt has more blocks than fit"
    );
    run_together(&mut *s, &[(1, 0, a.clone())], 2, usize::MAX);
    let stats = s.prefix_cache();
    assert_eq!((stats.blocks, stats.bytes), (2, 2 * block_bytes as u64));
    assert!(stats.evicted_blocks > 0, "{stats:?}");
    // The head of the chain stayed: B reuses its 2 blocks.
    let r = run_together(&mut *s, &[(2, 0, b)], 2, usize::MAX)
        .pop()
        .unwrap();
    assert_eq!(r.reused, 2 * 32);
    assert!(s.prefix_cache().bytes <= 2 * block_bytes as u64);
}

/// The last logits of `prompt` run through `stage` as sequence `seq` in
/// the pieces that `cuts` (positions) make, after what the prefix cache
/// gives; the sequence is released (and so kept in the cache) afterwards.
/// Returns the logits and the tokens reused.
fn last_logits(
    stage: &mut dyn Stage,
    seq: SequenceId,
    prompt: &[u32],
    cuts: &[usize],
) -> (Vec<f32>, usize) {
    let reused = stage.reuse_prefix(seq, prompt);
    let mut at = reused;
    let mut logits = Vec::new();
    for end in cuts
        .iter()
        .copied()
        .filter(|&c| c > reused)
        .chain([prompt.len()])
    {
        if end <= at {
            continue;
        }
        let out = stage
            .forward_batch(vec![(seq, StageInput::Tokens(prompt[at..end].to_vec()))])
            .unwrap();
        let StageOutput::Logits(l) = out.into_iter().next().unwrap() else {
            panic!("a whole model gives logits");
        };
        logits = l;
        at = end;
    }
    stage.release(seq);
    (logits, reused)
}

/// The logits' bits, to compare exactly.
fn bits(logits: &[f32]) -> Vec<u32> {
    logits.iter().map(|x| x.to_bits()).collect()
}

/// On candle a row's result depends only on its query and the keys it
/// sees, so a prompt gives the same logits to the bit whole, cut anywhere
/// into two pieces or three, and after the prefix cache's blocks and tail:
/// seeded sampling draws the same tokens with the cache as without it.
#[test]
fn candle_logits_are_bit_identical_however_a_prompt_is_cut_or_cached() {
    let file = GgufFile::open(shardplane_testkit::test_model()).unwrap();
    let text = TextModel::from_gguf(&file).unwrap();
    let a = prompt(&text, "What is the capital of France?");
    let n = a.len();
    assert!(n > 40, "the prompt spans more than a block");
    let mut plain = stage(&file, EngineKind::Candle, 0);
    let (whole, _) = last_logits(&mut *plain, 1, &a, &[]);
    let mut cuts: Vec<Vec<usize>> = (1..n).map(|c| vec![c]).collect();
    cuts.extend([vec![7, 19], vec![5, n - 2], vec![16, 32, 48]]);
    for (i, cut) in cuts.iter().enumerate() {
        let (logits, _) = last_logits(&mut *plain, 10 + i as u64, &a, cut);
        assert!(
            bits(&logits) == bits(&whole),
            "prompt of {n} cut at {cut:?}"
        );
    }

    let mut cached = stage(&file, EngineKind::Candle, 64 << 20);
    let (first, reused) = last_logits(&mut *cached, 1, &a, &[]);
    assert_eq!((bits(&first) == bits(&whole), reused), (true, 0));
    // The same prompt again: all of it but its last token from the cache.
    let (again, reused) = last_logits(&mut *cached, 2, &a, &[]);
    assert_eq!(reused, n - 1);
    assert!(bits(&again) == bits(&whole), "the cached prompt's logits");
    // A longer prompt that carries on from it, against the same run whole.
    let longer: Vec<u32> = a.iter().chain(&a[1..9]).copied().collect();
    let (want, _) = last_logits(&mut *plain, 3, &longer, &[]);
    let (got, reused) = last_logits(&mut *cached, 3, &longer, &[]);
    assert_eq!(reused, n - 1);
    assert!(
        bits(&got) == bits(&want),
        "a prompt carrying on from a cached one"
    );
}

#[test]
fn a_pipeline_s_stages_take_the_same_prefix_from_their_own_caches_candle() {
    a_pipeline_s_stages_take_the_same_prefix_from_their_own_caches(EngineKind::Candle);
}

#[cfg(feature = "mlx")]
#[test]
fn a_pipeline_s_stages_take_the_same_prefix_from_their_own_caches_mlx() {
    a_pipeline_s_stages_take_the_same_prefix_from_their_own_caches(EngineKind::Mlx);
}

/// Two stages of a pipeline (layers 0–13 and 13–30), each with its own
/// prefix cache, the first telling the second its rows' tokens.
struct Split {
    head: Box<dyn Stage>,
    tail: Box<dyn Stage>,
}

impl Split {
    fn load(file: &GgufFile, engine: EngineKind) -> Self {
        let options = LoadOptions {
            prefix_cache_bytes: 256 << 20,
            dequantize: engine == EngineKind::Mlx,
            ..Default::default()
        };
        let part = |layers| {
            let layout = StageLayout::new(layers, 30).unwrap();
            load_stage(file, layout, engine, &options).unwrap()
        };
        Split {
            head: part(0..13),
            tail: part(13..30),
        }
    }

    /// `prompt` as sequence `seq`, greedily for `n` tokens, in slices of
    /// 40 rows, as an agent runs it: the head takes what its cache holds,
    /// the tail exactly as much from its own (the test fails otherwise);
    /// rows go on with their token ids unless `tell` is false. Returns the
    /// run, its tokens reused by both stages.
    fn run(&mut self, seq: SequenceId, prompt: &[u32], n: usize, tell: bool) -> Run {
        let reused = self.head.reuse_prefix(seq, prompt);
        if reused > 0 {
            let tail = self.tail.reuse_prefix(seq, &prompt[..=reused]);
            assert_eq!(tail, reused, "the tail holds what the head took");
        }
        let mut run = Run {
            seq,
            start_step: 0,
            rest: prompt[reused..].to_vec(),
            out: Vec::new(),
            reused,
            margins: Vec::new(),
        };
        while run.out.len() < n {
            let input: Vec<u32> = match run.rest.is_empty() {
                true => vec![*run.out.last().expect("a token")],
                false => run.rest.drain(..40.min(run.rest.len())).collect(),
            };
            let out = self
                .head
                .forward_batch(vec![(seq, StageInput::Tokens(input.clone()))])
                .unwrap();
            let Some(StageOutput::Hidden(mut rows)) = out.into_iter().next() else {
                panic!("a first stage gives hidden states");
            };
            if tell {
                rows = rows.with_ids(input).unwrap();
            }
            let out = self
                .tail
                .forward_batch(vec![(seq, StageInput::Hidden(rows))])
                .unwrap();
            let Some(StageOutput::Logits(logits)) = out.into_iter().next() else {
                panic!("a last stage gives logits");
            };
            if run.rest.is_empty() {
                let (token, margin) = argmax(&logits);
                run.out.push(token);
                run.margins.push(margin);
            }
        }
        self.head.release(seq);
        self.tail.release(seq);
        run
    }
}

fn a_pipeline_s_stages_take_the_same_prefix_from_their_own_caches(engine: EngineKind) {
    let file = GgufFile::open(shardplane_testkit::test_model()).unwrap();
    let text = TextModel::from_gguf(&file).unwrap();
    let a = prompt(&text, "What is the capital of France?");
    let b = prompt(&text, "Which programming language uses Cargo?");
    let n = 12;
    let mut plain = stage(&file, engine, 0);
    let mut reference = |seq, p: &[u32]| {
        run_together(&mut *plain, &[(seq, 0, p.to_vec())], n, usize::MAX)
            .pop()
            .unwrap()
    };
    let (want_a, want_b) = (reference(1, &a), reference(2, &b));
    for want in [&want_a, &want_b] {
        assert!(
            want.clear_tokens().len() >= 6,
            "a near-tie early in prompt {}'s reference (leads {:?}): pick other prompts",
            want.seq,
            want.margins
        );
    }

    let mut split = Split::load(&file, engine);
    let first = split.run(1, &a, n, true);
    assert_eq!(first.reused, 0);
    assert!(first.out.starts_with(want_a.clear_tokens()));
    let (head, tail) = (split.head.prefix_cache(), split.tail.prefix_cache());
    assert_eq!(head.blocks, tail.blocks, "both kept the same blocks");
    assert!(tail.bytes > head.bytes, "of more layers on the tail");

    // B shares A's whole blocks of the system prompt, on both stages.
    let block = shardplane_engine::prefix::DEFAULT_BLOCK_TOKENS;
    let shared = a.iter().zip(&b).take_while(|(x, y)| x == y).count();
    let second = split.run(2, &b, n, true);
    assert_eq!(second.reused, shared / block * block);
    assert!(
        second.out.starts_with(want_b.clear_tokens()),
        "{:?} where the whole prompt gave {:?}",
        second.out,
        want_b.out
    );

    // A's prompt and answer again (the next turn): all but its last token.
    let again: Vec<u32> = a.iter().chain(&first.out[..n - 1]).copied().collect();
    let want = reference(3, &again);
    assert!(want.clear_tokens().len() >= 6, "leads {:?}", want.margins);
    let turn = split.run(3, &again, n, true);
    assert_eq!(turn.reused, again.len() - 1);
    assert!(
        turn.out.starts_with(want.clear_tokens()),
        "{:?} where the whole prompt gave {:?}",
        turn.out,
        want.out
    );
    assert_eq!(
        split.head.prefix_cache().hit_tokens,
        split.tail.prefix_cache().hit_tokens
    );

    // Rows whose tokens are not told: the tail keeps no blocks of them.
    let c = prompt(&text, "How many days are in a week?");
    let before = (
        split.head.prefix_cache().inserted_blocks,
        split.tail.prefix_cache().inserted_blocks,
    );
    split.run(4, &c, 2, false);
    assert!(split.head.prefix_cache().inserted_blocks > before.0);
    assert_eq!(split.tail.prefix_cache().inserted_blocks, before.1);
}
