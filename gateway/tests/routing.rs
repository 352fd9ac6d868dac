//! The router's choices, in process and in seconds: ready instances only,
//! least outstanding first, a failed instance passed over before the first
//! token, an answer resumed on another instance after it, busy instances
//! waited for and then a 429, unknown models a 404. The head stages are fake
//! data planes on loopback ports; the watch stores are filled by hand. The
//! same paths run against real agents in `cli/tests/gateway.rs`.

use std::sync::{Arc, Mutex};
use std::time::Duration;

use futures::StreamExt;
use kube::runtime::reflector::{self, Store, store::Writer};
use kube::runtime::watcher;
use shardplane_crds::{LayerRange, Model, ModelDeployment, Shard, ShardPhase, ShardStatus};
use shardplane_dataplane as dp;
use shardplane_dataplane::tonic::Status;
use shardplane_gateway::metrics::Metrics;
use shardplane_gateway::protocol::{ApiError, Event, Events, Input, Kind, Prompt};
use shardplane_gateway::routing::Router;
use shardplane_testkit::data_plane::FakeDataPlane;
use shardplane_testkit::fixtures;

const NS: &str = "in-process";
const TOKEN: &str = "in-process-data-plane-token";
/// Tokens of a whole answer: "w0 w1 … w5 ".
const WORDS: usize = 6;

/// How a fake head stage answers `Generate`.
#[derive(Debug, Clone, Copy)]
enum Behaviour {
    /// The whole answer, after the tokens resumed from.
    Answer,
    /// The answer up to token `n`, then the stage fails.
    FailAt(usize),
    /// The answer up to token `n`, then an error with this code.
    FailAtWith(usize, dp::tonic::Code),
    /// Refused: too much work queued.
    Busy,
}

/// The tokens each call resumed from.
type Calls = Arc<Mutex<Vec<Vec<u32>>>>;

fn event(e: dp::generate_response::Event) -> Result<dp::GenerateResponse, Status> {
    Ok(dp::GenerateResponse { event: Some(e) })
}

/// What a fake head stage behaving as `behaviour` streams for `request`.
fn answer(
    behaviour: Behaviour,
    calls: &Calls,
    request: dp::GenerateRequest,
) -> Result<Vec<Result<dp::GenerateResponse, Status>>, Status> {
    use dp::generate_response::Event as E;
    let resume = request.resume.map(|t| t.ids).unwrap_or_default();
    calls.lock().unwrap().push(resume.clone());
    if let Behaviour::Busy = behaviour {
        return Err(Status::resource_exhausted("about 40 s of work is queued"));
    }
    let mut events = vec![event(E::Started(dp::Started {
        prompt_tokens: 3,
        sequence: 1,
    }))];
    for i in resume.len()..WORDS {
        if let Behaviour::FailAt(n) = behaviour
            && i == n
        {
            events.push(Err(Status::unavailable("the stage went away")));
            return Ok(events);
        }
        if let Behaviour::FailAtWith(n, code) = behaviour
            && i == n
        {
            events.push(Err(Status::new(code, "this answer went wrong")));
            return Ok(events);
        }
        events.push(event(E::Delta(dp::Delta {
            text: format!("w{i} "),
            tokens: vec![i as u32],
            ..Default::default()
        })));
    }
    events.push(event(E::Finished(dp::Finished {
        reason: dp::FinishReason::Stop as i32,
        prompt_tokens: 3,
        completion_tokens: WORDS as u32,
        ..Default::default()
    })));
    Ok(events)
}

fn token() -> dp::Token {
    dp::Token::new(TOKEN).unwrap()
}

/// A fake head stage behaving as `behaviour` on a loopback port: its
/// endpoint and its calls.
async fn serve(behaviour: Behaviour) -> (String, Calls) {
    let calls = Calls::default();
    let seen = calls.clone();
    let endpoint = FakeDataPlane::generating(move |r| answer(behaviour, &seen, r))
        .serve(token())
        .await;
    (endpoint, calls)
}

