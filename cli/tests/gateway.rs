//! The gateway on a running system (real API server, two agent processes, the
//! real model), driven by the official openai, anthropic and ollama Python
//! clients: every API streamed and not, errors in each API's shape, fallbacks
//! to another deployment and to an external endpoint (a second gateway on
//! loopback standing in for a provider), 503 when nothing can serve, a client
//! that goes away freeing its sequence at the agents, and a replica killed
//! mid-answer losing no request: its answers resume on the other replica.

use std::time::Duration;

use k8s_openapi::api::core::v1::{Secret, SecretKeySelector};
use kube::Api;
use kube::api::{ObjectMeta, PostParams};
use shardplane_crds::*;
use shardplane_dataplane as dp;
use shardplane_testkit::{
    ChildGuard as Process, control_plane, fixtures, free_address, unique_name,
};

const WAIT: Duration = Duration::from_secs(90);

fn shardplane(args: &[&str]) -> Process {
    shardplane_testkit::spawn_component(env!("CARGO_BIN_EXE_shardplane"), args)
}

fn agent(node: &str, admin: &str) -> Process {
    let cache = shardplane_testkit::agent_cache(env!("CARGO_TARGET_TMPDIR"), node);
    shardplane(&[
        "agent",
        "--node-name",
        node,
        "--admin-address",
        admin,
        "--lease-seconds",
        "3",
        "--cache-dir",
        cache.to_str().unwrap(),
    ])
}

fn gateway(listen: &str, admin: &str, keys: &std::path::Path, extra: &[&str]) -> Process {
    let mut args = vec![
        "gateway",
        "--listen",
        listen,
        "--admin-address",
        admin,
        "--api-keys-file",
        keys.to_str().unwrap(),
    ];
    args.extend_from_slice(extra);
    shardplane(&args)
}

fn deployment(name: &str, alias: &str, fallback: Vec<FallbackTarget>) -> ModelDeployment {
    let mut d = fixtures::deployment(name, "gw-model", "unused-pool", "unused-strategy");
    d.spec.aliases = vec![alias.into()];
    d.spec.fallback = fallback;
    d
}

async fn sequences(endpoint: &str) -> u32 {
    let token = dp::Token::new(shardplane_testkit::DATA_PLANE_TOKEN).unwrap();
    let mut c = dp::client(dp::channel(endpoint, None).unwrap(), token);
    c.status(dp::StatusRequest {})
        .await
        .map(|s| s.into_inner().stages.iter().map(|s| s.sequences).sum())
        .unwrap_or(0)
}

