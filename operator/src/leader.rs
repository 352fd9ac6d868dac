//! Leader election on a Lease: of several operator replicas, only the holder
//! of the Lease runs controllers. A holder that cannot renew in time steps
//! down (the process exits and is restarted) so two never act at once.
//!
//! ```text
//!  standby ──try_take every renew_every──► leader ──renew──► leader
//!     │ ready while the API server answers     │ renewals fail for a whole
//!     ▼                                        ▼ lease_duration
//!  not ready (API server unreachable)       steps down (process exits)
//! ```
//!
//! Readiness does not depend on leadership: a standby that reaches the API
//! server is ready to take over, so rollouts, `helm install --wait` and GitOps
//! health checks complete with standbys. Who leads shows in the
//! `shardplane_operator_leader` gauge and the Lease's holder.

use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use k8s_openapi::api::coordination::v1::{Lease, LeaseSpec};
use k8s_openapi::api::core::v1::Namespace;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::MicroTime;
use k8s_openapi::jiff::{SignedDuration, Timestamp};
use kube::api::{ObjectMeta, PostParams};
use kube::{Api, Client};

/// Settings of the election.
#[derive(Debug, Clone)]
pub struct Election {
    /// Namespace of the Lease.
    pub namespace: String,
    /// Name of the Lease.
    pub name: String,
    /// This replica's identity.
    pub identity: String,
    /// How long a Lease holds without renewal.
    pub lease_duration: Duration,
    /// How often the holder renews.
    pub renew_every: Duration,
}

/// Creates the namespace if it is missing.
pub async fn ensure_namespace(client: &Client, name: &str) -> kube::Result<()> {
    let api: Api<Namespace> = Api::all(client.clone());
    if api.get_opt(name).await?.is_none() {
        let ns = Namespace {
            metadata: ObjectMeta {
                name: Some(name.to_string()),
                ..Default::default()
            },
            ..Default::default()
        };
        match api.create(&PostParams::default(), &ns).await {
            Ok(_) => {}
            Err(kube::Error::Api(e)) if e.code == 409 => {}
            Err(e) => return Err(e),
        }
    }
    Ok(())
}

impl Election {
    /// Waits until this replica holds the Lease. `ready` says whether the
    /// last try reached the API server (a standby that does is ready to take
    /// over); a failed try is logged and tried again.
    pub async fn acquire(&self, client: &Client, ready: &AtomicBool) {
        let (mut failing, mut namespace_seen) = (false, false);
        loop {
            let tried = match namespace_seen {
                true => self.try_take(client).await,
                false => match ensure_namespace(client, &self.namespace).await {
                    Ok(()) => {
                        namespace_seen = true;
                        self.try_take(client).await
                    }
                    Err(e) => Err(e),
                },
            };
            ready.store(tried.is_ok(), Ordering::Relaxed);
            match tried {
                Ok(true) => {
                    tracing::info!(identity = %self.identity, lease = %self.name, "became the leader");
                    return;
                }
                Ok(false) => failing = false,
                Err(e) => {
                    if !failing {
                        tracing::warn!(error = %e, lease = %self.name, "cannot reach the leader lease; trying again");
                    }
                    failing = true;
                }
            }
            tokio::time::sleep(self.renew_every).await;
        }
    }

    /// Renews the Lease until a renewal fails for longer than the Lease lasts;
    /// returns then (leadership is lost).
    pub async fn hold(&self, client: &Client) {
        let mut last_renewed = tokio::time::Instant::now();
        loop {
            tokio::time::sleep(self.renew_every).await;
            match self.try_take(client).await {
                Ok(true) => last_renewed = tokio::time::Instant::now(),
                Ok(false) => {
                    tracing::error!("another replica took the leader lease");
                    return;
                }
                Err(e) => tracing::warn!(error = %e, "cannot renew the leader lease"),
            }
            if last_renewed.elapsed() >= self.lease_duration {
                tracing::error!("could not renew the leader lease in time");
                return;
            }
        }
    }

    /// Takes or renews the Lease if it is free, expired or already ours.
    async fn try_take(&self, client: &Client) -> kube::Result<bool> {
        let api: Api<Lease> = Api::namespaced(client.clone(), &self.namespace);
        let now = Timestamp::now();
        let spec = |acquired: Option<MicroTime>, transitions: i32| LeaseSpec {
            holder_identity: Some(self.identity.clone()),
            lease_duration_seconds: Some(self.lease_duration.as_secs() as i32),
            acquire_time: acquired.or(Some(MicroTime(now))),
            renew_time: Some(MicroTime(now)),
            lease_transitions: Some(transitions),
            ..Default::default()
        };
        match api.get_opt(&self.name).await? {
            None => {
                let lease = Lease {
                    metadata: ObjectMeta {
                        name: Some(self.name.clone()),
                        ..Default::default()
                    },
                    spec: Some(spec(None, 0)),
                };
                match api.create(&PostParams::default(), &lease).await {
                    Ok(_) => Ok(true),
                    Err(kube::Error::Api(e)) if e.code == 409 => Ok(false),
                    Err(e) => Err(e),
                }
            }
            Some(mut lease) => {
                let current = lease.spec.clone().unwrap_or_default();
                let ours = current.holder_identity.as_deref() == Some(self.identity.as_str());
                let expired = match (&current.renew_time, current.lease_duration_seconds) {
                    (Some(renewed), Some(secs)) => {
                        renewed.0 + SignedDuration::from_secs(secs as i64) < now
                    }
                    _ => true,
                };
                if !ours && !expired {
                    return Ok(false);
                }
                let transitions = current.lease_transitions.unwrap_or(0) + i32::from(!ours);
                let acquired = if ours {
                    current.acquire_time.clone()
                } else {
                    None
                };
                lease.spec = Some(spec(acquired, transitions));
                // Replace with the resourceVersion read: a concurrent taker makes this fail (409).
                match api
                    .replace(&self.name, &PostParams::default(), &lease)
                    .await
                {
                    Ok(_) => Ok(true),
                    Err(kube::Error::Api(e)) if e.code == 409 => Ok(false),
                    Err(e) => Err(e),
                }
            }
        }
    }
}
