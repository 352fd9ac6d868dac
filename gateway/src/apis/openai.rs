//! OpenAI: `/v1/chat/completions`, the legacy `/v1/completions` and
//! `/v1/models`. Streams are server-sent events ending in `data: [DONE]`.

use axum::extract::{Path, State};
use axum::http::HeaderMap;
use axum::response::Response;
use futures::stream::BoxStream;
use serde_json::{Value, json};
use shardplane_dataplane as dp;

use super::fields::{
    flag, float, json_object, json_schema, known_only, max_tokens, message_fields, messages, model,
    only_value, stops, tools, uint,
};
use super::rendering::Rendering;
use super::{
    Collected, Dialect, Request, SSE_WAITING, chunked, error_type, id, listing, now_secs, sse,
};
use crate::App;
use crate::protocol::{ApiError, Event, Events, Finish, Input, Kind, Prompt};
use crate::routing::Served;

/// The OpenAI API, chat or legacy text completions.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum OpenAi {
    /// `/v1/chat/completions`.
    Chat,
    /// `/v1/completions`.
    Text,
}

impl OpenAi {
    fn id_prefix(self) -> &'static str {
        match self {
            OpenAi::Chat => "chatcmpl-",
            OpenAi::Text => "cmpl-",
        }
    }

    /// The `object` of a streamed chunk.
    fn chunk_object(self) -> &'static str {
        match self {
            OpenAi::Chat => "chat.completion.chunk",
            OpenAi::Text => "text_completion",
        }
    }
}

/// The fields both OpenAI APIs share that this gateway implements (or that
/// change nothing here: `user` identifies the caller to the provider), and
/// vLLM's and llama.cpp's `ignore_eos` (generate `max_tokens` whatever the
/// model would end with: for benchmarks).
const COMMON_FIELDS: &[&str] = &[
    "ignore_eos",
    "model",
    "temperature",
    "top_p",
    "seed",
    "max_tokens",
    "stop",
    "frequency_penalty",
    "presence_penalty",
    "n",
    "stream",
    "stream_options",
    "user",
];

/// Chat's own; `store` and `modalities` pass only with values that ask for
/// nothing more than text ([`check_fields`]); `reasoning_effort` and
/// (vLLM's and llama.cpp's) `chat_template_kwargs` go to the template
/// ([`Rendering`]).
const CHAT_FIELDS: &[&str] = &[
    "messages",
    "max_completion_tokens",
    "response_format",
    "tools",
    "tool_choice",
    "parallel_tool_calls",
    "logprobs",
    "top_logprobs",
    "store",
    "modalities",
    "reasoning_effort",
    "chat_template_kwargs",
];

/// The legacy completions API's own, likewise.
const TEXT_FIELDS: &[&str] = &["prompt", "echo", "best_of", "logprobs", "suffix"];

/// Refuses what this gateway does not implement: unknown fields, and known
/// ones whose value asks for more than plain text.
fn check_fields(api: OpenAi, v: &Value) -> Result<(), ApiError> {
    known_only(&v["stream_options"], "stream_options.", &["include_usage"])?;
    match api {
        OpenAi::Chat => {
            known_only(v, "", &[COMMON_FIELDS, CHAT_FIELDS].concat())?;
            message_fields(
                v,
                "messages",
                &["role", "content", "name", "tool_calls", "tool_call_id"],
            )?;
            known_only(
                &v["response_format"],
                "response_format.",
                &["type", "json_schema"],
            )?;
            known_only(
                &v["response_format"]["json_schema"],
                "response_format.json_schema.",
                &["name", "description", "schema", "strict"],
            )?;
            only_value(v, "store", |s| s == false, "false")?;
            only_value(
                v,
                "modalities",
                |m| m == &serde_json::json!(["text"]),
                r#"["text"]"#,
            )
        }
        OpenAi::Text => {
            known_only(v, "", &[COMMON_FIELDS, TEXT_FIELDS].concat())?;
            only_value(v, "echo", |e| e == false, "false")?;
            only_value(v, "best_of", |b| b == 1, "1")?;
            only_value(v, "suffix", |s| *s == "", "none")
        }
    }
}