async fn wait_http(base: &str) {
    shardplane_testkit::eventually("the gateway listens", WAIT, || async {
        tokio::net::TcpStream::connect(base.trim_start_matches("http://"))
            .await
            .ok()
            .map(|_| ())
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn official_clients_chat_through_every_api_with_fallbacks_and_failover() {
    // The Shards name the quickstart's path on the nodes.
    shardplane_testkit::install_quickstart_model();
    let python = shardplane_testkit::venv_python();
    let client = control_plane().client().await.unwrap();
    let ns = control_plane().namespace(&client, "gateway").await.unwrap();
    let tag = unique_name("gw");
    let (a, b) = (format!("{tag}-a"), format!("{tag}-b"));
    let admins = [free_address().to_string(), free_address().to_string()];
    let mut agents = [agent(&a, &admins[0]), agent(&b, &admins[1])].map(Some);

    // The model (and the same weights with a chat template that opens
    // reasoning), six deployments (names are unique to this test: served
    // names are global), and the Shards an operator would have made.
    let mut model = fixtures::model("gw-model");
    model.spec.served_name = Some(format!("{tag}-model"));
    let thinking_template = std::fs::read_to_string(
        shardplane_testkit::repo_root().join("engine/tests/fixtures/chat_templates/thinking.jinja"),
    )
    .unwrap();
    let mut thinker = fixtures::model("gw-thinker");
    thinker.spec.served_name = Some(format!("{tag}-thinker"));
    thinker.spec.chat_template = Some(thinking_template.clone());
    for m in [&model, &thinker] {
        Api::<Model>::namespaced(client.clone(), &ns)
            .create(&PostParams::default(), m)
            .await
            .unwrap();
    }
    let names = |s: &str| format!("{tag}-{s}");
    let provider_listen = free_address().to_string();
    // The provider's key, in a Secret that opts in to being sent out; the
    // same key in one that does not.
    for (name, opted_in) in [("provider-key", true), ("bare-key", false)] {
        let secret = Secret {
            metadata: ObjectMeta {
                name: Some(name.into()),
                labels: opted_in.then(|| {
                    [(
                        shardplane_gateway::external::EXTERNAL_CREDENTIAL_LABEL.to_string(),
                        "true".to_string(),
                    )]
                    .into()
                }),
                ..Default::default()
            },
            string_data: Some([("key".to_string(), "sk-provider".to_string())].into()),
            ..Default::default()
        };
        Api::<Secret>::namespaced(client.clone(), &ns)
            .create(&PostParams::default(), &secret)
            .await
            .unwrap();
    }
    let external = |secret: &str, base_url: String| {
        vec![FallbackTarget::External(ExternalEndpoint {
            base_url,
            model: names("daily"),
            api_key_secret_ref: Some(SecretKeySelector {
                name: secret.into(),
                key: "key".into(),
                optional: None,
            }),
        })]
    };
    let deployments: Api<ModelDeployment> = Api::namespaced(client.clone(), &ns);
    for d in [
        deployment("daily", &names("daily"), vec![]),
        deployment("pipe", &names("pipe"), vec![]),
        deployment(
            "empty",
            &names("empty"),
            vec![FallbackTarget::Deployment("daily".into())],
        ),
        deployment(
            "burst",
            &names("burst"),
            external("provider-key", format!("http://{provider_listen}/v1")),
        ),
        // Not on the gateway's allowlist; a key whose Secret does not opt in.
        deployment(
            "stray",
            &names("stray"),
            external("provider-key", "http://127.0.0.1:9/v1".into()),
        ),
        deployment(
            "unlabelled",
            &names("unlabelled"),
            external("bare-key", format!("http://{provider_listen}/v1")),
        ),
        deployment("none", &names("none"), vec![]),
        {
            let mut d = deployment("think", &names("think"), vec![]);
            d.spec.model = "gw-thinker".into();
            d
        },
    ] {
        deployments
            .create(&PostParams::default(), &d)
            .await
            .unwrap();
    }
    let shards: Api<Shard> = Api::namespaced(client.clone(), &ns);
    let whole = LayerRange { start: 0, end: 30 };
    let mut replica_b = fixtures::shard("daily", &b, 0, 1, whole);
    replica_b.metadata.name = Some("daily-1-0".into());
    replica_b.spec.instance = 1;
    replica_b
        .metadata
        .labels
        .as_mut()
        .unwrap()
        .insert(INSTANCE_LABEL.into(), "1".into());
    let mut think = fixtures::shard("think", &b, 0, 1, whole);
    think.spec.model = "gw-thinker".into();
    think.spec.chat_template = Some(thinking_template);
    for s in [
        fixtures::shard("daily", &a, 0, 1, whole),
        replica_b,
        think,
        fixtures::shard("pipe", &a, 0, 2, LayerRange { start: 0, end: 15 }),
        fixtures::shard("pipe", &b, 1, 2, LayerRange { start: 15, end: 30 }),
    ] {
        shards.create(&PostParams::default(), &s).await.unwrap();
    }
    let mut endpoints = std::collections::BTreeMap::new();
    for name in [
        "daily-0-0",
        "daily-1-0",
        "pipe-0-0",
        "pipe-0-1",
        "think-0-0",
    ] {
        let e = shardplane_testkit::eventually(&format!("{name} is Ready"), WAIT, || async {
            let st = shards.get(name).await.ok()?.status?;
            (st.phase == Some(ShardPhase::Ready)).then_some(st.endpoint?)
        })
        .await;
        endpoints.insert(name, e);
    }

    // Two gateways: ours, and a second one standing in for a cloud provider.
    let dir = tempfile::tempdir().unwrap();
    let keys = dir.path().join("keys");
    std::fs::write(&keys, "test: sk-test\n").unwrap();
    let provider_keys = dir.path().join("provider-keys");
    std::fs::write(&provider_keys, "provider: sk-provider\n").unwrap();
    let listen = free_address().to_string();
    let admin = free_address().to_string();
    let allowed = format!("http://{provider_listen}/v1");
    let _gateway = gateway(&listen, &admin, &keys, &["--allow-external-url", &allowed]);
    let _provider = gateway(
        &provider_listen,
        &free_address().to_string(),
        &provider_keys,
        &[],
    );
    let base = format!("http://{listen}");
    wait_http(&base).await;
    wait_http(&format!("http://{provider_listen}")).await;

    // The official clients, a real agent framework, unchanged, and the
    // thinking switches on a model whose template opens reasoning.
    for script in ["thinking.py", "gateway_clients.py", "agent_framework.py"] {
        let out = tokio::process::Command::new(&python)
            .arg(format!(
                "{}/tests/clients/{script}",
                env!("CARGO_MANIFEST_DIR")
            ))
            .env("GATEWAY", &base)
            .env("API_KEY", "sk-test")
            .env("DAILY", names("daily"))
            .env("PIPE", names("pipe"))
            .env("EMPTY", names("empty"))
            .env("BURST", names("burst"))
            .env("NONE", names("none"))
            .env("THINK", names("think"))
            .output()
            .await
            .unwrap();
        let stdout = String::from_utf8_lossy(&out.stdout);
        eprintln!("{stdout}");
        assert!(
            out.status.success(),
            "the checks of {script} failed:\n{stdout}\n{}",
            String::from_utf8_lossy(&out.stderr)
        );
    }

    // The client that went away: every stage frees its sequence.
    shardplane_testkit::eventually(
        "the abandoned stream is freed at the agents",
        WAIT,
        || async {
            let mut total = 0;
            for e in endpoints
                .values()
                .collect::<std::collections::BTreeSet<_>>()
            {
                total += sequences(e).await;
            }
            (total == 0).then_some(())
        },
    )
    .await;

    // A conversation keeps to the replica that holds its beginning: the
    // second turn of each of four conversations (long, distinct first
    // messages) starts from the blocks its first turn left in that replica's
    // prefix cache. Were turns routed by load alone, about half would land
    // on the other replica and recompute their first message.
    let http = shardplane_models::http_client().unwrap();
    let hits = || async {
        let mut total = 0.0;
        for admin in &admins {
            total += shardplane_testkit::metrics::sum(
                &shardplane_testkit::metrics::scrape(admin).await,
                "shardplane_agent_prefix_cache_hit_tokens_total",
            );
        }
        total
    };
    let chat = |messages: serde_json::Value| {
        let (http, base) = (http.clone(), base.clone());
        async move {
            let body = serde_json::json!({"model": names("daily"), "messages": messages,
                "max_tokens": 6, "temperature": 0});
            let r = http
                .post(format!("{base}/v1/chat/completions"))
                .bearer_auth("sk-test")
                .header("content-type", "application/json")
                .body(body.to_string())
                .send()
                .await
                .unwrap();
            assert_eq!(r.status(), 200);
            serde_json::from_str::<serde_json::Value>(&r.text().await.unwrap()).unwrap()
        }
    };
    let before = hits().await;
    let mut expected = 0;
    for topic in ["rivers", "bridges", "comets", "forests"] {
        let first = format!(
            "Here are my notes on {topic}. {}Summarise them.",
            format!("The {topic} in my notes are long, old and well known. ").repeat(12)
        );
        let turn1 = serde_json::json!([{"role": "user", "content": first}]);
        let answer = chat(turn1.clone()).await;
        let said = answer["choices"][0]["message"]["content"]
            .as_str()
            .unwrap()
            .to_string();
        let prompt_tokens = answer["usage"]["prompt_tokens"].as_u64().unwrap() as usize;
        // At least the whole blocks of the first turn's prompt, all but its
        // last token (its tail too, when the second turn's rendering begins
        // with the first's exact tokens).
        expected += (prompt_tokens - 1) / 32 * 32;
        let turn2 = serde_json::json!([
            {"role": "user", "content": first},
            {"role": "assistant", "content": said},
            {"role": "user", "content": "Shorter, please."}
        ]);
        let second = chat(turn2).await;
        // The client hears it too, as OpenAI says it: cached prompt tokens.
        let cached = second["usage"]["prompt_tokens_details"]["cached_tokens"]
            .as_u64()
            .unwrap() as usize;
        assert!(
            cached >= (prompt_tokens - 1) / 32 * 32,
            "{topic}: {cached} cached tokens of a {prompt_tokens}-token first turn"
        );
    }
    let reused = hits().await - before;
    eprintln!("second turns reused {reused} prompt tokens; their first turns' blocks: {expected}");
    assert!(
        reused >= expected as f64,
        "second turns reused {reused} tokens; their first turns' blocks hold {expected}"
    );

    // A replica dies mid-answer. Six greedy streams run on both replicas;
    // once each has given text, the replica running more of them is killed.
    // Every stream goes on to its end: those on the killed replica resume on
    // the other after the tokens they gave.

    // External fallbacks send prompts only where the gateway allows, and
    // keys only from Secrets that opt in: otherwise the step is skipped and
    // the 503 says why.
    for (model, says) in [
        (names("stray"), "is not among the gateway's allowed URLs"),
        (
            names("unlabelled"),
            "is not labelled shardplane.dev/external-credential=true",
        ),
    ] {
        let r = http
            .post(format!("{base}/v1/chat/completions"))
            .bearer_auth("sk-test")
            .header("content-type", "application/json")
            .body(
                serde_json::json!({"model": model, "max_tokens": 4,
                    "messages": [{"role": "user", "content": "hi"}]})
                .to_string(),
            )
            .send()
            .await
            .unwrap();
        assert_eq!(r.status(), 503, "{model}");
        let body = r.text().await.unwrap();
        assert!(body.contains(says), "{model}: {body}");
        assert!(!body.contains("sk-provider"), "the key never shows: {body}");
    }

    let story = |n: usize, stream: bool| {
        serde_json::json!({
            "model": names("daily"),
            "messages": [{"role": "user", "content": format!("Write a story about the number {n}.")}],
            "max_tokens": 100,
            "temperature": 0,
            "stream": stream,
        })
        .to_string()
    };
    let stream = |n: usize, started_tx: &tokio::sync::mpsc::Sender<()>| {
        let (http, base, body, started) = (
            http.clone(),
            base.clone(),
            story(n, true),
            started_tx.clone(),
        );
        async move {
            let send = || {
                http.post(format!("{base}/v1/chat/completions"))
                    .bearer_auth("sk-test")
                    .header("content-type", "application/json")
                    .body(body.clone())
                    .send()
            };
            // A connection error before any response is retried once, as the
            // official clients do (a pooled connection the server had just
            // closed; seen once in eleven runs).
            let mut r = match send().await {
                Ok(r) => r,
                Err(e) => {
                    eprintln!("stream {n}: no response ({e:?}); retrying once");
                    send().await.unwrap()
                }
            };
            let status = r.status();
            let (mut raw, mut content, mut done, mut signalled) =
                (String::new(), String::new(), false, false);
            while let Ok(Some(chunk)) = r.chunk().await {
                raw.push_str(&String::from_utf8_lossy(&chunk));
                while let Some(end) = raw.find("\n\n") {
                    let event: String = raw.drain(..end + 2).collect();
                    // A comment (the keep-alive of an answer taken over
                    // or waiting) carries no data.
                    let Some(data) = event.trim().strip_prefix("data: ") else {
                        continue;
                    };
                    let data = data.to_string();
                    if data == "[DONE]" {
                        done = true;
                        continue;
                    }
                    let v: serde_json::Value = serde_json::from_str(&data)
                        .unwrap_or_else(|e| panic!("stream {n}: {e}: {data}"));
                    assert!(v.get("error").is_none(), "stream {n} failed: {data}");
                    if let Some(piece) = v["choices"][0]["delta"]["content"].as_str() {
                        content.push_str(piece);
                        if !signalled && !piece.is_empty() {
                            signalled = true;
                            let _ = started.send(()).await;
                        }
                    }
                }
            }
            assert!(
                done,
                "stream {n} (HTTP {status}) ended without [DONE]: {content:?}"
            );
            content
        }
    };
    // Six stories at once; once each gave text, the replica running more of
    // them is killed: every running story is past its first token, and the
    // last to start has most of its tokens to go, so the killed replica is
    // mid-answer on at least one.
    let stories: Vec<usize> = (0..6).collect();
    let (started_tx, mut started_rx) = tokio::sync::mpsc::channel::<()>(6);
    let running: Vec<_> = stories
        .iter()
        .map(|&n| tokio::spawn(stream(n, &started_tx)))
        .collect();
    drop(started_tx);
    for _ in 0..6 {
        tokio::time::timeout(WAIT, started_rx.recv())
            .await
            .expect("every stream gives text")
            .expect("a stream ended before giving text");
    }
    let on = [
        sequences(&endpoints["daily-0-0"]).await,
        sequences(&endpoints["daily-1-0"]).await,
    ];
    let victim = usize::from(on[1] > on[0]);
    let on_killed = on[victim];
    assert!(
        on_killed >= 1,
        "no replica ran a story as the last one started: {on:?}"
    );
    agents[victim].take().unwrap().signal("-KILL");
    let mut streamed = Vec::new();
    for r in running {
        streamed.push(r.await.unwrap());
    }
    // The same stories, uninterrupted, from the replica left: answered, and
    // (greedy) the same text — a resumed answer prefills the tokens it had,
    // which on candle computes the same bits as decoding them one by one
    // (see the data-plane test), so only how the text was cut can differ.
    let mut same = 0;
    for (&n, got) in stories.iter().zip(&streamed) {
        let r = http
            .post(format!("{base}/v1/chat/completions"))
            .bearer_auth("sk-test")
            .header("content-type", "application/json")
            .body(story(n, false))
            .send()
            .await
            .unwrap();
        assert_eq!(r.status(), 200, "the other replica answers after the kill");
        let v: serde_json::Value = serde_json::from_str(&r.text().await.unwrap()).unwrap();
        same += usize::from(got == v["choices"][0]["message"]["content"].as_str().unwrap());
        assert!(!got.is_empty(), "story {n} has text");
    }
    eprintln!(
        "{on_killed} of 6 streams were running on the killed replica; all 6 completed, {same} with the text of an uninterrupted answer"
    );

    // The gateway's metrics saw it all.
    let metrics = shardplane_testkit::metrics::scrape(&admin).await;
    let value = |series: &str| shardplane_testkit::metrics::sum(&metrics, series);
    let daily = names("daily");
    assert!(
        value(&format!(
            "shardplane_gateway_requests_total{{api=\"openai\",model=\"{daily}\",status=\"200\"}}"
        )) >= 10.0,
        "{metrics}"
    );
    assert!(
        value(&format!(
            "shardplane_gateway_requests_total{{api=\"openai\",model=\"{}\",status=\"503\"}}",
            names("none")
        )) >= 1.0
    );
    assert!(
        value("shardplane_gateway_requests_total{api=\"openai\",model=\"\",status=\"404\"}") >= 1.0
    );
    assert!(
        value(&format!(
            "shardplane_gateway_time_to_first_token_seconds_count{{model=\"{daily}\"}}"
        )) >= 10.0
    );
    assert!(
        value(&format!(
            "shardplane_gateway_inter_token_latency_seconds_count{{model=\"{daily}\"}}"
        )) > 0.0
    );
    assert!(
        value(&format!(
            "shardplane_gateway_tokens_total{{direction=\"out\",model=\"{daily}\"}}"
        )) > 0.0
    );
    assert!(
        value(&format!(
            "shardplane_gateway_upstream_errors_total{{kind=\"instance\",model=\"{daily}\"}}"
        )) >= 1.0,
        "the killed replica failed its answers"
    );
    assert!(
        value(&format!(
            "shardplane_gateway_resumed_answers_total{{model=\"{daily}\"}}"
        )) >= 1.0,
        "answers cut on the killed replica were resumed on the other one"
    );
    // Answers a fallback gave are counted by the fallback that gave them;
    // the daily deployment answered for itself.
    assert!(
        value(&format!(
            "shardplane_gateway_fallback_answers_total{{fallback=\"daily\",model=\"{}\"}}",
            names("empty")
        )) >= 1.0,
        "{metrics}"
    );
    assert!(
        value(&format!(
            "shardplane_gateway_fallback_answers_total{{fallback=\"external\",model=\"{}\"}}",
            names("burst")
        )) >= 1.0,
        "{metrics}"
    );
    let own = format!("model=\"{daily}\"");
    assert!(
        !metrics.lines().any(
            |l| l.starts_with("shardplane_gateway_fallback_answers_total") && l.contains(&own)
        ),
        "{metrics}"
    );
    assert_eq!(
        value(&format!(
            "shardplane_gateway_in_flight_requests{{model=\"{daily}\"}}"
        )),
        0.0
    );
}
