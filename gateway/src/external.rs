//! An external OpenAI-compatible endpoint as a fallback: the request is sent
//! as a streaming chat (or text) completion and its server-sent events are
//! read back as this gateway's events.
//!
//! Prompts and keys leave the cluster only where the gateway's operator
//! allows: a fallback's `baseUrl` must fall under one of the gateway's
//! allowed URLs ([`Allowlist`], none by default), and the Secret holding its
//! key must opt in with the label [`EXTERNAL_CREDENTIAL_LABEL`]` = "true"`.
//! An error the endpoint sends mid-stream ends the answer with an error,
//! never with a normal finish.

use futures::StreamExt;
use serde_json::{Value, json};
use shardplane_crds::ExternalEndpoint;

use crate::protocol::{Answer, ApiError, Event, Input, Kind, Prompt};
use crate::sse::SseDecoder;

/// The HTTP client for external endpoints (rustls with the ring provider, as
/// kube uses). Streams have no overall deadline; connecting has one.
pub fn http_client() -> crate::Result<reqwest::Client> {
    // Several crates bring rustls; name the provider once for the process.
    let _ = rustls::crypto::ring::default_provider().install_default();
    reqwest::Client::builder()
        .user_agent(concat!("shardplane-gateway/", env!("CARGO_PKG_VERSION")))
        .connect_timeout(std::time::Duration::from_secs(10))
        .build()
        .map_err(crate::Error::HttpClient)
}

/// The label a Secret carries to let the gateway send its key to an
/// external endpoint.
pub const EXTERNAL_CREDENTIAL_LABEL: &str = "shardplane.dev/external-credential";

/// The URLs external fallbacks may use: a base URL is allowed when its
/// scheme, host and port equal one entry's and its path lies under the
/// entry's path (whole segments).
#[derive(Debug, Clone, Default)]
pub struct Allowlist(Vec<reqwest::Url>);

impl Allowlist {
    /// Reads the allowed URLs; a text that is not an http(s) URL is an error.
    pub fn parse<S: AsRef<str>>(urls: &[S]) -> Result<Self, String> {
        urls.iter()
            .map(|u| {
                let u = u.as_ref();
                let url = reqwest::Url::parse(u).map_err(|e| format!("{u:?}: {e}"))?;
                if !matches!(url.scheme(), "http" | "https") || url.host_str().is_none() {
                    return Err(format!("{u:?} is not an http(s) URL with a host"));
                }
                Ok(url)
            })
            .collect::<Result<_, _>>()
            .map(Allowlist)
    }

    /// Whether requests may go to `base_url`.
    pub fn allows(&self, base_url: &str) -> bool {
        let Ok(url) = reqwest::Url::parse(base_url) else {
            return false;
        };
        let segments = |u: &reqwest::Url| -> Vec<String> {
            u.path_segments()
                .map(|s| s.filter(|p| !p.is_empty()).map(str::to_string).collect())
                .unwrap_or_default()
        };
        self.0.iter().any(|allowed| {
            allowed.scheme() == url.scheme()
                && allowed.host_str() == url.host_str()
                && allowed.port_or_known_default() == url.port_or_known_default()
                && segments(&url).starts_with(&segments(allowed))
        })
    }
}

/// Why the endpoint did not answer.
pub enum Failure {
    /// It is down or overloaded: try the next target.
    Retry(String),
    /// It refused the request itself: tell the client.
    Client(ApiError),
}

