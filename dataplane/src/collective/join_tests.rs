//! Joins against scripted peers that speak the wire format by hand: lanes
//! of two attempts of one peer are never paired, and a rank that has sent
//! its `ready` waits for a peer still joining.

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::time::{Duration, Instant};

use super::*;
use crate::Token;

fn config(rank: usize, addresses: &[SocketAddr], timeout: Duration) -> MeshConfig {
    MeshConfig {
        group: "g".into(),
        rank,
        addresses: addresses.to_vec(),
        token: Token::new("the-group-s-secret-token").unwrap(),
        timeout,
        tls: None,
    }
}

/// A group of two on loopback whose one real rank joins on a thread of
/// its own; the other rank's listener and both ranks' configs, for a
/// script to play the other rank.
struct Pair {
    joining: std::thread::JoinHandle<Result<Lanes, CollectiveError>>,
    other: TcpListener,
    configs: [MeshConfig; 2],
}

/// A [`Pair`] whose rank `real` joins.
fn pair_joining(real: usize, timeout: Duration) -> Pair {
    let mut listeners = [
        Some(TcpListener::bind("127.0.0.1:0").unwrap()),
        Some(TcpListener::bind("127.0.0.1:0").unwrap()),
    ];
    let addresses: Vec<SocketAddr> = listeners
        .iter()
        .map(|l| l.as_ref().unwrap().local_addr().unwrap())
        .collect();
    let configs = [
        config(0, &addresses, timeout),
        config(1, &addresses, timeout),
    ];
    let (mine, config) = (listeners[real].take().unwrap(), configs[real].clone());
    Pair {
        joining: std::thread::spawn(move || join(&mine, &config)),
        other: listeners[1 - real].take().unwrap(),
        configs,
    }
}

/// The scripted peer's end of a join: the real rank's ready on `reads` at
/// once, then its own on `writes` at `answer_at`; the real rank's join then
/// ends well.
fn close_as_peer(pair: Pair, (reads, writes): (&mut Link, &mut Link), answer_at: Instant) {
    let mut byte = [0u8];
    reads.read_exact(&mut byte).unwrap();
    assert_eq!(byte[0], READY);
    std::thread::sleep(answer_at.saturating_duration_since(Instant::now()));
    writes.write_all(&[READY]).unwrap();
    writes.flush().unwrap();
    let joined = pair.joining.join().unwrap();
    assert!(joined.is_ok(), "{:?}", joined.err());
}

/// A scripted rank connecting to `address` and proving `lane` as `attempt`.
fn dial_as(config: &MeshConfig, address: SocketAddr, lane: Lane, attempt: u64) -> Link {
    let stream = TcpStream::connect(address).unwrap();
    stream
        .set_read_timeout(Some(Duration::from_secs(5)))
        .unwrap();
    let mut link = Link::Plain(stream);
    prove_connecting(&mut link, config, (0, attempt), lane).unwrap();
    link
}

/// Whether the other end shut `link`: its read ends (rather than waiting).
fn was_shut(link: &mut Link) -> bool {
    link.socket()
        .set_read_timeout(Some(Duration::from_secs(3)))
        .unwrap();
    match link.read(&mut [0u8]) {
        Ok(n) => n == 0,
        Err(e) => !matches!(
            e.kind(),
            std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut
        ),
    }
}

/// A connected pair: one end as a lane, the other as its peer's socket.
fn pair() -> (Link, TcpStream) {
    let l = TcpListener::bind("127.0.0.1:0").unwrap();
    let near = TcpStream::connect(l.local_addr().unwrap()).unwrap();
    let (far, _) = l.accept().unwrap();
    far.set_read_timeout(Some(Duration::from_millis(300)))
        .unwrap();
    (Link::Plain(near), far)
}

/// Whether the peer of `far` shut it (its read ends rather than waits).
fn ended(far: &mut TcpStream) -> bool {
    matches!(far.read(&mut [0u8]), Ok(0))
}

