//! Models resolved from remote sources read only the GGUF header, with HTTP
//! range requests, from a real HTTP server on loopback.

use std::sync::{Arc, Mutex};

use axum::Router;
use axum::extract::Request;
use axum::middleware::{self, Next};
use axum::response::Response;
use shardplane_models::{http_client, hugging_face_url, resolve_gguf_url};
use shardplane_testkit::fixtures;
use tower_http::services::ServeFile;

/// Serves the test model at `/m.gguf` and `/org/smollm/resolve/main/m.gguf`,
/// and a non-GGUF file at `/junk.gguf`; records every Range header.
async fn server(junk: std::path::PathBuf) -> (String, Arc<Mutex<Vec<String>>>) {
    let ranges = Arc::new(Mutex::new(Vec::new()));
    let seen = ranges.clone();
    let model = shardplane_testkit::test_model();
    let app = Router::new()
        .route_service("/m.gguf", ServeFile::new(&model))
        .route_service("/org/smollm/resolve/main/m.gguf", ServeFile::new(&model))
        .route_service("/junk.gguf", ServeFile::new(junk))
        .layer(middleware::from_fn(move |req: Request, next: Next| {
            let seen = seen.clone();
            async move {
                let range = req
                    .headers()
                    .get("range")
                    .and_then(|v| v.to_str().ok())
                    .unwrap_or("none")
                    .to_string();
                seen.lock().unwrap().push(range);
                let response: Response = next.run(req).await;
                response
            }
        }));
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let base = format!("http://{}", listener.local_addr().unwrap());
    tokio::spawn(async move { axum::serve(listener, app).await.unwrap() });
    (base, ranges)
}

#[tokio::test]
async fn remote_gguf_headers_resolve_with_range_requests() {
    let dir = tempfile::tempdir().unwrap();
    let junk = dir.path().join("junk.gguf");
    std::fs::write(&junk, vec![7u8; 1 << 20]).unwrap();
    let (base, ranges) = server(junk).await;
    let http = http_client().unwrap();
    let spec = fixtures::model("m").spec;

    let status = resolve_gguf_url(&http, &format!("{base}/m.gguf"), &spec)
        .await
        .unwrap();
    assert_eq!(
        (status.architecture.as_deref(), status.layers),
        (Some("llama"), Some(30))
    );
    assert_eq!(status.layer_bytes.len(), 30);
    let size = std::fs::metadata(shardplane_testkit::test_model())
        .unwrap()
        .len();
    assert_eq!(
        status.total_bytes,
        Some(size),
        "the size comes from Content-Range"
    );
    let asked = ranges.lock().unwrap().clone();
    assert_eq!(
        asked,
        vec![format!("bytes=0-{}", (4 << 20) - 1)],
        "one range request for the header, not the whole {size} bytes"
    );

    // The same through a Hugging Face endpoint (a mirror here).
    let url = hugging_face_url(&base, "org/smollm", "m.gguf", None);
    assert_eq!(url, format!("{base}/org/smollm/resolve/main/m.gguf"));
    let hf = resolve_gguf_url(&http, &url, &spec).await.unwrap();
    assert_eq!(hf.layer_bytes, status.layer_bytes);

    // Errors name what went wrong.
    let e = resolve_gguf_url(&http, &format!("{base}/absent.gguf"), &spec)
        .await
        .unwrap_err();
    assert_eq!(e.reason, "SourceUnreachable");
    assert!(e.message.contains("404"), "{}", e.message);
    let e = resolve_gguf_url(&http, &format!("{base}/junk.gguf"), &spec)
        .await
        .unwrap_err();
    assert_eq!(e.reason, "CorruptModel", "{}", e.message);
    let e = resolve_gguf_url(&http, "http://127.0.0.1:9/m.gguf", &spec)
        .await
        .unwrap_err();
    assert_eq!(e.reason, "SourceUnreachable");
}

/// A gated repository on a stand-in hub speaking the hub's protocol: the
/// revision resolves to a commit with the file's LFS SHA-256 only with the
/// token, the header is read from the commit, and no message shows the token.
#[tokio::test]
async fn a_gated_hugging_face_revision_resolves_to_a_commit_with_the_token() {
    use shardplane_models::hub;
    use shardplane_testkit::hub::{HUB_COMMIT, HUB_FILE, HUB_REPO, HUB_TOKEN, serve_hub};
    let hub_server = serve_hub().await;
    let base = &hub_server.base;
    let anonymous = hub::api_client(None).unwrap();
    let e = hub::resolve_revision(&anonymous, base, HUB_REPO, None)
        .await
        .unwrap_err();
    assert_eq!(e.reason, "GatedRepo", "{}", e.message);
    assert!(
        e.message.contains("restricted") && e.message.contains("HF_TOKEN"),
        "{}",
        e.message
    );

    let with_token = hub::api_client(Some(HUB_TOKEN)).unwrap();
    let revision = hub::resolve_revision(&with_token, base, HUB_REPO, Some("main"))
        .await
        .unwrap();
    assert_eq!(revision.commit, HUB_COMMIT);
    let file = revision.file(HUB_REPO, HUB_FILE).unwrap();
    assert_eq!(file.sha256.as_deref(), Some(hub_server.sha256.as_str()));
    let size = std::fs::metadata(shardplane_testkit::test_model())
        .unwrap()
        .len();
    assert_eq!(file.size, Some(size), "the LFS size, not the pointer's");
    assert_eq!(
        revision.file(HUB_REPO, "absent.gguf").unwrap_err().reason,
        "FileNotFound"
    );

    let e = hub::resolve_revision(&with_token, base, HUB_REPO, Some("v9"))
        .await
        .unwrap_err();
    assert_eq!(e.reason, "RevisionNotFound", "{}", e.message);
    assert!(
        e.message.starts_with("org/gated@v9: HTTP 404"),
        "{}",
        e.message
    );

    // The header comes from the pinned commit, with the token.
    let url = hugging_face_url(base, HUB_REPO, HUB_FILE, Some(&revision.commit));
    let spec = fixtures::model("m").spec;
    let status = resolve_gguf_url(&with_token, &url, &spec).await.unwrap();
    assert_eq!(status.layers, Some(30));
    let e = resolve_gguf_url(&anonymous, &url, &spec).await.unwrap_err();
    assert!(!e.message.contains(HUB_TOKEN));

    let requests = hub_server.requests.lock().unwrap().clone();
    assert!(
        requests
            .iter()
            .any(|(path, _)| path == "/api/models/org/gated/revision/main?blobs=true"),
        "{requests:?}"
    );
    assert!(
        requests
            .iter()
            .filter(|(path, _)| path.contains("/resolve/"))
            .all(|(path, _)| path.contains(HUB_COMMIT)),
        "files are fetched at the commit: {requests:?}"
    );
}
