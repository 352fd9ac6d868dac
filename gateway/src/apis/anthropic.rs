//! Anthropic: `/v1/messages`. The system prompt is a field of its own;
//! messages hold content blocks (text, `tool_use` in the assistant's,
//! `tool_result` in the user's); streams are named server-sent events.
//!
//! ```text
//!  user [tool_result…, text…]     ─► tool messages (one per result), then a user message
//!  assistant [text…, tool_use…]   ─► one assistant message with its calls
//!  answer: Text… ToolCall…        ─► content [text?, tool_use…], stop_reason tool_use
//!  stream: message_start, ping, (content_block_start, *_delta…, content_block_stop)…,
//!          message_delta, message_stop
//! ```

use futures::stream::BoxStream;
use serde_json::{Value, json};
use shardplane_dataplane as dp;

use super::fields::{
    array, chat_message, content_text, float, function_tool, given, known_only, max_tokens, model,
    stops, tool_set, uint,
};
use super::rendering::Rendering;
use super::{Collected, Dialect, Request, chunked, error_type, id, sse};
use crate::protocol::{ApiError, Event, Events, Finish, Input, Kind, Prompt};

/// The Anthropic Messages API.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Anthropic;

/// The Messages fields this gateway implements (`metadata.user_id` changes
/// nothing here).
const FIELDS: &[&str] = &[
    "model",
    "messages",
    "max_tokens",
    "system",
    "temperature",
    "top_p",
    "top_k",
    "stop_sequences",
    "stream",
    "metadata",
    "tools",
    "tool_choice",
    "thinking",
];

/// The fields of each content block this gateway takes (`cache_control`
/// is a caching hint: this gateway caches nothing, so it changes nothing).
fn block_fields(kind: &str) -> Option<&'static [&'static str]> {
    match kind {
        "text" => Some(&["type", "text", "cache_control"]),
        "tool_use" => Some(&["type", "id", "name", "input", "cache_control"]),
        "tool_result" => Some(&[
            "type",
            "tool_use_id",
            "content",
            "is_error",
            "cache_control",
        ]),
        _ => None,
    }
}

/// The conversation: `system`, then each message's blocks. A user's
/// `tool_result` blocks become tool messages (before the user's text); an
/// assistant's `tool_use` blocks become its calls.
fn conversation(v: &Value) -> Result<Vec<dp::ChatMessage>, ApiError> {
    let mut chat = Vec::new();
    let system = content_text(&v["system"], "system")?;
    if !system.is_empty() {
        chat.push(chat_message("system", system));
    }
    let Some(list) = v["messages"].as_array().filter(|l| !l.is_empty()) else {
        return Err(ApiError::invalid(
            "`messages` must be a non-empty array of messages",
        ));
    };
    for (i, m) in list.iter().enumerate() {
        let at = format!("messages[{i}]");
        known_only(m, &format!("{at}."), &["role", "content"])?;
        let role = m["role"].as_str().unwrap_or_default();
        if role != "user" && role != "assistant" {
            return Err(ApiError::invalid(format!(
                "{at}.role {:?} is not user or assistant (put system prompts in `system`)",
                m["role"]
            )));
        }
        let blocks = match &m["content"] {
            Value::String(s) => vec![json!({"type": "text", "text": s})],
            Value::Array(b) => b.clone(),
            _ => {
                return Err(ApiError::invalid(format!(
                    "{at}.content must be a string or an array of content blocks"
                )));
            }
        };
        let mut message = chat_message(role, "");
        let mut results = 0;
        for (j, b) in blocks.iter().enumerate() {
            let at = format!("{at}.content[{j}]");
            let kind = b["type"].as_str().unwrap_or_default();
            let Some(known) = block_fields(kind) else {
                return Err(ApiError::invalid(format!(
                    "{at}: content blocks of type {:?} are not supported (supported: text, tool_use, tool_result)",
                    b["type"]
                )));
            };
            known_only(b, &format!("{at}."), known)?;
            match (kind, role) {
                ("text", _) => message.content.push_str(
                    b["text"]
                        .as_str()
                        .ok_or_else(|| ApiError::invalid(format!("{at}.text must be a string")))?,
                ),
                ("tool_use", "assistant") => {
                    let (Some(id), Some(name), true) =
                        (b["id"].as_str(), b["name"].as_str(), b["input"].is_object())
                    else {
                        return Err(ApiError::invalid(format!(
                            "{at}: a tool_use block needs `id`, `name` and an object `input`"
                        )));
                    };
                    message.tool_calls.push(dp::ToolCall {
                        id: id.to_string(),
                        name: name.to_string(),
                        arguments: b["input"].to_string(),
                    });
                }
                ("tool_result", "user") => {
                    let id = b["tool_use_id"].as_str().ok_or_else(|| {
                        ApiError::invalid(format!("{at}.tool_use_id is required"))
                    })?;
                    let mut content = content_text(&b["content"], &format!("{at}.content"))?;
                    if b["is_error"] == true {
                        content = format!("Error: {content}");
                    }
                    results += 1;
                    chat.push(dp::ChatMessage {
                        role: "tool".into(),
                        content,
                        tool_call_id: id.to_string(),
                        ..Default::default()
                    });
                }
                _ => {
                    return Err(ApiError::invalid(format!(
                        "{at}: a {kind} block cannot be in a {role} message"
                    )));
                }
            }
        }
        if role == "assistant" || results == 0 || !message.content.is_empty() {
            chat.push(message);
        }
    }
    Ok(chat)
}

