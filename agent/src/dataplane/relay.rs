//! `Forward` on the stages after the head: each step of hidden states runs
//! through the stage; a middle stage sends its output on and relays the
//! answers back up, the last stage samples the next token.
//!
//! ```text
//!  stage before ─Open, Step…─► this stage ─Step…─► next stage     (middle)
//!               ◄── answers ◄──────────── relay ◄──┘
//!  stage before ─Open, Step…─► this stage: logits ─► sample ─► answer   (last)
//! ```

use std::sync::Arc;

use shardplane_dataplane as dp;
use shardplane_engine::constraint::TokenMask;
use shardplane_engine::pipeline::ban;
use shardplane_engine::sampler::Sampler;
use shardplane_engine::{Activations, SequenceId, StageInput, StageOutput};
use tokio::sync::mpsc;
use tokio_stream::wrappers::ReceiverStream;
use tonic::{Request, Response, Status, Streaming};

use super::next_stage::{Downstream, send_step};
use super::wire::{self, engine_status, sampling_params};
use super::{EventStream, Service};
use crate::shards::ServedStage;

impl Service {
    /// `Forward` on a later stage: the last samples, a middle one passes its
    /// hidden states on and relays the answers back.
    pub(super) async fn relay(
        &self,
        request: Request<Streaming<dp::ForwardRequest>>,
    ) -> Result<Response<EventStream<dp::ForwardResponse>>, Status> {
        let caller = self.calling_node(request.extensions().get(), "Forward")?;
        let mut inbound = request.into_inner();
        let open = dp::read_open(&mut inbound).await?;
        let stage = self.stage(open.shard.as_ref())?;
        self.check_previous(&stage, caller.as_deref())?;
        if stage.text.is_some() {
            return Err(Status::failed_precondition(format!(
                "shard {} is a first stage; it takes Generate, not hidden states",
                stage.name
            )));
        }
        let seq = Sequence {
            stage: stage.clone(),
            id: open.sequence,
        };
        // A recompute after a preemption: the sequence it replaces goes
        // first (a job before the prefix lookup on the stage's thread), so
        // its tokens are in the cache to take, and a step of it still on
        // its way is refused rather than run at position 0. Its stream's
        // end frees it again, which is then nothing.
        if open.replaces != 0 && open.replaces != open.sequence {
            stage.worker.retire(open.replaces);
        }
        take_cached(&seq, &open).await?;
        let (cached, prompt) = (open.cached, open.prompt.len());
        let width = stage.worker.hidden;
        let (answers, stream) = mpsc::channel(64);
        if stage.is_last() {
            let sampling = open.sampling.clone().unwrap_or_default();
            let params = sampling_params(&sampling, stage.worker.context_length)?;
            let (prompt, generated) = open
                .prompt
                .split_at(open.prompt.len().saturating_sub(open.generated as usize));
            let mut sampler = Sampler::resumed(params, prompt, generated).map_err(engine_status)?;
            let banned = open.banned.clone();
            tokio::spawn(async move {
                let seq = seq;
                while let Ok(Some(msg)) = inbound.message().await {
                    let answer = async {
                        let (step, out) =
                            until_closed(&answers, run_step(&seq, msg, width)).await?;
                        let StageOutput::Logits(mut logits) = out else {
                            return Err(Status::internal("the last stage gave hidden states"));
                        };
                        if !step.sample {
                            return Ok(dp::ForwardResponse::default());
                        }
                        ban(&mut logits, &banned);
                        let allowed = if step.allowed.is_empty() {
                            None
                        } else {
                            Some(TokenMask::from_bytes(&step.allowed).map_err(engine_status)?)
                        };
                        let token = sampler.sample_within(&mut logits, allowed.as_ref());
                        Ok(dp::ForwardResponse {
                            token,
                            sampled: true,
                            logprobs: sampler.take_logprobs().map(wire::sampled_logprobs),
                        })
                    }
                    .await;
                    let failed = answer.is_err();
                    if answers.send(answer).await.is_err() || failed {
                        break;
                    }
                }
            });
        } else {
            let mut open = open;
            open.shard = None;
            let downstream = self.open_next(&stage, open).await?;
            let Downstream {
                requests,
                answers: mut down_answers,
                ..
            } = downstream;
            let relay = answers.clone();
            // Answers come back up on their own task, so several prefill
            // chunks can be in flight along the pipeline.
            tokio::spawn(async move {
                loop {
                    let item = match down_answers.message().await {
                        Ok(Some(a)) => Ok(a),
                        Ok(None) => break,
                        Err(e) => Err(e),
                    };
                    let failed = item.is_err();
                    if relay.send(item).await.is_err() || failed {
                        break;
                    }
                }
            });
            let metrics = self.metrics.clone();
            tokio::spawn(async move {
                let seq = seq;
                while let Ok(Some(msg)) = inbound.message().await {
                    let sent = async {
                        let (step, out) =
                            until_closed(&answers, run_step(&seq, msg, width)).await?;
                        let StageOutput::Hidden(mut a) = out else {
                            return Err(Status::internal("a middle stage gave logits"));
                        };
                        // The rows stand for the tokens they came for.
                        a.ids = step.tokens;
                        send_step(&requests, &a, step.sample, step.allowed).await?;
                        metrics.hidden_bytes_sent.inc_by((a.data.len() * 4) as u64);
                        Ok(())
                    }
                    .await;
                    if let Err(e) = sent {
                        let _ = answers.send(Err(e)).await;
                        break;
                    }
                }
            });
        }
        let mut response = Response::new(Box::pin(ReceiverStream::new(stream)) as EventStream<_>);
        if cached > 0 {
            response
                .metadata_mut()
                .insert(dp::CACHED_HEADER, cached.into());
            // Counted once the sequence starts here and after: an ask this
            // stage or a later one refused counts at the head (as a
            // downstream miss).
            stage.worker.stats.count_look(prompt, cached as usize);
        }
        Ok(response)
    }
}

