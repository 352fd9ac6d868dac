//! The walk of one request through a deployment's ready instances, then
//! its fallback chain (other deployments, external endpoints), up to an
//! answer's first token; repeated with growing pauses while every instance
//! is only busy.
//!
//! ```text
//!  complete ─► walk: deployment ─► instances (affinity, load, ejected last)
//!                 │ busy / failed before the first token: next
//!                 └─► fallbacks in order ─► answer (counted when a fallback served it)
//!              every one busy ─► pause 0.25 s … 2 s ─► walk again, up to the busy wait
//! ```

use std::collections::HashSet;
use std::time::Duration;

use kube::runtime::reflector::ObjectRef;
use shardplane_crds::FallbackTarget;

use super::{Attempt, Instance, Router, affinity, kept_alive, outliers};
use crate::metrics::Metrics;
use crate::protocol::{Answer, ApiError, Prompt};

/// What one walk through a deployment's instances and fallbacks ended with.
struct Walked {
    error: ApiError,
    /// Some instance refused only because it was busy.
    busy: bool,
}

impl Router {
    /// Starts answering `prompt` with the model called `name`: the first ready
    /// instance that produces a first token, through the fallback chain.
    /// While an instance is only busy (admission refused it), the walk is
    /// tried again with a growing pause (0.25 s up to 2 s) for up to the
    /// router's busy wait; a client that leaves ends the wait.
    pub async fn complete(&self, name: &str, prompt: &Prompt) -> Result<Answer, ApiError> {
        let mut wait = BusyWait::new(self.busy_wait);
        loop {
            match self.walk(name, prompt).await {
                Ok(answer) => {
                    return Ok(Answer {
                        events: kept_alive(answer.events, self.keepalive),
                        ..answer
                    });
                }
                Err(Walked { busy: true, error }) => {
                    if !wait.pause(&self.metrics, name).await {
                        return Err(error);
                    }
                }
                Err(walked) => return Err(walked.error),
            }
        }
    }

    /// One walk through the deployment's ready instances, then its fallbacks.
    async fn walk(&self, name: &str, prompt: &Prompt) -> Result<Answer, Walked> {
        let Some(first) = self.deployment_for(name) else {
            return Err(Walked {
                error: ApiError::unknown_model(name),
                busy: false,
            });
        };
        let keys = affinity::Keys::of(prompt);
        let mut tried = Vec::new();
        let (mut busy, mut failed) = (0, 0);
        let mut seen = HashSet::new();
        let own = first.metadata.name.clone().unwrap_or_default();
        let mut chain = vec![FallbackTarget::Deployment(own.clone())];
        let ns = first.metadata.namespace.clone().unwrap_or_default();
        while !chain.is_empty() {
            let target = chain.remove(0);
            match target {
                FallbackTarget::Deployment(dep_name) => {
                    if !seen.insert(dep_name.clone()) {
                        continue;
                    }
                    let Some(d) = self.deployments.get(&ObjectRef::new(&dep_name).within(&ns))
                    else {
                        tried.push(format!("deployment {dep_name} does not exist"));
                        continue;
                    };
                    let instances = self.instances_for(&d, Some(&keys));
                    if instances.is_empty() {
                        tried.push(format!("deployment {dep_name} has no ready instance"));
                    }
                    for inst in instances {
                        tracing::debug!(model = name, instance = %inst.key, endpoint = %inst.endpoint, "trying an instance");
                        match self.try_instance(name, &dep_name, &inst, prompt).await {
                            Ok(answer) => {
                                self.outliers.succeeded(&inst.key);
                                self.holders_lock().served(&keys, &inst.holder());
                                if dep_name != own {
                                    self.answered_by_fallback(name, &dep_name, &tried);
                                }
                                return Ok(answer);
                            }
                            Err(Attempt::Fail(error)) => return Err(Walked { error, busy: false }),
                            Err(Attempt::Busy(why)) => {
                                busy += 1;
                                tracing::debug!(model = name, instance = %inst.key, %why, "instance busy; trying the next");
                                tried.push(format!("{}: {why}", inst.key));
                            }
                            Err(Attempt::Next(why) | Attempt::Broke(why)) => {
                                failed += 1;
                                self.metrics
                                    .upstream_errors
                                    .with_label_values(&[name, "instance"])
                                    .inc();
                                tracing::warn!(model = name, instance = %inst.key, %why, "instance failed before its first token; trying the next");
                                self.eject_if_failing(name, &inst);
                                tried.push(format!("{}: {why}", inst.key));
                            }
                        }
                    }
                    // Its own fallbacks come after the ones already queued.
                    chain.extend(d.spec.fallback.iter().cloned());
                }
                FallbackTarget::External(ext) => {
                    match self.try_external(name, &ns, &ext, prompt).await {
                        Ok(answer) => {
                            self.answered_by_fallback(name, "external", &tried);
                            return Ok(answer);
                        }
                        Err(Attempt::Fail(error)) => return Err(Walked { error, busy: false }),
                        Err(Attempt::Next(why) | Attempt::Broke(why) | Attempt::Busy(why)) => {
                            failed += 1;
                            self.metrics
                                .upstream_errors
                                .with_label_values(&[name, "external"])
                                .inc();
                            tried.push(format!("{}: {why}", ext.base_url));
                        }
                    }
                }
            }
        }
        let error = if busy > 0 && failed == 0 {
            ApiError::overloaded(format!(
                "every instance of {name:?} is busy; retry shortly ({})",
                tried.join("; ")
            ))
        } else {
            ApiError::unavailable(format!(
                "no instance of {name:?} can answer now ({})",
                tried.join("; ")
            ))
        };
        Err(Walked {
            error,
            busy: busy > 0,
        })
    }