/// The one-stage head Shard of instance `i` of deployment `chat`, Ready at
/// `endpoint` (or loading, without one).
fn head(i: u32, endpoint: Option<&str>) -> Shard {
    let mut s = fixtures::shard(
        "chat",
        &format!("node-{i}"),
        0,
        1,
        LayerRange { start: 0, end: 30 },
    );
    s.metadata.name = Some(format!("chat-{i}-0"));
    s.metadata.namespace = Some(NS.into());
    s.spec.instance = i;
    s.status = Some(ShardStatus {
        phase: Some(if endpoint.is_some() {
            ShardPhase::Ready
        } else {
            ShardPhase::Loading
        }),
        endpoint: endpoint.map(str::to_string),
        ..Default::default()
    });
    s
}

fn store<K>(objects: Vec<K>) -> (Store<K>, Writer<K>)
where
    K: kube::Resource<DynamicType = ()> + Clone + 'static,
{
    let (reader, mut writer) = reflector::store();
    for o in objects {
        writer.apply_watcher_event(&watcher::Event::Apply(o));
    }
    (reader, writer)
}

/// A router over deployment `chat` of model `m` with `shards`; the Shards'
/// writer, to change them while an answer runs.
fn router(shards: Vec<Shard>) -> (Router, Writer<Shard>) {
    let mut model = fixtures::model("m");
    model.metadata.namespace = Some(NS.into());
    let mut deployment = fixtures::deployment("chat", "m", "pool", "strategy");
    deployment.metadata.namespace = Some(NS.into());
    let http = shardplane_gateway::external::http_client().unwrap();
    // Nothing here reads the API server (no external endpoint has a Secret).
    let client =
        kube::Client::try_from(kube::Config::new("http://127.0.0.1:9".parse().unwrap())).unwrap();
    let (deployments, _) = store::<ModelDeployment>(vec![deployment]);
    let (models, _) = store::<Model>(vec![model]);
    let (shards, writer) = store(shards);
    let router = Router::new(
        client,
        deployments,
        models,
        shards,
        token(),
        http,
        Metrics::new(),
    )
    .with_busy_wait(Duration::from_millis(700));
    (router, writer)
}

fn prompt() -> Prompt {
    Prompt {
        input: Input::Text("say six words".into()),
        sampling: dp::Sampling::default(),
        grammar: None,
        tools: None,
    }
}

async fn text(mut events: Events) -> Result<String, ApiError> {
    let mut text = String::new();
    while let Some(e) = events.next().await {
        match e? {
            Event::Text(t) => text.push_str(&t),
            Event::ToolCall(c) => panic!("a call nobody offered tools for: {c:?}"),
            Event::Logprobs(l) => panic!("log-probabilities nobody asked for: {l:?}"),
            Event::Reasoning(r) => panic!("reasoning from a model that does not think: {r:?}"),
            Event::Waiting => {}
            Event::Done { .. } => return Ok(text),
        }
    }
    panic!("the answer ended without Done")
}

const WHOLE: &str = "w0 w1 w2 w3 w4 w5 ";

#[tokio::test]
async fn an_answer_comes_from_a_ready_instance_and_loading_ones_are_skipped() {
    let (ready, calls) = serve(Behaviour::Answer).await;
    let (router, _) = router(vec![head(0, None), head(1, Some(&ready))]);
    let answer = router.complete("m", &prompt()).await.unwrap();
    assert_eq!(answer.prompt_tokens, 3);
    assert_eq!(text(answer.events).await.unwrap(), WHOLE);
    assert_eq!(*calls.lock().unwrap(), vec![Vec::<u32>::new()]);
}

#[tokio::test]
async fn an_instance_that_fails_before_its_first_token_is_passed_over() {
    let (failing, failed) = serve(Behaviour::FailAt(0)).await;
    // Nothing listens where the second says it is.
    let gone = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let nowhere = gone.local_addr().unwrap().to_string();
    drop(gone);
    let (good, answered) = serve(Behaviour::Answer).await;
    let (router, _) = router(vec![
        head(0, Some(&failing)),
        head(1, Some(&nowhere)),
        head(2, Some(&good)),
    ]);
    for _ in 0..4 {
        let answer = router.complete("m", &prompt()).await.unwrap();
        assert_eq!(text(answer.events).await.unwrap(), WHOLE);
    }
    assert_eq!(answered.lock().unwrap().len(), 4);
    assert!(
        failed.lock().unwrap().iter().all(Vec::is_empty),
        "nothing is resumed before a first token"
    );
}

