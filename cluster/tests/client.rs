//! The client's call deadline, against a server on loopback that answers
//! what the test says: a call that gets no answer fails after the deadline;
//! a watch whose events come later than the deadline still gets them.

use std::time::{Duration, Instant};

use futures::StreamExt;
use k8s_openapi::api::core::v1::ConfigMap;
use kube::Api;
use kube::api::WatchParams;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpListener;

const DEADLINE: Duration = Duration::from_millis(800);

/// A server that never answers calls, and answers a watch with its headers
/// at once and one event after twice the deadline.
async fn server() -> String {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let address = listener.local_addr().unwrap().to_string();
    tokio::spawn(async move {
        loop {
            let (mut conn, _) = listener.accept().await.unwrap();
            tokio::spawn(async move {
                let mut request = vec![0u8; 4096];
                let n = conn.read(&mut request).await.unwrap_or(0);
                let head = String::from_utf8_lossy(&request[..n]).to_string();
                if !head.contains("watch=true") {
                    // Hold the connection, say nothing.
                    tokio::time::sleep(Duration::from_secs(30)).await;
                    return;
                }
                let _ = conn
                    .write_all(b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ntransfer-encoding: chunked\r\n\r\n")
                    .await;
                tokio::time::sleep(DEADLINE * 2).await;
                let event = r#"{"type":"ADDED","object":{"apiVersion":"v1","kind":"ConfigMap","metadata":{"name":"late","namespace":"default","resourceVersion":"2"}}}"#;
                let chunk = format!("{:x}\r\n{event}\n\r\n0\r\n\r\n", event.len() + 1);
                let _ = conn.write_all(chunk.as_bytes()).await;
            });
        }
    });
    address
}

fn client(address: &str) -> kube::Client {
    let config = kube::Config::new(format!("http://{address}").parse().unwrap());
    shardplane_cluster::client::client_with_deadline(config, DEADLINE).unwrap()
}

#[tokio::test]
async fn a_call_nobody_answers_fails_at_the_deadline() {
    let address = server().await;
    let api: Api<ConfigMap> = Api::namespaced(client(&address), "default");
    let started = Instant::now();
    let error = api.get("anything").await.unwrap_err();
    let took = started.elapsed();
    assert!(
        error.to_string().contains("did not answer within"),
        "{error}"
    );
    assert!(took >= DEADLINE, "failed before the deadline: {took:?}");
    assert!(took < DEADLINE * 10, "held far past the deadline: {took:?}");
}

#[tokio::test]
async fn a_watch_s_events_may_come_later_than_the_deadline() {
    let address = server().await;
    let api: Api<ConfigMap> = Api::namespaced(client(&address), "default");
    let mut events = api
        .watch(&WatchParams::default(), "1")
        .await
        .unwrap()
        .boxed();
    let first = events.next().await.unwrap().unwrap();
    match first {
        kube::api::WatchEvent::Added(cm) => {
            assert_eq!(cm.metadata.name.as_deref(), Some("late"))
        }
        other => panic!("not the event sent: {other:?}"),
    }
}
