//! What a model is: its hyper-parameters, read (without the engine) by
//! `shardplane-formats` from GGUF metadata or a `config.json`.

pub use shardplane_formats::config::{
    Activation, Architecture, LayerAttention, ModelConfig, SlidingWindow,
};
