//! The three APIs: OpenAI (`/v1/chat/completions`, `/v1/completions`,
//! `/v1/responses`, `/v1/models`), Anthropic (`/v1/messages`) and Ollama (`/api/chat`,
//! `/api/generate`, `/api/tags`). Each parses its own request shape into a
//! [`Prompt`], and renders answers, streams and errors in its own shape.
//!
//! ```text
//!  body ─► fields::object ─► D::parse ─► Request{model, Prompt} ─► router ─► Events
//!                                                   ┌── stream: D::stream (SSE / NDJSON chunks)
//!                                         Events ───┤
//!                                                   └── whole: collect ─► D::answer (JSON)
//!  any ApiError ─► D::error_body (the dialect's error shape, status, Retry-After)
//! ```
//!
//! # Layout
//! - this module: the [`Dialect`] each API implements, and [`handle`], the
//!   one path every generation request takes whatever its dialect;
//! - [`fields`]: reading the body's fields with the same checks everywhere;
//! - [`openai`], [`responses`], [`anthropic`], [`ollama`]: one file per
//!   dialect, each with its parse, answer, stream chunks and error body.
//! - [`rendering`]: each dialect's thinking switch and template variables,
//!   made one conversation.

mod anthropic;
mod fields;
mod ollama;
mod openai;
mod rendering;
mod responses;

use std::convert::Infallible;
use std::time::Instant;

use axum::body::{Body, Bytes};
use axum::http::{HeaderMap, HeaderValue, StatusCode, header};
use axum::response::{IntoResponse, Response};
use futures::StreamExt;
use futures::stream::BoxStream;
use serde_json::Value;

pub use anthropic::Anthropic;
pub use ollama::{Ollama, running as ollama_ps, show as ollama_show, tags as ollama_tags};
pub use openai::{OpenAi, model_info as openai_model, models as openai_models};
pub use rendering::is_plain;
pub use responses::{Responses, delete as delete_response, get as get_response};

use crate::App;
use crate::metrics::observed;
use crate::protocol::{ApiError, Event, Events, Finish, Kind, Prompt};
use crate::routing::Served;

/// What one API does in its own shape; [`handle`] does the rest.
pub trait Dialect: Clone + Send + Sync + 'static {
    /// The API's name in metric labels.
    const LABEL: &'static str;
    /// The content type of a streamed answer.
    const STREAM_CONTENT_TYPE: &'static str = "text/event-stream";

    /// The request in a body that is a JSON object.
    fn parse(&self, v: &Value) -> Result<Request, ApiError>;

    /// An error's body.
    fn error_body(&self, e: &ApiError) -> Value;

    /// A whole answer's body.
    fn answer(&self, req: &Request, c: &Collected) -> Value;

    /// The answer's stream of chunks, as they go on the wire.
    fn stream(
        &self,
        req: &Request,
        prompt_tokens: u32,
        events: Events,
    ) -> BoxStream<'static, String>;
}

/// A request, parsed.
#[derive(Debug)]
pub struct Request {
    /// The name the client asked for.
    pub model: String,
    /// What to generate.
    pub prompt: Prompt,
    /// Stream the answer, or give it whole.
    pub stream: bool,
    /// Give token counts at the end of a stream.
    pub include_usage: bool,
    /// What the dialect carries from the request to its answer (the
    /// Responses API echoes request fields and keeps the conversation).
    pub context: Value,
}

/// A whole answer, collected.
pub struct Collected {
    /// The text.
    pub text: String,
    /// The model's reasoning before it (empty when it has none).
    pub reasoning: String,
    /// The tools it called.
    pub tool_calls: Vec<shardplane_dataplane::ToolCall>,
    /// Each token's log-probabilities, when asked for.
    pub logprobs: Vec<shardplane_dataplane::TokenLogprobs>,
    /// Why it ended.
    pub finish: Finish,
    /// Tokens of the prompt.
    pub prompt_tokens: u32,
    /// Tokens generated.
    pub completion_tokens: u32,
    /// Prompt tokens the instance took from its prefix cache.
    pub cached_tokens: u32,
}

/// A fresh answer id: `prefix` and 24 random hex digits.
fn id(prefix: &str) -> String {
    format!(
        "{prefix}{:016x}{:08x}",
        rand::random::<u64>(),
        rand::random::<u32>()
    )
}

