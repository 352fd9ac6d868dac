//! What the family tests share: a tiny model of a family written by
//! `reference/tiny_model.py` with mlx-lm's outputs, how far two logit rows
//! lie apart, and stage loaders for each engine.

#![allow(dead_code)] // each test binary uses its own part

use std::path::{Path, PathBuf};

use shardplane_engine::candle::CandleStage;
use shardplane_engine::{KvPrecision, LoadOptions, Stage, StageLayout};

/// What the reference computed.
#[derive(serde::Deserialize)]
pub struct Reference {
    pub prompt: Vec<u32>,
    /// Greedy tokens after the prompt.
    pub tokens: Vec<u32>,
    /// The logits that chose each token, and those after the last one.
    pub logits: Vec<Vec<f32>>,
    /// Top-1 minus top-2 of each row.
    pub margins: Vec<f32>,
    /// With `--forced N`: N random tokens, and the logits after each.
    #[serde(default)]
    pub forced: Vec<u32>,
    #[serde(default)]
    pub forced_logits: Vec<Vec<f32>>,
}

/// A tiny model of `family` with its reference outputs.
pub struct Tiny {
    pub _dir: tempfile::TempDir,
    pub gguf: PathBuf,
    pub mlx: PathBuf,
    pub layers: usize,
    pub reference: Reference,
}

pub fn tiny(family: &str) -> Tiny {
    tiny_with(family, &[])
}

/// A tiny model quantized by mlx-lm to `bits` (MLX layout only; the
/// reference is the quantized model's).
pub fn tiny_quantized(family: &str, bits: u32) -> Tiny {
    tiny_with(family, &["0", &bits.to_string()])
}

pub fn tiny_with(family: &str, extra: &[&str]) -> Tiny {
    let dir = tempfile::tempdir().unwrap();
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/reference/tiny_model.py");
    let mut args = vec![dir.path().as_os_str(), family.as_ref()];
    args.extend(extra.iter().map(|a| std::ffi::OsStr::new(*a)));
    shardplane_testkit::run_reference(&script, &args);
    let text = std::fs::read_to_string(dir.path().join("reference.json")).unwrap();
    let reference: Reference = serde_json::from_str(&text).unwrap();
    let config: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(dir.path().join("mlx/config.json")).unwrap())
            .unwrap();
    assert_eq!(reference.logits.len(), reference.tokens.len() + 1);
    Tiny {
        gguf: dir.path().join("model.gguf"),
        mlx: dir.path().join("mlx"),
        layers: config["num_hidden_layers"].as_u64().unwrap() as usize,
        reference,
        _dir: dir,
    }
}

/// The largest difference between two logit rows, as a fraction of the
/// reference row's range.
pub fn gap(got: &[f32], reference: &[f32]) -> f32 {
    assert_eq!(got.len(), reference.len(), "vocabulary sizes differ");
    let max = reference.iter().cloned().fold(f32::MIN, f32::max);
    let min = reference.iter().cloned().fold(f32::MAX, f32::min);
    got.iter()
        .zip(reference)
        .map(|(a, b)| (a - b).abs())
        .fold(0.0, f32::max)
        / (max - min)
}

pub fn argmax(row: &[f32]) -> u32 {
    row.iter()
        .enumerate()
        .max_by(|a, b| a.1.total_cmp(b.1))
        .map(|(i, _)| i as u32)
        .unwrap()
}

pub const TOLERANCE: f32 = 1e-4;

/// Loads one stage of a tiny model.
pub type Loader<'a> = Box<dyn Fn(StageLayout) -> Box<dyn Stage> + 'a>;

/// candle multiplying in f32 (it would quantize safetensors matrices to
/// Q8_0 otherwise; the GGUF's f32 weights stay f32 either way).
pub fn candle(path: &Path) -> Loader<'_> {
    // An f32 KV cache, as the references hold theirs: the check is of the
    // model's definition, not of the cache's rounding.
    let options = LoadOptions {
        dequantize: true,
        kv_precision: KvPrecision::F32,
        ..Default::default()
    };
    Box::new(move |layout| Box::new(CandleStage::load(path, layout, &options).unwrap()))
}

#[cfg(feature = "mlx")]
pub fn mlx(path: &Path) -> Loader<'_> {
    use shardplane_engine::mlx::MlxStage;
    Box::new(move |layout| Box::new(MlxStage::load(path, layout, &LoadOptions::default()).unwrap()))
}
