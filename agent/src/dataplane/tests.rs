//! The relay of a middle stage, in process and in seconds: hidden states go
//! on to the next stage found in the watch store, answers come back, the
//! sequence's cache lives exactly as long as its stream, and a next stage
//! that is not ready or fails is an error the stage before hears. The next
//! stage is a fake data plane on a loopback port; the middle stage runs the
//! echoing test stage. Real agents run the same paths in
//! `cli/tests/data_plane/`.

use std::sync::atomic::Ordering;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use kube::runtime::reflector;
use kube::runtime::watcher;
use shardplane_crds::{LayerRange, Shard, ShardPhase, ShardStatus};
use shardplane_dataplane as dp;
use shardplane_engine::constraint::TokenMask;
use shardplane_testkit::data_plane::FakeDataPlane;
use tokio::sync::mpsc;
use tokio_stream::wrappers::ReceiverStream;
use tonic::{Status, Streaming};

use super::Service;
use crate::cache::Cache;
use crate::metrics::Metrics;
use crate::shards::{ServedStage, ShardSet};
use crate::stage::StageWorker;
use crate::test_stage::Echo;

pub(super) const NS: &str = "relay";
const TOKEN: &str = "in-process-data-plane-token";

pub(super) fn token() -> dp::Token {
    dp::Token::new(TOKEN).unwrap()
}

/// The rows each step brought.
type Rows = Arc<Mutex<Vec<Vec<f32>>>>;

/// A fake last stage on a loopback port: answers each step with `100 +`
/// the last row it got (or, when the step allows only some tokens, the
/// lowest of them), or fails at the step numbered `fail_at`. Its endpoint
/// and the rows it got.
async fn serve_last(fail_at: Option<usize>) -> (String, Rows) {
    let rows = Rows::default();
    let got = rows.clone();
    let endpoint = FakeDataPlane::stepping(move |n, step| {
        if fail_at == Some(n) {
            return Err(Status::internal("the last stage broke"));
        }
        let hidden = dp::decode_hidden(step.hidden.as_ref().unwrap()).unwrap();
        let mut token = 100 + *hidden.last().unwrap() as u32;
        if !step.allowed.is_empty() {
            let mask = TokenMask::from_bytes(&step.allowed).unwrap();
            token = (0..).find(|&t| mask.allows(t)).unwrap();
        }
        got.lock().unwrap().push(hidden);
        Ok(dp::ForwardResponse {
            token,
            sampled: step.sample,
            ..Default::default()
        })
    })
    .serve(token())
    .await;
    (endpoint, rows)
}

/// Stage `stage` of 3 of deployment `d`, Ready at `endpoint` when given.
pub(super) fn shard(stage: u32, endpoint: Option<&str>) -> Shard {
    let mut s = shardplane_testkit::fixtures::shard(
        "d",
        &format!("node-{stage}"),
        stage,
        3,
        LayerRange {
            start: stage * 10,
            end: (stage + 1) * 10,
        },
    );
    s.metadata.namespace = Some(NS.into());
    s.status = endpoint.map(|e| ShardStatus {
        phase: Some(ShardPhase::Ready),
        endpoint: Some(e.into()),
        ..Default::default()
    });
    s
}

/// The middle stage `d-0-1` served in process, its next stage `d-0-2` as
/// `next` says; the stage's worker, to watch its sequences.
async fn middle(next: Option<Shard>) -> (dp::Client, StageWorker, tempfile::TempDir) {
    middle_on(next, Echo::middle()).await
}

/// [`middle`], running `echo`.
async fn middle_on(
    next: Option<Shard>,
    echo: Echo,
) -> (dp::Client, StageWorker, tempfile::TempDir) {
    let (mut stage, me) = middle_stage();
    stage.worker = crate::test_stage::quiet_worker("d-0-1", Box::new(echo));
    let worker = stage.worker.clone();
    let (client, dir) = serve(stage, next.into_iter().chain([me]).collect()).await;
    (client, worker, dir)
}

/// The middle stage `d-0-1` (on node-1) running the echoing test stage, and its Shard.
pub(super) fn middle_stage() -> (ServedStage, Shard) {
    let worker = crate::test_stage::quiet_worker("d-0-1", Box::new(Echo::middle()));
    let me = shard(1, None);
    let stage = ServedStage {
        namespace: NS.into(),
        name: "d-0-1".into(),
        spec: me.spec.clone(),
        worker,
        text: None,
    };
    (stage, me)
}

