//! The way to the next stage: its Shard and node from the watch-fed stores,
//! the fastest link to that node, and the `Forward` stream opened there;
//! the least KV the stages after a head report holding.

use kube::runtime::reflector::{ObjectRef, Store};
use shardplane_crds::{Shard, ShardPhase};
use shardplane_dataplane as dp;
use shardplane_engine::Activations;
use tokio::sync::mpsc;
use tokio_stream::wrappers::ReceiverStream;
use tonic::{Status, Streaming};

use super::Service;
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
                Status::unavailable(format!(
                    "next stage {}/{next} at {endpoint}: {}",
                    stage.namespace,
                    e.message()
                ))
            })?
            .into_inner();
        Ok(Downstream { requests, answers })
    }
}

/// The sequence's stream to the next stage.
pub(super) struct Downstream {
    pub(super) requests: mpsc::Sender<dp::ForwardRequest>,
    pub(super) answers: Streaming<dp::ForwardResponse>,
}

/// Sends one step of hidden states down the pipeline; `sample` asks the
/// last stage for a token, from among the `allowed` ones when the answer
/// follows a grammar (a [`TokenMask`]'s wire form; empty: any token).
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

/// The least KV, in tokens, that a Ready stage after `stage` reports
/// holding (0: none reports), and that stage's Shard. A figure below one
/// context counts as one context, the least any stage holds.
pub(super) fn downstream_kv_tokens(
    directory: &Store<Shard>,
    stage: &ServedStage,
) -> (u64, Option<String>) {
    let context = u64::from(stage.spec.kv_cache.context_length);
    let mut least = (0, None);
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
            .filter(|&t| t > 0)
            .map(|t| t.max(context));
        if let Some(tokens) = reported
            && (least.0 == 0 || tokens < least.0)
        {
            least = (tokens, Some(name.clone()));
        }
        next = shard.spec.next.clone();
    }
    least
}
