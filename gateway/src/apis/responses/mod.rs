//! OpenAI's Responses API: `/v1/responses`. Input is text or a list of
//! items (messages, function calls, function-call outputs); `instructions`
//! are the system prompt of this response only; `previous_response_id`
//! continues a conversation kept in a bounded [`Store`]. Streams are named
//! server-sent events, each with a `sequence_number`.
//!
//! ```text
//!  previous_response_id ─► Store ─► earlier conversation ─┐
//!  instructions ─► system message ────────────────────────┼─► Prompt ─► router
//!  input items ─► user/assistant/tool messages ───────────┘
//!  answer: Text… ToolCall… ─► output [message?, function_call…] ─► Store (unless store: false)
//!  stream: response.created, response.in_progress,
//!          (output_item.added, content_part.added, output_text.delta…, …done) per message,
//!          (output_item.added, function_call_arguments.delta, …done) per call,
//!          response.completed | response.incomplete
//! ```
//!
//! The [`Store`] keeps the last [`STORED_RESPONSES`] responses and at most
//! [`STORED_BYTES`](crate::conversations::STORED_BYTES) of text in the gateway's memory; a response older than
//! that, or kept by another gateway replica, is not found (400).
//!
//! This file parses requests and builds whole responses; [`stream`] writes
//! a response's events as its answer comes.

use std::sync::Arc;

use futures::stream::BoxStream;
use serde_json::{Value, json};
use shardplane_dataplane as dp;

mod stream;

use super::fields::{
    array, chat_message, float, function_tool, known_only, max_tokens, model, only_value, tool_set,
    uint,
};
use super::openai::{OpenAi, response_format, token_logprobs};
use super::rendering::Rendering;
use super::{Collected, Dialect, Request, id, listing, now_secs};
use crate::App;
use crate::conversations::{STORED_RESPONSES, Store};
use crate::protocol::{ApiError, Events, Finish, Input, Prompt};
use axum::extract::{Path, State};
use axum::http::HeaderMap;
use axum::response::Response;

/// The Responses API, with the store its conversations continue from.
#[derive(Clone, Default)]
pub struct Responses {
    store: Arc<Store>,
}

/// The request fields this gateway implements (`metadata` is echoed back;
/// `user`, `safety_identifier` and `prompt_cache_key` change nothing here);
/// `truncation` passes only as `disabled`; `include` takes the output
/// text's log-probabilities ([`logprobs`]);
/// `reasoning` takes `effort` (see [`Rendering::effort`]).
const FIELDS: &[&str] = &[
    "model",
    "input",
    "instructions",
    "tools",
    "tool_choice",
    "parallel_tool_calls",
    "max_output_tokens",
    "temperature",
    "top_p",
    "stream",
    "previous_response_id",
    "store",
    "text",
    "metadata",
    "user",
    "safety_identifier",
    "prompt_cache_key",
    "truncation",
    "reasoning",
    "include",
    "top_logprobs",
];

/// A message's content: a string, or parts of type `input_text` or
/// `output_text`.
fn content(v: &Value, at: &str) -> Result<String, ApiError> {
    match v {
        Value::String(s) => Ok(s.clone()),
        Value::Array(parts) => {
            let mut out = String::new();
            for (j, p) in parts.iter().enumerate() {
                let at = format!("{at}[{j}]");
                match (p["type"].as_str(), p["text"].as_str()) {
                    (Some("input_text" | "output_text"), Some(t)) => {
                        known_only(
                            p,
                            &format!("{at}."),
                            &["type", "text", "annotations", "logprobs"],
                        )?;
                        out.push_str(t);
                    }
                    _ => {
                        return Err(ApiError::invalid(format!(
                            "`{at}.type` {} is not supported (supported: input_text, output_text)",
                            p["type"]
                        )));
                    }
                }
            }
            Ok(out)
        }
        _ => Err(ApiError::invalid(format!(
            "`{at}` must be a string or an array of text parts"
        ))),
    }
}

