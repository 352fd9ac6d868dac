//! Which sequences a step waits for: those the last step answered and that
//! come back quickly.
//!
//! ```text
//!  step n answers A B C ──► head samples, sends A' B' C' (≈ 1 ms) ──┐
//!  step n+1 starts when A' B' C' are all back, or the wait is over ◄┘
//!  wait ≤ 1.5 × (recent return time, leaning to the slow), only if ≤ ¼ of a pass
//! ```
//!
//! A stage that starts its next step as soon as one answered sequence is
//! back splits the decoding sequences into smaller batches: the rest arrive
//! while that step runs and wait for the one after. Every pass reads all of
//! the stage's weights, so two half batches cost nearly twice one full one.
//! The stage learns how long its answered sequences take to come back, and
//! waits for them only where that is a small part of a pass: a whole model's
//! or a last stage's head samples within a millisecond or two; the sequences
//! of a pipeline's first or middle stage come back only after the whole ring
//! and are not waited for.

use std::collections::HashMap;
use std::time::{Duration, Instant};

use shardplane_engine::SequenceId;

/// The part of a pass a step may wait for answered sequences.
const WORTH: f64 = 0.25;

/// How much of the way to a slower return the estimate moves: it follows
/// the slowest returns, so that a step waits for the last of a batch.
const RISE: f64 = 0.5;

/// How much of the way to a quicker return the estimate moves.
const FALL: f64 = 0.05;

/// How much longer than the estimate a step waits.
const SLACK: f64 = 1.5;

/// An answered sequence not heard from again for this long is forgotten.
const FORGET: Duration = Duration::from_secs(60);

/// The sequences the stage answered, and how quickly they return.
#[derive(Debug)]
pub struct Gather {
    /// Answered sequences not back yet, and when they were answered.
    out: HashMap<SequenceId, Instant>,
    /// How many of `out` the last step answered.
    waiting: usize,
    /// When the last step answered.
    answered_at: Instant,
    /// Seconds the last pass took.
    pass: f64,
    /// Seconds an answered sequence takes to send its next row, weighted
    /// towards the slower returns (`None` before the first return).
    back: Option<f64>,
}

impl Default for Gather {
    fn default() -> Self {
        Gather {
            out: HashMap::new(),
            waiting: 0,
            answered_at: Instant::now(),
            pass: 0.0,
            back: None,
        }
    }
}

impl Gather {
    /// A step that took `pass` seconds answered `seqs` just now.
    pub fn answered(&mut self, seqs: impl IntoIterator<Item = SequenceId>, pass: f64) {
        let now = Instant::now();
        // Sequences of earlier steps still count when they come back (their
        // return time is theirs), unless they never do.
        self.out
            .retain(|_, at| now.saturating_duration_since(*at) < FORGET);
        self.waiting = 0;
        for seq in seqs {
            self.out.insert(seq, now);
            self.waiting += 1;
        }
        self.answered_at = now;
        self.pass = pass;
    }

    /// `seq`'s next row arrived; it was sent at `sent`.
    pub fn arrived(&mut self, seq: SequenceId, sent: Instant) {
        let Some(at) = self.forget(seq) else {
            return;
        };
        let took = sent.saturating_duration_since(at).as_secs_f64();
        self.back = Some(match self.back {
            Some(back) if took > back => back + RISE * (took - back),
            Some(back) => back + FALL * (took - back),
            None => took,
        });
    }

    /// `seq` will not come back (released, or its caller left).
    pub fn gone(&mut self, seq: SequenceId) {
        self.forget(seq);
    }

    /// Takes `seq` out, telling when it was answered.
    fn forget(&mut self, seq: SequenceId) -> Option<Instant> {
        let at = self.out.remove(&seq)?;
        if at == self.answered_at {
            self.waiting = self.waiting.saturating_sub(1);
        }
        Some(at)
    }

    /// Nothing more will arrive.
    pub fn closed(&mut self) {
        self.out.clear();
        self.waiting = 0;
    }

    /// How much longer to wait, at `now`, for the sequences the last step
    /// answered that are still out (`None`: do not wait).
    pub fn wait_left(&self, now: Instant) -> Option<Duration> {
        if self.waiting == 0 {
            return None;
        }
        let wait = SLACK * self.back?;
        if wait > WORTH * self.pass {
            return None;
        }
        let deadline = self.answered_at + Duration::try_from_secs_f64(wait).ok()?;
        deadline
            .checked_duration_since(now)
            .filter(|left| !left.is_zero())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ms(n: u64) -> Duration {
        Duration::from_millis(n)
    }

    #[test]
    fn sequences_that_come_back_quickly_are_waited_for_until_all_are_back() {
        let mut g = Gather::default();
        g.answered([1, 2, 3], 0.040);
        // Nothing learnt yet: no wait.
        assert_eq!(g.wait_left(g.answered_at), None);
        g.arrived(1, g.answered_at + ms(2));
        assert_eq!(g.back, Some(0.002));
        // 1.5 times that from the answer, while 2 and 3 are out.
        assert_eq!(g.wait_left(g.answered_at), Some(ms(3)));
        assert_eq!(g.wait_left(g.answered_at + ms(1)), Some(ms(2)));
        assert_eq!(g.wait_left(g.answered_at + ms(3)), None);
        // A slower return moves the estimate half way; a quicker one little.
        g.arrived(2, g.answered_at + ms(4));
        assert!((g.back.unwrap() - 0.003).abs() < 1e-9, "{:?}", g.back);
        assert!(g.wait_left(g.answered_at).is_some());
        g.gone(3);
        assert_eq!(g.wait_left(g.answered_at), None, "all back or gone");
        g.answered([1], 0.040);
        g.arrived(1, g.answered_at + ms(1));
        assert!((g.back.unwrap() - 0.0029).abs() < 1e-9, "{:?}", g.back);
    }

    #[test]
    fn a_sequence_back_after_the_next_step_began_counts_from_its_own_answer() {
        let mut g = Gather {
            back: Some(0.001),
            ..Gather::default()
        };
        g.answered([1, 2], 0.040);
        let first = g.answered_at;
        // The next step ran with 1 alone; 2 comes back 5 ms after its answer.
        g.arrived(1, first);
        std::thread::sleep(ms(2));
        g.answered([1], 0.040);
        assert_eq!(g.waiting, 1, "2 is not the last step's");
        g.arrived(2, first + ms(5));
        assert_eq!(g.waiting, 1);
        assert!((g.back.unwrap() - 0.002975).abs() < 1e-9, "{:?}", g.back);
        assert!(g.wait_left(g.answered_at).is_some(), "1 is still out");
    }

    #[test]
    fn sequences_that_come_back_after_a_ring_are_not_waited_for() {
        let mut g = Gather::default();
        g.answered([1, 2], 0.040);
        // A middle stage: the next row comes after the other stages' passes.
        g.arrived(1, g.answered_at + ms(30));
        assert_eq!(g.wait_left(g.answered_at), None);
        // Rows that were not answered teach nothing.
        g.arrived(9, g.answered_at + ms(1));
        assert_eq!(g.back, Some(0.030));
    }

    #[test]
    fn a_closed_queue_ends_the_wait() {
        let mut g = Gather {
            back: Some(0.001),
            ..Gather::default()
        };
        g.answered([1, 2], 0.040);
        assert!(g.wait_left(g.answered_at).is_some());
        g.closed();
        assert_eq!(g.wait_left(g.answered_at), None);
    }
}