/// The output grammar of a chat request's `response_format`: `text` (or
/// none), `json_object`, or `json_schema` with its `schema`. The output is
/// always held to the schema (as with `strict: true`).
pub(super) fn response_format(f: &Value) -> Result<Option<dp::OutputGrammar>, ApiError> {
    if f.is_null() {
        return Ok(None);
    }
    match f["type"].as_str() {
        Some("text") => Ok(None),
        Some("json_object") => Ok(Some(json_object())),
        Some("json_schema") => {
            let spec = &f["json_schema"];
            if !spec.is_object() {
                return Err(ApiError::invalid(
                    "`response_format.json_schema` is required with type json_schema",
                ));
            }
            if !spec["name"].is_string() {
                return Err(ApiError::invalid(
                    "`response_format.json_schema.name` is required",
                ));
            }
            let schema = match &spec["schema"] {
                // No schema: any JSON object (as OpenAI reads it).
                Value::Null => json!({"type": "object"}),
                s => s.clone(),
            };
            json_schema(&schema, "response_format.json_schema.schema").map(Some)
        }
        _ => Err(ApiError::invalid(format!(
            "`response_format.type` {} is not supported (supported: text, json_object, json_schema)",
            f["type"]
        ))),
    }
}

/// How many alternatives each token's log-probabilities list, when asked
/// for: chat's `logprobs: true` with `top_logprobs` (0 to 20), the legacy
/// API's `logprobs` (0 to 5).
fn logprobs(api: OpenAi, v: &Value) -> Result<Option<u32>, ApiError> {
    match api {
        OpenAi::Chat => logprobs_and_top(v),
        OpenAi::Text => match uint(v, "logprobs")? {
            None => Ok(None),
            Some(n @ 0..=5) => Ok(Some(n as u32)),
            Some(n) => Err(ApiError::invalid(format!(
                "`logprobs` {n} must be between 0 and 5"
            ))),
        },
    }
}

/// `logprobs: true` with `top_logprobs` (0 to 20), as OpenAI chat and
/// Ollama take them.
pub(super) fn logprobs_and_top(v: &Value) -> Result<Option<u32>, ApiError> {
    let top = uint(v, "top_logprobs")?;
    match &v["logprobs"] {
        Value::Bool(true) => match top.unwrap_or(0) {
            n @ 0..=20 => Ok(Some(n as u32)),
            n => Err(ApiError::invalid(format!(
                "`top_logprobs` {n} must be between 0 and 20"
            ))),
        },
        Value::Null | Value::Bool(false) if top.unwrap_or(0) > 0 => Err(ApiError::invalid(
            "`top_logprobs` needs `logprobs` set to true",
        )),
        Value::Null | Value::Bool(false) => Ok(None),
        _ => Err(ApiError::invalid("`logprobs` must be true or false")),
    }
}

/// Tokens' log-probabilities as chat gives them (`choice.logprobs`).
fn chat_logprobs(l: &[dp::TokenLogprobs]) -> Value {
    json!({"content": token_logprobs(l), "refusal": null})
}

/// Each token's `{token, logprob, bytes, top_logprobs}`, as OpenAI chat
/// (and Ollama) list them.
pub(super) fn token_logprobs(l: &[dp::TokenLogprobs]) -> Vec<Value> {
    let entry = |t: &dp::TokenLogprob| json!({"token": t.token, "logprob": t.logprob, "bytes": t.token.as_bytes()});
    l.iter()
        .map(|t| {
            let mut e = entry(&t.chosen.clone().unwrap_or_default());
            e["top_logprobs"] = t.top.iter().map(entry).collect();
            e
        })
        .collect()
}

/// Tokens' log-probabilities as the legacy API gives them, the first token
/// at `offset` in the answer's text (which then moves past them).
fn text_logprobs(l: &[dp::TokenLogprobs], offset: &mut usize) -> Value {
    let (mut tokens, mut logprobs, mut tops, mut offsets) = (vec![], vec![], vec![], vec![]);
    for t in l {
        let chosen = t.chosen.clone().unwrap_or_default();
        offsets.push(*offset);
        *offset += chosen.token.len();
        tokens.push(chosen.token);
        logprobs.push(chosen.logprob);
        let top: serde_json::Map<String, Value> = t
            .top
            .iter()
            .map(|a| (a.token.clone(), json!(a.logprob)))
            .collect();
        tops.push(top);
    }
    json!({"tokens": tokens, "token_logprobs": logprobs, "top_logprobs": tops, "text_offset": offsets})
}

/// A call as OpenAI gives it in a message (`index` in a stream's delta).
fn tool_call(c: &dp::ToolCall, index: Option<usize>) -> Value {
    let mut v = json!({"id": c.id, "type": "function",
                       "function": {"name": c.name, "arguments": c.arguments}});
    if let Some(i) = index {
        v["index"] = json!(i);
    }
    v
}

fn finish_reason(f: Finish) -> &'static str {
    match f {
        Finish::Stop => "stop",
        Finish::Length => "length",
        Finish::ToolCalls => "tool_calls",
    }
}

