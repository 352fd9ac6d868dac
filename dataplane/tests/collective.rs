//! The tensor group's all-reduce over real TCP sockets: sums in rank order,
//! large frames both ways at once, peers that cannot prove the token or
//! belong to another group refused, strangers unable to hold a join up,
//! ranks out of step named.

use std::net::TcpListener;
use std::time::Duration;

use shardplane_dataplane::Token;
use shardplane_dataplane::collective::{CollectiveError, Mesh, MeshConfig};

fn token(text: &str) -> Token {
    Token::new(text).unwrap()
}

/// Runs `f` on every mesh at once, one thread each.
fn on_every_rank<T: Send>(meshes: Vec<Mesh>, f: impl Fn(&mut Mesh) -> T + Sync) -> Vec<T> {
    std::thread::scope(|s| {
        let running: Vec<_> = meshes
            .into_iter()
            .map(|mut m| {
                let f = &f;
                s.spawn(move || f(&mut m))
            })
            .collect();
        running.into_iter().map(|r| r.join().unwrap()).collect()
    })
}

#[test]
fn every_rank_gets_the_same_sum_in_rank_order() {
    let meshes = Mesh::loopback(3, &Token::random().unwrap(), Duration::from_secs(10)).unwrap();
    // 1e8 + 1 - 1e8 in f32 is 0 added left to right; any other order gives 0 or 1 differently.
    let sums = on_every_rank(meshes, |m| {
        let mine = [1e8f32, 1.0, -1e8][m.rank()];
        let mut values = vec![mine, m.rank() as f32];
        m.all_reduce(&mut values).unwrap();
        values
    });
    let in_order = ((1e8f32 + 1.0) - 1e8, 3.0);
    for s in &sums {
        assert_eq!((s[0], s[1]), in_order);
    }
}

#[test]
fn large_frames_cross_both_ways_without_blocking() {
    let meshes = Mesh::loopback(3, &Token::random().unwrap(), Duration::from_secs(10)).unwrap();
    let n = 1 << 20; // 4 MiB per rank, far past the socket buffers
    let sums = on_every_rank(meshes, |m| {
        let mut values = vec![m.rank() as f32 + 1.0; n];
        for _ in 0..3 {
            m.all_reduce(&mut values).unwrap();
        }
        values
    });
    // Each round multiplies by three ranks' worth: 6, then 18, then 54.
    for s in sums {
        assert!(s.iter().all(|&v| v == 54.0));
    }
}

fn listeners(n: usize) -> (Vec<TcpListener>, Vec<std::net::SocketAddr>) {
    let l: Vec<_> = (0..n)
        .map(|_| TcpListener::bind("127.0.0.1:0").unwrap())
        .collect();
    let a = l.iter().map(|l| l.local_addr().unwrap()).collect();
    (l, a)
}

fn config(group: &str, rank: usize, addresses: &[std::net::SocketAddr], t: &str) -> MeshConfig {
    MeshConfig {
        group: group.into(),
        rank,
        addresses: addresses.to_vec(),
        token: token(t),
        timeout: Duration::from_secs(2),
        tls: None,
    }
}

#[test]
fn a_peer_without_the_token_or_of_another_group_is_refused() {
    let right = "a-data-plane-token-of-32-characters";
    let wrong = "another-token-of-thirty-two-chars!";
    for (group, t) in [("g", wrong), ("h", right)] {
        let (listeners, addresses) = listeners(2);
        let results = std::thread::scope(|s| {
            let a = s.spawn(|| Mesh::join(&listeners[0], &config("g", 0, &addresses, right)));
            let b = s.spawn(|| Mesh::join(&listeners[1], &config(group, 1, &addresses, t)));
            (a.join().unwrap(), b.join().unwrap())
        });
        // Rank 0 drops the impostor and waits for the real rank 1 in vain.
        let e = results.0.unwrap_err();
        assert!(matches!(e, CollectiveError::Join(_)), "{e}");
        assert!(e.to_string().contains("ranks [1] did not join"), "{e}");
        let e = results.1.unwrap_err();
        assert!(
            matches!(
                e,
                CollectiveError::Refused { .. } | CollectiveError::Io { .. }
            ),
            "{e}"
        );
    }
}

