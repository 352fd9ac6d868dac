//! TLS on real sockets: names checked, callers without a certificate and
//! plain TCP refused, material swapped while serving.

use super::*;
use rcgen::{
    BasicConstraints, CertificateParams, DnType, ExtendedKeyUsagePurpose, IsCa, Issuer, KeyPair,
};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tower::ServiceExt;

struct Ca {
    pem: String,
    issuer: Issuer<'static, KeyPair>,
}

fn ca(name: &str) -> Ca {
    let key = KeyPair::generate().unwrap();
    let mut params = CertificateParams::new(Vec::<String>::new()).unwrap();
    params.distinguished_name.push(DnType::CommonName, name);
    params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
    let pem = params.self_signed(&key).unwrap().pem();
    Ca {
        pem,
        issuer: Issuer::new(params, key),
    }
}

fn node(ca: &Ca, name: &str) -> Material {
    let key = KeyPair::generate().unwrap();
    let mut params = CertificateParams::new(vec![name.to_string()]).unwrap();
    params.extended_key_usages = vec![
        ExtendedKeyUsagePurpose::ServerAuth,
        ExtendedKeyUsagePurpose::ClientAuth,
    ];
    let cert = params.signed_by(&key, &ca.issuer).unwrap();
    Material {
        ca_pem: ca.pem.clone(),
        identity: Some((cert.pem(), key.serialize_pem())),
    }
}

/// A gateway's material: a client-only certificate naming no node.
fn gateway_of(ca: &Ca) -> Material {
    let key = KeyPair::generate().unwrap();
    let mut params = CertificateParams::new(Vec::<String>::new()).unwrap();
    params
        .distinguished_name
        .push(DnType::CommonName, "shardplane-gateway");
    params.extended_key_usages = vec![ExtendedKeyUsagePurpose::ClientAuth];
    let cert = params.signed_by(&key, &ca.issuer).unwrap();
    Material {
        ca_pem: ca.pem.clone(),
        identity: Some((cert.pem(), key.serialize_pem())),
    }
}

/// The CA only, no certificate of its own.
fn trusting(ca: &Ca) -> Material {
    Material {
        ca_pem: ca.pem.clone(),
        identity: None,
    }
}

/// A server that greets every connection it accepts with "hello" and
/// reports who the caller was.
async fn greeter(tls: Option<Arc<Tls>>) -> (SocketAddr, tokio::sync::mpsc::Receiver<PeerInfo>) {
    greeter_counting(tls, |_| {}).await
}

