//! Conversions between the data plane's messages and the engine's types.

use shardplane_dataplane as dp;
use shardplane_engine::chat::{ChatMessage, ChatOptions};
use shardplane_engine::constraint::Grammar;
use shardplane_engine::sampler::{Logprobs, SamplingParams};
use shardplane_engine::tokenizer::Tokenizer;
use shardplane_engine::tools::{Tool, ToolCall, ToolChoice, ToolSet};
use tonic::Status;

/// The gRPC status of an engine error: the caller's fault or ours.
pub(super) fn engine_status(e: shardplane_engine::Error) -> Status {
    match e {
        shardplane_engine::Error::InvalidInput(m) | shardplane_engine::Error::Sampling(m) => {
            Status::invalid_argument(m)
        }
        // A template that refuses a conversation (roles out of order, say).
        e @ shardplane_engine::Error::ChatTemplate(_) => Status::invalid_argument(e.to_string()),
        e @ shardplane_engine::Error::ContextOverflow { .. } => {
            Status::invalid_argument(e.to_string())
        }
        // The gateway tries another instance.
        e @ shardplane_engine::Error::Unavailable(_) => Status::unavailable(e.to_string()),
        e => Status::internal(e.to_string()),
    }
}

/// The engine's sampling parameters from the wire's (0 means unset; an
/// unset token limit is as many as the context leaves), not yet checked.
pub(super) fn params(s: &dp::Sampling) -> SamplingParams {
    SamplingParams {
        temperature: s.temperature,
        top_k: (s.top_k > 0).then_some(s.top_k as usize),
        top_p: (s.top_p > 0.0).then_some(s.top_p),
        min_p: (s.min_p > 0.0).then_some(s.min_p),
        repetition_penalty: if s.repetition_penalty == 0.0 {
            1.0
        } else {
            s.repetition_penalty
        },
        frequency_penalty: s.frequency_penalty,
        presence_penalty: s.presence_penalty,
        seed: s.seed,
        max_tokens: if s.max_tokens == 0 {
            usize::MAX
        } else {
            s.max_tokens as usize
        },
        stop: s.stop.clone(),
        ignore_eos: s.ignore_eos,
        logprobs: s.logprobs.map(|n| n as usize),
    }
}

/// A sampled token's log-probabilities as the last stage sends them.
pub(super) fn sampled_logprobs(l: Logprobs) -> dp::SampledLogprobs {
    dp::SampledLogprobs {
        logprob: l.logprob,
        top_tokens: l.top.iter().map(|t| t.0).collect(),
        top_logprobs: l.top.iter().map(|t| t.1).collect(),
    }
}

/// The last stage's log-probabilities of `token`.
pub(super) fn logprobs(token: u32, l: dp::SampledLogprobs) -> Logprobs {
    Logprobs {
        token,
        logprob: l.logprob,
        top: l.top_tokens.into_iter().zip(l.top_logprobs).collect(),
    }
}

/// Log-probabilities with each token's text, for the client.
pub(super) fn token_logprobs(tokenizer: &Tokenizer, l: &Logprobs) -> dp::TokenLogprobs {
    let entry = |token: u32, logprob: f32| dp::TokenLogprob {
        token: tokenizer.decode(&[token], false).unwrap_or_default(),
        logprob,
    };
    dp::TokenLogprobs {
        chosen: Some(entry(l.token, l.logprob)),
        top: l.top.iter().map(|&(t, lp)| entry(t, lp)).collect(),
    }
}

/// The engine's sampling parameters from the wire's, checked, with at most
/// `room` tokens to generate.
pub(super) fn sampling_params(s: &dp::Sampling, room: usize) -> Result<SamplingParams, Status> {
    let mut params = params(s);
    params.max_tokens = params.max_tokens.min(room);
    params.validate().map_err(engine_status)?;
    Ok(params)
}

