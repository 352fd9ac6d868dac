//! Leader election on a Lease: of several operator replicas, only the holder
//! of the Lease runs controllers. A holder that cannot renew in time steps
//! down (the process exits and is restarted) so two never act at once.
//!
//! ```text
//!  standby ──try_take every renew_every──► leader ──renew──► leader
//!     │ ready while the API server answers     │ no renewal succeeds within
//!     ▼                                        ▼ the renew deadline (⅔ lease)
//!  not ready (API server unreachable)       steps down (process exits)
//! ```
//!
//! Time is the operator's own: a standby counts a Lease as expired when its
//! record has not changed for a whole `lease_duration` on the standby's
//! monotonic clock (as client-go does), never by comparing the holder's
//! written `renewTime` with its own wall clock, so skewed clocks cannot make
//! two leaders. The leader steps down at the renew deadline, a third of a
//! lease before any standby may take over.
//!
//! Readiness does not depend on leadership: a standby that reaches the API
//! server is ready to take over, so rollouts, `helm install --wait` and GitOps
//! health checks complete with standbys. Who leads shows in the
//! `shardplane_operator_leader` gauge and the Lease's holder.

use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use tokio::time::Instant;

use k8s_openapi::api::coordination::v1::{Lease, LeaseSpec};
use k8s_openapi::api::core::v1::Namespace;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::MicroTime;
use k8s_openapi::jiff::Timestamp;
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

/// The Lease's record as a standby last saw it, and when (on its own clock).
#[derive(Debug, Default)]
pub struct Observed {
    record: Option<(Option<String>, Option<MicroTime>)>,
    since: Option<Instant>,
}

impl Observed {
    /// Notes the record read now; whether it has stood unchanged for `lease`.
    fn stale_for(&mut self, record: (Option<String>, Option<MicroTime>), lease: Duration) -> bool {
        let now = Instant::now();
        if self.record.as_ref() != Some(&record) {
            self.record = Some(record);
            self.since = Some(now);
        }
        self.since
            .is_some_and(|since| now.duration_since(since) >= lease)
    }
}

/// The leader's contact with the API server, as its renewals show it. A
/// node's Lease counts as expired only once a renewal has succeeded after
/// the moment it expired (an agent cannot renew through an API server the
/// operator cannot reach either), and its time runs only from when contact
/// was last restored.
#[derive(Debug)]
pub struct Contact {
    state: std::sync::Mutex<ContactState>,
}

/// When the leader last renewed, and since when renewals have come without
/// a gap.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ContactState {
    /// The last successful renewal.
    pub last: Instant,
    /// Since when renewals have come without a gap.
    pub since: Instant,
}

impl Contact {
    /// Contact as of now (a leader has just renewed to become one).
    pub fn new() -> Contact {
        let now = Instant::now();
        Contact {
            state: std::sync::Mutex::new(ContactState {
                last: now,
                since: now,
            }),
        }
    }

    /// A renewal succeeded now; more than `gap` after the one before, it
    /// restores contact.
    pub fn renewed(&self, gap: Duration) {
        let now = Instant::now();
        let mut s = self.state.lock().expect("contact lock");
        if now.duration_since(s.last) > gap {
            s.since = now;
        }
        s.last = now;
    }

    /// The contact as of now.
    pub fn state(&self) -> ContactState {
        *self.state.lock().expect("contact lock")
    }

    /// The fence on the leader's writes: `Err(age)` once the last renewal
    /// is `renew_deadline` old or older. The leader steps down then, but a
    /// reconcile already running must not write after it: a standby may
    /// lead by now.
    pub fn fence(&self, renew_deadline: Duration) -> Result<(), Duration> {
        self.state().fence_at(Instant::now(), renew_deadline)
    }
}

impl ContactState {
    /// [`Contact::fence`] at `now`.
    pub fn fence_at(&self, now: Instant, renew_deadline: Duration) -> Result<(), Duration> {
        let age = now.saturating_duration_since(self.last);
        if age >= renew_deadline {
            Err(age)
        } else {
            Ok(())
        }
    }
}

impl Default for Contact {
    fn default() -> Self {
        Contact::new()
    }
}

impl Election {
    /// The longest pause between two renewals that still counts as unbroken
    /// contact with the API server: two renewal periods.
    pub fn contact_gap(&self) -> Duration {
        self.renew_every * 2
    }

