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
//! while that step runs and wait for the one after. The stage learns how long
//! its answered sequences take to come back, and waits for them only where
//! that is a small part of a decode pass: a whole model's head samples within
//! a millisecond or two; the sequences of any stage of a pipeline come back
//! only after the other stages' passes and are not waited for.

use std::collections::HashMap;
use std::time::{Duration, Instant};

use shardplane_engine::SequenceId;

/// The part of a pass a step may wait for answered sequences.
const WORTH: f64 = 0.25;

/// How much of the way to a slower return the estimate moves: it follows
/// the slowest returns, so that a step waits for the last of a batch.
const RISE: f64 = 0.5;

/// How much of the way to a quicker return the estimate moves.
const FALL: f64 = 0.1;

/// How much longer than the estimate a step waits.
const SLACK: f64 = 1.5;

/// An answered sequence not heard from again for this long is forgotten.
const FORGET: Duration = Duration::from_secs(60);

/// The sequences the stage answered, and how quickly they return.
#[derive(Debug)]
pub struct Gather {
    /// Answered sequences not back yet: the step that answered them, when,
    /// and what a decode pass then cost.
    out: HashMap<SequenceId, Answered>,
    /// The last step that answered (its number counts the steps so far).
    last: Answered,
    /// How many of `out` the last step answered.
    waiting: usize,
    /// Seconds an answered sequence takes to send its next row, weighted
    /// towards the slower returns (`None` before the first return).
    back: Option<f64>,
}

/// When a sequence was answered.
#[derive(Debug, Clone, Copy)]
struct Answered {
    step: u64,
    at: Instant,
    /// Seconds a pass of the step's answered sequences costs.
    pass: f64,
}

impl Default for Gather {
    fn default() -> Self {
        Gather {
            out: HashMap::new(),
            last: Answered {
                step: 0,
                at: Instant::now(),
                pass: 0.0,
            },
            waiting: 0,
            back: None,
        }
    }
}

impl Gather {
    /// A step answered `seqs` at `at`; a pass of them alone costs `pass`
    /// seconds.
    pub fn answered(&mut self, seqs: impl IntoIterator<Item = SequenceId>, at: Instant, pass: f64) {
        // Sequences of earlier steps still count when they come back (their
        // return time is theirs), unless they never do.
        self.out
            .retain(|_, a| at.saturating_duration_since(a.at) < FORGET);
        self.last = Answered {
            step: self.last.step + 1,
            at,
            pass,
        };
        for seq in seqs {
            self.out.insert(seq, self.last);
        }
        self.waiting = self
            .out
            .values()
            .filter(|a| a.step == self.last.step)
            .count();
    }

    /// `seq`'s next row arrived; it was sent at `sent`.
    pub fn arrived(&mut self, seq: SequenceId, sent: Instant) {
        let Some(a) = self.forget(seq) else {
            return;
        };
        // A return slower than a pass (a stall, a client that stopped
        // reading) counts as one pass: enough to stop waiting for it, not
        // enough to keep the stage from waiting long after.
        let took = sent
            .saturating_duration_since(a.at)
            .as_secs_f64()
            .min(a.pass.max(f64::MIN_POSITIVE));
        self.back = Some(match self.back {
            Some(back) if took > back => back + RISE * (took - back),
            Some(back) => back + FALL * (took - back),
            None => took,
        });
    }

    /// Answered sequences not back yet (decoding, between this stage's
    /// passes).
    pub fn out(&self) -> usize {
        self.out.len()
    }

    /// `seq` will not come back (released).
    pub fn gone(&mut self, seq: SequenceId) {
        self.forget(seq);
    }

