//! What a model is: its hyper-parameters, read (without the engine) by
//! `shardplane-formats` from GGUF metadata or a `config.json`.

use std::path::{Path, PathBuf};

use crate::error::{Error, Result};

pub use shardplane_formats::config::{
    Activation, Architecture, LatentAttention, LayerAttention, ModelConfig, Moe, PROMPT_STEP,
    Routing, SlidingWindow, sliding_kept, sliding_rows_held,
};

/// Reads the configuration of a safetensors model directory (the
/// MLX-community layout): the numbers, and the whole `config.json`.
pub fn read_dir_config(dir: &Path) -> Result<(ModelConfig, serde_json::Value)> {
    let path = dir.join("config.json");
    let text = std::fs::read_to_string(&path).map_err(|source| Error::Io {
        path: path.clone(),
        source,
    })?;
    let json: serde_json::Value = serde_json::from_str(&text).map_err(|e| Error::CorruptModel {
        path: path.clone(),
        reason: e.to_string(),
    })?;
    Ok((ModelConfig::from_hf_json(&json)?, json))
}

/// The `*.safetensors` files of a model directory, in name order (a sharded
/// model's shards, with or without its index).
pub fn safetensors_files(dir: &Path) -> Result<Vec<PathBuf>> {
    let mut files: Vec<PathBuf> = std::fs::read_dir(dir)
        .map_err(|source| Error::Io {
            path: dir.to_path_buf(),
            source,
        })?
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| p.extension().is_some_and(|x| x == "safetensors"))
        .collect();
    files.sort();
    if files.is_empty() {
        return Err(Error::MissingMetadata {
            what: format!("weights in {}", dir.display()),
            detail: "the directory holds no .safetensors file".into(),
        });
    }
    Ok(files)
}