/// The request body for the endpoint.
fn body(ext: &ExternalEndpoint, prompt: &Prompt) -> (String, Value) {
    let s = &prompt.sampling;
    let mut body = json!({
        "model": ext.model,
        "stream": true,
        "stream_options": {"include_usage": true},
        "temperature": s.temperature,
    });
    if s.max_tokens > 0 {
        body["max_tokens"] = json!(s.max_tokens);
    }
    if s.top_p > 0.0 {
        body["top_p"] = json!(s.top_p);
    }
    if let Some(seed) = s.seed {
        body["seed"] = json!(seed);
    }
    if !s.stop.is_empty() {
        body["stop"] = json!(s.stop);
    }
    if s.frequency_penalty != 0.0 {
        body["frequency_penalty"] = json!(s.frequency_penalty);
    }
    if s.presence_penalty != 0.0 {
        body["presence_penalty"] = json!(s.presence_penalty);
    }
    // The output grammar goes on as OpenAI's `response_format`: the only
    // grammars the gateway takes are JSON and JSON Schemas.
    use shardplane_dataplane::output_grammar::Kind as Grammar;
    match prompt.grammar.as_ref().and_then(|g| g.kind.as_ref()) {
        Some(Grammar::JsonObject(true)) => body["response_format"] = json!({"type": "json_object"}),
        Some(Grammar::JsonSchema(schema)) => {
            let schema: Value = serde_json::from_str(schema).unwrap_or(Value::Null);
            body["response_format"] = json!({"type": "json_schema", "json_schema": {
                "name": "output", "schema": schema, "strict": true,
            }});
        }
        _ => {}
    }
    match &prompt.input {
        Input::Chat(c) => {
            body["messages"] = c
                .messages
                .iter()
                .map(|m| json!({"role": m.role, "content": m.content}))
                .collect();
            ("chat/completions".into(), body)
        }
        Input::Text(text) => {
            body["prompt"] = json!(text);
            ("completions".into(), body)
        }
    }
}

/// Starts the answer at the endpoint; returns once its first token arrived.
pub async fn start(
    http: &reqwest::Client,
    name: &str,
    ext: &ExternalEndpoint,
    key: Option<&str>,
    prompt: &Prompt,
) -> Result<Answer, Failure> {
    let tool_exchange = match &prompt.input {
        Input::Chat(c) => c
            .messages
            .iter()
            .any(|m| !m.tool_calls.is_empty() || m.role == "tool"),
        Input::Text(_) => false,
    };
    if prompt.tools.is_some() || tool_exchange {
        // Passed on without them, the answer would ignore the tools.
        return Err(Failure::Retry(format!(
            "{name}'s external endpoint is not given tools or tool results (not implemented)"
        )));
    }
    if let Input::Chat(c) = &prompt.input
        && !crate::apis::is_plain(c)
    {
        // Passed on without them, the answer would think when told not to.
        return Err(Failure::Retry(format!(
            "{name}'s external endpoint is not given thinking settings or template variables (not implemented)"
        )));
    }
    if prompt.sampling.logprobs.is_some() {
        return Err(Failure::Retry(format!(
            "{name}'s external endpoint is not asked for log-probabilities (not implemented)"
        )));
    }
    let (path, body) = body(ext, prompt);
    let url = format!("{}/{path}", ext.base_url.trim_end_matches('/'));
    let mut request = http
        .post(&url)
        .header("content-type", "application/json")
        .body(serde_json::to_vec(&body).unwrap_or_default());
    if let Some(key) = key {
        request = request.bearer_auth(key);
    }
    let response = request
        .send()
        .await
        .map_err(|e| Failure::Retry(format!("POST {url}: {e}")))?;
    let status = response.status();
    if status.is_server_error() || status.as_u16() == 429 || status.as_u16() == 401 {
        // Its own outage, its own rate limit or a bad key of ours: not the client's fault.
        return Err(Failure::Retry(format!("POST {url}: HTTP {status}")));
    }
    if !status.is_success() {
        let text = response.text().await.unwrap_or_default();
        let message = serde_json::from_str::<Value>(&text)
            .ok()
            .and_then(|v| v["error"]["message"].as_str().map(str::to_string))
            .unwrap_or(text);
        return Err(Failure::Client(ApiError {
            status,
            kind: if status.as_u16() == 404 {
                Kind::NotFound
            } else {
                Kind::InvalidRequest
            },
            message,
            retry_after: None,
        }));
    }
    let chat = path == "chat/completions";
    let mut events = Box::pin(sse_events(response, chat));
    // Wait for the first piece of text (or the end) before committing to it.
    let mut first = Vec::new();
    loop {
        match events.next().await {
            None => {
                return Err(Failure::Retry(format!(
                    "{url} ended its stream without an answer"
                )));
            }
            Some(Err(e)) => return Err(Failure::Retry(e.message)),
            Some(Ok(e)) => {
                let text_or_done = matches!(e, Event::Text(ref t) if !t.is_empty())
                    || matches!(e, Event::Done { .. });
                first.push(Ok(e));
                if text_or_done {
                    break;
                }
            }
        }
    }
    Ok(Answer {
        model: name.to_string(),
        prompt_tokens: 0,
        events: Box::pin(futures::stream::iter(first).chain(events)),
    })
}

