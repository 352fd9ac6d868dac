//! A prefix cache: the KV of recent prompts, kept in blocks of a fixed number
//! of tokens, so a new sequence that starts with the same tokens skips them.
//!
//! ```text
//!  tokens  [ b0 ][ b1 ][ b2 ][ t ]x    (whole blocks, then the tail t: the
//!  keys     k0 ─► k1 ─► k2 ─► kt        rest but the last token x)
//!           k_i = hash(k_{i-1}, tokens of b_i)
//!  lookup: walk the keys from b0 while cached, then the longest tail under
//!          the last block reached that begins what is left → the longest
//!          cached prefix
//!  insert: the blocks and the tail not cached yet; evict least recently
//!          used (leaves of a chain first) until the bytes fit the budget
//! ```
//!
//! A block's key covers every token before it, so a hit is always a true
//! prefix; each entry also keeps its tokens and its parent's key, which a
//! lookup compares, so a hash collision cannot hand out another prompt's KV.
//! The tail lets the same prompt again (many clients asking alike, a retry)
//! or one that extends it (the next turn) reuse all of it but the one token
//! whose logits the new sequence needs; without it, up to a block less.
//! The cache knows nothing of tensors: each backend stores its own block data
//! (`B`) and says how many bytes it holds.

use std::cmp::Reverse;
use std::collections::{BTreeSet, HashMap};
use std::hash::{Hash, Hasher};
use std::ops::Range;

/// Tokens in a block unless configured otherwise.
pub const DEFAULT_BLOCK_TOKENS: usize = 32;

/// What a prefix cache did (its own counts: a look whose sequence is then
/// let go counts too; the agent's metrics count sequences that start).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct PrefixCacheStats {
    /// Prompt tokens looked up (every look).
    pub lookup_tokens: u64,
    /// Of those, tokens whose KV came from the cache.
    pub hit_tokens: u64,
    /// Blocks stored.
    pub inserted_blocks: u64,
    /// Blocks evicted to stay within the budget.
    pub evicted_blocks: u64,
    /// Blocks held now.
    pub blocks: u64,
    /// Bytes held now.
    pub bytes: u64,
    /// The budget in bytes.
    pub budget_bytes: u64,
}

/// What a lookup found.
#[derive(Debug, PartialEq, Eq)]
pub struct Hit<'a, B> {
    /// The cached blocks that begin the tokens, in order; the last may be a
    /// tail, shorter than a block.
    pub blocks: Vec<&'a B>,
    /// The tokens they cover.
    pub tokens: usize,
}

impl<B> Hit<'_, B> {
    /// The index of the first block a layer that sees `window` positions
    /// (itself included; `None`: all) needs to go on from the hit: the next
    /// query, at position `tokens`, sees keys from `tokens + 1 - window`.
    /// Every block but a tail is `block_tokens` long, so the blocks before
    /// it are whole and a sliding layer may do without them.
    pub fn first_needed(&self, block_tokens: usize, window: Option<usize>) -> usize {
        window.map_or(0, |w| {
            ((self.tokens + 1).saturating_sub(w) / block_tokens.max(1)).min(self.blocks.len())
        })
    }
}

impl<T> Hit<'_, Vec<Option<T>>> {
    /// For blocks that hold rows per layer (`None`: a sliding layer had
    /// forgotten them when the block was stored): the first block each
    /// layer of `windows` needs ([`Hit::first_needed`]), when every block
    /// from there holds that layer's rows; `None` when one does not, and the
    /// hit cannot be used.
    pub fn layer_firsts(
        &self,
        block_tokens: usize,
        windows: &[Option<usize>],
    ) -> Option<Vec<usize>> {
        windows
            .iter()
            .enumerate()
            .map(|(l, &w)| {
                let first = self.first_needed(block_tokens, w);
                let held = self.blocks[first..]
                    .iter()
                    .all(|b| b.get(l).is_some_and(Option::is_some));
                held.then_some(first)
            })
            .collect()
    }
}

struct Entry<B> {
    parent: u64,
    tokens: Vec<u32>,
    depth: usize,
    stamp: u64,
    bytes: usize,
    data: B,
}

