//! `shardplane bench`: prefill and decode speed of a model on this machine.

use anyhow::Context;
use clap::Args;
use serde::Serialize;
use shardplane_engine::bench::{self, BenchConfig, BenchReport};

use super::model_args::ModelArgs;

/// Options of `shardplane bench`.
#[derive(Args, Debug)]
pub struct BenchArgs {
    #[command(flatten)]
    model: ModelArgs,
    /// Tokens in the prompt.
    #[arg(long, default_value_t = 41)]
    prompt_tokens: usize,
    /// Tokens to generate per run (end-of-sequence is banned).
    #[arg(long, default_value_t = 64)]
    gen_tokens: usize,
    /// Counted runs, after one warm-up run.
    #[arg(long, default_value_t = 5)]
    runs: usize,
    /// Also decode this many sequences together and report their aggregate
    /// rate, inter-token and first-token times; a list (`1,8,32`) sweeps.
    #[arg(long, value_delimiter = ',', default_value = "1", value_parser = clap::value_parser!(u32).range(1..=4096))]
    concurrency: Vec<u32>,
    /// Also decode under the JSON Schema in this file, in the same runs, and
    /// report its rate and compile time beside the unconstrained ones.
    #[arg(long, conflicts_with_all = ["endpoint", "copy_from", "gateway"])]
    json_schema: Option<std::path::PathBuf>,
    /// Sample at this temperature instead of greedily (in one process; the
    /// cost of sampling a whole vocabulary shows in the decode rates).
    #[arg(long, default_value_t = 0.0, conflicts_with_all = ["endpoint", "copy_from", "gateway"])]
    temperature: f32,
    /// Nucleus sampling's probability mass (with `--temperature` above 0).
    #[arg(long, conflicts_with_all = ["endpoint", "copy_from", "gateway"])]
    top_p: Option<f32>,
    /// Compute threads (sets RAYON_NUM_THREADS for the measurement; with
    /// `--tensor-processes`, shared out among the rank processes).
    #[arg(long)]
    threads: Option<usize>,
    /// Print JSON instead of a table.
    #[arg(long)]
    json: bool,
    /// Measure a running pipeline instead: the data-plane endpoint of its head
    /// stage (`host:port`); `--model` is then only read for its tokenizer.
    #[arg(long, requires_all = ["shard", "token_file"])]
    endpoint: Option<String>,
    /// The head Shard to measure, `namespace/name` (with `--endpoint`).
    #[arg(long)]
    shard: Option<String>,
    /// Measure through this gateway (`http://host:port`) instead, as its
    /// clients see it (OpenAI completions, streamed); `--model` is then only
    /// read for its tokenizer. With `--endpoint`: time only the first token,
    /// through the gateway and straight to the head stage alternately (the
    /// gateway's overhead).
    #[arg(long, requires = "gateway_model", conflicts_with = "copy_from")]
    gateway: Option<String>,
    /// The model name to ask the gateway for (with `--gateway`).
    #[arg(long, requires = "gateway")]
    gateway_model: Option<String>,
    /// The gateway's API key (with `--gateway`).
    #[arg(long, env = "SHARDPLANE_API_KEY")]
    api_key: Option<String>,
    /// Measure a peer copy instead: copy the cached model `--copy-key` from
    /// the agent whose data plane is at this endpoint into `--copy-to`.
    #[arg(long, requires_all = ["copy_key", "copy_to", "token_file"], conflicts_with = "endpoint")]
    copy_from: Option<String>,
    /// The cache key of the model to copy (with `--copy-from`).
    #[arg(long)]
    copy_key: Option<String>,
    /// An empty directory to copy into (with `--copy-from`).
    #[arg(long)]
    copy_to: Option<std::path::PathBuf>,
    /// Measure the tensor group's all-reduce alone instead: one sum of this
    /// many f32 values (a decode step's hidden state: the model's width)
    /// across `--tensor` ranks joined over loopback, `--runs` × 100 times.
    #[arg(long, conflicts_with_all = ["endpoint", "copy_from", "json_schema"])]
    all_reduce_values: Option<usize>,
    /// The data-plane token file (with `--endpoint` or `--copy-from`).
    #[arg(long, env = "SHARDPLANE_DATA_PLANE_TOKEN_FILE")]
    token_file: Option<std::path::PathBuf>,
    #[command(flatten)]
    remote_tls: super::tls_args::RemoteTls,
}

#[derive(Serialize)]
struct Report<'a> {
    engine: &'a str,
    model: String,
    stages: Vec<String>,
    /// Ranks of each stage's tensor group (1: not split).
    tensor_ranks: usize,
    threads: usize,
    prompt_tokens: usize,
    generated_tokens: usize,
    runs: usize,
    concurrency: Vec<usize>,
    /// The sampling every run used (0: greedy).
    temperature: f32,
    top_p: Option<f32>,
    #[serde(flatten)]
    figures: BenchReport,
    peak_rss_bytes: Option<u64>,
    load_average_before: Option<f64>,
    load_average_after: Option<f64>,
}

