//! Which ready instance a request prefers: the one most likely to hold its
//! prompt's beginning in its prefix cache, unless that one carries more than
//! its share of the load.
//!
//! ```text
//!  prompt ─► keys: its opening (system messages and the first one after
//!            them, tools, template settings; or the first KiB of text) and,
//!            for a chat, the conversation before each assistant message
//!  instances ─► within the load bound? ── yes ─► those that answered the
//!                                      │         conversation's earlier turns,
//!                                      │         latest turn first, least
//!                                      │         loaded first; holders of the opening,
//!                                      │         least loaded first; then by
//!                                      │         rendezvous score (key, instance)
//!                                      └─ no ──► after them, least loaded first
//!  bound: an instance takes a request while its outstanding requests are
//!         under ⌈1.25 × (all outstanding + 1) / instances⌉
//!  holders: the incarnations that started an answer for a key in the last
//!           10 min (one re-placed or restarted holds nothing; one ejected
//!           for failing, nothing it served before)
//! ```
//!
//! The opening is the same for every turn of one conversation, so a
//! conversation keeps to one instance and finds its history cached there;
//! conversations spread over the instances by the rendezvous score, and one
//! hot prefix cannot pile onto one instance past the bound (Mirrokni et
//! al.'s consistent hashing with bounded loads).
//!
//! A hot prefix that overflowed onto a second instance is cached there too.
//! From then on both hold it, and the less loaded of them takes the next
//! request: by score alone, the first would take requests up to the bound
//! while the second idled (a burst of 8 like requests split 5 : 3 on two
//! instances, never 4 : 4). A conversation's later turn, though, goes back
//! to the instance that answered its last one while that is within the
//! bound: only that one holds the history beyond the opening. Each answer
//! from a second turn on records the key of the whole conversation it
//! answered; a later turn, which repeats that conversation and adds the
//! answer and a new message, looks up the keys of its conversation before
//! each assistant message, the longest first. (A first turn is its opening
//! and nothing else: conversations that began alike share it, so a second
//! turn goes to the opening's holders.)

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

/// Keys whose holders are remembered (each answer records one or two: about
/// 100 bytes each); past this, the least recently served quarter is
/// forgotten.
const KEYS: usize = 65_536;

/// An instance as it holds prefixes: its key (`namespace/head shard`) and
/// its incarnation, which changes when it is re-placed or restarted.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub(crate) struct Holder {
    pub name: String,
    pub incarnation: u64,
}

/// What a prompt's prefix is known by.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Keys {
    /// Its opening, the same for every turn of a conversation.
    pub opening: u64,
    /// A chat's conversation before each of its assistant messages but the
    /// first, the latest last: the prompts its earlier turns (from the
    /// second) were answered from.
    earlier: Vec<u64>,
    /// A chat's whole conversation, from its second turn on (what the next
    /// turn's `earlier` ends with).
    whole: Option<u64>,
}

/// Where a prompt's prefix is likely cached.
#[derive(Debug, Default, Clone)]
pub(crate) struct Held {
    /// The instances that answered the conversation's earlier turns, with
    /// the turn's rank (0: the latest), the latest turn first (each turn's
    /// most recent first); an instance once, at its latest turn.
    pub follows: Vec<(usize, Holder)>,
    /// The instances that lately answered a prompt of the same opening, the
    /// most recent first.
    pub opening: Vec<Holder>,
}

/// The instances that lately started an answer for each key.
#[derive(Debug, Default)]
pub(crate) struct Holders {
    by_key: HashMap<u64, Vec<(Holder, Instant)>>,
    /// Holders forgotten (ejected), and when: what they served before
    /// does not count.
    forgotten: HashMap<Holder, Instant>,
}

impl Holders {
    /// `holder` started an answer for a prompt of `keys`.
    pub(crate) fn served(&mut self, keys: &Keys, holder: &Holder) {
        self.record(keys.opening, holder);
        if let Some(whole) = keys.whole {
            self.record(whole, holder);
        }
    }

