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

/// An SSE comment: clients skip it, proxies see bytes (the keep-alive of
/// an answer silent for a while: waiting to heal, taken over, a slow stage).
const SSE_WAITING: &str = ": still working on the answer\n\n";

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
            Event::Waiting => {}
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
mod tests;
