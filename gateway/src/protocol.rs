//! The gateway's API-neutral vocabulary: every dialect parses its requests
//! into a [`Prompt`], the router answers with [`Events`], and errors travel
//! as [`ApiError`] until a dialect renders them in its own shape.
//!
//! ```text
//!  OpenAI / Anthropic / Ollama body ─► Prompt ─► router ─► Events (Text…, Done) ─► dialect's JSON, SSE or NDJSON
//!                                  └─► ApiError (kind, status, message) ─────────► dialect's error body
//! ```

use std::pin::Pin;

use axum::http::StatusCode;
use futures::Stream;
use shardplane_dataplane as dp;

/// What a client asks for, whatever API it spoke.
#[derive(Debug, Clone)]
pub struct Prompt {
    /// A conversation, or raw text.
    pub input: Input,
    /// Sampling and limits.
    pub sampling: dp::Sampling,
    /// What the output must follow (JSON, a JSON Schema), if anything.
    pub grammar: Option<dp::OutputGrammar>,
    /// Tools the model may call (chat only).
    pub tools: Option<dp::ToolSet>,
}

/// The input of a request.
#[derive(Debug, Clone)]
pub enum Input {
    /// Messages (with earlier tool calls and results), rendered with the
    /// model's chat template (with the conversation's thinking setting and
    /// template variables).
    Chat(dp::Conversation),
    /// Text used as is.
    Text(String),
}

/// Why a generation ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Finish {
    /// End of sequence or a stop string.
    Stop,
    /// The token limit.
    Length,
    /// The answer called tools.
    ToolCalls,
}

/// What a generation produces, in order: reasoning, text pieces (each after
/// its tokens' log-probabilities, when asked for) and calls, then one `Done`.
#[derive(Debug, Clone)]
pub enum Event {
    /// A piece of text (possibly empty: a token whose text is held back).
    Text(String),
    /// A piece of the model's reasoning (before its text).
    Reasoning(String),
    /// A tool call, whole.
    ToolCall(dp::ToolCall),
    /// The log-probabilities of the tokens whose text comes next (when the
    /// request asked for them).
    Logprobs(Vec<dp::TokenLogprobs>),
    /// Nothing yet: the answer has been silent for a while (10 s by
    /// default) — it waits for its deployment to heal, another instance
    /// takes it over, a stage or an external endpoint is slow — so that
    /// proxies and clients with idle timeouts keep the connection. Streams
    /// send their dialect's keep-alive (an SSE comment, Anthropic's `ping`,
    /// an empty Ollama line); whole answers ignore it.
    Waiting,
    /// The end.
    Done {
        /// Why it ended.
        finish: Finish,
        /// Tokens of the prompt.
        prompt_tokens: u32,
        /// Tokens generated.
        completion_tokens: u32,
        /// Prompt tokens the instance took from its prefix cache.
        cached_tokens: u32,
    },
}

/// The kinds of error every API renders in its own shape.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kind {
    /// Malformed or impossible request (400).
    InvalidRequest,
    /// Missing or wrong API key (401).
    Authentication,
    /// Unknown model (404).
    NotFound,
    /// Too many requests for the key (429).
    RateLimited,
    /// Nothing can serve now (503).
    Unavailable,
    /// Something broke upstream (500/502).
    Internal,
    /// The body is larger than the route allows (413).
    TooLarge,
    /// The body did not arrive in time (408).
    Timeout,
}

/// An error for the client.
#[derive(Debug, Clone)]
pub struct ApiError {
    /// HTTP status.
    pub status: StatusCode,
    /// What kind of error.
    pub kind: Kind,
    /// For a person.
    pub message: String,
    /// Seconds to wait before retrying (503, 429).
    pub retry_after: Option<u64>,
}

impl ApiError {
    /// A 400.
    pub fn invalid(message: impl Into<String>) -> Self {
        ApiError {
            status: StatusCode::BAD_REQUEST,
            kind: Kind::InvalidRequest,
            message: message.into(),
            retry_after: None,
        }
    }

    /// A 413: the body is over `limit` bytes.
    pub fn too_large(limit: usize) -> Self {
        ApiError {
            status: StatusCode::PAYLOAD_TOO_LARGE,
            kind: Kind::TooLarge,
            message: format!("the request body is larger than this route allows ({limit} bytes)"),
            retry_after: None,
        }
    }

    /// A 408: the body did not arrive within `seconds`.
    pub fn body_timeout(seconds: u64) -> Self {
        ApiError {
            status: StatusCode::REQUEST_TIMEOUT,
            kind: Kind::Timeout,
            message: format!("the request body did not arrive within {seconds} s"),
            retry_after: None,
        }
    }

    /// A 404 for a model.
    pub fn unknown_model(name: &str) -> Self {
        Self::not_found(format!(
            "model {name:?} is not served here (see /v1/models)"
        ))
    }

    /// A 404: what was asked for is not here.
    pub fn not_found(message: impl Into<String>) -> Self {
        ApiError {
            status: StatusCode::NOT_FOUND,
            kind: Kind::NotFound,
            message: message.into(),
            retry_after: None,
        }
    }

    /// A 503.
    pub fn unavailable(message: impl Into<String>) -> Self {
        ApiError {
            status: StatusCode::SERVICE_UNAVAILABLE,
            kind: Kind::Unavailable,
            message: message.into(),
            retry_after: Some(5),
        }
    }

    /// A 429: every instance that could answer is too busy now.
    pub fn overloaded(message: impl Into<String>) -> Self {
        ApiError {
            status: StatusCode::TOO_MANY_REQUESTS,
            kind: Kind::RateLimited,
            message: message.into(),
            retry_after: Some(2),
        }
    }

    /// A 502 for an upstream that broke mid-answer.
    pub fn upstream(message: impl Into<String>) -> Self {
        ApiError {
            status: StatusCode::BAD_GATEWAY,
            kind: Kind::Internal,
            message: message.into(),
            retry_after: None,
        }
    }
}

/// A stream of events.
pub type Events = Pin<Box<dyn Stream<Item = Result<Event, ApiError>> + Send>>;

/// Whether `event` is an answer's last: its end, or an error.
pub fn ends(event: &Result<Event, ApiError>) -> bool {
    matches!(event, Err(_) | Ok(Event::Done { .. }))
}

/// An answer under way: the first token has arrived (or the answer is done).
pub struct Answer {
    /// The name the client asked for.
    pub model: String,
    /// Tokens of the prompt.
    pub prompt_tokens: u32,
    /// The events, from the first.
    pub events: Events,
}