    fn record(&mut self, key: u64, holder: &Holder) {
        let now = Instant::now();
        let held = self.by_key.entry(key).or_default();
        held.retain(|(h, at)| h.name != holder.name && now.duration_since(*at) < HELD_FOR);
        held.push((holder.clone(), now));
        if self.by_key.len() > KEYS {
            let mut last: Vec<(Instant, u64)> = self
                .by_key
                .iter()
                .map(|(k, held)| (held.last().map_or(now, |(_, at)| *at), *k))
                .collect();
            last.select_nth_unstable(KEYS / 4 - 1);
            for (_, k) in &last[..KEYS / 4] {
                self.by_key.remove(k);
            }
        }
    }

    /// `holder` keeps failing (it was ejected): what it served so far is no
    /// longer counted on.
    pub(crate) fn forget(&mut self, holder: &Holder) {
        let now = Instant::now();
        self.forgotten
            .retain(|_, at| now.duration_since(*at) < HELD_FOR);
        self.forgotten.insert(holder.clone(), now);
    }

    /// The instances holding `key`, the most recent first.
    fn of(&self, key: u64) -> Vec<Holder> {
        let now = Instant::now();
        // Each list is kept in the order served.
        self.by_key
            .get(&key)
            .into_iter()
            .flatten()
            .rev()
            .filter(|(h, at)| {
                now.duration_since(*at) < HELD_FOR
                    && self.forgotten.get(h).is_none_or(|gone| at > gone)
            })
            .map(|(h, _)| h.clone())
            .collect()
    }

    /// Where a prompt of `keys` is likely cached.
    pub(crate) fn held(&self, keys: &Keys) -> Held {
        let mut follows: Vec<(usize, Holder)> = Vec::new();
        for (turn, key) in keys.earlier.iter().rev().enumerate() {
            for h in self.of(*key) {
                if !follows.iter().any(|(_, f)| *f == h) {
                    follows.push((turn, h));
                }
            }
        }
        Held {
            follows,
            opening: self.of(keys.opening),
        }
    }
}

/// How many messages every later turn of a conversation repeats: the
/// leading system (or developer) messages and the first message after them.
fn opening_len(messages: &[shardplane_dataplane::ChatMessage]) -> usize {
    let leading = messages
        .iter()
        .take_while(|m| m.role == "system" || m.role == "developer")
        .count();
    (leading + 1).min(messages.len())
}

fn hash_message(m: &shardplane_dataplane::ChatMessage, h: &mut DefaultHasher) {
    m.role.hash(h);
    m.content.hash(h);
    m.tool_call_id.hash(h);
    m.tool_calls.len().hash(h);
    for c in &m.tool_calls {
        c.id.hash(h);
        c.name.hash(h);
        c.arguments.hash(h);
    }
}

/// The key of a conversation hashed into `h` so far (longer than its
/// opening: a first turn is known by its opening alone).
fn conversation(h: &DefaultHasher) -> u64 {
    let mut h = h.clone();
    h.write_u64(u64::MAX);
    h.finish()
}

impl Keys {
    /// The keys of `prompt`.
    pub(crate) fn of(prompt: &Prompt) -> Keys {
        let mut h = DefaultHasher::new();
        match &prompt.input {
            Input::Chat(c) => {
                0u8.hash(&mut h);
                // Templates put tools and their settings near the start.
                c.template_vars.hash(&mut h);
                c.thinking.hash(&mut h);
                if let Some(tools) = &prompt.tools {
                    tools.tools.len().hash(&mut h);
                    for t in &tools.tools {
                        t.name.hash(&mut h);
                        t.description.hash(&mut h);
                        t.parameters.hash(&mut h);
                    }
                }
                let first = opening_len(&c.messages);
                for m in &c.messages[..first] {
                    hash_message(m, &mut h);
                }
                let opening = h.finish();
                // A second turn's earlier turn is a first turn, known by
                // its opening alone: every conversation that began alike
                // has that, so it names no conversation's instance.
                let mut earlier = Vec::new();
                for (i, m) in c.messages.iter().enumerate().skip(first) {
                    if m.role == "assistant" && i > first {
                        earlier.push(conversation(&h));
                    }
                    hash_message(m, &mut h);
                }
                // A turn that ends in the start of the answer (an assistant
                // prefill) is answered from the conversation before it: the
                // next turn looks that up.
                let whole = match c.messages.last() {
                    Some(m) if m.role == "assistant" => {
                        (c.messages.len() - 1 > first).then(|| *earlier.last().expect("pushed"))
                    }
                    _ => (c.messages.len() > first).then(|| conversation(&h)),
                };
                Keys {
                    opening,
                    earlier,
                    whole,
                }
            }
            Input::Text(t) => {
                1u8.hash(&mut h);
                let mut end = t.len().min(TEXT_BYTES);
                while !t.is_char_boundary(end) {
                    end -= 1;
                }
                t[..end].hash(&mut h);
                Keys {
                    opening: h.finish(),
                    earlier: Vec::new(),
                    whole: None,
                }
            }
        }
    }
}

