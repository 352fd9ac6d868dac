//! A stand-in for the Hugging Face hub on loopback, speaking the two requests
//! shardplane makes of it (the real hub is not reachable from the tests):
//!
//! ```text
//!  GET /api/models/<repo>/revision/{main|<commit>}?blobs=true
//!      ─► {"sha": HUB_COMMIT, "siblings": [m.gguf with lfs {sha256, size}, README.md]}
//!      other revisions ─► 404, X-Error-Code: RevisionNotFound
//!  GET /<repo>/resolve/HUB_COMMIT/m.gguf   the real test model (Range works)
//!  repos: org/gated    wants `Authorization: Bearer HUB_TOKEN`
//!         org/private  wants `Authorization: Bearer HUB_MODEL_TOKEN`
//!         else ─► 401, X-Error-Code: GatedRepo
//! ```
//!
//! Every request's path and Authorization header is recorded.

use std::sync::{Arc, Mutex};

use axum::Router;
use axum::extract::{Path, Request};
use axum::http::StatusCode;
use axum::middleware::{self, Next};
use axum::response::{IntoResponse, Response};
use axum::routing::get;
use sha2::{Digest, Sha256};
use tower_http::services::ServeFile;

/// The token the stand-in hub wants.
pub const HUB_TOKEN: &str = "hf_test_token_0123456789abcdef";
/// The gated repository it serves (with [`HUB_TOKEN`]).
pub const HUB_REPO: &str = "org/gated";
/// A second repository, opened by another token only (a Model's own).
pub const HUB_PRIVATE_REPO: &str = "org/private";
/// The token [`HUB_PRIVATE_REPO`] wants.
pub const HUB_MODEL_TOKEN: &str = "hf_model_token_fedcba9876543210";
/// The file in it (the real test model).
pub const HUB_FILE: &str = "m.gguf";
/// The commit `main` resolves to.
pub const HUB_COMMIT: &str = "0123456789abcdef0123456789abcdef01234567";

/// What the hub saw: each request's path and query, and its Authorization header.
pub type Seen = Arc<Mutex<Vec<(String, Option<String>)>>>;

/// A running stand-in hub.
pub struct Hub {
    /// Its base URL (the endpoint to configure).
    pub base: String,
    /// Each request's path and query, and its Authorization header.
    pub requests: Seen,
    /// The SHA-256 the hub gives for the model file (the file's real one).
    pub sha256: String,
}

/// Starts a stand-in hub on loopback.
pub async fn serve_hub() -> Hub {
    let model = crate::test_model();
    let bytes = std::fs::read(&model).expect("the test model");
    let sha256: String = Sha256::digest(&bytes)
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect();
    let size = bytes.len() as u64;
    drop(bytes);
    let requests: Seen = Arc::new(Mutex::new(Vec::new()));
    let seen = requests.clone();
    let sum = sha256.clone();
    let mut app = Router::new();
    for repo in [HUB_REPO, HUB_PRIVATE_REPO] {
        let sum = sum.clone();
        app = app
            .route(
                &format!("/api/models/{repo}/revision/{{revision}}"),
                get(move |Path(revision): Path<String>| async move {
                    if revision != "main" && revision != HUB_COMMIT {
                        return refusal(
                            StatusCode::NOT_FOUND,
                            "RevisionNotFound",
                            "Invalid rev id",
                        );
                    }
                    json(serde_json::json!({
                        "id": repo,
                        "sha": HUB_COMMIT,
                        "siblings": [
                            {"rfilename": "README.md", "size": 120},
                            {"rfilename": HUB_FILE, "size": 134,
                             "lfs": {"sha256": sum, "size": size, "pointerSize": 134}},
                        ],
                    }))
                }),
            )
            .route_service(
                &format!("/{repo}/resolve/{HUB_COMMIT}/{HUB_FILE}"),
                ServeFile::new(&model),
            );
    }
    let app = app
        .layer(middleware::from_fn(move |req: Request, next: Next| {
            let seen = seen.clone();
            async move {
                let auth = req
                    .headers()
                    .get("authorization")
                    .and_then(|v| v.to_str().ok())
                    .map(str::to_string);
                let path = req
                    .uri()
                    .path_and_query()
                    .map(|p| p.to_string())
                    .unwrap_or_default();
                seen.lock().unwrap().push((path.clone(), auth.clone()));
                let token = if path.contains(&format!("/{HUB_PRIVATE_REPO}/")) {
                    HUB_MODEL_TOKEN
                } else {
                    HUB_TOKEN
                };
                if auth.as_deref() != Some(&format!("Bearer {token}")) {
                    return refusal(
                        StatusCode::UNAUTHORIZED,
                        "GatedRepo",
                        "Access to this model is restricted. You must have access to it and be authenticated to access it. Please log in.",
                    );
                }
                next.run(req).await
            }
        }));
    let base = listen(app).await;
    Hub {
        base,
        requests,
        sha256,
    }
}

