//! Bringing one Shard up: fetch its weights, load its stage (or, for a
//! tensor rank, its share, joined to its group), start its worker and
//! measure its KV room; what a load's failure is called.
//!
//! ```text
//!  fetch ─► load (whole stage | tensor rank: tensor::load_and_join)
//!        ─► leader / stage: StageWorker, KvRoom, served   ─► Loaded
//!           follower: its rank kept, its thread started    ─► Loaded
//! ```

use std::sync::Arc;

use kube::Client;
use shardplane_crds::validation::Validate;
use shardplane_crds::{Engine, Shard, ShardPhase, ShardSpec, ShardStatus};
use shardplane_engine::pipeline::{EngineKind, TextModel, load_model_stage};
use shardplane_engine::{LoadOptions, StageLayout};

use super::healing::stage_crashed;
use super::kv_room::{self, KvRoom};
use super::{
    Claim, Key, ServedStage, ShardSet, Sources, crd_engine, fetch, key, owned, put_phase,
    report_claimed, tensor,
};
use crate::cache::Failure;
use crate::kv_budget::KvCost;
use crate::metrics::Metrics;
use crate::scheduler::Budget;
use crate::stage::{OnCrash, StageWorker};

/// Fetches and loads a shard under `claim`; returns what it holds. What
/// it loaded is served only while the claim stands (else `ShardGone`).
pub(super) async fn bring_up(
    client: &Client,
    (shard, claim): (&Shard, Claim),
    shards: &ShardSet,
    metrics: &Metrics,
    sources: &Sources,
) -> Result<Loaded, Failure> {
    let k = key(shard);
    shard.validate().map_err(|e| Failure {
        reason: "InvalidSpec",
        message: e.to_string(),
    })?;
    let status = |phase, message: String| ShardStatus {
        phase: Some(phase),
        message: Some(message),
        observed_generation: shard.metadata.generation,
        ..Default::default()
    };
    report_claimed(
        client,
        shards,
        (&k, claim),
        status(ShardPhase::Downloading, "checking the weights".into()),
    );
    let path = fetch::fetch(client, shards, (shard, claim), sources, metrics).await?;

    // Loading only while the claim stands: a Shard unloaded (deleted,
    // moved) while its weights came is not brought back.
    {
        let mut phases = shards.phases.lock().expect("phase lock");
        if phases.get(&k) != Some(&ShardPhase::Downloading) || !shards.claimed(&phases, &k, claim) {
            return Err(gone());
        }
        put_phase(&mut phases, metrics, &k, Some(ShardPhase::Loading));
    }
    report_claimed(
        client,
        shards,
        (&k, claim),
        status(
            ShardPhase::Loading,
            format!("loading layers {}", shard.spec.layers),
        ),
    );
    let spec = shard.spec.clone();
    let spec_kv = shard.spec.kv_cache;
    let engine_kind = sources.engine;
    let engine_name = match &shard.spec.tensor {
        Some(_) => Engine::Candle,
        None => crd_engine(engine_kind),
    };
    // Every stage but a tensor rank keeps its own layers' prefix cache (see
    // the engine's `reuse_prefix`); a rank leaves its budget to its KV.
    let prefix_cache_bytes = match shard.spec.tensor {
        None => sources.prefix_cache_bytes,
        Some(_) => 0,
    };
    // What the stage runs as: a tensor rank's group may have changed while
    // it joined.
    let mut joined_spec = shard.spec.clone();
    let mut generation = shard.metadata.generation;
    let (engine, text, tensor) = match &shard.spec.tensor {
        None => {
            let (engine, text) = load(path, spec, engine_kind, prefix_cache_bytes).await?;
            (engine, text, None)
        }
        Some(_) => {
            match tensor::load_and_join(client, (shard, claim), shards, sources, path).await? {
                tensor::Joined::Leads {
                    stage,
                    text,
                    mesh,
                    endpoint,
                    spec,
                    generation: joined,
                } => {
                    joined_spec = spec;
                    generation = joined;
                    (stage, text, Some((mesh, endpoint)))
                }
                tensor::Joined::Follows {
                    stage,
                    mesh,
                    endpoint,
                    spec,
                    generation,
                } => {
                    let bytes = stage.weight_bytes();
                    let rank = tensor::Rank {
                        mesh: mesh.clone(),
                        spec,
                        follower_bytes: Some(bytes),
                    };
                    // Kept before its mesh is watched: a break then finds it.
                    put_loaded((&k, claim), (Some(rank), None), shards, metrics, sources)?;
                    watch_group(client, &k, generation, &mesh, shards, metrics, sources);
                    if let Err(e) = tensor::follow(stage, mesh.clone(), &k.1) {
                        // Handled as any break (the rank let go of, the Shard
                        // failed and tried again), not left kept and idle.
                        mesh.break_with(&format!("cannot start the rank's thread: {e}"));
                    }
                    return Ok(Loaded {
                        bytes: bytes as u64,
                        kv_budget_tokens: 0,
                        engine: Engine::Candle,
                        tensor_endpoint: Some(endpoint),
                        generation,
                        follows: true,
                    });
                }
            }
        }
    };
    let kv_bytes_per_token = engine.kv_bytes_per_token_per_layer();
    // Sliding layers hold at most their kept rows of a sequence: each
    // stage counts a long one as less by its own layers (`KvCost`), its
    // head counts it so in every stage's budget.
    let cost = KvCost::of_windows(
        &engine
            .config()
            .layer_windows(shard.spec.layers.start as usize..shard.spec.layers.end as usize),
        sources.budget.prefill_tokens,
    );
    let on_crash: OnCrash = {
        let (client, shards, metrics, sources) = owned(client, shards, metrics, sources);
        let k = k.clone();
        let runtime = tokio::runtime::Handle::current();
        Box::new(move |message| {
            // Called on the stage's thread: the handling needs the runtime.
            let _inside = runtime.enter();
            stage_crashed(&client, k, generation, message, &shards, &metrics, &sources);
        })
    };
    // A pipeline's head keeps one group of decoding sequences per stage
    // going round, so that the stages work at once (see `scheduler`).
    let budget = Budget {
        decode_groups: match shard.spec.stage {
            0 => shard.spec.stage_count.max(1) as usize,
            _ => 1,
        },
        ..sources.budget
    };
    let worker = StageWorker::start(&k.1, engine, metrics.pass_observer(&k.1), budget, on_crash);
    // What this machine holds of the Shard's KV. Heads admit generations
    // within their own and each later stage's (see `dataplane::head`);
    // every stage reports its own in its status, measured again while it runs.
    let layers = u64::from(
        shard
            .spec
            .layers
            .end
            .saturating_sub(shard.spec.layers.start),
    );
    let room = KvRoom {
        context: u64::from(spec_kv.context_length),
        sequences: u64::from(spec_kv.concurrent_sequences),
        per_token: (kv_bytes_per_token as u64).saturating_mul(layers),
        reserve: sources.memory_reserve,
        prefix_cache: prefix_cache_bytes as u64,
        cost: cost.clone(),
    };
    worker.stats.kv.set_cost(cost);
    let budget = room.measure(&worker.stats, crate::machine::available_memory());
    if budget < room.shard_tokens() {
        tracing::warn!(
            shard = %k.1,
            budget,
            shard_tokens = room.shard_tokens(),
            "the machine's free memory holds less KV than the Shard asks: the instance's head \
             admits at most {budget} tokens (counted as its KV budget counts them)"
        );
    }
    let bytes = worker.weight_bytes;
    let loaded = Loaded {
        bytes: bytes as u64,
        kv_budget_tokens: budget,
        engine: engine_name,
        tensor_endpoint: tensor.as_ref().map(|(_, e)| e.clone()),
        generation,
        follows: false,
    };
    let served = Arc::new(ServedStage {
        namespace: k.0.clone(),
        name: k.1.clone(),
        spec: joined_spec.clone(),
        worker,
        text,
    });
    // A leader's rank is kept with its stage, so that its old group
    // breaking meanwhile cannot take the new stage with it.
    let rank = tensor.as_ref().map(|(mesh, _)| tensor::Rank {
        mesh: mesh.clone(),
        spec: joined_spec,
        follower_bytes: None,
    });
    put_loaded(
        (&k, claim),
        (rank, Some(served.clone())),
        shards,
        metrics,
        sources,
    )?;
    if let Some((mesh, _)) = &tensor {
        watch_group(client, &k, generation, mesh, shards, metrics, sources);
    }
    tokio::spawn(kv_room::remeasure(
        shards.clone(),
        k,
        Arc::downgrade(&served.worker.stats),
        room,
        kv_room::INTERVAL,
    ));
    Ok(loaded)
}

