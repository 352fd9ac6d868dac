//! Safetensors repositories fetched into the agent's cache from the
//! stand-in hub (testkit): a stage gets the files of its own layers, each
//! checked against the hub's listing, and a URL source's cut file is told
//! from a whole one by its header.

use std::path::Path;

use shardplane_agent::cache::Cache;
use shardplane_agent::repository::{Source, fetch};
use shardplane_engine::StageLayout;
use shardplane_testkit::hub::{HUB_COMMIT, HUB_MLX_REPO, serve_repository};

/// A safetensors file of F32 `[2]` tensors named `names`.
fn safetensors(names: &[String]) -> Vec<u8> {
    let mut header = serde_json::Map::new();
    for (i, n) in names.iter().enumerate() {
        header.insert(
            n.clone(),
            serde_json::json!({"dtype": "F32", "shape": [2], "data_offsets": [i * 8, i * 8 + 8]}),
        );
    }
    let mut json = serde_json::to_vec(&header).unwrap();
    while !json.len().is_multiple_of(8) {
        json.push(b' ');
    }
    let mut out = (json.len() as u64).to_le_bytes().to_vec();
    out.extend(json);
    out.extend(vec![0u8; 8 * names.len()]);
    out
}

/// A four-layer repository: a.safetensors holds the embedding and layers
/// 0–1, b.safetensors layers 2–3, the norm and the head.
fn repository(dir: &Path) {
    let a: Vec<String> = ["model.embed_tokens.weight".to_string()]
        .into_iter()
        .chain((0..2).map(|l| format!("model.layers.{l}.mlp.up_proj.weight")))
        .collect();
    let b: Vec<String> = (2..4)
        .map(|l| format!("model.layers.{l}.mlp.up_proj.weight"))
        .chain(["model.norm.weight".into(), "lm_head.weight".into()])
        .collect();
    let mut map = serde_json::Map::new();
    for (names, file) in [(&a, "a.safetensors"), (&b, "b.safetensors")] {
        for n in names {
            map.insert(n.clone(), file.into());
        }
    }
    let write = |name: &str, bytes: &[u8]| std::fs::write(dir.join(name), bytes).unwrap();
    write("config.json", br#"{"model_type": "llama"}"#);
    write("tokenizer.json", b"{}");
    write(
        "model.safetensors.index.json",
        &serde_json::to_vec(&serde_json::json!({ "weight_map": map })).unwrap(),
    );
    write("a.safetensors", &safetensors(&a));
    write("b.safetensors", &safetensors(&b));
}

fn http() -> reqwest::Client {
    shardplane_models::http_client().unwrap()
}

fn wanted(layers: std::ops::Range<usize>) -> StageLayout {
    StageLayout::new(layers, 4).unwrap()
}

async fn hub_source<'a>(hub: &str, http: &'a reqwest::Client) -> Source<'a> {
    let listing =
        shardplane_models::hub::resolve_revision(http, hub, HUB_MLX_REPO, Some(HUB_COMMIT))
            .await
            .unwrap();
    Source {
        base: format!("{hub}/{HUB_MLX_REPO}/resolve/{HUB_COMMIT}"),
        http,
        listing: Some(listing),
    }
}

fn gets(seen: &shardplane_testkit::hub::Seen, file: &str) -> usize {
    seen.lock()
        .unwrap()
        .iter()
        .filter(|(r, _)| r.starts_with("GET ") && r.ends_with(&format!("/{file}")))
        .count()
}

#[tokio::test]
async fn a_stage_fetches_the_files_of_its_layers_and_a_later_stage_the_rest() {
    let repo = tempfile::tempdir().unwrap();
    repository(repo.path());
    let (hub, seen) = serve_repository(repo.path(), &[]).await;
    let cache_dir = tempfile::tempdir().unwrap();
    let cache = Cache::new(cache_dir.path().into(), http()).unwrap();
    let client = http();
    let source = hub_source(&hub, &client).await;
    let key = "hf:org/mlx/@commit";

    let dir = fetch(&cache, key, &source, &wanted(0..2), |_, _| {})
        .await
        .unwrap();
    for f in [
        "config.json",
        "tokenizer.json",
        "model.safetensors.index.json",
        "a.safetensors",
    ] {
        assert!(dir.join(f).is_file(), "{f} fetched");
    }
    assert!(
        !dir.join("b.safetensors").exists(),
        "layers 2-3 not fetched"
    );
    assert_eq!(gets(&seen, "b.safetensors"), 0);

    // The last stage adds its file; the first stage's is not fetched again.
    let mut progress = Vec::new();
    fetch(&cache, key, &source, &wanted(2..4), |d, t| {
        progress.push((d, t))
    })
    .await
    .unwrap();
    assert!(dir.join("b.safetensors").is_file());
    assert_eq!(gets(&seen, "a.safetensors"), 1);
    assert_eq!(gets(&seen, "b.safetensors"), 1);
    let b = std::fs::metadata(dir.join("b.safetensors")).unwrap().len();
    assert_eq!(progress.last(), Some(&(b, Some(b))));
    // Listed, with every byte, and kept over a restart.
    let bytes: u64 = std::fs::read_dir(&dir)
        .unwrap()
        .map(|e| e.unwrap().metadata().unwrap().len())
        .sum();
    let listed = |c: &Cache| c.listed().into_iter().find(|m| m.key == key).unwrap();
    assert_eq!(listed(&cache).bytes, bytes);
    let again = Cache::new(cache_dir.path().into(), http()).unwrap();
    assert_eq!(listed(&again).bytes, bytes);
    // Over budget and unpinned, the whole directory goes.
    let tight = again.with_budget(Some(1));
    assert_eq!(tight.make_room(0), [key.to_string()]);
    assert!(!dir.exists());
}