fn now_secs() -> i64 {
    chrono::Utc::now().timestamp()
}

fn json_body(v: &Value) -> String {
    serde_json::to_string(v).unwrap_or_default()
}

fn json_response(v: &Value) -> Response {
    (
        StatusCode::OK,
        [(header::CONTENT_TYPE, "application/json")],
        json_body(v),
    )
        .into_response()
}

/// One server-sent event.
fn sse(event: Option<&str>, data: &Value) -> String {
    match event {
        Some(e) => format!("event: {e}\ndata: {}\n\n", json_body(data)),
        None => format!("data: {}\n\n", json_body(data)),
    }
}

/// `opening`, then each event's chunks (`chunks` never sees empty text: a
/// token whose text is held back sends nothing).
fn chunked(
    opening: Vec<String>,
    events: Events,
    mut chunks: impl FnMut(Result<Event, ApiError>) -> Vec<String> + Send + 'static,
) -> BoxStream<'static, String> {
    let body = events.flat_map(move |e| {
        futures::stream::iter(match e {
            Ok(Event::Text(t)) if t.is_empty() => Vec::new(),
            e => chunks(e),
        })
    });
    futures::stream::iter(opening).chain(body).boxed()
}

/// The error type OpenAI names a kind of error with (Anthropic uses the
/// same names, but `overloaded_error` for [`Kind::Unavailable`]).
fn error_type(kind: Kind) -> &'static str {
    match kind {
        Kind::InvalidRequest => "invalid_request_error",
        Kind::Authentication => "authentication_error",
        Kind::NotFound => "not_found_error",
        Kind::RateLimited => "rate_limit_error",
        Kind::Unavailable => "service_unavailable",
        Kind::Internal => "api_error",
        Kind::TooLarge => "request_too_large",
        Kind::Timeout => "request_timeout",
    }
}

/// A listing of served models in `api`'s shape, for a caller with a valid
/// key: what `render` makes of the served names, or its error.
fn listing<D: Dialect>(
    app: &App,
    headers: &HeaderMap,
    api: D,
    render: impl FnOnce(&[Served]) -> Result<Value, ApiError>,
) -> Response {
    match app
        .keys
        .check(headers)
        .and_then(|_| render(&app.router.served()))
    {
        Ok(v) => json_response(&v),
        Err(e) => error_response(&api, &e),
    }
}

/// Renders an error in `api`'s shape, with its status and `Retry-After`.
pub fn error_response<D: Dialect>(api: &D, e: &ApiError) -> Response {
    let mut r = (e.status, json_body(&api.error_body(e))).into_response();
    r.headers_mut().insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("application/json"),
    );
    if let Some(s) = e.retry_after
        && let Ok(v) = HeaderValue::from_str(&s.to_string())
    {
        r.headers_mut().insert(header::RETRY_AFTER, v);
    }
    r
}

async fn collect(mut events: Events) -> Result<Collected, ApiError> {
    let (mut text, mut reasoning) = (String::new(), String::new());
    let mut tool_calls = Vec::new();
    let mut logprobs = Vec::new();
    while let Some(e) = events.next().await {
        match e? {
            Event::Text(t) => text.push_str(&t),
            Event::Reasoning(r) => reasoning.push_str(&r),
            Event::ToolCall(c) => tool_calls.push(c),
            Event::Logprobs(l) => logprobs.extend(l),
            Event::Done {
                finish,
                prompt_tokens,
                completion_tokens,
                cached_tokens,
            } => {
                return Ok(Collected {
                    text,
                    reasoning,
                    tool_calls,
                    logprobs,
                    finish,
                    prompt_tokens,
                    completion_tokens,
                    cached_tokens,
                });
            }
        }
    }
    Err(ApiError::upstream("the answer ended without finishing"))
}

/// Decrements the in-flight gauge when the response is done or dropped.
struct InFlight(prometheus::IntGauge);

impl Drop for InFlight {
    fn drop(&mut self) {
        self.0.dec();
    }
}

fn stream_response(
    content_type: &'static str,
    chunks: impl futures::Stream<Item = String> + Send + 'static,
) -> Response {
    let body = Body::from_stream(chunks.map(|s| Ok::<_, Infallible>(Bytes::from(s))));
    (
        StatusCode::OK,
        [
            (header::CONTENT_TYPE, content_type),
            (header::CACHE_CONTROL, "no-cache"),
        ],
        body,
    )
        .into_response()
}