/// Serves `stage` in process on a loopback port, with `directory` the
/// Shards its watch store holds; a client, and the cache's directory.
pub(super) async fn serve(
    stage: ServedStage,
    directory: Vec<Shard>,
) -> (dp::Client, tempfile::TempDir) {
    let (endpoint, dir) = serve_at(stage, directory).await;
    (
        dp::client(dp::channel(&endpoint, None).unwrap(), token()),
        dir,
    )
}

/// Like [`serve`]: the endpoint, and the cache's directory.
pub(super) async fn serve_at(
    stage: ServedStage,
    directory: Vec<Shard>,
) -> (String, tempfile::TempDir) {
    serve_with(stage, directory, None).await
}

/// Like [`serve_at`], over TLS with `tls` when given.
pub(super) async fn serve_with(
    stage: ServedStage,
    directory: Vec<Shard>,
    tls: Option<Arc<dp::tls::Tls>>,
) -> (String, tempfile::TempDir) {
    let shards = ShardSet::new("in-process");
    shards.insert(stage);
    let (store, mut writer) = reflector::store();
    for s in directory {
        writer.apply_watcher_event(&watcher::Event::Apply(s));
    }
    let (nodes, _) = reflector::store();
    let dir = tempfile::tempdir().unwrap();
    let cache = Cache::new(dir.path().into(), shardplane_models::http_client().unwrap()).unwrap();
    let service = Service::new(
        "node-1".into(),
        shards,
        store,
        nodes,
        dp::Peers::new(token(), tls.clone()),
        Metrics::new(),
        cache,
    );
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let endpoint = listener.local_addr().unwrap().to_string();
    tokio::spawn(
        tonic::transport::Server::builder()
            .add_service(service.into_server(token()))
            .serve_with_incoming(dp::tls::incoming(listener, tls, |_| {}).unwrap()),
    );
    (endpoint, dir)
}

pub(super) fn open() -> dp::ForwardRequest {
    dp::ForwardRequest {
        message: Some(dp::forward_request::Message::Open(dp::Open {
            shard: Some(dp::ShardRef {
                namespace: NS.into(),
                name: "d-0-1".into(),
            }),
            sequence: 7,
            sampling: Some(dp::Sampling::default()),
            prompt: vec![1, 2, 3],
            banned: Vec::new(),
            generated: 0,
            cached: 0,
            replaces: 0,
        })),
    }
}

fn step(rows: usize) -> dp::ForwardRequest {
    dp::ForwardRequest {
        message: Some(dp::forward_request::Message::Step(dp::Step {
            hidden: Some(dp::Hidden {
                tokens: rows as u32,
                width: 1,
                data: dp::encode_f32(&vec![0.5; rows]),
            }),
            sample: true,
            allowed: Vec::new(),
            tokens: Vec::new(),
        })),
    }
}

/// Opens the sequence on the middle stage; the sender of further messages
/// and the answers.
async fn start(
    client: &mut dp::Client,
) -> Result<
    (
        mpsc::Sender<dp::ForwardRequest>,
        Streaming<dp::ForwardResponse>,
    ),
    Status,
> {
    start_with(client, open()).await
}

/// [`start`] with `open`.
async fn start_with(
    client: &mut dp::Client,
    open: dp::ForwardRequest,
) -> Result<
    (
        mpsc::Sender<dp::ForwardRequest>,
        Streaming<dp::ForwardResponse>,
    ),
    Status,
> {
    let (requests, outbound) = mpsc::channel(8);
    requests.send(open).await.unwrap();
    let answers = client
        .forward(ReceiverStream::new(outbound))
        .await?
        .into_inner();
    Ok((requests, answers))
}

