//! How many threads the compute engines use.
//!
//! candle sizes its thread pools from `RAYON_NUM_THREADS` when they first
//! start, and its pools spin while they wait for each other. Processes that
//! share a machine must divide its cores between them: two agents whose
//! pools together outnumber the cores wait out the scheduler at every
//! matrix product (measured here: a 33-token prefill took 0.85–1.6 s
//! instead of about 0.15 s while a second agent computed).

use std::os::unix::process::CommandExt;

use anyhow::Context;

/// The variable the compute pools read their size from.
pub const VARIABLE: &str = "RAYON_NUM_THREADS";

/// Makes this process compute with `threads` threads: when the variable does
/// not say so yet, the process replaces itself with the same command and the
/// variable set (the pools read it once, at their start). Returns when the
/// process already runs that way.
pub fn use_threads(threads: Option<usize>) -> anyhow::Result<()> {
    let Some(threads) = threads else {
        return Ok(());
    };
    anyhow::ensure!(threads > 0, "--threads must be at least 1");
    let wanted = threads.to_string();
    if std::env::var(VARIABLE).ok().as_deref() == Some(wanted.as_str()) {
        return Ok(());
    }
    let error = std::process::Command::new(std::env::current_exe()?)
        .args(std::env::args_os().skip(1))
        .env(VARIABLE, &wanted)
        .exec();
    Err(error).context("cannot restart with the thread count set")
}

/// The threads each of `processes` compute processes on this machine should
/// use so that together they do not outnumber its cores.
pub fn share(processes: usize) -> usize {
    let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
    (cores / processes.max(1)).max(1)
}