/// A public safetensors repository of the stand-in hub ([`serve_repository`]).
pub const HUB_MLX_REPO: &str = "org/mlx";

/// Serves the files of `dir` as [`HUB_MLX_REPO`] at [`HUB_COMMIT`] (no
/// token wanted): the listing gives every file's size and, for weight files
/// (`*.safetensors`), the SHA-256 of its bytes now — or the one `lies` gives
/// for its name. Files read later are served as they are then.
pub async fn serve_repository(dir: &std::path::Path, lies: &[(&str, &str)]) -> (String, Seen) {
    let mut siblings = Vec::new();
    let mut names: Vec<_> = std::fs::read_dir(dir)
        .expect("the repository directory")
        .map(|e| e.expect("an entry").path())
        .collect();
    names.sort();
    for path in names {
        let name = path.file_name().unwrap().to_string_lossy().into_owned();
        let bytes = std::fs::read(&path).expect("a repository file");
        let mut entry = serde_json::json!({"rfilename": name, "size": bytes.len()});
        if name.ends_with(".safetensors") {
            let sum = match lies.iter().find(|(n, _)| *n == name) {
                Some((_, lie)) => lie.to_string(),
                None => Sha256::digest(&bytes)
                    .iter()
                    .map(|b| format!("{b:02x}"))
                    .collect(),
            };
            entry["lfs"] =
                serde_json::json!({"sha256": sum, "size": bytes.len(), "pointerSize": 134});
        }
        siblings.push(entry);
    }
    let listing = serde_json::json!({"id": HUB_MLX_REPO, "sha": HUB_COMMIT, "siblings": siblings});
    let requests: Seen = Arc::new(Mutex::new(Vec::new()));
    let seen = requests.clone();
    let app = Router::new()
        .route(
            &format!("/api/models/{HUB_MLX_REPO}/revision/{{revision}}"),
            get(move |Path(revision): Path<String>| async move {
                if revision != "main" && revision != HUB_COMMIT {
                    return refusal(StatusCode::NOT_FOUND, "RevisionNotFound", "Invalid rev id");
                }
                json(listing)
            }),
        )
        .nest_service(
            &format!("/{HUB_MLX_REPO}/resolve/{HUB_COMMIT}"),
            tower_http::services::ServeDir::new(dir),
        )
        .layer(middleware::from_fn(move |req: Request, next: Next| {
            let seen = seen.clone();
            async move {
                let path = req.uri().path().to_string();
                seen.lock()
                    .unwrap()
                    .push((format!("{} {path}", req.method()), None));
                next.run(req).await
            }
        }));
    let base = listen(app).await;
    (base, requests)
}

/// Serves `app` on a loopback port; returns its base URL.
async fn listen(app: Router) -> String {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .expect("a loopback port");
    let base = format!("http://{}", listener.local_addr().expect("an address"));
    tokio::spawn(async move { axum::serve(listener, app).await.expect("the hub serves") });
    base
}

/// A JSON answer.
fn json(value: serde_json::Value) -> Response {
    ([("content-type", "application/json")], value.to_string()).into_response()
}

/// A refusal as the hub words it: status, X-Error-Code and a JSON error.
fn refusal(status: StatusCode, code: &'static str, message: &str) -> Response {
    let mut response = json(serde_json::json!({ "error": message }));
    *response.status_mut() = status;
    response
        .headers_mut()
        .insert("x-error-code", axum::http::HeaderValue::from_static(code));
    response
}