/// How much `instance` suits `key`: the highest score is preferred.
fn score(key: u64, instance: &str) -> u64 {
    let mut h = DefaultHasher::new();
    key.hash(&mut h);
    instance.hash(&mut h);
    h.finish()
}

/// Orders `(load, instance, item)`: those under the load bound first — those
/// `held` says answered the conversation's earlier turns (the latest turn
/// first, then the least loaded, then the most recent), then the holders of
/// the opening `key` least loaded first (then the most recent), then the
/// others by their score for `key` — then the rest, least loaded first.
pub(crate) fn order<T>(key: u64, candidates: Vec<(usize, Holder, T)>, held: &Held) -> Vec<T> {
    let n = candidates.len().max(1);
    let total: usize = candidates.iter().map(|(load, _, _)| load).sum();
    let bound = ((total + 1) as f64 * SLACK / n as f64).ceil() as usize;
    let mut ranked: Vec<_> = candidates
        .into_iter()
        .map(|(load, inst, item)| {
            let over = load >= bound.max(1);
            let follows = held.follows.iter().position(|(_, h)| *h == inst);
            let opening = held.opening.iter().position(|h| *h == inst);
            // Under the bound: the conversation's instances by turn, then
            // load, then recency; the opening's holders by load (then
            // recency); then the score alone. Over it, the load.
            let rank = match (over, follows, opening) {
                (true, _, _) => (load, 0, 0, 0),
                (false, Some(at), _) => (0, held.follows[at].0, load, at),
                (false, None, Some(recency)) => (1, load, recency, 0),
                (false, None, None) => (2, 0, 0, 0),
            };
            (over, rank, std::cmp::Reverse(score(key, &inst.name)), item)
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

    fn key(prompt: &Prompt) -> u64 {
        Keys::of(prompt).opening
    }

    fn inst(i: usize) -> Holder {
        Holder {
            name: format!("ns/d-{i}-0"),
            incarnation: 7,
        }
    }

    /// The first choice among instances with `loads`, knowing `held`.
    fn pick(key: u64, loads: &[usize], held: &Held) -> usize {
        let candidates = loads
            .iter()
            .enumerate()
            .map(|(i, &load)| (load, inst(i), i))
            .collect();
        order(key, candidates, held)[0]
    }

    fn first(key: u64, loads: &[usize]) -> usize {
        pick(key, loads, &Held::default())
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
        // A turn's conversation before each assistant message after the
        // first is what an earlier turn was answered from; a first turn is
        // known by its opening alone.
        let turn3 = chat(&[
            ("system", "You code."),
            ("user", "Fix the bug."),
            ("assistant", "Done."),
            ("user", "Now add a test."),
            ("assistant", "Added."),
            ("user", "Run it."),
        ]);
        let (k1, k2, k3) = (Keys::of(&turn1), Keys::of(&turn2), Keys::of(&turn3));
        assert_eq!((k1.whole, k1.earlier.len(), k2.earlier.len()), (None, 0, 0));
        assert_eq!(k3.earlier, vec![k2.whole.unwrap()]);
        assert_ne!(k2.whole, Some(k2.opening));
        assert_eq!(Keys::of(&text("a")).whole, None);
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
                assert_eq!(first(k, &[0, 0]), f);
            }
        }
    }

    #[test]
    fn a_preferred_instance_over_its_share_is_passed_over_for_the_least_loaded() {
        let k = (0..).find(|&k| first(k, &[0, 0, 0]) == 0).unwrap();
        // Within the bound: ⌈1.25 × 3 / 3⌉ = 2, so a load of 1 stays preferred.
        assert_eq!(first(k, &[1, 0, 1]), 0);
        // ⌈1.25 × 5 / 3⌉ = 3: a load of 3 is over it; the least loaded goes first.
        let candidates = [3, 1, 0]
            .iter()
            .enumerate()
            .map(|(i, &load)| (load, inst(i), i))
            .collect();
        let order_over = order(k, candidates, &Held::default());
        assert_eq!(order_over, vec![2, 1, 0], "the overloaded one last");
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
        let keys = Keys::of(&chat(&[("user", "Summarise this.")]));
        let k = keys.opening;
        // p is the instance the score prefers, q the other.
        let p = first(k, &[0, 0]);
        let q = 1 - p;
        let pick2 = |loads: &[usize; 2], holders: &Holders| pick(k, loads, &holders.held(&keys));
        // A burst of 8 like requests that stay outstanding: while only the
        // preferred instance holds the key, 5 : 3 (the bound lets it run
        // ahead); once both hold it, 4 : 4.
        let mut holders = Holders::default();
        let mut loads = [0usize; 2];
        for _ in 0..8 {
            let i = pick2(&loads, &Holders::default());
            loads[i] += 1;
            holders.served(&keys, &inst(i));
        }
        assert_eq!((loads[p], loads[q]), (5, 3));
        // The last of the burst went to the second.
        assert_eq!(holders.of(k), vec![inst(q), inst(p)]);
        let mut loads = [0usize; 2];
        for _ in 0..8 {
            let i = pick2(&loads, &holders);
            loads[i] += 1;
            holders.served(&keys, &inst(i));
        }
        assert_eq!(loads, [4, 4]);
        // A key only the less preferred instance holds (a conversation that
        // once overflowed there) stays with it while it is within the bound.
        let mut one = Holders::default();
        one.served(&keys, &inst(q));
        let mut loads = [0; 2];
        loads[q] = 1;
        assert_eq!(pick2(&loads, &one), q);
        // Over the bound, a holder is passed over like any instance.
        loads[q] = 3;
        assert_eq!(pick2(&loads, &one), p);
    }

    #[test]
    fn a_conversations_next_turn_goes_where_its_last_turn_was_answered() {
        let turns = |replies: &[&str]| {
            let mut m = vec![("system", "You code."), ("user", "Fix the bug.")];
            for (i, r) in replies.iter().enumerate() {
                m.push(("assistant", r));
                m.push(("user", ["Now add a test.", "Run it.", "Ship it."][i]));
            }
            chat(&m)
        };
        // Conversations a and b began alike (a coding agent's burst): their
        // first turns are one prompt, on instances 1 and 0.
        let a1 = turns(&[]);
        let (a2, a3, a4) = (
            turns(&["Done."]),
            turns(&["Done.", "Added."]),
            turns(&["Done.", "Added.", "Passes."]),
        );
        let b2 = turns(&["Which bug?"]);
        let mut holders = Holders::default();
        holders.served(&Keys::of(&a1), &inst(1));
        holders.served(&Keys::of(&a1), &inst(0));
        // A second turn names no conversation's instance: the opening's
        // holders share it, the less loaded first.
        let held = holders.held(&Keys::of(&a2));
        assert!(held.follows.is_empty(), "{held:?}");
        assert_eq!(held.opening, vec![inst(0), inst(1)]);
        assert_eq!(pick(key(&a2), &[1, 0], &held), 1);
        // a's second turn on 1, then b's on 0: a's third turn goes back to
        // 1 although 0 is less loaded and the opening's latest holder —
        // while 1 is within the bound.
        holders.served(&Keys::of(&a2), &inst(1));
        holders.served(&Keys::of(&b2), &inst(0));
        let held = holders.held(&Keys::of(&a3));
        assert_eq!(held.follows, vec![(0, inst(1))]);
        assert_eq!(held.opening[0], inst(0));
        assert_eq!(pick(key(&a3), &[0, 1], &held), 1);
        assert_eq!(pick(key(&a3), &[0, 4], &held), 0, "over the bound");
        // a's third turn on 0: the fourth follows it there, and falls back
        // to 1 (its second turn's) when 0 is no longer that instance —
        // ahead of 2, which lately answered a first turn like a's.
        holders.served(&Keys::of(&a3), &inst(0));
        holders.served(&Keys::of(&a1), &inst(2));
        let held = holders.held(&Keys::of(&a4));
        assert_eq!(held.follows, vec![(0, inst(0)), (1, inst(1))]);
        assert_eq!(held.opening[0], inst(2));
        assert_eq!(pick(key(&a4), &[1, 1, 0], &held), 0);
        let replaced = Holder {
            incarnation: 8,
            ..inst(0)
        };
        let candidates = vec![(0, replaced, 0), (0, inst(1), 1), (0, inst(2), 2)];
        assert_eq!(order(key(&a4), candidates, &held)[0], 1);
        // A turn that ends in the start of its answer (an assistant
        // prefill) is answered from the conversation before it: the turn
        // after it follows its instance.
        let mut prefilled = turns(&["Done."]);
        let Input::Chat(c) = &mut prefilled.input else {
            unreachable!()
        };
        c.messages.push(dp::ChatMessage {
            role: "assistant".into(),
            content: "{".into(),
            ..Default::default()
        });
        assert_eq!(Keys::of(&prefilled).whole, Keys::of(&a2).whole);
        let mut after = Holders::default();
        after.served(&Keys::of(&prefilled), &inst(2));
        assert_eq!(after.held(&Keys::of(&a3)).follows, vec![(0, inst(2))]);
    }

    #[test]
    fn holders_of_one_earlier_turn_share_its_next_turns_by_load() {
        // A burst of identical first turns longer than the opening (a
        // context message, then the question): each next turn follows the
        // instances that answered it, the least loaded first, not the
        // latest.
        let first = chat(&[
            ("system", "You code."),
            ("user", "Context."),
            ("user", "Fix it."),
        ]);
        let next = |reply: &str| {
            chat(&[
                ("system", "You code."),
                ("user", "Context."),
                ("user", "Fix it."),
                ("assistant", reply),
                ("user", "Go on."),
            ])
        };
        let mut holders = Holders::default();
        holders.served(&Keys::of(&first), &inst(0));
        holders.served(&Keys::of(&first), &inst(1));
        let held = holders.held(&Keys::of(&next("Done.")));
        assert_eq!(held.follows, vec![(0, inst(1)), (0, inst(0))]);
        assert_eq!(pick(key(&first), &[0, 1], &held), 0);
        assert_eq!(pick(key(&first), &[1, 0], &held), 1);
    }

    #[test]
    fn a_re_placed_or_ejected_instance_holds_nothing() {
        let keys = Keys::of(&chat(&[("user", "Hi.")]));
        let mut holders = Holders::default();
        holders.served(&keys, &inst(1));
        holders.served(&keys, &inst(0));
        // Instance 0, the latest holder, re-placed: another incarnation,
        // and no holder.
        let replaced = Holder {
            incarnation: 8,
            ..inst(0)
        };
        let held = holders.held(&keys);
        assert!(!held.opening.contains(&replaced));
        let candidates = vec![(0, replaced.clone(), 0), (0, inst(1), 1)];
        assert_eq!(order(keys.opening, candidates, &held)[0], 1);
        // An ejected holder is forgotten for what it served so far; what it
        // serves later counts again.
        holders.forget(&inst(0));
        assert_eq!(holders.held(&keys).opening, vec![inst(1)]);
        std::thread::sleep(Duration::from_millis(2));
        holders.served(&keys, &inst(0));
        assert_eq!(holders.held(&keys).opening, vec![inst(0), inst(1)]);
    }

    #[test]
    fn holders_are_bounded_and_forget_the_least_recently_served_keys() {
        let mut holders = Holders::default();
        for k in 0..=KEYS as u64 {
            holders.record(k, &inst(0));
        }
        assert_eq!(holders.by_key.len(), KEYS + 1 - KEYS / 4);
        assert!(holders.of(0).is_empty(), "the oldest went first");
        assert_eq!(holders.of(KEYS as u64), vec![inst(0)]);
        // An instance serving a key again is listed once, most recent first.
        holders.record(7, &inst(1));
        holders.record(KEYS as u64, &inst(1));
        holders.record(KEYS as u64, &inst(0));
        assert_eq!(holders.of(KEYS as u64), vec![inst(0), inst(1)]);
    }
}
