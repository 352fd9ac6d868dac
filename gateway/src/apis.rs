//! The three APIs: OpenAI (`/v1/chat/completions`, `/v1/completions`,
//! `/v1/models`), Anthropic (`/v1/messages`) and Ollama (`/api/chat`,
//! `/api/generate`, `/api/tags`). Each parses its own request shape into a
//! [`Prompt`], and renders answers, streams and errors in its own shape.

use std::convert::Infallible;
use std::time::Instant;

use axum::body::{Body, Bytes};
use axum::extract::State;
use axum::http::{HeaderMap, HeaderValue, StatusCode, header};
use axum::response::{IntoResponse, Response};
use futures::StreamExt;
use serde_json::{Value, json};
use shardplane_dataplane as dp;

use crate::App;
use crate::routing::{ApiError, Event, Events, Finish, Input, Kind, Prompt, observed};

/// Which API a request came through.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Api {
    /// OpenAI chat completions.
    OpenAiChat,
    /// OpenAI (legacy) completions.
    OpenAiText,
    /// Anthropic messages.
    Anthropic,
    /// Ollama chat.
    OllamaChat,
    /// Ollama generate.
    OllamaGenerate,
}

impl Api {
    fn label(self) -> &'static str {
        match self {
            Api::OpenAiChat | Api::OpenAiText => "openai",
            Api::Anthropic => "anthropic",
            Api::OllamaChat | Api::OllamaGenerate => "ollama",
        }
    }
}

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