#[tokio::test]
async fn an_answer_broken_off_resumes_on_another_instance_after_the_tokens_given() {
    let (breaking, _) = serve(Behaviour::FailAt(2)).await;
    let (spare, resumed) = serve(Behaviour::Answer).await;
    let (router, mut shards) = router(vec![head(0, Some(&breaking))]);
    let answer = router.complete("m", &prompt()).await.unwrap();
    // The spare becomes ready while the answer runs: the resume reads the
    // stores again.
    shards.apply_watcher_event(&watcher::Event::Apply(head(1, Some(&spare))));
    assert_eq!(text(answer.events).await.unwrap(), WHOLE);
    assert_eq!(*resumed.lock().unwrap(), vec![vec![0, 1]]);
}

#[tokio::test]
async fn an_answer_broken_off_with_no_instance_left_is_a_502_once_the_heal_wait_is_spent() {
    let (breaking, _) = serve(Behaviour::FailAt(3)).await;
    let (router, _) = router(vec![head(0, Some(&breaking))]);
    let router = router.with_heal_wait(Duration::from_secs(2));
    let answer = router.complete("m", &prompt()).await.unwrap();
    let started = std::time::Instant::now();
    let e = text(answer.events).await.unwrap_err();
    assert!(
        started.elapsed() >= Duration::from_millis(1500),
        "it waited"
    );
    assert_eq!(e.status.as_u16(), 502, "{e:?}");
    assert!(
        e.message
            .contains("no instance became ready to resume it within 2 s"),
        "{e:?}"
    );
}

/// While it waits, the answer tells its client every keep-alive period
/// (its dialect then sends a comment, a ping or an empty line), and still
/// ends with the 502 once the wait is spent.
#[tokio::test]
async fn an_answer_waiting_to_heal_sends_keep_alives() {
    let (breaking, _) = serve(Behaviour::FailAt(3)).await;
    let (router, _) = router(vec![head(0, Some(&breaking))]);
    let router = router
        .with_heal_wait(Duration::from_secs(3))
        .with_keepalive(Duration::from_millis(500));
    let mut events = router.complete("m", &prompt()).await.unwrap().events;
    let (mut text, mut waits) = (String::new(), Vec::new());
    let started = std::time::Instant::now();
    let end = loop {
        match events.next().await.expect("an end") {
            Ok(Event::Text(t)) => text.push_str(&t),
            Ok(Event::Waiting) => waits.push(started.elapsed()),
            other => break other,
        }
    };
    let e = end.unwrap_err();
    assert_eq!(e.status.as_u16(), 502, "{e:?}");
    assert_eq!(text, "w0 w1 w2 ", "the text before the break");
    assert!(
        (4..=7).contains(&waits.len()),
        "about one keep-alive each 0.5 s of a 3 s wait: {waits:?}"
    );
    for pair in waits.windows(2) {
        assert!(pair[1] - pair[0] >= Duration::from_millis(450), "{waits:?}");
    }
    assert!(events.next().await.is_none(), "nothing after the error");
}

/// While another instance takes a broken-off answer over (running its
/// prompt and tokens again before it gives the next one), the client hears
/// keep-alives too, and then the rest of the answer.
#[tokio::test]
async fn an_answer_being_taken_over_sends_keep_alives() {
    let (breaking, _) = serve(Behaviour::FailAt(2)).await;
    let calls = Calls::default();
    let seen = calls.clone();
    let slow = FakeDataPlane::generating(move |r| answer(Behaviour::Answer, &seen, r))
        .first_after(Duration::from_millis(1600))
        .serve(token())
        .await;
    // The slow instance is still loading when the answer starts, so it
    // starts on the breaking one; ready by the break.
    let (router, mut shards) = router(vec![head(0, Some(&breaking)), head(1, None)]);
    let router = router.with_keepalive(Duration::from_millis(300));
    let mut events = router.complete("m", &prompt()).await.unwrap().events;
    let mut seen_events = Vec::new();
    let end = loop {
        match events.next().await.expect("an end") {
            Ok(Event::Text(t)) => {
                if seen_events.is_empty() {
                    shards.apply_watcher_event(&watcher::Event::Apply(head(1, Some(&slow))));
                }
                seen_events.push(t)
            }
            Ok(Event::Waiting) => seen_events.push("…".into()),
            other => break other,
        }
    };
    assert!(matches!(end, Ok(Event::Done { .. })), "{end:?}");
    let text: String = seen_events.iter().filter(|e| *e != "…").cloned().collect();
    assert_eq!(text, WHOLE, "{seen_events:?}");
    let during = seen_events
        .iter()
        .skip_while(|e| *e != "w1 ")
        .take_while(|e| *e != "w2 ")
        .filter(|e| *e == "…")
        .count();
    assert!(
        (3..=10).contains(&during),
        "about one keep-alive each 0.3 s of a 1.6 s take-over: {seen_events:?}"
    );
    assert_eq!(calls.lock().unwrap().last(), Some(&vec![0, 1]));
}