pub(super) async fn sequences_become(worker: &StageWorker, n: u64) {
    for _ in 0..100 {
        if worker.stats.sequences.load(Ordering::Relaxed) == n {
            return;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    panic!("the stage still holds a sequence");
}

#[tokio::test]
async fn a_middle_stage_passes_hidden_states_on_and_relays_the_answers_back() {
    let (endpoint, rows) = serve_last(None).await;
    let (mut client, worker, _dir) = middle(Some(shard(2, Some(&endpoint)))).await;
    let (requests, mut answers) = start(&mut client).await.unwrap();
    // A prompt of 3 rows, then one decode row: the middle stage's rows are
    // their positions in the sequence, so the cache carried over.
    requests.send(step(3)).await.unwrap();
    let first = answers.message().await.unwrap().unwrap();
    requests.send(step(1)).await.unwrap();
    let second = answers.message().await.unwrap().unwrap();
    assert_eq!((first.token, first.sampled), (102, true));
    assert_eq!((second.token, second.sampled), (103, true));
    // A step whose token must come from a grammar's set: the set goes on
    // to the last stage unchanged.
    let mut constrained = step(1);
    if let Some(dp::forward_request::Message::Step(s)) = &mut constrained.message {
        s.allowed = TokenMask::of(&[7, 4000]).to_bytes();
    }
    requests.send(constrained).await.unwrap();
    let third = answers.message().await.unwrap().unwrap();
    assert_eq!((third.token, third.sampled), (7, true));
    assert_eq!(
        *rows.lock().unwrap(),
        vec![vec![0.0, 1.0, 2.0], vec![3.0], vec![4.0]]
    );
    assert_eq!(worker.stats.sequences.load(Ordering::Relaxed), 1);
    // The stage before goes away: the sequence is freed.
    drop(requests);
    drop(answers);
    sequences_become(&worker, 0).await;
}

/// What a fake last stage saw: each step's token ids, and each open's
/// `replaces`.
type Told = (Arc<Mutex<Vec<Vec<u32>>>>, Arc<Mutex<Vec<u64>>>);

/// A fake last stage that records each step's token ids and each open's
/// `replaces`, and answers `100 +` its last row; it refuses opens with a
/// cached prefix when `lacks`.
async fn last_telling_tokens(lacks: bool) -> (String, Told) {
    let told: Told = Default::default();
    let (got, opens) = (told.0.clone(), told.1.clone());
    let endpoint = FakeDataPlane::stepping(move |_, step| {
        let hidden = dp::decode_hidden(step.hidden.as_ref().unwrap()).unwrap();
        got.lock().unwrap().push(step.tokens);
        Ok(dp::ForwardResponse {
            token: 100 + *hidden.last().unwrap() as u32,
            sampled: step.sample,
            ..Default::default()
        })
    })
    .on_open(move |open| {
        opens.lock().unwrap().push(open.replaces);
        match lacks && open.cached > 0 {
            true => {
                let mut refusal = Status::aborted("holds 0 of them");
                refusal.metadata_mut().insert(dp::CACHED_HEADER, 0.into());
                Err(refusal)
            }
            false => Ok(()),
        }
    })
    .serve(token())
    .await;
    (endpoint, told)
}

#[tokio::test]
async fn a_later_stage_takes_the_head_s_cached_prefix_from_its_own_cache_or_refuses_the_open() {
    let cached = |n: u32| {
        let mut o = open();
        if let Some(dp::forward_request::Message::Open(open)) = &mut o.message {
            open.cached = n;
        }
        o
    };
    let holding = |n| {
        let mut echo = Echo::middle();
        echo.cached = n;
        echo
    };
    // It holds 2 tokens of the prompt [1, 2, 3] and says so: the first row
    // it is sent is at position 2, and goes on with its token id.
    let (endpoint, told) = last_telling_tokens(false).await;
    let next = || Some(shard(2, Some(&endpoint)));
    let (mut client, worker, _dir) = middle_on(next(), holding(2)).await;
    let (requests, outbound) = mpsc::channel(8);
    requests.send(cached(2)).await.unwrap();
    let response = client.forward(ReceiverStream::new(outbound)).await.unwrap();
    assert_eq!(response.metadata().get(dp::CACHED_HEADER).unwrap(), "2");
    let mut answers = response.into_inner();
    let mut told_step = step(1);
    if let Some(dp::forward_request::Message::Step(s)) = &mut told_step.message {
        s.tokens = vec![3];
    }
    requests.send(told_step).await.unwrap();
    assert_eq!(answers.message().await.unwrap().unwrap().token, 102);
    assert_eq!(*told.0.lock().unwrap(), vec![vec![3]]);
    drop((requests, answers));
    sequences_become(&worker, 0).await;
    assert_eq!(
        worker.stats.looks(),
        (3, 2),
        "the prompt's 3 tokens, 2 reused"
    );

    // It holds 1 of the 2, or all of them while the stage after it holds
    // none: ABORTED, saying how many the short stage holds (the head asks
    // again with as many, or runs the whole prompt), and the sequence it
    // started goes; a count beyond the prompt is refused.
    let (refusing, _) = last_telling_tokens(true).await;
    for (echo, after, says, holds) in [
        (
            holding(1),
            endpoint.clone(),
            "holds 1 of the 2 prompt tokens",
            "1",
        ),
        (holding(2), refusing, "holds 0 of them", "0"),
    ] {
        let (mut client, worker, _dir) = middle_on(Some(shard(2, Some(&after))), echo).await;
        let e = start_with(&mut client, cached(2)).await.err().unwrap();
        assert_eq!(e.code(), tonic::Code::Aborted, "{e:?}");
        assert!(e.message().contains(says), "{e:?}");
        assert_eq!(e.metadata().get(dp::CACHED_HEADER).unwrap(), holds);
        let e = start_with(&mut client, cached(3)).await.err().unwrap();
        assert_eq!(e.code(), tonic::Code::InvalidArgument, "{e:?}");
        sequences_become(&worker, 0).await;
        assert_eq!(
            worker.stats.looks(),
            (0, 0),
            "a refused ask counts at the head"
        );
    }
}

#[tokio::test]
async fn a_recompute_s_open_frees_the_sequence_it_replaces_before_taking_from_the_cache() {
    let opening = |sequence: u64, cached: u32, replaces: u64| {
        let mut o = open();
        if let Some(dp::forward_request::Message::Open(open)) = &mut o.message {
            (open.sequence, open.cached, open.replaces) = (sequence, cached, replaces);
            open.prompt = vec![1, 2, 3, 4, 5, 6];
        }
        o
    };
    let told = |ids: Vec<u32>| {
        let mut s = step(ids.len());
        if let Some(dp::forward_request::Message::Step(s)) = &mut s.message {
            s.tokens = ids;
        }
        s
    };
    let (endpoint, (_, replaced)) = last_telling_tokens(false).await;
    let mut echo = Echo::middle();
    echo.remember = true;
    let (mut client, worker, _dir) = middle_on(Some(shard(2, Some(&endpoint))), echo).await;
    // Sequence 7 runs the prompt [1, 2, 3] and decodes 4 and 5; then the
    // head preempts it. Its stream's close has not reached this stage yet:
    // the stage keeps blocks of the prompt only.
    let (old, mut old_answers) = start_with(&mut client, opening(7, 0, 0)).await.unwrap();
    for ids in [vec![1, 2, 3], vec![4], vec![5]] {
        old.send(told(ids)).await.unwrap();
        old_answers.message().await.unwrap().unwrap();
    }
    // A recompute of [1..=6] taking 5 from the caches, not naming 7: short.
    let e = start_with(&mut client, opening(8, 5, 0))
        .await
        .err()
        .unwrap();
    assert_eq!(e.code(), tonic::Code::Aborted, "{e:?}");
    assert!(e.message().contains("holds 3 of the 5"), "{e:?}");
    // Naming 7: it goes first, its tokens kept, and the 5 are taken.
    let (requests, outbound) = mpsc::channel(8);
    requests.send(opening(9, 5, 7)).await.unwrap();
    let response = client.forward(ReceiverStream::new(outbound)).await.unwrap();
    assert_eq!(response.metadata().get(dp::CACHED_HEADER).unwrap(), "5");
    sequences_become(&worker, 1).await;
    assert_eq!(
        *replaced.lock().unwrap(),
        vec![0, 7],
        "named down the pipeline"
    );
    // A step of 7 still on its way is refused, not run at position 0.
    old.send(told(vec![6])).await.unwrap();
    let e = old_answers.message().await.unwrap_err();
    assert!(e.message().contains("replaced"), "{e:?}");
    let mut answers = response.into_inner();
    requests.send(told(vec![6])).await.unwrap();
    assert_eq!(answers.message().await.unwrap().unwrap().token, 105);
    // The old stream's close frees nothing more; the new one's, the rest.
    drop((old, old_answers));
    requests.send(told(vec![7])).await.unwrap();
    assert_eq!(answers.message().await.unwrap().unwrap().token, 106);
    sequences_become(&worker, 1).await;
    drop((requests, answers));
    sequences_become(&worker, 0).await;
}

#[tokio::test]
async fn a_failure_of_the_next_stage_reaches_the_stage_before_and_frees_the_sequence() {
    let (endpoint, _) = serve_last(Some(1)).await;
    let (mut client, worker, _dir) = middle(Some(shard(2, Some(&endpoint)))).await;
    let (requests, mut answers) = start(&mut client).await.unwrap();
    requests.send(step(2)).await.unwrap();
    assert_eq!(answers.message().await.unwrap().unwrap().token, 101);
    requests.send(step(1)).await.unwrap();
    let e = answers.message().await.unwrap_err();
    assert!(e.message().contains("the last stage broke"), "{e:?}");
    drop(requests);
    sequences_become(&worker, 0).await;
}

#[tokio::test]
async fn a_next_stage_unknown_or_not_ready_is_unavailable() {
    for next in [None, Some(shard(2, None))] {
        let (mut client, _worker, _dir) = middle(next.clone()).await;
        let e = start(&mut client).await.err().unwrap();
        assert_eq!(e.code(), tonic::Code::Unavailable, "{e:?}");
        let says = if next.is_none() {
            "not known yet"
        } else {
            "not ready"
        };
        assert!(e.message().contains(says), "{e:?}");
    }
}

#[tokio::test]
async fn a_shard_this_node_does_not_serve_is_not_found() {
    let (mut client, _worker, _dir) = middle(None).await;
    let (requests, outbound) = mpsc::channel(8);
    let mut wrong = open();
    if let Some(dp::forward_request::Message::Open(o)) = &mut wrong.message {
        o.shard.as_mut().unwrap().name = "d-0-9".into();
    }
    requests.send(wrong).await.unwrap();
    let e = client
        .forward(ReceiverStream::new(outbound))
        .await
        .err()
        .unwrap();
    assert_eq!(e.code(), tonic::Code::NotFound, "{e:?}");
}

#[test]
fn later_stages_count_their_own_sliding_layers_with_their_agents_prompt_step() {
    use crate::kv_budget::KvCost;
    use shardplane_crds::{InferenceNode, InferenceNodeSpec, InferenceNodeStatus};
    // The head d-0-1 (layers 10-19 of 30) of a model whose every sixth layer
    // is global, the others a window of 4; its next stage d-0-2 runs layers
    // 20-29 (8 sliding, 2 global) on node-2, whose steps take 2048 prompt
    // tokens, and reports a budget below one context of 8192.
    let (mut stage, _) = middle_stage();
    let windows: Vec<_> = (0..30).map(|l| (l % 6 != 5).then_some(4)).collect();
    stage.worker.windows = windows.clone().into();
    stage.spec.kv_cache.context_length = 8192;
    let mut later = shard(2, Some("127.0.0.1:1"));
    later.status.as_mut().unwrap().kv_budget_tokens = Some(1000);
    let (directory, mut writer) = reflector::store();
    writer.apply_watcher_event(&watcher::Event::Apply(later.clone()));
    let (nodes, mut node_writer) = reflector::store();
    let mut node = InferenceNode::new("node-2", InferenceNodeSpec::default());
    node.status = Some(InferenceNodeStatus {
        prompt_step_tokens: Some(2048),
        ..Default::default()
    });
    node_writer.apply_watcher_event(&watcher::Event::Apply(node));
    let cost = KvCost::of_windows(&windows[20..30], 2048);
    // 2 full layers and 8 holding 4 + 64 kept, 256 and 256 more, and 2048.
    assert_eq!(cost.units(8192), (2 * 8192 + 8 * 2628_u64).div_ceil(10));
    let found = super::next_stage::later_stages(&directory, &nodes, &stage);
    assert_eq!(found.len(), 1);
    assert_eq!(
        (found[0].shard.as_str(), &found[0].cost, found[0].budget),
        ("d-0-2", &cost, cost.units(8192))
    );
    // A node that reports no step (an older agent, whose budget is in
    // tokens): counted in tokens, the floor one context.
    let (nodes, _) = reflector::store();
    let found = super::next_stage::later_stages(&directory, &nodes, &stage);
    assert_eq!(
        (&found[0].cost, found[0].budget),
        (&KvCost::default(), 8192)
    );
    // A later stage not Ready sets no budget.
    later.status.as_mut().unwrap().phase = Some(ShardPhase::Loading);
    writer.apply_watcher_event(&watcher::Event::Apply(later));
    assert!(super::next_stage::later_stages(&directory, &nodes, &stage).is_empty());
}