/// [`greeter`], telling `failed` of each handshake it drops.
async fn greeter_counting(
    tls: Option<Arc<Tls>>,
    failed: impl Fn(&'static str) + Send + Sync + 'static,
) -> (SocketAddr, tokio::sync::mpsc::Receiver<PeerInfo>) {
    use tokio_stream::StreamExt;
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let address = listener.local_addr().unwrap();
    let mut conns = incoming(listener, tls, failed).unwrap();
    let (tx, rx) = tokio::sync::mpsc::channel(16);
    tokio::spawn(async move {
        while let Some(Ok(mut conn)) = conns.next().await {
            let _ = tx.send(conn.peer.clone()).await;
            let _ = conn.write_all(b"hello").await;
            let _ = conn.shutdown().await;
        }
    });
    (address, rx)
}

async fn greeting(client: &Arc<Tls>, node: &str, at: SocketAddr) -> Result<String, String> {
    let uri: tonic::codegen::http::Uri = format!("http://{at}").parse().unwrap();
    let io = connector(client, node)
        .unwrap()
        .oneshot(uri)
        .await
        .map_err(|e| e.to_string())?;
    let mut stream = io.into_inner();
    let mut text = String::new();
    stream
        .read_to_string(&mut text)
        .await
        .map_err(|e| e.to_string())?;
    Ok(text)
}

#[tokio::test]
async fn a_client_reaches_only_the_node_it_names_through_the_cluster_ca() {
    let cluster = ca("cluster");
    let server = Tls::new(&node(&cluster, "node-a")).unwrap();
    assert_eq!(server.certificate().unwrap().names, vec!["node-a"]);
    let (at, mut callers) = greeter(Some(server)).await;

    // The gateway: its certificate names no node.
    let gateway = Tls::new(&gateway_of(&cluster)).unwrap();
    assert_eq!(greeting(&gateway, "node-a", at).await.unwrap(), "hello");
    assert_eq!(callers.recv().await.unwrap().node, None);

    // A caller with no certificate (the CA alone, or a token alone) is
    // refused in the handshake: nothing reaches the service.
    let anonymous = Tls::new(&trusting(&cluster)).unwrap();
    assert!(greeting(&anonymous, "node-a", at).await.is_err());

    // Another node: its certificate is sent and its name reaches the server.
    let b = Tls::new(&node(&cluster, "node-b")).unwrap();
    assert_eq!(greeting(&b, "node-a", at).await.unwrap(), "hello");
    assert_eq!(
        callers.recv().await.unwrap().node.as_deref(),
        Some("node-b")
    );

    // The endpoint was meant to be node-b's: node-a's certificate does not do.
    let e = greeting(&gateway, "node-b", at).await.unwrap_err();
    assert!(
        e.contains("not valid for name") || e.contains("NotValidForName"),
        "{e}"
    );

    // A client trusting another CA refuses the server.
    let stranger = Tls::new(&trusting(&ca("other"))).unwrap();
    let e = greeting(&stranger, "node-a", at).await.unwrap_err();
    assert!(
        e.contains("UnknownIssuer") || e.contains("unknown issuer"),
        "{e}"
    );

    // A caller with a certificate from another CA is refused by the server.
    let forged = Tls::new(&Material {
        ca_pem: cluster.pem.clone(),
        identity: node(&ca("other"), "node-c").identity,
    })
    .unwrap();
    assert!(greeting(&forged, "node-a", at).await.is_err());

    // A certificate for calling only (as a gateway's is) does not serve,
    // even were it to name the node: the client checks its usage.
    let key = KeyPair::generate().unwrap();
    let mut params = CertificateParams::new(vec!["node-a".to_string()]).unwrap();
    params.extended_key_usages = vec![ExtendedKeyUsagePurpose::ClientAuth];
    let calling_only = Material {
        ca_pem: cluster.pem.clone(),
        identity: Some((
            params.signed_by(&key, &cluster.issuer).unwrap().pem(),
            key.serialize_pem(),
        )),
    };
    let (posing, _) = greeter(Some(Tls::new(&calling_only).unwrap())).await;
    let e = greeting(&b, "node-a", posing).await.unwrap_err();
    assert!(e.contains("extended key usage for server"), "{e}");
    assert!(
        callers.try_recv().is_err(),
        "refused callers reached the service"
    );
}

#[tokio::test]
async fn plain_tcp_gets_nothing_from_a_tls_server() {
    let cluster = ca("cluster");
    let refused = Arc::new(std::sync::Mutex::new(Vec::new()));
    let seen = refused.clone();
    let (at, mut callers) = greeter_counting(
        Some(Tls::new(&node(&cluster, "node-a")).unwrap()),
        move |why| seen.lock().unwrap().push(why),
    )
    .await;
    let mut tcp = TcpStream::connect(at).await.unwrap();
    // What an HTTP/2 client without TLS sends first.
    tcp.write_all(b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n")
        .await
        .unwrap();
    let mut got = Vec::new();
    let read = tokio::time::timeout(Duration::from_secs(5), tcp.read_to_end(&mut got)).await;
    assert!(!String::from_utf8_lossy(&got).contains("hello"), "{got:?}");
    assert!(read.is_ok(), "the server closes the connection");
    assert!(
        callers.try_recv().is_err(),
        "no connection reached the service"
    );
    // Counted as refused (the count may land just after the close).
    let deadline = std::time::Instant::now() + Duration::from_secs(5);
    while refused.lock().unwrap().is_empty() && std::time::Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    assert_eq!(*refused.lock().unwrap(), vec!["refused"]);
}

#[tokio::test]
async fn renewed_material_is_used_by_the_next_handshake() {
    let (old, new) = (ca("old"), ca("new"));
    let server = Tls::new(&node(&old, "node-a")).unwrap();
    let (at, _callers) = greeter(Some(server.clone())).await;
    let trusts_old = Tls::new(&gateway_of(&old)).unwrap();
    let trusts_new = Tls::new(&gateway_of(&new)).unwrap();
    assert!(greeting(&trusts_old, "node-a", at).await.is_ok());
    assert!(greeting(&trusts_new, "node-a", at).await.is_err());
    server.replace(&node(&new, "node-a")).unwrap();
    assert!(greeting(&trusts_new, "node-a", at).await.is_ok());
    assert!(greeting(&trusts_old, "node-a", at).await.is_err());
    // Material that does not load leaves the working one in place.
    let broken = Material {
        ca_pem: new.pem.clone(),
        identity: Some(("not pem".into(), "not pem".into())),
    };
    assert!(server.replace(&broken).is_err());
    assert!(greeting(&trusts_new, "node-a", at).await.is_ok());
}

#[tokio::test]
async fn a_watched_directory_is_reloaded_when_its_files_change() {
    let dir = tempfile::tempdir().unwrap();
    let write = |m: &Material| {
        std::fs::write(dir.path().join(CA_FILE), &m.ca_pem).unwrap();
        let (cert, key) = m.identity.clone().unwrap();
        std::fs::write(dir.path().join(CERT_FILE), cert).unwrap();
        std::fs::write(dir.path().join(KEY_FILE), key).unwrap();
    };
    let (old, new) = (ca("old"), ca("new"));
    write(&node(&old, "node-a"));
    let server = Tls::new(&Material::read_dir(dir.path()).unwrap()).unwrap();
    let watching = server.watch_dir(dir.path().to_path_buf(), Duration::from_millis(50));
    let (at, _callers) = greeter(Some(server)).await;
    let trusts_new = Tls::new(&gateway_of(&new)).unwrap();
    assert!(greeting(&trusts_new, "node-a", at).await.is_err());
    write(&node(&new, "node-a"));
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    while greeting(&trusts_new, "node-a", at).await.is_err() {
        assert!(std::time::Instant::now() < deadline, "not reloaded");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    watching.abort();
}

#[test]
fn bad_material_names_what_is_wrong() {
    let e = Tls::new(&Material::default()).unwrap_err().to_string();
    assert!(e.contains("CA certificate: no certificate"), "{e}");
    let cluster = ca("cluster");
    let mut mismatched = node(&cluster, "node-a");
    let other_key = node(&cluster, "node-a").identity.unwrap().1;
    mismatched.identity.as_mut().unwrap().1 = other_key;
    let e = Tls::new(&mismatched).unwrap_err().to_string();
    assert!(e.contains("certificate and key"), "{e}");
    let client_only = Tls::new(&trusting(&cluster)).unwrap();
    assert!(matches!(
        client_only.server_config(),
        Err(TlsError::NoIdentity)
    ));
    let dir = tempfile::tempdir().unwrap();
    let e = Material::read_dir(dir.path()).unwrap_err().to_string();
    assert!(e.contains("ca.crt"), "{e}");
    let facts = facts(&node(&cluster, "node-a").identity.unwrap().0).unwrap();
    assert_eq!(facts.names, vec!["node-a"]);
    assert!(facts.not_after > facts.not_before);
}
