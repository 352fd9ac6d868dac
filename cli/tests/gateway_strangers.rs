//! The gateway against clients that mean harm, on a real gateway process:
//! a body is not read before the key is checked; bodies over the limit are
//! 413s in each API's shape (declared or streamed); made-up model names do
//! not grow `/metrics`; half-open and idle connections neither stop a
//! normal request nor stay open past the header deadline, and memory stays
//! bounded.

use std::time::{Duration, Instant};

use futures::StreamExt;
use shardplane_testkit::{ChildGuard as Process, control_plane, free_address};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

const KEY: &str = "sk-strangers";

fn gateway(listen: &str, admin: &str, keys: &std::path::Path) -> Process {
    shardplane_testkit::spawn_component(
        env!("CARGO_BIN_EXE_shardplane"),
        &[
            "gateway",
            "--listen",
            listen,
            "--admin-address",
            admin,
            "--api-keys-file",
            keys.to_str().unwrap(),
            "--header-timeout-seconds",
            "2",
            "--body-timeout-seconds",
            "2",
            "--max-body-mib",
            "1",
        ],
    )
}

/// What the server sends on `s` until it closes or `within` passes.
async fn read_all(s: &mut TcpStream, within: Duration) -> (String, bool) {
    let mut out = Vec::new();
    let mut buf = [0u8; 4096];
    let deadline = Instant::now() + within;
    loop {
        let left = deadline.saturating_duration_since(Instant::now());
        match tokio::time::timeout(left, s.read(&mut buf)).await {
            Ok(Ok(0)) | Ok(Err(_)) => return (String::from_utf8_lossy(&out).into(), true),
            Ok(Ok(n)) => out.extend_from_slice(&buf[..n]),
            Err(_) => return (String::from_utf8_lossy(&out).into(), false),
        }
    }
}

/// Sends `head` then `body` on a new connection while reading the answer
/// (a server that refuses early may close before the body is all sent).
async fn exchange(address: &str, head: &[u8], body: &[u8]) -> String {
    let s = TcpStream::connect(address).await.unwrap();
    let (mut r, mut w) = s.into_split();
    let reader = tokio::spawn(async move {
        let mut out = Vec::new();
        let mut buf = [0u8; 4096];
        while let Ok(Ok(n)) = tokio::time::timeout(Duration::from_secs(5), r.read(&mut buf)).await {
            if n == 0 {
                break;
            }
            out.extend_from_slice(&buf[..n]);
        }
        String::from_utf8_lossy(&out).into_owned()
    });
    let _ = w.write_all(head).await;
    let _ = w.write_all(body).await;
    reader.await.unwrap()
}

