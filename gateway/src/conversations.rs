//! Conversations kept for the Responses API's `previous_response_id`: in
//! the gateway's memory, bounded in count and in bytes, oldest out first.
//!
//! ```text
//!  answer ─► put(response id, conversation + answer) ─► evict oldest while over bounds
//!  next request ─► get(previous_response_id) ─► conversation to continue
//! ```

use std::collections::{HashMap, VecDeque};
use std::sync::{Arc, Mutex};

use shardplane_dataplane as dp;

/// How many responses the store keeps (the oldest go first).
pub const STORED_RESPONSES: usize = 1024;
/// How much text the store keeps, in bytes, across its responses.
pub const STORED_BYTES: usize = 64 << 20;

/// Conversations of earlier responses, by response id: bounded in count and
/// in bytes, oldest out first.
pub struct Store {
    max_entries: usize,
    max_bytes: usize,
    inner: Mutex<Kept>,
}

#[derive(Default)]
struct Kept {
    by_id: HashMap<String, (Arc<Vec<dp::ChatMessage>>, usize)>,
    order: VecDeque<String>,
    bytes: usize,
}

impl Default for Store {
    fn default() -> Self {
        Store::new(STORED_RESPONSES, STORED_BYTES)
    }
}

impl Store {
    /// A store of at most `max_entries` responses and `max_bytes` of text.
    pub fn new(max_entries: usize, max_bytes: usize) -> Self {
        Store {
            max_entries,
            max_bytes,
            inner: Mutex::default(),
        }
    }

    /// The conversation up to and including the response `id`.
    pub fn get(&self, id: &str) -> Option<Arc<Vec<dp::ChatMessage>>> {
        let kept = self.inner.lock().unwrap_or_else(|e| e.into_inner());
        kept.by_id.get(id).map(|(c, _)| c.clone())
    }

    /// Keeps `conversation` as the response `id`'s, dropping the oldest
    /// responses to stay within bounds (one larger than the whole store is
    /// not kept).
    pub fn put(&self, id: String, conversation: Vec<dp::ChatMessage>) {
        let size: usize = conversation
            .iter()
            .map(|m| {
                64 + m.content.len()
                    + m.tool_call_id.len()
                    + m.tool_calls
                        .iter()
                        .map(|c| 64 + c.arguments.len() + c.name.len() + c.id.len())
                        .sum::<usize>()
            })
            .sum();
        if size > self.max_bytes || self.max_entries == 0 {
            return;
        }
        let mut kept = self.inner.lock().unwrap_or_else(|e| e.into_inner());
        while kept.order.len() >= self.max_entries || kept.bytes + size > self.max_bytes {
            let Some(old) = kept.order.pop_front() else {
                break;
            };
            if let Some((_, n)) = kept.by_id.remove(&old) {
                kept.bytes -= n;
            }
        }
        kept.bytes += size;
        kept.order.push_back(id.clone());
        kept.by_id.insert(id, (Arc::new(conversation), size));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn conv(n: usize) -> Vec<dp::ChatMessage> {
        vec![dp::ChatMessage {
            role: "user".into(),
            content: "x".repeat(n),
            ..Default::default()
        }]
    }

    #[test]
    fn the_store_is_bounded_in_count_and_bytes() {
        let store = Store::new(2, 1000);
        store.put("a".into(), conv(10));
        store.put("b".into(), conv(10));
        store.put("c".into(), conv(10));
        assert!(store.get("a").is_none() && store.get("b").is_some() && store.get("c").is_some());
        store.put("d".into(), conv(900));
        assert!(store.get("b").is_none() && store.get("c").is_none() && store.get("d").is_some());
        store.put("e".into(), conv(5000));
        assert!(store.get("e").is_none() && store.get("d").is_some());
    }
}