/// The tool set: `tools` (custom tools: `name`, `description`,
/// `input_schema`) and `tool_choice` (`auto`, `any`, `tool` with a `name`,
/// `none`; `disable_parallel_tool_use`). None without tools or with `none`.
fn tools(v: &Value) -> Result<Option<dp::ToolSet>, ApiError> {
    let c = &v["tool_choice"];
    known_only(
        c,
        "tool_choice.",
        &["type", "name", "disable_parallel_tool_use"],
    )?;
    let (choice, function) = match c["type"].as_str() {
        _ if c.is_null() => (dp::ToolChoice::Auto, String::new()),
        Some("auto") => (dp::ToolChoice::Auto, String::new()),
        Some("any") => (dp::ToolChoice::Required, String::new()),
        Some("tool") => match c["name"].as_str() {
            Some(name) => (dp::ToolChoice::Function, name.to_string()),
            None => {
                return Err(ApiError::invalid(
                    "`tool_choice.name` is required with type tool",
                ));
            }
        },
        Some("none") => return Ok(None),
        _ => {
            return Err(ApiError::invalid(format!(
                "`tool_choice.type` {} is not supported (supported: auto, any, tool, none)",
                c["type"]
            )));
        }
    };
    let mut tools = Vec::new();
    for (i, t) in array(v, "tools")?.iter().enumerate() {
        let at = format!("tools[{i}]");
        if !(t["type"].is_null() || t["type"] == "custom") {
            return Err(ApiError::invalid(format!(
                "`{at}.type` {} is not supported (supported: custom tools, with `input_schema`)",
                t["type"]
            )));
        }
        known_only(
            t,
            &format!("{at}."),
            &[
                "type",
                "name",
                "description",
                "input_schema",
                "cache_control",
            ],
        )?;
        if !t["input_schema"].is_object() {
            return Err(ApiError::invalid(format!(
                "`{at}.input_schema` is required"
            )));
        }
        tools.push(function_tool(t, &at, "input_schema")?);
    }
    tool_set(
        tools,
        choice,
        function,
        c["disable_parallel_tool_use"] != true,
    )
}

fn stop_reason(f: Finish) -> &'static str {
    match f {
        Finish::Stop => "end_turn",
        Finish::Length => "max_tokens",
        Finish::ToolCalls => "tool_use",
    }
}