/// Blocks of KV keyed by the prefix they end, evicted least recently used
/// within a byte budget.
pub struct PrefixCache<B> {
    block_tokens: usize,
    budget: usize,
    clock: u64,
    entries: HashMap<u64, Entry<B>>,
    /// Eviction order: oldest stamp first; among equal stamps, deepest first
    /// (a chain loses its tail before its head).
    order: BTreeSet<(u64, Reverse<usize>, u64)>,
    /// The keys of the tails (entries shorter than a block) under each
    /// parent: the prefix they follow.
    tails: HashMap<u64, Vec<u64>>,
    stats: PrefixCacheStats,
}

impl<B> std::fmt::Debug for PrefixCache<B> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PrefixCache")
            .field("block_tokens", &self.block_tokens)
            .field("stats", &self.stats)
            .finish()
    }
}

/// The key of the block `tokens` that follows the prefix keyed `parent`.
fn block_key(parent: u64, tokens: &[u32]) -> u64 {
    // SipHash with fixed keys: the same prompt gives the same keys in every
    // process, which keeps the keys comparable in logs and tests.
    let mut h = std::hash::DefaultHasher::new();
    parent.hash(&mut h);
    tokens.hash(&mut h);
    h.finish()
}

impl<B> PrefixCache<B> {
    /// A cache of blocks of `block_tokens` tokens holding at most
    /// `budget_bytes` (0: the cache keeps nothing).
    pub fn new(block_tokens: usize, budget_bytes: usize) -> Self {
        PrefixCache {
            block_tokens: block_tokens.max(1),
            budget: budget_bytes,
            clock: 0,
            entries: HashMap::new(),
            order: BTreeSet::new(),
            tails: HashMap::new(),
            stats: PrefixCacheStats {
                budget_bytes: budget_bytes as u64,
                ..PrefixCacheStats::default()
            },
        }
    }

    /// Tokens in a block.
    pub fn block_tokens(&self) -> usize {
        self.block_tokens
    }

    /// Whether the cache may hold anything.
    pub fn enabled(&self) -> bool {
        self.budget > 0
    }

    /// What the cache did so far and holds now.
    pub fn stats(&self) -> PrefixCacheStats {
        self.stats
    }

    /// Marks `key` used now (every block one lookup or insert touches gets
    /// the same stamp, so the deepest of them goes first).
    fn touch(&mut self, key: u64) {
        let stamp = self.clock;
        if let Some(e) = self.entries.get_mut(&key) {
            self.order.remove(&(e.stamp, Reverse(e.depth), key));
            e.stamp = stamp;
            self.order.insert((stamp, Reverse(e.depth), key));
        }
    }

