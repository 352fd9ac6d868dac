//! Conversions between the data plane's messages and the engine's types.

use shardplane_dataplane as dp;
use shardplane_engine::constraint::Grammar;
use shardplane_engine::sampler::SamplingParams;
use tonic::Status;

/// The gRPC status of an engine error: the caller's fault or ours.
pub(super) fn engine_status(e: shardplane_engine::Error) -> Status {
    match e {
        shardplane_engine::Error::InvalidInput(m) | shardplane_engine::Error::Sampling(m) => {
            Status::invalid_argument(m)
        }
        e @ shardplane_engine::Error::ContextOverflow { .. } => {
            Status::invalid_argument(e.to_string())
        }
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

/// A `Generate` answer carrying `e`.
pub(super) fn event(e: dp::generate_response::Event) -> Result<dp::GenerateResponse, Status> {
    Ok(dp::GenerateResponse { event: Some(e) })
}
