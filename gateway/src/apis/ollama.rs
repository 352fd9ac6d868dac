//! Ollama: `/api/chat`, `/api/generate` and `/api/tags`. Sampling lives in
//! `options`; streams (the default) are newline-delimited JSON lines, the
//! last one `done` with the token counts.

use axum::body::Body;
use axum::extract::State;
use axum::http::HeaderMap;
use axum::response::Response;
use futures::stream::BoxStream;
use serde_json::{Value, json};
use shardplane_dataplane as dp;

use super::fields::{
    chat_message, float, json_object, json_schema, known_only, max_tokens, message_fields,
    messages, model, object, stops, tools, uint,
};
use super::openai::{logprobs_and_top, token_logprobs};
use super::rendering::Rendering;
use super::{Collected, Dialect, Request, chunked, error_response, json_body, listing, read_body};
use crate::App;
use crate::protocol::{ApiError, Event, Events, Finish, Input, Prompt};
use crate::routing::Served;

/// The Ollama API, chat or generate.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Ollama {
    /// `/api/chat`.
    Chat,
    /// `/api/generate`.
    Generate,
}

/// The `options` this gateway implements, and the ones about how a model is
/// run (context, threads, GPU layers, memory mapping), which the cluster
/// decides and which change nothing in an answer.
const OPTIONS: &[&str] = &[
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "repeat_penalty",
    "presence_penalty",
    "frequency_penalty",
    "seed",
    "num_predict",
    "stop",
    "num_ctx",
    "num_batch",
    "num_gpu",
    "main_gpu",
    "num_thread",
    "use_mmap",
    "use_mlock",
    "numa",
    "low_vram",
];

impl Ollama {
    /// The request fields this gateway implements (`keep_alive` is the
    /// cluster's to decide: models stay loaded while deployed).
    fn fields(self) -> &'static [&'static str] {
        match self {
            Ollama::Chat => &[
                "model",
                "messages",
                "stream",
                "options",
                "keep_alive",
                "think",
                "format",
                "tools",
                "logprobs",
                "top_logprobs",
            ],
            Ollama::Generate => &[
                "model",
                "prompt",
                "system",
                "raw",
                "stream",
                "options",
                "keep_alive",
                "think",
                "format",
                "logprobs",
                "top_logprobs",
            ],
        }
    }

    /// One line of an answer carrying `text`.
    fn line(self, model: &str, text: &str, done: bool) -> Value {
        let mut v = json!({
            "model": model,
            "created_at": chrono::Utc::now().to_rfc3339_opts(chrono::SecondsFormat::Nanos, true),
            "done": done,
        });
        match self {
            Ollama::Chat => v["message"] = json!({"role": "assistant", "content": text}),
            Ollama::Generate => v["response"] = json!(text),
        }
        v
    }

    /// Puts the model's reasoning in a line (`message.thinking` in chat,
    /// `thinking` in generate, as Ollama gives it).
    fn think(self, line: &mut Value, reasoning: &str) {
        match self {
            Ollama::Chat => line["message"]["thinking"] = json!(reasoning),
            Ollama::Generate => line["thinking"] = json!(reasoning),
        }
    }

    /// A line carrying the tool calls `calls` (Ollama gives the arguments
    /// as an object).
    fn calls_line(self, model: &str, calls: &[dp::ToolCall]) -> Value {
        let mut v = self.line(model, "", false);
        v["message"]["tool_calls"] = calls
            .iter()
            .map(|c| {
                let arguments: Value =
                    serde_json::from_str(&c.arguments).unwrap_or_else(|_| json!({}));
                json!({"function": {"name": c.name, "arguments": arguments}})
            })
            .collect();
        v
    }

    /// The last line of an answer.
    fn last_line(
        self,
        model: &str,
        text: &str,
        finish: Finish,
        prompt: u32,
        completion: u32,
    ) -> Value {
        let mut v = self.line(model, text, true);
        v["done_reason"] = json!(match finish {
            Finish::Stop | Finish::ToolCalls => "stop",
            Finish::Length => "length",
        });
        v["prompt_eval_count"] = json!(prompt);
        v["eval_count"] = json!(completion);
        v
    }
}

impl Dialect for Ollama {
    const LABEL: &'static str = "ollama";
    const STREAM_CONTENT_TYPE: &'static str = "application/x-ndjson";