/// Waiting for busy instances to take a broken-off answer over sends
/// keep-alives too, and keep-alives do not stretch the busy wait.
#[tokio::test]
async fn a_resume_waiting_for_busy_instances_sends_keep_alives_within_its_wait() {
    let (breaking, _) = serve(Behaviour::FailAt(2)).await;
    let (busy, busy_calls) = serve(Behaviour::Busy).await;
    let (router, _) = router(vec![head(0, Some(&breaking)), head(1, Some(&busy))]);
    // Busy instances are waited for 0.7 s (`router`); no heal wait.
    let router = router
        .with_heal_wait(Duration::ZERO)
        .with_keepalive(Duration::from_millis(200));
    let mut events = router.complete("m", &prompt()).await.unwrap().events;
    let started = std::time::Instant::now();
    let mut waits = 0;
    let end = loop {
        match events.next().await.expect("an end") {
            Ok(Event::Waiting) => waits += 1,
            Ok(Event::Text(_)) => {}
            other => break other,
        }
    };
    let e = end.unwrap_err();
    assert_eq!(e.status.as_u16(), 502, "{e:?}");
    assert!(
        waits >= 1,
        "keep-alives while busy instances were waited for"
    );
    assert!(
        started.elapsed() < Duration::from_secs(3),
        "the busy wait of 0.7 s was not stretched: {:?}",
        started.elapsed()
    );
    assert!(
        busy_calls.lock().unwrap().len() >= 2,
        "tried again while waiting"
    );
}

/// An error about the answer itself (its KV outgrew the budget, a bad
/// request) would come again: it is not waited for, whatever the heal wait.
#[tokio::test]
async fn an_error_about_the_answer_itself_is_not_waited_for() {
    use dp::tonic::Code;
    for code in [
        Code::ResourceExhausted,
        Code::InvalidArgument,
        Code::FailedPrecondition,
        Code::Internal,
    ] {
        let (breaking, calls) = serve(Behaviour::FailAtWith(2, code)).await;
        let (router, _) = router(vec![head(0, Some(&breaking))]);
        let router = router.with_heal_wait(Duration::from_secs(30));
        let answer = router.complete("m", &prompt()).await.unwrap();
        let started = std::time::Instant::now();
        let e = text(answer.events).await.unwrap_err();
        assert!(
            started.elapsed() < Duration::from_secs(5),
            "{code:?}: no wait"
        );
        assert_eq!(e.status.as_u16(), 502, "{code:?}: {e:?}");
        assert!(
            e.message.contains("this answer went wrong"),
            "{code:?}: {e:?}"
        );
        assert_eq!(calls.lock().unwrap().len(), 1, "{code:?}: not tried again");
    }
}

