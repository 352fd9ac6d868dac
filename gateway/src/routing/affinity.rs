//! Which ready instance a request prefers: the one most likely to hold its
//! prompt's beginning in its prefix cache, unless that one carries more than
//! its share of the load.
//!
//! ```text
//!  prompt ─► key: hash of what starts it (system messages and the first one
//!            after them, tools, template settings; or the first KiB of text)
//!  instances ─► within the load bound? ── yes ─► holders of the key first, least
//!                                      │         loaded first; then by rendezvous
//!                                      │         score of (key, instance)
//!                                      └─ no ──► after them, least loaded first
//!  bound: an instance takes a request while its outstanding requests are
//!         under ⌈1.25 × (all outstanding + 1) / instances⌉
//!  holders: the instances that started an answer for the key in the last 10 min
//! ```
//!
//! The key is the same for every turn of one conversation (its first
//! messages do not change), so a conversation keeps to one instance and
//! finds its history cached there; conversations spread over the instances
//! by the rendezvous score, and one hot prefix cannot pile onto one instance
//! past the bound (Mirrokni et al.'s consistent hashing with bounded loads).
//!
//! A hot prefix that overflowed onto a second instance is cached there too.
//! From then on both hold it, and the less loaded of them takes the next
//! request: by score alone, the first would take requests up to the bound
//! while the second idled (a burst of 8 like requests split 5 : 3 on two
//! instances, never 4 : 4). A conversation whose turn once overflowed may
//! then move between its holders, and recompute what only the other holds
//! of its history.

use std::collections::HashMap;
use std::hash::{DefaultHasher, Hash, Hasher};
use std::time::{Duration, Instant};

use crate::protocol::{Input, Prompt};

/// The bound's slack over an even share.
const SLACK: f64 = 1.25;

/// Bytes of raw text the key covers.
const TEXT_BYTES: usize = 1024;

/// How long an instance counts as holding a key's prefix after it last
/// started an answer for it (an agent's prefix cache evicts by use).
const HELD_FOR: Duration = Duration::from_secs(600);

/// Keys whose holders are remembered; past this, the least recently served
/// quarter is forgotten.
const KEYS: usize = 4096;

/// The instances that lately started an answer for each key.
#[derive(Debug, Default)]
pub(crate) struct Holders {
    by_key: HashMap<u64, Vec<(String, Instant)>>,
}

impl Holders {
    /// `instance` started an answer for `key`.
    pub(crate) fn served(&mut self, key: u64, instance: &str) {
        let now = Instant::now();
        let held = self.by_key.entry(key).or_default();
        held.retain(|(name, at)| name != instance && now.duration_since(*at) < HELD_FOR);
        held.push((instance.to_string(), now));
        if self.by_key.len() > KEYS {
            let mut last: Vec<(Instant, u64)> = self
                .by_key
                .iter()
                .map(|(k, held)| (held.last().map_or(now, |(_, at)| *at), *k))
                .collect();
            last.sort_unstable();
            for (_, k) in last.into_iter().take(KEYS / 4) {
                self.by_key.remove(&k);
            }
        }
    }

    /// The instances holding `key`, the most recent first.
    pub(crate) fn of(&self, key: u64) -> Vec<String> {
        let now = Instant::now();
        // Each list is kept in the order served.
        self.by_key
            .get(&key)
            .into_iter()
            .flatten()
            .rev()
            .filter(|(_, at)| now.duration_since(*at) < HELD_FOR)
            .map(|(name, _)| name.clone())
            .collect()
    }
}

/// The messages every later turn of a conversation repeats: the leading
/// system (or developer) messages and the first message after them.
fn opening(messages: &[shardplane_dataplane::ChatMessage]) -> &[shardplane_dataplane::ChatMessage] {
    let leading = messages
        .iter()
        .take_while(|m| m.role == "system" || m.role == "developer")
        .count();
    &messages[..(leading + 1).min(messages.len())]
}

/// The key of what starts `prompt`.
pub(crate) fn key(prompt: &Prompt) -> u64 {
    let mut h = DefaultHasher::new();
    match &prompt.input {
        Input::Chat(c) => {
            0u8.hash(&mut h);
            for m in opening(&c.messages) {
                m.role.hash(&mut h);
                m.content.hash(&mut h);
            }
            // Templates put tools and their settings near the start.
            c.template_vars.hash(&mut h);
            c.thinking.hash(&mut h);
            if let Some(tools) = &prompt.tools {
                for t in &tools.tools {
                    t.name.hash(&mut h);
                    t.description.hash(&mut h);
                    t.parameters.hash(&mut h);
                }
            }
        }
        Input::Text(t) => {
            1u8.hash(&mut h);
            let mut end = t.len().min(TEXT_BYTES);
            while !t.is_char_boundary(end) {
                end -= 1;
            }
            t[..end].hash(&mut h);
        }
    }
    h.finish()
}