/// `thinking`: `{"type": "disabled"}`, or `{"type": "enabled",
/// "budget_tokens": N}` with N below `max_tokens` (Anthropic's floor of
/// 1024 is not imposed: small models think briefly).
fn thinking(t: &Value, max_tokens: u64) -> Result<Rendering, ApiError> {
    let mut r = Rendering::default();
    if t.is_null() {
        return Ok(r);
    }
    if !t.is_object() {
        return Err(ApiError::invalid("`thinking` must be an object"));
    }
    known_only(t, "thinking.", &["type", "budget_tokens"])?;
    match t["type"].as_str() {
        Some("disabled") => {
            if given(&t["budget_tokens"]) {
                return Err(ApiError::invalid(
                    "`thinking.budget_tokens` goes with `thinking.type` enabled",
                ));
            }
            r.thinking(false);
        }
        Some("enabled") => {
            let budget = uint(t, "budget_tokens")?.ok_or_else(|| {
                ApiError::invalid("`thinking.budget_tokens` is required when thinking is enabled")
            })?;
            if budget == 0 || budget >= max_tokens {
                return Err(ApiError::invalid(format!(
                    "`thinking.budget_tokens` must be at least 1 and less than `max_tokens` ({max_tokens})"
                )));
            }
            r.thinking(true);
            r.budget(budget as u32);
        }
        _ => {
            return Err(ApiError::invalid(format!(
                "`thinking.type` {} is not supported (supported: \"enabled\", \"disabled\")",
                t["type"]
            )));
        }
    }
    Ok(r)
}

impl Dialect for Anthropic {
    const LABEL: &'static str = "anthropic";

    fn parse(&self, v: &Value) -> Result<Request, ApiError> {
        let model = model(v)?;
        known_only(v, "", FIELDS)?;
        known_only(&v["metadata"], "metadata.", &["user_id"])?;
        let limit =
            uint(v, "max_tokens")?.ok_or_else(|| ApiError::invalid("`max_tokens` is required"))?;
        let chat = thinking(&v["thinking"], limit)?.conversation(conversation(v)?);
        let tools = tools(v)?;
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
                grammar: None,
                tools,
            },
            stream: v["stream"].as_bool().unwrap_or(false),
            include_usage: true,
            context: Value::Null,
        })
    }

    fn error_body(&self, e: &ApiError) -> Value {
        json!({"type": "error", "error": {
            "type": match e.kind {
                Kind::Unavailable => "overloaded_error",
                kind => error_type(kind),
            },
            "message": e.message,
        }})
    }

    fn answer(&self, req: &Request, c: &Collected) -> Value {
        let model = req.model.as_str();
        let mut content = Vec::new();
        if !c.reasoning.is_empty() {
            content.push(json!({"type": "thinking", "thinking": c.reasoning, "signature": ""}));
        }
        if !c.text.is_empty() || c.tool_calls.is_empty() {
            content.push(json!({"type": "text", "text": c.text}));
        }
        content.extend(
            c.tool_calls.iter().map(
                |t| json!({"type": "tool_use", "id": t.id, "name": t.name, "input": input(t)}),
            ),
        );
        json!({
            "id": id("msg_"),
            "type": "message",
            "role": "assistant",
            "model": model,
            "content": content,
            "stop_reason": stop_reason(c.finish),
            "stop_sequence": null,
            "usage": usage(c.prompt_tokens, c.cached_tokens, c.completion_tokens),
        })
    }

    fn stream(
        &self,
        req: &Request,
        prompt_tokens: u32,
        events: Events,
    ) -> BoxStream<'static, String> {
        let model = req.model.clone();
        let opening = vec![
            sse(
                Some("message_start"),
                &json!({"type": "message_start", "message": {
                    "id": id("msg_"), "type": "message", "role": "assistant", "model": model,
                    "content": [], "stop_reason": null, "stop_sequence": null,
                    "usage": {"input_tokens": prompt_tokens, "output_tokens": 0},
                }}),
            ),
            sse(Some("ping"), &json!({"type": "ping"})),
        ];
        let mut blocks = Blocks::default();
        chunked(opening, events, move |e| match e {
            Ok(Event::Text(t)) => {
                let mut out = blocks.open("text");
                out.push(blocks.delta(json!({"type": "text_delta", "text": t})));
                out
            }
            Ok(Event::Reasoning(r)) => {
                let mut out = blocks.open("thinking");
                out.push(blocks.delta(json!({"type": "thinking_delta", "thinking": r})));
                out
            }
            // Not asked for: this API has none.
            Ok(Event::Logprobs(_)) => Vec::new(),
            Ok(Event::Waiting) => vec![sse(Some("ping"), &json!({"type": "ping"}))],
            Ok(Event::ToolCall(c)) => {
                let mut out = blocks.close();
                out.push(
                    blocks.start(
                        json!({"type": "tool_use", "id": c.id, "name": c.name, "input": {}}),
                    ),
                );
                out.push(blocks.delta(
                    json!({"type": "input_json_delta", "partial_json": input(&c).to_string()}),
                ));
                out.extend(blocks.close());
                out
            }
            Ok(Event::Done {
                finish,
                prompt_tokens,
                completion_tokens,
                cached_tokens,
            }) => {
                // An answer always has a text or tool_use block, if only
                // an empty text one.
                let mut out = if !blocks.answered {
                    blocks.open("text")
                } else {
                    Vec::new()
                };
                out.extend(blocks.close());
                out.push(sse(
                    Some("message_delta"),
                    // The final counts (cumulative, as Anthropic's are): the
                    // cached share is known once the prompt has run.
                    &json!({"type": "message_delta", "delta": {"stop_reason": stop_reason(finish), "stop_sequence": null},
                            "usage": usage(prompt_tokens, cached_tokens, completion_tokens)}),
                ));
                out.push(sse(Some("message_stop"), &json!({"type": "message_stop"})));
                out
            }
            Err(e) => vec![sse(
                Some("error"),
                &json!({"type": "error", "error": {"type": "api_error", "message": e.message}}),
            )],
        })
    }
}