impl Dialect for OpenAi {
    const LABEL: &'static str = "openai";

    fn parse(&self, v: &Value) -> Result<Request, ApiError> {
        let model = model(v)?;
        check_fields(*self, v)?;
        if uint(v, "n")?.is_some_and(|n| n != 1) {
            return Err(ApiError::invalid("only `n` = 1 is supported"));
        }
        let input = match self {
            OpenAi::Chat => {
                let mut rendering = Rendering::default();
                rendering.effort("reasoning_effort", &v["reasoning_effort"])?;
                rendering.template_vars("chat_template_kwargs", &v["chat_template_kwargs"])?;
                Input::Chat(rendering.conversation(messages(v, "messages")?))
            }
            OpenAi::Text => Input::Text(match &v["prompt"] {
                Value::String(s) => s.clone(),
                Value::Array(a) if a.len() == 1 && a[0].is_string() => {
                    a[0].as_str().unwrap_or_default().to_string()
                }
                Value::Null => return Err(ApiError::invalid("`prompt` is required")),
                _ => return Err(ApiError::invalid("`prompt` must be one string")),
            }),
        };
        let (grammar, tools) = match self {
            OpenAi::Chat => (response_format(&v["response_format"])?, tools(v)?),
            OpenAi::Text => (None, None),
        };
        if grammar.is_some() && tools.is_some() {
            return Err(ApiError::invalid(
                "`response_format` cannot go with `tools` here: give one or the other",
            ));
        }
        let ignore_eos = flag(v, "ignore_eos")?;
        if ignore_eos && (grammar.is_some() || tools.is_some()) {
            return Err(ApiError::invalid(
                "`ignore_eos` cannot go with `response_format` or `tools`: held to a grammar, an answer must be able to end",
            ));
        }
        let limit = uint(v, "max_completion_tokens")?.or(uint(v, "max_tokens")?);
        // The legacy completions API stops at 16 tokens unless told otherwise.
        let limit = match self {
            OpenAi::Text => Some(limit.unwrap_or(16)),
            OpenAi::Chat => limit,
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
                    logprobs: logprobs(*self, v)?,
                    ignore_eos,
                    ..Default::default()
                },
                grammar,
                tools,
            },
            stream: v["stream"].as_bool().unwrap_or(false),
            include_usage: v["stream_options"]["include_usage"]
                .as_bool()
                .unwrap_or(false),
            context: Value::Null,
        })
    }

    fn error_body(&self, e: &ApiError) -> Value {
        json!({"error": {
            "message": e.message,
            "type": error_type(e.kind),
            "param": null,
            "code": match e.kind {
                Kind::NotFound => json!("model_not_found"),
                Kind::Authentication => json!("invalid_api_key"),
                _ => Value::Null,
            },
        }})
    }

    fn answer(&self, req: &Request, c: &Collected) -> Value {
        let model = req.model.as_str();
        let asked = req.prompt.sampling.logprobs.is_some();
        let usage = usage(c.prompt_tokens, c.completion_tokens, c.cached_tokens);
        let (object, choice) = match self {
            OpenAi::Chat => ("chat.completion", {
                let mut message = json!({"role": "assistant", "content": c.text});
                if !c.reasoning.is_empty() {
                    // As DeepSeek's and vLLM's APIs give it.
                    message["reasoning_content"] = json!(c.reasoning);
                }
                if !c.tool_calls.is_empty() {
                    if c.text.is_empty() {
                        message["content"] = Value::Null;
                    }
                    message["tool_calls"] =
                        c.tool_calls.iter().map(|t| tool_call(t, None)).collect();
                }
                json!({
                    "index": 0,
                    "message": message,
                    "logprobs": if asked { chat_logprobs(&c.logprobs) } else { Value::Null },
                    "finish_reason": finish_reason(c.finish),
                })
            }),
            OpenAi::Text => (
                "text_completion",
                json!({
                    "index": 0,
                    "text": c.text,
                    "logprobs": if asked { text_logprobs(&c.logprobs, &mut 0) } else { Value::Null },
                    "finish_reason": finish_reason(c.finish),
                }),
            ),
        };
        json!({
            "id": id(self.id_prefix()),
            "object": object,
            "created": now_secs(),
            "model": model,
            "choices": [choice],
            "usage": usage,
        })
    }

    fn stream(
        &self,
        req: &Request,
        _prompt_tokens: u32,
        events: Events,
    ) -> BoxStream<'static, String> {
        let (api, model, include_usage) = (*self, req.model.clone(), req.include_usage);
        let cid = id(api.id_prefix());
        let created = now_secs();
        let chunk = {
            let (cid, model) = (cid.clone(), model.clone());
            move |delta: Value, logprobs: Value, finish: Option<&str>| -> String {
                let choice = match api {
                    OpenAi::Chat => {
                        json!({"index": 0, "delta": delta, "logprobs": logprobs, "finish_reason": finish})
                    }
                    OpenAi::Text => {
                        json!({"index": 0, "text": delta["content"].as_str().unwrap_or(""), "logprobs": logprobs, "finish_reason": finish})
                    }
                };
                sse(
                    None,
                    &json!({
                        "id": cid,
                        "object": api.chunk_object(),
                        "created": created,
                        "model": model,
                        "choices": [choice],
                    }),
                )
            }
        };
        let opening = match api {
            OpenAi::Chat => vec![chunk(
                json!({"role": "assistant", "content": ""}),
                Value::Null,
                None,
            )],
            OpenAi::Text => Vec::new(),
        };
        let mut calls = 0;
        // Log-probabilities go with the next chunk (a token's text may be
        // held back for a while).
        let (asked, mut pending, mut offset) = (req.prompt.sampling.logprobs.is_some(), vec![], 0);
        let mut logprobs = move |more: Option<Vec<dp::TokenLogprobs>>| -> Value {
            if let Some(more) = more {
                pending.extend(more);
                return Value::Null;
            }
            if !asked || pending.is_empty() {
                return Value::Null;
            }
            let l: Vec<dp::TokenLogprobs> = std::mem::take(&mut pending);
            match api {
                OpenAi::Chat => chat_logprobs(&l),
                OpenAi::Text => text_logprobs(&l, &mut offset),
            }
        };
        chunked(opening, events, move |e| match e {
            Ok(Event::Logprobs(l)) => {
                logprobs(Some(l));
                Vec::new()
            }
            Ok(Event::Waiting) => vec![SSE_WAITING.to_string()],
            Ok(Event::Text(t)) => vec![chunk(json!({"content": t}), logprobs(None), None)],
            // (only a chat has reasoning)
            Ok(Event::Reasoning(r)) => {
                vec![chunk(json!({"reasoning_content": r}), logprobs(None), None)]
            }
            Ok(Event::ToolCall(c)) => {
                calls += 1;
                vec![chunk(
                    json!({"tool_calls": [tool_call(&c, Some(calls - 1))]}),
                    logprobs(None),
                    None,
                )]
            }
            Ok(Event::Done {
                finish,
                prompt_tokens,
                completion_tokens,
                cached_tokens,
            }) => {
                let mut out = vec![chunk(
                    json!({}),
                    logprobs(None),
                    Some(finish_reason(finish)),
                )];
                if include_usage {
                    out.push(sse(
                        None,
                        &json!({
                            "id": cid, "object": api.chunk_object(),
                            "created": created, "model": model, "choices": [],
                            "usage": usage(prompt_tokens, completion_tokens, cached_tokens),
                        }),
                    ));
                }
                out.push("data: [DONE]\n\n".to_string());
                out
            }
            Err(e) => vec![sse(
                None,
                &json!({"error": {"message": e.message, "type": "api_error"}}),
            )],
        })
    }
}

