//! Failed shards heal: a failure that may pass (a download, a full disk, a
//! peer, a crash while loading, a mismatching download that a fresh fetch
//! may fix) is tried again after a pause that doubles from 10 s up to 5
//! minutes, as Kubernetes restarts a crashing Pod; a permanent one (a spec
//! or model this agent cannot run, a checksum that mismatches again) is not
//! tried again until the Shard's spec changes.
//!
//! ```text
//!  bring_up ──Err──► transient? ──yes──► Failed, nextRetryTime ──pause──► bring_up (restarts + 1)
//!                        └──no───► Failed, no nextRetryTime (until a new generation)
//! ```
//!
//! The record survives recovery: a Ready Shard still shows how often it was
//! restarted and what last went wrong, until it is deleted.

use std::time::Duration;

/// The pause before the first retry; each further one doubles it.
pub const FIRST_PAUSE: Duration = Duration::from_secs(10);
/// The longest pause between retries.
pub const MAX_PAUSE: Duration = Duration::from_secs(300);

/// What the agent remembers of one Shard's failures.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Record {
    /// Retries started so far.
    pub restarts: u32,
    /// The last failure, `Reason: message`.
    pub last_failure: Option<String>,
    /// The last failure's reason.
    pub last_reason: Option<&'static str>,
    /// The spec generation that failed for good (no retry until it changes).
    pub given_up_on: Option<Option<i64>>,
}

impl Record {
    /// Notes a failure of the spec at `generation`; returns the pause before
    /// the next try, or `None` when the failure is permanent.
    pub fn failed(
        &mut self,
        reason: &'static str,
        message: &str,
        generation: Option<i64>,
    ) -> Option<Duration> {
        let again = self.last_reason == Some(reason);
        self.last_failure = Some(format!("{reason}: {message}"));
        self.last_reason = Some(reason);
        if transient(reason, again) {
            self.given_up_on = None;
            Some(pause(self.restarts))
        } else {
            self.given_up_on = Some(generation);
            None
        }
    }

    /// Whether a Failed shard at `generation` may be brought up now: not
    /// while a retry is pending, not when its spec failed for good.
    pub fn may_try(&self, generation: Option<i64>) -> bool {
        self.given_up_on.is_some_and(|g| g != generation)
    }
}

/// Whether trying again can help with `reason` (`again`: the previous
/// failure had the same reason).
pub fn transient(reason: &str, again: bool) -> bool {
    match reason {
        "DownloadFailed" | "PeerCopyFailed" | "DiskFull" | "CacheUnwritable" | "LoadPanicked"
        | "WeightsUnreadable" | "StageCrashed" => true,
        // A tensor group forms again once its ranks are back (or replaced).
        "TensorGroupBroken" | "TensorGroupIncomplete" => true,
        // A Secret can be created, labelled or filled without a new spec.
        "SecretUnreadable" | "SecretNotOptedIn" | "SecretKeyMissing" => true,
        // The mismatching download was discarded: one fresh fetch may bring
        // the right file; the same mismatch twice is the source's.
        "ChecksumMismatch" => !again,
        _ => false,
    }
}

/// The pause before retry number `restarts + 1`.
pub fn pause(restarts: u32) -> Duration {
    FIRST_PAUSE
        .saturating_mul(1 << restarts.min(8))
        .min(MAX_PAUSE)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pauses_double_up_to_five_minutes() {
        let secs: Vec<u64> = (0..8).map(|n| pause(n).as_secs()).collect();
        assert_eq!(secs, [10, 20, 40, 80, 160, 300, 300, 300]);
        assert_eq!(pause(u32::MAX), MAX_PAUSE);
    }

    #[test]
    fn transient_failures_are_retried_and_permanent_ones_wait_for_a_new_spec() {
        let mut record = Record::default();
        assert_eq!(
            record.failed("DownloadFailed", "GET u: HTTP 503", Some(1)),
            Some(FIRST_PAUSE)
        );
        assert!(!record.may_try(Some(1)), "a retry is pending");
        record.restarts += 1;
        assert_eq!(
            record.failed("DiskFull", "10 bytes", Some(1)),
            Some(Duration::from_secs(20))
        );
        assert_eq!(record.last_failure.as_deref(), Some("DiskFull: 10 bytes"));
        record.restarts += 1;
        // A mismatching download is fetched once more, not twice.
        assert!(record.failed("ChecksumMismatch", "x", Some(1)).is_some());
        record.restarts += 1;
        assert_eq!(record.failed("ChecksumMismatch", "x", Some(1)), None);
        assert!(!record.may_try(Some(1)));
        assert!(record.may_try(Some(2)), "a new spec is tried");
        assert_eq!(record.restarts, 3);
        for permanent in [
            "InvalidSpec",
            "UnsupportedModel",
            "ModelTooLarge",
            "CorruptWeights",
        ] {
            let mut record = Record::default();
            assert_eq!(record.failed(permanent, "m", None), None, "{permanent}");
            assert!(!record.may_try(None) && record.may_try(Some(1)));
        }
    }
}