/// A load's failure when its Shard went (or was claimed anew) meanwhile.
fn gone() -> Failure {
    Failure {
        reason: "ShardGone",
        message: "the Shard went while it loaded".into(),
    }
}

/// What a loaded stage reports.
pub(super) struct Loaded {
    /// Memory it uses: weights (and the KV cache as it grows).
    pub(super) bytes: u64,
    /// Tokens of KV its machine holds for it (`KvCost`'s units).
    pub(super) kv_budget_tokens: u64,
    /// The engine it runs on.
    pub(super) engine: Engine,
    /// A tensor rank's address for its group.
    pub(super) tensor_endpoint: Option<String>,
    /// The Shard's generation it runs as (a tensor rank's group may have
    /// changed while it joined).
    pub(super) generation: Option<i64>,
    /// A tensor follower: it serves no stage of its own (its rank is kept).
    pub(super) follows: bool,
}

/// Loads a stage that is not split; its tokenizer on a first stage.
pub(super) async fn load(
    path: std::path::PathBuf,
    spec: ShardSpec,
    engine_kind: EngineKind,
    prefix_cache_bytes: usize,
) -> Result<(Box<dyn shardplane_engine::Stage>, Option<Arc<TextModel>>), Failure> {
    tokio::task::spawn_blocking(move || {
        let (layout, options) = layout_and_options(&spec, prefix_cache_bytes)?;
        let (engine, text) = load_model_stage(&path, layout, engine_kind, &options)?;
        let text = with_template(text, &spec)?;
        Ok::<_, shardplane_engine::Error>((engine, text.map(Arc::new)))
    })
    .await
    .map_err(|e| Failure {
        reason: "LoadPanicked",
        message: e.to_string(),
    })?
    .map_err(load_failure)
}

