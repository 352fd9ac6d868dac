//! The Responses API's stream: named events, each with its
//! `sequence_number`, for the reasoning, message and call items of one
//! response, ending with the whole response.
//!
//! ```text
//!  response.created, response.in_progress
//!  Reasoning… ─► output_item.added, reasoning_text.delta…, reasoning_text.done, output_item.done
//!  Text…      ─► output_item.added, content_part.added, output_text.delta…, …done ×3
//!  ToolCall   ─► output_item.added, function_call_arguments.delta/.done, output_item.done
//!  Done       ─► response.completed | response.incomplete (and the store keeps it)
//! ```

use futures::stream::BoxStream;
use serde_json::{Value, json};
use shardplane_dataplane as dp;

use super::{Responses, call_item, message_item, reasoning_item, response, status, usage};
use crate::apis::openai::token_logprobs;
use crate::apis::{Request, SSE_WAITING, chunked, id, now_secs, sse};
use crate::protocol::{Event, Events, Finish};

/// The stream of `req`'s answer, from its `events`.
pub(super) fn stream(api: &Responses, req: &Request, events: Events) -> BoxStream<'static, String> {
    let mut s = Streamed {
        api: api.clone(),
        req: Request {
            model: req.model.clone(),
            prompt: req.prompt.clone(),
            stream: true,
            include_usage: true,
            context: req.context.clone(),
        },
        id: id("resp_"),
        created: now_secs(),
        sequence: 0,
        output: Vec::new(),
        open: None,
        thinking: None,
        calls: Vec::new(),
        text: String::new(),
        pending: Vec::new(),
    };
    let opening = vec![
        s.event(
            "response.created",
            json!({"response": s.snapshot("in_progress")}),
        ),
        s.event(
            "response.in_progress",
            json!({"response": s.snapshot("in_progress")}),
        ),
    ];
    chunked(opening, events, move |e| match e {
        Ok(Event::Text(t)) => s.text(&t),
        Ok(Event::Reasoning(r)) => s.reasoning(&r),
        // They go with the next text delta.
        Ok(Event::Logprobs(l)) => {
            s.pending.extend(l);
            Vec::new()
        }
        Ok(Event::Waiting) => vec![SSE_WAITING.to_string()],
        Ok(Event::ToolCall(c)) => s.call(c),
        Ok(Event::Done {
            finish,
            prompt_tokens,
            completion_tokens,
            cached_tokens,
        }) => s.done(finish, (prompt_tokens, completion_tokens, cached_tokens)),
        Err(e) => vec![s.event(
            "error",
            json!({"code": null, "message": e.message, "param": null}),
        )],
    })
}

/// A message (or reasoning) item being streamed: its id, text and text's
/// log-probabilities so far.
struct OpenMessage {
    id: String,
    text: String,
    logprobs: Vec<Value>,
}

/// A response as it streams: the items done, the message under way, and
/// what the store will keep.
struct Streamed {
    api: Responses,
    req: Request,
    id: String,
    created: i64,
    sequence: u64,
    output: Vec<Value>,
    open: Option<OpenMessage>,
    thinking: Option<OpenMessage>,
    calls: Vec<dp::ToolCall>,
    text: String,
    /// Log-probabilities of tokens whose text has not come yet.
    pending: Vec<dp::TokenLogprobs>,
}

impl Streamed {
    fn event(&mut self, kind: &str, mut body: Value) -> String {
        body["type"] = json!(kind);
        body["sequence_number"] = json!(self.sequence);
        self.sequence += 1;
        sse(Some(kind), &body)
    }

    fn snapshot(&self, state: &str) -> Value {
        response(
            &self.req,
            &self.id,
            self.created,
            (state, Value::Null),
            self.output.clone(),
            Value::Null,
        )
    }

    fn reasoning(&mut self, r: &str) -> Vec<String> {
        let mut out = Vec::new();
        let index = self.output.len();
        if self.thinking.is_none() {
            let item = id("rs_");
            out.push(self.event(
                "response.output_item.added",
                json!({"output_index": index, "item": {"type": "reasoning", "id": item,
                       "status": "in_progress", "summary": [], "content": []}}),
            ));
            self.thinking = Some(OpenMessage {
                id: item,
                text: String::new(),
                logprobs: Vec::new(),
            });
        }
        let item = self
            .thinking
            .as_ref()
            .map(|m| m.id.clone())
            .unwrap_or_default();
        out.push(self.event(
            "response.reasoning_text.delta",
            json!({"item_id": item, "output_index": index, "content_index": 0, "delta": r}),
        ));
        if let Some(m) = self.thinking.as_mut() {
            m.text.push_str(r);
        }
        out
    }