#[test]
fn strangers_that_connect_and_say_nothing_hold_up_no_real_peer() {
    let (listeners, addresses) = listeners(3);
    let t = "a-data-plane-token-of-32-characters";
    // Connected before any rank, more than the 16 handshakes a rank runs at
    // once: rank 0 accepts them first. Proven one by one, each would have
    // held rank 0's join for its whole 8 s; each is cut when a newer
    // connection needs its place (or after 5 s), so the real ranks, behind
    // them in the backlog, get theirs.
    let strangers: Vec<_> = (0..20)
        .map(|_| std::net::TcpStream::connect(addresses[0]).unwrap())
        .collect();
    let config = |rank| MeshConfig {
        timeout: Duration::from_secs(8),
        ..config("g", rank, &addresses, t)
    };
    let results = std::thread::scope(|s| {
        let joins: Vec<_> = (0..3)
            .map(|rank| {
                let (listeners, config) = (&listeners, &config);
                s.spawn(move || Mesh::join(&listeners[rank], &config(rank)))
            })
            .collect();
        joins
            .into_iter()
            .map(|j| j.join().unwrap())
            .collect::<Vec<_>>()
    });
    let meshes: Vec<Mesh> = results.into_iter().map(|r| r.unwrap()).collect();
    let sums = on_every_rank(meshes, |m| {
        let mut values = vec![m.rank() as f32 + 1.0; 3];
        m.all_reduce(&mut values).unwrap();
        values
    });
    assert!(sums.iter().all(|v| v == &vec![6.0; 3]), "{sums:?}");
    drop(strangers);
}

#[test]
fn strangers_that_drip_bytes_hold_up_no_real_peer() {
    let (listeners, addresses) = listeners(2);
    let t = "a-data-plane-token-of-32-characters";
    // More strangers than the handshakes a rank runs at once, each sending
    // a byte every 2 s (within the 3 s a read may wait, 14 s for a hello's
    // first 7 bytes) and connecting again when cut: each read alone would
    // hold its handshake past the join's 8 s.
    let stop = std::sync::atomic::AtomicBool::new(false);
    let configs: Vec<MeshConfig> = (0..2)
        .map(|rank| MeshConfig {
            timeout: Duration::from_secs(8),
            ..config("g", rank, &addresses, t)
        })
        .collect();
    let joined = std::thread::scope(|s| {
        for _ in 0..24 {
            let (stop, to) = (&stop, addresses[0]);
            s.spawn(move || {
                while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                    let Ok(mut c) = std::net::TcpStream::connect(to) else {
                        std::thread::sleep(Duration::from_millis(50));
                        continue;
                    };
                    while !stop.load(std::sync::atomic::Ordering::Relaxed)
                        && std::io::Write::write_all(&mut c, b"\0").is_ok()
                    {
                        for _ in 0..20 {
                            if stop.load(std::sync::atomic::Ordering::Relaxed) {
                                break;
                            }
                            std::thread::sleep(Duration::from_millis(100));
                        }
                    }
                }
            });
        }
        std::thread::sleep(Duration::from_millis(500));
        let joins: Vec<_> = (0..2)
            .map(|rank| {
                let (listeners, config) = (&listeners, &configs[rank]);
                s.spawn(move || Mesh::join(&listeners[rank], config))
            })
            .collect();
        let joined: Vec<_> = joins.into_iter().map(|j| j.join().unwrap()).collect();
        stop.store(true, std::sync::atomic::Ordering::Relaxed);
        joined
    });
    let meshes: Vec<Mesh> = joined.into_iter().map(|r| r.unwrap()).collect();
    let sums = on_every_rank(meshes, |m| {
        let mut values = vec![m.rank() as f32 + 1.0; 2];
        m.all_reduce(&mut values).unwrap();
        values
    });
    assert!(sums.iter().all(|v| v == &vec![3.0; 2]), "{sums:?}");
}

#[test]
fn ranks_out_of_step_are_named_not_summed() {
    let meshes = Mesh::loopback(2, &Token::random().unwrap(), Duration::from_secs(5)).unwrap();
    let results = on_every_rank(meshes, |m| {
        // Rank 1 sends a different number of values.
        let mut values = vec![1.0; 4 + m.rank()];
        m.all_reduce(&mut values)
    });
    for r in results {
        let e = r.unwrap_err();
        assert!(matches!(e, CollectiveError::OutOfStep { .. }), "{e}");
    }
}