/// A served name as OpenAI describes a model.
fn model_object(s: &Served) -> Value {
    let created = s.created().map_or(0, |t| t.as_second());
    json!({"id": s.name, "object": "model", "created": created, "owned_by": "shardplane"})
}

/// `GET /v1/models`.
pub async fn models(State(app): State<App>, headers: HeaderMap) -> Response {
    listing(&app, &headers, OpenAi::Chat, |served| {
        let data: Vec<Value> = served.iter().map(model_object).collect();
        Ok(json!({"object": "list", "data": data}))
    })
}

/// `GET /v1/models/{id}` (a served name may hold `/`).
pub async fn model_info(
    State(app): State<App>,
    Path(id): Path<String>,
    headers: HeaderMap,
) -> Response {
    listing(&app, &headers, OpenAi::Chat, |served| {
        served
            .iter()
            .find(|s| s.name == id)
            .map(model_object)
            .ok_or_else(|| ApiError::unknown_model(&id))
    })
}

/// Token counts as OpenAI gives them: the prompt's cached share under
/// `prompt_tokens_details` (tokens the instance's prefix cache held).
fn usage(prompt: u32, completion: u32, cached: u32) -> Value {
    json!({
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
        "prompt_tokens_details": {"cached_tokens": cached},
    })
}
