//! Tensor groups on this machine: the ranks of a stage loaded with their
//! shares and joined over loopback TCP by the data plane's all-reduce, the
//! same collective ranks on separate machines use — on threads of this
//! process, or (`--tensor-processes`) in processes of their own.
//!
//! ```text
//!  TensorSplit (engine) ──► shares ─┐
//!  Mesh::loopback(n) ─────► meshes ─┴─► CandleStage::load_group ─► one Stage
//!
//!  leader ──spawn──► shardplane tensor-rank --rank k   (loads its share)
//!         ◄─stdout── listening 127.0.0.1:PORT
//!         ──stdin──► token, every rank's address       (then all join)
//!         ══mesh══► commands; replies ◄══               (until the leader leaves)
//! ```

use std::io::{BufRead, BufReader, Write};
use std::net::{SocketAddr, TcpListener};
use std::path::Path;
use std::process::{Child, Stdio};
use std::time::{Duration, Instant};

use anyhow::Context;
use clap::Args;
use shardplane_agent::tensor::{MeshFollowers, SharedMesh, follow};
use shardplane_dataplane::Token;
use shardplane_dataplane::collective::{Mesh, MeshConfig};
use shardplane_engine::bench::Spread;
use shardplane_engine::candle::CandleStage;
use shardplane_engine::config::read_dir_config;
use shardplane_engine::gguf::GgufFile;
use shardplane_engine::tensor::{
    AllReduce, Command, Followers, Reply, TensorGroup, TensorRank, TensorSplit,
};
use shardplane_engine::{LoadOptions, ModelConfig, Stage, StageLayout};

use super::model_args::ModelArgs;

/// The longest a rank waits for the others (to join, or for a step's
/// partial sums).
const RANK_TIMEOUT: Duration = Duration::from_secs(60);

/// Loads stage `layout` of the model at `path` as a tensor group of
/// `weights.len()` ranks with shares in proportion to `weights`.
pub fn load_group(
    path: &Path,
    config: &ModelConfig,
    layout: StageLayout,
    options: &LoadOptions,
    weights: &[f64],
) -> anyhow::Result<Box<dyn Stage>> {
    let split = TensorSplit::weighted(config, weights)?;
    let meshes = Mesh::loopback(weights.len(), &Token::random()?, RANK_TIMEOUT)
        .context("cannot join the tensor group's ranks over loopback")?;
    let group = CandleStage::load_group(path, layout, options, &split, collectives(meshes))
        .with_context(|| format!("cannot load a tensor group of {}", path.display()))?;
    Ok(Box::new(group))
}

/// Each mesh as an engine collective.
pub fn collectives(meshes: Vec<Mesh>) -> Vec<Box<dyn AllReduce>> {
    meshes
        .into_iter()
        .map(|mut mesh| {
            Box::new(move |values: &mut [f32]| mesh.all_reduce(values).map_err(|e| e.to_string()))
                as Box<dyn AllReduce>
        })
        .collect()
}

/// The time of one all-reduce of `values` f32 values across `ranks` ranks
/// joined over loopback, in microseconds (as rank 0 sees it), over `rounds`
/// rounds after ten unmeasured ones.
pub fn all_reduce_micros(ranks: usize, values: usize, rounds: usize) -> anyhow::Result<Spread> {
    anyhow::ensure!(ranks >= 2, "an all-reduce needs --tensor 2 or more");
    anyhow::ensure!(rounds > 0, "at least one run");
    let meshes = Mesh::loopback(ranks, &Token::random()?, RANK_TIMEOUT)?;
    let timings = std::thread::scope(|s| {
        let running: Vec<_> = meshes
            .into_iter()
            .map(|mut mesh| {
                s.spawn(move || -> anyhow::Result<Vec<f64>> {
                    let mut buffer = vec![1.0f32; values];
                    let mut times = Vec::with_capacity(rounds);
                    for round in 0..rounds + 10 {
                        let start = std::time::Instant::now();
                        mesh.all_reduce(&mut buffer)?;
                        if round >= 10 {
                            times.push(start.elapsed().as_secs_f64() * 1e6);
                        }
                        buffer.fill(1.0);
                    }
                    Ok(times)
                })
            })
            .collect();
        running
            .into_iter()
            .map(|r| r.join().expect("a rank does not panic"))
            .collect::<anyhow::Result<Vec<_>>>()
    })?;
    Ok(Spread::of(timings.into_iter().next().unwrap_or_default()))
}

/// Followers in processes of their own, reached through rank 0's mesh.
struct Processes {
    followers: MeshFollowers,
    children: Vec<Child>,
}

impl Followers for Processes {
    fn count(&self) -> usize {
        self.followers.count()
    }

    fn start(&mut self, command: &Command) {
        self.followers.start(command);
    }

    fn finish(&mut self) -> Vec<Reply> {
        self.followers.finish()
    }
}

impl Drop for Processes {
    fn drop(&mut self) {
        // Closing the connections ends the followers' loops.
        self.followers.close();
        let deadline = Instant::now() + Duration::from_secs(5);
        for child in &mut self.children {
            while matches!(child.try_wait(), Ok(None)) && Instant::now() < deadline {
                std::thread::sleep(Duration::from_millis(20));
            }
            let _ = child.kill();
            let _ = child.wait();
        }
    }
}

