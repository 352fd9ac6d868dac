//! Anthropic: `/v1/messages`. The system prompt is a field of its own;
//! streams are named server-sent events (`message_start`,
//! `content_block_delta`, …, `message_stop`).

use futures::stream::BoxStream;
use serde_json::{Value, json};
use shardplane_dataplane as dp;

use super::fields::{
    chat_message, content_text, float, known_only, max_tokens, message_fields, messages, model,
    only_value, stops, uint,
};
use super::{Collected, Dialect, Request, chunked, error_type, id, sse};
use crate::protocol::{ApiError, Event, Events, Finish, Input, Kind, Prompt};

/// The Anthropic Messages API.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Anthropic;

/// The Messages fields this gateway implements (`metadata.user_id` changes
/// nothing here; `tool_choice` and `thinking` pass only when they ask for
/// nothing more than text).
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
    "tool_choice",
    "thinking",
];

fn stop_reason(f: Finish) -> &'static str {
    match f {
        Finish::Stop => "end_turn",
        Finish::Length => "max_tokens",
        Finish::ToolCalls => "tool_use",
    }
}

impl Dialect for Anthropic {
    const LABEL: &'static str = "anthropic";

    fn parse(self, v: &Value) -> Result<Request, ApiError> {
        let model = model(v)?;
        known_only(v, "", FIELDS)?;
        known_only(&v["metadata"], "metadata.", &["user_id"])?;
        message_fields(v, "messages", &["role", "content"])?;
        only_value(
            v,
            "tool_choice",
            |c| c["type"] == "auto" || c["type"] == "none",
            r#"{"type": "auto"} or {"type": "none"} without tools"#,
        )?;
        only_value(
            v,
            "thinking",
            |t| t["type"] == "disabled",
            r#"{"type": "disabled"}"#,
        )?;
        let limit =
            uint(v, "max_tokens")?.ok_or_else(|| ApiError::invalid("`max_tokens` is required"))?;
        let mut chat = Vec::new();
        let system = content_text(&v["system"], "system")?;
        if !system.is_empty() {
            chat.push(chat_message("system", system));
        }
        for m in messages(v, "messages")? {
            if m.role != "user" && m.role != "assistant" {
                return Err(ApiError::invalid(format!(
                    "messages: role {:?} is not user or assistant (put system prompts in `system`)",
                    m.role
                )));
            }
            chat.push(m);
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
                grammar: None,
                tools: None,
            },
            stream: v["stream"].as_bool().unwrap_or(false),
            include_usage: true,
        })
    }

    fn error_body(self, e: &ApiError) -> Value {
        json!({"type": "error", "error": {
            "type": match e.kind {
                Kind::Unavailable => "overloaded_error",
                kind => error_type(kind),
            },
            "message": e.message,
        }})
    }

    fn answer(self, model: &str, c: &Collected) -> Value {
        json!({
            "id": id("msg_"),
            "type": "message",
            "role": "assistant",
            "model": model,
            "content": [{"type": "text", "text": c.text}],
            "stop_reason": stop_reason(c.finish),
            "stop_sequence": null,
            "usage": {"input_tokens": c.prompt_tokens, "output_tokens": c.completion_tokens},
        })
    }

    fn stream(
        self,
        model: String,
        prompt_tokens: u32,
        _include_usage: bool,
        events: Events,
    ) -> BoxStream<'static, String> {
        let opening = vec![
            sse(
                Some("message_start"),
                &json!({"type": "message_start", "message": {
                    "id": id("msg_"), "type": "message", "role": "assistant", "model": model,
                    "content": [], "stop_reason": null, "stop_sequence": null,
                    "usage": {"input_tokens": prompt_tokens, "output_tokens": 0},
                }}),
            ),
            sse(
                Some("content_block_start"),
                &json!({"type": "content_block_start", "index": 0, "content_block": {"type": "text", "text": ""}}),
            ),
            sse(Some("ping"), &json!({"type": "ping"})),
        ];
        chunked(opening, events, |e| match e {
            // Tools are refused by this dialect's parse: no call comes.
            Ok(Event::ToolCall(_)) => Vec::new(),
            Ok(Event::Text(t)) => vec![sse(
                Some("content_block_delta"),
                &json!({"type": "content_block_delta", "index": 0, "delta": {"type": "text_delta", "text": t}}),
            )],
            Ok(Event::Done {
                finish,
                completion_tokens,
                ..
            }) => vec![
                sse(
                    Some("content_block_stop"),
                    &json!({"type": "content_block_stop", "index": 0}),
                ),
                sse(
                    Some("message_delta"),
                    &json!({"type": "message_delta", "delta": {"stop_reason": stop_reason(finish), "stop_sequence": null}, "usage": {"output_tokens": completion_tokens}}),
                ),
                sse(Some("message_stop"), &json!({"type": "message_stop"})),
            ],
            Err(e) => vec![sse(
                Some("error"),
                &json!({"type": "error", "error": {"type": "api_error", "message": e.message}}),
            )],
        })
    }
}
