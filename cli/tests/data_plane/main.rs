//! The data plane between real agents: a 2-stage pipeline on two agent
//! processes generates exactly what the model generates in one process, many
//! sequences at once; calls without the token are refused; a client that goes
//! away frees its sequence on every stage; bad calls get clear errors.
//!
//! Rooms: [`pipeline`] (two candle agents against one process), [`mixed_engines`]
//! (an MLX agent and a candle agent in one pipeline), [`peer_copy`] (weights
//! copied from a peer, verified, an interrupted copy resumed).

#[cfg(feature = "mlx")]
mod mixed_engines;
mod peer_copy;
mod pipeline;

use std::time::Duration;

use kube::Api;
use kube::api::PostParams;
use shardplane_crds::*;
use shardplane_dataplane as dp;
use shardplane_dataplane::tonic::Code;
use shardplane_engine::gguf::GgufFile;
use shardplane_engine::pipeline::{EngineKind, LocalPipeline, TextModel, generate};
use shardplane_engine::sampler::SamplingParams;
use shardplane_engine::text_output::TextOutput;
use shardplane_engine::{LoadOptions, chat::ChatMessage};
use shardplane_testkit::{
    ChildGuard as Process, control_plane, fixtures, free_address, unique_name,
};
use tokio_stream::wrappers::ReceiverStream;

const WAIT: Duration = Duration::from_secs(90);

fn cache_of(node: &str) -> std::path::PathBuf {
    shardplane_testkit::agent_cache(env!("CARGO_TARGET_TMPDIR"), node)
}

fn agent_with_admin(node: &str, admin: &str) -> Process {
    agent_with(node, admin, &[])
}

fn agent_with(node: &str, admin: &str, extra: &[&str]) -> Process {
    let cache = cache_of(node);
    let mut args = vec![
        "agent",
        "--node-name",
        node,
        "--admin-address",
        admin,
        "--lease-seconds",
        "3",
        "--cache-dir",
        cache.to_str().unwrap(),
        "--probe-links-seconds",
        "2",
    ];
    args.extend_from_slice(extra);
    shardplane_testkit::spawn_component(env!("CARGO_BIN_EXE_shardplane"), &args)
}

fn client(endpoint: &str) -> dp::Client {
    shardplane_testkit::agent_calls::client(endpoint)
}

fn shard_ref(ns: &str, name: &str) -> Option<dp::ShardRef> {
    Some(dp::ShardRef {
        namespace: ns.into(),
        name: name.into(),
    })
}

fn conversation(text: &str) -> Option<dp::generate_request::Input> {
    Some(dp::generate_request::Input::Chat(dp::Conversation {
        messages: vec![dp::ChatMessage {
            role: "user".into(),
            content: text.into(),
            ..Default::default()
        }],
        ..Default::default()
    }))
}

/// What one process generates for `prompt`, greedy.
fn reference(
    text: &TextModel,
    pipeline: &mut LocalPipeline,
    prompt: &str,
    n: usize,
) -> (Vec<u32>, String) {
    let ids = text
        .chat_prompt(&[ChatMessage::new("user", prompt)])
        .unwrap();
    let params = SamplingParams {
        max_tokens: n,
        ..Default::default()
    };
    let g = generate(pipeline, text, 1, &ids, &params, |_| {}).unwrap();
    (g.tokens, g.text)
}

/// `tokens` pushed into a new text output (greedy defaults): the output and
/// the text they release.
fn pushed<'a>(text: &'a TextModel, tokens: &[u32]) -> (TextOutput<'a>, String) {
    let mut output = TextOutput::new(&text.tokenizer, &SamplingParams::default());
    let released = tokens
        .iter()
        .map(|&t| output.push(t).unwrap().text)
        .collect();
    (output, released)
}

/// The text `tokens` release as the start of an answer.
fn released_text(text: &TextModel, tokens: &[u32]) -> String {
    pushed(text, tokens).1
}

/// The whole text of an answer of `tokens`.
fn answer_text(text: &TextModel, tokens: &[u32]) -> String {
    let (output, released) = pushed(text, tokens);
    released + &output.finish().unwrap()
}

/// Runs a Generate to the end; returns the tokens, the text and the finish.
async fn run(
    mut c: dp::Client,
    req: dp::GenerateRequest,
) -> Result<(Vec<u32>, String, dp::Finished), dp::tonic::Status> {
    let mut stream = c.generate(req).await?.into_inner();
    let (mut tokens, mut text, mut finished) = (Vec::new(), String::new(), None);
    while let Some(ev) = stream.message().await? {
        match ev.event {
            Some(dp::generate_response::Event::Delta(d)) => {
                tokens.extend(d.tokens);
                text.push_str(&d.text);
            }
            Some(dp::generate_response::Event::Finished(f)) => finished = Some(f),
            _ => {}
        }
    }
    Ok((tokens, text, finished.expect("a Finished event")))
}

/// Sequences held by each stage an agent serves.
async fn sequences(endpoint: &str) -> Vec<(String, u32)> {
    let status = client(endpoint)
        .status(dp::StatusRequest {})
        .await
        .unwrap()
        .into_inner();
    status
        .stages
        .into_iter()
        .map(|s| (s.shard.unwrap().name, s.sequences))
        .collect()
}

/// Waits until each Shard is Ready; returns their data-plane endpoints.
async fn ready_endpoints(shards: &Api<Shard>, names: &[&str]) -> Vec<String> {
    let mut endpoints = Vec::new();
    for name in names {
        let e = shardplane_testkit::eventually(&format!("{name} is Ready"), WAIT, || async {
            let st = shards.get(name).await.ok()?.status?;
            (st.phase == Some(ShardPhase::Ready)).then_some(st.endpoint?)
        })
        .await;
        endpoints.push(e);
    }
    endpoints
}

async fn metric(admin: &str, series: &str) -> f64 {
    shardplane_testkit::metrics::sum(&shardplane_testkit::metrics::scrape(admin).await, series)
}
