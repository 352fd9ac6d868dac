//! Run any layer range of a model.
//!
//! Layout:
//! - [`stage`]: the contract of a stage (the [`Stage`] trait) and what flows
//!   between stages;
//! - [`gguf`] and [`config`]: reading model files and their hyper-parameters;
//! - [`candle`]: the candle backend; `mlx` (feature `mlx`): the MLX backend,
//!   through a C++ shim over libmlx;
//! - engine-independent parts every backend shares: [`tokenizer`], [`chat`],
//!   [`text_model`] (a model's tokenizer, template and answer format),
//!   [`harmony`] (gpt-oss's answer format),
//!   [`detokenizer`], [`sampler`], [`constraint`] (output that must follow a
//!   grammar), [`tools`] (tool calling: prompts, call grammars, parsing),
//!   [`text_output`] (tokens to the text a client
//!   sees), [`generation`] (the one generation loop and the request it
//!   trusts, used by the CLI and by head stages), and [`pipeline`], which
//!   drives stages to generate text in one process; [`prefix`]: the cache of
//!   prompts' KV that a backend keeps in blocks; [`tensor`]: tensor parallelism
//!   (how a layer is split across ranks, and a group of ranks as one stage).
//!
//! This crate knows nothing of Kubernetes or the network.

pub mod answer;
pub mod bench;
pub mod candle;
pub mod chat;
pub mod config;
pub mod constraint;
pub mod detokenizer;
pub mod error;
pub mod generation;
pub mod gguf;
pub mod harmony;
#[cfg(feature = "mlx")]
pub mod mlx;
pub mod mxfp4;
pub mod names;
pub mod pipeline;
pub mod prefix;
pub mod reasoning;
mod routing;
pub mod sampler;
pub mod stage;
pub mod stop;
pub mod tensor;
pub mod text_model;
pub mod text_output;
pub mod tokenizer;
pub mod tools;

pub use config::{Architecture, ModelConfig};
pub use error::{Error, Result};
pub use stage::{
    Activations, KvPrecision, LoadOptions, SequenceId, Stage, StageInput, StageLayout, StageOutput,
};
