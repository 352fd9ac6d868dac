//! The API client every component uses: each call must be answered (its
//! response headers) within [`CALL_DEADLINE`], so an API server that hangs
//! (stopped, overloaded, behind a dead link) fails a call instead of holding
//! the caller forever. A watch's headers come at once; its events then
//! stream without a deadline (the watcher's own server-side timeout ends
//! it), so watches are unaffected.
//!
//! ```text
//!  call ─► [deadline: response headers within CALL_DEADLINE] ─► kube's stack (auth, TLS, HTTP)
//! ```

use std::time::Duration;

use kube::client::ClientBuilder;
use kube::{Client, Config};
use tower::util::MapFutureLayer;

/// How long the API server has to answer a call.
pub const CALL_DEADLINE: Duration = Duration::from_secs(30);

/// A client for `config` whose calls have [`CALL_DEADLINE`].
pub fn client(config: Config) -> kube::Result<Client> {
    client_with_deadline(config, CALL_DEADLINE)
}

/// A client for `config` whose calls have `deadline`.
pub fn client_with_deadline(config: Config, deadline: Duration) -> kube::Result<Client> {
    let layer = MapFutureLayer::new(move |call| async move {
        match tokio::time::timeout(deadline, call).await {
            Ok(answer) => answer,
            Err(_) => Err(format!(
                "the API server did not answer within {} s",
                deadline.as_secs_f64()
            )
            .into()),
        }
    });
    Ok(ClientBuilder::try_from(config)?.with_layer(&layer).build())
}
