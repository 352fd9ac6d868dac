//! Options shared by the commands that load a model.

use std::path::PathBuf;

use anyhow::Context;
use clap::Args;
use shardplane_engine::LoadOptions;
use shardplane_engine::StageLayout;
use shardplane_engine::config::read_dir_config;
use shardplane_engine::gguf::GgufFile;
use shardplane_engine::pipeline::{
    EngineKind, LocalPipeline, TextModel, load_model_stage, parse_stages,
};

/// Which model, how to split it and which engine runs it.
#[derive(Args, Debug, Clone)]
pub struct ModelArgs {
    /// The GGUF model file (not needed with `--endpoint`, which uses a running
    /// pipeline; `bench --endpoint` and `bench --gateway` still read its
    /// tokenizer).
    #[arg(long, env = "SHARDPLANE_MODEL", required_unless_present = "endpoint")]
    pub model: Option<PathBuf>,
    /// Split the model into stages run in this process, passing hidden states
    /// between them: inclusive layer ranges covering every layer, e.g.
    /// `0-9,10-19,20-29`. One stage when unset.
    #[arg(long)]
    pub stages: Option<String>,
    /// The engine: candle, or mlx in binaries built with the `mlx` feature.
    #[arg(long, default_value = "candle")]
    pub engine: String,
    /// The most tokens a sequence may hold; the model's context length when unset.
    #[arg(long)]
    pub context: Option<usize>,
    /// Keep Q4_1/Q5_0/Q5_1 weights as they are instead of re-quantizing them to
    /// Q8_0 at load (less memory, slower on CPUs).
    #[arg(long)]
    pub keep_quantization: bool,
    /// Expand quantized weights to f32 at load (several times the memory):
    /// candle then multiplies in f32 from the exact weights, as MLX does; MLX
    /// on a CPU multiplies through BLAS, far faster than its quantized CPU kernel.
    #[arg(long)]
    pub dequantize: bool,
    /// Hold keys and values as f32 rather than f16 on candle (twice the KV
    /// memory, and slower at long contexts; for comparing with an f32
    /// reference).
    #[arg(long)]
    pub kv_f32: bool,
    /// Split every stage across this many ranks (tensor parallelism), run in
    /// this process on threads of their own and joined over loopback TCP
    /// with the all-reduce agents use, so a split can be checked on one
    /// machine. Candle engine, dense models.
    #[arg(long, default_value_t = 1, value_parser = clap::value_parser!(u16).range(1..))]
    pub tensor: u16,
    /// Uneven tensor shares, one weight per rank, e.g. `2:1` (two ranks, the
    /// first with twice the heads and columns of the second); sets the rank
    /// count.
    #[arg(long, conflicts_with = "tensor")]
    pub tensor_weights: Option<String>,
    /// Run tensor ranks 1 and up in processes of their own (this binary,
    /// joined over loopback TCP) instead of threads: what ranks on separate
    /// machines do, on one.
    #[arg(long)]
    pub tensor_processes: bool,
}

impl ModelArgs {
    /// The model file.
    pub fn path(&self) -> anyhow::Result<&std::path::Path> {
        self.model.as_deref().context("--model is needed here")
    }

    /// Opens the model and loads its stages and text parts.
    pub fn load(&self) -> anyhow::Result<(LocalPipeline, TextModel)> {
        let path = self.path()?;
        let engine: EngineKind = self.engine.parse()?;
        let options = self.options();
        if let Some(weights) = self.rank_weights()? {
            return self.load_tensor(path, engine, &options, &weights);
        }
        if path.is_dir() {
            return self.load_dir(path, engine, &options);
        }
        let file = GgufFile::open(path)?;
        let splits = match &self.stages {
            Some(spec) => parse_stages(spec, file.config().layers)?,
            None => Vec::new(),
        };
        let pipeline = LocalPipeline::load(&file, &splits, engine, &options)
            .with_context(|| format!("cannot load {}", path.display()))?;
        let text = TextModel::from_gguf(&file)?;
        Ok((pipeline, text))
    }

