//! API keys (`Authorization: Bearer <key>` or `x-api-key: <key>`) from a file
//! or a Kubernetes Secret, reloaded every 30 seconds, and optional per-key
//! rate limits.

use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::{Arc, RwLock};
use std::time::{Duration, Instant};

use axum::http::{HeaderMap, StatusCode};
use k8s_openapi::api::core::v1::Secret;
use kube::{Api, Client};

use crate::protocol::{ApiError, Kind};

/// Where the keys come from.
#[derive(Debug, Clone)]
pub enum KeySource {
    /// A file: one key per line, optionally `name:key`; `#` starts a comment.
    File(PathBuf),
    /// A Secret (`namespace/name`): every data entry is a key, named by its entry.
    Secret {
        /// Its namespace.
        namespace: String,
        /// Its name.
        name: String,
    },
    /// No keys: every request is let in (for a gateway on loopback only).
    Anonymous,
}

/// The keys in force and the rate limiter.
#[derive(Clone)]
pub struct Keys {
    source: KeySource,
    /// key → its name (for logs and limits).
    keys: Arc<RwLock<HashMap<String, String>>>,
    per_minute: Option<u32>,
    buckets: Arc<std::sync::Mutex<HashMap<String, (f64, Instant)>>>,
}

/// Parses a keys file.
pub fn parse_keys(text: &str) -> HashMap<String, String> {
    let mut keys = HashMap::new();
    for (i, line) in text.lines().enumerate() {
        let line = line.trim();
        if line.is_empty() || line.starts_with('#') {
            continue;
        }
        match line.split_once(':') {
            Some((name, key)) if !key.trim().is_empty() => {
                keys.insert(key.trim().to_string(), name.trim().to_string());
            }
            _ => {
                keys.insert(line.to_string(), format!("line-{}", i + 1));
            }
        }
    }
    keys
}

impl Keys {
    /// Keys from `source`, limited to `per_minute` requests per key when set.
    pub fn new(source: KeySource, per_minute: Option<u32>) -> Self {
        Keys {
            source,
            keys: Arc::default(),
            per_minute,
            buckets: Arc::default(),
        }
    }

    /// Loads the keys now.
    pub async fn load(&self, client: &Client) -> crate::Result<()> {
        let keys = match &self.source {
            KeySource::Anonymous => return Ok(()),
            KeySource::File(path) => {
                parse_keys(&std::fs::read_to_string(path).map_err(|source| {
                    crate::Error::KeysUnreadable {
                        path: path.clone(),
                        source,
                    }
                })?)
            }
            KeySource::Secret { namespace, name } => {
                let secret = Api::<Secret>::namespaced(client.clone(), namespace)
                    .get(name)
                    .await
                    .map_err(|source| crate::Error::SecretUnreadable {
                        namespace: namespace.clone(),
                        name: name.clone(),
                        source,
                    })?;
                secret
                    .data
                    .unwrap_or_default()
                    .into_iter()
                    .filter_map(|(entry, v)| {
                        let key = String::from_utf8(v.0).ok()?.trim().to_string();
                        (!key.is_empty()).then_some((key, entry))
                    })
                    .collect()
            }
        };
        if keys.is_empty() {
            tracing::warn!("no API keys: every request will be refused");
        }
        *self.keys.write().expect("keys lock") = keys;
        Ok(())
    }

    /// Reloads the keys every 30 seconds.
    pub async fn reload_forever(self, client: Client) {
        loop {
            tokio::time::sleep(Duration::from_secs(30)).await;
            if let Err(e) = self.load(&client).await {
                tracing::warn!(error = %e, "cannot reload the API keys; keeping the old ones");
            }
        }
    }

    /// Checks a request's key and its rate; returns the key's name.
    pub fn check(&self, headers: &HeaderMap) -> Result<String, ApiError> {
        if matches!(self.source, KeySource::Anonymous) {
            return Ok("anonymous".into());
        }
        let presented = headers
            .get("x-api-key")
            .and_then(|v| v.to_str().ok())
            .map(str::trim)
            .or_else(|| {
                headers
                    .get("authorization")
                    .and_then(|v| v.to_str().ok())
                    .and_then(|v| v.strip_prefix("Bearer "))
                    .map(str::trim)
            });
        let unauthorized = |m: &str| ApiError {
            status: StatusCode::UNAUTHORIZED,
            kind: Kind::Authentication,
            message: m.into(),
            retry_after: None,
        };
        let Some(key) = presented else {
            return Err(unauthorized(
                "no API key: send `Authorization: Bearer <key>` or `x-api-key: <key>`",
            ));
        };
        let name = self
            .keys
            .read()
            .expect("keys lock")
            .get(key)
            .cloned()
            .ok_or_else(|| unauthorized("invalid API key"))?;
        if let Some(per_minute) = self.per_minute {
            let rate = per_minute as f64 / 60.0;
            let mut buckets = self.buckets.lock().expect("bucket lock");
            let (tokens, at) = buckets
                .entry(name.clone())
                .or_insert((per_minute as f64, Instant::now()));
            *tokens = (*tokens + at.elapsed().as_secs_f64() * rate).min(per_minute as f64);
            *at = Instant::now();
            if *tokens < 1.0 {
                let wait = ((1.0 - *tokens) / rate).ceil() as u64;
                return Err(ApiError {
                    status: StatusCode::TOO_MANY_REQUESTS,
                    kind: Kind::RateLimited,
                    message: format!("key {name} is over {per_minute} requests per minute"),
                    retry_after: Some(wait.max(1)),
                });
            }
            *tokens -= 1.0;
        }
        Ok(name)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn keys_files_name_their_keys() {
        let keys = parse_keys("# comment\nalice: sk-a\n\nsk-bare\nbob:sk-b\n");
        assert_eq!(keys.get("sk-a").map(String::as_str), Some("alice"));
        assert_eq!(keys.get("sk-b").map(String::as_str), Some("bob"));
        assert_eq!(keys.get("sk-bare").map(String::as_str), Some("line-4"));
        assert_eq!(keys.len(), 3);
    }

    #[test]
    fn keys_are_checked_and_rate_limited() {
        let k = Keys::new(KeySource::File("/nonexistent".into()), Some(2));
        *k.keys.write().unwrap() = parse_keys("alice:sk-a");
        let mut h = HeaderMap::new();
        assert_eq!(k.check(&h).unwrap_err().status, StatusCode::UNAUTHORIZED);
        h.insert("authorization", "Bearer sk-wrong".parse().unwrap());
        assert_eq!(k.check(&h).unwrap_err().status, StatusCode::UNAUTHORIZED);
        h.insert("authorization", "Bearer sk-a".parse().unwrap());
        assert_eq!(k.check(&h).unwrap(), "alice");
        let mut x = HeaderMap::new();
        x.insert("x-api-key", "sk-a".parse().unwrap());
        assert_eq!(k.check(&x).unwrap(), "alice");
        let limited = k.check(&h).unwrap_err();
        assert_eq!(limited.status, StatusCode::TOO_MANY_REQUESTS);
        assert!(limited.retry_after.unwrap() >= 1);
    }
}