    /// How long the leader keeps trying to renew before it steps down: two
    /// thirds of the lease, so it has stopped acting well before a standby
    /// may take the Lease.
    pub fn renew_deadline(&self) -> Duration {
        self.lease_duration * 2 / 3
    }

    /// Waits until this replica holds the Lease. `ready` says whether the
    /// last try reached the API server (a standby that does is ready to take
    /// over); a failed try is logged and tried again.
    pub async fn acquire(&self, client: &Client, ready: &AtomicBool) {
        let (mut failing, mut namespace_seen) = (false, false);
        let mut observed = Observed::default();
        loop {
            let tried = match namespace_seen {
                true => self.try_take(client, &mut observed).await,
                false => match ensure_namespace(client, &self.namespace).await {
                    Ok(()) => {
                        namespace_seen = true;
                        self.try_take(client, &mut observed).await
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

    /// Renews the Lease until no renewal succeeds within the renew deadline
    /// (each call is cut off at it, so a hung API server cannot hold a
    /// renewal past it); returns then (leadership is lost). Each success is
    /// noted in `contact`.
    pub async fn hold(&self, client: &Client, contact: &Contact) {
        let deadline = self.renew_deadline();
        let mut last_renewed = Instant::now();
        let mut wait = self.renew_every;
        loop {
            tokio::time::sleep(wait).await;
            let left = deadline.saturating_sub(last_renewed.elapsed());
            let mut observed = Observed::default();
            match tokio::time::timeout(left, self.try_take(client, &mut observed)).await {
                Ok(Ok(true)) => {
                    last_renewed = Instant::now();
                    contact.renewed(self.contact_gap());
                    wait = self.renew_every;
                }
                Ok(Ok(false)) => {
                    tracing::error!("another replica took the leader lease");
                    return;
                }
                Ok(Err(e)) => {
                    tracing::warn!(error = %e, "cannot renew the leader lease");
                    // Try again sooner while the deadline runs.
                    wait = self.renew_every / 3;
                }
                Err(_) => tracing::warn!("renewing the leader lease timed out"),
            }
            if last_renewed.elapsed() >= deadline {
                tracing::error!(
                    deadline_seconds = deadline.as_secs_f64(),
                    "could not renew the leader lease before the renew deadline; stepping down"
                );
                return;
            }
        }
    }

    /// Gives the Lease up at a clean stop, so a standby (or the next start)
    /// leads at once instead of waiting a lease out.
    pub async fn release(&self, client: &Client) {
        let api: Api<Lease> = Api::namespaced(client.clone(), &self.namespace);
        let Ok(Some(mut lease)) = api.get_opt(&self.name).await else {
            return;
        };
        let spec = lease.spec.get_or_insert_with(Default::default);
        if spec.holder_identity.as_deref() != Some(self.identity.as_str()) {
            return;
        }
        spec.holder_identity = None;
        spec.renew_time = None;
        match api
            .replace(&self.name, &PostParams::default(), &lease)
            .await
        {
            Ok(_) => tracing::info!(lease = %self.name, "gave up the leader lease"),
            Err(e) => tracing::warn!(error = %e, "cannot give up the leader lease"),
        }
    }

    /// Takes or renews the Lease if it is free, expired or already ours.
    async fn try_take(&self, client: &Client, observed: &mut Observed) -> kube::Result<bool> {
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
                // Unchanged for the holder's lease duration on this clock.
                let lasts = current
                    .lease_duration_seconds
                    .map_or(
                        self.lease_duration,
                        |s| Duration::from_secs(s.max(0) as u64),
                    );
                let record = (current.holder_identity.clone(), current.renew_time.clone());
                let expired =
                    current.holder_identity.is_none() || observed.stale_for(record, lasts);
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn writes_are_fenced_once_the_last_renewal_passes_the_renew_deadline() {
        let start = Instant::now();
        let state = ContactState {
            last: start,
            since: start,
        };
        let deadline = Duration::from_secs(10);
        assert_eq!(state.fence_at(start, deadline), Ok(()));
        assert_eq!(
            state.fence_at(start + Duration::from_secs(9), deadline),
            Ok(())
        );
        assert_eq!(
            state.fence_at(start + Duration::from_secs(10), deadline),
            Err(Duration::from_secs(10))
        );
        assert!(Contact::new().fence(deadline).is_ok());
    }
}
