//! The data plane between real agents: a 2-stage pipeline on two agent
//! processes generates exactly what the model generates in one process, many
//! sequences at once; calls without the token are refused; a client that goes
//! away frees its sequence on every stage; bad calls get clear errors.

use std::time::Duration;

use kube::Api;
use kube::api::PostParams;
use shardplane_crds::*;
use shardplane_dataplane as dp;
use shardplane_dataplane::tonic::Code;
use shardplane_engine::gguf::GgufFile;
use shardplane_engine::pipeline::{EngineKind, LocalPipeline, TextModel, generate};
use shardplane_engine::sampler::SamplingParams;
use shardplane_engine::text_output::TextOutput;
use shardplane_engine::{LoadOptions, chat::ChatMessage};
use shardplane_testkit::{
    ChildGuard as Process, control_plane, fixtures, free_address, unique_name,
};
use tokio_stream::wrappers::ReceiverStream;

const WAIT: Duration = Duration::from_secs(90);

fn agent(node: &str) -> Process {
    agent_with_admin(node, &free_address().to_string())
}

fn cache_of(node: &str) -> std::path::PathBuf {
    shardplane_testkit::agent_cache(env!("CARGO_TARGET_TMPDIR"), node)
}

fn agent_with_admin(node: &str, admin: &str) -> Process {
    agent_with(node, admin, &[])
}

fn agent_with(node: &str, admin: &str, extra: &[&str]) -> Process {
    let cache = cache_of(node);
    let mut args = vec![
        "agent",
        "--node-name",
        node,
        "--admin-address",
        admin,
        "--lease-seconds",
        "3",
        "--cache-dir",
        cache.to_str().unwrap(),
        "--probe-links-seconds",
        "2",
    ];
    args.extend_from_slice(extra);
    shardplane_testkit::spawn_component(env!("CARGO_BIN_EXE_shardplane"), &args)
}

fn client(endpoint: &str) -> dp::Client {
    shardplane_testkit::agent_calls::client(endpoint)
}

fn shard_ref(ns: &str, name: &str) -> Option<dp::ShardRef> {
    Some(dp::ShardRef {
        namespace: ns.into(),
        name: name.into(),
    })
}

fn conversation(text: &str) -> Option<dp::generate_request::Input> {
    Some(dp::generate_request::Input::Chat(dp::Conversation {
        messages: vec![dp::ChatMessage {
            role: "user".into(),
            content: text.into(),
            ..Default::default()
        }],
        ..Default::default()
    }))
}

/// What one process generates for `prompt`, greedy.
fn reference(
    text: &TextModel,
    pipeline: &mut LocalPipeline,
    prompt: &str,
    n: usize,
) -> (Vec<u32>, String) {
    let ids = text
        .chat_prompt(&[ChatMessage::new("user", prompt)])
        .unwrap();
    let params = SamplingParams {
        max_tokens: n,
        ..Default::default()
    };
    let g = generate(pipeline, text, 1, &ids, &params, |_| {}).unwrap();
    (g.tokens, g.text)
}

/// `tokens` pushed into a new text output (greedy defaults): the output and
/// the text they release.
fn pushed<'a>(text: &'a TextModel, tokens: &[u32]) -> (TextOutput<'a>, String) {
    let mut output = TextOutput::new(&text.tokenizer, &SamplingParams::default());
    let released = tokens
        .iter()
        .map(|&t| output.push(t).unwrap().text)
        .collect();
    (output, released)
}

/// The text `tokens` release as the start of an answer.
fn released_text(text: &TextModel, tokens: &[u32]) -> String {
    pushed(text, tokens).1
}

/// The whole text of an answer of `tokens`.
fn answer_text(text: &TextModel, tokens: &[u32]) -> String {
    let (output, released) = pushed(text, tokens);
    released + &output.finish().unwrap()
}

/// Runs a Generate to the end; returns the tokens, the text and the finish.
async fn run(
    mut c: dp::Client,
    req: dp::GenerateRequest,
) -> Result<(Vec<u32>, String, dp::Finished), dp::tonic::Status> {
    let mut stream = c.generate(req).await?.into_inner();
    let (mut tokens, mut text, mut finished) = (Vec::new(), String::new(), None);
    while let Some(ev) = stream.message().await? {
        match ev.event {
            Some(dp::generate_response::Event::Delta(d)) => {
                tokens.extend(d.tokens);
                text.push_str(&d.text);
            }
            Some(dp::generate_response::Event::Finished(f)) => finished = Some(f),
            _ => {}
        }
    }
    Ok((tokens, text, finished.expect("a Finished event")))
}