/// The layers a Shard's stage runs and how it loads them.
pub(super) fn layout_and_options(
    spec: &ShardSpec,
    prefix_cache_bytes: usize,
) -> shardplane_engine::Result<(StageLayout, LoadOptions)> {
    let layout = StageLayout::new(
        spec.layers.start as usize..spec.layers.end as usize,
        spec.total_layers as usize,
    )?;
    let options = LoadOptions {
        context_length: Some(spec.kv_cache.context_length as usize),
        prefix_cache_bytes,
        ..Default::default()
    };
    Ok((layout, options))
}

/// A first stage's text model with the Shard's chat template, when it
/// names one.
pub(super) fn with_template(
    text: Option<TextModel>,
    spec: &ShardSpec,
) -> shardplane_engine::Result<Option<TextModel>> {
    Ok(match (text, &spec.chat_template) {
        (Some(text), Some(source)) => Some(text.with_template(text.template.with_source(source)?)),
        (text, _) => text,
    })
}

/// A load's error as a Shard's failure.
pub(super) fn load_failure(e: shardplane_engine::Error) -> Failure {
    Failure {
        reason: match e {
            shardplane_engine::Error::CorruptModel { .. }
            | shardplane_engine::Error::MissingMetadata { .. } => "CorruptWeights",
            shardplane_engine::Error::UnsupportedArchitecture(_)
            | shardplane_engine::Error::UnsupportedTensorType { .. } => "UnsupportedModel",
            shardplane_engine::Error::LayerRange { .. } => "LayerRangeDoesNotFit",
            shardplane_engine::Error::Io { .. } => "WeightsUnreadable",
            shardplane_engine::Error::ChatTemplate(_) => "InvalidChatTemplate",
            shardplane_engine::Error::Tensor(_) => "TensorSplitImpossible",
            _ => "LoadFailed",
        },
        message: e.to_string(),
    }
}