/// An instance takes one answer at most twice (its first run and one after
/// it came back), so an answer that itself breaks its stage cannot keep
/// the deployment's only instance failing: re-placed again and again, the
/// instance is tried once more, then the answer ends at once (no instance
/// is left that may take it, so there is nothing to wait for).
#[tokio::test]
async fn an_instance_takes_one_answer_at_most_twice() {
    let (breaking, calls) = serve(Behaviour::FailAt(2)).await;
    let (router, mut shards) = router(vec![head(0, Some(&breaking))]);
    let router = router.with_heal_wait(Duration::from_secs(30));
    let answer = router.complete("m", &prompt()).await.unwrap();
    let started = std::time::Instant::now();
    // The operator moves the Shard every 0.3 s (a new incarnation each
    // time), renaming it, as the operator's Shard names carry a hash of
    // their node: still instance 0.
    let moves = async {
        let mut before = head(0, Some(&breaking));
        for n in 0..12 {
            tokio::time::sleep(Duration::from_millis(300)).await;
            let mut moved = head(0, Some(&breaking));
            moved.spec.node = format!("node-elsewhere-{n}");
            moved.metadata.name = Some(format!("chat-0-0-{n}"));
            shards.apply_watcher_event(&watcher::Event::Delete(before));
            shards.apply_watcher_event(&watcher::Event::Apply(moved.clone()));
            before = moved;
        }
    };
    let (got, ended) = tokio::join!(
        async {
            let got = text(answer.events).await;
            (got, started.elapsed())
        },
        moves
    )
    .0;
    let e = got.unwrap_err();
    assert_eq!(e.status.as_u16(), 502, "{e:?}");
    assert!(
        e.message
            .contains("every instance of the deployment (1) has run it 2 times"),
        "{e:?}"
    );
    assert!(
        ended < Duration::from_secs(10),
        "it ended once the only instance had run it twice, not after the 30 s wait: {ended:?}"
    );
    assert_eq!(
        *calls.lock().unwrap(),
        vec![vec![], vec![0, 1]],
        "the first run and one resume, no more"
    );
}

#[tokio::test]
async fn an_answer_broken_off_resumes_on_its_own_instance_once_that_is_re_placed() {
    let (breaking, _) = serve(Behaviour::FailAt(2)).await;
    let (healed, resumed) = serve(Behaviour::Answer).await;
    let (router, mut shards) = router(vec![head(0, Some(&breaking))]);
    let router = router.with_heal_wait(Duration::from_secs(30));
    let answer = router.complete("m", &prompt()).await.unwrap();
    // The answer breaks and waits: the same instance, still listed as it
    // was, is not tried again; then the operator moves its Shard.
    let replace = async {
        tokio::time::sleep(Duration::from_millis(700)).await;
        assert!(resumed.lock().unwrap().is_empty(), "not resumed before");
        let mut moved = head(0, Some(&healed));
        moved.spec.node = "node-elsewhere".into();
        shards.apply_watcher_event(&watcher::Event::Apply(moved));
    };
    let (got, ()) = tokio::join!(text(answer.events), replace);
    assert_eq!(got.unwrap(), WHOLE);
    assert_eq!(*resumed.lock().unwrap(), vec![vec![0, 1]]);
}

#[tokio::test]
async fn busy_instances_are_waited_for_and_then_the_client_hears_429() {
    let (a, a_calls) = serve(Behaviour::Busy).await;
    let (b, _) = serve(Behaviour::Busy).await;
    let (router, _) = router(vec![head(0, Some(&a)), head(1, Some(&b))]);
    let e = router.complete("m", &prompt()).await.err().unwrap();
    assert_eq!(
        (e.kind, e.status.as_u16()),
        (Kind::RateLimited, 429),
        "{e:?}"
    );
    assert!(e.retry_after.is_some());
    assert!(
        a_calls.lock().unwrap().len() >= 2,
        "the walk is tried again while the wait lasts"
    );
}

#[tokio::test]
async fn an_unknown_model_is_a_404_and_no_ready_instance_a_503() {
    let (router, _) = router(vec![head(0, None)]);
    let e = router.complete("nope", &prompt()).await.err().unwrap();
    assert_eq!((e.kind, e.status.as_u16()), (Kind::NotFound, 404), "{e:?}");
    let e = router.complete("m", &prompt()).await.err().unwrap();
    assert_eq!(
        (e.kind, e.status.as_u16()),
        (Kind::Unavailable, 503),
        "{e:?}"
    );
    assert!(e.message.contains("no ready instance"), "{e:?}");
}

#[tokio::test]
async fn the_instance_with_fewer_answers_under_way_comes_first() {
    let (a, a_calls) = serve(Behaviour::Answer).await;
    let (b, _) = serve(Behaviour::Answer).await;
    let (router, _) = router(vec![head(0, Some(&a)), head(1, Some(&b))]);
    // An answer not yet read holds its instance.
    let held = router.complete("m", &prompt()).await.unwrap();
    let busy = if a_calls.lock().unwrap().is_empty() {
        "chat-1-0"
    } else {
        "chat-0-0"
    };
    let deployment = router.deployment_for("m").unwrap();
    for _ in 0..8 {
        let first = &router.instances(&deployment)[0];
        assert_ne!(first.shard, busy, "the idle instance comes first");
    }
    drop(held);
}
