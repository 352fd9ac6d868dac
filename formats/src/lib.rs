//! Model file formats, read without a compute engine: what the operator needs
//! to place a model and what an engine needs before it loads one.
//!
//! ```text
//!  GGUF file ──► gguf::GgufHeader (metadata, tensor directory; bounded) ──► ModelConfig
//!  config.json ──────────────────────────────────────────────────────────► ModelConfig
//!  *.safetensors header ──► safetensors::parse_header (bounded) ──► tensor sizes
//! ```
//!
//! Layout: [`gguf`] reads (and, for tests, writes) GGUF headers; [`ggml`]
//! knows ggml's tensor types and their block sizes; [`config`] turns either
//! format's metadata into a [`ModelConfig`]; [`held`] counts what each
//! engine holds of a GGUF or MLX-community safetensors model in memory; [`safetensors`] reads a
//! safetensors header. Nothing here reads tensor data. Every reader is
//! fuzzed (`fuzz/fuzz_targets/model_headers.rs`).

pub mod config;
pub mod error;
pub mod ggml;
pub mod gguf;
pub mod held;
pub mod safetensors;

pub use config::{Architecture, ModelConfig};
pub use error::{Error, Result};
pub use ggml::GgmlType;
pub use gguf::GgufHeader;
