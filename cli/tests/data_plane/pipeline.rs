//! Two agents serve a pipeline exactly as one process does.

use super::*;

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
    let (admin_a, admin_b) = (free_address().to_string(), free_address().to_string());
    let _agents = (
        agent_with_admin(&a, &admin_a),
        agent_with_admin(&b, &admin_b),
    );
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

    // And again through the pipeline: its head takes as much from its own
    // prefix cache, its second stage (on the other agent) the same tokens
    // from its own, and both run only the last token.
    let before = metric(&admin_b, hits).await;
    let mut taken = 0;
    for (p, (tokens, _)) in prompts.iter().zip(&expected) {
        let (got, _, finished) = run(client(&head), request("pipe-0-0", p)).await.unwrap();
        assert_eq!(&got, tokens, "again, through the pipeline: {p}");
        assert_eq!(
            finished.cached_tokens + 1,
            finished.prompt_tokens,
            "{p}: {} of {} prompt tokens cached on both stages",
            finished.cached_tokens,
            finished.prompt_tokens
        );
        taken += finished.cached_tokens as usize;
    }
    // (Each stage's counters follow its passes: wait for the last.)
    let mut counted = (0.0, 0.0);
    for _ in 0..50 {
        counted = (
            metric(&admin_a, hits).await,
            metric(&admin_b, hits).await - before,
        );
        if counted.0 >= taken as f64 && counted.1 >= taken as f64 {
            break;
        }
        tokio::time::sleep(std::time::Duration::from_millis(100)).await;
    }
    assert_eq!(
        counted,
        (taken as f64, taken as f64),
        "the head took them from its own cache, the second stage as many from its own"
    );
    assert_eq!(
        metric(
            &admin_a,
            "shardplane_agent_prefix_cache_downstream_misses_total"
        )
        .await,
        0.0
    );

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
            cached: 0,
            replaces: 0,
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
            tokens: Vec::new(),
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