    /// Ends the reasoning under way, if any.
    fn close_reasoning(&mut self) -> Vec<String> {
        let Some(m) = self.thinking.take() else {
            return Vec::new();
        };
        let index = self.output.len();
        let item = reasoning_item(&m.id, &m.text, "completed");
        let out = vec![
            self.event(
                "response.reasoning_text.done",
                json!({"item_id": m.id, "output_index": index, "content_index": 0, "text": m.text}),
            ),
            self.event(
                "response.output_item.done",
                json!({"output_index": index, "item": item}),
            ),
        ];
        self.output.push(item);
        out
    }

    fn text(&mut self, t: &str) -> Vec<String> {
        let mut out = self.close_reasoning();
        let index = self.output.len();
        if self.open.is_none() {
            let item = id("msg_");
            out.push(self.event(
                "response.output_item.added",
                json!({"output_index": index, "item": {"type": "message", "id": item,
                       "status": "in_progress", "role": "assistant", "content": []}}),
            ));
            out.push(self.event(
                "response.content_part.added",
                json!({"item_id": item, "output_index": index, "content_index": 0,
                       "part": {"type": "output_text", "text": "", "annotations": [], "logprobs": []}}),
            ));
            self.open = Some(OpenMessage {
                id: item,
                text: String::new(),
                logprobs: Vec::new(),
            });
        }
        let item = self.open.as_ref().map(|m| m.id.clone()).unwrap_or_default();
        let logprobs = token_logprobs(&std::mem::take(&mut self.pending));
        out.push(self.event(
            "response.output_text.delta",
            json!({"item_id": item, "output_index": index, "content_index": 0, "delta": t, "logprobs": logprobs}),
        ));
        if let Some(m) = self.open.as_mut() {
            m.text.push_str(t);
            m.logprobs.extend(logprobs);
        }
        self.text.push_str(t);
        out
    }

    /// Ends the message under way, if any.
    fn close(&mut self) -> Vec<String> {
        let Some(m) = self.open.take() else {
            return Vec::new();
        };
        let index = self.output.len();
        let item = message_item(&m.id, &m.text, "completed", &m.logprobs);
        let out = vec![
            self.event(
                "response.output_text.done",
                json!({"item_id": m.id, "output_index": index, "content_index": 0, "text": m.text, "logprobs": m.logprobs}),
            ),
            self.event(
                "response.content_part.done",
                json!({"item_id": m.id, "output_index": index, "content_index": 0, "part": item["content"][0]}),
            ),
            self.event("response.output_item.done", json!({"output_index": index, "item": item})),
        ];
        self.output.push(item);
        out
    }

    fn call(&mut self, c: dp::ToolCall) -> Vec<String> {
        let mut out = self.close_reasoning();
        out.extend(self.close());
        let index = self.output.len();
        let item = id("fc_");
        out.push(self.event(
            "response.output_item.added",
            json!({"output_index": index, "item": call_item(&item, &c, "", "in_progress")}),
        ));
        out.push(self.event(
            "response.function_call_arguments.delta",
            json!({"item_id": item, "output_index": index, "delta": c.arguments}),
        ));
        out.push(self.event(
            "response.function_call_arguments.done",
            json!({"item_id": item, "output_index": index, "name": c.name, "arguments": c.arguments}),
        ));
        let done = call_item(&item, &c, &c.arguments, "completed");
        out.push(self.event(
            "response.output_item.done",
            json!({"output_index": index, "item": done}),
        ));
        self.output.push(done);
        self.calls.push(c);
        out
    }

    /// The end: `tokens` are the prompt's, the answer's and the prompt's cached ones.
    fn done(&mut self, finish: Finish, tokens: (u32, u32, u32)) -> Vec<String> {
        let (prompt, completion, cached) = tokens;
        // An answer always has a message or a call, if only an empty
        // message.
        let mut out = if self.open.is_none() && self.text.is_empty() && self.calls.is_empty() {
            self.text("")
        } else {
            Vec::new()
        };
        out.extend(self.close());
        let state = status(finish);
        let kind = if state.0 == "completed" {
            "response.completed"
        } else {
            "response.incomplete"
        };
        let whole = response(
            &self.req,
            &self.id,
            self.created,
            state,
            self.output.clone(),
            usage(prompt, completion, cached),
        );
        self.api
            .keep(&self.req, &self.id, &self.text, &self.calls, &whole);
        out.push(self.event(kind, json!({"response": whole})));
        out
    }
}