/// The endpoint's server-sent events as this gateway's events
/// ([`SseDecoder`] on the body as it arrives).
fn sse_events(
    response: reqwest::Response,
    chat: bool,
) -> impl futures::Stream<Item = Result<Event, ApiError>> + Send {
    type Body =
        std::pin::Pin<Box<dyn futures::Stream<Item = reqwest::Result<axum::body::Bytes>> + Send>>;
    let state: (Body, SseDecoder) = (Box::pin(response.bytes_stream()), SseDecoder::new(chat));
    futures::stream::unfold(state, |(mut body, mut decoder)| async move {
        loop {
            if let Some(event) = decoder.next_event() {
                return Some((event, (body, decoder)));
            }
            if decoder.ended() {
                return None;
            }
            match body.next().await {
                Some(Ok(chunk)) => decoder.push(&chunk),
                Some(Err(e)) => {
                    // Ends the decoder too.
                    let _ = decoder.finish();
                    let error = ApiError::upstream(format!("the external endpoint: {e}"));
                    return Some((Err(error), (body, decoder)));
                }
                None => return decoder.finish().map(|event| (event, (body, decoder))),
            }
        }
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_allowlist_matches_scheme_host_port_and_whole_path_segments() {
        let list =
            Allowlist::parse(&["https://api.example.com/v1", "http://10.0.0.5:8000"]).unwrap();
        for ok in [
            "https://api.example.com/v1",
            "https://api.example.com/v1/",
            "https://api.example.com:443/v1/chat",
            "http://10.0.0.5:8000/v1",
        ] {
            assert!(list.allows(ok), "{ok}");
        }
        for refused in [
            "http://api.example.com/v1",
            "https://api.example.com/v10",
            "https://api.example.com/",
            "https://api.example.com.evil.net/v1",
            "https://evil.net/api.example.com/v1",
            "http://10.0.0.5:8001/v1",
            "not a url",
        ] {
            assert!(!list.allows(refused), "{refused}");
        }
        assert!(!Allowlist::default().allows("https://api.example.com/v1"));
        assert!(Allowlist::parse(&["ftp://host/x"]).is_err());
        assert!(Allowlist::parse(&["api.example.com"]).is_err());
    }

    #[tokio::test]
    async fn an_error_event_mid_stream_ends_the_answer_with_an_error() {
        let body = "data: {\"choices\": [{\"delta\": {\"content\": \"Hel\"}}]}\n\n\
                    data: {\"error\": {\"message\": \"the provider's GPU fell over\"}}\n\n\
                    data: [DONE]\n\n";
        let app = axum::Router::new().route("/", axum::routing::get(move || async move { body }));
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let address = listener.local_addr().unwrap();
        tokio::spawn(async move { axum::serve(listener, app).await });
        let response = http_client()
            .unwrap()
            .get(format!("http://{address}/"))
            .send()
            .await
            .unwrap();
        let events: Vec<_> = sse_events(response, true).collect().await;
        assert!(
            matches!(&events[0], Ok(Event::Text(t)) if t == "Hel"),
            "{events:?}"
        );
        match &events[1] {
            Err(e) => assert!(e.message.contains("the provider's GPU fell over"), "{e:?}"),
            other => panic!("{other:?}"),
        }
        assert_eq!(events.len(), 2, "no normal finish after it: {events:?}");
    }
}
