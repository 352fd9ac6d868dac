//! The way to the next stage: its Shard and node from the watch-fed stores,
//! the fastest link to that node, and the `Forward` stream opened there;
//! what the stages after a head report holding of KV.

use kube::runtime::reflector::{ObjectRef, Store};
use shardplane_crds::{InferenceNode, Shard, ShardPhase};
use shardplane_dataplane as dp;
use shardplane_engine::Activations;
use tokio::sync::mpsc;
use tokio_stream::wrappers::ReceiverStream;
use tonic::{Status, Streaming};

use super::Service;
use crate::kv_budget::{KvCost, Later};
use crate::links::route;
use crate::shards::ServedStage;

impl Service {
    /// Opens the sequence on the stage after `stage`.
    pub(super) async fn open_next(
        &self,
        stage: &ServedStage,
        mut open: dp::Open,
    ) -> Result<Downstream, Status> {
        let next = stage.spec.next.as_deref().ok_or_else(|| {
            Status::failed_precondition(format!(
                "shard {} is not the last stage but names no next stage",
                stage.name
            ))
        })?;
        let shard = self
            .directory
            .get(&ObjectRef::new(next).within(&stage.namespace))
            .ok_or_else(|| {
                Status::unavailable(format!(
                    "next stage {}/{next} is not known yet",
                    stage.namespace
                ))
            })?;
        let status = shard.status.clone().unwrap_or_default();
        let endpoint = match (status.phase, status.endpoint) {
            // The fastest link to the next stage's node, when it is known.
            (Some(ShardPhase::Ready), Some(e)) => self
                .nodes
                .get(&ObjectRef::new(&shard.spec.node))
                .and_then(|n| n.status.as_ref().and_then(|st| route(&self.addresses, st)))
                .map(|r| r.endpoint)
                .unwrap_or(e),
            (phase, _) => {
                return Err(Status::unavailable(format!(
                    "next stage {}/{next} is not ready (phase {})",
                    stage.namespace,
                    phase.map(|p| p.to_string()).unwrap_or("Pending".into())
                )));
            }
        };
        open.shard = Some(dp::ShardRef {
            namespace: stage.namespace.clone(),
            name: next.to_string(),
        });
        let mut client = self
            .peers
            .client(&shard.spec.node, &endpoint)
            .map_err(|e| Status::invalid_argument(e.to_string()))?;
        let cached = open.cached;
        let (requests, outbound) = mpsc::channel(64);
        requests
            .send(dp::ForwardRequest {
                message: Some(dp::forward_request::Message::Open(open)),
            })
            .await
            .map_err(|_| Status::internal("cannot queue the open message"))?;
        let answers = client
            .forward(ReceiverStream::new(outbound))
            .await
            .map_err(|e| {
                // A stage that does not hold the cached prefix says so up
                // to the head (see `Open.cached`); anything else makes this
                // instance unavailable.
                let code = match e.code() {
                    tonic::Code::Aborted => tonic::Code::Aborted,
                    _ => tonic::Code::Unavailable,
                };
                let mut status = Status::new(
                    code,
                    format!(
                        "next stage {}/{next} at {endpoint}: {}",
                        stage.namespace,
                        e.message()
                    ),
                );
                // How many it holds, for the head to ask again with.
                if let (tonic::Code::Aborted, Some(held)) =
                    (code, e.metadata().get(dp::CACHED_HEADER))
                {
                    status
                        .metadata_mut()
                        .insert(dp::CACHED_HEADER, held.clone());
                }
                status
            })?;
        // It says it took the cached prefix; a stage that does not know the
        // field ran nothing of it, and would take the rows for positions
        // from 0.
        let confirmed = answers
            .metadata()
            .get(dp::CACHED_HEADER)
            .and_then(|v| v.to_str().ok()?.parse::<u32>().ok());
        if cached > 0 && confirmed != Some(cached) {
            return Err(Status::aborted(format!(
                "next stage {}/{next} at {endpoint} did not confirm taking {cached} prompt tokens \
                 from its prefix cache (an agent from before pipelines reused prefixes?)",
                stage.namespace
            )));
        }
        let answers = answers.into_inner();
        Ok(Downstream { requests, answers })
    }
}

