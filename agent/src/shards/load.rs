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
    Key, ServedStage, ShardSet, Sources, crd_engine, fetch, key, owned, put_phase, report, tensor,
};
use crate::cache::Failure;
use crate::kv_budget::KvCost;
use crate::metrics::Metrics;
use crate::scheduler::Budget;
use crate::stage::{OnCrash, StageWorker};

/// Fetches and loads a shard; returns what it holds.
pub(super) async fn bring_up(
    client: &Client,
    shard: &Shard,
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
    report(
        client,
        shards,
        &k,
        status(ShardPhase::Downloading, "checking the weights".into()),
    );
    let path = fetch::fetch(client, shards, shard, sources, metrics).await?;

    // Loading only while the claim stands: a Shard unloaded (deleted,
    // moved) while its weights came is not brought back.
    {
        let mut phases = shards.phases.lock().expect("phase lock");
        if phases.get(&k) != Some(&ShardPhase::Downloading) {
            return Err(Failure {
                reason: "ShardGone",
                message: "the Shard went while its weights were fetched".into(),
            });
        }
        put_phase(&mut phases, metrics, &k, Some(ShardPhase::Loading));
    }
    report(
        client,
        shards,
        &k,
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
    // Only a stage that runs the whole model reuses prefixes (see the
    // engine's `reuse_prefix`): a pipeline's stages keep no cache and leave
    // its budget to their KV.
    let whole = shard.spec.layers.start == 0 && shard.spec.layers.end == shard.spec.total_layers;
    let prefix_cache_bytes = if whole && shard.spec.tensor.is_none() {
        sources.prefix_cache_bytes
    } else {
        0
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
        Some(_) => match tensor::load_and_join(client, shard, shards, sources, path).await? {
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
                metrics.weight_bytes.add(bytes as i64);
                let rank = tensor::Rank {
                    mesh: mesh.clone(),
                    spec,
                    follower_bytes: Some(bytes),
                };
                // Kept before its mesh is watched: a break then finds it.
                put_rank(&k, rank, shards, metrics, sources);
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
        },
    };
    let kv_bytes_per_token = engine.config().kv_bytes_per_token_per_layer();
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
    metrics.weight_bytes.add(bytes as i64);
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
    // A leader's rank is kept before its stage, so that its old group
    // breaking meanwhile cannot take the new stage with it.
    if let Some((mesh, _)) = &tensor {
        let rank = tensor::Rank {
            mesh: mesh.clone(),
            spec: joined_spec,
            follower_bytes: None,
        };
        put_rank(&k, rank, shards, metrics, sources);
    }
    let replaced = shards
        .loaded
        .lock()
        .expect("shard set lock")
        .insert(k.clone(), served.clone());
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
    // A new spec (other layers, another template) replaced a loaded stage:
    // its sequences finish on the old one, which then goes.
    if let Some(old) = replaced {
        metrics.weight_bytes.sub(old.worker.weight_bytes as i64);
        sources.cache.unpin(&old.spec.source.cache_key());
    }
    Ok(loaded)
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

/// Keeps `rank` as Shard `k`'s; one it replaces is let go of (its mesh
/// closed; a follower's weights and cache pin released), and a leader's
/// stage when the Shard now follows.
pub(super) fn put_rank(
    k: &Key,
    rank: tensor::Rank,
    shards: &ShardSet,
    metrics: &Metrics,
    sources: &Sources,
) {
    let follows = rank.follower_bytes.is_some();
    let old = shards
        .ranks
        .lock()
        .expect("rank lock")
        .insert(k.clone(), rank);
    if let Some(old) = old {
        old.mesh.close();
        if let Some(bytes) = old.follower_bytes {
            sources.cache.unpin(&old.spec.source.cache_key());
            metrics.weight_bytes.sub(bytes as i64);
        }
    }
    let led = follows
        .then(|| shards.loaded.lock().expect("shard set lock").remove(k))
        .flatten();
    if let Some(stage) = led {
        sources.cache.unpin(&stage.spec.source.cache_key());
        metrics.weight_bytes.sub(stage.worker.weight_bytes as i64);
        // Its stage's series go with it (a follower serves none).
        metrics.forget_shard(&stage.name);
    }
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