#[test]
fn lanes_of_two_attempts_of_one_peer_are_never_paired() {
    let mut held = Held::new(3);
    let (a0, mut a0_far) = pair();
    let (a1, mut a1_far) = pair();
    held.keep(vec![(2, Lane::ConnectorSends, 7, a0)]);
    assert_eq!(held.missing(0), vec![1, 2]);
    // Rank 2 began its join again (attempt 8) after proving one lane of
    // attempt 7: that lane goes, and one lane of each is not a pair.
    let (b1, mut b1_far) = pair();
    held.keep(vec![(2, Lane::AcceptorSends, 8, b1)]);
    assert!(
        ended(&mut a0_far),
        "the lane of the given-up attempt is shut"
    );
    assert_eq!(held.missing(0), vec![1, 2]);
    // A late lane of attempt 7 is shut at once.
    held.keep(vec![(2, Lane::ConnectorSends, 7, a1)]);
    assert!(ended(&mut a1_far));
    assert_eq!(held.missing(0), vec![1, 2]);
    let (b0, mut b0_far) = pair();
    let (c0, _c0_far) = pair();
    let (c1, _c1_far) = pair();
    held.keep(vec![
        (2, Lane::ConnectorSends, 8, b0),
        (1, Lane::ConnectorSends, 3, c0),
        (1, Lane::AcceptorSends, 3, c1),
    ]);
    assert!(held.missing(0).is_empty());
    assert!(
        !ended(&mut b0_far) && !ended(&mut b1_far),
        "attempt 8's lanes kept"
    );
    let (mut outs, mut ins) = (vec![None, None, None], vec![None, None, None]);
    held.into(&mut outs, &mut ins);
    // The lane rank 2 writes is among those rank 0 reads.
    let mut from_two = ins[2].take().unwrap();
    b0_far.write_all(&[READY]).unwrap();
    let mut byte = [0u8];
    from_two.read_exact(&mut byte).unwrap();
    assert_eq!(byte[0], READY);
    assert!(outs[1].is_some() && ins[1].is_some() && outs[0].is_none());
}

#[test]
fn an_accepting_rank_pairs_a_peer_s_lanes_from_its_latest_attempt_only() {
    let pair = pair_joining(0, Duration::from_secs(5));
    let (one, at) = (pair.configs[1].clone(), pair.configs[0].addresses[0]);
    // Rank 1's attempt 1 proves the lane it writes, then gives up; its
    // attempt 2 proves the other lane first.
    let mut stale = dial_as(&one, at, Lane::ConnectorSends, 1);
    let mut reads = dial_as(&one, at, Lane::AcceptorSends, 2);
    // Rank 0 holds no pair yet: it shuts the stale lane and sends no ready.
    assert!(
        was_shut(&mut stale),
        "a lane of a given-up attempt stays open"
    );
    let mut writes = dial_as(&one, at, Lane::ConnectorSends, 2);
    // The ready comes on attempt 2's lane.
    close_as_peer(pair, (&mut reads, &mut writes), Instant::now());
}

#[test]
fn a_connecting_rank_dials_again_when_a_peer_began_its_join_again_between_its_lanes() {
    let timeout = Duration::from_secs(5);
    let pair = pair_joining(1, timeout);
    let (l0, zero) = (&pair.other, pair.configs[0].clone());
    // Rank 0 answers the first lane as attempt 1 and every later one as
    // attempt 2 (it began its join again between the two).
    l0.set_nonblocking(true).unwrap();
    let until = Instant::now() + Duration::from_secs(5);
    let (mut lanes, mut dialled) = (Vec::new(), Vec::new());
    for attempt in [1, 2, 2, 2] {
        let stream = loop {
            match l0.accept() {
                Ok((s, _)) => break s,
                Err(_) if Instant::now() < until => std::thread::sleep(Duration::from_millis(5)),
                Err(e) => panic!("rank 1 dialled {} lanes, not 4: {e}", lanes.len()),
            }
        };
        stream.set_nonblocking(false).unwrap();
        stream.set_read_timeout(Some(timeout)).unwrap();
        let mut link = Link::Plain(stream);
        let (peer, lane, theirs_is, theirs) = read_hello(&mut link, &zero, None).unwrap();
        prove_accepting(&mut link, &zero, (peer, lane, attempt), &theirs).unwrap();
        lanes.push((lane, link));
        dialled.push(theirs_is);
    }
    // Dialled again as a new attempt, so that rank 0's attempt 2 shuts the
    // lane it holds of rank 1's first (which rank 1 dropped).
    assert_eq!(dialled[0], dialled[1]);
    assert!(
        dialled[2] > dialled[1] && dialled[3] == dialled[2],
        "{dialled:?}"
    );
    let named: Vec<Lane> = lanes.iter().map(|(l, _)| *l).collect();
    assert_eq!(
        named,
        [
            Lane::ConnectorSends,
            Lane::AcceptorSends,
            Lane::ConnectorSends,
            Lane::AcceptorSends
        ]
    );
    // The join closes on attempt 2's pair.
    let (mut reads, mut writes) = (lanes.remove(2).1, lanes.remove(2).1);
    close_as_peer(pair, (&mut reads, &mut writes), Instant::now());
}

#[test]
fn a_rank_that_sent_its_ready_waits_for_a_peer_still_joining() {
    // Rank 1 is proven early, then takes most of its own join (accepting a
    // higher rank, say) before it sends its ready: later than what rank
    // 0's join had left, and than the hello's 5 s.
    let started = Instant::now();
    let pair = pair_joining(0, Duration::from_secs(6));
    let (one, at) = (pair.configs[1].clone(), pair.configs[0].addresses[0]);
    let mut writes = dial_as(&one, at, Lane::ConnectorSends, 1);
    let mut reads = dial_as(&one, at, Lane::AcceptorSends, 1);
    close_as_peer(
        pair,
        (&mut reads, &mut writes),
        started + Duration::from_secs(7),
    );
}
