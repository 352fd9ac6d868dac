//! A data plane a test scripts, for in-process tests of the gateway and the
//! agent: `Generate` and the steps of `Forward` answer as the test says, the
//! other calls are unimplemented. It listens on a loopback port and, like an
//! agent, refuses calls without the data-plane token.
//!
//! ```text
//!  test ─► FakeDataPlane::generating(|request| events) / ::stepping(|n, step| answer)
//!       ─► serve(token) ─► "127.0.0.1:port" ─► the gateway's router or an agent's relay calls it
//! ```

use std::pin::Pin;
use std::sync::Arc;

use futures::{Stream, StreamExt};
use shardplane_dataplane as dp;
use shardplane_dataplane::data_plane_server::{DataPlane, DataPlaneServer};
use shardplane_dataplane::tonic::{self, Request, Response, Status, Streaming};

/// The events a fake `Generate` streams for a request, or its refusal.
pub type Generate = dyn Fn(dp::GenerateRequest) -> Result<Vec<Result<dp::GenerateResponse, Status>>, Status>
    + Send
    + Sync;

/// The answer a fake `Forward` gives to its `n`th step (counted from 0,
/// after the Open); an error ends the stream.
pub type Step = dyn Fn(usize, dp::Step) -> Result<dp::ForwardResponse, Status> + Send + Sync;

/// What a fake `Forward` says to its `Open`: go on, or refuse the stream.
pub type Open = dyn Fn(&dp::Open) -> Result<(), Status> + Send + Sync;

/// A scripted data plane.
#[derive(Clone, Default)]
pub struct FakeDataPlane {
    generate: Option<Arc<Generate>>,
    step: Option<Arc<Step>>,
    open: Option<Arc<Open>>,
    /// Leave out the confirmation of a cached prefix, as an agent from
    /// before pipelines reused prefixes does.
    older: bool,
    /// How long a `Generate` stream is silent before its first event.
    first_after: std::time::Duration,
}

impl FakeDataPlane {
    /// A head stage answering `Generate` with what `answer` gives.
    pub fn generating(
        answer: impl Fn(
            dp::GenerateRequest,
        ) -> Result<Vec<Result<dp::GenerateResponse, Status>>, Status>
        + Send
        + Sync
        + 'static,
    ) -> Self {
        FakeDataPlane {
            generate: Some(Arc::new(answer)),
            ..Default::default()
        }
    }

    /// Each `Generate` stream says nothing for `delay` first, as a stage
    /// running a long prompt does.
    pub fn first_after(mut self, delay: std::time::Duration) -> Self {
        self.first_after = delay;
        self
    }

    /// A later stage answering each step of `Forward` with what `answer`
    /// gives.
    pub fn stepping(
        answer: impl Fn(usize, dp::Step) -> Result<dp::ForwardResponse, Status> + Send + Sync + 'static,
    ) -> Self {
        FakeDataPlane {
            step: Some(Arc::new(answer)),
            ..Default::default()
        }
    }

    /// Each `Forward` stream's `Open` goes to `check` first; an error
    /// refuses the stream.
    pub fn on_open(
        mut self,
        check: impl Fn(&dp::Open) -> Result<(), Status> + Send + Sync + 'static,
    ) -> Self {
        self.open = Some(Arc::new(check));
        self
    }

    /// Answers opens as an agent from before pipelines reused prefixes:
    /// without confirming the cached prefix (`dp::CACHED_HEADER`).
    pub fn as_older_agent(mut self) -> Self {
        self.older = true;
        self
    }

    /// Serves it on a loopback port, refusing calls without `token`; its
    /// `host:port`.
    pub async fn serve(self, token: dp::Token) -> String {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
            .await
            .expect("bind a loopback port");
        let endpoint = listener.local_addr().expect("bound").to_string();
        let service = tonic::service::interceptor::InterceptedService::new(
            DataPlaneServer::new(self),
            dp::RequireToken(token),
        );
        tokio::spawn(
            tonic::transport::Server::builder()
                .add_service(service)
                .serve_with_incoming(tonic::transport::server::TcpIncoming::from(listener)),
        );
        endpoint
    }
}

type Answers<T> = Pin<Box<dyn Stream<Item = Result<T, Status>> + Send>>;

fn unscripted<T>(call: &str) -> Result<T, Status> {
    Err(Status::unimplemented(format!(
        "this fake does not answer {call}"
    )))
}

#[tonic::async_trait]
impl DataPlane for FakeDataPlane {
    type GenerateStream = Answers<dp::GenerateResponse>;
    type ForwardStream = Answers<dp::ForwardResponse>;
    type ReadBlobStream = Answers<dp::BlobChunk>;

    async fn generate(
        &self,
        request: Request<dp::GenerateRequest>,
    ) -> Result<Response<Self::GenerateStream>, Status> {
        let Some(answer) = &self.generate else {
            return unscripted("Generate");
        };
        let events = answer(request.into_inner())?;
        let events = futures::stream::iter(events);
        if self.first_after.is_zero() {
            return Ok(Response::new(Box::pin(events)));
        }
        let silence = futures::stream::once(tokio::time::sleep(self.first_after))
            .filter_map(|()| async { None });
        Ok(Response::new(Box::pin(silence.chain(events))))
    }

    async fn forward(
        &self,
        request: Request<Streaming<dp::ForwardRequest>>,
    ) -> Result<Response<Self::ForwardStream>, Status> {
        let Some(answer) = self.step.clone() else {
            return unscripted("Forward");
        };
        let mut inbound = request.into_inner();
        let open = dp::read_open(&mut inbound).await?;
        if let Some(check) = &self.open {
            check(&open)?;
        }
        let start = (inbound, 0, false);
        let answers = futures::stream::unfold(start, move |(mut inbound, n, ended)| {
            let answer = answer.clone();
            async move {
                if ended {
                    return None;
                }
                loop {
                    use dp::forward_request::Message;
                    match inbound.message().await {
                        Ok(Some(dp::ForwardRequest {
                            message: Some(Message::Step(step)),
                        })) => {
                            let a = answer(n, step);
                            let failed = a.is_err();
                            return Some((a, (inbound, n + 1, failed)));
                        }
                        // An empty message.
                        Ok(Some(_)) => continue,
                        Ok(None) | Err(_) => return None,
                    }
                }
            }
        });
        // Like a stage that took the open's cached prefix (see
        // `dp::CACHED_HEADER`).
        let mut response = Response::new(Box::pin(answers) as Answers<dp::ForwardResponse>);
        if open.cached > 0 && !self.older {
            response
                .metadata_mut()
                .insert(dp::CACHED_HEADER, open.cached.into());
        }
        Ok(response)
    }

    async fn status(
        &self,
        _: Request<dp::StatusRequest>,
    ) -> Result<Response<dp::StatusResponse>, Status> {
        unscripted("Status")
    }

    async fn ping(
        &self,
        _: Request<dp::PingRequest>,
    ) -> Result<Response<dp::PingResponse>, Status> {
        unscripted("Ping")
    }

    async fn read_blob(
        &self,
        _: Request<dp::ReadBlobRequest>,
    ) -> Result<Response<Self::ReadBlobStream>, Status> {
        unscripted("ReadBlob")
    }
}