    /// A fallback (`fallback`: a deployment's name, or `external`) answered
    /// for `name` after what `tried` says: counted, and said in the log (at info),
    /// so that a deployment that cannot serve is not hidden by its fallback.
    fn answered_by_fallback(&self, name: &str, fallback: &str, tried: &[String]) {
        self.metrics
            .fallback_answers
            .with_label_values(&[name, fallback])
            .inc();
        // Info, not a warning: a deployment may overflow to a fallback by design.
        tracing::info!(model = name, fallback, tried = %tried.join("; "), "a fallback answered: the model's own deployment could not");
    }

    /// Notes a failure of instance `inst` (serving `name`); one failure too
    /// many ejects it for a while.
    fn eject_if_failing(&self, name: &str, inst: &Instance) {
        let key = inst.key.as_str();
        if let Some(ejected) = self.outliers.failed(key) {
            self.metrics.ejections.with_label_values(&[name]).inc();
            // Its prefix cache is not counted on while it keeps failing.
            self.holders_lock().forget(&inst.holder());
            tracing::warn!(model = name, instance = %key, seconds = ejected.as_secs(), "instance failed {} times in a row; tried last for a while", outliers::EJECT_AFTER);
            let shards = self.shards.state();
            self.outliers.retain(|k| {
                shards.iter().any(|s| {
                    k.split_once('/').is_some_and(|(ns, name)| {
                        s.metadata.namespace.as_deref() == Some(ns)
                            && s.metadata.name.as_deref() == Some(name)
                    })
                })
            });
        }
    }
}

/// The pauses of a request that only busy instances stand in the way of:
/// 0.25 s growing to 2 s, until the router's busy wait is spent.
pub(super) struct BusyWait {
    deadline: tokio::time::Instant,
    pause: Duration,
}

impl BusyWait {
    pub(super) fn new(budget: Duration) -> Self {
        BusyWait {
            deadline: tokio::time::Instant::now() + budget,
            pause: Duration::from_millis(250),
        }
    }

    /// Sleeps the next pause and says true, or says false when it would
    /// end past the deadline.
    pub(super) async fn pause(&mut self, metrics: &Metrics, model: &str) -> bool {
        if tokio::time::Instant::now() + self.pause >= self.deadline {
            return false;
        }
        metrics.busy_waits.with_label_values(&[model]).inc();
        tokio::time::sleep(self.pause).await;
        self.pause = (self.pause * 2).min(Duration::from_secs(2));
        true
    }
}