#[test]
fn a_rank_that_never_comes_is_named_when_the_join_times_out() {
    let (listeners, addresses) = listeners(3);
    let t = "a-data-plane-token-of-32-characters";
    let e = std::thread::scope(|s| {
        let a = s.spawn(|| Mesh::join(&listeners[0], &config("g", 0, &addresses, t)));
        let b = s.spawn(|| Mesh::join(&listeners[1], &config("g", 1, &addresses, t)));
        let _ = b.join().unwrap();
        a.join().unwrap()
    })
    .unwrap_err();
    assert!(
        e.to_string().contains("ranks [2] did not join rank 0"),
        "{e}"
    );
}

#[test]
fn a_join_fails_for_every_rank_when_one_rank_fails_after_its_lanes_were_proven() {
    // Rank 2 proves its lanes to rank 0, then fails to reach rank 1 (its
    // address for rank 1 is a listener nobody answers on) and gives up;
    // rank 1 waits for rank 2 in vain. Rank 0 holds every lane it needs
    // from the first two proofs, but its join closes only when every peer
    // says it holds all of its own: it fails with the others rather than
    // count a group that is not there.
    let (listeners, addresses) = listeners(3);
    let silent = TcpListener::bind("127.0.0.1:0").unwrap();
    let t = "a-data-plane-token-of-32-characters";
    let timed = |rank, addresses: &[std::net::SocketAddr], secs| MeshConfig {
        timeout: Duration::from_secs(secs),
        ..config("g", rank, addresses, t)
    };
    let mut astray = addresses.clone();
    astray[1] = silent.local_addr().unwrap();
    let started = std::time::Instant::now();
    let (zero, one, two) = std::thread::scope(|s| {
        let zero = s.spawn(|| Mesh::join(&listeners[0], &timed(0, &addresses, 20)));
        let one = s.spawn(|| Mesh::join(&listeners[1], &timed(1, &addresses, 5)));
        let two = s.spawn(|| Mesh::join(&listeners[2], &timed(2, &astray, 4)));
        (
            zero.join().unwrap(),
            one.join().unwrap(),
            two.join().unwrap(),
        )
    });
    assert!(two.is_err() && one.is_err(), "ranks 1 and 2 cannot join");
    let e = zero.expect_err("rank 0 counted a group whose other ranks failed");
    // (Its own ready meets a closed lane, or a peer's does not come.)
    let e = e.to_string();
    assert!(
        e.contains("did not close the join with rank 0") || e.contains("could not send ready"),
        "{e}"
    );
    // Rank 0 learns it from its peers, not from its own (later) deadline.
    assert!(
        started.elapsed() < Duration::from_secs(15),
        "{:?}",
        started.elapsed()
    );
}

#[test]
fn an_idle_rank_finds_a_peer_gone_without_waiting_and_leaves_waiting_bytes_alone() {
    let mut meshes = Mesh::loopback(3, &Token::random().unwrap(), Duration::from_secs(5)).unwrap();
    let (two, mut one, mut zero) = (
        meshes.pop().unwrap(),
        meshes.pop().unwrap(),
        meshes.pop().unwrap(),
    );
    zero.check_idle().unwrap();
    // A message waiting is neither taken nor an error.
    one.send_message(0, b"reply").unwrap();
    std::thread::sleep(Duration::from_millis(50));
    zero.check_idle().unwrap();
    assert_eq!(zero.receive_message(1, false).unwrap().unwrap(), b"reply");
    // Rank 2's process ends: its connections close.
    drop(two);
    std::thread::sleep(Duration::from_millis(50));
    let e = zero.check_idle().unwrap_err();
    assert!(matches!(e, CollectiveError::Io { peer: 2, .. }), "{e}");
    // The connections the check looked at read as before: a read waits for
    // a message sent later (a socket left non-blocking would fail at once).
    let later = std::thread::spawn(move || {
        std::thread::sleep(Duration::from_millis(200));
        one.send_message(0, b"later").unwrap();
        one
    });
    assert_eq!(zero.receive_message(1, false).unwrap().unwrap(), b"later");
    drop(later.join().unwrap());
}