    fn parse(&self, v: &Value) -> Result<Request, ApiError> {
        let model = model(v)?;
        known_only(v, "", self.fields())?;
        message_fields(
            v,
            "messages",
            &["role", "content", "tool_calls", "tool_name"],
        )?;
        // `think`: true or false, or a level (gpt-oss's `low`, `medium`,
        // `high`).
        let mut rendering = Rendering::default();
        match &v["think"] {
            Value::Null => {}
            Value::Bool(on) => rendering.thinking(*on),
            level => rendering.effort("think", level)?,
        }
        let o = &v["options"];
        if !(o.is_null() || o.is_object()) {
            return Err(ApiError::invalid("`options` must be an object"));
        }
        known_only(o, "options.", OPTIONS)?;
        let input = match self {
            Ollama::Chat => Input::Chat(rendering.conversation(messages(v, "messages")?)),
            Ollama::Generate => {
                let prompt = v["prompt"]
                    .as_str()
                    .ok_or_else(|| ApiError::invalid("`prompt` is required"))?
                    .to_string();
                if v["raw"].as_bool().unwrap_or(false) {
                    if !v["think"].is_null() {
                        return Err(ApiError::invalid(
                            "`think` goes with a templated prompt, not with `raw`",
                        ));
                    }
                    Input::Text(prompt)
                } else {
                    let mut chat = Vec::new();
                    if let Some(s) = v["system"].as_str() {
                        chat.push(chat_message("system", s));
                    }
                    chat.push(chat_message("user", prompt));
                    Input::Chat(rendering.conversation(chat))
                }
            }
        };
        // `format`: "json" for any JSON value Ollama's way (an object here,
        // as models are asked for), or a JSON Schema.
        let grammar = match &v["format"] {
            Value::Null => None,
            Value::String(s) if s.is_empty() => None,
            Value::String(s) if s == "json" => Some(json_object()),
            Value::String(s) => {
                return Err(ApiError::invalid(format!(
                    "`format` {s:?} is not supported (supported: \"json\" or a JSON Schema)"
                )));
            }
            schema => Some(json_schema(schema, "format")?),
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
                    logprobs: logprobs_and_top(v)?,
                    ..Default::default()
                },
                grammar,
                tools: match self {
                    Ollama::Chat => tools(v)?,
                    Ollama::Generate => None,
                },
            },
            stream: v["stream"].as_bool().unwrap_or(true),
            include_usage: true,
            context: Value::Null,
        })
    }

    fn error_body(&self, e: &ApiError) -> Value {
        json!({"error": e.message})
    }

    fn answer(&self, req: &Request, c: &Collected) -> Value {
        let model = req.model.as_str();
        let mut v = self.last_line(
            model,
            &c.text,
            c.finish,
            c.prompt_tokens,
            c.completion_tokens,
        );
        if !c.tool_calls.is_empty() {
            v["message"]["tool_calls"] =
                self.calls_line(model, &c.tool_calls)["message"]["tool_calls"].take();
        }
        if !c.reasoning.is_empty() {
            self.think(&mut v, &c.reasoning);
        }
        if req.prompt.sampling.logprobs.is_some() {
            v["logprobs"] = token_logprobs(&c.logprobs).into();
        }
        v
    }

    fn stream(
        &self,
        req: &Request,
        _prompt_tokens: u32,
        events: Events,
    ) -> BoxStream<'static, String> {
        let (api, model) = (*self, req.model.clone());
        // Tokens' log-probabilities go with the next line (the one their
        // text, reasoning or call is in).
        let mut pending: Vec<dp::TokenLogprobs> = Vec::new();
        chunked(Vec::new(), events, move |e| {
            let mut line = match e {
                Ok(Event::Logprobs(l)) => {
                    pending.extend(l);
                    return Vec::new();
                }
                // An empty line, its log-probabilities left for the next.
                Ok(Event::Waiting) => return vec![json_body(&api.line(&model, "", false)) + "\n"],
                Ok(Event::ToolCall(c)) => api.calls_line(&model, &[c]),
                Ok(Event::Reasoning(r)) => {
                    let mut line = api.line(&model, "", false);
                    api.think(&mut line, &r);
                    line
                }
                Ok(Event::Text(t)) => api.line(&model, &t, false),
                Ok(Event::Done {
                    finish,
                    prompt_tokens,
                    completion_tokens,
                    ..
                }) => api.last_line(&model, "", finish, prompt_tokens, completion_tokens),
                Err(e) => json!({"error": e.message}),
            };
            if !pending.is_empty() {
                line["logprobs"] = token_logprobs(&std::mem::take(&mut pending)).into();
            }
            vec![json_body(&line) + "\n"]
        })
    }
}

/// `GET /api/tags`.
pub async fn tags(State(app): State<App>, headers: HeaderMap) -> Response {
    listing(&app, &headers, Ollama::Chat, |served| {
        let models: Vec<Value> = served.iter().map(tag).collect();
        Ok(json!({"models": models}))
    })
}

/// The served name `name` asks for: as given, or without Ollama's default
/// tag (`name:latest` is `name`).
fn find<'a>(served: &'a [Served], name: &str) -> Option<&'a Served> {
    let bare = name.strip_suffix(":latest");
    served
        .iter()
        .find(|s| s.name == name)
        .or_else(|| served.iter().find(|s| Some(s.name.as_str()) == bare))
}

