//! Responses kept for the Responses API: each one's conversation (for
//! `previous_response_id`) and the response itself (for
//! `GET /v1/responses/{id}`), in the gateway's memory, bounded in count and
//! in bytes, oldest out first.
//!
//! ```text
//!  answer ─► put(response id, conversation + answer, response) ─► evict oldest while over bounds
//!  next request ─► get(previous_response_id) ─► conversation to continue
//!  GET / DELETE /v1/responses/{id} ─► response(id) / delete(id)
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
    by_id: HashMap<String, Entry>,
    order: VecDeque<String>,
    bytes: usize,
}

/// One kept response.
struct Entry {
    conversation: Arc<Vec<dp::ChatMessage>>,
    response: Arc<serde_json::Value>,
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
        kept.by_id.get(id).map(|e| e.conversation.clone())
    }

    /// The response `id` as it was answered.
    pub fn response(&self, id: &str) -> Option<Arc<serde_json::Value>> {
        let kept = self.inner.lock().unwrap_or_else(|e| e.into_inner());
        kept.by_id.get(id).map(|e| e.response.clone())
    }

    /// Forgets the response `id`; whether it was kept.
    pub fn delete(&self, id: &str) -> bool {
        let mut kept = self.inner.lock().unwrap_or_else(|e| e.into_inner());
        let Some(e) = kept.by_id.remove(id) else {
            return false;
        };
        kept.bytes -= e.bytes;
        kept.order.retain(|k| k != id);
        true
    }

    /// Keeps `conversation` and `response` as the response `id`'s, dropping
    /// the oldest responses to stay within bounds (one larger than the
    /// whole store is not kept).
    pub fn put(&self, id: String, conversation: Vec<dp::ChatMessage>, response: serde_json::Value) {
        let size: usize = response.to_string().len()
            + conversation
                .iter()
                .map(|m| {
                    64 + m.content.len()
                        + m.tool_call_id.len()
                        + m.tool_calls
                            .iter()
                            .map(|c| 64 + c.arguments.len() + c.name.len() + c.id.len())
                            .sum::<usize>()
                })
                .sum::<usize>();
        if size > self.max_bytes || self.max_entries == 0 {
            return;
        }
        let mut kept = self.inner.lock().unwrap_or_else(|e| e.into_inner());
        while kept.order.len() >= self.max_entries || kept.bytes + size > self.max_bytes {
            let Some(old) = kept.order.pop_front() else {
                break;
            };
            if let Some(e) = kept.by_id.remove(&old) {
                kept.bytes -= e.bytes;
            }
        }
        kept.bytes += size;
        kept.order.push_back(id.clone());
        kept.by_id.insert(
            id,
            Entry {
                conversation: Arc::new(conversation),
                response: Arc::new(response),
                bytes: size,
            },
        );
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
        let put = |id: &str, n: usize| store.put(id.into(), conv(n), serde_json::json!({"id": id}));
        put("a", 10);
        put("b", 10);
        put("c", 10);
        assert!(store.get("a").is_none() && store.get("b").is_some() && store.get("c").is_some());
        assert_eq!(store.response("c").unwrap()["id"], "c");
        put("d", 900);
        assert!(store.get("b").is_none() && store.get("c").is_none() && store.get("d").is_some());
        put("e", 5000);
        assert!(store.get("e").is_none() && store.get("d").is_some());
        // A deleted response is gone, and its bytes are free again.
        assert!(store.delete("d") && !store.delete("d"));
        assert!(store.get("d").is_none() && store.response("d").is_none());
        assert_eq!(store.inner.lock().unwrap().bytes, 0);
        put("f", 900);
        assert!(store.get("f").is_some());
        put("g", 10);
        assert!(store.get("f").is_none() && store.get("g").is_some());
    }
}
