//! The engine's errors: each says what went wrong and, where a person can act,
//! what to do.

use std::path::PathBuf;

/// Everything that can go wrong loading or running a stage.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// The model file cannot be opened or read.
    #[error("cannot read model file {path}: {source}")]
    Io {
        /// The file.
        path: PathBuf,
        /// The cause.
        source: std::io::Error,
    },
    /// The file (GGUF, or one of a model directory's) is not valid, or is
    /// truncated or corrupt.
    #[error("{path} is not a valid model file (truncated or corrupt?): {reason}")]
    CorruptModel {
        /// The file.
        path: PathBuf,
        /// What is wrong with it.
        reason: String,
    },
    /// The model's architecture is not one this engine runs.
    #[error("architecture {0:?} is not supported: supported are {SUPPORTED}", SUPPORTED = shardplane_formats::error::SUPPORTED)]
    UnsupportedArchitecture(String),
    /// A tensor's type is not one this engine can compute with.
    #[error(
        "tensor {tensor} has type {dtype}, which is not supported: supported are F32, F16, BF16, Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, Q2_K..Q8_K"
    )]
    UnsupportedTensorType {
        /// The tensor's name.
        tensor: String,
        /// The type found.
        dtype: String,
    },
    /// A required metadata key or tensor is missing, or has the wrong shape or type.
    #[error("model {what} is missing or malformed: {detail}")]
    MissingMetadata {
        /// Which key or tensor.
        what: String,
        /// What was expected.
        detail: String,
    },
    /// The requested layer range does not fit the model.
    #[error(
        "layer range {start}-{end} does not fit a model of {layers} layers (need start < end <= {layers})"
    )]
    LayerRange {
        /// First layer asked for.
        start: usize,
        /// One past the last layer asked for.
        end: usize,
        /// Layers of the model.
        layers: usize,
    },
    /// The input does not fit the stage (tokens to a middle stage, wrong width…).
    #[error("invalid input for this stage: {0}")]
    InvalidInput(String),
    /// A sequence would grow past the context the stage was loaded for.
    #[error("sequence of {needed} tokens exceeds the context length of {context} tokens")]
    ContextOverflow {
        /// Tokens the sequence would hold.
        needed: usize,
        /// The context length.
        context: usize,
    },
    /// The tokenizer or chat template could not be built or applied.
    #[error("tokenizer: {0}")]
    Tokenizer(String),
    /// The chat template could not be rendered.
    #[error("chat template: {0}")]
    ChatTemplate(String),
    /// Sampling parameters are out of range.
    #[error("invalid sampling parameters: {0}")]
    Sampling(String),
    /// An output grammar could not be built or followed.
    #[error("output grammar: {0}")]
    Grammar(String),
    /// MLX refused an operation or failed to run it (the C++ exception's message).
    #[error("MLX: {0}")]
    Mlx(String),
    /// The compute backend failed.
    #[error("compute backend: {0}")]
    Backend(#[from] candle_core::Error),
    /// The stage cannot run the sequence now (its thread stopped, or a
    /// failed pass dropped the sequence's state): the fault is the
    /// server's, and another instance may serve the request.
    #[error("the stage is unavailable: {0}")]
    Unavailable(String),
    /// A tensor-parallel split or group that cannot be made.
    #[error("tensor parallelism: {0}")]
    Tensor(String),
}

impl Error {
    /// Whether the error is the caller's (its input), not the stage's.
    pub fn is_callers(&self) -> bool {
        matches!(
            self,
            Error::InvalidInput(_)
                | Error::ContextOverflow { .. }
                | Error::Sampling(_)
                | Error::ChatTemplate(_)
        )
    }
}

impl From<shardplane_formats::Error> for Error {
    fn from(e: shardplane_formats::Error) -> Self {
        use shardplane_formats::Error as F;
        match e {
            F::UnsupportedArchitecture(a) => Error::UnsupportedArchitecture(a),
            F::UnsupportedTensorType { tensor, dtype } => {
                Error::UnsupportedTensorType { tensor, dtype }
            }
            F::MissingMetadata { what, detail } => Error::MissingMetadata { what, detail },
            other => Error::CorruptModel {
                path: PathBuf::from("the model file"),
                reason: other.to_string(),
            },
        }
    }
}

/// The engine's result type.
pub type Result<T, E = Error> = std::result::Result<T, E>;