/// Reads a body of at most `limit` bytes; one declared or found larger is
/// a 413 (and is not read further).
pub async fn read_body(
    headers: &HeaderMap,
    body: Body,
    limit: usize,
    deadline: std::time::Duration,
) -> Result<Bytes, ApiError> {
    let declared = headers
        .get(header::CONTENT_LENGTH)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.parse::<u64>().ok());
    if declared.is_some_and(|n| n > limit as u64) {
        return Err(ApiError::too_large(limit));
    }
    // A body that trickles in is cut off: a connection cannot be held for
    // longer than `deadline` by a request it never finishes sending.
    let collect = http_body_util::BodyExt::collect(http_body_util::Limited::new(body, limit));
    let Ok(collected) = tokio::time::timeout(deadline, collect).await else {
        return Err(ApiError::body_timeout(deadline.as_secs()));
    };
    match collected {
        Ok(collected) => Ok(collected.to_bytes()),
        Err(e) if e.is::<http_body_util::LengthLimitError>() => Err(ApiError::too_large(limit)),
        Err(e) => Err(ApiError::invalid(format!(
            "the request body could not be read: {e}"
        ))),
    }
}

/// Handles one generation request through `api`: the key is checked before
/// the body (at most `app.max_body_bytes`) is read.
pub async fn handle<D: Dialect>(app: App, api: D, headers: HeaderMap, body: Body) -> Response {
    let start = Instant::now();
    let outcome = async {
        app.keys.check(&headers)?;
        let body = read_body(&headers, body, app.max_body_bytes, app.body_timeout).await?;
        api.parse(&fields::object(&body)?)
    }
    .await;
    let req = match outcome {
        Ok(r) => r,
        Err(e) => {
            app.metrics
                .requests
                .with_label_values(&["", D::LABEL, e.status.as_str()])
                .inc();
            return error_response(&api, &e);
        }
    };
    let model = req.model.clone();
    // Only served names become metric labels: a stranger's made-up names
    // must not grow /metrics.
    if app.router.deployment_for(&model).is_none() {
        app.metrics
            .requests
            .with_label_values(&["", D::LABEL, "404"])
            .inc();
        return error_response(&api, &ApiError::unknown_model(&model));
    }
    let gauge = app.metrics.in_flight.with_label_values(&[&model]);
    gauge.inc();
    let in_flight = InFlight(gauge);
    let answer = match app.router.complete(&model, &req.prompt).await {
        Ok(a) => a,
        Err(e) => {
            let label = if e.kind == Kind::NotFound {
                ""
            } else {
                model.as_str()
            };
            app.metrics
                .requests
                .with_label_values(&[label, D::LABEL, e.status.as_str()])
                .inc();
            return error_response(&api, &e);
        }
    };
    app.metrics
        .requests
        .with_label_values(&[&model, D::LABEL, "200"])
        .inc();
    let prompt_tokens = answer.prompt_tokens;
    let events = observed(answer.events, &model, &app.metrics, start);
    if !req.stream {
        let result = collect(events).await;
        drop(in_flight);
        return match result {
            Ok(c) => json_response(&api.answer(&req, &c)),
            Err(e) => error_response(&api, &e),
        };
    }
    let stream = api.stream(&req, prompt_tokens, events);
    stream_response(
        D::STREAM_CONTENT_TYPE,
        stream.map(move |chunk| {
            let _ = &in_flight;
            chunk
        }),
    )
}

#[cfg(test)]
mod tests {
    use serde_json::{Value, json};

    use super::*;

    /// A call of `get_weather` for Paris.
    pub(super) fn call() -> shardplane_dataplane::ToolCall {
        shardplane_dataplane::ToolCall {
            id: "call_1".into(),
            name: "get_weather".into(),
            arguments: r#"{"city": "Paris"}"#.into(),
        }
    }

    /// The data of each chunk `api` streams for `events`.
    pub(super) fn streamed<D: Dialect>(api: &D, req: &Request, events: Vec<Event>) -> Vec<Value> {
        let events: Events = Box::pin(futures::stream::iter(events.into_iter().map(Ok)));
        let chunks: Vec<String> = futures::executor::block_on(api.stream(req, 0, events).collect());
        // (OpenAI's last line, `data: [DONE]`, is not JSON)
        chunks
            .iter()
            .filter(|c| !c.contains("[DONE]"))
            .map(|c| serde_json::from_str(c.split("data: ").nth(1).unwrap().trim()).unwrap())
            .collect()
    }