/// The input items as messages: messages by role, a function call joins
/// the assistant message before it (or starts one), a function call's
/// output becomes a tool message.
fn items(input: &Value) -> Result<Vec<dp::ChatMessage>, ApiError> {
    let list = match input {
        Value::String(s) => return Ok(vec![chat_message("user", s.clone())]),
        Value::Array(a) if !a.is_empty() => a,
        Value::Null => return Err(ApiError::invalid("`input` is required")),
        _ => {
            return Err(ApiError::invalid(
                "`input` must be a string or a non-empty array of items",
            ));
        }
    };
    let mut chat: Vec<dp::ChatMessage> = Vec::new();
    for (i, item) in list.iter().enumerate() {
        let at = format!("input[{i}]");
        let kind = match item["type"].as_str() {
            None if item["role"].is_string() => "message",
            Some(k) => k,
            None => return Err(ApiError::invalid(format!("`{at}.type` is required"))),
        };
        match kind {
            "message" => {
                known_only(
                    item,
                    &format!("{at}."),
                    &["type", "role", "content", "id", "status"],
                )?;
                let role = match item["role"].as_str() {
                    Some("developer" | "system") => "system",
                    Some(r @ ("user" | "assistant")) => r,
                    _ => {
                        return Err(ApiError::invalid(format!(
                            "`{at}.role` {} is not user, assistant, system or developer",
                            item["role"]
                        )));
                    }
                };
                chat.push(chat_message(
                    role,
                    content(&item["content"], &format!("{at}.content"))?,
                ));
            }
            "function_call" => {
                known_only(
                    item,
                    &format!("{at}."),
                    &["type", "id", "call_id", "name", "arguments", "status"],
                )?;
                let (Some(call_id), Some(name), Some(arguments)) = (
                    item["call_id"].as_str(),
                    item["name"].as_str(),
                    item["arguments"].as_str(),
                ) else {
                    return Err(ApiError::invalid(format!(
                        "`{at}` needs `call_id`, `name` and `arguments` (a string)"
                    )));
                };
                if chat.last().is_none_or(|m| m.role != "assistant") {
                    chat.push(chat_message("assistant", ""));
                }
                if let Some(m) = chat.last_mut() {
                    m.tool_calls.push(dp::ToolCall {
                        id: call_id.to_string(),
                        name: name.to_string(),
                        arguments: arguments.to_string(),
                    });
                }
            }
            "function_call_output" => {
                known_only(
                    item,
                    &format!("{at}."),
                    &["type", "id", "call_id", "output", "status"],
                )?;
                let call_id = item["call_id"]
                    .as_str()
                    .ok_or_else(|| ApiError::invalid(format!("`{at}.call_id` is required")))?;
                chat.push(dp::ChatMessage {
                    role: "tool".into(),
                    content: content(&item["output"], &format!("{at}.output"))?,
                    tool_call_id: call_id.to_string(),
                    ..Default::default()
                });
            }
            other => {
                return Err(ApiError::invalid(format!(
                    "`{at}.type` {other:?} is not supported (supported: message, function_call, function_call_output)"
                )));
            }
        }
    }
    Ok(chat)
}

/// Function tools (`{type: "function", name, description, parameters,
/// strict}`), `tool_choice` and `parallel_tool_calls`.
fn tools(v: &Value) -> Result<Option<dp::ToolSet>, ApiError> {
    let mut tools = Vec::new();
    for (i, t) in array(v, "tools")?.iter().enumerate() {
        let at = format!("tools[{i}]");
        if t["type"] != "function" {
            return Err(ApiError::invalid(format!(
                "`{at}.type` {} is not supported (supported: function)",
                t["type"]
            )));
        }
        known_only(
            t,
            &format!("{at}."),
            &["type", "name", "description", "parameters", "strict"],
        )?;
        tools.push(function_tool(t, &at, "parameters")?);
    }
    let c = &v["tool_choice"];
    let (choice, function) = match c {
        Value::Null => (dp::ToolChoice::Auto, String::new()),
        Value::String(s) if s == "auto" => (dp::ToolChoice::Auto, String::new()),
        Value::String(s) if s == "required" => (dp::ToolChoice::Required, String::new()),
        Value::String(s) if s == "none" => return Ok(None),
        c if c["type"] == "function" && c["name"].is_string() => {
            known_only(c, "tool_choice.", &["type", "name"])?;
            (
                dp::ToolChoice::Function,
                c["name"].as_str().unwrap_or_default().to_string(),
            )
        }
        c => {
            return Err(ApiError::invalid(format!(
                "`tool_choice` {c} is not supported (supported: \"auto\", \"none\", \"required\", {{\"type\": \"function\", \"name\": …}})"
            )));
        }
    };
    tool_set(
        tools,
        choice,
        function,
        v["parallel_tool_calls"].as_bool().unwrap_or(true),
    )
}