/// Keeps what a load under `claim` brought up as Shard `k`'s — a tensor
/// `rank` and, unless it follows, a `stage` — while the claim stands (else
/// `ShardGone`, a rank's mesh closed; the Shard was unloaded, perhaps
/// claimed anew, meanwhile). What they replace is let go of: a rank's
/// mesh closed, a follower's weights and cache pin released, a stage's
/// (a new spec's stage replaced it, its sequences finish on it, or the
/// Shard now follows).
pub(super) fn put_loaded(
    (k, claim): (&Key, Claim),
    (rank, stage): (Option<tensor::Rank>, Option<Arc<ServedStage>>),
    shards: &ShardSet,
    metrics: &Metrics,
    sources: &Sources,
) -> Result<(), Failure> {
    let follows = rank.as_ref().is_some_and(|r| r.follower_bytes.is_some());
    let bytes = match (&stage, &rank) {
        (Some(stage), _) => stage.worker.weight_bytes,
        (None, Some(rank)) => rank.follower_bytes.unwrap_or(0),
        (None, None) => 0,
    };
    let (old, led) = {
        let mut ranks = shards.ranks.lock().expect("rank lock");
        let phases = shards.phases.lock().expect("phase lock");
        if !shards.claimed(&phases, k, claim) {
            if let Some(rank) = rank {
                rank.mesh.close();
            }
            return Err(gone());
        }
        // A stage that is no tensor rank replaces the rank it was.
        let old = match rank {
            Some(rank) => ranks.insert(k.clone(), rank),
            None => ranks.remove(k),
        };
        let mut loaded = shards.loaded.lock().expect("shard set lock");
        let led = match stage {
            Some(stage) => loaded.insert(k.clone(), stage),
            None if follows => loaded.remove(k),
            None => None,
        };
        // Counted before an unload can take it out again.
        metrics.weight_bytes.add(bytes as i64);
        (old, led)
    };
    if let Some(old) = old {
        old.mesh.close();
        if let Some(bytes) = old.follower_bytes {
            sources.cache.unpin(&old.spec.source.cache_key());
            metrics.weight_bytes.sub(bytes as i64);
        }
    }
    if let Some(stage) = led {
        sources.cache.unpin(&stage.spec.source.cache_key());
        metrics.weight_bytes.sub(stage.worker.weight_bytes as i64);
        // Its stage's series go with it when a follower serves none.
        if follows {
            metrics.forget_shard(&stage.name);
        }
    }
    Ok(())
}

/// Fails Shard `k` when its tensor group's `mesh` breaks.
pub(super) fn watch_group(
    client: &Client,
    k: &Key,
    generation: Option<i64>,
    mesh: &crate::tensor::SharedMesh,
    shards: &ShardSet,
    metrics: &Metrics,
    sources: &Sources,
) {
    let (client, shards, metrics, sources) = owned(client, shards, metrics, sources);
    let (k, watched) = (k.clone(), mesh.id());
    let runtime = tokio::runtime::Handle::current();
    mesh.on_broken(Box::new(move |why| {
        // Called on the rank's thread: the handling needs the runtime.
        let _inside = runtime.enter();
        tensor::group_broken(
            &client,
            k,
            generation,
            (watched, why),
            &shards,
            &metrics,
            &sources,
        );
    }));
}

