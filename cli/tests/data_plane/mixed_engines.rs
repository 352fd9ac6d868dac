//! An MLX agent and a candle agent serve one pipeline.

use super::*;

/// An agent running MLX (stage 1) and one running candle (stage 2) serve the
/// tokens the same two engines give in one process, and an MLX agent serving
/// the whole model gives MLX's tokens.
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