/// Frees a sequence on a stage when dropped, however the call ends.
pub(super) struct Sequence {
    pub(super) stage: Arc<ServedStage>,
    pub(super) id: SequenceId,
}

impl Drop for Sequence {
    fn drop(&mut self) {
        self.stage.worker.release(self.id);
    }
}

/// Starts `seq` from exactly the prompt tokens the head took from its prefix
/// cache (`Open.cached`), from this stage's own cache; `ABORTED` when it no
/// longer holds them all (evicted, or never run here), saying how many it
/// does hold (in the `shardplane-cached` header), so that the head asks
/// again with as many or runs the whole prompt.
async fn take_cached(seq: &Sequence, open: &dp::Open) -> Result<(), Status> {
    let n = open.cached as usize;
    if n == 0 {
        return Ok(());
    }
    if n >= open.prompt.len() {
        return Err(Status::invalid_argument(format!(
            "{n} cached tokens of a prompt of {}: its last token always runs",
            open.prompt.len()
        )));
    }
    let held = seq
        .stage
        .worker
        .seed(seq.id, open.prompt[..=n].to_vec())
        .await;
    if held != n {
        let mut refusal = Status::aborted(format!(
            "shard {} holds {held} of the {n} prompt tokens the head took from its prefix \
             cache",
            seq.stage.name
        ));
        // The head may ask again with as many.
        refusal
            .metadata_mut()
            .insert(dp::CACHED_HEADER, (held as u32).into());
        return Err(refusal);
    }
    Ok(())
}

/// Runs one inbound `Forward` message (a step of hidden states) through the
/// sequence's stage.
async fn run_step(
    seq: &Sequence,
    msg: dp::ForwardRequest,
    width: usize,
) -> Result<(dp::Step, StageOutput), Status> {
    let Some(dp::forward_request::Message::Step(step)) = msg.message else {
        return Err(Status::invalid_argument("only steps follow Open"));
    };
    let input = hidden_input(&step, width)?;
    let out = seq
        .stage
        .worker
        .forward(seq.id, input)
        .await
        .map_err(engine_status)?;
    Ok((step, out))
}

/// Runs `work` unless the stream it answers on closes first (the stage
/// before went away): then the work is dropped, and with it the queued job.
async fn until_closed<T, R>(
    answers: &mpsc::Sender<Result<R, Status>>,
    work: impl std::future::Future<Output = Result<T, Status>>,
) -> Result<T, Status> {
    tokio::select! {
        biased;
        _ = answers.closed() => Err(Status::cancelled("the previous stage went away")),
        r = work => r,
    }
}

fn hidden_input(step: &dp::Step, width: usize) -> Result<StageInput, Status> {
    let h = step
        .hidden
        .as_ref()
        .ok_or_else(|| Status::invalid_argument("a step carries no hidden states"))?;
    let data = dp::decode_hidden(h).map_err(|e| Status::invalid_argument(e.to_string()))?;
    if h.width as usize != width {
        return Err(Status::invalid_argument(format!(
            "hidden states are {} wide; this stage takes {width}",
            h.width
        )));
    }
    let mut rows = Activations::new(h.tokens as usize, width, data).map_err(engine_status)?;
    if !step.tokens.is_empty() {
        rows = rows.with_ids(step.tokens.clone()).map_err(engine_status)?;
    }
    Ok(StageInput::Hidden(rows))
}
