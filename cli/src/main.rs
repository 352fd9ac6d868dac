//! The `shardplane` binary: parses arguments and hands over to the libraries.

fn main() -> std::process::ExitCode {
    shardplane::Cli::parse_and_run()
}
