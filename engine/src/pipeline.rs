//! Generating text with the stages of one model in one process: the stages run
//! in order, passing hidden states, exactly as they would across machines.
//!
//! ```text
//!  prompt ─► tokenizer ─► stage 0 ─► stage 1 ─► … ─► logits ─► sampler ─► token
//!                           ▲                                              │
//!                           └──────────────── next step ◄──────────────────┘
//! ```

use std::ops::Range;
use std::time::{Duration, Instant};

use crate::candle::CandleStage;
use crate::error::{Error, Result};
pub use crate::generation::FinishReason;
use crate::generation::{Decoder, ValidRequest};
use crate::gguf::GgufFile;
use crate::sampler::{Sampler, SamplingParams};
use crate::stage::{LoadOptions, SequenceId, Stage, StageInput, StageLayout, StageOutput};
pub use crate::text_model::TextModel;

/// The engines a stage can run on.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum EngineKind {
    /// candle (CPU here; CUDA or Metal where built with them).
    Candle,
    /// MLX (Metal on Apple Silicon, CPU elsewhere): the `mlx` feature.
    #[cfg(feature = "mlx")]
    Mlx,
}

impl EngineKind {
    /// The engine's name (what `FromStr` takes).
    pub fn name(self) -> &'static str {
        match self {
            EngineKind::Candle => "candle",
            #[cfg(feature = "mlx")]
            EngineKind::Mlx => "mlx",
        }
    }

    /// Bytes the engines' allocators keep for reuse instead of giving them
    /// back to the system (MLX's buffer cache): the process holds them
    /// although no array does.
    pub fn cached_bytes() -> usize {
        #[cfg(feature = "mlx")]
        {
            crate::mlx::cache_memory()
        }
        #[cfg(not(feature = "mlx"))]
        {
            0
        }
    }

    /// The engines built into this binary.
    pub fn available() -> &'static [&'static str] {
        if cfg!(feature = "mlx") {
            &["candle", "mlx"]
        } else {
            &["candle"]
        }
    }
}

impl std::str::FromStr for EngineKind {
    type Err = Error;

    fn from_str(s: &str) -> Result<Self> {
        match s {
            "candle" => Ok(EngineKind::Candle),
            #[cfg(feature = "mlx")]
            "mlx" => Ok(EngineKind::Mlx),
            #[cfg(not(feature = "mlx"))]
            "mlx" => Err(Error::InvalidInput(
                "engine \"mlx\" is not built into this binary: build it with `--features mlx` \
                 (after `bash scripts/mlx.sh` installs libmlx)"
                    .into(),
            )),
            other => Err(Error::InvalidInput(format!(
                "engine {other:?} is not known: available are {}",
                EngineKind::available().join(", ")
            ))),
        }
    }
}

/// Parses a stage split such as `0-9,10-19,20-29` (inclusive layer ranges)
/// into half-open ranges covering all `layers` in order.
pub fn parse_stages(spec: &str, layers: usize) -> Result<Vec<Range<usize>>> {
    let bad = |m: String| Error::InvalidInput(format!("stages {spec:?}: {m}"));
    let mut ranges = Vec::new();
    let mut next = 0;
    for part in spec.split(',').map(str::trim) {
        let (a, b) = part
            .split_once('-')
            .ok_or_else(|| bad(format!("{part:?} is not FIRST-LAST")))?;
        let parse = |x: &str| {
            x.trim()
                .parse::<usize>()
                .map_err(|_| bad(format!("{x:?} is not a layer number")))
        };
        let (first, last) = (parse(a)?, parse(b)?);
        if first != next {
            return Err(bad(format!("stage {part} should start at layer {next}")));
        }
        if last < first {
            return Err(bad(format!("stage {part} is reversed")));
        }
        if last >= layers {
            return Err(bad(format!(
                "layer {last} is past the model's {layers} layers (0-{})",
                layers - 1
            )));
        }
        ranges.push(first..last + 1);
        next = last + 1;
    }
    if next != layers {
        return Err(bad(format!(
            "the stages end at layer {next} but the model has {layers} layers"
        )));
    }
    Ok(ranges)
}

/// Loads one stage of the GGUF model with `engine`.
pub fn load_stage(
    file: &GgufFile,
    layout: StageLayout,
    engine: EngineKind,
    options: &LoadOptions,
) -> Result<Box<dyn Stage>> {
    Ok(match engine {
        EngineKind::Candle => Box::new(CandleStage::load_from(
            file,
            layout,
            options,
            candle_core::Device::Cpu,
        )?),
        #[cfg(feature = "mlx")]
        EngineKind::Mlx => Box::new(crate::mlx::MlxStage::load_gguf(file, layout, options)?),
    })
}

