//! `Generate` on a head stage, in process and in seconds: the prompt goes
//! down in chunks and only the last asks for a token, the tokens that come
//! back become text and `Finished`, an output grammar's token sets travel
//! with each sampling step and end the answer once complete, and the
//! sequence is freed afterwards. The head runs the echoing test stage with
//! the test model's tokenizer; the next stage is a scripted fake that
//! answers each sampling step with the next token of its script. Real agents
//! run the same path in `cli/tests/data_plane/`.

use std::sync::{Arc, Mutex};

use shardplane_dataplane as dp;
use shardplane_engine::constraint::TokenMask;
use shardplane_engine::gguf::GgufFile;
use shardplane_engine::pipeline::TextModel;
use shardplane_testkit::data_plane::FakeDataPlane;
use tonic::Status;

use super::tests::{NS, sequences_become, serve, shard, token};
use crate::shards::ServedStage;
use crate::stage::StageWorker;
use crate::test_stage::Echo;

/// `<|im_end|>`, a stop token of the test model.
const IM_END: u32 = 2;

/// What the fake last stage saw of one step: rows, whether it sampled, and
/// the allowed set's wire form.
type Seen = Arc<Mutex<Vec<(u32, bool, Vec<u8>)>>>;

/// A fake last stage answering its sampling steps with `script`, then with
/// `<|im_end|>`; a step whose allowed set refuses the scripted token fails.
async fn scripted_last(script: Vec<u32>) -> (String, Seen) {
    let seen = Seen::default();
    let log = seen.clone();
    let next = Arc::new(Mutex::new(script.into_iter().peekable()));
    let endpoint = FakeDataPlane::stepping(move |_, step| {
        let rows = step.hidden.as_ref().map_or(0, |h| h.tokens);
        log.lock()
            .unwrap()
            .push((rows, step.sample, step.allowed.clone()));
        if !step.sample {
            return Ok(dp::ForwardResponse::default());
        }
        let mask =
            (!step.allowed.is_empty()).then(|| TokenMask::from_bytes(&step.allowed).unwrap());
        let mut script = next.lock().unwrap();
        let token = match &mask {
            // One token allowed: a sampler gives it, and the script waits.
            Some(m) if m.count() == 1 && !script.peek().is_some_and(|&t| m.allows(t)) => {
                (0..).find(|&t| m.allows(t)).unwrap()
            }
            _ => script.next().unwrap_or(IM_END),
        };
        if mask.is_some_and(|m| !m.allows(token)) {
            return Err(Status::internal(format!("token {token} is not allowed")));
        }
        Ok(dp::ForwardResponse {
            token,
            sampled: true,
            // A made-up distribution: the token, then the one after it.
            logprobs: Some(dp::SampledLogprobs {
                logprob: -0.5,
                top_tokens: vec![token, token + 1],
                top_logprobs: vec![-0.5, -1.5],
            }),
        })
    })
    .serve(token())
    .await;
    (endpoint, seen)
}

fn text_model() -> Arc<TextModel> {
    let file = GgufFile::open(shardplane_testkit::test_model()).expect("the test model");
    Arc::new(TextModel::from_gguf(&file).expect("its tokenizer"))
}

/// The head stage `d-0-0` served in process, its next stage at `next`.
async fn head(next: &str, text: Arc<TextModel>) -> (dp::Client, StageWorker, tempfile::TempDir) {
    head_on(next, text, Echo::new(false).0).await
}

/// [`head`], running `echo`.
async fn head_on(
    next: &str,
    text: Arc<TextModel>,
    echo: Echo,
) -> (dp::Client, StageWorker, tempfile::TempDir) {
    let worker = crate::test_stage::quiet_worker("d-0-0", Box::new(echo));
    let me = shard(0, None);
    let stage = ServedStage {
        namespace: NS.into(),
        name: "d-0-0".into(),
        spec: me.spec.clone(),
        worker: worker.clone(),
        text: Some(text),
    };
    let (client, dir) = serve(stage, vec![me, shard(1, Some(next))]).await;
    (client, worker, dir)
}