/// Sequences held by each stage an agent serves.
async fn sequences(endpoint: &str) -> Vec<(String, u32)> {
    let status = client(endpoint)
        .status(dp::StatusRequest {})
        .await
        .unwrap()
        .into_inner();
    status
        .stages
        .into_iter()
        .map(|s| (s.shard.unwrap().name, s.sequences))
        .collect()
}

/// Waits until each Shard is Ready; returns their data-plane endpoints.
async fn ready_endpoints(shards: &Api<Shard>, names: &[&str]) -> Vec<String> {
    let mut endpoints = Vec::new();
    for name in names {
        let e = shardplane_testkit::eventually(&format!("{name} is Ready"), WAIT, || async {
            let st = shards.get(name).await.ok()?.status?;
            (st.phase == Some(ShardPhase::Ready)).then_some(st.endpoint?)
        })
        .await;
        endpoints.push(e);
    }
    endpoints
}

/// An agent running MLX (stage 1) and one running candle (stage 2) serve the
/// tokens the same two engines give in one process, and an MLX agent serving
/// the whole model gives MLX's tokens.
#[cfg(feature = "mlx")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_mlx_agent_and_a_candle_agent_serve_one_pipeline() {
    use shardplane_engine::StageLayout;
    use shardplane_engine::pipeline::{load_model_stage, load_stage};
    // Some Shards name the quickstart's path on the nodes.
    shardplane_testkit::install_quickstart_model();
    let client_k = control_plane().client().await.unwrap();
    let ns = control_plane().namespace(&client_k, "mixed").await.unwrap();
    let (a, b) = (unique_name("mx-a"), unique_name("mx-b"));
    // The MLX-community layout, converted from the test model: on the nodes
    // as a path, and in a repository of the stand-in hub.
    let dir = tempfile::tempdir().unwrap();
    let mlx_dir = dir.path().join("smollm2-mlx");
    shardplane_engine::mlx::convert::gguf_to_mlx(&shardplane_testkit::test_model(), &mlx_dir)
        .unwrap();
    let (hub, hub_requests) = shardplane_testkit::hub::serve_repository(&mlx_dir, &[]).await;
    let _agents = (
        agent_with(&a, &free_address().to_string(), &["--engine", "mlx"]),
        agent_with(
            &b,
            &free_address().to_string(),
            &["--hugging-face-endpoint", &hub],
        ),
    );
    let shards: Api<Shard> = Api::namespaced(client_k.clone(), &ns);
    for s in [
        fixtures::shard("mixed", &a, 0, 2, LayerRange { start: 0, end: 15 }),
        fixtures::shard("mixed", &b, 1, 2, LayerRange { start: 15, end: 30 }),
        fixtures::shard("mlxwhole", &a, 0, 1, LayerRange { start: 0, end: 30 }),
    ] {
        shards.create(&PostParams::default(), &s).await.unwrap();
    }
    // The MLX-community layout from a path on the node, on each engine; a
    // directory without config.json fails the Shard, naming what is missing.
    let no_config = dir.path().to_path_buf();
    for (name, node, path) in [
        ("dira", &a, &mlx_dir),
        ("dirb", &b, &mlx_dir),
        ("nodir", &b, &no_config),
    ] {
        let mut s = fixtures::shard(name, node, 0, 1, LayerRange { start: 0, end: 30 });
        s.spec.format = ModelFormat::Safetensors;
        s.spec.source = ModelSource::Path(PathSource {
            path: path.display().to_string(),
            sha256: None,
        });
        shards.create(&PostParams::default(), &s).await.unwrap();
    }
    // And from the hub, pinned to its commit: downloaded into the cache,
    // each weight file checked against the hub's SHA-256.
    let mut s = fixtures::shard("hubdir", &b, 0, 1, LayerRange { start: 0, end: 30 });
    s.spec.format = ModelFormat::Safetensors;
    s.spec.source = ModelSource::HuggingFace(HuggingFaceSource {
        repo: shardplane_testkit::hub::HUB_MLX_REPO.into(),
        file: None,
        revision: Some(shardplane_testkit::hub::HUB_COMMIT.into()),
        sha256: None,
        token_secret_ref: None,
    });
    shards.create(&PostParams::default(), &s).await.unwrap();
    let failed = shardplane_testkit::eventually("nodir-0-0 fails", WAIT, || async {
        let st = shards.get("nodir-0-0").await.ok()?.status?;
        (st.phase == Some(ShardPhase::Failed)).then_some(st)
    })
    .await;
    assert_eq!(
        failed.reason.as_deref(),
        Some("WeightsNotFound"),
        "{failed:?}"
    );
    assert!(
        failed
            .message
            .as_deref()
            .unwrap_or_default()
            .contains("no config.json"),
        "{failed:?}"
    );
    let endpoints = ready_endpoints(
        &shards,
        &[
            "mixed-0-0",
            "mixed-0-1",
            "mlxwhole-0-0",
            "dira-0-0",
            "dirb-0-0",
            "hubdir-0-0",
        ],
    )
    .await;
    // Each Shard reports the engine it runs on, and each node its engines,
    // the one it loads into first.
    for (shard, engine) in [
        ("mixed-0-0", Engine::Mlx),
        ("mixed-0-1", Engine::Candle),
        ("mlxwhole-0-0", Engine::Mlx),
        ("dira-0-0", Engine::Mlx),
        ("dirb-0-0", Engine::Candle),
    ] {
        let st = shards.get(shard).await.unwrap().status.unwrap();
        assert_eq!(st.engine, Some(engine), "{shard}");
    }
    let nodes: Api<InferenceNode> = Api::all(client_k.clone());
    for (node, engines) in [
        (&a, vec![Engine::Mlx, Engine::Candle]),
        (&b, vec![Engine::Candle, Engine::Mlx]),
    ] {
        let st = nodes.get(node).await.unwrap().status.unwrap();
        assert_eq!(st.engines, engines, "{node}");
    }

    let file = GgufFile::open(shardplane_testkit::test_model()).unwrap();
    let text = TextModel::from_gguf(&file).unwrap();
    let options = LoadOptions::default();
    let stage = |r: std::ops::Range<usize>| StageLayout::new(r, 30).unwrap();
    let mut mixed = LocalPipeline::from_stages(vec![
        load_stage(&file, stage(0..15), EngineKind::Mlx, &options).unwrap(),
        load_stage(&file, stage(15..30), EngineKind::Candle, &options).unwrap(),
    ]);
    let mut mlx = LocalPipeline::load(&file, &[], EngineKind::Mlx, &options).unwrap();
    assert_eq!(mlx.stages()[0].layout().layers, 0..30);
    let prompt = "Name a large animal.";
    for (endpoint, shard, local) in [
        (&endpoints[0], "mixed-0-0", &mut mixed),
        (&endpoints[2], "mlxwhole-0-0", &mut mlx),
    ] {
        run_against_local(&ns, endpoint, shard, &text, local, prompt).await;
    }
    // The directory's stages answer as the same engine on the same directory
    // does in this process; MLX's also as MLX on the GGUF (the conversion
    // keeps the weights bit for bit).
    run_against_local(&ns, &endpoints[3], "dira-0-0", &text, &mut mlx, prompt).await;
    let (mut candle_dir, dir_text) = {
        let (stage, text) =
            load_model_stage(&mlx_dir, stage(0..30), EngineKind::Candle, &options).unwrap();
        (LocalPipeline::from_stages(vec![stage]), text.unwrap())
    };
    run_against_local(
        &ns,
        &endpoints[4],
        "dirb-0-0",
        &dir_text,
        &mut candle_dir,
        prompt,
    )
    .await;
    run_against_local(
        &ns,
        &endpoints[5],
        "hubdir-0-0",
        &dir_text,
        &mut candle_dir,
        prompt,
    )
    .await;
    let fetched: Vec<String> = hub_requests
        .lock()
        .unwrap()
        .iter()
        .map(|(r, _)| r.clone())
        .filter(|r| r.starts_with("GET "))
        .collect();
    for file in ["config.json", "tokenizer.json", "model.safetensors"] {
        assert!(
            fetched.iter().any(|r| r.ends_with(&format!("/{file}"))),
            "{file} fetched: {fetched:?}"
        );
    }
}