/// A call's arguments as the object `input` (the head writes them as a JSON
/// object; anything else is kept whole under `arguments`).
fn input(c: &dp::ToolCall) -> Value {
    match serde_json::from_str::<Value>(&c.arguments) {
        Ok(v) if v.is_object() => v,
        _ => json!({"arguments": c.arguments}),
    }
}

/// The content blocks of a stream: which is open, the next one's index, and
/// whether a text or tool_use block has come.
#[derive(Default)]
struct Blocks {
    open: Option<&'static str>,
    next: usize,
    answered: bool,
}

impl Blocks {
    fn start(&mut self, block: Value) -> String {
        self.open = Some(match block["type"].as_str() {
            Some("text") => "text",
            Some("thinking") => "thinking",
            _ => "tool_use",
        });
        self.answered |= self.open != Some("thinking");
        sse(
            Some("content_block_start"),
            &json!({"type": "content_block_start", "index": self.next, "content_block": block}),
        )
    }

    /// A text or thinking block, unless one is open (closing any other
    /// first).
    fn open(&mut self, kind: &'static str) -> Vec<String> {
        if self.open == Some(kind) {
            return Vec::new();
        }
        let mut out = self.close();
        out.push(self.start(match kind {
            "thinking" => json!({"type": "thinking", "thinking": "", "signature": ""}),
            _ => json!({"type": "text", "text": ""}),
        }));
        out
    }

    fn delta(&self, delta: Value) -> String {
        sse(
            Some("content_block_delta"),
            &json!({"type": "content_block_delta", "index": self.next, "delta": delta}),
        )
    }

    fn close(&mut self) -> Vec<String> {
        if self.open.take().is_none() {
            return Vec::new();
        }
        self.next += 1;
        vec![sse(
            Some("content_block_stop"),
            &json!({"type": "content_block_stop", "index": self.next - 1}),
        )]
    }
}

