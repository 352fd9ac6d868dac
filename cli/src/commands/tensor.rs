//! Tensor groups in one process: the ranks of a stage loaded with their
//! shares and joined over loopback TCP by the data plane's all-reduce, the
//! same collective ranks on separate machines use.
//!
//! ```text
//!  TensorSplit (engine) ──► shares ─┐
//!  Mesh::loopback(n) ─────► meshes ─┴─► CandleStage::load_group ─► one Stage
//! ```

use std::path::Path;
use std::time::Duration;

use anyhow::Context;
use shardplane_dataplane::Token;
use shardplane_dataplane::collective::Mesh;
use shardplane_engine::bench::Spread;
use shardplane_engine::candle::CandleStage;
use shardplane_engine::tensor::{AllReduce, TensorSplit};
use shardplane_engine::{LoadOptions, ModelConfig, Stage, StageLayout};

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
