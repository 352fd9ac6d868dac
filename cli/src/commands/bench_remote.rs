//! `shardplane bench --endpoint`: the same figures as the in-process bench,
//! measured by a client of a head stage's data plane (the whole pipeline of
//! agents, its hops and the client's own overhead included).

use std::time::{Duration, Instant};

use anyhow::{Context, bail};
use shardplane_dataplane as dp;
use shardplane_engine::bench::{BenchConfig, BenchReport, ConcurrentRuns, synthetic_prompt};
use shardplane_engine::pipeline::TextModel;

/// One generation as the client saw it.
pub(super) struct Timed {
    /// Its prompt's tokens.
    pub prompt: usize,
    /// From sending the request to the first token.
    pub ttft: Duration,
    /// From the first token to the last.
    pub decode: Duration,
    /// Tokens generated.
    pub tokens: usize,
}

/// Where and what to measure.
pub struct Remote {
    /// The head stage's data-plane endpoint.
    pub endpoint: String,
    /// The head Shard, `namespace/name`.
    pub shard: String,
    /// The data-plane token.
    pub token: dp::Token,
    /// TLS to the endpoint's node, when the agents serve it.
    pub tls: Option<NodeTls>,
}

pub use super::tls_args::NodeTls;

/// A channel to `endpoint` (inside a runtime): TLS to the node when `tls` says.
pub(super) fn channel(
    endpoint: &str,
    tls: &Option<NodeTls>,
) -> anyhow::Result<dp::tonic::transport::Channel> {
    dp::channel(endpoint, tls.as_ref().map(|(t, n)| (t, n.as_str()))).map_err(anyhow::Error::msg)
}

/// One generation straight from a head stage.
pub(super) async fn once(client: &dp::Client, req: dp::GenerateRequest) -> anyhow::Result<Timed> {
    let prompt = match &req.input {
        Some(dp::generate_request::Input::Tokens(t)) => t.ids.len(),
        _ => 0,
    };
    let start = Instant::now();
    let mut stream = client.clone().generate(req).await?.into_inner();
    let (mut first, mut last, mut tokens) = (None, start, 0);
    while let Some(ev) = stream.message().await? {
        if let Some(dp::generate_response::Event::Delta(d)) = ev.event
            && !d.tokens.is_empty()
        {
            let now = Instant::now();
            first.get_or_insert(now);
            last = now;
            tokens += d.tokens.len();
        }
    }
    let first = first.context("the generation produced no token")?;
    Ok(Timed {
        prompt,
        ttft: first - start,
        decode: last - first,
        tokens,
    })
}

impl Remote {
    /// Runs the benchmark against the head stage.
    pub fn run(&self, text: &TextModel, config: &BenchConfig) -> anyhow::Result<BenchReport> {
        let Some((namespace, name)) = self.shard.split_once('/') else {
            bail!("--shard {:?} is not namespace/name", self.shard);
        };
        let prompt = synthetic_prompt(text, config.prompt_tokens)?;
        let request = dp::GenerateRequest {
            shard: Some(dp::ShardRef {
                namespace: namespace.into(),
                name: name.into(),
            }),
            input: Some(dp::generate_request::Input::Tokens(dp::TokenIds {
                ids: prompt.clone(),
            })),
            sampling: Some(dp::Sampling {
                max_tokens: config.gen_tokens as u32,
                ignore_eos: true,
                ..Default::default()
            }),
            resume: None,
            grammar: None,
            tools: None,
        };
        tokio::runtime::Runtime::new()?.block_on(async {
            let client = dp::client(channel(&self.endpoint, &self.tls)?, self.token.clone());
            sweep(|| once(&client, request.clone()), config).await
        })
    }
}

/// One warm-up and `config.runs` measured runs of one generation alone,
/// each followed by every sequence count of `config.concurrency` started at
/// once: the figures of a remote bench. `once` starts one generation.
pub(super) async fn sweep<F, Fut>(once: F, config: &BenchConfig) -> anyhow::Result<BenchReport>
where
    F: Fn() -> Fut,
    Fut: std::future::Future<Output = anyhow::Result<Timed>>,
{
    let (gen_tokens, runs) = (config.gen_tokens, config.runs);
    if runs == 0 || gen_tokens < 2 {
        bail!("a benchmark needs at least 1 run and 2 generated tokens");
    }
    let (mut prefill, mut decode, mut ttft) = (Vec::new(), Vec::new(), Vec::new());
    let mut concurrent = ConcurrentRuns::sweep(&config.concurrency);
    for run in 0..=runs {
        let t = once().await?;
        if t.tokens != gen_tokens {
            bail!("asked for {gen_tokens} tokens, got {}", t.tokens);
        }
        for measured in &mut concurrent {
            let start = Instant::now();
            let all =
                futures::future::try_join_all((0..measured.sequences).map(|_| once())).await?;
            let tokens: usize = all.iter().map(|t| t.tokens).sum();
            let rate = tokens as f64 / start.elapsed().as_secs_f64();
            let inter: Vec<f64> = all
                .iter()
                .map(|t| t.decode.as_secs_f64() * 1e3 / (t.tokens.max(2) - 1) as f64)
                .collect();
            let first: Vec<f64> = all.iter().map(|t| t.ttft.as_secs_f64() * 1e3).collect();
            if run > 0 {
                measured.add(rate, &inter, &first);
            }
        }
        if run == 0 {
            continue; // warm-up
        }
        prefill.push(t.prompt as f64 / t.ttft.as_secs_f64());
        decode.push((t.tokens - 1) as f64 / t.decode.as_secs_f64());
        ttft.push(t.ttft.as_secs_f64() * 1e3);
    }
    let concurrent = concurrent
        .into_iter()
        .map(ConcurrentRuns::figures)
        .collect();
    Ok(BenchReport::from_runs(prefill, decode, ttft, concurrent))
}
