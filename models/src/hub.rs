//! The Hugging Face hub, as far as fetching one revision of a repository
//! needs it: a branch or tag resolved once to a commit, with each file's size
//! and (for LFS files) SHA-256, and the token that opens gated repositories.
//!
//! ```text
//!  GET {endpoint}/api/models/{owner}/{name}/revision/{revision}?blobs=true
//!      (Authorization: Bearer <token>, when one is configured)
//!   ─► {"sha": <commit>, "siblings": [{"rfilename", "size", "lfs": {"sha256", "size"}}]}
//!  files then come from {endpoint}/{repo}/resolve/{commit}/{file}
//! ```
//!
//! The token goes only to the hub's endpoint: clients made by [`client_for`]
//! carry it as a sensitive default header, which reqwest drops when a
//! redirect leaves the host (the hub sends file bodies from a CDN). Nothing
//! here puts it into a message.
//!
//! The `hf-hub` crate is not used: it takes no reqwest client of ours (so no
//! connect and idle timeouts), its 0.x downloader buffers chunks in memory and
//! does not verify SHA-256, and 1.0 drops resuming for plain HTTP and requires
//! hf-xet. The protocol it would speak for us is the two requests above.

use std::time::Duration;

use reqwest::header::{AUTHORIZATION, HeaderMap, HeaderValue};
use serde_json::Value;

use crate::Unresolved;

/// One file of a revision.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct HubFile {
    /// Its path in the repository.
    pub path: String,
    /// Its size in bytes, when the hub says.
    pub size: Option<u64>,
    /// Its SHA-256, for files kept in LFS (model weights are).
    pub sha256: Option<String>,
}

/// A revision resolved to a commit, with its files.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Revision {
    /// The commit (40 hex digits).
    pub commit: String,
    /// Every file of the commit.
    pub files: Vec<HubFile>,
}

impl Revision {
    /// The file at `path`, or a `FileNotFound` naming what the commit has.
    pub fn file(&self, repo: &str, path: &str) -> Result<&HubFile, Unresolved> {
        self.files.iter().find(|f| f.path == path).ok_or_else(|| {
            let mut names: Vec<&str> = self.files.iter().map(|f| f.path.as_str()).collect();
            names.truncate(20);
            Unresolved {
                reason: "FileNotFound",
                message: format!(
                    "{repo} at commit {} has no file {path:?}; it has: {}",
                    self.commit,
                    names.join(", ")
                ),
            }
        })
    }
}

/// An HTTP client for the hub at `endpoint`'s requests: `builder` with the
/// token as a sensitive `Authorization` header when there is one. Use it only
/// for URLs on the hub's endpoint.
pub fn client_for(
    builder: reqwest::ClientBuilder,
    token: Option<&str>,
) -> Result<reqwest::Client, crate::Error> {
    let mut headers = HeaderMap::new();
    if let Some(token) = token {
        let mut value = HeaderValue::from_str(&format!("Bearer {token}"))
            .map_err(|_| crate::Error::TokenNotAHeader)?;
        value.set_sensitive(true);
        headers.insert(AUTHORIZATION, value);
    }
    crate::client(builder.default_headers(headers))
}

/// A client for the hub's API and headers (2-minute deadline per request).
pub fn api_client(token: Option<&str>) -> Result<reqwest::Client, crate::Error> {
    client_for(
        reqwest::Client::builder().timeout(Duration::from_secs(120)),
        token,
    )
}

/// A client for downloading weights from the hub: as
/// [`crate::download_client`], with the token.
pub fn download_client(
    idle: Duration,
    token: Option<&str>,
) -> Result<reqwest::Client, crate::Error> {
    client_for(reqwest::Client::builder().read_timeout(idle), token)
}

/// Reads a token from `file` (whitespace around it dropped); an empty file
/// is no token.
pub fn read_token(file: &std::path::Path) -> Result<Option<String>, crate::Error> {
    let text = std::fs::read_to_string(file).map_err(|source| crate::Error::TokenUnreadable {
        path: file.to_path_buf(),
        source,
    })?;
    let token = text.trim();
    Ok((!token.is_empty()).then(|| token.to_string()))
}

/// Whether `url` is on the hub at `endpoint` (the only place its token goes).
pub fn is_on(endpoint: &str, url: &str) -> bool {
    let endpoint = endpoint.trim_end_matches('/');
    url.strip_prefix(endpoint)
        .is_some_and(|rest| rest.starts_with('/'))
}

/// Resolves `revision` (a branch, tag or commit; `main` when unset) of
/// `repo` on the hub at `endpoint` to a commit and its files. `client`
/// carries the token when the repository is gated or private.
pub async fn resolve_revision(
    client: &reqwest::Client,
    endpoint: &str,
    repo: &str,
    revision: Option<&str>,
) -> Result<Revision, Unresolved> {
    let revision = revision.unwrap_or("main");
    let unreachable = |message: String| Unresolved {
        reason: "SourceUnreachable",
        message,
    };
    let mut url = reqwest::Url::parse(endpoint.trim_end_matches('/'))
        .map_err(|e| unreachable(format!("the hub endpoint {endpoint:?} is not a URL: {e}")))?;
    {
        let mut segments = url
            .path_segments_mut()
            .map_err(|()| unreachable(format!("the hub endpoint {endpoint:?} cannot be a base")))?;
        segments.pop_if_empty().push("api").push("models");
        segments.extend(repo.split('/'));
        // One segment: a branch named `feature/x` is sent as `feature%2Fx`.
        segments.push("revision").push(revision);
    }
    url.set_query(Some("blobs=true"));
    let response = client
        .get(url.clone())
        .send()
        .await
        .map_err(|e| unreachable(format!("GET {url}: {e}")))?;
    let status = response.status();
    let code = response
        .headers()
        .get("x-error-code")
        .and_then(|v| v.to_str().ok())
        .unwrap_or_default()
        .to_string();
    let body = response
        .bytes()
        .await
        .map_err(|e| unreachable(format!("GET {url}: {e}")))?;
    if !status.is_success() {
        return Err(refused(status, &code, repo, revision, &body));
    }
    let json: Value = serde_json::from_slice(&body).map_err(|e| Unresolved {
        reason: "SourceUnreachable",
        message: format!("GET {url}: not the hub's JSON: {e}"),
    })?;
    parse_revision(&json).ok_or_else(|| Unresolved {
        reason: "SourceUnreachable",
        message: format!("GET {url}: the answer names no commit"),
    })
}