/// The engine's output grammar from the wire's (none when unset).
pub(super) fn grammar(g: Option<&dp::OutputGrammar>) -> Result<Option<Grammar>, Status> {
    use dp::output_grammar::Kind;
    Ok(match g.and_then(|g| g.kind.as_ref()) {
        None | Some(Kind::JsonObject(false)) => None,
        Some(Kind::JsonObject(true)) => Some(Grammar::JsonObject),
        Some(Kind::JsonSchema(text)) => {
            Some(Grammar::JsonSchema(serde_json::from_str(text).map_err(
                |e| Status::invalid_argument(format!("the output JSON Schema is not JSON: {e}")),
            )?))
        }
        Some(Kind::Regex(rx)) => Some(Grammar::Regex(rx.clone())),
        Some(Kind::Lark(lark)) => Some(Grammar::Lark(lark.clone())),
    })
}

/// The engine's tool set from the wire's, checked (none when it holds no
/// tools).
pub(super) fn tools(t: Option<&dp::ToolSet>) -> Result<Option<ToolSet>, Status> {
    let Some(t) = t.filter(|t| !t.tools.is_empty()) else {
        return Ok(None);
    };
    let tools = t
        .tools
        .iter()
        .map(|x| {
            let parameters = if x.parameters.is_empty() {
                serde_json::json!({"type": "object"})
            } else {
                serde_json::from_str(&x.parameters).map_err(|e| {
                    Status::invalid_argument(format!(
                        "the parameters of tool {:?} are not JSON: {e}",
                        x.name
                    ))
                })?
            };
            Ok(Tool {
                name: x.name.clone(),
                description: x.description.clone(),
                parameters,
            })
        })
        .collect::<Result<Vec<_>, Status>>()?;
    let choice = match dp::ToolChoice::try_from(t.choice) {
        Ok(dp::ToolChoice::Auto) => ToolChoice::Auto,
        Ok(dp::ToolChoice::Required) => ToolChoice::Required,
        Ok(dp::ToolChoice::Function) => ToolChoice::Function(t.function.clone()),
        Err(_) => {
            return Err(Status::invalid_argument(format!(
                "tool choice {} is unknown",
                t.choice
            )));
        }
    };
    let set = ToolSet {
        tools,
        choice,
        parallel: t.parallel,
    };
    set.validate().map_err(engine_status)?;
    Ok(Some(set))
}

/// The engine's chat message from the wire's.
pub(super) fn chat_message(m: &dp::ChatMessage) -> ChatMessage {
    ChatMessage {
        tool_calls: m
            .tool_calls
            .iter()
            .map(|c| ToolCall {
                id: c.id.clone(),
                name: c.name.clone(),
                arguments: c.arguments.clone(),
            })
            .collect(),
        tool_call_id: (!m.tool_call_id.is_empty()).then(|| m.tool_call_id.clone()),
        ..ChatMessage::new(m.role.clone(), m.content.clone())
    }
}

/// How a conversation is rendered: its template variables and thinking
/// switch, checked.
pub(super) fn chat_options(c: &dp::Conversation) -> Result<ChatOptions, Status> {
    let vars = if c.template_vars.is_empty() {
        serde_json::Map::new()
    } else {
        match serde_json::from_str(&c.template_vars) {
            Ok(serde_json::Value::Object(m)) => m,
            _ => {
                return Err(Status::invalid_argument(
                    "template_vars must be a JSON object",
                ));
            }
        }
    };
    ChatOptions::new(vars, c.thinking).map_err(engine_status)
}

/// The wire's tool call from the engine's.
pub(super) fn tool_call(c: ToolCall) -> dp::ToolCall {
    dp::ToolCall {
        id: c.id,
        name: c.name,
        arguments: c.arguments,
    }
}

/// A `Generate` answer carrying `e`.
pub(super) fn event(e: dp::generate_response::Event) -> Result<dp::GenerateResponse, Status> {
    Ok(dp::GenerateResponse { event: Some(e) })
}