/// The sequence's stream to the next stage.
pub(super) struct Downstream {
    pub(super) requests: mpsc::Sender<dp::ForwardRequest>,
    pub(super) answers: Streaming<dp::ForwardResponse>,
}

/// Sends one step of hidden states (and the tokens they stand for, when
/// told) down the pipeline; `sample` asks the last stage for a token, from
/// among the `allowed` ones when the answer follows a grammar (a
/// [`TokenMask`]'s wire form; empty: any token).
///
/// [`TokenMask`]: shardplane_engine::constraint::TokenMask
pub(super) async fn send_step(
    requests: &mpsc::Sender<dp::ForwardRequest>,
    a: &Activations,
    sample: bool,
    allowed: Vec<u8>,
) -> Result<(), Status> {
    let step = dp::Step {
        hidden: Some(dp::Hidden {
            tokens: a.tokens as u32,
            width: a.hidden as u32,
            data: dp::encode_f32(&a.data),
        }),
        sample,
        allowed,
        tokens: a.told_ids().unwrap_or_default().to_vec(),
    };
    requests
        .send(dp::ForwardRequest {
            message: Some(dp::forward_request::Message::Step(step)),
        })
        .await
        .map_err(|_| Status::unavailable("the next stage closed the sequence"))
}

impl Downstream {
    pub(super) async fn send(
        &self,
        a: &Activations,
        sample: bool,
        allowed: Vec<u8>,
    ) -> Result<(), Status> {
        send_step(&self.requests, a, sample, allowed).await
    }

    pub(super) async fn answer(&mut self) -> Result<dp::ForwardResponse, Status> {
        match self.answers.message().await {
            Ok(Some(a)) => Ok(a),
            Ok(None) => Err(Status::unavailable("the next stage ended the sequence")),
            Err(e) => Err(Status::unavailable(format!("next stage: {}", e.message()))),
        }
    }
}

/// The KV accounts of the Ready stages after `stage` that report a
/// budget (`kvBudgetTokens`), for its head's ledger: each counts a sequence
/// by its own layers' [`KvCost`], with its agent's prompt step (from its
/// InferenceNode), and holds at least one context, the least any stage
/// holds. A node that reports no step (its agent older than the field, or
/// not seen yet) is counted in plain tokens: never less than what sliding
/// layers cost, and the unit older agents report their budget in.
pub(super) fn later_stages(
    directory: &Store<Shard>,
    nodes: &Store<InferenceNode>,
    stage: &ServedStage,
) -> Vec<Later> {
    let context = u64::from(stage.spec.kv_cache.context_length);
    let mut later = Vec::new();
    let mut next = stage.spec.next.clone();
    // One hop per stage at most: a loop of `next` names ends the walk.
    for _ in 0..stage.spec.stage_count {
        let Some(name) = next else { break };
        let Some(shard) = directory.get(&ObjectRef::new(&name).within(&stage.namespace)) else {
            break;
        };
        let reported = shard
            .status
            .as_ref()
            .filter(|s| s.phase == Some(ShardPhase::Ready))
            .and_then(|s| s.kv_budget_tokens)
            .filter(|&t| t > 0);
        if let Some(budget) = reported {
            let step = nodes
                .get(&ObjectRef::new(&shard.spec.node))
                .and_then(|n| n.status.as_ref()?.prompt_step_tokens);
            let layers = shard.spec.layers.start as usize..shard.spec.layers.end as usize;
            let cost = match (step, stage.worker.windows.get(layers)) {
                (Some(step), Some(windows)) => KvCost::of_windows(windows, step as usize),
                _ => KvCost::default(),
            };
            later.push(Later {
                shard: name.clone(),
                budget: budget.max(cost.units(context)),
                cost,
            });
        }
        next = shard.spec.next.clone();
    }
    later
}