/// The output grammar of `text.format` (`text`, `json_object`, or
/// `json_schema` with `name`, `schema` and `strict` beside the type).
fn text_format(text: &Value) -> Result<Option<dp::OutputGrammar>, ApiError> {
    known_only(text, "text.", &["format"])?;
    let f = &text["format"];
    known_only(
        f,
        "text.format.",
        &["type", "name", "description", "schema", "strict"],
    )?;
    if f["type"] == "json_schema" {
        let spec = json!({"name": f["name"], "schema": f["schema"], "strict": f["strict"]});
        return response_format(&json!({"type": "json_schema", "json_schema": spec})).map_err(
            |e| {
                ApiError::invalid(
                    e.message
                        .replace("response_format.json_schema", "text.format"),
                )
            },
        );
    }
    response_format(f)
        .map_err(|e| ApiError::invalid(e.message.replace("response_format", "text.format")))
}

fn status(f: Finish) -> (&'static str, Value) {
    match f {
        Finish::Length => ("incomplete", json!({"reason": "max_output_tokens"})),
        Finish::Stop | Finish::ToolCalls => ("completed", Value::Null),
    }
}

/// The 404 of a response that is not kept here.
fn not_kept(id: &str) -> ApiError {
    ApiError::not_found(format!(
        "response {id:?} is not kept here: this gateway keeps the last {STORED_RESPONSES} responses in memory, and not those made with `store: false`"
    ))
}

/// `GET /v1/responses/{id}`: a kept response.
pub async fn get(State(app): State<App>, Path(id): Path<String>, headers: HeaderMap) -> Response {
    listing(&app, &headers, OpenAi::Chat, |_| {
        app.responses.retrieve(&id)
    })
}

/// `DELETE /v1/responses/{id}`: forgets a kept response.
pub async fn delete(
    State(app): State<App>,
    Path(id): Path<String>,
    headers: HeaderMap,
) -> Response {
    listing(&app, &headers, OpenAi::Chat, |_| app.responses.delete(&id))
}

fn message_item(id: &str, text: &str, status: &str, logprobs: &[Value]) -> Value {
    json!({"type": "message", "id": id, "status": status, "role": "assistant",
           "content": [{"type": "output_text", "text": text, "annotations": [], "logprobs": logprobs}]})
}

/// What `include` and `top_logprobs` ask for: the output text's
/// log-probabilities (`message.output_text.logprobs`) with that many
/// alternatives (0 to 20), or nothing.
fn logprobs(v: &Value) -> Result<Option<u32>, ApiError> {
    const LOGPROBS: &str = "message.output_text.logprobs";
    let mut asked = false;
    for (i, item) in array(v, "include")?.iter().enumerate() {
        match item.as_str() {
            Some(LOGPROBS) => asked = true,
            _ => {
                return Err(ApiError::invalid(format!(
                    "`include[{i}]` {item} is not supported by this gateway (supported: {LOGPROBS:?})"
                )));
            }
        }
    }
    match (asked, uint(v, "top_logprobs")?) {
        (true, None) => Ok(Some(0)),
        (true, Some(n @ 0..=20)) => Ok(Some(n as u32)),
        (true, Some(n)) => Err(ApiError::invalid(format!(
            "`top_logprobs` {n} must be between 0 and 20"
        ))),
        (false, None) => Ok(None),
        (false, Some(_)) => Err(ApiError::invalid(format!(
            "`top_logprobs` needs `include: [{LOGPROBS:?}]`"
        ))),
    }
}