    /// The cached blocks that begin `tokens`, in order, covering at most
    /// `limit` tokens: whole blocks, then the longest tail that fits; counts
    /// `tokens.len()` as looked up and the covered tokens as hits, and marks
    /// the blocks used.
    pub fn lookup(&mut self, tokens: &[u32], limit: usize) -> Hit<'_, B> {
        self.stats.lookup_tokens += tokens.len() as u64;
        let within = &tokens[..limit.min(tokens.len())];
        let mut keys = Vec::new();
        let mut parent = 0;
        for block in within.chunks_exact(self.block_tokens) {
            let key = block_key(parent, block);
            match self.entries.get(&key) {
                Some(e) if e.parent == parent && e.tokens == block => keys.push(key),
                _ => break,
            }
            parent = key;
        }
        let mut covered = keys.len() * self.block_tokens;
        let rest = &within[covered..];
        let tail = self
            .tails
            .get(&parent)
            .into_iter()
            .flatten()
            .filter_map(|&k| self.entries.get(&k).map(|e| (k, e)))
            .filter(|(_, e)| e.parent == parent && rest.starts_with(&e.tokens))
            .max_by_key(|(_, e)| e.tokens.len())
            .map(|(k, e)| (k, e.tokens.len()));
        if let Some((key, n)) = tail {
            keys.push(key);
            covered += n;
        }
        self.clock += 1;
        for &key in &keys {
            self.touch(key);
        }
        self.stats.hit_tokens += covered as u64;
        Hit {
            blocks: keys.iter().map(|k| &self.entries[k].data).collect(),
            tokens: covered,
        }
    }

    /// Takes back `tokens` counted as hits by the last lookup, when its
    /// caller could not use them (a sliding layer's rows were not kept).
    pub fn unused_hit(&mut self, tokens: usize) {
        self.stats.hit_tokens = self.stats.hit_tokens.saturating_sub(tokens as u64);
    }

    /// Stores the whole blocks of `tokens` that are not cached yet, then
    /// its tail (what follows the last whole block before its last token);
    /// `make` gives a block's data and its bytes from its token range (an
    /// error stops the insert, keeping what was stored). A cached block for
    /// which `refill` says so (its data lacks rows, a sliding layer's that
    /// were forgotten when it was stored, that this sequence still holds)
    /// is made again from this sequence, so one long prompt cannot leave a
    /// shared prefix unusable for good. Then evicts down to the budget.
    pub fn insert<E>(
        &mut self,
        tokens: &[u32],
        make: impl FnMut(Range<usize>) -> Result<(B, usize), E>,
        refill: impl Fn(&B, Range<usize>) -> bool,
    ) -> Result<(), E> {
        if !self.enabled() {
            return Ok(());
        }
        let stored = self.store_chain(tokens, make, refill);
        // What was stored before an error counts against the budget too.
        self.evict();
        stored
    }

    /// The blocks and the tail of `tokens` not cached yet (see
    /// [`Self::insert`]).
    fn store_chain<E>(
        &mut self,
        tokens: &[u32],
        mut make: impl FnMut(Range<usize>) -> Result<(B, usize), E>,
        refill: impl Fn(&B, Range<usize>) -> bool,
    ) -> Result<(), E> {
        self.clock += 1;
        let mut parent = 0;
        // The chain's keys: `chain[i]` ends block i.
        let mut chain = Vec::new();
        for (i, block) in tokens.chunks_exact(self.block_tokens).enumerate() {
            let key = block_key(parent, block);
            let stored = match self.entries.get(&key) {
                Some(e) if e.parent == parent && e.tokens == block => {
                    let range = i * self.block_tokens..(i + 1) * self.block_tokens;
                    if refill(&e.data, range.clone()) {
                        let made = make(range)?;
                        self.refill(key, made);
                    }
                    self.touch(key);
                    true
                }
                // A colliding key for another prefix: keep the older entry;
                // this chain stops here.
                Some(_) => false,
                None => {
                    let start = i * self.block_tokens;
                    self.store(
                        key,
                        parent,
                        block,
                        i,
                        make(start..start + self.block_tokens)?,
                    )
                }
            };
            if !stored {
                break;
            }
            chain.push(key);
            parent = key;
        }
        // The tail: after the whole blocks of all but the last token.
        let end = tokens.len().saturating_sub(1);
        let whole = end / self.block_tokens;
        let start = whole * self.block_tokens;
        let tail_parent = match whole {
            0 => Some(0),
            n => chain.get(n - 1).copied(),
        };
        if let Some(parent) = tail_parent.filter(|_| start < end) {
            let tail = &tokens[start..end];
            let key = block_key(parent, tail);
            match self.entries.get(&key) {
                Some(e) if e.parent == parent && e.tokens == tail => {
                    if refill(&e.data, start..end) {
                        let made = make(start..end)?;
                        self.refill(key, made);
                    }
                    self.touch(key)
                }
                Some(_) => {}
                None => {
                    if self.store(key, parent, tail, whole, make(start..end)?) {
                        self.tails.entry(parent).or_default().push(key);
                    }
                }
            }
        }
        Ok(())
    }

    /// Stores the entry `key` (unless it alone is over the budget).
    fn store(
        &mut self,
        key: u64,
        parent: u64,
        tokens: &[u32],
        depth: usize,
        (data, bytes): (B, usize),
    ) -> bool {
        if bytes > self.budget {
            return false;
        }
        self.entries.insert(
            key,
            Entry {
                parent,
                tokens: tokens.to_vec(),
                depth,
                stamp: self.clock,
                bytes,
                data,
            },
        );
        self.order.insert((self.clock, Reverse(depth), key));
        self.stats.bytes += bytes as u64;
        self.stats.blocks += 1;
        self.stats.inserted_blocks += 1;
        true
    }

    /// Puts `made` in place of entry `key`'s data (unless it alone is over
    /// the budget).
    fn refill(&mut self, key: u64, (data, bytes): (B, usize)) {
        if bytes > self.budget {
            return;
        }
        if let Some(e) = self.entries.get_mut(&key) {
            self.stats.bytes = self.stats.bytes - e.bytes as u64 + bytes as u64;
            e.data = data;
            e.bytes = bytes;
        }
    }

    fn evict(&mut self) {
        while self.stats.bytes > self.budget as u64 {
            let Some((stamp, depth, key)) = self.order.pop_first() else {
                break;
            };
            let _ = (stamp, depth);
            if let Some(e) = self.entries.remove(&key) {
                if e.tokens.len() < self.block_tokens
                    && let Some(keys) = self.tails.get_mut(&e.parent)
                {
                    keys.retain(|&k| k != key);
                    if keys.is_empty() {
                        self.tails.remove(&e.parent);
                    }
                }
                self.stats.bytes -= e.bytes as u64;
                self.stats.blocks -= 1;
                self.stats.evicted_blocks += 1;
            }
        }
    }

    /// Drops every block.
    pub fn clear(&mut self) {
        self.entries.clear();
        self.order.clear();
        self.tails.clear();
        self.stats.bytes = 0;
        self.stats.blocks = 0;
    }
}

