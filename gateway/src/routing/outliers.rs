//! Outlier ejection: an instance that failed before its first token
//! [`EJECT_AFTER`] times in a row is tried after every other instance for a
//! while (10 s, doubling with each ejection in a row up to 5 minutes), so
//! requests stop paying for a broken instance its Shard's status does not
//! show yet (a hung agent, a broken link). It is never skipped: when it is
//! the only one left it is still tried, and one answer started on it ends
//! its ejection.
//!
//! ```text
//!  failure ─► consecutive += 1 ─► ≥ EJECT_AFTER ─► tried last until now + 10 s × 2^(ejections)
//!  success ─► forgotten
//! ```

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// Failures in a row before an instance is ejected.
pub const EJECT_AFTER: u32 = 3;
/// The first ejection's length; each ejection in a row doubles it.
pub const BASE_EJECTION: Duration = Duration::from_secs(10);
/// The longest ejection.
pub const MAX_EJECTION: Duration = Duration::from_secs(300);

#[derive(Debug, Default, Clone, Copy)]
struct Health {
    /// Failures since the last success or ejection.
    consecutive: u32,
    /// Ejections since the last success.
    ejections: u32,
    /// Tried last until then.
    until: Option<Instant>,
}

/// The instances' recent failures, by instance key (`namespace/head shard`):
/// only instances that failed since their last success are held.
#[derive(Debug, Clone, Default)]
pub struct Outliers {
    health: Arc<Mutex<HashMap<String, Health>>>,
}

impl Outliers {
    /// `key` failed before its first token now; returns how long it is
    /// ejected for when this failure ejects it.
    pub fn failed(&self, key: &str) -> Option<Duration> {
        self.failed_at(key, Instant::now())
    }

    fn failed_at(&self, key: &str, now: Instant) -> Option<Duration> {
        let mut health = self.health.lock().expect("outliers lock");
        let h = health.entry(key.to_string()).or_default();
        h.consecutive += 1;
        if h.consecutive < EJECT_AFTER {
            return None;
        }
        let ejection = BASE_EJECTION
            .saturating_mul(1 << h.ejections.min(10))
            .min(MAX_EJECTION);
        h.consecutive = 0;
        h.ejections += 1;
        h.until = Some(now + ejection);
        Some(ejection)
    }

    /// `key` started an answer: its failures are forgotten.
    pub fn succeeded(&self, key: &str) {
        self.health.lock().expect("outliers lock").remove(key);
    }

    /// `instances` with the ones ejected now moved to the end (each part
    /// keeps its order).
    pub fn ejected_last<T>(&self, instances: Vec<T>, key: impl Fn(&T) -> &str) -> Vec<T> {
        self.ejected_last_at(instances, key, Instant::now())
    }

    fn ejected_last_at<T>(
        &self,
        instances: Vec<T>,
        key: impl Fn(&T) -> &str,
        now: Instant,
    ) -> Vec<T> {
        let health = self.health.lock().expect("outliers lock");
        let ejected = |k: &str| {
            health
                .get(k)
                .and_then(|h| h.until)
                .is_some_and(|until| until > now)
        };
        let (out, mut last): (Vec<T>, Vec<T>) =
            instances.into_iter().partition(|i| !ejected(key(i)));
        let mut out = out;
        out.append(&mut last);
        out
    }

    /// Forgets instances that no longer exist (`exists` says which do), so
    /// the map holds only current instances.
    pub fn retain(&self, exists: impl Fn(&str) -> bool) {
        self.health
            .lock()
            .expect("outliers lock")
            .retain(|k, _| exists(k));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_instance_failing_in_a_row_goes_last_for_a_growing_while() {
        let o = Outliers::default();
        let t0 = Instant::now();
        let order = |at: Instant| o.ejected_last_at(vec!["a", "b", "c"], |s| s, at);
        assert_eq!(o.failed_at("a", t0), None);
        assert_eq!(o.failed_at("a", t0), None);
        assert_eq!(order(t0), ["a", "b", "c"], "two failures eject nothing");
        assert_eq!(o.failed_at("a", t0), Some(BASE_EJECTION));
        assert_eq!(order(t0), ["b", "c", "a"]);
        // Its time passes: first again.
        assert_eq!(
            order(t0 + BASE_EJECTION + Duration::from_millis(1)),
            ["a", "b", "c"]
        );
        // Ejected again in a row: twice as long.
        for _ in 0..EJECT_AFTER - 1 {
            assert_eq!(o.failed_at("a", t0), None);
        }
        assert_eq!(o.failed_at("a", t0), Some(BASE_EJECTION * 2));
        // A success forgets it all.
        o.succeeded("a");
        assert_eq!(order(t0), ["a", "b", "c"]);
        for _ in 0..EJECT_AFTER - 1 {
            o.failed_at("a", t0);
        }
        assert_eq!(o.failed_at("a", t0), Some(BASE_EJECTION));
    }

    #[test]
    fn ejections_are_bounded_and_every_instance_is_still_tried() {
        let o = Outliers::default();
        let t0 = Instant::now();
        let mut longest = Duration::ZERO;
        for _ in 0..200 {
            if let Some(d) = o.failed_at("a", t0) {
                longest = d;
            }
        }
        assert_eq!(longest, MAX_EJECTION);
        for _ in 0..EJECT_AFTER {
            o.failed_at("b", t0);
        }
        // Both ejected: both still tried, in their order.
        assert_eq!(o.ejected_last_at(vec!["a", "b"], |s| s, t0), ["a", "b"]);
        o.retain(|k| k == "b");
        assert_eq!(o.ejected_last_at(vec!["a", "b"], |s| s, t0), ["a", "b"]);
        assert_eq!(o.health.lock().unwrap().len(), 1);
    }
}