fn reasoning_item(id: &str, text: &str, status: &str) -> Value {
    json!({"type": "reasoning", "id": id, "status": status, "summary": [],
           "content": [{"type": "reasoning_text", "text": text}]})
}

fn call_item(id: &str, c: &dp::ToolCall, arguments: &str, status: &str) -> Value {
    json!({"type": "function_call", "id": id, "call_id": c.id, "name": c.name,
           "arguments": arguments, "status": status})
}

impl Responses {
    /// The Responses API over `store`.
    pub fn new(store: Arc<Store>) -> Self {
        Responses { store }
    }

    /// A kept response, as it was answered.
    fn retrieve(&self, id: &str) -> Result<Value, ApiError> {
        self.store
            .response(id)
            .map(|r| (*r).clone())
            .ok_or_else(|| not_kept(id))
    }

    /// Forgets a kept response.
    fn delete(&self, id: &str) -> Result<Value, ApiError> {
        if !self.store.delete(id) {
            return Err(not_kept(id));
        }
        Ok(json!({"id": id, "object": "response", "deleted": true}))
    }

    /// Keeps the conversation of `req` and its answer as the response `id`'s
    /// (unless the request said `store: false`).
    fn keep(&self, req: &Request, id: &str, text: &str, calls: &[dp::ToolCall], response: &Value) {
        if req.context["store"] == false {
            return;
        }
        let Input::Chat(dp::Conversation { messages: chat, .. }) = &req.prompt.input else {
            return;
        };
        let skip = req.context["skip"].as_u64().unwrap_or(0) as usize;
        let mut conversation = chat[skip.min(chat.len())..].to_vec();
        let mut answer = chat_message("assistant", text);
        answer.tool_calls = calls.to_vec();
        conversation.push(answer);
        self.store
            .put(id.to_string(), conversation, response.clone());
    }
}

/// The response object: what the request asked (echoed), then `output`,
/// its status and usage.
fn response(
    req: &Request,
    id: &str,
    created: i64,
    state: (&str, Value),
    output: Vec<Value>,
    usage: Value,
) -> Value {
    let mut r = req.context["echo"].clone();
    for (k, v) in [
        ("id", json!(id)),
        ("object", json!("response")),
        ("created_at", json!(created)),
        ("status", json!(state.0)),
        ("incomplete_details", state.1),
        ("error", Value::Null),
        ("model", json!(req.model)),
        ("output", Value::Array(output)),
        ("usage", usage),
    ] {
        r[k] = v;
    }
    r
}

fn usage(prompt: u32, completion: u32, cached: u32) -> Value {
    json!({"input_tokens": prompt, "input_tokens_details": {"cached_tokens": cached},
           "output_tokens": completion, "output_tokens_details": {"reasoning_tokens": 0},
           "total_tokens": prompt + completion})
}

impl Dialect for Responses {
    const LABEL: &'static str = "openai";