#[cfg(test)]
// A block's data here is its token range; a lookup of one block is a list
// of one range.
#[allow(clippy::single_range_in_vec_init)]
mod tests {
    use super::*;

    /// A cache of 4-token blocks whose data is the block's token range, each
    /// block 10 bytes.
    fn cache(budget: usize) -> PrefixCache<Range<usize>> {
        PrefixCache::new(4, budget)
    }

    fn insert(c: &mut PrefixCache<Range<usize>>, tokens: &[u32]) -> usize {
        let mut made = 0;
        c.insert(
            tokens,
            |r| {
                made += 1;
                Ok::<_, ()>((r, 10))
            },
            |_, _| false,
        )
        .unwrap();
        made
    }

    /// What a lookup found: the blocks' data (token ranges) and the tokens.
    fn found(
        c: &mut PrefixCache<Range<usize>>,
        tokens: &[u32],
        limit: usize,
    ) -> (Vec<Range<usize>>, usize) {
        let hit = c.lookup(tokens, limit);
        (hit.blocks.into_iter().cloned().collect(), hit.tokens)
    }

    #[test]
    fn a_sliding_layer_needs_only_the_blocks_its_window_reaches() {
        let mut c = cache(1000);
        let prompt: Vec<u32> = (0..10).collect();
        insert(&mut c, &prompt);
        let hit = c.lookup(&prompt, 9);
        // Blocks [0..4] [4..8] and the tail [8]; the next query is at 9.
        assert_eq!(hit.first_needed(4, None), 0);
        assert_eq!(hit.first_needed(4, Some(10)), 0, "keys from 0");
        assert_eq!(hit.first_needed(4, Some(6)), 1, "keys from 4");
        assert_eq!(hit.first_needed(4, Some(3)), 1, "keys from 7");
        assert_eq!(hit.first_needed(4, Some(2)), 2, "keys from 8: the tail");
        assert_eq!(
            hit.first_needed(4, Some(1)),
            2,
            "keys from 9: none cached, the tail kept"
        );
        // Per-layer rows: a global layer and a sliding one of window 2
        // whose first block's rows were forgotten.
        let rows = |held: [bool; 2]| held.map(|h| h.then_some(())).to_vec();
        let blocks = [rows([true, false]), rows([true, true]), rows([true, true])];
        let layered = Hit {
            blocks: blocks.iter().collect(),
            tokens: 9,
        };
        assert_eq!(layered.layer_firsts(4, &[None, Some(2)]), Some(vec![0, 2]));
        assert_eq!(layered.layer_firsts(4, &[None, Some(6)]), Some(vec![0, 1]));
        assert_eq!(
            layered.layer_firsts(4, &[None, Some(10)]),
            None,
            "block 0 needed"
        );
        assert_eq!(c.stats().hit_tokens, 9);
        c.unused_hit(9);
        assert_eq!(c.stats().hit_tokens, 0);
    }