fn rss_bytes(pid: u32) -> u64 {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap();
    let kib: u64 = status
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
        .unwrap();
    kib << 10
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn strangers_cannot_make_the_gateway_read_grow_or_wait() {
    // The gateway watches the cluster: it needs the API server.
    let _ = control_plane().client().await.unwrap();
    let dir = tempfile::tempdir().unwrap();
    let keys = dir.path().join("keys");
    std::fs::write(&keys, format!("strangers: {KEY}\n")).unwrap();
    let (listen, admin) = (free_address().to_string(), free_address().to_string());
    let gw = gateway(&listen, &admin, &keys);
    let pid = gw.0.id();
    let base = format!("http://{listen}");
    let http = shardplane_models::http_client().unwrap();
    shardplane_testkit::eventually("the gateway answers", Duration::from_secs(60), || async {
        http.get(format!("{base}/v1/models"))
            .bearer_auth(KEY)
            .send()
            .await
            .ok()
            .filter(|r| r.status() == 200)
            .map(|_| ())
    })
    .await;

    // No key and a body declared at 100 MB that never comes: refused at
    // once in OpenAI's shape, without waiting for (or reading) the body.
    let mut s = TcpStream::connect(&listen).await.unwrap();
    s.write_all(
        b"POST /v1/chat/completions HTTP/1.1\r\nHost: gw\r\ncontent-type: application/json\r\n\
          content-length: 100000000\r\n\r\n",
    )
    .await
    .unwrap();
    let asked = Instant::now();
    let (answer, _) = read_all(&mut s, Duration::from_secs(3)).await;
    assert!(answer.starts_with("HTTP/1.1 401"), "{answer}");
    assert!(answer.contains("invalid_api_key"), "{answer}");
    assert!(asked.elapsed() < Duration::from_secs(3));

    // With the key, a body over the limit (1 MiB here) is a 413 in each
    // API's own shape, whether its length is declared (refused before
    // reading) or it is streamed in chunks (refused at the limit).
    let big = "a".repeat((1 << 20) + 4096);
    for (path, check) in [
        ("/v1/chat/completions", "/error/type"),
        ("/v1/messages", "/error/type"),
        ("/api/chat", "/error"),
    ] {
        for streamed in [false, true] {
            let framing = if streamed {
                "transfer-encoding: chunked".to_string()
            } else {
                format!("content-length: {}", big.len())
            };
            let head = format!(
                "POST {path} HTTP/1.1\r\nHost: gw\r\nauthorization: Bearer {KEY}\r\n\
                 x-api-key: {KEY}\r\ncontent-type: application/json\r\n{framing}\r\n\r\n"
            );
            let mut body = Vec::new();
            if streamed {
                for c in big.as_bytes().chunks(64 << 10) {
                    body.extend_from_slice(format!("{:x}\r\n", c.len()).as_bytes());
                    body.extend_from_slice(c);
                    body.extend_from_slice(b"\r\n");
                }
                body.extend_from_slice(b"0\r\n\r\n");
            } else {
                body.extend_from_slice(big.as_bytes());
            }
            let answer = exchange(&listen, head.as_bytes(), &body).await;
            assert!(
                answer.starts_with("HTTP/1.1 413"),
                "{path} streamed={streamed}: {}",
                &answer[..answer.len().min(300)]
            );
            let json = answer.split_once("\r\n\r\n").unwrap().1;
            let v: serde_json::Value = serde_json::from_str(json).unwrap();
            let said = v
                .pointer(check)
                .and_then(|s| s.as_str())
                .unwrap_or_default();
            assert!(
                said == "request_too_large" || said.contains("larger than"),
                "{path}: {v}"
            );
        }
    }
    // A body that stops coming: 408 in the API's shape once the body
    // deadline (2 s here) passes, and the connection is not held.
    let mut s = TcpStream::connect(&listen).await.unwrap();
    s.write_all(
        format!(
            "POST /v1/messages HTTP/1.1\r\nHost: gw\r\nx-api-key: {KEY}\r\n\
             content-type: application/json\r\ncontent-length: 1000\r\n\r\n{{\"model\": "
        )
        .as_bytes(),
    )
    .await
    .unwrap();
    let (answer, _) = read_all(&mut s, Duration::from_secs(6)).await;
    assert!(answer.starts_with("HTTP/1.1 408"), "{answer}");
    assert!(answer.contains("request_timeout"), "{answer}");

    let small = http
        .post(format!("{base}/api/show"))
        .bearer_auth(KEY)
        .body(format!("{{\"model\": \"{}\"}}", "m".repeat(100 << 10)))
        .send()
        .await
        .unwrap();
    assert_eq!(
        small.status(),
        413,
        "routes other than generation take small bodies"
    );
    // Answered before its body was read: the client is told the connection
    // closes, so its next request goes on a new one.
    assert_eq!(
        small.headers().get("connection").map(|v| v.as_bytes()),
        Some(&b"close"[..]),
        "{:?}",
        small.headers()
    );

    // 10,000 requests for made-up models: each a 404, and /metrics does not
    // grow by a series.
    let unknown = |i: usize| {
        let http = http.clone();
        let url = format!("{base}/v1/chat/completions");
        async move {
            http.post(url)
                .bearer_auth(KEY)
                .header("content-type", "application/json")
                .body(format!(
                    "{{\"model\": \"made-up-{i}\", \"messages\": [{{\"role\": \"user\", \"content\": \"hi\"}}]}}"
                ))
                .send()
                .await
                .map(|r| r.status().as_u16())
                .unwrap_or(0)
        }
    };
    assert_eq!(unknown(0).await, 404);
    let before = shardplane_testkit::metrics::scrape(&admin).await;
    let statuses: Vec<u16> = futures::stream::iter(1..10_000)
        .map(unknown)
        .buffer_unordered(16)
        .collect()
        .await;
    assert!(statuses.iter().all(|s| *s == 404), "every one a 404");
    let after = shardplane_testkit::metrics::scrape(&admin).await;
    assert!(!after.contains("made-up-"), "a made-up name became a label");
    assert!(
        after.len() <= before.len() + 16,
        "/metrics grew from {} to {} bytes",
        before.len(),
        after.len()
    );

    // Slowloris: 500 connections that send half a request's headers, 50
    // that send nothing and 20 left idle after a first request. A normal request is still answered at once;
    // the server closes them all after the header deadline (2 s here).
    let rss_before = rss_bytes(pid);
    let mut held = Vec::new();
    for i in 0..550 {
        let mut s = TcpStream::connect(&listen).await.unwrap();
        if i < 500 {
            s.write_all(b"POST /v1/chat/completions HTTP/1.1\r\nHost: gw\r\nx-slow: ")
                .await
                .unwrap();
        }
        held.push(s);
    }
    // And 20 that ask once on a kept-alive connection, then say nothing.
    for _ in 0..20 {
        let mut s = TcpStream::connect(&listen).await.unwrap();
        s.write_all(
            format!("GET /v1/models HTTP/1.1\r\nHost: gw\r\nauthorization: Bearer {KEY}\r\n\r\n")
                .as_bytes(),
        )
        .await
        .unwrap();
        let mut first = [0u8; 12];
        s.read_exact(&mut first).await.unwrap();
        assert_eq!(&first, b"HTTP/1.1 200");
        held.push(s);
    }
    let asked = Instant::now();
    let r = http
        .get(format!("{base}/v1/models"))
        .bearer_auth(KEY)
        .send()
        .await
        .unwrap();
    let took = asked.elapsed();
    assert_eq!(r.status(), 200);
    eprintln!("a normal request beside 570 slow connections: {took:?}");
    assert!(took < Duration::from_secs(1), "{took:?}");
    let rss_peak = rss_bytes(pid);
    eprintln!(
        "gateway memory: {} MiB before, {} MiB with the slow connections",
        rss_before >> 20,
        rss_peak >> 20
    );
    assert!(
        rss_peak < rss_before + (64 << 20),
        "570 connections took {} MiB",
        (rss_peak - rss_before) >> 20
    );
    let closed = futures::future::join_all(
        held.iter_mut()
            .map(|s| async move { read_all(s, Duration::from_secs(8)).await.1 }),
    )
    .await;
    let open = closed.iter().filter(|c| !**c).count();
    assert_eq!(
        open, 0,
        "{open} slow connections still open after the deadline"
    );
    drop(gw);
}
