//! The `shardplane` command line: one binary, one subcommand per component.
//!
//! Layout: `lib.rs` holds the argument tree; each subcommand lives in its own
//! module under `commands/` and calls into the component crates.

mod commands;

use std::process::ExitCode;

use clap::{Parser, Subcommand};

/// A Kubernetes-style control plane for LLM inference across Apple Silicon Macs
/// and Linux machines.
#[derive(Parser, Debug)]
#[command(name = "shardplane", version, about, long_about = None)]
pub struct Cli {
    #[command(subcommand)]
    command: Command,
}

// Parsed once at start-up: the size of the largest variant does not matter.
#[allow(clippy::large_enum_variant)]
#[derive(Subcommand, Debug)]
enum Command {
    /// Print every CustomResourceDefinition of the shardplane.dev API as YAML,
    /// or write one file per CRD into a directory.
    Crds(commands::crds::CrdsArgs),
    /// Generate text with a model on this machine, optionally split into
    /// stages that pass hidden states as they would across machines.
    Generate(commands::generate::GenerateArgs),
    /// Measure prefill and decode speed; prints a report (JSON with --json).
    Bench(commands::bench::BenchArgs),
    /// Convert a GGUF model to the MLX-community safetensors layout (the
    /// `mlx` engine and MLX's own tools read it).
    Convert(commands::convert::ConvertArgs),
    /// Run the operator: resolve models, track nodes and pools, place
    /// deployments as Shards.
    Operator(commands::operator::OperatorArgs),
    /// Run the node agent: register this machine, renew its Lease, run the
    /// Shards bound to it.
    Agent(commands::agent::AgentArgs),
    /// Run the gateway: one OpenAI-, Anthropic- and Ollama-compatible
    /// endpoint routing to ready instances.
    Gateway(commands::gateway::GatewayArgs),
    /// Write a kubeconfig for node agents off the cluster, with a token of the
    /// agents' ServiceAccount (the Helm chart creates it).
    AgentKubeconfig(commands::agent_kubeconfig::AgentKubeconfigArgs),
    /// Bring up a local cluster on this machine from a checkout: control
    /// plane, operator, gateway and agents serving the quickstart; Ctrl-C
    /// stops it all.
    Up(commands::up::UpArgs),
    /// Show the cluster on one screen: nodes (memory, links, cached models)
    /// and each deployment's instances and stages, with download progress.
    Status(commands::status::StatusArgs),
    /// One follower rank of a tensor group led by another shardplane
    /// process (started by `--tensor-processes`; not for people).
    #[command(hide = true)]
    TensorRank(commands::tensor::TensorRankArgs),
}

impl Command {
    /// Long-running components log what they do; tools only warnings.
    fn default_log(&self) -> &'static str {
        match self {
            Command::Operator(_) | Command::Agent(_) | Command::Gateway(_) => "info,kube=warn",
            Command::Up(_) => "warn,kube_client=error",
            _ => "warn",
        }
    }
}

impl Cli {
    /// Parses the process arguments and runs the chosen subcommand.
    pub fn parse_and_run() -> ExitCode {
        if let Err(missing) = processor_has_what_the_build_uses() {
            eprintln!(
                "error: this shardplane was built for x86-64 processors with {missing} \
                 (x86-64-v3: Intel Haswell, AMD Zen and later); rebuild it for this one with \
                 RUSTFLAGS=\"-C target-cpu=native\""
            );
            return ExitCode::FAILURE;
        }
        let cli = Cli::parse();
        tracing_subscriber::fmt()
            .with_env_filter(
                tracing_subscriber::EnvFilter::try_from_default_env()
                    .unwrap_or_else(|_| cli.command.default_log().into()),
            )
            .with_writer(std::io::stderr)
            .init();
        let result = match cli.command {
            Command::Crds(args) => commands::crds::run(args),
            Command::Generate(args) => commands::generate::run(args),
            Command::Bench(args) => commands::bench::run(args),
            Command::Convert(args) => commands::convert::run(args),
            Command::Operator(args) => commands::operator::run(args),
            Command::Agent(args) => commands::agent::run(args),
            Command::Gateway(args) => commands::gateway::run(args),
            Command::AgentKubeconfig(args) => commands::agent_kubeconfig::run(args),
            Command::Up(args) => commands::up::run(args),
            Command::Status(args) => commands::status::run(args),
            Command::TensorRank(args) => commands::tensor::run_rank(args),
        };
        match result {
            Ok(()) => ExitCode::SUCCESS,
            Err(e) => {
                eprintln!("error: {e:#}");
                ExitCode::FAILURE
            }
        }
    }
}

/// Whether this processor has the instructions the build was compiled to use
/// (`.cargo/config.toml` targets x86-64-v3 on x86-64); the missing ones.
fn processor_has_what_the_build_uses() -> Result<(), &'static str> {
    #[cfg(all(target_arch = "x86_64", target_feature = "avx2"))]
    {
        if !std::arch::is_x86_feature_detected!("avx2")
            || !std::arch::is_x86_feature_detected!("fma")
            || !std::arch::is_x86_feature_detected!("f16c")
        {
            return Err("AVX2, FMA and F16C");
        }
    }
    Ok(())
}
