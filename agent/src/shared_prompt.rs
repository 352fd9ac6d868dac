//! Which running prompt a new one should wait for: a burst of prompts that
//! begin alike (a coding agent's parallel requests under one long system
//! prompt) would otherwise all miss the prefix cache — a prompt's blocks are
//! kept only once its last slice has run — and each compute the shared part.
//!
//! ```text
//!  A: [system prompt ··········][task a]   running, slice by slice
//!  B: [system prompt ··········][task b]   arrives: shares 2 000 tokens with A
//!     └─ waits until A has run, then takes the shared part from the cache
//!        and runs only [task b]
//! ```
//!
//! A prompt waits only when the wait pays: it shares at least a cache block
//! with the running prompt beyond what the cache gave that one (and so is
//! likely to give this one: what is cached already needs no wait), and what
//! the running prompt still has to run is at most four times that gain. The
//! choice is made before the prompt looks in the cache, so a prompt that
//! waits is looked up (and counted) once, when it goes on.

use shardplane_engine::SequenceId;
use shardplane_engine::prefix::DEFAULT_BLOCK_TOKENS;

/// The fewest tokens a wait must save.
pub const MIN_GAIN: usize = DEFAULT_BLOCK_TOKENS;

/// How many times the tokens it saves the leader may still have to run.
pub const MOST_WORK_PER_GAIN: usize = 4;

/// The running prompt `prompt` should wait for, among `running`:
/// `(sequence, its whole prompt, tokens of it the cache gave, tokens it has
/// still to run)`. The one that saves the most wins.
pub fn leader<'a>(
    prompt: &[u32],
    running: impl IntoIterator<Item = (SequenceId, &'a [u32], usize, usize)>,
) -> Option<SequenceId> {
    // The cache always leaves the last token to run.
    let reusable = prompt.len().saturating_sub(1);
    running
        .into_iter()
        .filter_map(|(seq, theirs, cached, left)| {
            let common = prompt
                .iter()
                .zip(theirs)
                .take_while(|(a, b)| a == b)
                .count()
                .min(reusable);
            let gain = common.saturating_sub(cached);
            (gain >= MIN_GAIN && left <= MOST_WORK_PER_GAIN * gain).then_some((gain, seq))
        })
        .max_by_key(|&(gain, seq)| (gain, std::cmp::Reverse(seq)))
        .map(|(_, seq)| seq)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn prompt(shared: usize, own: u32, len: usize) -> Vec<u32> {
        (0..len)
            .map(|i| if i < shared { i as u32 } else { 100_000 + own })
            .collect()
    }

    #[test]
    fn a_prompt_waits_for_the_running_one_it_shares_most_with() {
        let a = prompt(2_000, 1, 2_100);
        let b = prompt(2_000, 2, 2_100);
        let c = prompt(500, 3, 600);
        // A has 1 500 tokens left to run: B saves 2 000 by waiting for it.
        assert_eq!(leader(&b, [(1, &a[..], 0, 1_500)]), Some(1));
        // Of two running prompts, the one B shares more with.
        assert_eq!(
            leader(&b, [(3, &c[..], 0, 100), (1, &a[..], 0, 1_500)]),
            Some(1)
        );
        // A found the shared part in the cache: so will B, without waiting.
        assert_eq!(leader(&b, [(1, &a[..], 2_000, 100)]), None);
    }

    #[test]
    fn a_wait_that_saves_little_or_costs_much_is_not_taken() {
        let a = prompt(20, 1, 3_000);
        let b = prompt(20, 2, 100);
        // 20 tokens in common: less than a block.
        assert_eq!(leader(&b, [(1, &a[..], 0, 3_000)]), None);
        // 100 in common, but A has 3 000 tokens of its own still to run.
        let a = prompt(100, 1, 3_000);
        let b = prompt(100, 2, 200);
        assert_eq!(leader(&b, [(1, &a[..], 0, 2_950)]), None);
        // The same prompt twice: all but its last token can come from A.
        let same = prompt(64, 0, 64);
        assert_eq!(leader(&same, [(1, &same[..], 0, 64)]), Some(1));
        assert_eq!(leader(&same, [(1, &same[..], 16, 48)]), Some(1));
        assert_eq!(leader(&same[..33], [(1, &same[..], 0, 64)]), Some(1));
        assert_eq!(leader(&same[..32], [(1, &same[..], 0, 64)]), None);
    }
}
