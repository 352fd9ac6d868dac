//! What can be wrong with a model file's header.

/// A model file's header could not be read or does not describe a model
/// this project runs.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// Reading failed (the file ended early, or the disk failed).
    #[error("{0}")]
    Io(#[from] std::io::Error),
    /// The bytes are not a valid header.
    #[error("{0}")]
    Corrupt(String),
    /// A count or size in the header is past what any real model needs
    /// (a hostile or corrupt file).
    #[error("{what} is {found}, more than the {limit} this reader accepts")]
    TooLarge {
        /// What was counted.
        what: String,
        /// What the file says.
        found: u64,
        /// The most accepted.
        limit: u64,
    },
    /// The model's architecture is not one the engines run.
    #[error("architecture {0:?} is not supported: supported are {SUPPORTED}")]
    UnsupportedArchitecture(String),
    /// A tensor has a type no engine here computes with.
    #[error("tensor {tensor} has type {dtype}, which is not supported")]
    UnsupportedTensorType {
        /// The tensor's name.
        tensor: String,
        /// The type found.
        dtype: String,
    },
    /// A metadata key or tensor is missing or has the wrong type or value.
    #[error("model {what} is missing or malformed: {detail}")]
    MissingMetadata {
        /// Which key or tensor.
        what: String,
        /// What was expected.
        detail: String,
    },
}

/// The architectures the engines run, as error messages name them.
pub const SUPPORTED: &str = "llama (SmolLM, Llama 2/3, Mistral, and Mixtral with experts), qwen2, qwen2moe, qwen3, qwen3moe, gemma3 (text), gpt-oss (gpt_oss in config.json), and DeepSeek V2 / V3 / Kimi K2 (deepseek2; deepseek_v2, deepseek_v3 or kimi_k2 in config.json)";

impl Error {
    /// A short, bounded label for metrics and condition reasons.
    pub fn metric_label(&self) -> &'static str {
        match self {
            Error::Io(_) => "io",
            Error::Corrupt(_) => "corrupt",
            Error::TooLarge { .. } => "too_large",
            Error::UnsupportedArchitecture(_) => "unsupported_architecture",
            Error::UnsupportedTensorType { .. } => "unsupported_tensor_type",
            Error::MissingMetadata { .. } => "missing_metadata",
        }
    }

    /// A missing or malformed metadata key.
    pub(crate) fn metadata(what: impl Into<String>, detail: impl Into<String>) -> Self {
        Error::MissingMetadata {
            what: what.into(),
            detail: detail.into(),
        }
    }
}

/// The result type of this crate.
pub type Result<T, E = Error> = std::result::Result<T, E>;