    /// A block stored without some of its rows (`None` here) is made again
    /// from a later sequence that holds them, and only then.
    #[test]
    fn an_incomplete_block_takes_a_later_sequence_s_complete_data() {
        let mut c: PrefixCache<Option<usize>> = PrefixCache::new(4, 1000);
        let tokens: Vec<u32> = (0..10).collect();
        let insert = |c: &mut PrefixCache<Option<usize>>, held_from: usize| {
            let mut made = Vec::new();
            c.insert(
                &tokens,
                |r| {
                    made.push(r.start);
                    Ok::<_, ()>(((r.start >= held_from).then_some(r.start), 10))
                },
                |b, r| b.is_none() && r.start >= held_from,
            )
            .unwrap();
            made
        };
        // The first sequence had forgotten its first block's rows.
        assert_eq!(insert(&mut c, 4), [0, 4, 8]);
        let data = |c: &mut PrefixCache<Option<usize>>| -> Vec<Option<usize>> {
            c.lookup(&(0..10).collect::<Vec<_>>(), 9)
                .blocks
                .into_iter()
                .copied()
                .collect()
        };
        assert_eq!(data(&mut c), [None, Some(4), Some(8)]);
        // One that had forgotten them too changes nothing (nor copies).
        assert_eq!(insert(&mut c, 4), Vec::<usize>::new());
        assert_eq!(data(&mut c), [None, Some(4), Some(8)]);
        // One that holds them fills the block in; complete blocks stay.
        assert_eq!(insert(&mut c, 0), [0]);
        assert_eq!(data(&mut c), [Some(0), Some(4), Some(8)]);
        assert_eq!(insert(&mut c, 0), Vec::<usize>::new());
        assert_eq!((c.stats().blocks, c.stats().bytes), (3, 30));
    }

    #[test]
    fn a_lookup_finds_the_longest_cached_prefix() {
        let mut c = cache(1000);
        let prompt: Vec<u32> = (0..10).collect();
        assert_eq!(
            insert(&mut c, &prompt),
            3,
            "two whole blocks of four, and the tail [8] (the last token is not kept)"
        );
        // The same prompt again: all but its last token.
        assert_eq!(found(&mut c, &prompt, 9), (vec![0..4, 4..8, 8..9], 9));
        // Same start, longer: both blocks and the tail.
        let longer: Vec<u32> = (0..20).collect();
        assert_eq!(found(&mut c, &longer, 19), (vec![0..4, 4..8, 8..9], 9));
        // The limit keeps the blocks within it.
        assert_eq!(found(&mut c, &longer, 7), (vec![0..4], 4));
        // Differs in the second block: only the first.
        let mut other = longer.clone();
        other[5] = 99;
        assert_eq!(found(&mut c, &other, 19), (vec![0..4], 4));
        // Differs in the first: nothing, though the second block's tokens match.
        let mut first = longer.clone();
        first[0] = 99;
        assert_eq!(found(&mut c, &first, 19), (vec![], 0));
        let s = c.stats();
        assert_eq!((s.lookup_tokens, s.hit_tokens), (90, 9 + 9 + 4 + 4));
        // Inserting again stores only what is new: three blocks and a tail.
        assert_eq!(insert(&mut c, &longer), 4);
        assert_eq!(c.stats().blocks, 7);
    }