#[tokio::test]
async fn two_stages_starting_at_once_fetch_each_file_once() {
    let repo = tempfile::tempdir().unwrap();
    repository(repo.path());
    let (hub, seen) = serve_repository(repo.path(), &[]).await;
    let cache_dir = tempfile::tempdir().unwrap();
    let cache = Cache::new(cache_dir.path().into(), http()).unwrap();
    let client = http();
    let source = hub_source(&hub, &client).await;
    let whole = wanted(0..4);
    let (first, last) = tokio::join!(
        fetch(&cache, "k", &source, &whole, |_, _| {}),
        fetch(&cache, "k", &source, &whole, |_, _| {}),
    );
    assert_eq!(first.unwrap(), last.unwrap());
    for file in ["config.json", "a.safetensors", "b.safetensors"] {
        assert_eq!(gets(&seen, file), 1, "{file}");
    }
}

#[tokio::test]
async fn a_file_whose_hash_is_not_the_listed_one_is_discarded() {
    let repo = tempfile::tempdir().unwrap();
    repository(repo.path());
    let lie = "ab".repeat(32);
    let (hub, _) = serve_repository(repo.path(), &[("b.safetensors", &lie)]).await;
    let cache_dir = tempfile::tempdir().unwrap();
    let cache = Cache::new(cache_dir.path().into(), http()).unwrap();
    let client = http();
    let source = hub_source(&hub, &client).await;
    let e = fetch(&cache, "k", &source, &wanted(2..4), |_, _| {})
        .await
        .unwrap_err();
    assert_eq!(e.reason, "ChecksumMismatch", "{}", e.message);
    assert!(e.message.contains(&lie) && e.message.contains("discarded"));
    let dir = cache.repository_dir("k");
    assert!(!dir.join("b.safetensors").exists());
    assert!(!dir.join("b.safetensors.partial").exists());
    assert!(cache.listed().is_empty(), "nothing listed");
}

#[tokio::test]
async fn a_url_source_names_missing_files_and_tells_a_cut_file_by_its_header() {
    let repo = tempfile::tempdir().unwrap();
    repository(repo.path());
    let (hub, _) = serve_repository(repo.path(), &[]).await;
    let cache_dir = tempfile::tempdir().unwrap();
    let cache = Cache::new(cache_dir.path().into(), http()).unwrap();
    let client = http();
    let source = Source {
        base: format!("{hub}/{HUB_MLX_REPO}/resolve/{HUB_COMMIT}"),
        http: &client,
        listing: None,
    };
    // The server now holds a cut copy of b.
    let b = std::fs::read(repo.path().join("b.safetensors")).unwrap();
    std::fs::write(repo.path().join("b.safetensors"), &b[..b.len() - 5]).unwrap();
    let e = fetch(&cache, "u", &source, &wanted(2..4), |_, _| {})
        .await
        .unwrap_err();
    assert_eq!(e.reason, "CorruptWeights", "{}", e.message);
    assert!(
        e.message.contains(&format!("header promises {}", b.len())),
        "{}",
        e.message
    );
    // The first stage's file is whole.
    fetch(&cache, "u", &source, &wanted(0..1), |_, _| {})
        .await
        .unwrap();

    std::fs::remove_file(repo.path().join("tokenizer.json")).unwrap();
    let e = fetch(&cache, "v", &source, &wanted(0..1), |_, _| {})
        .await
        .unwrap_err();
    assert_eq!(e.reason, "WeightsNotFound");
    assert!(
        e.message.contains("tokenizer.json") && e.message.contains("tiktoken.model"),
        "{}",
        e.message
    );
    // Tiktoken ranks in its place (Kimi K2's layout) are fetched instead,
    // with the settings that name their code.
    std::fs::write(repo.path().join("tiktoken.model"), b"YQ== 0\n").unwrap();
    let e = fetch(&cache, "w", &source, &wanted(0..1), |_, _| {})
        .await
        .unwrap_err();
    assert!(e.message.contains("tokenizer_config.json"), "{}", e.message);
    std::fs::write(repo.path().join("tokenizer_config.json"), b"{}").unwrap();
    let dir = fetch(&cache, "w", &source, &wanted(0..1), |_, _| {})
        .await
        .unwrap();
    assert!(dir.join("tiktoken.model").is_file());
    assert!(!dir.join("tokenizer.json").exists());
}