/// Loads one stage of the model at `path` — a GGUF file, or a directory in
/// the MLX-community layout — with the model's tokenizer and chat
/// template when the stage is the first.
pub fn load_model_stage(
    path: &std::path::Path,
    layout: StageLayout,
    engine: EngineKind,
    options: &LoadOptions,
) -> Result<(Box<dyn Stage>, Option<TextModel>)> {
    if path.is_dir() {
        let text = layout
            .is_first()
            .then(|| TextModel::from_dir(path))
            .transpose()?;
        let stage: Box<dyn Stage> = match engine {
            #[cfg(feature = "mlx")]
            EngineKind::Mlx => Box::new(crate::mlx::MlxStage::load(path, layout, options)?),
            EngineKind::Candle => Box::new(CandleStage::load(path, layout, options)?),
        };
        return Ok((stage, text));
    }
    let file = GgufFile::open(path)?;
    let text = layout
        .is_first()
        .then(|| TextModel::from_gguf(&file))
        .transpose()?;
    Ok((load_stage(&file, layout, engine, options)?, text))
}

/// Loads rank `rank` of a tensor group computing stage `layout` of the
/// model at `path` (a GGUF file or a safetensors directory), its share
/// following `weights` (every rank's, in rank order), summing with
/// `collective`; with the tokenizer when it leads the first stage. Tensor
/// ranks run on candle.
pub fn load_tensor_rank(
    path: &std::path::Path,
    layout: StageLayout,
    options: &LoadOptions,
    weights: &[f64],
    rank: usize,
    collective: Box<dyn crate::tensor::AllReduce>,
) -> Result<(Box<dyn Stage>, Option<TextModel>)> {
    let (config, text) = if path.is_dir() {
        let leads_first = rank == 0 && layout.is_first();
        let text = leads_first.then(|| TextModel::from_dir(path)).transpose()?;
        (crate::config::read_dir_config(path)?.0, text)
    } else {
        let file = GgufFile::open(path)?;
        let text = (rank == 0 && layout.is_first())
            .then(|| TextModel::from_gguf(&file))
            .transpose()?;
        (file.config().clone(), text)
    };
    let split = crate::tensor::TensorSplit::weighted(&config, weights)?;
    let share = split.shares().get(rank).cloned().ok_or_else(|| {
        Error::Tensor(format!("rank {rank} of a group of {} ranks", weights.len()))
    })?;
    let rank = crate::tensor::TensorRank { share, collective };
    let stage = CandleStage::load_rank(path, layout, options, rank)?;
    Ok((Box::new(stage), text))
}

/// The stages of one model, run in order in this process.
pub struct LocalPipeline {
    stages: Vec<Box<dyn Stage>>,
}

impl LocalPipeline {
    /// Loads `splits` (half-open layer ranges covering the model) of the GGUF
    /// file with `engine`; one stage for the whole model when `splits` is empty.
    pub fn load(
        file: &GgufFile,
        splits: &[Range<usize>],
        engine: EngineKind,
        options: &LoadOptions,
    ) -> Result<Self> {
        let layers = file.config().layers;
        let whole = std::iter::once(0..layers).collect::<Vec<_>>();
        let splits = if splits.is_empty() {
            &whole[..]
        } else {
            splits
        };
        let stages = splits
            .iter()
            .map(|range| {
                load_stage(
                    file,
                    StageLayout::new(range.clone(), layers)?,
                    engine,
                    options,
                )
            })
            .collect::<Result<Vec<_>>>()?;
        Ok(LocalPipeline { stages })
    }

    /// Builds a pipeline from stages already loaded (in order).
    pub fn from_stages(stages: Vec<Box<dyn Stage>>) -> Self {
        LocalPipeline { stages }
    }

    /// The stages.
    pub fn stages(&self) -> &[Box<dyn Stage>] {
        &self.stages
    }

    /// The stages, to drive one by one.
    pub fn stages_mut(&mut self) -> &mut [Box<dyn Stage>] {
        &mut self.stages
    }

    /// The most tokens one sequence may hold (the smallest over the stages).
    pub fn context_length(&self) -> usize {
        self.stages
            .iter()
            .map(|s| s.context_length())
            .min()
            .unwrap_or(0)
    }

    /// Runs tokens of several sequences through every stage as one step;
    /// returns the logits at each sequence's last token, in input order. A
    /// step may mix decode tokens with slices of prompts.
    pub fn step(&mut self, batch: Vec<(SequenceId, Vec<u32>)>) -> Result<Vec<Vec<f32>>> {
        let seqs: Vec<SequenceId> = batch.iter().map(|(s, _)| *s).collect();
        let mut inputs: Vec<(SequenceId, StageInput)> = batch
            .into_iter()
            .map(|(s, t)| (s, StageInput::Tokens(t)))
            .collect();
        let n = self.stages.len();
        for (i, stage) in self.stages.iter_mut().enumerate() {
            let outputs = if inputs.len() == 1 {
                let (seq, input) = inputs.pop().expect("one input");
                vec![stage.forward(seq, input)?]
            } else {
                stage.forward_batch(inputs)?
            };
            if i + 1 == n {
                return outputs
                    .into_iter()
                    .map(|o| match o {
                        StageOutput::Logits(l) => Ok(l),
                        StageOutput::Hidden(_) => Err(Error::InvalidInput(
                            "the last stage gave hidden states".into(),
                        )),
                    })
                    .collect();
            }
            inputs = seqs
                .iter()
                .zip(outputs)
                .map(|(&s, o)| match o {
                    StageOutput::Hidden(a) => Ok((s, StageInput::Hidden(a))),
                    StageOutput::Logits(_) => Err(Error::InvalidInput(format!(
                        "stage {i} is not the last but gave logits"
                    ))),
                })
                .collect::<Result<_>>()?;
        }
        Err(Error::InvalidInput(
            "a pipeline needs at least one stage".into(),
        ))
    }