pub(super) fn request(tokens: Vec<u32>, max_tokens: u32) -> dp::GenerateRequest {
    dp::GenerateRequest {
        shard: Some(dp::ShardRef {
            namespace: NS.into(),
            name: "d-0-0".into(),
        }),
        input: Some(dp::generate_request::Input::Tokens(dp::TokenIds {
            ids: tokens,
        })),
        sampling: Some(dp::Sampling {
            max_tokens,
            ..Default::default()
        }),
        resume: None,
        grammar: None,
        tools: None,
    }
}

/// The text of a `Generate` stream, its tokens and its `Finished`.
pub(super) async fn collect(
    client: &mut dp::Client,
    request: dp::GenerateRequest,
) -> Result<(String, Vec<u32>, dp::Finished), Status> {
    use dp::generate_response::Event;
    let mut stream = client.generate(request).await?.into_inner();
    let (mut text, mut tokens) = (String::new(), Vec::new());
    while let Some(event) = stream.message().await? {
        match event.event {
            Some(Event::Delta(d)) => {
                text.push_str(&d.text);
                tokens.extend(d.tokens);
            }
            Some(Event::Finished(f)) => return Ok((text, tokens, f)),
            _ => {}
        }
    }
    Err(Status::internal("the stream ended without Finished"))
}

#[tokio::test]
async fn a_long_prompt_goes_down_in_chunks_and_the_tokens_come_back_as_text() {
    let text = text_model();
    let script = text.tokenizer.encode(" blue sky", false).unwrap();
    let (next, seen) = scripted_last(script.clone()).await;
    let (mut client, worker, _dir) = head(&next, text).await;
    let (answer, tokens, finished) = collect(&mut client, request(vec![100; 1100], 2))
        .await
        .unwrap();
    assert_eq!(answer, " blue sky");
    assert_eq!(tokens, script);
    assert_eq!(
        (
            finished.reason,
            finished.prompt_tokens,
            finished.completion_tokens
        ),
        (dp::FinishReason::Length as i32, 1100, 2)
    );
    // 512 + 512 + 76 rows, only the last chunk sampling; then one row.
    let steps: Vec<(u32, bool)> = seen.lock().unwrap().iter().map(|s| (s.0, s.1)).collect();
    assert_eq!(
        steps,
        vec![(512, false), (512, false), (76, true), (1, true)]
    );
    assert!(seen.lock().unwrap().iter().all(|s| s.2.is_empty()));
    sequences_become(&worker, 0).await;
}