/// How much `instance` suits `key`: the highest score is preferred.
fn score(key: u64, instance: &str) -> u64 {
    let mut h = DefaultHasher::new();
    key.hash(&mut h);
    instance.hash(&mut h);
    h.finish()
}

/// Orders `(load, instance key, item)`: those under the load bound first —
/// the `holders` of `key` (most recent first) least loaded first, then the
/// others by their score for `key` — then the rest, least loaded first.
pub(crate) fn order<T>(
    key: u64,
    candidates: Vec<(usize, String, T)>,
    holders: &[String],
) -> Vec<T> {
    let n = candidates.len().max(1);
    let total: usize = candidates.iter().map(|(load, _, _)| load).sum();
    let bound = ((total + 1) as f64 * SLACK / n as f64).ceil() as usize;
    let mut ranked: Vec<_> = candidates
        .into_iter()
        .map(|(load, name, item)| {
            let over = load >= bound.max(1);
            let held = holders.iter().position(|h| *h == name);
            // Under the bound: holders by load (then recency), then the score
            // alone; over it, the load.
            let rank = match (over, held) {
                (true, _) => (load, 0, usize::MAX),
                (false, Some(recency)) => (0, load, recency),
                (false, None) => (1, 0, usize::MAX),
            };
            (over, rank, std::cmp::Reverse(score(key, &name)), item)
        })
        .collect();
    ranked.sort_by_key(|a| (a.0, a.1, a.2));
    ranked.into_iter().map(|(_, _, _, item)| item).collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use shardplane_dataplane as dp;

    fn chat(messages: &[(&str, &str)]) -> Prompt {
        Prompt {
            input: Input::Chat(dp::Conversation {
                messages: messages
                    .iter()
                    .map(|(role, content)| dp::ChatMessage {
                        role: role.to_string(),
                        content: content.to_string(),
                        ..Default::default()
                    })
                    .collect(),
                ..Default::default()
            }),
            sampling: dp::Sampling::default(),
            grammar: None,
            tools: None,
        }
    }

    fn first(key: u64, loads: &[usize]) -> usize {
        let candidates = loads
            .iter()
            .enumerate()
            .map(|(i, &load)| (load, format!("ns/d-{i}-0"), i))
            .collect();
        order(key, candidates, &[])[0]
    }

    #[test]
    fn every_turn_of_a_conversation_has_the_key_of_its_first_messages() {
        let turn1 = chat(&[("system", "You code."), ("user", "Fix the bug.")]);
        let turn2 = chat(&[
            ("system", "You code."),
            ("user", "Fix the bug."),
            ("assistant", "Done."),
            ("user", "Now add a test."),
        ]);
        let other = chat(&[("system", "You code."), ("user", "Write docs.")]);
        assert_eq!(key(&turn1), key(&turn2));
        // Without a system prompt: the first message alone.
        let bare1 = chat(&[("user", "Fix the bug.")]);
        let bare2 = chat(&[
            ("user", "Fix the bug."),
            ("assistant", "Done."),
            ("user", "Now add a test."),
        ]);
        assert_eq!(key(&bare1), key(&bare2));
        assert_ne!(key(&bare1), key(&turn1));
        assert_ne!(key(&turn1), key(&other));
        let mut with_tools = turn1.clone();
        with_tools.tools = Some(dp::ToolSet {
            tools: vec![dp::Tool {
                name: "read_file".into(),
                ..Default::default()
            }],
            ..Default::default()
        });
        assert_ne!(key(&turn1), key(&with_tools), "tools render at the start");
        let text = |t: &str| Prompt {
            input: Input::Text(t.into()),
            ..turn1.clone()
        };
        let long = "é".repeat(600);
        assert_eq!(key(&text(&long)), key(&text(&(long.clone() + "more"))));
        assert_ne!(key(&text("a")), key(&text("b")));
    }

    #[test]
    fn a_key_keeps_to_one_instance_and_keys_spread_over_all() {
        let mut firsts = [0usize; 3];
        for k in 0..3000u64 {
            let f = first(k, &[0, 0, 0]);
            assert_eq!(f, first(k, &[0, 0, 0]), "the same choice every time");
            firsts[f] += 1;
        }
        for n in firsts {
            assert!((800..1200).contains(&n), "{firsts:?}");
        }
        // An instance going away moves only its own keys.
        for k in 0..300u64 {
            let f = first(k, &[0, 0, 0]);
            if f != 2 {
                let two = order(
                    k,
                    vec![(0, "ns/d-0-0".into(), 0), (0, "ns/d-1-0".into(), 1)],
                    &[],
                );
                assert_eq!(two[0], f);
            }
        }
    }

    #[test]
    fn a_preferred_instance_over_its_share_is_passed_over_for_the_least_loaded() {
        let k = (0..).find(|&k| first(k, &[0, 0, 0]) == 0).unwrap();
        // Within the bound: ⌈1.25 × 3 / 3⌉ = 2, so a load of 1 stays preferred.
        assert_eq!(first(k, &[1, 0, 1]), 0);
        // ⌈1.25 × 5 / 3⌉ = 3: a load of 3 is over it; the least loaded goes first.
        let order_over = order(
            k,
            vec![
                (3, "ns/d-0-0".into(), 0),
                (1, "ns/d-1-0".into(), 1),
                (0, "ns/d-2-0".into(), 2),
            ],
            &[],
        );
        assert_eq!(order_over[2], 0, "the overloaded one last");
        assert!(order_over[..2].contains(&1) && order_over[..2].contains(&2));
        // A hot key: 100 requests that stay outstanding, on 2 instances: the
        // preferred one takes at most 1.25 times its share.
        let mut loads = [0usize; 2];
        for _ in 0..100 {
            loads[first(k, &loads)] += 1;
        }
        assert!((50..=63).contains(&loads[0]), "{loads:?}");
    }

    #[test]
    fn a_hot_key_held_by_two_instances_goes_to_the_less_loaded() {
        let k = (0..).find(|&k| first(k, &[0, 0]) == 0).unwrap();
        let names = ["ns/d-0-0", "ns/d-1-0"];
        let pick = |loads: &[usize; 2], holders: &Holders| {
            let candidates = (0..2)
                .map(|i| (loads[i], names[i].to_string(), i))
                .collect();
            order(k, candidates, &holders.of(k))[0]
        };
        // A burst of 8 like requests that stay outstanding: while only the
        // preferred instance holds the key, 5 : 3 (the bound lets it run
        // ahead); once both hold it, 4 : 4.
        let mut holders = Holders::default();
        let mut loads = [0usize; 2];
        for _ in 0..8 {
            let i = pick(&loads, &Holders::default());
            loads[i] += 1;
            holders.served(k, names[i]);
        }
        assert_eq!(loads, [5, 3]);
        // The last of the burst went to the second.
        assert_eq!(
            holders.of(k),
            vec![names[1].to_string(), names[0].to_string()]
        );
        let mut loads = [0usize; 2];
        for _ in 0..8 {
            let i = pick(&loads, &holders);
            loads[i] += 1;
            holders.served(k, names[i]);
        }
        assert_eq!(loads, [4, 4]);
        // A key only the less preferred instance holds (a conversation that
        // once overflowed there) stays with it while it is within the bound.
        let mut one = Holders::default();
        one.served(k, names[1]);
        assert_eq!(pick(&[0, 1], &one), 1);
        // Over the bound, a holder is passed over like any instance.
        assert_eq!(pick(&[0, 3], &one), 0);
    }

    #[test]
    fn holders_are_bounded_and_forget_the_least_recently_served_keys() {
        let mut holders = Holders::default();
        for k in 0..=KEYS as u64 {
            holders.served(k, "ns/d-0-0");
        }
        assert_eq!(holders.by_key.len(), KEYS + 1 - KEYS / 4);
        assert!(holders.of(0).is_empty(), "the oldest went first");
        assert_eq!(holders.of(KEYS as u64), vec!["ns/d-0-0".to_string()]);
        // An instance serving a key again is listed once, most recent first.
        holders.served(7, "ns/d-1-0");
        holders.served(KEYS as u64, "ns/d-1-0");
        holders.served(KEYS as u64, "ns/d-0-0");
        assert_eq!(
            holders.of(KEYS as u64),
            vec!["ns/d-0-0".to_string(), "ns/d-1-0".to_string()]
        );
    }
}
