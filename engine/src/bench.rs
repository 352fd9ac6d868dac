//! Measuring a pipeline: prefill and decode speed of one sequence, and the
//! aggregate decode speed of several sequences decoded together.
//!
//! Timing is taken inside the process around the engine calls (no process
//! start, no model load); end-of-sequence tokens are banned so every run
//! generates the same number of tokens.

use std::time::{Duration, Instant};

use serde::Serialize;

use crate::constraint::Grammar;
use crate::error::{Error, Result};
use crate::generation::ValidRequest;
use crate::pipeline::{LocalPipeline, TextModel, ban, generate, generate_request};
use crate::sampler::{Sampler, SamplingParams};
use crate::stage::SequenceId;

/// Text repeated to make prompts of any length.
const FILLER: &str = "The history of astronomy is the story of people looking up at the night sky and \
trying to explain what they saw. Early observers tracked the motions of the sun, the moon and the \
planets, built calendars, and predicted eclipses. Later, telescopes revealed moons around Jupiter, \
phases of Venus and countless stars in the Milky Way. ";

/// What to measure.
#[derive(Debug, Clone)]
pub struct BenchConfig {
    /// Tokens in the prompt.
    pub prompt_tokens: usize,
    /// Tokens to generate per sequence.
    pub gen_tokens: usize,
    /// Counted runs (after one warm-up run).
    pub runs: usize,
    /// Sequences decoded together in the concurrency measurement (1: skip it).
    pub concurrency: usize,
    /// Also generate under this output grammar in every run (up to
    /// `gen_tokens`, ending where the grammar completes) and report its
    /// decode rate and compile time beside the unconstrained ones.
    pub grammar: Option<Grammar>,
}

/// Minimum, median and maximum of one figure over the runs.
#[derive(Debug, Clone, Copy, Serialize)]
pub struct Spread {
    /// The smallest value.
    pub min: f64,
    /// The median (quote this one).
    pub median: f64,
    /// The largest value.
    pub max: f64,
}

impl Spread {
    /// The spread of `values` (at least one).
    pub fn of(mut values: Vec<f64>) -> Spread {
        values.sort_by(f64::total_cmp);
        let n = values.len();
        let median = if n % 2 == 1 {
            values[n / 2]
        } else {
            (values[n / 2 - 1] + values[n / 2]) / 2.0
        };
        Spread {
            min: values[0],
            median,
            max: values[n - 1],
        }
    }
}

/// The figures of one benchmark.
#[derive(Debug, Clone, Serialize)]
pub struct BenchReport {
    /// Prompt tokens per second (prefill, first token included).
    pub prefill_tokens_per_second: Spread,
    /// Tokens per second after the first, one sequence.
    pub decode_tokens_per_second: Spread,
    /// Time to first token, milliseconds.
    pub time_to_first_token_ms: Spread,
    /// Tokens per second over all sequences decoded together (when measured).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub concurrent_decode_tokens_per_second: Option<Spread>,
    /// The same decode under an output grammar (when measured).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub constrained: Option<ConstrainedFigures>,
}

/// Decode under an output grammar, measured in the same runs as the rest.
#[derive(Debug, Clone, Serialize)]
pub struct ConstrainedFigures {
    /// Tokens per second after the first, one sequence.
    pub decode_tokens_per_second: Spread,
    /// Tokens generated before the grammar completed (or the limit).
    pub generated_tokens: Spread,
    /// Time to compile the grammar for the model, milliseconds.
    pub compile_ms: Spread,
}

impl BenchReport {
    /// The figures of the measured runs: prompt and decode rates, times to
    /// first token (ms) and concurrent decode rates (none when not measured).
    pub fn from_runs(
        prefill: Vec<f64>,
        decode: Vec<f64>,
        ttft_ms: Vec<f64>,
        concurrent: Vec<f64>,
    ) -> Self {
        BenchReport {
            prefill_tokens_per_second: Spread::of(prefill),
            decode_tokens_per_second: Spread::of(decode),
            time_to_first_token_ms: Spread::of(ttft_ms),
            concurrent_decode_tokens_per_second: (!concurrent.is_empty())
                .then(|| Spread::of(concurrent)),
            constrained: None,
        }
    }
}

/// A prompt of exactly `n` tokens cut from repeated filler text.
pub fn synthetic_prompt(text: &TextModel, n: usize) -> Result<Vec<u32>> {
    if n == 0 {
        return Err(Error::InvalidInput(
            "the prompt needs at least one token".into(),
        ));
    }
    let mut source = FILLER.to_string();
    loop {
        let ids = text.tokenizer.encode(&source, true)?;
        if ids.len() >= n {
            return Ok(ids[..n].to_vec());
        }
        source.push_str(FILLER);
    }
}