/// Checks the sampling options before anything is loaded: a top_p needs a
/// temperature to act on.
fn sampling(args: &BenchArgs) -> anyhow::Result<()> {
    let params = shardplane_engine::sampler::SamplingParams {
        temperature: args.temperature,
        top_p: args.top_p,
        ..Default::default()
    };
    params.validate().map_err(|e| anyhow::anyhow!("{e}"))?;
    if args.top_p.is_some() && args.temperature == 0.0 {
        anyhow::bail!(
            "--top-p acts only when sampling: give --temperature above 0 (at 0 every run is greedy)"
        );
    }
    Ok(())
}

/// Runs the benchmark and prints the report.
pub fn run(args: BenchArgs) -> anyhow::Result<()> {
    if let Some(endpoint) = &args.copy_from {
        return copy(&args, endpoint);
    }
    sampling(&args)?;
    args.model.use_threads(args.threads)?;
    if let Some(values) = args.all_reduce_values {
        let ranks = args.model.tensor_ranks()?;
        let micros = super::tensor::all_reduce_micros(ranks, values, args.runs * 100)?;
        println!(
            "{}",
            serde_json::to_string_pretty(&serde_json::json!({
                "ranks": ranks,
                "values": values,
                "all_reduce_us": micros,
            }))?
        );
        return Ok(());
    }
    let concurrency: Vec<usize> = args.concurrency.iter().map(|&n| n as usize).collect();
    let load_before = load_average();
    let config = BenchConfig {
        prompt_tokens: args.prompt_tokens,
        gen_tokens: args.gen_tokens,
        runs: args.runs,
        concurrency: concurrency.clone(),
        grammar: match &args.json_schema {
            Some(path) => {
                let text = std::fs::read_to_string(path)
                    .with_context(|| format!("reading {}", path.display()))?;
                Some(shardplane_engine::constraint::Grammar::JsonSchema(
                    serde_json::from_str(&text)
                        .with_context(|| format!("{} is not JSON", path.display()))?,
                ))
            }
            None => None,
        },
        temperature: args.temperature,
        top_p: args.top_p,
    };
    let gateway = args
        .gateway
        .as_ref()
        .map(|url| super::bench_gateway::Gateway {
            url: url.clone(),
            model: args.gateway_model.clone().unwrap_or_default(),
            api_key: args.api_key.clone(),
        });
    let (figures, stages) = if let Some(endpoint) = &args.endpoint {
        let text = tokenizer_model(&args)?;
        let token_file = args.token_file.as_deref().context("--token-file")?;
        let remote = super::bench_remote::Remote {
            endpoint: endpoint.clone(),
            shard: args.shard.clone().context("--shard")?,
            token: shardplane_dataplane::Token::from_file(token_file)
                .map_err(anyhow::Error::msg)?,
            tls: args.remote_tls.load()?,
        };
        if let Some(gateway) = &gateway {
            let report = gateway.overhead(&remote, args.runs)?;
            println!("{}", serde_json::to_string_pretty(&report)?);
            return Ok(());
        }
        let figures = remote.run(&text, &config)?;
        (figures, vec![format!("remote {endpoint} {}", remote.shard)])
    } else if let Some(gateway) = &gateway {
        let text = tokenizer_model(&args)?;
        let figures = gateway.run(&text, &config)?;
        (
            figures,
            vec![format!("gateway {} {}", gateway.url, gateway.model)],
        )
    } else {
        let (mut pipeline, text) = args.model.load()?;
        let figures = bench::run(&mut pipeline, &text, &config)?;
        let stages = pipeline
            .stages()
            .iter()
            .map(|s| format!("{}-{}", s.layout().layers.start, s.layout().layers.end - 1))
            .collect();
        (figures, stages)
    };
    let report = Report {
        engine: &args.model.engine,
        model: args.model.path()?.display().to_string(),
        stages,
        tensor_ranks: args.model.tensor_ranks()?,
        threads: std::env::var("RAYON_NUM_THREADS")
            .ok()
            .and_then(|t| t.parse().ok())
            .unwrap_or_else(|| std::thread::available_parallelism().map_or(1, |n| n.get())),
        prompt_tokens: args.prompt_tokens,
        generated_tokens: args.gen_tokens,
        runs: args.runs,
        concurrency,
        temperature: args.temperature,
        top_p: args.top_p,
        figures,
        peak_rss_bytes: peak_rss_bytes(),
        load_average_before: load_before,
        load_average_after: load_average(),
    };
    if args.json {
        println!("{}", serde_json::to_string_pretty(&report)?);
    } else {
        let f = &report.figures;
        println!(
            "engine {} stages {:?} tensor {} threads {} prompt {} gen {} runs {}",
            report.engine,
            report.stages,
            report.tensor_ranks,
            report.threads,
            report.prompt_tokens,
            report.generated_tokens,
            report.runs
        );
        if report.temperature > 0.0 {
            println!(
                "sampling at temperature {}, top_p {}",
                report.temperature,
                report.top_p.map_or("none".to_string(), |p| p.to_string())
            );
        }
        println!(
            "prefill tok/s median {:.1} (min {:.1} max {:.1})",
            f.prefill_tokens_per_second.median,
            f.prefill_tokens_per_second.min,
            f.prefill_tokens_per_second.max
        );
        println!(
            "decode  tok/s median {:.1} (min {:.1} max {:.1})",
            f.decode_tokens_per_second.median,
            f.decode_tokens_per_second.min,
            f.decode_tokens_per_second.max
        );
        println!("ttft ms median {:.1}", f.time_to_first_token_ms.median);
        for c in &f.concurrent {
            println!(
                "{} sequences together: decode tok/s median {:.1}, inter-token ms p50 {:.1} p99 {:.1}, first token ms p50 {:.1} p99 {:.1}",
                c.sequences,
                c.decode_tokens_per_second.median,
                c.inter_token_ms.p50,
                c.inter_token_ms.p99,
                c.time_to_first_token_ms.p50,
                c.time_to_first_token_ms.p99
            );
        }
        if let Some(c) = &f.constrained {
            println!(
                "under the JSON Schema: decode tok/s median {:.1} ({:.2}x unconstrained), {:.0} tokens, compile ms median {:.1}",
                c.decode_tokens_per_second.median,
                c.decode_tokens_per_second.median / f.decode_tokens_per_second.median,
                c.generated_tokens.median,
                c.compile_ms.median
            );
        }
        println!(
            "peak RSS {} MiB, load average {:?} -> {:?}",
            report.peak_rss_bytes.unwrap_or(0) >> 20,
            report.load_average_before,
            report.load_average_after
        );
    }
    Ok(())
}

