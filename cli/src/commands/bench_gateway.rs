//! `shardplane bench --gateway`: measured by a client of the gateway's
//! OpenAI completions API (streaming), what users of a deployment see.
//!
//! ```text
//!  --gateway alone:        sweep ──► N streams at once ──► gateway ──► instances
//!  --gateway --endpoint:   time to first token, gateway vs head stage, alternately
//! ```
//!
//! A stream's tokens are counted by the usage the gateway reports
//! (`stream_options.include_usage`); its first token is the first chunk with
//! text, its last the last such chunk. `ignore_eos` makes every answer run to
//! `--gen-tokens`.

use std::time::Instant;

use anyhow::{Context, bail};
use serde_json::Value;
use shardplane_dataplane as dp;
use shardplane_engine::bench::{BenchConfig, BenchReport, Spread, synthetic_prompt};
use shardplane_engine::pipeline::TextModel;

use super::bench_remote::{Remote, Timed, once, sweep};

/// A gateway and what to ask it for.
pub struct Gateway {
    /// The gateway's base URL (`http://host:port`).
    pub url: String,
    /// The model name to ask for.
    pub model: String,
    /// The API key, if the gateway wants one.
    pub api_key: Option<String>,
}

impl Gateway {
    /// Streams one completion of `body` and times it.
    async fn stream(&self, http: &reqwest::Client, body: &Value) -> anyhow::Result<Timed> {
        let url = format!("{}/v1/completions", self.url.trim_end_matches('/'));
        let start = Instant::now();
        let mut request = http
            .post(&url)
            .header("content-type", "application/json")
            .body(body.to_string());
        if let Some(k) = &self.api_key {
            request = request.bearer_auth(k);
        }
        let response = request.send().await?;
        if !response.status().is_success() {
            let status = response.status();
            bail!(
                "{url}: HTTP {status}: {}",
                response.text().await.unwrap_or_default()
            );
        }
        let mut body = response.bytes_stream();
        let (mut buffer, mut first, mut last) = (Vec::<u8>::new(), None, start);
        let mut usage = None;
        while let Some(chunk) = futures::StreamExt::next(&mut body).await {
            let now = Instant::now();
            buffer.extend_from_slice(&chunk?);
            while let Some(end) = buffer.iter().position(|b| *b == b'\n') {
                let line: Vec<u8> = buffer.drain(..=end).collect();
                let line = String::from_utf8_lossy(&line);
                let Some(data) = line.trim().strip_prefix("data:").map(str::trim) else {
                    continue;
                };
                if data == "[DONE]" {
                    continue;
                }
                let v: Value = serde_json::from_str(data)
                    .with_context(|| format!("{url} streamed a chunk that is not JSON: {data}"))?;
                if let Some(e) = v.get("error") {
                    bail!("{url} failed mid-answer: {e}");
                }
                if v["choices"][0]["text"]
                    .as_str()
                    .is_some_and(|t| !t.is_empty())
                {
                    first.get_or_insert(now);
                    last = now;
                }
                if v["usage"].is_object() {
                    usage = Some((
                        v["usage"]["prompt_tokens"].as_u64().unwrap_or(0) as usize,
                        v["usage"]["completion_tokens"].as_u64().unwrap_or(0) as usize,
                    ));
                }
            }
        }
        let first = first.context("the gateway streamed no text")?;
        let (prompt, tokens) = usage.context("the gateway reported no usage")?;
        Ok(Timed {
            prompt,
            ttft: first - start,
            decode: last - first,
            tokens,
        })
    }

    /// A streamed, greedy completion request for `gen_tokens` tokens.
    fn body(&self, prompt: &str, gen_tokens: usize) -> Value {
        serde_json::json!({
            "model": self.model,
            "prompt": prompt,
            "max_tokens": gen_tokens,
            "temperature": 0,
            "ignore_eos": true,
            "stream": true,
            "stream_options": {"include_usage": true},
        })
    }

    /// The bench's figures through the gateway: one stream alone, then each
    /// count of `config.concurrency` at once, in every run. The prompt is
    /// `config.prompt_tokens` of `text`'s tokenizer, as text (the gateway tokenizes
    /// it again, and its count is the one reported).
    pub fn run(&self, text: &TextModel, config: &BenchConfig) -> anyhow::Result<BenchReport> {
        let ids = synthetic_prompt(text, config.prompt_tokens)?;
        let prompt = text.tokenizer.decode(&ids, true)?;
        let body = self.body(&prompt, config.gen_tokens);
        tokio::runtime::Runtime::new()?.block_on(async {
            let http = http_client()?;
            sweep(|| self.stream(&http, &body), config).await
        })
    }

    /// Time to first token through the gateway against straight to the head
    /// stage, measured alternately by the same client, `runs` pairs after a
    /// warm-up: the gateway's overhead.
    pub fn overhead(&self, remote: &Remote, runs: usize) -> anyhow::Result<OverheadReport> {
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
        let body = self.body(question, 2);
        tokio::runtime::Runtime::new()?.block_on(async {
            let client = dp::client(
                super::bench_remote::channel(&remote.endpoint, &remote.tls)?,
                remote.token.clone(),
            );
            let http = http_client()?;
            let (mut direct, mut via, mut overhead) = (Vec::new(), Vec::new(), Vec::new());
            for run in 0..=runs {
                let d = once(&client, direct_request.clone()).await?.ttft;
                let g = self.stream(&http, &body).await?.ttft;
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

/// An HTTP client that opens a connection per request: each stream is
/// timed from its own connect, and a server closing an idle kept-alive
/// connection (llama.cpp's server does) cannot fail a run.
fn http_client() -> anyhow::Result<reqwest::Client> {
    shardplane_models::client(reqwest::Client::builder().pool_max_idle_per_host(0))
        .map_err(anyhow::Error::msg)
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