    fn refused<D: Dialect>(api: D, v: &Value, field: &str) {
        let e = api.parse(v).expect_err("refused");
        assert_eq!(e.status.as_u16(), 400);
        assert!(e.message.contains(field), "{field}: {}", e.message);
    }

    fn with(v: &Value, field: &str, value: Value) -> Value {
        let mut v = v.clone();
        v[field] = value;
        v
    }

    #[test]
    fn openai_refuses_what_it_does_not_implement_and_takes_the_rest() {
        let chat = json!({"model": "m", "messages": [{"role": "user", "content": "hi", "name": "ann"}],
            "max_tokens": 5, "temperature": 0, "user": "u-1", "response_format": {"type": "text"},
            "stream_options": {"include_usage": true}, "tools": [], "logprobs": false, "tool_choice": "none"});
        OpenAi::Chat.parse(&chat).unwrap();
        for (field, value) in [
            ("tools", json!([{"type": "retrieval"}])),
            (
                "tools",
                json!([{"type": "function", "function": {"name": "f", "cache": true}}]),
            ),
            ("logit_bias", json!({"1": 1})),
            ("top_logprobs", json!(3)),
            ("response_format", json!({"type": "grammar"})),
            ("tool_choice", json!("required")),
            ("reasoning_effort", json!("extreme")),
            ("chat_template_kwargs", json!("enable_thinking=false")),
        ] {
            refused(OpenAi::Chat, &with(&chat, field, value), field);
        }
        refused(
            OpenAi::Chat,
            &with(
                &chat,
                "stream_options",
                json!({"include_obfuscation": true}),
            ),
            "stream_options.include_obfuscation",
        );
        refused(
            OpenAi::Chat,
            &with(
                &chat,
                "messages",
                json!([{"role": "assistant", "content": "", "tool_calls": [{"id": "1"}]}]),
            ),
            "messages[0].tool_calls",
        );
        let text =
            json!({"model": "m", "prompt": "x", "echo": false, "best_of": 1, "suffix": null});
        OpenAi::Text.parse(&text).unwrap();
        refused(OpenAi::Text, &with(&text, "echo", json!(true)), "echo");
        refused(OpenAi::Text, &with(&text, "logprobs", json!(6)), "logprobs");
        refused(
            OpenAi::Chat,
            &with(
                &with(&chat, "logprobs", json!(true)),
                "top_logprobs",
                json!(21),
            ),
            "top_logprobs",
        );
    }

    #[test]
    fn json_output_becomes_the_output_grammar() {
        use shardplane_dataplane::output_grammar::Kind;
        let grammar = |api: &dyn Fn(&Value) -> Result<Request, ApiError>, v: Value| {
            api(&v).unwrap().prompt.grammar.and_then(|g| g.kind)
        };
        let chat = |v: &Value| OpenAi::Chat.parse(v);
        let base = json!({"model": "m", "messages": [{"role": "user", "content": "hi"}]});
        assert_eq!(grammar(&chat, base.clone()), None);
        assert_eq!(
            grammar(
                &chat,
                with(&base, "response_format", json!({"type": "json_object"}))
            ),
            Some(Kind::JsonObject(true))
        );
        let schema = json!({"type": "object", "properties": {"a": {"type": "integer"}}});
        let Some(Kind::JsonSchema(text)) = grammar(
            &chat,
            with(
                &base,
                "response_format",
                json!({"type": "json_schema", "json_schema": {"name": "a", "strict": true, "schema": schema}}),
            ),
        ) else {
            panic!("a JSON Schema grammar");
        };
        assert_eq!(serde_json::from_str::<Value>(&text).unwrap(), schema);
        for (format, field) in [
            (
                json!({"type": "json_schema"}),
                "response_format.json_schema",
            ),
            (
                json!({"type": "json_schema", "json_schema": {"schema": {}}}),
                "response_format.json_schema.name",
            ),
            (
                json!({"type": "json_schema", "json_schema": {"name": "a", "schema": [1]}}),
                "response_format.json_schema.schema",
            ),
            (
                json!({"type": "json_object", "schema": {"type": "object"}}),
                "response_format.schema",
            ),
        ] {
            refused(OpenAi::Chat, &with(&base, "response_format", format), field);
        }
        let ollama = |v: &Value| Ollama::Chat.parse(v);
        assert_eq!(
            grammar(&ollama, with(&base, "format", json!("json"))),
            Some(Kind::JsonObject(true))
        );
        assert!(matches!(
            grammar(&ollama, with(&base, "format", schema)),
            Some(Kind::JsonSchema(_))
        ));
        assert_eq!(grammar(&ollama, with(&base, "format", json!(""))), None);
    }

