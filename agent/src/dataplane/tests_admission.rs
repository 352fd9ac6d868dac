//! KV admission on a whole model's head stage, in process with the real test
//! model: generations reserve what they hold (their prompt and the next few
//! tokens) and grow as they decode; when one finds no room, the youngest is
//! preempted and resumes by recompute when there is room, and its answer is
//! the one it gives alone. The pipeline head's up-front reservation is in `tests_head.rs`.

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

/// Tokens of each answer.
const ANSWER: u32 = 24;

/// Two prompts and the greedy answer each gets alone, with no budget.
async fn answers_alone(client: &dp::Client, text: &TextModel) -> (Vec<Vec<u32>>, Vec<Vec<u32>>) {
    let prompts: Vec<Vec<u32>> = [
        "The three primary colours are",
        "Water boils at a temperature of",
    ]
    .iter()
    .map(|p| text.tokenizer.encode(p, true).unwrap())
    .collect();
    let mut alone = Vec::new();
    for p in &prompts {
        let (_, tokens, _) = collect(&mut client.clone(), request(p.clone(), ANSWER))
            .await
            .unwrap();
        assert_eq!(tokens.len(), ANSWER as usize, "{tokens:?}");
        alone.push(tokens);
    }
    (prompts, alone)
}

#[tokio::test]
async fn a_generation_without_room_to_grow_is_preempted_and_resumes_with_the_same_answer() {
    let (client, worker, text, _dir) = whole().await;
    let (prompts, alone) = answers_alone(&client, &text).await;
    // Room for one whole answer and the other's prompt and first 16
    // tokens: whichever grows second finds none, and the younger of the two
    // is preempted; it resumes when the other ends.
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
    assert_eq!(worker.stats.kv_waiting(), 0);
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

#[tokio::test]
async fn the_youngest_generation_yields_its_room_to_an_older_one() {
    use dp::generate_response::Event;
    let (client, worker, text, _dir) = whole().await;
    let (prompts, alone) = answers_alone(&client, &text).await;
    // Room for both prompts and 16 tokens of each, and 4 more: the older
    // one, the first to need more, cannot grow by 16 (or by the 8 it
    // lacks) beside the younger one.
    let (a, b) = (prompts[0].len() as u64, prompts[1].len() as u64);
    worker
        .stats
        .kv_budget_tokens
        .store(a + b + 32 + 4, Ordering::Relaxed);
    let mut older = client
        .clone()
        .generate(request(prompts[0].clone(), ANSWER))
        .await
        .unwrap()
        .into_inner();
    let mut first = Vec::new();
    while first.len() < 4 {
        if let Some(Event::Delta(d)) = older.message().await.unwrap().unwrap().event {
            first.extend(d.tokens);
        }
    }
    let mut c = client.clone();
    let young = prompts[1].clone();
    let younger = tokio::spawn(async move {
        let answer = collect(&mut c, request(young, ANSWER)).await;
        (answer, std::time::Instant::now())
    });
    loop {
        match older.message().await.unwrap().unwrap().event {
            Some(Event::Delta(d)) => first.extend(d.tokens),
            Some(Event::Finished(_)) => break,
            _ => {}
        }
    }
    let older_done = std::time::Instant::now();
    let (answer, younger_done) = younger.await.unwrap();
    assert_eq!(first, alone[0]);
    assert_eq!(answer.unwrap().1, alone[1]);
    // The younger one was preempted, and resumed once the older one ended.
    assert_eq!(worker.stats.kv_preemptions.load(Ordering::Relaxed), 1);
    assert!(younger_done > older_done, "the younger one waited");
    assert_eq!(worker.stats.kv_waiting(), 0);
    assert_eq!(worker.stats.kv_reserved_tokens.load(Ordering::Relaxed), 0);
    sequences_become(&worker, 0).await;
}