    fn parse(&self, v: &Value) -> Result<Request, ApiError> {
        let model = model(v)?;
        known_only(v, "", FIELDS)?;
        only_value(v, "truncation", |t| t == "disabled", "\"disabled\"")?;
        if !(v["reasoning"].is_null() || v["reasoning"].is_object()) {
            return Err(ApiError::invalid("`reasoning` must be an object"));
        }
        known_only(&v["reasoning"], "reasoning.", &["effort"])?;
        let mut rendering = Rendering::default();
        rendering.effort("reasoning.effort", &v["reasoning"]["effort"])?;
        let grammar = text_format(&v["text"])?;
        let tools = tools(v)?;
        if grammar.is_some() && tools.is_some() {
            return Err(ApiError::invalid(
                "`text.format` cannot go with `tools` here: give one or the other",
            ));
        }
        let mut chat = Vec::new();
        let instructions = match &v["instructions"] {
            Value::Null => None,
            Value::String(s) => Some(s.clone()),
            _ => return Err(ApiError::invalid("`instructions` must be a string")),
        };
        if let Some(s) = instructions.as_ref().filter(|s| !s.is_empty()) {
            chat.push(chat_message("system", s.clone()));
        }
        let skip = chat.len();
        match &v["previous_response_id"] {
            Value::Null => {}
            Value::String(id) => chat.extend(self.store.get(id).ok_or_else(|| {
                ApiError::invalid(format!(
                    "`previous_response_id` {id:?} is not found: this gateway keeps the last {STORED_RESPONSES} responses in memory, and not those made with `store: false`"
                ))
            })?.iter().cloned()),
            _ => return Err(ApiError::invalid("`previous_response_id` must be a string")),
        }
        chat.extend(items(&v["input"])?);
        let limit = uint(v, "max_output_tokens")?;
        let echo = json!({
            "instructions": instructions,
            "metadata": if v["metadata"].is_object() { v["metadata"].clone() } else { json!({}) },
            "parallel_tool_calls": v["parallel_tool_calls"].as_bool().unwrap_or(true),
            "temperature": v["temperature"].as_f64().unwrap_or(1.0),
            "top_p": v["top_p"].as_f64().unwrap_or(1.0),
            "tool_choice": if v["tool_choice"].is_null() { json!("auto") } else { v["tool_choice"].clone() },
            "tools": if v["tools"].is_array() { v["tools"].clone() } else { json!([]) },
            "max_output_tokens": limit,
            "top_logprobs": v["top_logprobs"],
            "previous_response_id": v["previous_response_id"],
            "store": v["store"] != false,
            "text": if v["text"]["format"].is_object() { v["text"].clone() } else { json!({"format": {"type": "text"}}) },
            "truncation": "disabled",
            "reasoning": {"effort": v["reasoning"]["effort"], "summary": null},
        });
        Ok(Request {
            model,
            prompt: Prompt {
                input: Input::Chat(rendering.conversation(chat)),
                sampling: dp::Sampling {
                    temperature: float(v, "temperature", 1.0, (0.0, 2.0))?,
                    top_p: float(v, "top_p", 0.0, (0.0, 1.0))?,
                    max_tokens: max_tokens(limit)?,
                    logprobs: logprobs(v)?,
                    ..Default::default()
                },
                grammar,
                tools,
            },
            stream: v["stream"].as_bool().unwrap_or(false),
            include_usage: true,
            context: json!({"echo": echo, "skip": skip, "store": v["store"] != false}),
        })
    }

    fn error_body(&self, e: &ApiError) -> Value {
        OpenAi::Chat.error_body(e)
    }

    fn answer(&self, req: &Request, c: &Collected) -> Value {
        let rid = id("resp_");
        let mut output = Vec::new();
        if !c.reasoning.is_empty() {
            output.push(reasoning_item(&id("rs_"), &c.reasoning, "completed"));
        }
        if !c.text.is_empty() || c.tool_calls.is_empty() {
            let logprobs = match req.prompt.sampling.logprobs {
                Some(_) => token_logprobs(&c.logprobs),
                None => Vec::new(),
            };
            output.push(message_item(&id("msg_"), &c.text, "completed", &logprobs));
        }
        output.extend(
            c.tool_calls
                .iter()
                .map(|t| call_item(&id("fc_"), t, &t.arguments, "completed")),
        );
        let whole = response(
            req,
            &rid,
            now_secs(),
            status(c.finish),
            output,
            usage(c.prompt_tokens, c.completion_tokens, c.cached_tokens),
        );
        self.keep(req, &rid, &c.text, &c.tool_calls, &whole);
        whole
    }

    fn stream(
        &self,
        req: &Request,
        _prompt_tokens: u32,
        events: Events,
    ) -> BoxStream<'static, String> {
        stream::stream(self, req, events)
    }
}

#[cfg(test)]
mod tests;
