//! `shardplane bench --endpoint`: the same figures as the in-process bench,
//! measured by a client of a head stage's data plane (the whole pipeline of
//! agents, its hops and the client's own overhead included).

use std::time::{Duration, Instant};

use anyhow::{Context, bail};
use shardplane_dataplane as dp;
use shardplane_engine::bench::{BenchReport, Spread, synthetic_prompt};
use shardplane_engine::pipeline::TextModel;

/// One generation as the client saw it.
struct Timed {
    ttft: Duration,
    decode: Duration,
    tokens: usize,
}

/// Where and what to measure.
pub struct Remote {
    /// The head stage's data-plane endpoint.
    pub endpoint: String,
    /// The head Shard, `namespace/name`.
    pub shard: String,
    /// The data-plane token.
    pub token: dp::Token,
}

async fn once(client: &dp::Client, req: dp::GenerateRequest) -> anyhow::Result<Timed> {
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
        ttft: first - start,
        decode: last - first,
        tokens,
    })
}

impl Remote {
    /// Runs the benchmark against the head stage.
    pub fn run(
        &self,
        text: &TextModel,
        prompt_tokens: usize,
        gen_tokens: usize,
        runs: usize,
        concurrency: usize,
    ) -> anyhow::Result<BenchReport> {
        if runs == 0 || gen_tokens < 2 {
            bail!("a benchmark needs at least 1 run and 2 generated tokens");
        }
        let Some((namespace, name)) = self.shard.split_once('/') else {
            bail!("--shard {:?} is not namespace/name", self.shard);
        };
        let prompt = synthetic_prompt(text, prompt_tokens)?;
        let request = dp::GenerateRequest {
            shard: Some(dp::ShardRef {
                namespace: namespace.into(),
                name: name.into(),
            }),
            input: Some(dp::generate_request::Input::Tokens(dp::TokenIds {
                ids: prompt.clone(),
            })),
            sampling: Some(dp::Sampling {
                max_tokens: gen_tokens as u32,
                ignore_eos: true,
                ..Default::default()
            }),
        };
        tokio::runtime::Runtime::new()?.block_on(async {
            let client = dp::client(
                dp::channel(&self.endpoint).map_err(anyhow::Error::msg)?,
                self.token.clone(),
            );
            let (mut prefill, mut decode, mut ttft, mut concurrent) =
                (Vec::new(), Vec::new(), Vec::new(), Vec::new());
            for run in 0..=runs {
                let t = once(&client, request.clone()).await?;
                if t.tokens != gen_tokens {
                    bail!("asked for {gen_tokens} tokens, got {}", t.tokens);
                }
                let rate = if concurrency > 1 {
                    let start = Instant::now();
                    let all = futures::future::try_join_all(
                        (0..concurrency).map(|_| once(&client, request.clone())),
                    )
                    .await?;
                    let n: usize = all.iter().map(|t| t.tokens).sum();
                    Some(n as f64 / start.elapsed().as_secs_f64())
                } else {
                    None
                };
                if run == 0 {
                    continue; // warm-up
                }
                prefill.push(prompt.len() as f64 / t.ttft.as_secs_f64());
                decode.push((t.tokens - 1) as f64 / t.decode.as_secs_f64());
                ttft.push(t.ttft.as_secs_f64() * 1e3);
                concurrent.extend(rate);
            }
            Ok(BenchReport {
                prefill_tokens_per_second: Spread::of(prefill),
                decode_tokens_per_second: Spread::of(decode),
                time_to_first_token_ms: Spread::of(ttft),
                concurrent_decode_tokens_per_second: (!concurrent.is_empty())
                    .then(|| Spread::of(concurrent)),
            })
        })
    }
}