    /// Takes `seq` out, telling when it was answered.
    fn forget(&mut self, seq: SequenceId) -> Option<Answered> {
        let a = self.out.remove(&seq)?;
        if a.step == self.last.step {
            self.waiting = self.waiting.saturating_sub(1);
        }
        Some(a)
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
        if wait > WORTH * self.last.pass {
            return None;
        }
        let deadline = self.last.at + Duration::try_from_secs_f64(wait).ok()?;
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
        let t = Instant::now();
        let mut g = Gather::default();
        g.answered([1, 2, 3], t, 0.040);
        // Nothing learnt yet: no wait.
        assert_eq!(g.wait_left(t), None);
        g.arrived(1, t + ms(2));
        assert_eq!(g.back, Some(0.002));
        // 1.5 times that from the answer, while 2 and 3 are out.
        assert_eq!(g.wait_left(t), Some(ms(3)));
        assert_eq!(g.wait_left(t + ms(1)), Some(ms(2)));
        assert_eq!(g.wait_left(t + ms(3)), None);
        // A slower return moves the estimate half way; a quicker one a tenth.
        g.arrived(2, t + ms(4));
        assert!((g.back.unwrap() - 0.003).abs() < 1e-9, "{:?}", g.back);
        assert!(g.wait_left(t).is_some());
        g.gone(3);
        assert_eq!(g.wait_left(t), None, "all back or gone");
        g.answered([1], t + ms(10), 0.040);
        g.arrived(1, t + ms(11));
        assert!((g.back.unwrap() - 0.0028).abs() < 1e-9, "{:?}", g.back);
    }

    #[test]
    fn a_sequence_back_after_the_next_step_began_counts_from_its_own_answer() {
        let t = Instant::now();
        let mut g = Gather {
            back: Some(0.001),
            ..Gather::default()
        };
        g.answered([1, 2], t, 0.040);
        // The next step ran with 1 alone; 2 comes back 5 ms after its answer.
        g.arrived(1, t);
        g.answered([1], t + ms(2), 0.040);
        assert_eq!(g.waiting, 1, "2 is not the last step's");
        g.arrived(2, t + ms(5));
        assert_eq!(g.waiting, 1);
        assert!((g.back.unwrap() - 0.00295).abs() < 1e-9, "{:?}", g.back);
        assert!(g.wait_left(t + ms(2)).is_some(), "1 is still out");
    }

    #[test]
    fn one_stalled_return_counts_as_a_pass_and_is_soon_forgotten() {
        let t = Instant::now();
        let mut g = Gather {
            back: Some(0.001),
            ..Gather::default()
        };
        g.answered([1, 2], t, 0.040);
        // 2 s (a client that stopped reading): counted as the 40 ms pass.
        g.arrived(1, t + ms(2_000));
        assert!((g.back.unwrap() - 0.0205).abs() < 1e-9, "{:?}", g.back);
        assert_eq!(g.wait_left(t), None);
        // Quick returns bring the wait back within a few steps.
        let mut steps = 0;
        while g.wait_left(g.last.at).is_none() {
            steps += 1;
            let at = t + ms(100 * steps);
            g.answered([1, 2, 3, 4], at, 0.040);
            for seq in 1..=4 {
                g.arrived(seq, at + ms(1));
            }
            g.answered([1, 2], at + ms(50), 0.040);
        }
        assert!(steps <= 3, "{steps} steps");
    }

    #[test]
    fn sequences_that_come_back_after_a_ring_are_not_waited_for() {
        let t = Instant::now();
        let mut g = Gather::default();
        g.answered([1, 2], t, 0.040);
        // A pipeline's stage: the next row comes after the other stages' passes.
        g.arrived(1, t + ms(30));
        assert_eq!(g.wait_left(t), None);
        // Rows that were not answered teach nothing.
        g.arrived(9, t + ms(1));
        assert_eq!(g.back, Some(0.030));
    }

    #[test]
    fn a_closed_queue_ends_the_wait() {
        let t = Instant::now();
        let mut g = Gather {
            back: Some(0.001),
            ..Gather::default()
        };
        g.answered([1, 2], t, 0.040);
        assert!(g.wait_left(t).is_some());
        g.closed();
        assert_eq!(g.wait_left(t), None);
    }
}
