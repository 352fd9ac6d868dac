//! Calls on the data plane of the agents a test starts: they run without TLS
//! and share [`crate::DATA_PLANE_TOKEN`].
//!
//! ```text
//!  test ─► client(endpoint) ─► Generate(prompt(ns, shard, text, n)) ─► the head stage ─► text
//! ```

use shardplane_dataplane as dp;
use shardplane_dataplane::tonic::Status;

/// A data-plane client of the test agent at `endpoint`.
pub fn client(endpoint: &str) -> dp::Client {
    dp::client(
        dp::channel(endpoint, None).expect("a test agent's endpoint"),
        dp::Token::new(crate::DATA_PLANE_TOKEN).expect("the tests' token"),
    )
}

/// A `Generate` of the plain prompt `text` on the head Shard `ns/shard`, up to
/// `max_tokens`, greedy.
pub fn prompt(ns: &str, shard: &str, text: &str, max_tokens: u32) -> dp::GenerateRequest {
    dp::GenerateRequest {
        shard: Some(dp::ShardRef {
            namespace: ns.into(),
            name: shard.into(),
        }),
        input: Some(dp::generate_request::Input::Prompt(text.into())),
        sampling: Some(dp::Sampling {
            max_tokens,
            ..Default::default()
        }),
        ..Default::default()
    }
}

/// Runs [`prompt`] on the agent at `endpoint` to its end: the text.
pub async fn generate_text(
    endpoint: &str,
    ns: &str,
    shard: &str,
    text: &str,
    max_tokens: u32,
) -> Result<String, Status> {
    let request = prompt(ns, shard, text, max_tokens);
    let mut stream = client(endpoint).generate(request).await?.into_inner();
    let mut answer = String::new();
    while let Some(event) = stream.message().await? {
        if let Some(dp::generate_response::Event::Delta(d)) = event.event {
            answer.push_str(&d.text);
        }
    }
    Ok(answer)
}
