//! An agent copies weights from a peer, verified, and resumes an
//! interrupted copy.

use super::*;

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
