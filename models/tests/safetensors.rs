//! Safetensors models: config.json and the weight files' headers give the
//! same numbers whether read from a directory or from a Hugging Face repository.

use std::collections::BTreeMap;
use std::path::Path;

use axum::Router;
use shardplane_models::{http_client, safetensors};
use shardplane_testkit::fixtures;
use tower_http::services::ServeDir;

const CONFIG: &str = r#"{"model_type": "llama", "num_hidden_layers": 2, "hidden_size": 64,
    "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 100,
    "intermediate_size": 128, "max_position_embeddings": 2048, "quantization": {"group_size": 64, "bits": 4}}"#;

/// Tensors of a 2-layer model: (name, bytes). Tied embeddings (no lm_head).
fn tensors() -> Vec<(String, u64)> {
    let mut t = vec![("model.embed_tokens.weight".to_string(), 100 * 64 * 2)];
    for l in 0..2 {
        for (name, bytes) in [
            ("self_attn.q_proj.weight", 2048u64),
            ("self_attn.q_proj.scales", 256),
            ("mlp.down_proj.weight", 4096),
        ] {
            t.push((format!("model.layers.{l}.{name}"), bytes + l as u64));
        }
    }
    t.push(("model.norm.weight".into(), 128));
    t
}

/// Writes a safetensors file holding `tensors` (zeros).
fn write_safetensors(path: &Path, tensors: &[(String, u64)]) {
    let mut header = serde_json::Map::new();
    let mut offset = 0u64;
    for (name, bytes) in tensors {
        header.insert(
            name.clone(),
            serde_json::json!({"dtype": "U8", "shape": [bytes], "data_offsets": [offset, offset + bytes]}),
        );
        offset += bytes;
    }
    header.insert("__metadata__".into(), serde_json::json!({"format": "mlx"}));
    let json = serde_json::to_vec(&header).unwrap();
    let mut out = (json.len() as u64).to_le_bytes().to_vec();
    out.extend(json);
    out.extend(std::iter::repeat_n(0u8, offset as usize));
    std::fs::write(path, out).unwrap();
}

fn check(status: &shardplane_crds::ModelStatus) {
    assert_eq!(status.architecture.as_deref(), Some("llama"));
    assert_eq!(
        (
            status.layers,
            status.hidden_size,
            status.kv_heads,
            status.head_dim
        ),
        (Some(2), Some(64), Some(2), Some(16))
    );
    assert_eq!(
        status.layer_bytes,
        vec![2048 + 256 + 4096, 2049 + 257 + 4097]
    );
    assert_eq!(status.embedding_bytes, Some(12800));
    assert_eq!(
        status.output_bytes,
        Some(12800 + 128),
        "tied head: the embedding again, plus the norm"
    );
    assert_eq!(status.kv_bytes_per_token, Some(2 * 2 * 16 * 4 * 2));
    assert_eq!(status.quantization.as_deref(), Some("4bit"));
    assert_eq!(status.context_length, Some(2048));
}

