//! KV admission on a head stage, in process with the real test
//! model: generations reserve what they hold (their prompt and the next few
//! tokens) and grow as they decode; when one finds no room, the youngest is
//! preempted and resumes by recompute when there is room, and its answer is
//! the one it gives alone; for a whole model and for a pipeline, whose last
//! stage samples on from where it was.

use std::sync::Arc;
use std::sync::atomic::Ordering;

use shardplane_crds::LayerRange;
use shardplane_dataplane as dp;
use shardplane_engine::pipeline::{EngineKind, TextModel, load_model_stage};
use shardplane_engine::{LoadOptions, StageLayout};

use super::tests::{NS, sequences_become, serve, serve_at, shard};
use super::tests_head::{collect, request, reserved_becomes};
use crate::shards::ServedStage;
use crate::stage::StageWorker;

/// A stage of the test model, layers `layers` of 30, on a stage thread.
fn stage(layers: std::ops::Range<usize>) -> (StageWorker, Option<Arc<TextModel>>) {
    let options = LoadOptions {
        context_length: Some(512),
        prefix_cache_bytes: 64 << 20,
        ..Default::default()
    };
    let (stage, text) = load_model_stage(
        &shardplane_testkit::test_model(),
        StageLayout::new(layers, 30).unwrap(),
        EngineKind::Candle,
        &options,
    )
    .expect("the test model");
    let worker = crate::test_stage::quiet_worker("stage", stage);
    (worker, text.map(Arc::new))
}

/// The test model served in process, with prefix caches: whole as the
/// one-stage shard `d-0-0`, or as a pipeline of two (`d-0-0`, layers 0-14,
/// then `d-0-1`), each stage behind its own data plane. A client of the
/// head, its worker, the tokenizer, and what to keep until the end.
async fn instance(
    pipeline: bool,
) -> (
    dp::Client,
    StageWorker,
    Arc<TextModel>,
    Vec<tempfile::TempDir>,
) {
    instance_with(pipeline, None).await
}

/// Like [`instance`]; the later stage's Shard reports `later_kv` tokens of
/// KV (`status.kvBudgetTokens`) when given.
async fn instance_with(
    pipeline: bool,
    later_kv: Option<u64>,
) -> (
    dp::Client,
    StageWorker,
    Arc<TextModel>,
    Vec<tempfile::TempDir>,
) {
    let mut head = shard(0, None);
    head.spec.stage_count = if pipeline { 2 } else { 1 };
    // A later stage holds at least one context (see `later_stages`):
    // the Shard asks for contexts of what it reports.
    if let Some(kv) = later_kv {
        head.spec.kv_cache.context_length = kv as u32;
    }
    head.spec.layers = LayerRange {
        start: 0,
        end: if pipeline { 15 } else { 30 },
    };
    head.spec.next = pipeline.then(|| "d-0-1".to_string());
    let mut directory = vec![head.clone()];
    let mut dirs = Vec::new();
    if pipeline {
        let (worker, _) = stage(15..30);
        let mut last = shard(1, None);
        last.spec.stage_count = 2;
        last.spec.layers = LayerRange { start: 15, end: 30 };
        last.spec.next = None;
        let served = ServedStage {
            namespace: NS.into(),
            name: "d-0-1".into(),
            spec: last.spec.clone(),
            worker,
            text: None,
        };
        let (endpoint, dir) = serve_at(served, vec![last.clone()]).await;
        dirs.push(dir);
        directory.push(shard(1, Some(&endpoint)));
        let listed = directory.last_mut().unwrap();
        listed.spec = last.spec;
        if let Some(status) = listed.status.as_mut() {
            status.kv_budget_tokens = later_kv;
        }
    }
    let (worker, text) = stage(head.spec.layers.start as usize..head.spec.layers.end as usize);
    let text = text.expect("a first stage's tokenizer");
    let served = ServedStage {
        namespace: NS.into(),
        name: "d-0-0".into(),
        spec: head.spec.clone(),
        worker: worker.clone(),
        text: Some(text.clone()),
    };
    let (client, dir) = serve(served, directory).await;
    dirs.push(dir);
    (client, worker, text, dirs)
}

/// Tokens of each answer.
const ANSWER: u32 = 24;

/// The two prompts the tests run, as tokens.
fn prompts(text: &TextModel) -> Vec<Vec<u32>> {
    [
        "The three primary colours are",
        "Water boils at a temperature of",
    ]
    .iter()
    .map(|p| text.tokenizer.encode(p, true).unwrap())
    .collect()
}

/// Two prompts and the greedy answer each gets alone, with no budget.
async fn answers_alone(client: &dp::Client, text: &TextModel) -> (Vec<Vec<u32>>, Vec<Vec<u32>>) {
    let prompts = prompts(text);
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
    for pipeline in [false, true] {
        preempted_and_resumed(pipeline).await;
    }
}

