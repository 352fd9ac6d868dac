//! With TLS on, every caller needs a certificate from the cluster CA, calls
//! only agents make need a node's, and `Forward` into a stage only from its
//! previous stage's node. A real TLS data plane on a loopback port; callers
//! with node certificates, the gateway's (naming no node), others the CA
//! signed, and none.

use std::sync::Arc;

use shardplane_dataplane as dp;
use shardplane_dataplane::tls::Tls;
use shardplane_testkit::tls::TestCa;
use tokio_stream::wrappers::ReceiverStream;
use tonic::Code;

use super::tests::{middle_stage, open, serve_with, shard, token};

/// The cluster's CA, as the tests here use it.
struct Ca(TestCa);

impl Ca {
    fn new() -> Ca {
        Ca(TestCa::new())
    }

    /// TLS material of `node`, or of the gateway.
    fn tls(&self, node: Option<&str>) -> Arc<Tls> {
        self.0.tls(Some(match node {
            Some(node) => self.0.node(node),
            None => self.0.gateway(),
        }))
    }

    /// A caller that trusts the CA but has no certificate.
    fn anonymous(&self) -> Arc<Tls> {
        self.0.tls(None)
    }
}

#[tokio::test]
async fn calls_between_agents_need_the_right_node_certificate() {
    let ca = Ca::new();
    let (stage, me) = middle_stage();
    // The previous stage d-0-0 is on node-0; this one on node-1.
    let (endpoint, _dir) = serve_with(
        stage,
        vec![shard(0, None), me],
        Some(ca.tls(Some("node-1"))),
    )
    .await;
    let client = |caller: Option<&str>| {
        let tls = ca.tls(caller);
        dp::client(
            dp::channel(&endpoint, Some((&tls, "node-1"))).unwrap(),
            token(),
        )
    };
    let forward = |caller: Option<&'static str>| {
        let mut c = client(caller);
        async move {
            let (tx, rx) = tokio::sync::mpsc::channel(4);
            tx.send(open()).await.unwrap();
            let code = match c.forward(ReceiverStream::new(rx)).await {
                Ok(r) => match r.into_inner().message().await {
                    Ok(_) => Code::Ok,
                    Err(e) => e.code(),
                },
                Err(e) => e.code(),
            };
            drop(tx);
            code
        }
    };
    // Anyone with a certificate from the CA reaches the service; a caller
    // with the token but no certificate does not.
    let status = |tls: Arc<Tls>| {
        let mut c = dp::client(
            dp::channel(&endpoint, Some((&tls, "node-1"))).unwrap(),
            token(),
        );
        async move { c.status(dp::StatusRequest {}).await.map(|_| ()) }
    };
    status(ca.tls(None))
        .await
        .expect("the gateway's certificate");
    status(ca.tls(Some("node-2")))
        .await
        .expect("a node's certificate");
    let refused = status(ca.anonymous()).await.unwrap_err();
    assert!(
        refused.to_string().contains("CertificateRequired"),
        "{refused}"
    );
    // Certificates the signer does not issue, though of the same CA: no
    // DNS name and another common name, or several DNS names.
    let calling = vec![rcgen::ExtendedKeyUsagePurpose::ClientAuth];
    let stranger =
        ca.0.tls(Some(ca.0.issue(&[], Some("someone"), calling.clone())));
    let two_names =
        ca.0.tls(Some(ca.0.issue(&["node-2", "node-0"], None, calling)));
    for (tls, says) in [
        (stranger.clone(), "common name \"someone\""),
        (two_names.clone(), "several DNS names"),
    ] {
        let refused = status(tls).await.unwrap_err();
        assert_eq!(refused.code(), Code::PermissionDenied, "{refused}");
        assert!(refused.message().contains(says), "{refused}");
    }
    // Links are measured between agents: Ping needs a node's certificate.
    let ping = |caller: Option<&str>| {
        let mut c = client(caller);
        async move {
            c.ping(dp::PingRequest::default())
                .await
                .err()
                .map(|e| e.code())
        }
    };
    assert_eq!(ping(Some("node-2")).await, None);
    assert_eq!(ping(None).await, Some(Code::PermissionDenied));
    // Prompts come from clients (naming no node) or this node's own tools,
    // not from another node (the stage is no head: past the check, the
    // call fails as a precondition).
    let generate = |caller: Option<&str>| {
        let mut c = client(caller);
        async move {
            let request = dp::GenerateRequest {
                shard: Some(dp::ShardRef {
                    namespace: super::tests::NS.into(),
                    name: "d-0-1".into(),
                }),
                input: Some(dp::generate_request::Input::Prompt("hi".into())),
                ..Default::default()
            };
            c.generate(request).await.err().map(|e| e.code())
        }
    };
    assert_eq!(generate(Some("node-2")).await, Some(Code::PermissionDenied));
    for tls in [&stranger, &two_names] {
        let mut c = dp::client(
            dp::channel(&endpoint, Some((tls, "node-1"))).unwrap(),
            token(),
        );
        let request = dp::GenerateRequest {
            input: Some(dp::generate_request::Input::Prompt("hi".into())),
            ..Default::default()
        };
        let refused = c.generate(request).await.unwrap_err();
        assert_eq!(refused.code(), Code::PermissionDenied, "{refused}");
        // Nor is the one naming two nodes taken for either.
        let refused = c.ping(dp::PingRequest::default()).await.unwrap_err();
        assert_eq!(refused.code(), Code::PermissionDenied, "{refused}");
    }
    assert_eq!(generate(None).await, Some(Code::FailedPrecondition));
    assert_eq!(
        generate(Some("node-1")).await,
        Some(Code::FailedPrecondition)
    );
    // The gateway (naming no node) and another node may not drive the stage.
    assert_eq!(forward(None).await, Code::PermissionDenied);
    assert_eq!(forward(Some("node-2")).await, Code::PermissionDenied);
    // The previous stage's node passes the check (the sequence then fails
    // for want of a next stage, which this test does not serve).
    let from_previous = forward(Some("node-0")).await;
    assert_ne!(from_previous, Code::PermissionDenied);
    assert_ne!(from_previous, Code::Unauthenticated);

    let read = |caller: Option<&'static str>| {
        let mut c = client(caller);
        async move {
            let request = dp::ReadBlobRequest {
                key: "no-such-model".into(),
                offset: 0,
                length: 1,
            };
            c.read_blob(request).await.err().map(|e| e.code())
        }
    };
    assert_eq!(read(None).await, Some(Code::PermissionDenied));
    // Any node may copy weights: this one is simply not in the cache.
    assert_eq!(read(Some("node-2")).await, Some(Code::NotFound));
}

#[tokio::test]
async fn a_forward_whose_sender_cannot_be_checked_is_refused() {
    let ca = Ca::new();
    let (stage, me) = middle_stage();
    // The watch store has not seen the previous stage d-0-0.
    let (endpoint, _dir) = serve_with(stage, vec![me], Some(ca.tls(Some("node-1")))).await;
    let tls = ca.tls(Some("node-0"));
    let mut c = dp::client(
        dp::channel(&endpoint, Some((&tls, "node-1"))).unwrap(),
        token(),
    );
    let (tx, rx) = tokio::sync::mpsc::channel(4);
    tx.send(open()).await.unwrap();
    let e = match c.forward(ReceiverStream::new(rx)).await {
        Ok(r) => r.into_inner().message().await.unwrap_err(),
        Err(e) => e,
    };
    assert_eq!(e.code(), Code::Unavailable, "{e}");
    assert!(e.message().contains("is not known"), "{e}");
}