    #[test]
    fn tails_serve_a_prompt_of_whole_blocks_a_short_one_and_the_longest_that_fits() {
        let mut c = cache(1000);
        // 8 tokens: blocks [0..4] and [4..8], and the tail [4..7] after the
        // first block.
        let whole: Vec<u32> = (0..8).collect();
        assert_eq!(insert(&mut c, &whole), 3);
        assert_eq!(found(&mut c, &whole, 7), (vec![0..4, 4..7], 7));
        // Shorter than a block: a tail at the root.
        let short = [50, 51, 52];
        assert_eq!(insert(&mut c, &short), 1);
        assert_eq!(found(&mut c, &short, 2), (vec![0..2], 2));
        // A tail that does not begin what is left is not used.
        assert_eq!(found(&mut c, &[50, 60, 61], 2), (vec![], 0));
        // Of the tails after one block, the longest that begins the rest.
        assert_eq!(insert(&mut c, &[0, 1, 2, 3, 9, 9]), 1);
        assert_eq!(insert(&mut c, &[0, 1, 2, 3, 9, 9, 9]), 1);
        let next = [0, 1, 2, 3, 9, 9, 9, 9];
        assert_eq!(found(&mut c, &next, 7), (vec![0..4, 4..6], 6));
        // The same tail again is not stored twice.
        assert_eq!(insert(&mut c, &[0, 1, 2, 3, 9, 9, 9]), 0);
        // An evicted tail is no longer offered.
        let mut small = cache(20);
        insert(&mut small, &[0, 1, 2, 3, 4, 5]);
        insert(&mut small, &[7, 7, 7, 7, 7]);
        // (the tail was the deepest of the oldest: it went first)
        assert_eq!(found(&mut small, &[0, 1, 2, 3, 4, 5], 5), (vec![0..4], 4));
        assert!(small.tails.is_empty());
    }

    #[test]
    fn the_least_recently_used_blocks_go_first_and_a_chain_loses_its_tail_first() {
        let mut c = cache(40);
        // Lengths of whole blocks and one token: no tails.
        let a: Vec<u32> = (0..13).collect();
        let b: Vec<u32> = (100..109).collect();
        insert(&mut c, &a);
        insert(&mut c, &b);
        // 5 blocks of 10 bytes in a budget of 40: a's last block went (a and
        // b each were inserted in one go; a is older).
        let s = c.stats();
        assert_eq!((s.blocks, s.bytes, s.evicted_blocks), (4, 40, 1));
        assert_eq!(c.lookup(&a, 12).blocks.len(), 2);
        // a was just used: a new block now evicts b's last block, then b's head.
        let d: Vec<u32> = (200..209).collect();
        insert(&mut c, &d);
        assert!(c.lookup(&b, 8).blocks.is_empty());
        assert_eq!(c.lookup(&a, 12).blocks.len(), 2);
        assert_eq!(c.lookup(&d, 8).blocks.len(), 2);
        assert_eq!(c.stats().bytes, 40);
    }

    #[test]
    fn a_prompt_longer_than_the_budget_keeps_its_head() {
        let mut c = cache(25);
        let a: Vec<u32> = (0..40).collect();
        insert(&mut c, &a);
        assert_eq!(found(&mut c, &a, 40), (vec![0..4, 4..8], 8));
    }

    #[test]
    fn a_zero_budget_keeps_nothing_and_errors_keep_what_was_stored() {
        let mut c = cache(0);
        assert_eq!(insert(&mut c, &(0..8).collect::<Vec<_>>()), 0);
        // Three blocks of which the third cannot be made.
        let failing = |c: &mut PrefixCache<Range<usize>>| {
            c.insert(
                &(0..12).collect::<Vec<_>>(),
                |r| {
                    if r.start == 8 {
                        Err("no memory")
                    } else {
                        Ok((r, 10))
                    }
                },
                |_, _| false,
            )
        };
        let mut c = cache(100);
        assert_eq!(failing(&mut c), Err("no memory"));
        assert_eq!(c.stats().blocks, 2);
        // What an insert stored before its error is evicted to the budget.
        let mut c = cache(15);
        assert_eq!(failing(&mut c), Err("no memory"));
        assert_eq!((c.stats().blocks, c.stats().bytes), (1, 10));
        c.clear();
        assert_eq!((c.stats().blocks, c.stats().bytes), (0, 0));
    }
}