async fn preempted_and_resumed(pipeline: bool) {
    let (client, worker, text, _dirs) = instance(pipeline).await;
    let (prompts, alone) = answers_alone(&client, &text).await;
    // Room for one whole answer and the other's prompt and first 16
    // tokens: whichever grows second finds none, and the younger of the two
    // is preempted; it resumes when the other ends.
    let (a, b) = (prompts[0].len() as u64, prompts[1].len() as u64);
    let budget = a + b + u64::from(ANSWER) + 16;
    worker
        .stats
        .kv
        .budget_tokens
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
    assert_eq!(worker.stats.kv.preemptions.load(Ordering::Relaxed), 1);
    assert_eq!(worker.stats.kv.waiting(), 0);
    // The recompute looked in the caches, and no later stage held none of
    // its tokens (which would pause the head's seeding).
    assert!(worker.stats.seeds(), "a later stage lacked the prefix");
    reserved_becomes(&worker, 0).await;
    sequences_become(&worker, 0).await;
}

#[tokio::test]
async fn the_youngest_generation_yields_its_room_to_an_older_one() {
    for pipeline in [false, true] {
        youngest_yields(pipeline).await;
    }
}

async fn youngest_yields(pipeline: bool) {
    use dp::generate_response::Event;
    let (client, worker, text, _dirs) = instance(pipeline).await;
    let (prompts, alone) = answers_alone(&client, &text).await;
    // Room for both prompts and 16 tokens of each, and 4 more: the older
    // one, the first to need more, cannot grow by 16 (or by the 8 it
    // lacks) beside the younger one.
    let (a, b) = (prompts[0].len() as u64, prompts[1].len() as u64);
    worker
        .stats
        .kv
        .budget_tokens
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
    assert_eq!(worker.stats.kv.preemptions.load(Ordering::Relaxed), 1);
    assert!(younger_done > older_done, "the younger one waited");
    assert_eq!(worker.stats.kv.waiting(), 0);
    reserved_becomes(&worker, 0).await;
    sequences_become(&worker, 0).await;
}

#[tokio::test]
async fn a_head_admits_within_the_kv_its_later_stages_hold() {
    // The later stage's machine holds 40 tokens, one context of the Shard;
    // the head's own budget is unset (no cap of its own).
    let (client, worker, text, _dirs) = instance_with(true, Some(40)).await;
    let prompts = prompts(&text);
    // Each prompt and 24 tokens fit; both prompts and 16 tokens each do not.
    assert!(prompts.iter().all(|p| p.len() + 24 <= 40));
    assert!(prompts[0].len() + prompts[1].len() + 32 > 40);
    // More than the later stage could hold even alone: refused at once, naming it.
    let refused = collect(&mut client.clone(), request(prompts[0].clone(), 64))
        .await
        .unwrap_err();
    assert_eq!(refused.code(), tonic::Code::ResourceExhausted);
    assert!(
        refused.message().contains("stage d-0-1's machine"),
        "{}",
        refused.message()
    );
    // The head's own budget is unset; the later stage's account is 40.
    assert_eq!(worker.stats.kv.budget(), 0);
    let full = worker
        .stats
        .kv
        .beyond(41)
        .expect("over the later stage's 40");
    assert_eq!((full.later.as_deref(), full.budget), (Some("d-0-1"), 40));
    // While one generation holds its prompt and next 16 tokens, another's
    // do not fit beside it: refused, with the 40 tokens named; alone, it
    // is answered.
    use dp::generate_response::Event;
    let mut first = client
        .clone()
        .generate(request(prompts[0].clone(), 24))
        .await
        .unwrap()
        .into_inner();
    loop {
        if let Some(Event::Delta(_)) = first.message().await.unwrap().unwrap().event {
            break;
        }
    }
    let busy = collect(&mut client.clone(), request(prompts[1].clone(), 24))
        .await
        .unwrap_err();
    assert_eq!(busy.code(), tonic::Code::ResourceExhausted);
    assert!(busy.message().contains("of the 40"), "{}", busy.message());
    // The head's account of the later stage (as its metrics show it).
    let usage = worker.stats.kv.later_usage();
    assert_eq!(
        (usage.len(), usage[0].0.as_str(), usage[0].2),
        (1, "d-0-1", 40)
    );
    assert!(usage[0].1 > 0, "{usage:?}");
    while first.message().await.unwrap().is_some() {}
    reserved_becomes(&worker, 0).await;
    let (_, tokens, _) = collect(&mut client.clone(), request(prompts[1].clone(), 24))
        .await
        .unwrap();
    assert_eq!(tokens.len(), 24);
    reserved_becomes(&worker, 0).await;
    sequences_become(&worker, 0).await;
}
