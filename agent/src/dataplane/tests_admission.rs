//! KV admission on a whole model's head stage, in process with the real test
//! model: generations reserve what they hold (their prompt and the next few
//! tokens) and grow as they decode; one that finds no room is preempted and
//! resumes by recompute when there is, and its answer is the one it gives
//! alone. The pipeline head's up-front reservation is in `tests_head.rs`.

use std::sync::Arc;
use std::sync::atomic::Ordering;

use shardplane_crds::LayerRange;
use shardplane_dataplane as dp;
use shardplane_engine::pipeline::{EngineKind, TextModel, load_model_stage};
use shardplane_engine::{LoadOptions, StageLayout};

use super::tests::{NS, sequences_become, serve, shard};
use super::tests_head::{collect, request};
use crate::scheduler::Budget;
use crate::shards::ServedStage;
use crate::stage::StageWorker;

/// The whole test model served in process as the one-stage shard `d-0-0`,
/// with a prefix cache.
async fn whole() -> (dp::Client, StageWorker, Arc<TextModel>, tempfile::TempDir) {
    let options = LoadOptions {
        context_length: Some(512),
        prefix_cache_bytes: 64 << 20,
        ..Default::default()
    };
    let (stage, text) = load_model_stage(
        &shardplane_testkit::test_model(),
        StageLayout::new(0..30, 30).unwrap(),
        EngineKind::Candle,
        &options,
    )
    .expect("the test model");
    let text = Arc::new(text.expect("a first stage's tokenizer"));
    let worker = StageWorker::start(
        "d-0-0",
        stage,
        Arc::new(|_| {}),
        Budget::default(),
        Box::new(|_| {}),
    );
    let mut me = shard(0, None);
    me.spec.stage_count = 1;
    me.spec.next = None;
    me.spec.layers = LayerRange { start: 0, end: 30 };
    let served = ServedStage {
        namespace: NS.into(),
        name: "d-0-0".into(),
        spec: me.spec.clone(),
        worker: worker.clone(),
        text: Some(text.clone()),
    };
    let (client, dir) = serve(served, vec![me]).await;
    (client, worker, text, dir)
}

#[tokio::test]
async fn a_generation_without_room_to_grow_is_preempted_and_resumes_with_the_same_answer() {
    let (client, worker, text, _dir) = whole().await;
    const ANSWER: u32 = 24;
    let prompts: Vec<Vec<u32>> = [
        "The three primary colours are",
        "Water boils at a temperature of",
    ]
    .iter()
    .map(|p| text.tokenizer.encode(p, true).unwrap())
    .collect();
    // Alone, with no budget: the answers to match.
    let mut alone = Vec::new();
    for p in &prompts {
        let (_, tokens, _) = collect(&mut client.clone(), request(p.clone(), ANSWER))
            .await
            .unwrap();
        assert_eq!(tokens.len(), ANSWER as usize, "{tokens:?}");
        alone.push(tokens);
    }
    // Room for one whole answer and the other's prompt and first 16
    // tokens: whichever grows second finds none and is preempted; it
    // resumes when the first ends.
    let (a, b) = (prompts[0].len() as u64, prompts[1].len() as u64);
    let budget = a + b + u64::from(ANSWER) + 16;
    worker
        .stats
        .kv_budget_tokens
        .store(budget, Ordering::Relaxed);
    let (mut one, mut other) = (client.clone(), client.clone());
    let (first, second) = tokio::join!(
        collect(&mut one, request(prompts[0].clone(), ANSWER)),
        collect(&mut other, request(prompts[1].clone(), ANSWER)),
    );
    assert_eq!(
        first.unwrap().1,
        alone[0],
        "{:?}",
        text.tokenizer.decode(&alone[0], true)
    );
    assert_eq!(
        second.unwrap().1,
        alone[1],
        "{:?}",
        text.tokenizer.decode(&alone[1], true)
    );
    assert_eq!(worker.stats.kv_preemptions.load(Ordering::Relaxed), 1);
    assert_eq!(worker.stats.kv_preempted_waiting.load(Ordering::Relaxed), 0);
    assert_eq!(
        worker.stats.kv_reserved_tokens.load(Ordering::Relaxed),
        0,
        "every generation gave its share back"
    );
    sequences_become(&worker, 0).await;

    // One that could not finish even alone is refused at once.
    worker
        .stats
        .kv_budget_tokens
        .store(a + 100, Ordering::Relaxed);
    let e = collect(&mut client.clone(), request(prompts[0].clone(), 400))
        .await
        .unwrap_err();
    assert_eq!(e.code(), tonic::Code::ResourceExhausted, "{e}");
    assert!(
        e.message().contains(&format!(
            "it may need {} tokens (prompt and max_tokens), more than the {} the shard holds",
            a + 400,
            a + 100
        )),
        "{e}"
    );
    assert_eq!(worker.stats.kv_reserved_tokens.load(Ordering::Relaxed), 0);
}