/// Renders an error in `api`'s shape.
pub fn error_response(api: Api, e: &ApiError) -> Response {
    let body = match api {
        Api::OpenAiChat | Api::OpenAiText => json!({"error": {
            "message": e.message,
            "type": match e.kind {
                Kind::InvalidRequest => "invalid_request_error",
                Kind::Authentication => "authentication_error",
                Kind::NotFound => "not_found_error",
                Kind::RateLimited => "rate_limit_error",
                Kind::Unavailable => "service_unavailable",
                Kind::Internal => "api_error",
            },
            "param": null,
            "code": match e.kind {
                Kind::NotFound => json!("model_not_found"),
                Kind::Authentication => json!("invalid_api_key"),
                _ => Value::Null,
            },
        }}),
        Api::Anthropic => json!({"type": "error", "error": {
            "type": match e.kind {
                Kind::InvalidRequest => "invalid_request_error",
                Kind::Authentication => "authentication_error",
                Kind::NotFound => "not_found_error",
                Kind::RateLimited => "rate_limit_error",
                Kind::Unavailable => "overloaded_error",
                Kind::Internal => "api_error",
            },
            "message": e.message,
        }}),
        Api::OllamaChat | Api::OllamaGenerate => json!({"error": e.message}),
    };
    let mut r = (e.status, json_body(&body)).into_response();
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

fn parse(body: &[u8]) -> Result<Value, ApiError> {
    let v: Value = serde_json::from_slice(body)
        .map_err(|e| ApiError::invalid(format!("the body is not valid JSON: {e}")))?;
    if !v.is_object() {
        return Err(ApiError::invalid("the body must be a JSON object"));
    }
    Ok(v)
}

fn model_of(v: &Value) -> Result<String, ApiError> {
    match &v["model"] {
        Value::String(s) if !s.is_empty() => Ok(s.clone()),
        Value::Null => Err(ApiError::invalid("`model` is required")),
        _ => Err(ApiError::invalid("`model` must be a non-empty string")),
    }
}

/// Message content: a string, or an array of `{type: "text", text}` blocks.
fn content_text(v: &Value, field: &str) -> Result<String, ApiError> {
    match v {
        Value::String(s) => Ok(s.clone()),
        Value::Null => Ok(String::new()),
        Value::Array(blocks) => {
            let mut out = String::new();
            for b in blocks {
                match (b["type"].as_str(), b["text"].as_str()) {
                    (Some("text"), Some(t)) => out.push_str(t),
                    (Some(other), _) => {
                        return Err(ApiError::invalid(format!(
                            "{field}: content blocks of type {other:?} are not supported (text only)"
                        )));
                    }
                    _ => {
                        return Err(ApiError::invalid(format!(
                            "{field}: a content block needs `type`"
                        )));
                    }
                }
            }
            Ok(out)
        }
        _ => Err(ApiError::invalid(format!(
            "{field} must be a string or an array of text blocks"
        ))),
    }
}

fn messages(v: &Value, field: &str) -> Result<Vec<(String, String)>, ApiError> {
    let Some(list) = v[field].as_array() else {
        return Err(ApiError::invalid(format!(
            "`{field}` must be an array of messages"
        )));
    };
    if list.is_empty() {
        return Err(ApiError::invalid(format!("`{field}` is empty")));
    }
    list.iter()
        .enumerate()
        .map(|(i, m)| {
            let role = m["role"]
                .as_str()
                .ok_or_else(|| ApiError::invalid(format!("{field}[{i}].role is required")))?;
            if !["system", "developer", "user", "assistant", "tool"].contains(&role) {
                return Err(ApiError::invalid(format!(
                    "{field}[{i}].role {role:?} is not system, user, assistant or tool"
                )));
            }
            let role = if role == "developer" { "system" } else { role };
            Ok((
                role.to_string(),
                content_text(&m["content"], &format!("{field}[{i}].content"))?,
            ))
        })
        .collect()
}

fn float(v: &Value, field: &str, default: f32, range: (f32, f32)) -> Result<f32, ApiError> {
    match &v[field] {
        Value::Null => Ok(default),
        Value::Number(n) => {
            let x = n.as_f64().unwrap_or(f64::NAN) as f32;
            if x.is_finite() && x >= range.0 && x <= range.1 {
                Ok(x)
            } else {
                Err(ApiError::invalid(format!(
                    "`{field}` {x} must be between {} and {}",
                    range.0, range.1
                )))
            }
        }
        _ => Err(ApiError::invalid(format!("`{field}` must be a number"))),
    }
}

fn uint(v: &Value, field: &str) -> Result<Option<u64>, ApiError> {
    match &v[field] {
        Value::Null => Ok(None),
        Value::Number(n) => n
            .as_u64()
            .map(Some)
            .ok_or_else(|| ApiError::invalid(format!("`{field}` must be a whole number ≥ 0"))),
        _ => Err(ApiError::invalid(format!(
            "`{field}` must be a whole number"
        ))),
    }
}

fn stops(v: &Value, field: &str) -> Result<Vec<String>, ApiError> {
    match &v[field] {
        Value::Null => Ok(Vec::new()),
        Value::String(s) => Ok(vec![s.clone()]),
        Value::Array(a) => a
            .iter()
            .map(|s| {
                s.as_str()
                    .map(str::to_string)
                    .ok_or_else(|| ApiError::invalid(format!("`{field}` must hold strings")))
            })
            .collect(),
        _ => Err(ApiError::invalid(format!(
            "`{field}` must be a string or an array of strings"
        ))),
    }
}

fn max_tokens(n: Option<u64>) -> Result<u32, ApiError> {
    match n {
        Some(0) => Err(ApiError::invalid("the token limit must be at least 1")),
        Some(n) => Ok(n.min(u32::MAX as u64) as u32),
        None => Ok(0),
    }
}

/// A parsed request.
struct Request {
    model: String,
    prompt: Prompt,
    stream: bool,
    include_usage: bool,
}

fn parse_openai(api: Api, v: &Value) -> Result<Request, ApiError> {
    let model = model_of(v)?;
    if uint(v, "n")?.is_some_and(|n| n != 1) {
        return Err(ApiError::invalid("only `n` = 1 is supported"));
    }
    let input = match api {
        Api::OpenAiChat => Input::Chat(messages(v, "messages")?),
        _ => Input::Text(match &v["prompt"] {
            Value::String(s) => s.clone(),
            Value::Array(a) if a.len() == 1 && a[0].is_string() => {
                a[0].as_str().unwrap_or_default().to_string()
            }
            Value::Null => return Err(ApiError::invalid("`prompt` is required")),
            _ => return Err(ApiError::invalid("`prompt` must be one string")),
        }),
    };
    let limit = uint(v, "max_completion_tokens")?.or(uint(v, "max_tokens")?);
    // The legacy completions API stops at 16 tokens unless told otherwise.
    let limit = if api == Api::OpenAiText {
        Some(limit.unwrap_or(16))
    } else {
        limit
    };
    Ok(Request {
        model,
        prompt: Prompt {
            input,
            sampling: dp::Sampling {
                temperature: float(v, "temperature", 1.0, (0.0, 2.0))?,
                top_p: float(v, "top_p", 0.0, (0.0, 1.0))?,
                seed: match &v["seed"] {
                    Value::Null => None,
                    Value::Number(n) => Some(n.as_i64().unwrap_or(0) as u64),
                    _ => return Err(ApiError::invalid("`seed` must be an integer")),
                },
                max_tokens: max_tokens(limit)?,
                stop: stops(v, "stop")?,
                frequency_penalty: float(v, "frequency_penalty", 0.0, (-2.0, 2.0))?,
                presence_penalty: float(v, "presence_penalty", 0.0, (-2.0, 2.0))?,
                ..Default::default()
            },
        },
        stream: v["stream"].as_bool().unwrap_or(false),
        include_usage: v["stream_options"]["include_usage"]
            .as_bool()
            .unwrap_or(false),
    })
}

fn parse_anthropic(v: &Value) -> Result<Request, ApiError> {
    let model = model_of(v)?;
    let limit =
        uint(v, "max_tokens")?.ok_or_else(|| ApiError::invalid("`max_tokens` is required"))?;
    let mut chat = Vec::new();
    let system = content_text(&v["system"], "system")?;
    if !system.is_empty() {
        chat.push(("system".to_string(), system));
    }
    for (role, content) in messages(v, "messages")? {
        if role != "user" && role != "assistant" {
            return Err(ApiError::invalid(format!(
                "messages: role {role:?} is not user or assistant (put system prompts in `system`)"
            )));
        }
        chat.push((role, content));
    }
    Ok(Request {
        model,
        prompt: Prompt {
            input: Input::Chat(chat),
            sampling: dp::Sampling {
                temperature: float(v, "temperature", 1.0, (0.0, 1.0))?,
                top_p: float(v, "top_p", 0.0, (0.0, 1.0))?,
                top_k: uint(v, "top_k")?.unwrap_or(0) as u32,
                max_tokens: max_tokens(Some(limit))?,
                stop: stops(v, "stop_sequences")?,
                ..Default::default()
            },
        },
        stream: v["stream"].as_bool().unwrap_or(false),
        include_usage: true,
    })
}

fn parse_ollama(api: Api, v: &Value) -> Result<Request, ApiError> {
    let model = model_of(v)?;
    let o = &v["options"];
    if !(o.is_null() || o.is_object()) {
        return Err(ApiError::invalid("`options` must be an object"));
    }
    let input = if api == Api::OllamaChat {
        Input::Chat(messages(v, "messages")?)
    } else {
        let prompt = v["prompt"]
            .as_str()
            .ok_or_else(|| ApiError::invalid("`prompt` is required"))?
            .to_string();
        if v["raw"].as_bool().unwrap_or(false) {
            Input::Text(prompt)
        } else {
            let mut chat = Vec::new();
            if let Some(s) = v["system"].as_str() {
                chat.push(("system".to_string(), s.to_string()));
            }
            chat.push(("user".to_string(), prompt));
            Input::Chat(chat)
        }
    };
    let limit = match &o["num_predict"] {
        Value::Number(n) if n.as_i64().is_some_and(|n| n < 0) => None,
        _ => uint(o, "num_predict")?,
    };
    Ok(Request {
        model,
        prompt: Prompt {
            input,
            sampling: dp::Sampling {
                temperature: float(o, "temperature", 0.8, (0.0, 100.0))?,
                top_p: float(o, "top_p", 0.0, (0.0, 1.0))?,
                top_k: uint(o, "top_k")?.unwrap_or(0) as u32,
                min_p: float(o, "min_p", 0.0, (0.0, 1.0))?,
                repetition_penalty: float(o, "repeat_penalty", 1.0, (0.0, 100.0))?,
                presence_penalty: float(o, "presence_penalty", 0.0, (-100.0, 100.0))?,
                frequency_penalty: float(o, "frequency_penalty", 0.0, (-100.0, 100.0))?,
                seed: match &o["seed"] {
                    Value::Number(n) => Some(n.as_i64().unwrap_or(0) as u64),
                    _ => None,
                },
                max_tokens: max_tokens(limit)?,
                stop: stops(o, "stop")?,
                ..Default::default()
            },
        },
        stream: v["stream"].as_bool().unwrap_or(true),
        include_usage: true,
    })
}

/// A whole answer, collected.
struct Collected {
    text: String,
    finish: Finish,
    prompt_tokens: u32,
    completion_tokens: u32,
}

async fn collect(mut events: Events) -> Result<Collected, ApiError> {
    let mut text = String::new();
    while let Some(e) = events.next().await {
        match e? {
            Event::Text(t) => text.push_str(&t),
            Event::Done {
                finish,
                prompt_tokens,
                completion_tokens,
            } => {
                return Ok(Collected {
                    text,
                    finish,
                    prompt_tokens,
                    completion_tokens,
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

fn finish_openai(f: Finish) -> &'static str {
    match f {
        Finish::Stop => "stop",
        Finish::Length => "length",
    }
}

fn finish_anthropic(f: Finish) -> &'static str {
    match f {
        Finish::Stop => "end_turn",
        Finish::Length => "max_tokens",
    }
}

/// Handles one generation request through `api`.
pub async fn handle(app: App, api: Api, headers: HeaderMap, body: Bytes) -> Response {
    let start = Instant::now();
    let outcome = async {
        app.keys.check(&headers)?;
        let v = parse(&body)?;
        let req = match api {
            Api::OpenAiChat | Api::OpenAiText => parse_openai(api, &v)?,
            Api::Anthropic => parse_anthropic(&v)?,
            Api::OllamaChat | Api::OllamaGenerate => parse_ollama(api, &v)?,
        };
        Ok::<_, ApiError>(req)
    }
    .await;
    let req = match outcome {
        Ok(r) => r,
        Err(e) => {
            app.metrics
                .requests
                .with_label_values(&["", api.label(), e.status.as_str()])
                .inc();
            return error_response(api, &e);
        }
    };
    let model = req.model.clone();
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
                .with_label_values(&[label, api.label(), e.status.as_str()])
                .inc();
            return error_response(api, &e);
        }
    };
    app.metrics
        .requests
        .with_label_values(&[&model, api.label(), "200"])
        .inc();
    let prompt_tokens = answer.prompt_tokens;
    let events = observed(answer.events, &model, &app.metrics, start);
    if !req.stream {
        let result = collect(events).await;
        drop(in_flight);
        return match result {
            Ok(c) => json_response(&full_answer(api, &model, &c)),
            Err(e) => error_response(api, &e),
        };
    }
    let stream = streamed(api, model, prompt_tokens, req.include_usage, events);
    stream_response(
        match api {
            Api::OllamaChat | Api::OllamaGenerate => "application/x-ndjson",
            _ => "text/event-stream",
        },
        stream.map(move |chunk| {
            let _ = &in_flight;
            chunk
        }),
    )
}

fn full_answer(api: Api, model: &str, c: &Collected) -> Value {
    let usage = json!({
        "prompt_tokens": c.prompt_tokens,
        "completion_tokens": c.completion_tokens,
        "total_tokens": c.prompt_tokens + c.completion_tokens,
    });
    match api {
        Api::OpenAiChat => json!({
            "id": id("chatcmpl-"),
            "object": "chat.completion",
            "created": now_secs(),
            "model": model,
            "choices": [{
                "index": 0,
                "message": {"role": "assistant", "content": c.text},
                "logprobs": null,
                "finish_reason": finish_openai(c.finish),
            }],
            "usage": usage,
        }),
        Api::OpenAiText => json!({
            "id": id("cmpl-"),
            "object": "text_completion",
            "created": now_secs(),
            "model": model,
            "choices": [{
                "index": 0,
                "text": c.text,
                "logprobs": null,
                "finish_reason": finish_openai(c.finish),
            }],
            "usage": usage,
        }),
        Api::Anthropic => json!({
            "id": id("msg_"),
            "type": "message",
            "role": "assistant",
            "model": model,
            "content": [{"type": "text", "text": c.text}],
            "stop_reason": finish_anthropic(c.finish),
            "stop_sequence": null,
            "usage": {"input_tokens": c.prompt_tokens, "output_tokens": c.completion_tokens},
        }),
        Api::OllamaChat | Api::OllamaGenerate => {
            let mut v = ollama_line(api, model, &c.text, true);
            ollama_done(&mut v, c.finish, c.prompt_tokens, c.completion_tokens);
            v
        }
    }
}

fn ollama_line(api: Api, model: &str, text: &str, done: bool) -> Value {
    let mut v = json!({
        "model": model,
        "created_at": chrono::Utc::now().to_rfc3339_opts(chrono::SecondsFormat::Nanos, true),
        "done": done,
    });
    if api == Api::OllamaChat {
        v["message"] = json!({"role": "assistant", "content": text});
    } else {
        v["response"] = json!(text);
    }
    v
}

fn ollama_done(v: &mut Value, finish: Finish, prompt: u32, completion: u32) {
    v["done_reason"] = json!(match finish {
        Finish::Stop => "stop",
        Finish::Length => "length",
    });
    v["prompt_eval_count"] = json!(prompt);
    v["eval_count"] = json!(completion);
}

fn sse(event: Option<&str>, data: &Value) -> String {
    match event {
        Some(e) => format!("event: {e}\ndata: {}\n\n", json_body(data)),
        None => format!("data: {}\n\n", json_body(data)),
    }
}

/// The answer as `api`'s stream of chunks.
fn streamed(
    api: Api,
    model: String,
    prompt_tokens: u32,
    include_usage: bool,
    events: Events,
) -> impl futures::Stream<Item = String> + Send {
    let cid = id(match api {
        Api::OpenAiChat => "chatcmpl-",
        Api::OpenAiText => "cmpl-",
        _ => "msg_",
    });
    let created = now_secs();
    let openai_chunk = {
        let (cid, model) = (cid.clone(), model.clone());
        move |delta: Value, finish: Option<&str>| -> String {
            let choice = if api == Api::OpenAiChat {
                json!({"index": 0, "delta": delta, "logprobs": null, "finish_reason": finish})
            } else {
                json!({"index": 0, "text": delta["content"].as_str().unwrap_or(""), "logprobs": null, "finish_reason": finish})
            };
            sse(
                None,
                &json!({
                    "id": cid,
                    "object": if api == Api::OpenAiChat { "chat.completion.chunk" } else { "text_completion" },
                    "created": created,
                    "model": model,
                    "choices": [choice],
                }),
            )
        }
    };
    let opening: Vec<String> = match api {
        Api::OpenAiChat => vec![openai_chunk(
            json!({"role": "assistant", "content": ""}),
            None,
        )],
        Api::Anthropic => vec![
            sse(
                Some("message_start"),
                &json!({"type": "message_start", "message": {
                    "id": cid, "type": "message", "role": "assistant", "model": model,
                    "content": [], "stop_reason": null, "stop_sequence": null,
                    "usage": {"input_tokens": prompt_tokens, "output_tokens": 0},
                }}),
            ),
            sse(
                Some("content_block_start"),
                &json!({"type": "content_block_start", "index": 0, "content_block": {"type": "text", "text": ""}}),
            ),
            sse(Some("ping"), &json!({"type": "ping"})),
        ],
        _ => Vec::new(),
    };
    let body = events.flat_map(move |e| {
        let chunks: Vec<String> = match e {
            Ok(Event::Text(t)) if t.is_empty() => Vec::new(),
            Ok(Event::Text(t)) => match api {
                Api::OpenAiChat | Api::OpenAiText => vec![openai_chunk(json!({"content": t}), None)],
                Api::Anthropic => vec![sse(Some("content_block_delta"), &json!({"type": "content_block_delta", "index": 0, "delta": {"type": "text_delta", "text": t}}))],
                Api::OllamaChat | Api::OllamaGenerate => vec![json_body(&ollama_line(api, &model, &t, false)) + "\n"],
            },
            Ok(Event::Done { finish, prompt_tokens, completion_tokens }) => match api {
                Api::OpenAiChat | Api::OpenAiText => {
                    let mut out = vec![openai_chunk(json!({}), Some(finish_openai(finish)))];
                    if include_usage {
                        out.push(sse(None, &json!({
                            "id": cid, "object": if api == Api::OpenAiChat { "chat.completion.chunk" } else { "text_completion" },
                            "created": created, "model": model, "choices": [],
                            "usage": {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens, "total_tokens": prompt_tokens + completion_tokens},
                        })));
                    }
                    out.push("data: [DONE]\n\n".to_string());
                    out
                }
                Api::Anthropic => vec![
                    sse(Some("content_block_stop"), &json!({"type": "content_block_stop", "index": 0})),
                    sse(Some("message_delta"), &json!({"type": "message_delta", "delta": {"stop_reason": finish_anthropic(finish), "stop_sequence": null}, "usage": {"output_tokens": completion_tokens}})),
                    sse(Some("message_stop"), &json!({"type": "message_stop"})),
                ],
                Api::OllamaChat | Api::OllamaGenerate => {
                    let mut v = ollama_line(api, &model, "", true);
                    ollama_done(&mut v, finish, prompt_tokens, completion_tokens);
                    vec![json_body(&v) + "\n"]
                }
            },
            Err(e) => match api {
                Api::OpenAiChat | Api::OpenAiText => vec![sse(None, &json!({"error": {"message": e.message, "type": "api_error"}}))],
                Api::Anthropic => vec![sse(Some("error"), &json!({"type": "error", "error": {"type": "api_error", "message": e.message}}))],
                Api::OllamaChat | Api::OllamaGenerate => vec![json_body(&json!({"error": e.message})) + "\n"],
            },
        };
        futures::stream::iter(chunks)
    });
    futures::stream::iter(opening).chain(body)
}

/// `GET /v1/models`.
pub async fn openai_models(State(app): State<App>, headers: HeaderMap) -> Response {
    if let Err(e) = app.keys.check(&headers) {
        return error_response(Api::OpenAiChat, &e);
    }
    let data: Vec<Value> = app
        .router
        .served()
        .into_iter()
        .map(|s| {
            let created = s.created().map_or(0, |t| t.as_second());
            json!({"id": s.name, "object": "model", "created": created, "owned_by": "shardplane"})
        })
        .collect();
    json_response(&json!({"object": "list", "data": data}))
}

/// `GET /api/tags`.
pub async fn ollama_tags(State(app): State<App>, headers: HeaderMap) -> Response {
    if let Err(e) = app.keys.check(&headers) {
        return error_response(Api::OllamaChat, &e);
    }
    let models: Vec<Value> = app
        .router
        .served()
        .into_iter()
        .map(|s| {
            let st = s.model.as_ref().and_then(|m| m.status.clone()).unwrap_or_default();
            let modified = s.created().map(|t| t.to_string()).unwrap_or_default();
            json!({
                "name": s.name,
                "model": s.name,
                "modified_at": modified,
                "size": st.total_bytes.unwrap_or(0),
                "digest": st.sha256.clone().unwrap_or_default(),
                "details": {
                    "format": s.model.as_ref().map(|m| format!("{:?}", m.spec.format).to_lowercase()).unwrap_or_default(),
                    "family": st.architecture.clone().unwrap_or_default(),
                    "families": st.architecture.iter().collect::<Vec<_>>(),
                    "parameter_size": "",
                    "quantization_level": st.quantization.clone().unwrap_or_default(),
                },
            })
        })
        .collect();
    json_response(&json!({"models": models}))
}
