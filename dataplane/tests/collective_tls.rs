//! The tensor group's mesh over TLS with per-node certificates: sums and
//! messages cross encrypted lanes, and a rank whose certificate names
//! another node, one of another CA, or one that speaks plain TCP is refused.

use std::net::{SocketAddr, TcpListener};
use std::sync::Arc;
use std::time::Duration;

use rcgen::ExtendedKeyUsagePurpose;
use shardplane_dataplane::Token;
use shardplane_dataplane::collective::{CollectiveError, Mesh, MeshConfig, MeshTls};
use shardplane_dataplane::tls::Tls;
use shardplane_testkit::tls::TestCa;

/// A node's TLS: a certificate naming `node`, signed by `ca`.
fn node(ca: &TestCa, node: &str) -> Arc<Tls> {
    named(ca, &[node])
}

/// TLS with a certificate naming `names` (none: as the gateway's), signed
/// by `ca`, for serving and calling.
fn named(ca: &TestCa, names: &[&str]) -> Arc<Tls> {
    let usages = vec![
        ExtendedKeyUsagePurpose::ServerAuth,
        ExtendedKeyUsagePurpose::ClientAuth,
    ];
    ca.tls(Some(ca.issue(names, None, usages)))
}

const NODES: [&str; 3] = ["node-0", "node-1", "node-2"];

fn listeners(n: usize) -> (Vec<TcpListener>, Vec<SocketAddr>) {
    let l: Vec<_> = (0..n)
        .map(|_| TcpListener::bind("127.0.0.1:0").unwrap())
        .collect();
    let a = l.iter().map(|l| l.local_addr().unwrap()).collect();
    (l, a)
}

/// Joins `tls.len()` ranks at once, rank r with `tls[r]` (none: plain).
fn join_all(tls: Vec<Option<Arc<Tls>>>, timeout: Duration) -> Vec<Result<Mesh, CollectiveError>> {
    let (listeners, addresses) = listeners(tls.len());
    let nodes: Vec<String> = NODES[..tls.len()].iter().map(|n| n.to_string()).collect();
    std::thread::scope(|s| {
        let joins: Vec<_> = tls
            .into_iter()
            .enumerate()
            .map(|(rank, tls)| {
                let config = MeshConfig {
                    group: "g".into(),
                    rank,
                    addresses: addresses.clone(),
                    token: Token::new("the-group-token-of-this-test").unwrap(),
                    timeout,
                    tls: tls.map(|t| MeshTls::new(&t, nodes.clone()).unwrap()),
                };
                let listener = &listeners[rank];
                s.spawn(move || Mesh::join(listener, &config))
            })
            .collect();
        joins.into_iter().map(|j| j.join().unwrap()).collect()
    })
}

#[test]
fn sums_and_messages_cross_tls_lanes_between_nodes_named_by_their_certificates() {
    let ca = TestCa::new();
    let tls = NODES.iter().map(|n| Some(node(&ca, n))).collect();
    let meshes: Vec<Mesh> = join_all(tls, Duration::from_secs(10))
        .into_iter()
        .map(|m| m.expect("every rank joins"))
        .collect();
    let sums = std::thread::scope(|s| {
        let running: Vec<_> = meshes
            .into_iter()
            .map(|mut mesh| {
                s.spawn(move || {
                    let rank = mesh.rank() as f32;
                    // Small frames, then one larger than the socket buffers
                    // (written while the peers' are read).
                    let mut small = vec![rank + 1.0; 16];
                    mesh.all_reduce(&mut small).unwrap();
                    let mut large = vec![rank; 300_000];
                    mesh.all_reduce(&mut large).unwrap();
                    // A message round: rank 0 to each, each back.
                    if mesh.rank() == 0 {
                        for peer in 1..mesh.ranks() {
                            mesh.send_message(peer, b"command").unwrap();
                            let reply = mesh.receive_message(peer, false).unwrap();
                            assert_eq!(reply.as_deref(), Some(&b"reply"[..]));
                        }
                    } else {
                        let command = mesh.receive_message(0, true).unwrap();
                        assert_eq!(command.as_deref(), Some(&b"command"[..]));
                        mesh.send_message(0, b"reply").unwrap();
                    }
                    (small[0], large[299_999])
                })
            })
            .collect();
        running
            .into_iter()
            .map(|r| r.join().unwrap())
            .collect::<Vec<_>>()
    });
    assert_eq!(sums, vec![(6.0, 3.0); 3]);
}

#[test]
fn a_rank_whose_certificate_names_another_node_is_refused() {
    let ca = TestCa::new();
    // Rightly named, the same two ranks join within the same time.
    let tls = vec![Some(node(&ca, "node-0")), Some(node(&ca, "node-1"))];
    let results = join_all(tls, Duration::from_secs(2));
    assert!(results.iter().all(Result::is_ok), "{results:?}");
    // Rank 1 holds node-2's certificate: rank 0 drops it after its hello
    // (it claims rank 1, which runs on node-1).
    let tls = vec![Some(node(&ca, "node-0")), Some(node(&ca, "node-2"))];
    let results = join_all(tls, Duration::from_secs(2));
    match &results[0] {
        Err(CollectiveError::Join(why)) => assert!(why.contains("[1]"), "{why}"),
        other => panic!("rank 0 joined a rank of another node: {other:?}"),
    }
    assert!(results[1].is_err(), "rank 1 joined");
    // Rank 1 holds a certificate that names no node (as the gateway's).
    let tls = vec![Some(node(&ca, "node-0")), Some(named(&ca, &[]))];
    let results = join_all(tls, Duration::from_secs(2));
    assert!(results.iter().all(Result::is_err), "{results:?}");
    // Rank 0 holds node-2's certificate: rank 1, connecting to it, refuses.
    let tls = vec![Some(node(&ca, "node-2")), Some(node(&ca, "node-1"))];
    let results = join_all(tls, Duration::from_secs(2));
    match &results[1] {
        Err(CollectiveError::Refused { peer: 0, .. }) => {}
        other => panic!("rank 1 joined a rank 0 of another node: {other:?}"),
    }
    assert!(results[0].is_err(), "rank 0 joined");
}

#[test]
fn a_rank_of_another_ca_or_without_tls_is_refused() {
    let (ours, theirs) = (TestCa::new(), TestCa::new());
    let tls = vec![Some(node(&ours, "node-0")), Some(node(&theirs, "node-1"))];
    let results = join_all(tls, Duration::from_secs(2));
    assert!(results[0].is_err() && results[1].is_err(), "{results:?}");
    // Plain TCP to a rank that runs TLS: its handshake fails.
    let tls = vec![Some(node(&ours, "node-0")), None];
    let results = join_all(tls, Duration::from_secs(2));
    match &results[0] {
        Err(CollectiveError::Join(why)) => assert!(why.contains("[1]"), "{why}"),
        other => panic!("rank 0 joined a plain peer: {other:?}"),
    }
    assert!(results[1].is_err(), "the plain rank joined");
}