#[tokio::test]
async fn an_output_grammar_sends_the_allowed_tokens_with_each_step_and_ends_when_complete() {
    let text = text_model();
    let script = text.tokenizer.encode(r#"{"a": 1}"#, false).unwrap();
    let (next, seen) = scripted_last(script.clone()).await;
    let (mut client, worker, _dir) = head(&next, text.clone()).await;
    let json = dp::OutputGrammar {
        kind: Some(dp::output_grammar::Kind::JsonObject(true)),
    };
    let (answer, _, finished) = collect(
        &mut client,
        dp::GenerateRequest {
            grammar: Some(json.clone()),
            ..request(text.tokenizer.encode("Hi", false).unwrap(), 50)
        },
    )
    .await
    .unwrap();
    assert_eq!(answer, r#"{"a": 1}"#);
    assert_eq!(finished.reason, dp::FinishReason::Stop as i32);
    let sets: Vec<TokenMask> = seen
        .lock()
        .unwrap()
        .iter()
        .map(|s| TokenMask::from_bytes(&s.2).unwrap())
        .collect();
    assert!(sets.len() >= script.len(), "a set with every sampling step");
    // The first token must open an object: `{` may come, a letter not.
    let letter = text.tokenizer.encode("x", false).unwrap()[0];
    assert!(sets[0].allows(script[0]) && !sets[0].allows(letter));
    assert!(sets[0].count() < text.tokenizer.vocab_size() / 2);
    sequences_become(&worker, 0).await;

    // A script that breaks the grammar is caught by the set it was given.
    let bad = text.tokenizer.encode("hello", false).unwrap();
    let (next, _) = scripted_last(bad).await;
    let (mut client, _worker, _dir) = head(&next, text.clone()).await;
    let e = collect(
        &mut client,
        dp::GenerateRequest {
            grammar: Some(json),
            ..request(vec![100], 5)
        },
    )
    .await
    .unwrap_err();
    assert!(e.message().contains("not allowed"), "{e:?}");

    // A grammar that does not compile is the caller's error.
    let (next, _) = scripted_last(Vec::new()).await;
    let (mut client, _worker, _dir) = head(&next, text).await;
    let e = collect(
        &mut client,
        dp::GenerateRequest {
            grammar: Some(dp::OutputGrammar {
                kind: Some(dp::output_grammar::Kind::JsonSchema("{\"type\": 7}".into())),
            }),
            ..request(vec![100], 5)
        },
    )
    .await
    .unwrap_err();
    assert_eq!(e.code(), tonic::Code::InvalidArgument, "{e:?}");
}

#[tokio::test]
async fn tools_are_offered_and_a_call_comes_back_as_a_call_not_text() {
    let text = text_model();
    let written = "<tool_call>\n{\"name\": \"now\", \"arguments\": {}}\n</tool_call>";
    let (next, seen) = scripted_last(text.tokenizer.encode(written, false).unwrap()).await;
    let (mut client, worker, _dir) = head(&next, text).await;
    let chat = dp::generate_request::Input::Chat(dp::Conversation {
        messages: vec![dp::ChatMessage {
            role: "user".into(),
            content: "What time is it?".into(),
            ..Default::default()
        }],
        ..Default::default()
    });
    let tools = dp::ToolSet {
        tools: vec![dp::Tool {
            name: "now".into(),
            description: "The time.".into(),
            parameters: String::new(),
        }],
        choice: dp::ToolChoice::Required as i32,
        function: String::new(),
        parallel: false,
    };
    use dp::generate_response::Event;
    let mut stream = client
        .generate(dp::GenerateRequest {
            input: Some(chat),
            tools: Some(tools),
            ..request(Vec::new(), 60)
        })
        .await
        .unwrap()
        .into_inner();
    let (mut answer, mut calls, mut finished) = (String::new(), Vec::new(), None);
    while let Some(event) = stream.message().await.unwrap() {
        match event.event {
            Some(Event::Delta(d)) => {
                answer.push_str(&d.text);
                calls.extend(d.tool_calls);
            }
            Some(Event::Finished(f)) => finished = Some(f),
            _ => {}
        }
    }
    assert_eq!(answer, "", "a call's text is not given as text");
    assert_eq!(calls.len(), 1);
    assert_eq!(
        (calls[0].name.as_str(), calls[0].arguments.as_str()),
        ("now", "{}")
    );
    assert!(calls[0].id.starts_with("call_"));
    assert_eq!(finished.unwrap().reason, dp::FinishReason::ToolCalls as i32);
    // Every sampling step carried the grammar's set.
    assert!(
        seen.lock()
            .unwrap()
            .iter()
            .filter(|s| s.1)
            .all(|s| !s.2.is_empty())
    );
    sequences_become(&worker, 0).await;
}

#[tokio::test]
async fn the_last_stage_s_log_probabilities_come_back_with_each_token_s_text() {
    use dp::generate_response::Event;
    let text = text_model();
    let script = text.tokenizer.encode(" blue sky", false).unwrap();
    let (next, _) = scripted_last(script.clone()).await;
    let (mut client, worker, _dir) = head(&next, text.clone()).await;
    let mut req = request(vec![100; 3], 2);
    req.sampling.as_mut().unwrap().logprobs = Some(1);
    let mut stream = client.generate(req).await.unwrap().into_inner();
    let mut got = Vec::new();
    while let Some(event) = stream.message().await.unwrap() {
        if let Some(Event::Delta(d)) = event.event {
            assert_eq!(d.logprobs.len(), d.tokens.len(), "one per token");
            got.extend(d.logprobs);
        }
    }
    let words: Vec<(String, f32, String)> = got
        .iter()
        .map(|l| {
            let chosen = l.chosen.clone().unwrap();
            (chosen.token, chosen.logprob, l.top[1].token.clone())
        })
        .collect();
    let after = |t: u32| text.tokenizer.decode(&[t + 1], false).unwrap();
    assert_eq!(
        words,
        [
            (" blue".to_string(), -0.5, after(script[0])),
            (" sky".to_string(), -0.5, after(script[1])),
        ]
    );
    sequences_become(&worker, 0).await;
}

#[tokio::test]
async fn a_chat_s_reasoning_is_told_from_its_text() {
    use dp::generate_response::Event;
    let text = text_model();
    let script = text
        .tokenizer
        .encode("<think>The user greets.</think>\n\nHello!", false)
        .unwrap();
    let (next, _) = scripted_last(script.clone()).await;
    let (mut client, worker, _dir) = head(&next, text.clone()).await;
    let chat = dp::generate_request::Input::Chat(dp::Conversation {
        messages: vec![dp::ChatMessage {
            role: "user".into(),
            content: "Hi".into(),
            ..Default::default()
        }],
        ..Default::default()
    });
    let answer = |input| {
        let mut req = request(Vec::new(), script.len() as u32 + 1);
        req.input = Some(input);
        req
    };
    let read = |mut stream: tonic::Streaming<dp::GenerateResponse>| async move {
        let (mut reasoning, mut text) = (String::new(), String::new());
        while let Some(event) = stream.message().await.unwrap() {
            if let Some(Event::Delta(d)) = event.event {
                reasoning.push_str(&d.reasoning);
                text.push_str(&d.text);
            }
        }
        (reasoning, text)
    };
    let stream = client.generate(answer(chat)).await.unwrap().into_inner();
    assert_eq!(
        read(stream).await,
        ("The user greets.".to_string(), "Hello!".to_string())
    );
    sequences_become(&worker, 0).await;
    // A raw prompt's answer is text as written.
    let (next, _) = scripted_last(script.clone()).await;
    let (mut client, _worker, _dir) = head(&next, text.clone()).await;
    let raw = dp::generate_request::Input::Prompt("Hi".into());
    let stream = client.generate(answer(raw)).await.unwrap().into_inner();
    assert_eq!(
        read(stream).await,
        (
            String::new(),
            "<think>The user greets.</think>\n\nHello!".to_string()
        )
    );
}

#[tokio::test]
async fn a_reasoning_budget_closes_the_reasoning_and_the_answer_follows() {
    use dp::generate_response::Event;
    let text = text_model();
    let script = text
        .tokenizer
        .encode(
            "<think>one two three four five six</think>\n\nseven eight",
            false,
        )
        .unwrap();
    let (next, seen) = scripted_last(script.clone()).await;
    let (mut client, worker, _dir) = head(&next, text.clone()).await;
    let mut req = request(Vec::new(), 40);
    req.input = Some(dp::generate_request::Input::Chat(dp::Conversation {
        messages: vec![dp::ChatMessage {
            role: "user".into(),
            content: "Count.".into(),
            ..Default::default()
        }],
        thinking: Some(true),
        thinking_budget: 3,
        ..Default::default()
    }));
    let mut stream = client.generate(req).await.unwrap().into_inner();
    let (mut reasoning, mut answer) = (String::new(), String::new());
    while let Some(event) = stream.message().await.unwrap() {
        if let Some(Event::Delta(d)) = event.event {
            reasoning.push_str(&d.reasoning);
            answer.push_str(&d.text);
        }
    }
    // Three tokens of reasoning, then the closing text was the only choice;
    // the model's own words go on as the answer.
    assert_eq!(
        text.tokenizer
            .encode(reasoning.trim(), false)
            .unwrap()
            .len(),
        3,
        "{reasoning:?}"
    );
    assert!(answer.starts_with("four"), "{answer:?}");
    let forced = seen
        .lock()
        .unwrap()
        .iter()
        .filter(|(_, _, allowed)| !allowed.is_empty())
        .count();
    let close = text.tokenizer.encode("\n</think>\n\n", false).unwrap();
    assert_eq!(forced, close.len());
    sequences_become(&worker, 0).await;
}

#[tokio::test]
async fn a_generation_whose_kv_does_not_fit_beside_the_admitted_ones_is_refused() {
    use std::sync::atomic::Ordering;
    let text = text_model();
    let (next, _) = scripted_last(vec![100; 400]).await;
    let (mut client, worker, _dir) = head(&next, text).await;
    let stats = &worker.stats;
    stats.kv.budget_tokens.store(100, Ordering::Relaxed);
    // What generations admitted before hold: 76 of the 100.
    stats.kv.reserved_tokens.store(76, Ordering::Relaxed);
    // A prompt of 30 and its next tokens (10 at most here) do not fit.
    let refused = client
        .generate(request(vec![100; 30], 10))
        .await
        .unwrap_err();
    assert_eq!(refused.code(), tonic::Code::ResourceExhausted);
    assert!(
        refused.message().contains(
            "it needs 40 tokens (its prompt and the next tokens of its answer), and 76 of the 100"
        ),
        "{}",
        refused.message()
    );
    // 3 + 4 do, and give their share back.
    collect(&mut client, request(vec![100; 3], 4))
        .await
        .unwrap();
    reserved_becomes(&worker, 76).await;
    // One that could not fit even alone is refused whatever the others hold.
    stats.kv.reserved_tokens.store(0, Ordering::Relaxed);
    let alone = client
        .generate(request(vec![100; 30], 80))
        .await
        .unwrap_err();
    assert!(
        alone
            .message()
            .contains("may need 110 tokens of KV (prompt and max_tokens), more than the 100"),
        "{}",
        alone.message()
    );
    // Once the others end, the first is admitted.
    let (_, tokens, _) = collect(&mut client, request(vec![100; 30], 10))
        .await
        .unwrap();
    assert_eq!(tokens.len(), 10);
    reserved_becomes(&worker, 0).await;
    sequences_become(&worker, 0).await;
}

/// Waits for the KV reserved on `worker`'s stage to come to `n` tokens (a
/// generation gives its share back just after its last event).
pub(super) async fn reserved_becomes(worker: &StageWorker, n: u64) {
    for _ in 0..100 {
        if worker
            .stats
            .kv
            .reserved_tokens
            .load(std::sync::atomic::Ordering::Relaxed)
            == n
        {
            return;
        }
        tokio::time::sleep(std::time::Duration::from_millis(20)).await;
    }
    panic!("the stage still holds a reservation");
}

/// What a fake last stage saw: each `Open`'s cached tokens, and each step's
/// rows and token ids.
#[derive(Default)]
struct Opened {
    cached: Vec<u32>,
    steps: Vec<(u32, Vec<u32>)>,
}

/// What the fake last stage of [`cached_head`] does with a cached prefix.
#[derive(Clone, Copy, PartialEq)]
enum Next {
    /// Takes it.
    Holds,
    /// Refuses the open with `ABORTED`, as a stage that evicted it does.
    Lacks,
    /// Ignores it, as an agent from before pipelines reused prefixes does.
    Older,
    /// Holds 64 of them: refuses more with `ABORTED`, saying so.
    Fewer,
    /// Holds half of what it is asked for, every time.
    Halves,
}

/// A refusal of an open by a stage that holds `n` of its cached tokens.
fn holding(n: u32) -> Status {
    let mut refusal = Status::aborted(format!("holds {n} of them"));
    refusal.metadata_mut().insert(dp::CACHED_HEADER, n.into());
    refusal
}

/// A head whose prefix cache gives 600 tokens of a 1100-token prompt, and
/// a fake last stage that does with them as `next` says.
async fn cached_head(next: Next) -> (Arc<Mutex<Opened>>, dp::Finished, Vec<u32>, StageWorker) {
    let text = text_model();
    let seen = Arc::new(Mutex::new(Opened::default()));
    let (opens, steps) = (seen.clone(), seen.clone());
    let fake = FakeDataPlane::stepping(move |_, step| {
        let rows = step.hidden.as_ref().map_or(0, |h| h.tokens);
        steps.lock().unwrap().steps.push((rows, step.tokens));
        Ok(dp::ForwardResponse {
            token: 7,
            sampled: step.sample,
            logprobs: None,
        })
    })
    .on_open(move |open| {
        opens.lock().unwrap().cached.push(open.cached);
        match next {
            Next::Lacks if open.cached > 0 => Err(holding(0)),
            Next::Fewer if open.cached > 64 => Err(holding(64)),
            Next::Halves if open.cached > 0 => Err(holding(open.cached / 2)),
            _ => Ok(()),
        }
    });
    let fake = match next {
        Next::Older => fake.as_older_agent(),
        _ => fake,
    };
    let next = fake.serve(token()).await;
    let (mut echo, _) = Echo::new(false);
    echo.cached = 600;
    let (mut client, worker, _dir) = head_on(&next, text, echo).await;
    let prompt: Vec<u32> = (0..1100).map(|i| 100 + i % 50).collect();
    let (_, _, finished) = collect(&mut client, request(prompt.clone(), 2))
        .await
        .unwrap();
    sequences_become(&worker, 0).await;
    (seen, finished, prompt, worker)
}

#[tokio::test]
async fn a_head_sends_only_what_its_prefix_cache_lacks_and_tells_each_row_s_token() {
    let (seen, finished, prompt, worker) = cached_head(Next::Holds).await;
    let seen = seen.lock().unwrap();
    assert_eq!(seen.cached, vec![600], "the open tells what the head took");
    assert_eq!(
        seen.steps,
        vec![(500, prompt[600..].to_vec()), (1, vec![7])],
        "the rest of the prompt in one chunk, then the token sampled"
    );
    assert_eq!(finished.cached_tokens, 600);
    assert_eq!(finished.prompt_tokens, 1100);
    assert_eq!(worker.stats.looks(), (1100, 600), "one look, 600 reused");
}

#[tokio::test]
async fn a_head_runs_the_whole_prompt_when_a_later_stage_lacks_its_cached_prefix() {
    // Refused, or taken by a stage that ignores the field (it would take
    // the rows for positions from 0): opened again whole, and the next
    // prompts run whole for a while without looking in the cache.
    for next in [Next::Lacks, Next::Older] {
        let (seen, finished, prompt, worker) = cached_head(next).await;
        let seen = seen.lock().unwrap();
        assert_eq!(
            seen.cached,
            vec![600, 0],
            "refused, then opened again whole"
        );
        let rows: Vec<u32> = seen.steps.iter().map(|s| s.0).collect();
        assert_eq!(rows, vec![512, 512, 76, 1]);
        let sent: Vec<u32> = seen.steps[..3].iter().flat_map(|s| s.1.clone()).collect();
        assert_eq!(sent, prompt);
        assert_eq!(finished.cached_tokens, 0);
        assert!(!worker.stats.seeds(), "seeding paused");
        assert_eq!(worker.stats.looks(), (1100, 0), "one look, nothing reused");
    }
}

#[tokio::test]
async fn a_head_asks_again_with_as_many_tokens_as_a_later_stage_says_it_holds() {
    let (seen, finished, prompt, worker) = cached_head(Next::Fewer).await;
    let seen = seen.lock().unwrap();
    assert_eq!(seen.cached, vec![600, 64], "refused, then asked with 64");
    let rows: Vec<u32> = seen.steps.iter().map(|s| s.0).collect();
    assert_eq!(rows, vec![512, 512, 12, 1]);
    let sent: Vec<u32> = seen.steps[..3].iter().flat_map(|s| s.1.clone()).collect();
    assert_eq!(sent, prompt[64..]);
    assert_eq!(finished.cached_tokens, 64);
    assert!(worker.stats.seeds(), "no pause: the stages keep caches");
    assert_eq!(worker.stats.looks(), (1100, 64), "counted once, as it ran");
}

#[tokio::test]
async fn a_head_asks_again_three_times_at_most_then_runs_the_prompt_whole() {
    let (seen, finished, _, worker) = cached_head(Next::Halves).await;
    let seen = seen.lock().unwrap();
    assert_eq!(seen.cached, vec![600, 300, 150, 75, 0]);
    assert_eq!(finished.cached_tokens, 0);
    assert!(worker.stats.seeds(), "no pause: the stages keep caches");
    assert_eq!(worker.stats.looks(), (1100, 0), "counted once, as it ran");
}
