//! Which ready instance a request prefers: the one most likely to hold its
//! prompt's beginning in its prefix cache, unless that one carries more than
//! its share of the load.
//!
//! ```text
//!  prompt ─► key: hash of what starts it (system messages and the first one
//!            after them, tools, template settings; or the first KiB of text)
//!  instances ─► within the load bound? ── yes ─► by rendezvous score of (key, instance)
//!                                      └─ no ──► after them, least loaded first
//!  bound: an instance takes a request while its outstanding requests are
//!         under ⌈1.25 × (all outstanding + 1) / instances⌉
//! ```
//!
//! The key is the same for every turn of one conversation (its first
//! messages do not change), so a conversation keeps to one instance and
//! finds its history cached there; conversations spread over the instances
//! by the rendezvous score, and one hot prefix cannot pile onto one instance
//! past the bound (Mirrokni et al.'s consistent hashing with bounded loads).

use std::hash::{DefaultHasher, Hash, Hasher};

use crate::protocol::{Input, Prompt};

/// The bound's slack over an even share.
const SLACK: f64 = 1.25;

/// Bytes of raw text the key covers.
const TEXT_BYTES: usize = 1024;

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

/// Orders `(load, instance key, item)`: those under the load bound by their
/// score for `key`, then the rest, least loaded first.
pub(crate) fn order<T>(key: u64, candidates: Vec<(usize, String, T)>) -> Vec<T> {
    let n = candidates.len().max(1);
    let total: usize = candidates.iter().map(|(load, _, _)| load).sum();
    let bound = ((total + 1) as f64 * SLACK / n as f64).ceil() as usize;
    let mut ranked: Vec<(bool, usize, std::cmp::Reverse<u64>, T)> = candidates
        .into_iter()
        .map(|(load, name, item)| {
            let over = load >= bound.max(1);
            // Under the bound, the score alone orders; over it, the load.
            let load_rank = if over { load } else { 0 };
            (over, load_rank, std::cmp::Reverse(score(key, &name)), item)
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
        order(key, candidates)[0]
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
}
