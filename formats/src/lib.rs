//! Model file formats, read without a compute engine: what the operator needs
//! to place a model and what an engine needs before it loads one.
//!
//! ```text
//!  GGUF file ──► gguf::GgufHeader (metadata, tensor directory; bounded) ──► ModelConfig
//!  config.json ──────────────────────────────────────────────────────────► ModelConfig
//! ```
//!
//! Layout: [`gguf`] reads (and, for tests, writes) GGUF headers; [`ggml`]
//! knows ggml's tensor types and their block sizes; [`config`] turns either
//! format's metadata into a [`ModelConfig`]. Nothing here reads tensor data.

pub mod config;
pub mod error;
pub mod ggml;
pub mod gguf;

pub use config::{Architecture, ModelConfig};
pub use error::{Error, Result};
pub use ggml::GgmlType;
pub use gguf::GgufHeader;
