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
    /// Sequence counts to decode together, each measured in every run
    /// (counts of 1 are the single-sequence figures, measured anyway).
    pub concurrency: Vec<usize>,
    /// Also generate under this output grammar in every run (up to
    /// `gen_tokens`, ending where the grammar completes) and report its
    /// decode rate and compile time beside the unconstrained ones.
    pub grammar: Option<Grammar>,
    /// Sampling temperature of every run (0: greedy).
    pub temperature: f32,
    /// Nucleus sampling's probability mass (with a temperature above 0).
    pub top_p: Option<f32>,
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
    /// Many sequences at once, one entry per count asked for.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub concurrent: Vec<ConcurrentFigures>,
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

/// `sequences` decoded together: their aggregate rate over the runs, and
/// the latencies each of them saw.
#[derive(Debug, Clone, Serialize)]
pub struct ConcurrentFigures {
    /// Sequences at once.
    pub sequences: usize,
    /// Tokens per second after the first, over all of them.
    pub decode_tokens_per_second: Spread,
    /// Time between two tokens of a sequence, ms: every batched step of
    /// every run (in this process), or each stream's mean (`--endpoint`).
    pub inter_token_ms: Percentiles,
    /// Time to first token when they all arrive at once, ms, over every
    /// sequence of every run.
    pub time_to_first_token_ms: Percentiles,
}

/// The median and the 99th percentile (nearest rank) of many samples.
#[derive(Debug, Clone, Copy, Serialize)]
pub struct Percentiles {
    /// Half the samples are at most this.
    pub p50: f64,
    /// 99 % of the samples are at most this.
    pub p99: f64,
}

impl Percentiles {
    /// The percentiles of `values` (at least one).
    pub fn of(mut values: Vec<f64>) -> Percentiles {
        values.sort_by(f64::total_cmp);
        let rank =
            |p: f64| values[((p * values.len() as f64).ceil() as usize).clamp(1, values.len()) - 1];
        Percentiles {
            p50: rank(0.50),
            p99: rank(0.99),
        }
    }
}

/// The measured runs of `sequences` at once: each run's aggregate decode
/// rate, and the inter-token and first-token times (ms) of all of them.
#[derive(Debug)]
pub struct ConcurrentRuns {
    /// Sequences at once.
    pub sequences: usize,
    rates: Vec<f64>,
    inter_token_ms: Vec<f64>,
    first_token_ms: Vec<f64>,
}

impl ConcurrentRuns {
    /// One entry per sequence count of a sweep worth measuring together:
    /// above one, each once, in the order given.
    pub fn sweep(asked: &[usize]) -> Vec<ConcurrentRuns> {
        let mut sweep: Vec<ConcurrentRuns> = Vec::new();
        for &sequences in asked {
            if sequences > 1 && sweep.iter().all(|r| r.sequences != sequences) {
                sweep.push(ConcurrentRuns {
                    sequences,
                    rates: Vec::new(),
                    inter_token_ms: Vec::new(),
                    first_token_ms: Vec::new(),
                });
            }
        }
        sweep
    }

    /// Adds one run.
    pub fn add(&mut self, rate: f64, inter_token_ms: &[f64], first_token_ms: &[f64]) {
        self.rates.push(rate);
        self.inter_token_ms.extend_from_slice(inter_token_ms);
        self.first_token_ms.extend_from_slice(first_token_ms);
    }

    /// The figures of the runs added (at least one).
    pub fn figures(self) -> ConcurrentFigures {
        ConcurrentFigures {
            sequences: self.sequences,
            decode_tokens_per_second: Spread::of(self.rates),
            inter_token_ms: Percentiles::of(self.inter_token_ms),
            time_to_first_token_ms: Percentiles::of(self.first_token_ms),
        }
    }
}