/// The commit and files of the hub's revision JSON.
fn parse_revision(json: &Value) -> Option<Revision> {
    let commit = json["sha"].as_str()?.to_string();
    let files = json["siblings"]
        .as_array()
        .into_iter()
        .flatten()
        .filter_map(|s| {
            let lfs = &s["lfs"];
            Some(HubFile {
                path: s["rfilename"].as_str()?.to_string(),
                size: lfs["size"].as_u64().or(s["size"].as_u64()),
                sha256: lfs["sha256"].as_str().map(str::to_string),
            })
        })
        .collect();
    Some(Revision { commit, files })
}

/// What a refusal of the hub means, in a condition's words.
fn refused(
    status: reqwest::StatusCode,
    code: &str,
    repo: &str,
    revision: &str,
    body: &[u8],
) -> Unresolved {
    // The hub's own words, when it sent JSON ({"error": "..."}), kept short.
    let said = serde_json::from_slice::<Value>(body)
        .ok()
        .and_then(|v| v["error"].as_str().map(str::to_string))
        .map(|m| format!(": {}", m.chars().take(300).collect::<String>()))
        .unwrap_or_default();
    let (reason, advice) = match (status.as_u16(), code) {
        (_, "GatedRepo") => (
            "GatedRepo",
            "accept the model's terms on the hub with an account, and give the operator and the agents that account's token (--hugging-face-token-file or HF_TOKEN)",
        ),
        (_, "RevisionNotFound") => (
            "RevisionNotFound",
            "set spec.source.huggingFace.revision to a branch, tag or commit that exists",
        ),
        (_, "RepoNotFound") | (404, _) => (
            "RepoNotFound",
            "check spec.source.huggingFace.repo; a private repository also answers this way without a token",
        ),
        (401 | 403, _) => (
            "Unauthorized",
            "the hub refused the token or wants one: check --hugging-face-token-file or HF_TOKEN",
        ),
        _ => (
            "SourceUnreachable",
            "the hub may be down; this is tried again",
        ),
    };
    Unresolved {
        reason,
        message: format!("{repo}@{revision}: HTTP {status}{said}; {advice}"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_token_goes_only_to_the_hub() {
        let hub = "https://huggingface.co";
        assert!(is_on(
            hub,
            "https://huggingface.co/org/m/resolve/abc/m.gguf"
        ));
        assert!(is_on("https://hf.example/", "https://hf.example/org/m"));
        assert!(!is_on(hub, "https://huggingface.co.evil.example/org/m"));
        assert!(!is_on(hub, "https://example.com/https://huggingface.co/x"));
    }

    #[test]
    fn lfs_sizes_and_sums_are_read_and_plain_files_keep_their_size() {
        let json = serde_json::json!({
            "sha": "0123456789abcdef0123456789abcdef01234567",
            "siblings": [
                {"rfilename": "config.json", "size": 700},
                {"rfilename": "m.gguf", "size": 135,
                 "lfs": {"sha256": "ab".repeat(32), "size": 1_000_000_000u64, "pointerSize": 135}}
            ]
        });
        let r = parse_revision(&json).unwrap();
        assert_eq!(r.commit, "0123456789abcdef0123456789abcdef01234567");
        assert_eq!(r.files[0].size, Some(700));
        assert_eq!(r.files[0].sha256, None);
        assert_eq!(r.files[1].size, Some(1_000_000_000));
        assert_eq!(r.files[1].sha256.as_deref(), Some("ab".repeat(32).as_str()));
        let missing = r.file("org/m", "other.gguf").unwrap_err();
        assert_eq!(missing.reason, "FileNotFound");
        assert!(
            missing.message.contains("config.json, m.gguf"),
            "{}",
            missing.message
        );
    }

    #[test]
    fn refusals_say_what_to_change() {
        let gated = refused(
            reqwest::StatusCode::UNAUTHORIZED,
            "GatedRepo",
            "org/m",
            "main",
            br#"{"error":"Access to model org/m is restricted."}"#,
        );
        assert_eq!(gated.reason, "GatedRepo");
        assert!(gated.message.contains("restricted") && gated.message.contains("HF_TOKEN"));
        let revision = refused(
            reqwest::StatusCode::NOT_FOUND,
            "RevisionNotFound",
            "org/m",
            "v9",
            b"",
        );
        assert_eq!(revision.reason, "RevisionNotFound");
        assert!(
            revision.message.starts_with("org/m@v9: HTTP 404"),
            "{}",
            revision.message
        );
        assert_eq!(
            refused(reqwest::StatusCode::NOT_FOUND, "", "org/m", "main", b"").reason,
            "RepoNotFound"
        );
        assert_eq!(
            refused(reqwest::StatusCode::BAD_GATEWAY, "", "org/m", "main", b"").reason,
            "SourceUnreachable"
        );
    }
}
