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

#[derive(Subcommand, Debug)]
enum Command {
    /// Print every CustomResourceDefinition of the shardplane.dev API as YAML,
    /// or write one file per CRD into a directory.
    Crds(commands::crds::CrdsArgs),
}

impl Cli {
    /// Parses the process arguments and runs the chosen subcommand.
    pub fn parse_and_run() -> ExitCode {
        let cli = Cli::parse();
        let result = match cli.command {
            Command::Crds(args) => commands::crds::run(args),
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