impl BenchReport {
    /// The figures of the measured runs: prompt and decode rates, times to
    /// first token (ms) and the concurrent figures (none when not measured).
    pub fn from_runs(
        prefill: Vec<f64>,
        decode: Vec<f64>,
        ttft_ms: Vec<f64>,
        concurrent: Vec<ConcurrentFigures>,
    ) -> Self {
        BenchReport {
            prefill_tokens_per_second: Spread::of(prefill),
            decode_tokens_per_second: Spread::of(decode),
            time_to_first_token_ms: Spread::of(ttft_ms),
            concurrent,
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
        temperature: config.temperature,
        top_p: config.top_p,
        ..Default::default()
    };
    let mut prefill = Vec::new();
    let mut decode = Vec::new();
    let mut ttft = Vec::new();
    let mut concurrent = ConcurrentRuns::sweep(&config.concurrency);
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
        for runs in &mut concurrent {
            let (rate, steps, first) =
                concurrent_decode(pipeline, text, &prompt, runs.sequences, config)?;
            if run > 0 {
                runs.add(rate, &steps, &first);
            }
        }
        if run == 0 {
            continue; // warm-up
        }
        prefill.push(g.prefill_tokens_per_second());
        decode.push(g.decode_tokens_per_second());
        ttft.push(g.time_to_first_token.as_secs_f64() * 1e3);
    }
    let concurrent = concurrent
        .into_iter()
        .map(ConcurrentRuns::figures)
        .collect();
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

/// Prefills `sequences` sequences that arrived together, one after another,
/// then decodes them together in batched steps; returns the aggregate decode
/// tokens per second, each step's time and each first token's time (ms).
fn concurrent_decode(
    pipeline: &mut LocalPipeline,
    text: &TextModel,
    prompt: &[u32],
    sequences: usize,
    config: &BenchConfig,
) -> Result<(f64, Vec<f64>, Vec<f64>)> {
    let seqs: Vec<SequenceId> = (100..100 + sequences as SequenceId).collect();
    let ms = |d: Duration| d.as_secs_f64() * 1e3;
    let result = (|| {
        let mut samplers = Vec::new();
        let mut next = Vec::new();
        let arrived = Instant::now();
        let mut first = Vec::with_capacity(seqs.len());
        for &seq in &seqs {
            let params = SamplingParams {
                ignore_eos: true,
                temperature: config.temperature,
                top_p: config.top_p,
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
            first.push(ms(arrived.elapsed()));
        }
        let start = Instant::now();
        let mut steps = Vec::with_capacity(config.gen_tokens);
        for _ in 1..config.gen_tokens {
            let step = Instant::now();
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
            steps.push(ms(step.elapsed()));
        }
        let elapsed: Duration = start.elapsed();
        let rate = ((config.gen_tokens - 1) * seqs.len()) as f64 / elapsed.as_secs_f64();
        Ok((rate, steps, first))
    })();
    for &seq in &seqs {
        pipeline.release(seq);
    }
    result
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn percentiles_take_the_nearest_rank() {
        let p = Percentiles::of((1..=200).rev().map(f64::from).collect());
        assert_eq!((p.p50, p.p99), (100.0, 198.0));
        let one = Percentiles::of(vec![7.0]);
        assert_eq!((one.p50, one.p99), (7.0, 7.0));
    }

    #[test]
    fn a_sweep_measures_each_count_above_one_once() {
        let counts = |asked: &[usize]| -> Vec<usize> {
            ConcurrentRuns::sweep(asked)
                .iter()
                .map(|r| r.sequences)
                .collect()
        };
        assert_eq!(counts(&[1, 8, 32, 8]), vec![8, 32]);
        assert!(counts(&[1]).is_empty());
    }

    #[test]
    fn concurrent_runs_pool_every_sample() {
        let mut runs = ConcurrentRuns::sweep(&[2]).remove(0);
        runs.add(100.0, &[10.0, 12.0], &[5.0]);
        runs.add(120.0, &[11.0], &[6.0, 50.0]);
        let f = runs.figures();
        assert_eq!(f.decode_tokens_per_second.median, 110.0);
        assert_eq!((f.inter_token_ms.p50, f.inter_token_ms.p99), (11.0, 12.0));
        assert_eq!(f.time_to_first_token_ms.p99, 50.0);
    }
}
