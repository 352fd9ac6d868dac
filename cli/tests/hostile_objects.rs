//! The operator (a real process) against objects meant to break it: model
//! files whose headers claim absurd sizes, and counts past every bound.
//! Each hostile Model ends with a condition that says why; the operator
//! keeps running, leading and resolving the next good Model; the API server
//! refuses the absurd counts at apply time.

use std::path::Path;
use std::time::Duration;

use kube::Api;
use kube::api::PostParams;
use shardplane_crds::*;
use shardplane_formats::gguf::Value;
use shardplane_formats::gguf::write::file as gguf_file;
use shardplane_testkit::{control_plane, eventually, fixtures, free_address, unique_name};

const WAIT: Duration = Duration::from_secs(60);

/// A llama GGUF header with `overrides` on top of plausible metadata.
fn llama(overrides: &[(&str, Value)]) -> Vec<u8> {
    let mut metadata: Vec<(&str, Value)> = vec![
        ("general.architecture", Value::String("llama".into())),
        ("llama.block_count", Value::U32(2)),
        ("llama.embedding_length", Value::U32(64)),
        ("llama.feed_forward_length", Value::U32(128)),
        ("llama.attention.head_count", Value::U32(4)),
        ("llama.context_length", Value::U32(256)),
        (
            "tokenizer.ggml.tokens",
            Value::Array(shardplane_formats::gguf::Array::String(vec![
                "a".into(),
                "b".into(),
            ])),
        ),
    ];
    for (k, v) in overrides {
        metadata.retain(|(key, _)| key != k);
        metadata.push((k, v.clone()));
    }
    gguf_file(&metadata, &[])
}

/// A safetensors directory: `config` as config.json and one weights file
/// whose first bytes are `weights`.
fn safetensors_dir(dir: &Path, config: serde_json::Value, weights: &[u8]) {
    std::fs::create_dir_all(dir).unwrap();
    std::fs::write(dir.join("config.json"), config.to_string()).unwrap();
    std::fs::write(dir.join("model.safetensors"), weights).unwrap();
}

/// A valid safetensors file holding one 4-byte tensor.
fn one_tensor() -> Vec<u8> {
    let header = br#"{"model.layers.0.w":{"dtype":"F32","shape":[1],"data_offsets":[0,4]}}"#;
    let mut out = (header.len() as u64).to_le_bytes().to_vec();
    out.extend_from_slice(header);
    out.extend_from_slice(&[0; 4]);
    out
}

fn model(name: &str, format: ModelFormat, path: &Path) -> Model {
    let mut m = fixtures::model(name);
    m.spec.format = format;
    m.spec.source = ModelSource::Path(PathSource {
        path: path.display().to_string(),
        sha256: None,
    });
    m
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn hostile_models_and_counts_leave_the_operator_running_and_say_why() {
    let client = control_plane().client().await.unwrap();
    let ns = control_plane().namespace(&client, "hostile").await.unwrap();
    let admin = free_address().to_string();
    let leader_ns = unique_name("leader");
    let mut operator = shardplane_testkit::spawn_component(
        env!("CARGO_BIN_EXE_shardplane"),
        &[
            "operator",
            "--admin-address",
            &admin,
            "--leader-namespace",
            &leader_ns,
            "--leader-lease-seconds",
            "4",
            "--read-model-paths",
        ],
    );

    let dir = tempfile::tempdir().unwrap();
    let at = |name: &str| dir.path().join(name);
    let config = |layers: u64, hidden: u64| {
        serde_json::json!({"model_type": "llama", "num_hidden_layers": layers,
            "hidden_size": hidden, "num_attention_heads": 4})
    };
    // (name, format, file, words its condition must say)
    let hostile: Vec<(&str, ModelFormat, std::path::PathBuf, &str)> = vec![
        (
            "alignment-zero",
            ModelFormat::Gguf,
            at("a.gguf"),
            "general.alignment",
        ),
        (
            "many-blocks",
            ModelFormat::Gguf,
            at("b.gguf"),
            "the number of layers is 4294967295",
        ),
        (
            "wide",
            ModelFormat::Gguf,
            at("w.gguf"),
            "the hidden size is 4294967295",
        ),
        (
            "many-tensors",
            ModelFormat::Gguf,
            at("t.gguf"),
            "the number of tensors",
        ),
        (
            "trillion-layers",
            ModelFormat::Safetensors,
            at("st-layers"),
            "the number of layers is 1000000000000",
        ),
        (
            "endless-header",
            ModelFormat::Safetensors,
            at("st-header"),
            "implausibly large",
        ),
    ];
    std::fs::write(at("a.gguf"), llama(&[("general.alignment", Value::U32(0))])).unwrap();
    std::fs::write(
        at("b.gguf"),
        llama(&[("llama.block_count", Value::U32(u32::MAX))]),
    )
    .unwrap();
    std::fs::write(
        at("w.gguf"),
        llama(&[
            ("llama.embedding_length", Value::U32(u32::MAX)),
            ("llama.attention.head_count", Value::U32(1)),
        ]),
    )
    .unwrap();
    // "GGUF", version 3, then 2^64-1 tensors and no more.
    let mut many = b"GGUF".to_vec();
    many.extend_from_slice(&3u32.to_le_bytes());
    many.extend_from_slice(&u64::MAX.to_le_bytes());
    many.extend_from_slice(&0u64.to_le_bytes());
    std::fs::write(at("t.gguf"), many).unwrap();
    safetensors_dir(
        &at("st-layers"),
        config(1_000_000_000_000, 64),
        &one_tensor(),
    );
    safetensors_dir(&at("st-header"), config(2, 64), &[0xff; 16]);

    let models: Api<Model> = Api::namespaced(client.clone(), &ns);
    for (name, format, path, _) in &hostile {
        models
            .create(&PostParams::default(), &model(name, *format, path))
            .await
            .unwrap();
    }
    for (name, _, _, words) in &hostile {
        let message = eventually(&format!("model {name} says why"), WAIT, || async {
            let m = models.get(name).await.ok()?;
            let c = m
                .status?
                .conditions
                .into_iter()
                .find(|c| c.type_ == CONDITION_RESOLVED && c.status == "False")?;
            (c.reason == "CorruptModel").then_some(c.message)
        })
        .await;
        assert!(message.contains(words), "{name}: {message}");
    }

    // Still running, still leading, and a good Model after them resolves.
    assert!(
        operator.0.try_wait().unwrap().is_none(),
        "the operator exited"
    );
    let metrics = shardplane_testkit::metrics::scrape(&admin).await;
    assert_eq!(
        shardplane_testkit::metrics::sum(&metrics, "shardplane_operator_leader "),
        1.0
    );
    models
        .create(
            &PostParams::default(),
            &model("good", ModelFormat::Gguf, &shardplane_testkit::test_model()),
        )
        .await
        .unwrap();
    eventually("the good model resolves", WAIT, || async {
        models.get("good").await.ok()?.status?.layers
    })
    .await;

    // Counts past their bounds never reach the operator.
    let mut d = fixtures::deployment("huge", "good", "pool", "strategy");
    d.spec.replicas = i32::MAX;
    let refused = Api::<ModelDeployment>::namespaced(client.clone(), &ns)
        .create(&PostParams::default(), &d)
        .await
        .expect_err("2147483647 replicas are refused");
    let refused = refused.to_string();
    assert!(
        refused.contains("spec.replicas") && refused.contains("1024"),
        "{refused}"
    );
    assert!(
        operator.0.try_wait().unwrap().is_none(),
        "the operator exited"
    );
}