/// Generates 12 tokens for `prompt` through the agent at `endpoint` and
/// checks them (and their text) against `local`.
#[cfg(feature = "mlx")]
async fn run_against_local(
    ns: &str,
    endpoint: &str,
    shard: &str,
    text: &TextModel,
    local: &mut LocalPipeline,
    prompt: &str,
) {
    let (tokens, words) = reference(text, local, prompt, 12);
    let request = dp::GenerateRequest {
        shard: shard_ref(ns, shard),
        input: conversation(prompt),
        sampling: Some(dp::Sampling {
            max_tokens: 12,
            ..Default::default()
        }),
        resume: None,
        grammar: None,
        tools: None,
    };
    let (got, got_text, _) = run(client(endpoint), request).await.unwrap();
    assert_eq!(got, tokens, "{shard}");
    assert_eq!(got_text, words, "{shard}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_agents_serve_a_pipeline_exactly_as_one_process_does() {
    // Some Shards name the quickstart's path on the nodes.
    shardplane_testkit::install_quickstart_model();
    let client_k = control_plane().client().await.unwrap();
    let ns = control_plane()
        .namespace(&client_k, "dataplane")
        .await
        .unwrap();
    let (a, b) = (unique_name("dp-a"), unique_name("dp-b"));
    let admin_b = free_address().to_string();
    let _agents = (agent(&a), agent_with_admin(&b, &admin_b));
    let shards: Api<Shard> = Api::namespaced(client_k.clone(), &ns);
    for s in [
        fixtures::shard("pipe", &a, 0, 2, LayerRange { start: 0, end: 13 }),
        fixtures::shard("pipe", &b, 1, 2, LayerRange { start: 13, end: 30 }),
        fixtures::shard("whole", &b, 0, 1, LayerRange { start: 0, end: 30 }),
    ] {
        shards.create(&PostParams::default(), &s).await.unwrap();
    }
    let endpoints = ready_endpoints(&shards, &["pipe-0-0", "pipe-0-1", "whole-0-0"]).await;
    let (head, tail, whole) = (
        endpoints[0].clone(),
        endpoints[1].clone(),
        endpoints[2].clone(),
    );
    assert_ne!(head, tail, "two agents, two endpoints");
    assert_eq!(tail, whole);

    // The reference: the whole model in this process.
    let file = GgufFile::open(shardplane_testkit::test_model()).unwrap();
    let text = TextModel::from_gguf(&file).unwrap();
    let mut local =
        LocalPipeline::load(&file, &[], EngineKind::Candle, &LoadOptions::default()).unwrap();
    let prompts = [
        "What is the capital of France?",
        "Write a haiku about the sea.",
        "List three prime numbers.",
    ];
    let expected: Vec<_> = prompts
        .iter()
        .map(|p| reference(&text, &mut local, p, 24))
        .collect();
    let request = |shard: &str, prompt: &str| dp::GenerateRequest {
        shard: shard_ref(&ns, shard),
        input: conversation(prompt),
        sampling: Some(dp::Sampling {
            max_tokens: 24,
            ..Default::default()
        }),
        resume: None,
        grammar: None,
        tools: None,
    };

    // One at a time, through the 2-stage pipeline and the whole-model stage.
    for (p, (tokens, text)) in prompts.iter().zip(&expected) {
        for (endpoint, shard) in [(&head, "pipe-0-0"), (&whole, "whole-0-0")] {
            let (got, got_text, finished) = run(client(endpoint), request(shard, p)).await.unwrap();
            assert_eq!(&got, tokens, "{shard}: {p}");
            assert_eq!(&got_text, text, "{shard}: {p}");
            assert_eq!(finished.completion_tokens as usize, tokens.len());
            assert!(finished.prompt_tokens > 5);
        }
    }

    // The same prompts again on the whole-model stage: each starts from the
    // blocks and the tail its first run left in the prefix cache (all of
    // the prompt but its last token), and answers alike.
    let hits = "shardplane_agent_prefix_cache_hit_tokens_total";
    let before = metric(&admin_b, hits).await;
    for (p, (tokens, _)) in prompts.iter().zip(&expected) {
        let (got, _, finished) = run(client(&whole), request("whole-0-0", p)).await.unwrap();
        assert_eq!(&got, tokens, "again, from the prefix cache: {p}");
        assert_eq!(
            finished.cached_tokens + 1,
            finished.prompt_tokens,
            "{p}: {} of {} prompt tokens cached",
            finished.cached_tokens,
            finished.prompt_tokens
        );
    }
    let reused = metric(&admin_b, hits).await - before;
    assert!(
        reused >= (prompts.len() * 32) as f64,
        "each prompt reused at least its first block: {reused} tokens"
    );
    assert!(metric(&admin_b, "shardplane_agent_prefix_cache_bytes").await > 0.0);

    // Resumed after the first k tokens of an answer (as the gateway does when
    // an instance fails mid-answer): exactly what the model gives when it
    // prefills the prompt and those k tokens and decodes greedily up to the
    // same limit, and text that carries on from what the k tokens released.
    // That is the uninterrupted answer's own tokens too: on candle a row
    // computes the same bits in a prefill of k more tokens as in k decode
    // steps (this model's answers loop between near-tied tokens, so any
    // rounding difference would show).
    let mut differed = 0;
    for (p, (tokens, _)) in prompts.iter().zip(&expected) {
        let prompt_ids = text
            .chat_prompt(&[ChatMessage::new("user", p.to_string())])
            .unwrap();
        for k in [1, tokens.len() / 2, tokens.len() - 1, tokens.len()] {
            let prefix = &tokens[..k];
            let rest = if k < 24 && !text.tokenizer.stop_tokens().contains(&tokens[k - 1]) {
                let context = [prompt_ids.as_slice(), prefix].concat();
                let params = SamplingParams {
                    max_tokens: 24 - k,
                    ..Default::default()
                };
                generate(&mut local, &text, 1, &context, &params, |_| {})
                    .unwrap()
                    .tokens
            } else {
                Vec::new()
            };
            differed += usize::from(rest[..] != tokens[k..]);
            let whole_answer = [prefix, &rest].concat();
            let reason = match whole_answer.last() {
                Some(t) if text.tokenizer.stop_tokens().contains(t) => dp::FinishReason::Stop,
                _ => dp::FinishReason::Length,
            };
            for (endpoint, shard) in [(&head, "pipe-0-0"), (&whole, "whole-0-0")] {
                let resumed = dp::GenerateRequest {
                    resume: Some(dp::TokenIds {
                        ids: prefix.to_vec(),
                    }),
                    ..request(shard, p)
                };
                let (got, got_text, finished) = run(client(endpoint), resumed).await.unwrap();
                assert_eq!(got, rest, "{shard}: {p}, resumed after {k}");
                assert_eq!(
                    format!("{}{got_text}", released_text(&text, prefix)),
                    answer_text(&text, &whole_answer),
                    "{shard}: {p}, resumed after {k}"
                );
                assert_eq!(finished.completion_tokens as usize, whole_answer.len());
                assert_eq!(
                    finished.reason, reason as i32,
                    "{shard}: {p}, resumed after {k}"
                );
            }
        }
    }
    assert_eq!(
        differed, 0,
        "resumed answers that part from the uninterrupted one (of 12)"
    );
    // More tokens to resume from than the answer may have, one past the
    // vocabulary, or an end of sequence before their end: refused.
    let eos = text.tokenizer.stop_tokens()[0];
    for (ids, says) in [
        (vec![expected[0].0[0]; 25], "at most 24"),
        (vec![1, 10_000_000], "vocabulary"),
        (
            vec![expected[0].0[0], eos, expected[0].0[0]],
            "end the answer",
        ),
    ] {
        let err = run(
            client(&whole),
            dp::GenerateRequest {
                resume: Some(dp::TokenIds { ids }),
                ..request("whole-0-0", prompts[0])
            },
        )
        .await
        .unwrap_err();
        assert_eq!(err.code(), Code::InvalidArgument, "{err:?}");
        assert!(err.message().contains(says), "{err:?}");
    }
    // Resumed after an end of sequence (the Finished was lost): it ends at once.
    let (got, _, finished) = run(
        client(&whole),
        dp::GenerateRequest {
            resume: Some(dp::TokenIds {
                ids: vec![expected[0].0[0], eos],
            }),
            ..request("whole-0-0", prompts[0])
        },
    )
    .await
    .unwrap();
    assert!(got.is_empty(), "{got:?}");
    assert_eq!(finished.reason, dp::FinishReason::Stop as i32);
    assert_eq!(finished.completion_tokens, 2);

    // All at once: sequences interleave (and batch) on both stages.
    let runs = prompts
        .iter()
        .map(|p| tokio::spawn(run(client(&head), request("pipe-0-0", p))))
        .collect::<Vec<_>>();
    for (r, (tokens, _)) in runs.into_iter().zip(&expected) {
        assert_eq!(&r.await.unwrap().unwrap().0, tokens);
    }
    shardplane_testkit::eventually("every sequence is freed", WAIT, || async {
        let all = [sequences(&head).await, sequences(&tail).await].concat();
        all.iter().all(|(_, n)| *n == 0).then_some(())
    })
    .await;

    // A client that goes away mid-stream frees its sequence on every stage.
    let long = dp::GenerateRequest {
        sampling: Some(dp::Sampling {
            max_tokens: 3000,
            ignore_eos: true,
            ..Default::default()
        }),
        ..request("pipe-0-0", prompts[0])
    };
    let mut stream = client(&head).generate(long).await.unwrap().into_inner();
    for _ in 0..4 {
        stream.message().await.unwrap().unwrap();
    }
    let held = [sequences(&head).await, sequences(&tail).await].concat();
    assert!(
        held.iter()
            .filter(|(n, _)| n.starts_with("pipe"))
            .all(|(_, n)| *n == 1),
        "both stages hold the running sequence: {held:?}"
    );
    drop(stream);
    shardplane_testkit::eventually(
        "the cancelled sequence is freed on both stages",
        WAIT,
        || async {
            let all = [sequences(&head).await, sequences(&tail).await].concat();
            all.iter().all(|(_, n)| *n == 0).then_some(())
        },
    )
    .await;

    // Stop strings, sampling with a seed and max_tokens are honoured.
    let seeded = |shard: &str| dp::GenerateRequest {
        sampling: Some(dp::Sampling {
            max_tokens: 12,
            temperature: 0.8,
            top_p: 0.9,
            seed: Some(7),
            ..Default::default()
        }),
        ..request(shard, prompts[1])
    };
    let (tokens, text_out, finished) = run(client(&head), seeded("pipe-0-0")).await.unwrap();
    let again = run(client(&whole), seeded("whole-0-0")).await.unwrap();
    assert_eq!(
        tokens, again.0,
        "the same seed samples the same tokens on both"
    );
    assert!(tokens.len() <= 12 && finished.completion_tokens as usize == tokens.len());
    assert_eq!(text_out, again.1);
    let stop_at = &expected[0].1[..expected[0].1.len() / 2];
    let stop_word = stop_at.split_whitespace().last().unwrap().to_string();
    let (_, stopped_text, finished) = run(
        client(&head),
        dp::GenerateRequest {
            sampling: Some(dp::Sampling {
                max_tokens: 24,
                stop: vec![stop_word.clone()],
                ..Default::default()
            }),
            ..request("pipe-0-0", prompts[0])
        },
    )
    .await
    .unwrap();
    assert!(
        !stopped_text.contains(&stop_word),
        "{stopped_text:?} stops before {stop_word:?}"
    );
    assert_eq!(finished.reason, dp::FinishReason::Stop as i32);

    // Without the token, or with a wrong one, every call is refused.
    let bare = dp::data_plane_client::DataPlaneClient::new(dp::channel(&head, None).unwrap());
    let err = bare
        .clone()
        .generate(request("pipe-0-0", "hi"))
        .await
        .unwrap_err();
    assert_eq!(err.code(), Code::Unauthenticated, "{err:?}");
    let err = bare.clone().status(dp::StatusRequest {}).await.unwrap_err();
    assert_eq!(err.code(), Code::Unauthenticated);
    let wrong = dp::client(
        dp::channel(&head, None).unwrap(),
        dp::Token::new("not-the-cluster-token-at-all").unwrap(),
    );
    let err = wrong
        .clone()
        .status(dp::StatusRequest {})
        .await
        .unwrap_err();
    assert_eq!(err.code(), Code::Unauthenticated);
    // Forward from an outsider is refused too, so hidden states cannot be injected.
    let (_tx, rx) = tokio::sync::mpsc::channel::<dp::ForwardRequest>(1);
    let err = bare
        .clone()
        .forward(ReceiverStream::new(rx))
        .await
        .unwrap_err();
    assert_eq!(err.code(), Code::Unauthenticated);

    // Bad calls get clear errors.
    let err = run(client(&tail), request("pipe-0-1", "hi"))
        .await
        .unwrap_err();
    assert_eq!(err.code(), Code::FailedPrecondition, "{err:?}");
    let err = run(client(&head), request("no-such-shard", "hi"))
        .await
        .unwrap_err();
    assert_eq!(err.code(), Code::NotFound, "{err:?}");
    let err = run(client(&head), request("pipe-0-0", &"word ".repeat(5000)))
        .await
        .unwrap_err();
    assert_eq!(err.code(), Code::InvalidArgument, "{err:?}");
    assert!(err.message().contains("context"), "{err:?}");
    let err = run(
        client(&head),
        dp::GenerateRequest {
            sampling: Some(dp::Sampling {
                temperature: -1.0,
                ..Default::default()
            }),
            ..request("pipe-0-0", "hi")
        },
    )
    .await
    .unwrap_err();
    assert_eq!(err.code(), Code::InvalidArgument, "{err:?}");
    let err = run(
        client(&head),
        dp::GenerateRequest {
            input: Some(dp::generate_request::Input::Tokens(dp::TokenIds {
                ids: vec![1, 10_000_000],
            })),
            ..request("pipe-0-0", "hi")
        },
    )
    .await
    .unwrap_err();
    assert_eq!(err.code(), Code::InvalidArgument, "{err:?}");
    // Hidden states of the wrong width are refused by a later stage.
    let (tx, rx) = tokio::sync::mpsc::channel(4);
    tx.send(dp::ForwardRequest {
        message: Some(dp::forward_request::Message::Open(dp::Open {
            shard: shard_ref(&ns, "pipe-0-1"),
            sequence: 99,
            sampling: None,
            prompt: vec![],
            banned: vec![],
            generated: 0,
        })),
    })
    .await
    .unwrap();
    tx.send(dp::ForwardRequest {
        message: Some(dp::forward_request::Message::Step(dp::Step {
            hidden: Some(dp::Hidden {
                tokens: 1,
                width: 3,
                data: dp::encode_f32(&[1.0, 2.0, 3.0]),
            }),
            sample: true,
            allowed: Vec::new(),
        })),
    })
    .await
    .unwrap();
    let mut answers = client(&tail)
        .forward(ReceiverStream::new(rx))
        .await
        .unwrap()
        .into_inner();
    let err = answers.message().await.unwrap_err();
    assert_eq!(err.code(), Code::InvalidArgument, "{err:?}");
    drop(tx);
    // The agents are still serving.
    let (got, _, _) = run(client(&head), request("pipe-0-0", prompts[2]))
        .await
        .unwrap();
    assert_eq!(got, expected[2].0);

    // Each agent measured its link to the other and wrote it where the planner reads it.
    let nodes: Api<InferenceNode> = Api::all(client_k.clone());
    for (me, peer, peer_endpoint) in [(&a, &b, &tail), (&b, &a, &head)] {
        let link =
            shardplane_testkit::eventually(&format!("{me} measures {peer}"), WAIT, || async {
                nodes
                    .get(me)
                    .await
                    .ok()?
                    .status?
                    .links
                    .into_iter()
                    .find(|l| &l.node == peer)
            })
            .await;
        eprintln!(
            "link {me} -> {peer}: {} us, {} Mb/s",
            link.latency_micros,
            link.bandwidth_mbps.unwrap_or(0)
        );
        assert_eq!(&link.address, peer_endpoint);
        assert_eq!(link.kind, LinkKind::Loopback);
        assert!(
            link.latency_micros > 0 && link.latency_micros < 1_000_000,
            "{link:?}"
        );
        assert!(link.bandwidth_mbps.unwrap() > 100, "{link:?}");
    }
}

async fn metric(admin: &str, series: &str) -> f64 {
    shardplane_testkit::metrics::sum(&shardplane_testkit::metrics::scrape(admin).await, series)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_agent_copies_weights_from_a_peer_verified_and_resumes_an_interrupted_copy() {
    let client_k = control_plane().client().await.unwrap();
    let ns = control_plane()
        .namespace(&client_k, "peercopy")
        .await
        .unwrap();
    let (a, b) = (unique_name("pc-a"), unique_name("pc-b"));
    let (admin_a, admin_b) = (free_address().to_string(), free_address().to_string());
    let _a = agent_with_admin(&a, &admin_a);
    let shards: Api<Shard> = Api::namespaced(client_k.clone(), &ns);
    let nodes: Api<InferenceNode> = Api::all(client_k.clone());
    let (base, log) = shardplane_testkit::serve_test_model().await;
    // Peers are trusted for what the Model pins only.
    let pinned = shardplane_agent::cache::sha256_file(&shardplane_testkit::test_model()).unwrap();
    let source = ModelSource::Url(UrlSource {
        url: format!("{base}/m.gguf"),
        sha256: Some(pinned),
    });
    let key = source.cache_key();
    let ready = |name: &'static str| {
        let shards = shards.clone();
        async move {
            shardplane_testkit::eventually(&format!("{name} is Ready"), WAIT, || async {
                let st = shards.get(name).await.ok()?.status?;
                if st.phase == Some(ShardPhase::Failed) {
                    panic!("{name} failed: {st:?}");
                }
                (st.phase == Some(ShardPhase::Ready)).then_some(())
            })
            .await
        }
    };

    // A downloads the model from its URL once, although two stages of it
    // arrive at once (the second waits for the first's file), and lists it.
    for name in ["first", "twin"] {
        let mut shard = fixtures::shard(name, &a, 0, 1, LayerRange { start: 0, end: 30 });
        shard.spec.source = source.clone();
        shards.create(&PostParams::default(), &shard).await.unwrap();
    }
    ready("first-0-0").await;
    ready("twin-0-0").await;
    shardplane_testkit::eventually("A lists the model", WAIT, || async {
        let st = nodes.get(&a).await.ok()?.status?;
        st.cached_models.iter().any(|m| m.key == key).then_some(())
    })
    .await;
    let downloads = log.lock().unwrap().clone();
    assert_eq!(downloads, ["full"], "one download for both stages");
    let downloads = downloads.len();

    // B already has two pieces of an interrupted copy.
    let model = std::fs::read(shardplane_testkit::test_model()).unwrap();
    let piece = shardplane_agent::peer_copy::PIECE as usize;
    let cache_b =
        shardplane_agent::cache::Cache::new(cache_of(&b), reqwest::Client::new()).unwrap();
    let partial = cache_b.file_for(&key).with_extension("gguf.partial");
    std::fs::write(&partial, &model[..2 * piece]).unwrap();
    let mut pieces = partial.as_os_str().to_owned();
    pieces.push(".pieces");
    std::fs::write(&pieces, "0\n1\n").unwrap();

    // B gets a shard of the same model: it copies the rest from A, not from the URL.
    let _b = agent_with_admin(&b, &admin_b);
    let mut second = fixtures::shard("second", &b, 0, 1, LayerRange { start: 0, end: 30 });
    second.spec.source = source.clone();
    shards
        .create(&PostParams::default(), &second)
        .await
        .unwrap();
    ready("second-0-0").await;
    let requests = log.lock().unwrap().clone();
    assert_eq!(
        requests.len(),
        downloads,
        "no request went to the URL: {requests:?}"
    );
    assert_eq!(
        std::fs::read(cache_b.file_for(&key)).unwrap(),
        model,
        "the copy is whole"
    );
    assert!(!partial.exists() && !std::path::Path::new(&pieces).exists());
    let served = metric(&admin_a, "shardplane_agent_peer_served_bytes_total").await;
    assert_eq!(
        served as usize,
        model.len() - 2 * piece,
        "only the missing pieces travelled"
    );
    let fetched = metric(
        &admin_b,
        "shardplane_agent_download_bytes_total{source=\"peer\"}",
    )
    .await;
    assert_eq!(fetched as usize, model.len() - 2 * piece);
    let listed = shardplane_testkit::eventually("B lists the model", WAIT, || async {
        let st = nodes.get(&b).await.ok()?.status?;
        st.cached_models.into_iter().find(|m| m.key == key)
    })
    .await;
    assert_eq!(listed.bytes as usize, model.len());

    // A model no hash pins: B fetches it from its source, not from A, whose
    // copy could be checked only against A's own word.
    let unpinned = ModelSource::Url(UrlSource {
        url: format!("{base}/m.gguf?unpinned"),
        sha256: None,
    });
    let unpinned_key = unpinned.cache_key();
    let mut third = fixtures::shard("third", &a, 0, 1, LayerRange { start: 0, end: 30 });
    third.spec.source = unpinned.clone();
    shards.create(&PostParams::default(), &third).await.unwrap();
    ready("third-0-0").await;
    shardplane_testkit::eventually("A lists the unpinned model", WAIT, || async {
        let st = nodes.get(&a).await.ok()?.status?;
        st.cached_models
            .iter()
            .any(|m| m.key == unpinned_key)
            .then_some(())
    })
    .await;
    let (from_url, from_peers) = (log.lock().unwrap().len(), fetched);
    let mut fourth = fixtures::shard("fourth", &b, 0, 1, LayerRange { start: 0, end: 30 });
    fourth.spec.source = unpinned;
    shards
        .create(&PostParams::default(), &fourth)
        .await
        .unwrap();
    ready("fourth-0-0").await;
    assert!(
        log.lock().unwrap().len() > from_url,
        "B fetched the unpinned model from its URL"
    );
    let fetched = metric(
        &admin_b,
        "shardplane_agent_download_bytes_total{source=\"peer\"}",
    )
    .await;
    assert_eq!(fetched, from_peers, "nothing came from a peer");
}