    /// Frees a sequence on every stage.
    pub fn release(&mut self, seq: SequenceId) {
        for stage in &mut self.stages {
            stage.release(seq);
        }
    }
}

/// The result of one generation.
#[derive(Debug, Clone)]
pub struct Generation {
    /// Generated token ids (the stop token included, if one ended it).
    pub tokens: Vec<u32>,
    /// Generated text (stop strings and end tokens left out).
    pub text: String,
    /// Why it ended.
    pub finish: FinishReason,
    /// Tokens of the prompt.
    pub prompt_tokens: usize,
    /// Time to run the prompt and pick the first token.
    pub time_to_first_token: Duration,
    /// Time for every token after the first.
    pub decode_time: Duration,
}

impl Generation {
    /// Prompt tokens per second of the prefill (first token included).
    pub fn prefill_tokens_per_second(&self) -> f64 {
        self.prompt_tokens as f64 / self.time_to_first_token.as_secs_f64()
    }

    /// Generated tokens per second after the first.
    pub fn decode_tokens_per_second(&self) -> f64 {
        (self.tokens.len().saturating_sub(1)) as f64 / self.decode_time.as_secs_f64()
    }
}

/// Makes `tokens` impossible to pick.
pub fn ban(logits: &mut [f32], tokens: &[u32]) {
    for &t in tokens {
        if let Some(l) = logits.get_mut(t as usize) {
            *l = f32::NEG_INFINITY;
        }
    }
}

/// Generates a reply to `prompt` for sequence `seq`, calling `on_text` with
/// each piece of text as soon as it is whole. The sequence is freed on every
/// stage afterwards, whatever happens.
pub fn generate(
    pipeline: &mut LocalPipeline,
    text: &TextModel,
    seq: SequenceId,
    prompt: &[u32],
    params: &SamplingParams,
    on_text: impl FnMut(&str),
) -> Result<Generation> {
    let request = ValidRequest::new(
        prompt.to_vec(),
        Vec::new(),
        params.clone(),
        text.tokenizer.vocab_size(),
        pipeline.context_length(),
    )?;
    generate_request(pipeline, text, seq, &request, on_text)
}

/// Like [`generate`], for a request already checked (and perhaps bound to
/// an output grammar).
pub fn generate_request(
    pipeline: &mut LocalPipeline,
    text: &TextModel,
    seq: SequenceId,
    request: &ValidRequest,
    mut on_text: impl FnMut(&str),
) -> Result<Generation> {
    let result = generate_inner(pipeline, text, seq, request, &mut on_text);
    pipeline.release(seq);
    result
}

fn generate_inner(
    pipeline: &mut LocalPipeline,
    text: &TextModel,
    seq: SequenceId,
    request: &ValidRequest,
    on_text: &mut impl FnMut(&str),
) -> Result<Generation> {
    let params = request.params();
    let mut sampler = Sampler::new(params.clone(), &request.context())?;
    let mut decoder = Decoder::new(&text.tokenizer, request)?;
    let mut out = String::new();
    let mut tokens = Vec::new();
    let start = Instant::now();
    let mut first_token_at = None;
    while let Some(input) = decoder.next_input() {
        let allowed = decoder.allowed()?;
        let mut logits = pipeline
            .step(vec![(seq, input)])?
            .pop()
            .expect("one sequence");
        if params.ignore_eos {
            ban(&mut logits, text.tokenizer.stop_tokens());
        }
        let token = sampler.sample_within(&mut logits, allowed.as_ref());
        first_token_at.get_or_insert_with(Instant::now);
        tokens.push(token);
        let piece = decoder.accept(token)?;
        on_text(&piece.text);
        out.push_str(&piece.text);
    }
    // Text held back for an incomplete character or a possible stop string.
    let (tail, finish) = decoder.finish()?;
    on_text(&tail);
    out.push_str(&tail);
    let end = Instant::now();
    let first = first_token_at.unwrap_or(end);
    Ok(Generation {
        tokens,
        text: out,
        finish,
        prompt_tokens: request.prompt().len(),
        time_to_first_token: first - start,
        decode_time: end - first,
    })
}