#[cfg(test)]
mod tests {
    use shardplane_crds::LayerRange;

    use super::super::{set_phase, test_set, unload};
    use super::*;

    fn stage(k: &Key) -> Arc<ServedStage> {
        let shard = shardplane_testkit::fixtures::shard(
            "d",
            "node-0",
            0,
            2,
            LayerRange { start: 0, end: 8 },
        );
        Arc::new(ServedStage {
            namespace: k.0.clone(),
            name: k.1.clone(),
            spec: shard.spec,
            worker: crate::test_stage::quiet_worker(
                &k.1,
                Box::new(crate::test_stage::Echo::middle()),
            ),
            text: None,
        })
    }

    #[tokio::test]
    async fn a_load_puts_in_its_stage_only_while_its_claim_stands() {
        let (_dir, shards, metrics, sources) = test_set();
        let k: Key = ("ns".into(), "s".into());
        set_phase(&shards, &metrics, &k, Some(ShardPhase::Loading));
        let old = shards.claim(&k);
        // Unloaded (deleted) during the load, then claimed anew under its
        // name: the old load's stage is refused, the Shard left to the
        // new load.
        unload(&k, &shards, &metrics, &sources.cache);
        set_phase(&shards, &metrics, &k, Some(ShardPhase::Downloading));
        let new = shards.claim(&k);
        let put = |claim, s| put_loaded((&k, claim), (None, Some(s)), &shards, &metrics, &sources);
        let refused = put(old, stage(&k)).expect_err("a stale claim put its stage in");
        assert_eq!(refused.reason, "ShardGone");
        assert!(shards.served(&k.0, &k.1).is_none());
        // The new load's stage goes in; the claim's phase is the load's.
        let mine = stage(&k);
        put(new, mine.clone()).expect("the standing claim");
        let served = shards.served(&k.0, &k.1).expect("served");
        assert!(Arc::ptr_eq(&served, &mine));
        // The old load, still running, cannot replace it either.
        assert!(put(old, stage(&k)).is_err());
        let served = shards.served(&k.0, &k.1).expect("served");
        assert!(Arc::ptr_eq(&served, &mine));
        // Only the standing claim's weights are counted.
        assert_eq!(metrics.weight_bytes.get(), mine.worker.weight_bytes as i64);
    }

    #[tokio::test]
    async fn a_stage_that_is_no_tensor_rank_replaces_the_rank_it_was() {
        let (_dir, shards, metrics, sources) = test_set();
        let k: Key = ("ns".into(), "s".into());
        set_phase(&shards, &metrics, &k, Some(ShardPhase::Loading));
        // A follower's rank, its weights counted and its model pinned.
        let spec = stage(&k).spec.clone();
        let mesh = crate::tensor::SharedMesh::default();
        let rank = tensor::Rank {
            mesh: mesh.clone(),
            spec: spec.clone(),
            follower_bytes: Some(1000),
        };
        sources.cache.pin(&spec.source.cache_key());
        put_loaded(
            (&k, shards.claim(&k)),
            (Some(rank), None),
            &shards,
            &metrics,
            &sources,
        )
        .expect("the follower's rank");
        assert_eq!(metrics.weight_bytes.get(), 1000);
        // Its spec changes to a stage of its own: the rank goes with its
        // weights, so a later break of its old group finds nothing here.
        let mine = stage(&k);
        put_loaded(
            (&k, shards.claim(&k)),
            (None, Some(mine.clone())),
            &shards,
            &metrics,
            &sources,
        )
        .expect("the stage");
        assert!(shards.ranks.lock().unwrap().get(&k).is_none());
        assert_eq!(metrics.weight_bytes.get(), mine.worker.weight_bytes as i64);
    }
}