/// Loads stage `layout` as a tensor group whose ranks 1 and up run in
/// processes of their own (`shardplane tensor-rank`), joined over loopback.
pub fn load_group_processes(
    args: &ModelArgs,
    config: &ModelConfig,
    layout: StageLayout,
    weights: &[f64],
) -> anyhow::Result<Box<dyn Stage>> {
    let path = args.path()?;
    let split = TensorSplit::weighted(config, weights)?;
    let spec = weights
        .iter()
        .map(f64::to_string)
        .collect::<Vec<_>>()
        .join(":");
    let layers = format!("{}-{}", layout.layers.start, layout.layers.end - 1);
    let mut children = Vec::new();
    for rank in 1..weights.len() {
        let mut command = std::process::Command::new(std::env::current_exe()?);
        command
            .args([
                "tensor-rank",
                "--rank",
                &rank.to_string(),
                "--layers",
                &layers,
            ])
            .args(["--tensor-weights", &spec, "--model"])
            .arg(path)
            .args(args.context.map(|c| format!("--context={c}")))
            .args(args.keep_quantization.then_some("--keep-quantization"))
            .args(args.dequantize.then_some("--dequantize"))
            .args(args.kv_f32.then_some("--kv-f32"))
            .stdin(Stdio::piped())
            .stdout(Stdio::piped());
        children.push(
            command
                .spawn()
                .context("cannot start a tensor rank's process")?,
        );
    }
    let listener = TcpListener::bind(("127.0.0.1", 0))?;
    let mesh = SharedMesh::default();
    let rank = TensorRank {
        share: split.shares()[0].clone(),
        collective: mesh.collective(),
    };
    let leader = CandleStage::load_rank(path, layout, &args.options(), rank)?;
    let mut addresses = vec![listener.local_addr()?];
    for (i, child) in children.iter_mut().enumerate() {
        addresses.push(announced_address(child).with_context(|| format!("rank {}", i + 1))?);
    }
    let token = Token::random()?;
    let list: Vec<String> = addresses.iter().map(ToString::to_string).collect();
    for child in &mut children {
        let stdin = child.stdin.as_mut().context("a rank's stdin")?;
        writeln!(stdin, "{}\n{}", token.expose(), list.join(","))?;
    }
    let joined = Mesh::join(&listener, &group_config(0, addresses, token))?;
    mesh.set(Some(joined));
    let followers = Processes {
        followers: MeshFollowers::new(mesh, children.len() + 1),
        children,
    };
    Ok(Box::new(TensorGroup::led(
        Box::new(leader),
        Box::new(followers),
    )))
}

/// The address a rank's process prints once loaded: `listening ADDRESS`.
fn announced_address(child: &mut Child) -> anyhow::Result<SocketAddr> {
    let stdout = child.stdout.take().context("its stdout")?;
    let mut line = String::new();
    BufReader::new(stdout).read_line(&mut line)?;
    match line.trim().strip_prefix("listening ") {
        Some(address) => Ok(address.parse()?),
        None => {
            let status = child.wait()?;
            anyhow::bail!("its process ended ({status}) before it listened")
        }
    }
}

fn group_config(rank: usize, addresses: Vec<SocketAddr>, token: Token) -> MeshConfig {
    MeshConfig {
        group: "local".into(),
        rank,
        addresses,
        token,
        timeout: RANK_TIMEOUT,
        // The ranks are processes of this machine, on loopback.
        tls: None,
    }
}

/// Options of `shardplane tensor-rank`.
#[derive(Args, Debug)]
pub struct TensorRankArgs {
    #[command(flatten)]
    model: ModelArgs,
    /// This rank (1 and up; rank 0 leads).
    #[arg(long)]
    rank: usize,
    /// The layers of the stage, `first-last` (inclusive).
    #[arg(long)]
    layers: String,
}

/// One follower rank of a group led by another process: loads its share,
/// prints `listening ADDRESS`, reads the group's token and every rank's
/// address (comma-separated) from stdin, joins, then runs the leader's
/// commands until the leader leaves.
pub fn run_rank(args: TensorRankArgs) -> anyhow::Result<()> {
    let path = args.model.path()?;
    let weights = args
        .model
        .rank_weights()?
        .context("--tensor-weights is needed")?;
    let config = if path.is_dir() {
        read_dir_config(path)?.0
    } else {
        GgufFile::open(path)?.config().clone()
    };
    // The leader writes `first-last`; the layout checks it against the model.
    let range = args
        .layers
        .split_once('-')
        .and_then(|(a, b)| Some(a.parse().ok()?..b.parse::<usize>().ok()? + 1))
        .context("--layers first-last")?;
    let layout = StageLayout::new(range, config.layers)?;
    let split = TensorSplit::weighted(&config, &weights)?;
    let share = split
        .shares()
        .get(args.rank)
        .filter(|s| !s.is_leader())
        .with_context(|| format!("--rank {} of {} ranks", args.rank, weights.len()))?;
    let mesh = SharedMesh::default();
    let rank = TensorRank {
        share: share.clone(),
        collective: mesh.collective(),
    };
    let mut stage = CandleStage::load_rank(path, layout, &args.model.options(), rank)?;
    let listener = TcpListener::bind(("127.0.0.1", 0))?;
    println!("listening {}", listener.local_addr()?);
    std::io::stdout().flush()?;
    let mut lines = std::io::stdin().lock().lines();
    let token = Token::new(&lines.next().context("the group's token")??)?;
    let addresses = lines
        .next()
        .context("the ranks' addresses")??
        .split(',')
        .map(str::parse)
        .collect::<Result<Vec<SocketAddr>, _>>()?;
    mesh.set(Some(Mesh::join(
        &listener,
        &group_config(args.rank, addresses, token),
    )?));
    follow(&mut stage, &mesh)?;
    Ok(())
}