/// Runs the benchmark.
pub fn run(
    pipeline: &mut LocalPipeline,
    text: &TextModel,
    config: &BenchConfig,
) -> Result<BenchReport> {
    if config.runs == 0 || config.gen_tokens < 2 {
        return Err(Error::InvalidInput(
            "a benchmark needs at least 1 run and 2 generated tokens".into(),
        ));
    }
    let prompt = synthetic_prompt(text, config.prompt_tokens)?;
    let params = SamplingParams {
        max_tokens: config.gen_tokens,
        ignore_eos: true,
        ..Default::default()
    };
    let mut prefill = Vec::new();
    let mut decode = Vec::new();
    let mut ttft = Vec::new();
    let mut concurrent = Vec::new();
    let mut constrained = (Vec::new(), Vec::new(), Vec::new());
    for run in 0..=config.runs {
        let g = generate(pipeline, text, 1, &prompt, &params, |_| {})?;
        if let Some(grammar) = &config.grammar {
            let compiling = Instant::now();
            let constraint = text.constraint(grammar)?;
            let compile_ms = compiling.elapsed().as_secs_f64() * 1e3;
            let params = SamplingParams {
                ignore_eos: false,
                ..params.clone()
            };
            let request = ValidRequest::new(
                prompt.clone(),
                Vec::new(),
                params,
                text.tokenizer.vocab_size(),
                pipeline.context_length(),
            )?
            .with_constraint(constraint)?;
            let c = generate_request(pipeline, text, 1, &request, |_| {})?;
            if run > 0 {
                constrained.0.push(c.decode_tokens_per_second());
                constrained.1.push(c.tokens.len() as f64);
                constrained.2.push(compile_ms);
            }
        }
        let concurrent_rate = if config.concurrency > 1 {
            Some(concurrent_decode(pipeline, text, &prompt, config)?)
        } else {
            None
        };
        if run == 0 {
            continue; // warm-up
        }
        prefill.push(g.prefill_tokens_per_second());
        decode.push(g.decode_tokens_per_second());
        ttft.push(g.time_to_first_token.as_secs_f64() * 1e3);
        concurrent.extend(concurrent_rate);
    }
    let mut report = BenchReport::from_runs(prefill, decode, ttft, concurrent);
    if config.grammar.is_some() {
        report.constrained = Some(ConstrainedFigures {
            decode_tokens_per_second: Spread::of(constrained.0),
            generated_tokens: Spread::of(constrained.1),
            compile_ms: Spread::of(constrained.2),
        });
    }
    Ok(report)
}

/// Prefills `concurrency` sequences, then decodes them together in batched
/// steps; returns the aggregate decode tokens per second.
fn concurrent_decode(
    pipeline: &mut LocalPipeline,
    text: &TextModel,
    prompt: &[u32],
    config: &BenchConfig,
) -> Result<f64> {
    let seqs: Vec<SequenceId> = (100..100 + config.concurrency as SequenceId).collect();
    let result = (|| {
        let mut samplers = Vec::new();
        let mut next = Vec::new();
        for &seq in &seqs {
            let params = SamplingParams {
                ignore_eos: true,
                ..Default::default()
            };
            let mut sampler = Sampler::new(params, prompt)?;
            let mut logits = pipeline
                .step(vec![(seq, prompt.to_vec())])?
                .pop()
                .expect("one sequence");
            ban(&mut logits, text.tokenizer.stop_tokens());
            next.push(sampler.sample(&mut logits));
            samplers.push(sampler);
        }
        let start = Instant::now();
        for _ in 1..config.gen_tokens {
            let batch = seqs
                .iter()
                .zip(&next)
                .map(|(&s, &t)| (s, vec![t]))
                .collect();
            let logits = pipeline.step(batch)?;
            for ((mut l, sampler), t) in logits.into_iter().zip(&mut samplers).zip(&mut next) {
                ban(&mut l, text.tokenizer.stop_tokens());
                *t = sampler.sample(&mut l);
            }
        }
        let elapsed: Duration = start.elapsed();
        Ok(((config.gen_tokens - 1) * seqs.len()) as f64 / elapsed.as_secs_f64())
    })();
    for &seq in &seqs {
        pipeline.release(seq);
    }
    result
}