/// `POST /api/show`: one served model, as Ollama describes a model (the
/// hyper-parameters its clients read, such as the context length).
pub async fn show(State(app): State<App>, headers: HeaderMap, body: Body) -> Response {
    // A small body (64 KiB at most) read before `listing` checks the key.
    let body = match read_body(&headers, body, crate::SMALL_BODY_BYTES, app.body_timeout).await {
        Ok(b) => b,
        Err(e) => return error_response(&Ollama::Chat, &e),
    };
    listing(&app, &headers, Ollama::Chat, |served| {
        let v = object(&body)?;
        known_only(&v, "", &["model", "name", "verbose"])?;
        let name = v["model"]
            .as_str()
            .or(v["name"].as_str())
            .ok_or_else(|| ApiError::invalid("`model` is required"))?;
        let s = find(served, name).ok_or_else(|| ApiError::unknown_model(name))?;
        let st = s
            .model
            .as_ref()
            .and_then(|m| m.status.clone())
            .unwrap_or_default();
        let arch = st.architecture.clone().unwrap_or_default();
        let mut info = serde_json::Map::new();
        info.insert("general.architecture".into(), json!(arch));
        for (key, value) in [
            ("context_length", st.context_length),
            ("embedding_length", st.hidden_size),
            ("block_count", st.layers),
            ("attention.head_count", st.attention_heads),
            ("attention.head_count_kv", st.kv_heads),
            ("vocab_size", st.vocab_size),
        ] {
            if let Some(v) = value {
                info.insert(format!("{arch}.{key}"), json!(v));
            }
        }
        let listed = tag(s);
        Ok(json!({
            "modelfile": "",
            "parameters": "",
            "template": "",
            "details": listed["details"],
            "model_info": info,
            "capabilities": ["completion"],
            "modified_at": listed["modified_at"],
        }))
    })
}

/// `GET /api/ps`: the served models that have a ready instance now.
pub async fn running(State(app): State<App>, headers: HeaderMap) -> Response {
    listing(&app, &headers, Ollama::Chat, |served| {
        let models: Vec<Value> = served
            .iter()
            .filter(|s| s.ready > 0)
            .map(|s| {
                let mut m = tag(s);
                m["expires_at"] = Value::Null;
                m["size_vram"] = json!(0);
                m
            })
            .collect();
        Ok(json!({"models": models}))
    })
}

/// A served name as Ollama lists a model.
fn tag(s: &Served) -> Value {
    let st = s
        .model
        .as_ref()
        .and_then(|m| m.status.clone())
        .unwrap_or_default();
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
}

#[cfg(test)]
mod tests {
    use super::*;
    use futures::StreamExt;

    fn lp(token: &str, logprob: f32) -> dp::TokenLogprobs {
        let entry = |token: &str, logprob: f32| dp::TokenLogprob {
            token: token.into(),
            logprob,
        };
        dp::TokenLogprobs {
            chosen: Some(entry(token, logprob)),
            top: vec![entry(token, logprob), entry(" x", -3.0)],
        }
    }

    #[test]
    fn log_probabilities_come_with_the_line_of_their_text() {
        let v = json!({"model": "m", "messages": [{"role": "user", "content": "hi"}],
                       "logprobs": true, "top_logprobs": 2});
        let req = Ollama::Chat.parse(&v).unwrap();
        assert_eq!(req.prompt.sampling.logprobs, Some(2));
        let bad = json!({"model": "m", "prompt": "hi", "top_logprobs": 2});
        let e = Ollama::Generate.parse(&bad).unwrap_err();
        assert!(e.message.contains("`logprobs`"), "{}", e.message);

        let events = vec![
            Event::Logprobs(vec![lp(" a", -0.5)]),
            Event::Text(" a".into()),
            Event::Logprobs(vec![lp(" b", -0.25), lp(" c", -0.1)]),
            Event::Text(" b c".into()),
            Event::Done {
                finish: Finish::Stop,
                prompt_tokens: 1,
                completion_tokens: 3,
                cached_tokens: 0,
            },
        ];
        let events: Events = Box::pin(futures::stream::iter(events.into_iter().map(Ok)));
        let lines: Vec<Value> =
            futures::executor::block_on(Ollama::Chat.stream(&req, 1, events).collect::<Vec<_>>())
                .iter()
                .map(|l| serde_json::from_str(l).unwrap())
                .collect();
        let counts: Vec<(&str, usize)> = lines
            .iter()
            .map(|l| {
                (
                    l["message"]["content"].as_str().unwrap(),
                    l["logprobs"].as_array().map_or(0, Vec::len),
                )
            })
            .collect();
        assert_eq!(counts, [(" a", 1), (" b c", 2), ("", 0)]);
        assert_eq!(lines[1]["logprobs"][1]["token"], " c");
        assert_eq!(
            lines[1]["logprobs"][1]["top_logprobs"][1]["logprob"],
            json!(-3.0)
        );

        let whole = Ollama::Chat.answer(
            &req,
            &Collected {
                text: " a b c".into(),
                reasoning: String::new(),
                tool_calls: Vec::new(),
                logprobs: vec![lp(" a", -0.5), lp(" b", -0.25), lp(" c", -0.1)],
                finish: Finish::Stop,
                prompt_tokens: 1,
                completion_tokens: 3,
                cached_tokens: 0,
            },
        );
        assert_eq!(whole["logprobs"].as_array().unwrap().len(), 3);
        assert_eq!(whole["logprobs"][0]["bytes"], json!([32, 97]));
    }
}