#[tokio::test]
async fn a_safetensors_model_resolves_from_a_directory_and_a_repository() {
    let spec = fixtures::model("m").spec;
    let root = tempfile::tempdir().unwrap();

    // One file.
    let single = root.path().join("org/single/resolve/main");
    std::fs::create_dir_all(&single).unwrap();
    std::fs::write(single.join("config.json"), CONFIG).unwrap();
    write_safetensors(&single.join("model.safetensors"), &tensors());
    check(&safetensors::resolve_dir(&single, &spec).unwrap());

    // Two files and an index.
    let sharded = root.path().join("org/sharded/resolve/main");
    std::fs::create_dir_all(&sharded).unwrap();
    std::fs::write(sharded.join("config.json"), CONFIG).unwrap();
    let all = tensors();
    let (a, b) = all.split_at(4);
    write_safetensors(&sharded.join("model-00001-of-00002.safetensors"), a);
    write_safetensors(&sharded.join("model-00002-of-00002.safetensors"), b);
    let map: BTreeMap<String, String> = a
        .iter()
        .map(|(n, _)| (n.clone(), "model-00001-of-00002.safetensors".into()))
        .chain(
            b.iter()
                .map(|(n, _)| (n.clone(), "model-00002-of-00002.safetensors".into())),
        )
        .collect();
    std::fs::write(
        sharded.join("model.safetensors.index.json"),
        serde_json::to_vec(&serde_json::json!({"weight_map": map})).unwrap(),
    )
    .unwrap();
    check(&safetensors::resolve_dir(&sharded, &spec).unwrap());

    // The same through a Hugging Face endpoint on loopback.
    let app = Router::new().fallback_service(ServeDir::new(root.path()));
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let base = format!("http://{}", listener.local_addr().unwrap());
    tokio::spawn(async move { axum::serve(listener, app).await.unwrap() });
    let http = http_client().unwrap();
    check(
        &safetensors::resolve_repo(&http, &format!("{base}/org/single/resolve/main"), &spec)
            .await
            .unwrap(),
    );
    check(
        &safetensors::resolve_repo(&http, &format!("{base}/org/sharded/resolve/main"), &spec)
            .await
            .unwrap(),
    );
    let e = safetensors::resolve_repo(&http, &format!("{base}/org/absent/resolve/main"), &spec)
        .await
        .unwrap_err();
    assert_eq!(e.reason, "SourceUnreachable");
}

#[test]
fn broken_safetensors_models_are_named() {
    let spec = fixtures::model("m").spec;
    let dir = tempfile::tempdir().unwrap();
    std::fs::write(
        dir.path().join("config.json"),
        CONFIG.replace("llama", "mamba"),
    )
    .unwrap();
    write_safetensors(&dir.path().join("model.safetensors"), &tensors());
    let e = safetensors::resolve_dir(dir.path(), &spec).unwrap_err();
    assert_eq!(e.reason, "UnsupportedArchitecture", "{}", e.message);
    assert!(e.message.contains("\"mamba\""));

    // A mixture of experts reports its experts.
    let moe = CONFIG.replace(
        r#""model_type": "llama""#,
        r#""model_type": "qwen3_moe", "num_experts": 8, "num_experts_per_tok": 2,
            "moe_intermediate_size": 32"#,
    );
    std::fs::write(dir.path().join("config.json"), moe).unwrap();
    write_safetensors(&dir.path().join("model.safetensors"), &tensors());
    let status = safetensors::resolve_dir(dir.path(), &spec).unwrap();
    assert_eq!(status.architecture.as_deref(), Some("qwen3moe"));
    assert_eq!(
        (status.experts, status.experts_per_token),
        (Some(8), Some(2))
    );

    // A mixture of experts that cannot route as it says.
    let moe = CONFIG.replace(
        r#""model_type": "llama""#,
        r#""model_type": "qwen3_moe", "num_experts": 4, "num_experts_per_tok": 8,
            "moe_intermediate_size": 32"#,
    );
    std::fs::write(dir.path().join("config.json"), moe).unwrap();
    let e = safetensors::resolve_dir(dir.path(), &spec).unwrap_err();
    assert_eq!(e.reason, "CorruptModel", "{}", e.message);
    assert!(
        e.message
            .contains("8 experts per token, but only 4 experts"),
        "{}",
        e.message
    );

    std::fs::write(dir.path().join("config.json"), CONFIG).unwrap();
    std::fs::write(
        dir.path().join("model.safetensors"),
        b"\x10\x00\x00\x00\x00\x00\x00\x00{not json",
    )
    .unwrap();
    let e = safetensors::resolve_dir(dir.path(), &spec).unwrap_err();
    assert_eq!(e.reason, "CorruptModel", "{}", e.message);

    let empty = tempfile::tempdir().unwrap();
    let e = safetensors::resolve_dir(empty.path(), &spec).unwrap_err();
    assert_eq!(e.reason, "SourceUnreadable");
}