    /// How stages are loaded.
    pub fn options(&self) -> LoadOptions {
        LoadOptions {
            context_length: self.context,
            requantize_slow_types: !self.keep_quantization,
            dequantize: self.dequantize,
            // One request at a time: nothing to share.
            prefix_cache_bytes: 0,
            kv_precision: match self.kv_f32 {
                true => shardplane_engine::KvPrecision::F32,
                false => shardplane_engine::KvPrecision::F16,
            },
        }
    }

    /// Makes this process (and the rank processes it starts, which inherit
    /// the setting) compute with its share of `total` threads (the cores
    /// when unset): all of them, or with `--tensor-processes` an equal part
    /// per rank, so the ranks' pools do not outnumber the cores (measured
    /// here: tensor 2 in two processes decoded 4.8 tokens/s with a pool of
    /// both cores each, 34.5 with one thread each). May restart the process.
    pub fn use_threads(&self, total: Option<usize>) -> anyhow::Result<()> {
        let ranks = self.tensor_ranks()?;
        if self.tensor_processes && ranks > 1 {
            let cores = total.unwrap_or_else(|| super::threads::share(1));
            return super::threads::use_threads(Some((cores / ranks).max(1)));
        }
        super::threads::use_threads(total)
    }

    /// Ranks of each stage's tensor group (1 when not split).
    pub fn tensor_ranks(&self) -> anyhow::Result<usize> {
        Ok(self.rank_weights()?.map_or(1, |w| w.len()))
    }

    /// The weights of a tensor group's ranks, when the stages are split.
    pub fn rank_weights(&self) -> anyhow::Result<Option<Vec<f64>>> {
        Ok(match &self.tensor_weights {
            Some(spec) => Some(shardplane_engine::tensor::parse_weights(spec)?),
            None if self.tensor > 1 => Some(vec![1.0; usize::from(self.tensor)]),
            None => None,
        })
    }

    /// Loads every stage as a tensor group of `weights.len()` ranks.
    fn load_tensor(
        &self,
        path: &std::path::Path,
        engine: EngineKind,
        options: &LoadOptions,
        weights: &[f64],
    ) -> anyhow::Result<(LocalPipeline, TextModel)> {
        anyhow::ensure!(
            engine == EngineKind::Candle,
            "--tensor runs on the candle engine; the {} engine does not split layers yet",
            engine.name()
        );
        let (config, text) = if path.is_dir() {
            (read_dir_config(path)?.0, TextModel::from_dir(path)?)
        } else {
            let file = GgufFile::open(path)?;
            (file.config().clone(), TextModel::from_gguf(&file)?)
        };
        let splits = match &self.stages {
            Some(spec) => parse_stages(spec, config.layers)?,
            None => std::iter::once(0..config.layers).collect(),
        };
        let stages = splits
            .into_iter()
            .map(|r| {
                let layout = StageLayout::new(r, config.layers)?;
                if self.tensor_processes {
                    super::tensor::load_group_processes(self, &config, layout, weights)
                } else {
                    super::tensor::load_group(path, &config, layout, options, weights)
                }
            })
            .collect::<anyhow::Result<Vec<_>>>()?;
        Ok((LocalPipeline::from_stages(stages), text))
    }

    /// Loads a safetensors model directory (the MLX-community layout, as
    /// `shardplane convert` writes it) with either engine.
    fn load_dir(
        &self,
        dir: &std::path::Path,
        engine: EngineKind,
        options: &LoadOptions,
    ) -> anyhow::Result<(LocalPipeline, TextModel)> {
        let (config, _) = read_dir_config(dir)?;
        let layers = config.layers;
        let splits = match &self.stages {
            Some(spec) => parse_stages(spec, layers)?,
            None => std::iter::once(0..layers).collect(),
        };
        let mut text = None;
        let mut stages = Vec::new();
        for r in splits {
            let layout = StageLayout::new(r, layers)?;
            let (stage, first) = load_model_stage(dir, layout, engine, options)
                .with_context(|| format!("cannot load {}", dir.display()))?;
            text = text.or(first);
            stages.push(stage);
        }
        let text = text.context("the first stage brings the tokenizer")?;
        Ok((LocalPipeline::from_stages(stages), text))
    }
}