/// The model's tokenizer and template alone, for a bench of a running
/// deployment (`--endpoint`, `--gateway`).
fn tokenizer_model(args: &BenchArgs) -> anyhow::Result<shardplane_engine::pipeline::TextModel> {
    let file = shardplane_engine::gguf::GgufFile::open(args.model.path()?)?;
    Ok(shardplane_engine::pipeline::TextModel::from_gguf(&file)?)
}

/// The process's peak resident memory (Linux `VmHWM`).
fn peak_rss_bytes() -> Option<u64> {
    let status = std::fs::read_to_string("/proc/self/status").ok()?;
    let line = status.lines().find(|l| l.starts_with("VmHWM:"))?;
    let kib: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
    Some(kib * 1024)
}

/// The one-minute load average (Linux).
fn load_average() -> Option<f64> {
    std::fs::read_to_string("/proc/loadavg")
        .ok()?
        .split_whitespace()
        .next()?
        .parse()
        .ok()
}

#[derive(Serialize)]
struct CopyReport {
    bytes: u64,
    runs: usize,
    seconds: bench::Spread,
    gigabytes_per_second: bench::Spread,
}

/// Times peer copies of one cached model into a fresh cache, `runs` times.
fn copy(args: &BenchArgs, endpoint: &str) -> anyhow::Result<()> {
    let key = args.copy_key.clone().context("--copy-key")?;
    let dir = args.copy_to.clone().context("--copy-to")?;
    let token =
        shardplane_dataplane::Token::from_file(args.token_file.as_deref().context("--token-file")?)
            .map_err(anyhow::Error::msg)?;
    tokio::runtime::Runtime::new()?.block_on(async {
        let client = shardplane_dataplane::client(
            super::bench_remote::channel(endpoint, &args.remote_tls.load()?)?,
            token,
        );
        // The size, from the first chunk of the file.
        let mut probe = client
            .clone()
            .read_blob(shardplane_dataplane::ReadBlobRequest {
                key: key.clone(),
                offset: 0,
                length: 1,
            })
            .await?
            .into_inner();
        let size = probe.message().await?.context("empty answer")?.size;
        let (mut seconds, mut rates) = (Vec::new(), Vec::new());
        for run in 0..=args.runs {
            let _ = std::fs::remove_dir_all(&dir);
            let cache = shardplane_agent::cache::Cache::new(dir.clone(), reqwest_client()?)?;
            let start = std::time::Instant::now();
            cache
                .fetch_from_peer(&client, endpoint, &key, size, None, |_| {})
                .await
                .map_err(|f| anyhow::anyhow!("{}: {}", f.reason, f.message))?;
            // Hashing the copy is part of every copy; it is timed too.
            let secs = start.elapsed().as_secs_f64();
            if run > 0 {
                seconds.push(secs);
                rates.push(size as f64 / secs / 1e9);
            }
        }
        let _ = std::fs::remove_dir_all(&dir);
        let report = CopyReport {
            bytes: size,
            runs: args.runs,
            seconds: bench::Spread::of(seconds),
            gigabytes_per_second: bench::Spread::of(rates),
        };
        println!("{}", serde_json::to_string_pretty(&report)?);
        Ok(())
    })
}

fn reqwest_client() -> anyhow::Result<reqwest::Client> {
    shardplane_models::http_client().map_err(anyhow::Error::msg)
}
