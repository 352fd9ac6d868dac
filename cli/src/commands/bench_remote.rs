//! `shardplane bench --endpoint`: the same figures as the in-process bench,
//! measured by a client of a head stage's data plane (the whole pipeline of
//! agents, its hops and the client's own overhead included).

use std::time::{Duration, Instant};

use anyhow::{Context, bail};
use shardplane_dataplane as dp;
use shardplane_engine::bench::{BenchReport, ConcurrentRuns, Spread, synthetic_prompt};
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
        concurrency: &[usize],
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
            resume: None,
            grammar: None,
            tools: None,
        };
        tokio::runtime::Runtime::new()?.block_on(async {
            let client = dp::client(
                dp::channel(&self.endpoint).map_err(anyhow::Error::msg)?,
                self.token.clone(),
            );
            let (mut prefill, mut decode, mut ttft) = (Vec::new(), Vec::new(), Vec::new());
            let mut concurrent = ConcurrentRuns::sweep(concurrency);
            for run in 0..=runs {
                let t = once(&client, request.clone()).await?;
                if t.tokens != gen_tokens {
                    bail!("asked for {gen_tokens} tokens, got {}", t.tokens);
                }
                for measured in &mut concurrent {
                    let start = Instant::now();
                    let all = futures::future::try_join_all(
                        (0..measured.sequences).map(|_| once(&client, request.clone())),
                    )
                    .await?;
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
                prefill.push(prompt.len() as f64 / t.ttft.as_secs_f64());
                decode.push((t.tokens - 1) as f64 / t.decode.as_secs_f64());
                ttft.push(t.ttft.as_secs_f64() * 1e3);
            }
            let concurrent = concurrent
                .into_iter()
                .map(ConcurrentRuns::figures)
                .collect();
            Ok(BenchReport::from_runs(prefill, decode, ttft, concurrent))
        })
    }
}

/// Time to first token through the gateway against straight to the head
/// stage, measured alternately by the same client: the gateway's overhead.
pub struct GatewayOverhead {
    /// The gateway's base URL (`http://host:port`).
    pub gateway: String,
    /// The model name to ask the gateway for.
    pub model: String,
    /// The API key, if the gateway wants one.
    pub api_key: Option<String>,
}

/// Milliseconds to the first token, direct and through the gateway, paired.
#[derive(serde::Serialize)]
pub struct OverheadReport {
    /// Requests per path (after one warm-up each).
    pub runs: usize,
    /// Straight to the head stage over the data plane.
    pub direct_ttft_ms: Spread,
    /// Through the gateway's OpenAI completions API (streaming).
    pub gateway_ttft_ms: Spread,
    /// Gateway minus direct, per pair.
    pub overhead_ms: Spread,
}

impl GatewayOverhead {
    /// Runs `runs` pairs.
    pub fn run(&self, remote: &Remote, runs: usize) -> anyhow::Result<OverheadReport> {
        let Some((namespace, name)) = remote.shard.split_once('/') else {
            bail!("--shard {:?} is not namespace/name", remote.shard);
        };
        // A two-token prompt, so prefill is short and the difference shows.
        let question = "Hello";
        let direct_request = dp::GenerateRequest {
            shard: Some(dp::ShardRef {
                namespace: namespace.into(),
                name: name.into(),
            }),
            input: Some(dp::generate_request::Input::Prompt(question.into())),
            sampling: Some(dp::Sampling {
                max_tokens: 2,
                ignore_eos: true,
                ..Default::default()
            }),
            resume: None,
            grammar: None,
            tools: None,
        };
        let body = serde_json::json!({
            "model": self.model,
            "prompt": question,
            "max_tokens": 2,
            "temperature": 0,
            "stream": true,
        })
        .to_string();
        tokio::runtime::Runtime::new()?.block_on(async {
            let client = dp::client(
                dp::channel(&remote.endpoint).map_err(anyhow::Error::msg)?,
                remote.token.clone(),
            );
            let http = shardplane_models::http_client().map_err(anyhow::Error::msg)?;
            let url = format!("{}/v1/completions", self.gateway.trim_end_matches('/'));
            let (mut direct, mut via, mut overhead) = (Vec::new(), Vec::new(), Vec::new());
            for run in 0..=runs {
                let d = once(&client, direct_request.clone()).await?.ttft;
                let start = Instant::now();
                let mut request = http
                    .post(&url)
                    .header("content-type", "application/json")
                    .body(body.clone());
                if let Some(k) = &self.api_key {
                    request = request.bearer_auth(k);
                }
                let response = request.send().await?;
                if !response.status().is_success() {
                    bail!("{url}: HTTP {}", response.status());
                }
                let mut stream = response.bytes_stream();
                let mut seen = String::new();
                let mut first = None;
                while let Some(chunk) = futures::StreamExt::next(&mut stream).await {
                    seen.push_str(&String::from_utf8_lossy(&chunk?));
                    // The first chunk carrying text.
                    if first.is_none() && seen.contains("\"text\":\"") {
                        first = Some(start.elapsed());
                    }
                }
                let g = first.context("the gateway streamed no content")?;
                if run == 0 {
                    continue;
                }
                direct.push(d.as_secs_f64() * 1e3);
                via.push(g.as_secs_f64() * 1e3);
                overhead.push((g.as_secs_f64() - d.as_secs_f64()) * 1e3);
            }
            Ok(OverheadReport {
                runs,
                direct_ttft_ms: Spread::of(direct),
                gateway_ttft_ms: Spread::of(via),
                overhead_ms: Spread::of(overhead),
            })
        })
    }
}