    #[test]
    fn openai_tools_become_the_tool_set() {
        use shardplane_dataplane as dp;
        let weather = json!({"type": "function", "function": {"name": "get_weather", "strict": true,
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}});
        let base = json!({"model": "m", "messages": [
            {"role": "user", "content": "weather?"},
            {"role": "assistant", "content": null, "tool_calls": [{"id": "call_1", "type": "function",
                "function": {"name": "get_weather", "arguments": "{\"city\": \"Paris\"}"}}]},
            {"role": "tool", "tool_call_id": "call_1", "content": "sunny"}],
            "tools": [weather]});
        let parsed = OpenAi::Chat.parse(&base).unwrap().prompt;
        let set = parsed.tools.unwrap();
        assert_eq!(
            (set.tools.len(), set.choice, set.parallel),
            (1, dp::ToolChoice::Auto as i32, true)
        );
        assert_eq!(
            serde_json::from_str::<Value>(&set.tools[0].parameters).unwrap()["properties"]["city"]
                ["type"],
            "string"
        );
        let crate::protocol::Input::Chat(dp::Conversation { messages, .. }) = parsed.input else {
            panic!("a chat");
        };
        assert_eq!(messages[1].tool_calls[0].name, "get_weather");
        assert_eq!(messages[1].tool_calls[0].arguments, r#"{"city": "Paris"}"#);
        assert_eq!(messages[2].tool_call_id, "call_1");
        let choice = |c: Value| {
            OpenAi::Chat
                .parse(&with(&base, "tool_choice", c))
                .map(|r| r.prompt.tools.map(|t| (t.choice, t.function)))
        };
        assert_eq!(
            choice(json!("required")).unwrap(),
            Some((dp::ToolChoice::Required as i32, String::new()))
        );
        assert_eq!(
            choice(json!({"type": "function", "function": {"name": "get_weather"}})).unwrap(),
            Some((dp::ToolChoice::Function as i32, "get_weather".into()))
        );
        assert_eq!(choice(json!("none")).unwrap(), None);
        assert!(choice(json!({"type": "function", "function": {"name": "nope"}})).is_err());
        refused(
            OpenAi::Chat,
            &with(&base, "response_format", json!({"type": "json_object"})),
            "response_format",
        );
    }

    #[test]
    fn openai_gives_log_probabilities_with_the_text_they_belong_to() {
        use shardplane_dataplane as dp;
        let entry = |token: &str, logprob: f32| dp::TokenLogprob {
            token: token.into(),
            logprob,
        };
        let lp = |token: &str, logprob: f32| dp::TokenLogprobs {
            chosen: Some(entry(token, logprob)),
            top: vec![entry(token, logprob), entry(" x", -3.0)],
        };
        let base = json!({"model": "m", "messages": [{"role": "user", "content": "hi"}],
                          "logprobs": true, "top_logprobs": 2});
        let req = OpenAi::Chat.parse(&base).unwrap();
        assert_eq!(req.prompt.sampling.logprobs, Some(2));
        // The first token's text is held back until the second's comes.
        let data = tests::streamed(
            &OpenAi::Chat,
            &req,
            vec![
                Event::Logprobs(vec![lp("\u{fffd}", -0.5)]),
                Event::Text(String::new()),
                Event::Logprobs(vec![lp("\u{fffd}", -0.25)]),
                Event::Text("é".into()),
                Event::Logprobs(vec![lp(" ok", -0.1)]),
                Event::Text(" ok".into()),
                Event::Done {
                    finish: Finish::Stop,
                    prompt_tokens: 1,
                    completion_tokens: 3,
                    cached_tokens: 0,
                },
            ],
        );
        let with_text: Vec<(String, usize)> = data
            .iter()
            .filter_map(|d| {
                let c = &d["choices"][0];
                let n = c["logprobs"]["content"].as_array().map_or(0, Vec::len);
                c["delta"]["content"].as_str().map(|t| (t.to_string(), n))
            })
            .collect();
        assert_eq!(
            with_text,
            [("".into(), 0), ("é".into(), 2), (" ok".into(), 1)]
        );
        let whole = OpenAi::Chat.answer(
            &req,
            &Collected {
                text: "é ok".into(),
                reasoning: String::new(),
                tool_calls: Vec::new(),
                logprobs: vec![lp(" ok", -0.1)],
                finish: Finish::Stop,
                prompt_tokens: 40,
                completion_tokens: 1,
                cached_tokens: 32,
            },
        );
        assert_eq!(
            whole["usage"],
            json!({"prompt_tokens": 40, "completion_tokens": 1, "total_tokens": 41,
                   "prompt_tokens_details": {"cached_tokens": 32}})
        );
        let l = &whole["choices"][0]["logprobs"]["content"][0];
        assert_eq!(l["token"], " ok");
        assert_eq!(l["bytes"], json!([32, 111, 107]));
        assert_eq!(l["top_logprobs"][1]["logprob"], json!(-3.0));
        let text = json!({"model": "m", "prompt": "x", "logprobs": 1});
        let req = OpenAi::Text.parse(&text).unwrap();
        let whole = OpenAi::Text.answer(
            &req,
            &Collected {
                text: " ok ok".into(),
                reasoning: String::new(),
                tool_calls: Vec::new(),
                logprobs: vec![lp(" ok", -0.1), lp(" ok", -0.2)],
                finish: Finish::Stop,
                prompt_tokens: 1,
                completion_tokens: 2,
                cached_tokens: 0,
            },
        );
        let l = &whole["choices"][0]["logprobs"];
        assert_eq!(l["text_offset"], json!([0, 3]));
        assert_eq!(l["tokens"], json!([" ok", " ok"]));
        assert_eq!(l["top_logprobs"][0][" x"], json!(-3.0));
    }

    #[test]
    fn reasoning_comes_out_as_each_api_gives_it() {
        let collected = Collected {
            text: "Hello!".into(),
            reasoning: "The user greets.".into(),
            tool_calls: Vec::new(),
            logprobs: Vec::new(),
            finish: Finish::Stop,
            prompt_tokens: 1,
            completion_tokens: 9,
            cached_tokens: 0,
        };
        let events = || {
            vec![
                Event::Reasoning("The user".into()),
                Event::Reasoning(" greets.".into()),
                Event::Text("Hello!".into()),
                Event::Done {
                    finish: Finish::Stop,
                    prompt_tokens: 1,
                    completion_tokens: 9,
                    cached_tokens: 0,
                },
            ]
        };
        let chat =
            json!({"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 9});
        // OpenAI chat: reasoning_content, whole and in deltas.
        let req = OpenAi::Chat.parse(&chat).unwrap();
        let m = &OpenAi::Chat.answer(&req, &collected)["choices"][0]["message"];
        assert_eq!(
            (m["reasoning_content"].as_str(), m["content"].as_str()),
            (Some("The user greets."), Some("Hello!"))
        );
        let deltas: String = streamed(&OpenAi::Chat, &req, events())
            .iter()
            .filter_map(|d| {
                d["choices"][0]["delta"]["reasoning_content"]
                    .as_str()
                    .map(String::from)
            })
            .collect();
        assert_eq!(deltas, "The user greets.");
        // Anthropic: a thinking block before the text.
        let req = Anthropic.parse(&chat).unwrap();
        let content = &Anthropic.answer(&req, &collected)["content"];
        assert_eq!(
            (
                content[0]["type"].as_str(),
                content[0]["thinking"].as_str(),
                content[1]["text"].as_str()
            ),
            (Some("thinking"), Some("The user greets."), Some("Hello!"))
        );
        let starts: Vec<String> = streamed(&Anthropic, &req, events())
            .iter()
            .filter(|d| d["type"] == "content_block_start")
            .map(|d| format!("{} {}", d["index"], d["content_block"]["type"]))
            .collect();
        assert_eq!(starts, ["0 \"thinking\"", "1 \"text\""]);
        // Ollama: message.thinking.
        let req = Ollama::Chat
            .parse(&json!({"model": "m", "messages": [{"role": "user", "content": "hi"}]}))
            .unwrap();
        assert_eq!(
            Ollama::Chat.answer(&req, &collected)["message"]["thinking"],
            "The user greets."
        );
        // Responses: a reasoning item before the message.
        let api = Responses::default();
        let req = api.parse(&json!({"model": "m", "input": "hi"})).unwrap();
        let output = &api.answer(&req, &collected)["output"];
        assert_eq!(
            (
                output[0]["type"].as_str(),
                output[0]["content"][0]["text"].as_str(),
                output[1]["type"].as_str()
            ),
            (Some("reasoning"), Some("The user greets."), Some("message"))
        );
        let data = streamed(&api, &req, events());
        let kinds: Vec<&str> = data.iter().map(|d| d["type"].as_str().unwrap()).collect();
        assert_eq!(
            kinds[2..7],
            [
                "response.output_item.added",
                "response.reasoning_text.delta",
                "response.reasoning_text.delta",
                "response.reasoning_text.done",
                "response.output_item.done",
            ]
        );
        let whole = &data.last().unwrap()["response"]["output"];
        assert_eq!(
            (
                whole[0]["type"].as_str(),
                whole[1]["content"][0]["text"].as_str()
            ),
            (Some("reasoning"), Some("Hello!"))
        );
    }

    #[test]
    fn anthropic_refuses_what_it_does_not_implement_and_takes_the_rest() {
        let m = json!({"model": "m", "max_tokens": 5, "messages": [{"role": "user", "content": "hi"}],
            "metadata": {"user_id": "u-1"}, "thinking": {"type": "disabled"}, "tool_choice": {"type": "auto"}});
        Anthropic.parse(&m).unwrap();
        refused(
            Anthropic,
            &with(
                &m,
                "tools",
                json!([{"type": "bash_20250124", "name": "bash"}]),
            ),
            "tools[0].type",
        );
        for (thinking, named) in [
            (
                json!({"type": "enabled", "budget_tokens": 1024}),
                "thinking.budget_tokens",
            ),
            (json!({"type": "enabled"}), "thinking.budget_tokens"),
            (json!({"type": "adaptive"}), "thinking.type"),
            (
                json!({"type": "disabled", "display": "summarized"}),
                "thinking.display",
            ),
            (json!(true), "thinking"),
        ] {
            refused(Anthropic, &with(&m, "thinking", thinking), named);
        }
        refused(
            Anthropic,
            &with(&m, "tool_choice", json!({"type": "any"})),
            "tool_choice",
        );
        refused(
            Anthropic,
            &with(&m, "service_tier", json!("auto")),
            "service_tier",
        );
    }

    #[test]
    fn ollama_refuses_what_it_does_not_implement_and_takes_the_rest() {
        let c = json!({"model": "m", "messages": [{"role": "user", "content": "hi"}], "tools": [],
            "keep_alive": "5m", "think": false, "options": {"temperature": 0, "num_ctx": 4096, "num_thread": 8}});
        Ollama::Chat.parse(&c).unwrap();
        refused(Ollama::Chat, &with(&c, "format", json!("yaml")), "format");
        refused(
            Ollama::Chat,
            &with(&c, "tools", json!([{"type": "function"}])),
            "tools",
        );
        refused(Ollama::Chat, &with(&c, "think", json!("max")), "think");
        let raw = json!({"model": "m", "prompt": "hi", "raw": true, "think": false});
        refused(Ollama::Generate, &raw, "think");
        refused(
            Ollama::Chat,
            &with(&c, "options", json!({"mirostat": 2})),
            "options.mirostat",
        );
        refused(
            Ollama::Chat,
            &with(
                &c,
                "messages",
                json!([{"role": "user", "content": "x", "images": ["aGk="]}]),
            ),
            "messages[0].images",
        );
        let g = json!({"model": "m", "prompt": "x", "system": "s", "raw": false});
        Ollama::Generate.parse(&g).unwrap();
        refused(
            Ollama::Generate,
            &with(&g, "template", json!("{{ .Prompt }}")),
            "template",
        );
        refused(
            Ollama::Generate,
            &with(&g, "images", json!(["aGk="])),
            "images",
        );
    }
}
