//! A prefix cache: the KV of recent prompts, kept in blocks of a fixed number
//! of tokens, so a new sequence that starts with the same tokens skips them.
//!
//! ```text
//!  tokens  [ b0 ][ b1 ][ b2 ][ b3 ]..   (whole blocks only)
//!  keys     k0 ─► k1 ─► k2 ─► k3        k_i = hash(k_{i-1}, tokens of b_i)
//!  lookup: walk the keys from b0 while cached → the longest cached prefix
//!  insert: the blocks not cached yet; evict least recently used (leaves of
//!          a chain first) until the bytes fit the budget
//! ```
//!
//! A block's key covers every token before it, so a hit is always a true
//! prefix; each entry also keeps its tokens and its parent's key, which a
//! lookup compares, so a hash collision cannot hand out another prompt's KV.
//! The cache knows nothing of tensors: each backend stores its own block data
//! (`B`) and says how many bytes it holds.

use std::cmp::Reverse;
use std::collections::{BTreeSet, HashMap};
use std::hash::{Hash, Hasher};
use std::ops::Range;

/// Tokens in a block unless configured otherwise.
pub const DEFAULT_BLOCK_TOKENS: usize = 32;

/// What a prefix cache did, for metrics.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct PrefixCacheStats {
    /// Prompt tokens looked up (every new sequence's prompt).
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
    /// `limit` tokens; counts `tokens.len()` as looked up and the blocks'
    /// tokens as hits, and marks the blocks used.
    pub fn lookup(&mut self, tokens: &[u32], limit: usize) -> Vec<&B> {
        self.stats.lookup_tokens += tokens.len() as u64;
        let mut keys = Vec::new();
        let mut parent = 0;
        for block in tokens[..limit.min(tokens.len())].chunks_exact(self.block_tokens) {
            let key = block_key(parent, block);
            match self.entries.get(&key) {
                Some(e) if e.parent == parent && e.tokens == block => keys.push(key),
                _ => break,
            }
            parent = key;
        }
        self.clock += 1;
        for &key in &keys {
            self.touch(key);
        }
        self.stats.hit_tokens += (keys.len() * self.block_tokens) as u64;
        keys.iter().map(|k| &self.entries[k].data).collect()
    }

    /// Stores the whole blocks of `tokens` that are not cached yet; `make`
    /// gives a block's data and its bytes from its token range (an error
    /// stops the insert, keeping what was stored). Then evicts down to the
    /// budget.
    pub fn insert<E>(
        &mut self,
        tokens: &[u32],
        make: impl FnMut(Range<usize>) -> Result<(B, usize), E>,
    ) -> Result<(), E> {
        if !self.enabled() {
            return Ok(());
        }
        let stored = self.store_chain(tokens, make);
        // What was stored before an error counts against the budget too.
        self.evict();
        stored
    }

    /// The blocks of `tokens` not cached yet (see [`Self::insert`]).
    fn store_chain<E>(
        &mut self,
        tokens: &[u32],
        mut make: impl FnMut(Range<usize>) -> Result<(B, usize), E>,
    ) -> Result<(), E> {
        self.clock += 1;
        let mut parent = 0;
        for (i, block) in tokens.chunks_exact(self.block_tokens).enumerate() {
            let key = block_key(parent, block);
            match self.entries.get(&key) {
                Some(e) if e.parent == parent && e.tokens == block => self.touch(key),
                // A colliding key for another prefix: keep the older entry;
                // this chain stops here.
                Some(_) => break,
                None => {
                    let start = i * self.block_tokens;
                    let (data, bytes) = make(start..start + self.block_tokens)?;
                    if bytes > self.budget {
                        break;
                    }
                    self.entries.insert(
                        key,
                        Entry {
                            parent,
                            tokens: block.to_vec(),
                            depth: i,
                            stamp: self.clock,
                            bytes,
                            data,
                        },
                    );
                    self.order.insert((self.clock, Reverse(i), key));
                    self.stats.bytes += bytes as u64;
                    self.stats.blocks += 1;
                    self.stats.inserted_blocks += 1;
                }
            }
            parent = key;
        }
        Ok(())
    }

    fn evict(&mut self) {
        while self.stats.bytes > self.budget as u64 {
            let Some((stamp, depth, key)) = self.order.pop_first() else {
                break;
            };
            let _ = (stamp, depth);
            if let Some(e) = self.entries.remove(&key) {
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
        self.stats.bytes = 0;
        self.stats.blocks = 0;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A cache of 4-token blocks whose data is the block's token range, each
    /// block 10 bytes.
    fn cache(budget: usize) -> PrefixCache<Range<usize>> {
        PrefixCache::new(4, budget)
    }

    fn insert(c: &mut PrefixCache<Range<usize>>, tokens: &[u32]) -> usize {
        let mut made = 0;
        c.insert(tokens, |r| {
            made += 1;
            Ok::<_, ()>((r, 10))
        })
        .unwrap();
        made
    }

    #[test]
    fn a_lookup_finds_the_longest_cached_prefix_of_whole_blocks() {
        let mut c = cache(1000);
        let prompt: Vec<u32> = (0..10).collect();
        assert_eq!(insert(&mut c, &prompt), 2, "two whole blocks of four");
        // Same start, longer: both blocks.
        let longer: Vec<u32> = (0..20).collect();
        assert_eq!(c.lookup(&longer, 19), vec![&(0..4), &(4..8)]);
        // The limit keeps the blocks within it.
        assert_eq!(c.lookup(&longer, 7), vec![&(0..4)]);
        // Differs in the second block: only the first.
        let mut other = longer.clone();
        other[5] = 99;
        assert_eq!(c.lookup(&other, 19), vec![&(0..4)]);
        // Differs in the first: nothing, though the second block's tokens match.
        let mut first = longer.clone();
        first[0] = 99;
        assert!(c.lookup(&first, 19).is_empty());
        let s = c.stats();
        assert_eq!((s.lookup_tokens, s.hit_tokens), (80, 8 + 4 + 4));
        // Inserting again stores only what is new.
        assert_eq!(insert(&mut c, &longer), 3);
        assert_eq!(c.stats().blocks, 5);
    }

    #[test]
    fn the_least_recently_used_blocks_go_first_and_a_chain_loses_its_tail_first() {
        let mut c = cache(40);
        let a: Vec<u32> = (0..12).collect();
        let b: Vec<u32> = (100..108).collect();
        insert(&mut c, &a);
        insert(&mut c, &b);
        // 5 blocks of 10 bytes in a budget of 40: a's tail went (a and b
        // each were inserted in one go; a is older).
        let s = c.stats();
        assert_eq!((s.blocks, s.bytes, s.evicted_blocks), (4, 40, 1));
        assert_eq!(c.lookup(&a, 12).len(), 2);
        // a was just used: a new block now evicts b's tail, then b's head.
        let d: Vec<u32> = (200..208).collect();
        insert(&mut c, &d);
        assert!(c.lookup(&b, 8).is_empty());
        assert_eq!(c.lookup(&a, 12).len(), 2);
        assert_eq!(c.lookup(&d, 8).len(), 2);
        assert_eq!(c.stats().bytes, 40);
    }

    #[test]
    fn a_prompt_longer_than_the_budget_keeps_its_head() {
        let mut c = cache(25);
        let a: Vec<u32> = (0..40).collect();
        insert(&mut c, &a);
        assert_eq!(c.lookup(&a, 40), vec![&(0..4), &(4..8)]);
    }

    #[test]
    fn a_zero_budget_keeps_nothing_and_errors_keep_what_was_stored() {
        let mut c = cache(0);
        assert_eq!(insert(&mut c, &(0..8).collect::<Vec<_>>()), 0);
        // Three blocks of which the third cannot be made.
        let failing = |c: &mut PrefixCache<Range<usize>>| {
            c.insert(&(0..12).collect::<Vec<_>>(), |r| {
                if r.start == 8 {
                    Err("no memory")
                } else {
                    Ok((r, 10))
                }
            })
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