/// Token counts as Anthropic gives them: `input_tokens` are the prompt's
/// tokens after what was read from the cache (`cache_read_input_tokens`, the
/// instance's prefix cache); nothing is ever written to a cache on request.
fn usage(prompt: u32, cached: u32, completion: u32) -> Value {
    json!({
        "input_tokens": prompt.saturating_sub(cached),
        "cache_creation_input_tokens": 0,
        "cache_read_input_tokens": cached,
        "output_tokens": completion,
    })
}

#[cfg(test)]
mod tests {
    use super::super::tests::{call, streamed};
    use super::*;

    fn request(extra: Value) -> Value {
        let mut v = json!({"model": "m", "max_tokens": 50, "messages": [
            {"role": "user", "content": "Weather in Paris?"},
            {"role": "assistant", "content": [
                {"type": "text", "text": "Let me look."},
                {"type": "tool_use", "id": "toolu_1", "name": "get_weather", "input": {"city": "Paris"}}]},
            {"role": "user", "content": [
                {"type": "tool_result", "tool_use_id": "toolu_1", "content": [{"type": "text", "text": "sunny"}]},
                {"type": "text", "text": "And tomorrow?"}]}],
            "tools": [{"name": "get_weather", "description": "Weather.", "cache_control": {"type": "ephemeral"},
                       "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}}}]});
        for (k, x) in extra.as_object().unwrap() {
            v[k] = x.clone();
        }
        v
    }

    #[test]
    fn tool_use_and_tool_result_blocks_become_calls_and_tool_messages() {
        let prompt = Anthropic.parse(&request(json!({}))).unwrap().prompt;
        let Input::Chat(dp::Conversation { messages: chat, .. }) = prompt.input else {
            panic!("a chat")
        };
        let roles: Vec<&str> = chat.iter().map(|m| m.role.as_str()).collect();
        assert_eq!(roles, ["user", "assistant", "tool", "user"]);
        assert_eq!(chat[1].content, "Let me look.");
        assert_eq!(chat[1].tool_calls[0].id, "toolu_1");
        assert_eq!(chat[1].tool_calls[0].arguments, r#"{"city":"Paris"}"#);
        assert_eq!(
            (chat[2].tool_call_id.as_str(), chat[2].content.as_str()),
            ("toolu_1", "sunny")
        );
        assert_eq!(chat[3].content, "And tomorrow?");
        let set = prompt.tools.unwrap();
        assert_eq!(
            (set.tools[0].name.as_str(), set.choice, set.parallel),
            ("get_weather", dp::ToolChoice::Auto as i32, true)
        );
        // Results alone make no empty user message; an error result says so.
        let v = json!({"model": "m", "max_tokens": 5, "messages": [{"role": "user", "content": [
            {"type": "tool_result", "tool_use_id": "t", "content": "no such city", "is_error": true}]}]});
        let Input::Chat(dp::Conversation { messages: chat, .. }) =
            Anthropic.parse(&v).unwrap().prompt.input
        else {
            panic!("a chat")
        };
        assert_eq!(chat.len(), 1);
        assert_eq!(chat[0].content, "Error: no such city");
    }

    #[test]
    fn tool_choice_maps_and_what_is_not_implemented_is_named() {
        let choice = |c: Value| {
            Anthropic
                .parse(&request(json!({"tool_choice": c})))
                .map(|r| r.prompt.tools.map(|t| (t.choice, t.function, t.parallel)))
        };
        assert_eq!(
            choice(json!({"type": "any", "disable_parallel_tool_use": true})).unwrap(),
            Some((dp::ToolChoice::Required as i32, String::new(), false))
        );
        assert_eq!(
            choice(json!({"type": "tool", "name": "get_weather"})).unwrap(),
            Some((dp::ToolChoice::Function as i32, "get_weather".into(), true))
        );
        assert_eq!(choice(json!({"type": "none"})).unwrap(), None);
        for (c, named) in [
            (json!({"type": "tool", "name": "nope"}), "nope"),
            (json!({"type": "tool"}), "tool_choice.name"),
            (json!({"type": "sometimes"}), "tool_choice.type"),
        ] {
            let e = choice(c).unwrap_err();
            assert!(e.message.contains(named), "{}", e.message);
        }
        for (extra, named) in [
            (
                json!({"tools": [{"type": "web_search_20250305", "name": "web_search"}]}),
                "tools[0].type",
            ),
            (json!({"tools": [{"name": "f"}]}), "tools[0].input_schema"),
            (
                json!({"tools": [{"name": "f", "input_schema": {}, "strict": true}]}),
                "tools[0].strict",
            ),
            (
                json!({"messages": [{"role": "user", "content": [{"type": "image", "source": {}}]}]}),
                "image",
            ),
            (
                json!({"messages": [{"role": "user", "content": [{"type": "tool_use", "id": "1", "name": "f", "input": {}}]}]}),
                "user message",
            ),
            (
                json!({"messages": [{"role": "user", "content": [{"type": "text", "text": "x", "citations": []}, {"type": "text", "text": "y", "citations": [1]}]}]}),
                "messages[0].content[1].citations",
            ),
        ] {
            let e = Anthropic.parse(&request(extra)).unwrap_err();
            assert!(e.message.contains(named), "{named}: {}", e.message);
        }
    }

    #[test]
    fn calls_are_tool_use_blocks_whole_and_streamed() {
        let req = Anthropic.parse(&request(json!({}))).unwrap();
        let whole = Anthropic.answer(
            &req,
            &Collected {
                text: String::new(),
                reasoning: String::new(),
                tool_calls: vec![call()],
                logprobs: Vec::new(),
                finish: Finish::ToolCalls,
                prompt_tokens: 3,
                completion_tokens: 9,
                cached_tokens: 2,
            },
        );
        assert_eq!(
            whole["usage"],
            json!({"input_tokens": 1, "cache_creation_input_tokens": 0,
                   "cache_read_input_tokens": 2, "output_tokens": 9}),
            "the prefix cache's share as a cache read"
        );
        assert_eq!(
            whole["content"],
            json!([{"type": "tool_use", "id": "call_1", "name": "get_weather", "input": {"city": "Paris"}}])
        );
        assert_eq!(whole["stop_reason"], "tool_use");
        let data = streamed(
            &Anthropic,
            &req,
            vec![
                Event::Text("Sure.".into()),
                Event::ToolCall(call()),
                Event::ToolCall(call()),
                Event::Done {
                    finish: Finish::ToolCalls,
                    prompt_tokens: 3,
                    completion_tokens: 9,
                    cached_tokens: 2,
                },
            ],
        );
        let delta = data.iter().find(|d| d["type"] == "message_delta").unwrap();
        assert_eq!(delta["usage"]["cache_read_input_tokens"], 2);
        assert_eq!(delta["usage"]["input_tokens"], 1);
        let shape: Vec<String> = data
            .iter()
            .map(|d| {
                let kind = d["type"].as_str().unwrap();
                match (
                    &d["index"],
                    d["content_block"]["type"].as_str(),
                    d["delta"]["type"].as_str(),
                ) {
                    (Value::Number(i), Some(b), _) => format!("{kind} {i} {b}"),
                    (Value::Number(i), None, Some(t)) => format!("{kind} {i} {t}"),
                    (Value::Number(i), None, None) => format!("{kind} {i}"),
                    _ => kind.to_string(),
                }
            })
            .collect();
        assert_eq!(
            shape,
            [
                "message_start",
                "ping",
                "content_block_start 0 text",
                "content_block_delta 0 text_delta",
                "content_block_stop 0",
                "content_block_start 1 tool_use",
                "content_block_delta 1 input_json_delta",
                "content_block_stop 1",
                "content_block_start 2 tool_use",
                "content_block_delta 2 input_json_delta",
                "content_block_stop 2",
                "message_delta",
                "message_stop",
            ]
        );
        assert_eq!(
            serde_json::from_str::<Value>(data[6]["delta"]["partial_json"].as_str().unwrap())
                .unwrap(),
            json!({"city": "Paris"})
        );
        assert_eq!(data[11]["delta"]["stop_reason"], "tool_use");
    }
}
