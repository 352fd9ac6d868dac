//! Joining a mesh: every higher rank opens two connections to every lower
//! one (one lane each way), and on each the two prove they hold the
//! data-plane token (and, with TLS, a certificate naming their rank's node).
//!
//! ```text
//!  rank j > i:  connect ─► [TLS: rank i's certificate names its node] ─► hello(lane) ─► proofs
//!  rank i:      accept (a thread per handshake, strangers dropped) ─► [TLS] ─► hello ─►
//!               [TLS: the certificate names rank j's node] ─► proofs ─► lane kept
//!  every rank, once it holds all its lanes: ready ─► every peer; ◄─ ready from every peer
//! ```
//!
//! The closing `ready` makes a join fail for every rank when one rank fails
//! after some of its lanes were proven (it drops them, and its peers read
//! the end of the lane instead of its `ready`), rather than leave the
//! others holding a group that breaks at its first all-reduce. A rank that
//! has sent its `ready` therefore waits for its peers' as long as any peer
//! still joining may take, never giving up on a timer a peer could still
//! beat.
//!
//! Every hello names its sender's join attempt (a number that only grows,
//! in a process, and across restarts while the clock does not go back; a
//! rank that dials a peer again takes a new one), so both lanes between two
//! ranks come from one attempt of each: a lane of an attempt a peer gave up
//! is never paired with one of its next.

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use ring::hmac;
use ring::rand::{SecureRandom, SystemRandom};

use super::link::Link;
use super::{
    CollectiveError, HELLO_WITHIN, KEEPALIVE_IDLE, KEEPALIVE_INTERVAL, KEEPALIVE_PROBES,
    MAX_HANDSHAKES, MeshConfig,
};

const MAGIC: &[u8; 4] = b"SPTP";
const VERSION: u8 = 4;
const NONCE: usize = 32;
/// The byte a rank writes on every lane it writes once it holds all its
/// lanes.
const READY: u8 = 0x52;

/// The lane a connection is: written by the rank that connected, or by the
/// rank that accepted.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Lane {
    /// The connector writes, the acceptor reads.
    ConnectorSends = 0,
    /// The acceptor writes, the connector reads.
    AcceptorSends = 1,
}

/// Every rank's lanes, indexed by rank (`None` at this rank): those this
/// rank writes and those it reads.
pub(super) type Lanes = (Vec<Option<Link>>, Vec<Option<Link>>);

/// The last join attempt's number.
static LAST_ATTEMPT: AtomicU64 = AtomicU64::new(0);

/// A new join attempt's number: the time in microseconds, or one more than
/// the last when that is later, so it grows in a process and (with the
/// clock) across a restart.
fn new_attempt() -> u64 {
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_micros() as u64);
    let next = |last: u64| now.max(last + 1);
    let last = LAST_ATTEMPT
        .fetch_update(Ordering::Relaxed, Ordering::Relaxed, |last| {
            Some(next(last))
        })
        .unwrap_or_else(|last| last);
    next(last)
}

/// Joins the group (see [`super::Mesh::join`]).
pub(super) fn join(listener: &TcpListener, config: &MeshConfig) -> Result<Lanes, CollectiveError> {
    join_as(listener, config, new_attempt())
}

/// [`join`] as the attempt `attempt`.
fn join_as(
    listener: &TcpListener,
    config: &MeshConfig,
    attempt: u64,
) -> Result<Lanes, CollectiveError> {
    let ranks = config.addresses.len();
    let me = config.rank;
    if me >= ranks {
        return Err(CollectiveError::Join(format!(
            "rank {me} of a group of {ranks}"
        )));
    }
    let deadline = Instant::now() + config.timeout;
    let mut outs: Vec<Option<Link>> = (0..ranks).map(|_| None).collect();
    let mut ins: Vec<Option<Link>> = (0..ranks).map(|_| None).collect();
    for (peer, address) in config.addresses.iter().enumerate().take(me) {
        // Both lanes from one attempt of the peer's: one that began its
        // join again between the two dials gets both again, as a new
        // attempt of this rank's, so that it shuts the lane its new attempt
        // holds already (this rank drops it) rather than pair it.
        let mut attempt = attempt;
        loop {
            let (out, theirs) = dial(
                *address,
                config,
                deadline,
                (peer, attempt),
                Lane::ConnectorSends,
            )?;
            let (inn, again) = dial(
                *address,
                config,
                deadline,
                (peer, attempt),
                Lane::AcceptorSends,
            )?;
            if theirs == again {
                (outs[peer], ins[peer]) = (Some(out), Some(inn));
                break;
            }
            if Instant::now() >= deadline {
                return Err(CollectiveError::Join(format!(
                    "rank {peer} began its join again while rank {me} connected, \
                     until the join's {:?} ran out",
                    config.timeout
                )));
            }
            attempt = new_attempt();
        }
    }
    listener
        .set_nonblocking(true)
        .map_err(|source| CollectiveError::Io { peer: me, source })?;
    // Each accepted connection proves itself on a thread of its own, so
    // a stranger that connects and says nothing holds up no real peer:
    // it is cut when it has not proven itself within `HELLO_WITHIN`
    // however it drips its bytes, and when `MAX_HANDSHAKES` run, a new
    // connection takes the place of the one that has run longest (a real
    // peer proves itself in a few round trips).
    let mut handshakes = Handshakes::new(config, deadline, attempt);
    let mut held = Held::new(ranks);
    loop {
        held.keep(handshakes.proven(Duration::ZERO));
        if held.missing(me).is_empty() {
            break;
        }
        if Instant::now() > deadline {
            // Handshakes under way end by the deadline: a peer proven
            // just in time still counts.
            let grace = Instant::now() + Duration::from_millis(500);
            while handshakes.unreported() > 0 && Instant::now() < grace {
                held.keep(handshakes.proven(Duration::from_millis(50)));
            }
            let missing = held.missing(me);
            if missing.is_empty() {
                break;
            }
            return Err(CollectiveError::Join(format!(
                "ranks {missing:?} did not join rank {me} within {:?}",
                config.timeout
            )));
        }
        handshakes.cut_overdue();
        match listener.accept() {
            Ok((stream, _)) => {
                // Room for every higher rank's two lanes beside strangers.
                if handshakes.running() >= MAX_HANDSHAKES + 2 * (ranks - me - 1) {
                    handshakes.cut_oldest();
                }
                handshakes.start(stream);
            }
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {
                std::thread::sleep(Duration::from_millis(2));
            }
            Err(source) => return Err(CollectiveError::Io { peer: me, source }),
        }
    }
    drop(handshakes);
    held.into(&mut outs, &mut ins);
    close(&mut outs, &mut ins, config)?;
    Ok((outs, ins))
}

/// Connects to the lower rank `peer` at `address` and proves the lane
/// `lane` as the attempt `attempt`; the link, and the peer's attempt.
fn dial(
    address: SocketAddr,
    config: &MeshConfig,
    deadline: Instant,
    (peer, attempt): (usize, u64),
    lane: Lane,
) -> Result<(Link, u64), CollectiveError> {
    let stream = connect(address, deadline, peer)?;
    // The handshake and proofs within what the join has left; the lane
    // then runs with the mesh's timeout.
    let left = deadline
        .saturating_duration_since(Instant::now())
        .max(Duration::from_millis(1));
    prepare(&stream, left, peer)?;
    let mut link = match &config.tls {
        Some(tls) => tls.connect(stream, peer)?,
        None => Link::Plain(stream),
    };
    let theirs = prove_connecting(&mut link, config, (peer, attempt), lane)?;
    let io = |source| CollectiveError::Io { peer, source };
    let socket = link.socket();
    socket.set_read_timeout(Some(config.timeout)).map_err(io)?;
    socket.set_write_timeout(Some(config.timeout)).map_err(io)?;
    Ok((link, theirs))
}

/// The lanes higher ranks proved to an accepting rank, each peer's from
/// one attempt of its: a lane of an older attempt than one already held is
/// shut, and one of a newer attempt shuts the lanes of the older (that
/// attempt was given up). A rank that connects again within one attempt
/// gave up its earlier connection: the newest stays.
struct Held {
    /// By rank: the attempt, the lane the peer writes and the one it reads.
    peers: Vec<Option<PeerLanes>>,
}

/// A peer's attempt, the lane it writes and the one it reads.
type PeerLanes = (u64, Option<Link>, Option<Link>);

impl Held {
    fn new(ranks: usize) -> Self {
        Held {
            peers: (0..ranks).map(|_| None).collect(),
        }
    }

    fn keep(&mut self, proven: Vec<Proven>) {
        for (peer, lane, attempt, link) in proven {
            let held = &mut self.peers[peer];
            match held {
                Some((a, _, _)) if attempt < *a => {
                    shut(&link);
                    continue;
                }
                Some((a, writes, reads)) if attempt > *a => {
                    for old in [writes.take(), reads.take()].into_iter().flatten() {
                        shut(&old);
                    }
                    *a = attempt;
                }
                Some(_) => {}
                None => *held = Some((attempt, None, None)),
            }
            let (_, writes, reads) = held.as_mut().expect("set above");
            let slot = match lane {
                Lane::ConnectorSends => writes,
                Lane::AcceptorSends => reads,
            };
            if let Some(old) = slot.replace(link) {
                shut(&old);
            }
        }
    }

    /// The higher ranks than `me` that lack a lane.
    fn missing(&self, me: usize) -> Vec<usize> {
        (me + 1..self.peers.len())
            .filter(|&p| !matches!(&self.peers[p], Some((_, Some(_), Some(_)))))
            .collect()
    }

    /// Puts the lanes where the mesh keeps them: the one a peer writes
    /// among those this rank reads, and the other way round.
    fn into(self, outs: &mut [Option<Link>], ins: &mut [Option<Link>]) {
        for (peer, held) in self.peers.into_iter().enumerate() {
            if let Some((_, writes, reads)) = held {
                (ins[peer], outs[peer]) = (writes, reads);
            }
        }
    }
}

/// Shuts a lane that is not kept (its peer reads its end at once).
fn shut(link: &Link) {
    let _ = link.socket().shutdown(std::net::Shutdown::Both);
}

/// Step 4 of the wire format: [`READY`] on every lane this rank writes,
/// then every peer's on each lane it reads. A peer whose lane ends instead
/// gave up on its join, and so does this one. Having sent its own, a rank
/// waits for the others' as long as a peer still joining may take: one
/// still in its join began it before this one's lanes to it were proven,
/// so it holds its lanes (and sends its `ready`) or gives up (and its lanes
/// end) within the mesh's timeout and the half second of grace (the wait
/// is the timeout and [`HELLO_WITHIN`] more); waiting less would let this
/// rank give up while others, holding its `ready`, keep the group. The
/// ranks of a group must share the timeout.
fn close(
    outs: &mut [Option<Link>],
    ins: &mut [Option<Link>],
    config: &MeshConfig,
) -> Result<(), CollectiveError> {
    let wait = config.timeout + HELLO_WITHIN;
    let until = Instant::now() + wait;
    let failed = |peer: usize, why: String| {
        CollectiveError::Join(format!(
            "rank {peer} did not close the join with rank {}: {why}",
            config.rank
        ))
    };
    for (peer, link) in outs.iter_mut().enumerate() {
        if let Some(link) = link {
            link.write_all(&[READY])
                .and_then(|()| link.flush())
                .map_err(|e| {
                    CollectiveError::Join(format!(
                        "rank {} could not send ready to rank {peer}: {e}",
                        config.rank
                    ))
                })?;
        }
    }
    for (peer, link) in ins.iter_mut().enumerate() {
        let Some(link) = link else { continue };
        let io = |source| CollectiveError::Io { peer, source };
        let left = until
            .saturating_duration_since(Instant::now())
            .max(Duration::from_millis(1));
        link.socket().set_read_timeout(Some(left)).map_err(io)?;
        let mut byte = [0u8];
        match link.read_exact(&mut byte) {
            Ok(()) if byte[0] == READY => {}
            Ok(()) => return Err(failed(peer, format!("sent {:#04x}, not ready", byte[0]))),
            Err(e) => {
                use std::io::ErrorKind::*;
                let why = match e.kind() {
                    UnexpectedEof | ConnectionReset | ConnectionAborted | BrokenPipe => {
                        "it gave up its join".into()
                    }
                    WouldBlock | TimedOut => format!("it sent no ready within {wait:?}"),
                    _ => e.to_string(),
                };
                return Err(failed(peer, why));
            }
        }
        link.socket()
            .set_read_timeout(Some(config.timeout))
            .map_err(io)?;
    }
    Ok(())
}

fn connect(
    address: SocketAddr,
    deadline: Instant,
    peer: usize,
) -> Result<TcpStream, CollectiveError> {
    loop {
        let left = deadline.saturating_duration_since(Instant::now());
        match TcpStream::connect_timeout(&address, left.max(Duration::from_millis(10))) {
            Ok(stream) => return Ok(stream),
            Err(source) if Instant::now() >= deadline => {
                return Err(CollectiveError::Io { peer, source });
            }
            // Not listening yet: it is still starting.
            Err(_) => std::thread::sleep(Duration::from_millis(20)),
        }
    }
}

/// A lane a higher rank proved: its rank, the lane, its attempt and the link.
type Proven = (usize, Lane, u64, Link);

/// What a handshake thread reports: its number, and what its connection
/// proved (none: dropped).
type Handshake = (u64, Option<Proven>);

/// How a handshake ended, settled under its lock: a connection cut is
/// never kept, one proven is never cut.
#[derive(Clone, Copy, PartialEq)]
enum Ended {
    Not,
    Cut,
    Proven,
}

/// A running handshake: its connection (a clone), since when (none: cut)
/// and how it ended.
type Running = (TcpStream, Option<Instant>, Arc<Mutex<Ended>>);

/// The handshakes of the connections a joining rank accepted, each on a
/// thread of its own. One still running after `HELLO_WITHIN` (a stranger
/// that sends a byte now and then), or when the join ends, is cut: its
/// connection is shut, which ends its thread's reads.
struct Handshakes {
    config: std::sync::Arc<MeshConfig>,
    deadline: Instant,
    /// This rank's join attempt.
    attempt: u64,
    report: std::sync::mpsc::Sender<Handshake>,
    reports: std::sync::mpsc::Receiver<Handshake>,
    /// The running ones' connections (clones), since when (none: cut, its
    /// thread's report still to come) and how they ended, by number.
    running: std::collections::BTreeMap<u64, Running>,
    next: u64,
}

impl Handshakes {
    fn new(config: &MeshConfig, deadline: Instant, attempt: u64) -> Self {
        let (report, reports) = std::sync::mpsc::channel();
        Handshakes {
            config: std::sync::Arc::new(config.clone()),
            deadline,
            attempt,
            report,
            reports,
            running: Default::default(),
            next: 0,
        }
    }

    /// Handshakes running and not cut.
    fn running(&self) -> usize {
        self.running
            .values()
            .filter(|(_, s, _)| s.is_some())
            .count()
    }

    /// Handshakes whose threads have not reported yet.
    fn unreported(&self) -> usize {
        self.running.len()
    }

    /// Shuts the connections of handshakes running longer than
    /// `HELLO_WITHIN` (a real peer proves itself in a few round trips);
    /// their threads then report them dropped.
    fn cut_overdue(&mut self) {
        for (stream, since, ended) in self.running.values_mut() {
            if since.is_some_and(|s| s.elapsed() > HELLO_WITHIN) {
                cut(stream, ended);
                *since = None;
            }
        }
    }

    /// Cuts the handshake that has run longest.
    fn cut_oldest(&mut self) {
        let oldest = self
            .running
            .values_mut()
            .filter(|(_, since, _)| since.is_some())
            .min_by_key(|(_, since, _)| *since);
        if let Some((stream, since, ended)) = oldest {
            cut(stream, ended);
            *since = None;
        }
    }

    /// Proves `stream` on a thread of its own (dropped when it cannot be
    /// cloned or no thread starts).
    fn start(&mut self, stream: TcpStream) {
        let Ok(clone) = stream.try_clone() else {
            return;
        };
        let (n, config, report, deadline, attempt) = (
            self.next,
            self.config.clone(),
            self.report.clone(),
            self.deadline,
            self.attempt,
        );
        self.next += 1;
        let ended = Arc::new(Mutex::new(Ended::Not));
        let settled = ended.clone();
        let handshake = move || {
            let mut proven = accept_peer(stream, &config, deadline, attempt);
            let mut ended = settled.lock().unwrap_or_else(|e| e.into_inner());
            match *ended {
                Ended::Cut => proven = None,
                _ if proven.is_some() => *ended = Ended::Proven,
                _ => {}
            }
            drop(ended);
            let _ = report.send((n, proven));
        };
        if std::thread::Builder::new()
            .name("tensor-join".into())
            .spawn(handshake)
            .is_ok()
        {
            self.running.insert(n, (clone, Some(Instant::now()), ended));
        }
    }

    /// The peers proven since last asked, waiting up to `wait` for a first
    /// report.
    fn proven(&mut self, wait: Duration) -> Vec<Proven> {
        let first = match wait {
            Duration::ZERO => self.reports.try_recv().ok(),
            _ => self.reports.recv_timeout(wait).ok(),
        };
        let mut proven = Vec::new();
        let mut next = first;
        while let Some((n, outcome)) = next {
            self.running.remove(&n);
            proven.extend(outcome);
            next = self.reports.try_recv().ok();
        }
        proven
    }
}

/// Shuts a running handshake's connection unless it was proven already.
fn cut(stream: &TcpStream, ended: &Mutex<Ended>) {
    let mut ended = ended.lock().unwrap_or_else(|e| e.into_inner());
    if *ended == Ended::Not {
        *ended = Ended::Cut;
        let _ = stream.shutdown(std::net::Shutdown::Both);
    }
}

impl Drop for Handshakes {
    fn drop(&mut self) {
        for (stream, _, _) in self.running.values() {
            let _ = stream.shutdown(std::net::Shutdown::Both);
        }
    }
}

/// Sets up an accepted connection and has it prove it is a higher rank of
/// the group, within `deadline` (the join's), this rank answering as the
/// attempt `attempt`; its rank, lane, attempt and link, or
/// `None` for a stranger, a rank out of turn, one that fails its proof (or,
/// with TLS, its handshake or whose certificate names another node) or a
/// connection that cannot be set up (reset already), which are dropped: the
/// real peer may still come, and one that never does is named when the join
/// times out.
fn accept_peer(
    stream: TcpStream,
    config: &MeshConfig,
    deadline: Instant,
    attempt: u64,
) -> Option<Proven> {
    let me = config.rank;
    let left = deadline
        .saturating_duration_since(Instant::now())
        .max(Duration::from_millis(1));
    stream.set_nonblocking(false).ok()?;
    prepare(&stream, config.timeout, me).ok()?;
    // A real peer starts its handshake (and sends its hello) as it
    // connects: a connection that says nothing for a while is dropped, its
    // place taken by the next.
    stream.set_read_timeout(Some(left.min(HELLO_WITHIN))).ok()?;
    stream.set_write_timeout(Some(left)).ok()?;
    let mut link = match &config.tls {
        Some(tls) => tls.accept(stream).ok()?,
        None => Link::Plain(stream),
    };
    let (peer, lane, their_attempt, theirs) = read_hello(&mut link, config, None).ok()?;
    if peer <= me {
        return None;
    }
    if let Some(tls) = &config.tls {
        tls.check(&link, peer).ok()?;
    }
    // The rest may take no longer than the join has left.
    link.socket().set_read_timeout(Some(left)).ok()?;
    prove_accepting(&mut link, config, (peer, lane, attempt), &theirs).ok()?;
    link.socket().set_read_timeout(Some(config.timeout)).ok()?;
    link.socket().set_write_timeout(Some(config.timeout)).ok()?;
    Some((peer, lane, their_attempt, link))
}

pub(super) fn prepare(
    stream: &TcpStream,
    timeout: Duration,
    peer: usize,
) -> Result<(), CollectiveError> {
    let io = |source| CollectiveError::Io { peer, source };
    stream.set_nodelay(true).map_err(io)?;
    // A follower waits for its leader without a deadline: the kernel's
    // probes find a peer whose machine went silent (no FIN, no RST) within
    // about 20 s.
    let keepalive = socket2::TcpKeepalive::new()
        .with_time(KEEPALIVE_IDLE)
        .with_interval(KEEPALIVE_INTERVAL)
        .with_retries(KEEPALIVE_PROBES);
    socket2::SockRef::from(stream)
        .set_tcp_keepalive(&keepalive)
        .map_err(io)?;
    stream.set_read_timeout(Some(timeout)).map_err(io)?;
    stream.set_write_timeout(Some(timeout)).map_err(io)
}

/// A `hello` message of the attempt `attempt`.
fn hello(config: &MeshConfig, nonce: &[u8; NONCE], lane: Lane, attempt: u64) -> Vec<u8> {
    let mut m = Vec::new();
    m.extend_from_slice(MAGIC);
    m.push(VERSION);
    m.extend_from_slice(&(config.group.len() as u16).to_le_bytes());
    m.extend_from_slice(config.group.as_bytes());
    m.extend_from_slice(&(config.addresses.len() as u32).to_le_bytes());
    m.extend_from_slice(&(config.rank as u32).to_le_bytes());
    m.push(lane as u8);
    m.extend_from_slice(&attempt.to_le_bytes());
    m.extend_from_slice(nonce);
    m
}

/// Reads a peer's `hello`; returns its rank, the lane it names, its
/// attempt and the message's bytes.
fn read_hello(
    stream: &mut Link,
    config: &MeshConfig,
    expected: Option<usize>,
) -> Result<(usize, Lane, u64, Vec<u8>), CollectiveError> {
    let peer = expected.unwrap_or(usize::MAX);
    let io = |source| CollectiveError::Io { peer, source };
    let refused = |why: String| CollectiveError::Refused { peer, why };
    let mut head = [0u8; 7];
    stream.read_exact(&mut head).map_err(io)?;
    if &head[..4] != MAGIC || head[4] != VERSION {
        return Err(refused(format!(
            "not a shardplane tensor-group peer (version {VERSION})"
        )));
    }
    let len = u16::from_le_bytes([head[5], head[6]]) as usize;
    if len != config.group.len() {
        return Err(refused("a peer of another group".into()));
    }
    let mut rest = vec![0u8; len + 17 + NONCE];
    stream.read_exact(&mut rest).map_err(io)?;
    if &rest[..len] != config.group.as_bytes() {
        return Err(refused("a peer of another group".into()));
    }
    let ranks = u32::from_le_bytes(rest[len..len + 4].try_into().expect("4 bytes")) as usize;
    let rank = u32::from_le_bytes(rest[len + 4..len + 8].try_into().expect("4 bytes")) as usize;
    if ranks != config.addresses.len() || rank >= ranks || expected.is_some_and(|e| e != rank) {
        return Err(refused(format!(
            "claims rank {rank} of {ranks}, expected {} of {}",
            expected.map_or("a rank".into(), |e| e.to_string()),
            config.addresses.len()
        )));
    }
    let lane = match rest[len + 8] {
        0 => Lane::ConnectorSends,
        1 => Lane::AcceptorSends,
        other => return Err(refused(format!("names lane {other}, not 0 or 1"))),
    };
    let attempt = u64::from_le_bytes(rest[len + 9..len + 17].try_into().expect("8 bytes"));
    let mut message = head.to_vec();
    message.extend_from_slice(&rest);
    Ok((rank, lane, attempt, message))
}

/// HMAC-SHA256 of `label ‖ transcript` under the token.
fn tag(config: &MeshConfig, label: &[u8], transcript: &[u8]) -> hmac::Tag {
    let key = hmac::Key::new(hmac::HMAC_SHA256, config.token.0.as_bytes());
    let mut ctx = hmac::Context::with_key(&key);
    ctx.update(label);
    ctx.update(transcript);
    ctx.sign()
}

/// Checks a peer's tag in constant time.
fn check_tag(
    config: &MeshConfig,
    label: &[u8],
    transcript: &[u8],
    proof: &[u8],
    peer: usize,
) -> Result<(), CollectiveError> {
    let key = hmac::Key::new(hmac::HMAC_SHA256, config.token.0.as_bytes());
    hmac::verify(&key, &[label, transcript].concat(), proof).map_err(|_| CollectiveError::Refused {
        peer,
        why: "does not hold the data-plane token".into(),
    })
}

/// This rank's hello of the attempt `attempt`, with a fresh nonce.
fn my_hello(
    config: &MeshConfig,
    peer: usize,
    lane: Lane,
    attempt: u64,
) -> Result<Vec<u8>, CollectiveError> {
    let mut nonce = [0u8; NONCE];
    SystemRandom::new()
        .fill(&mut nonce)
        .map_err(|_| CollectiveError::Refused {
            peer,
            why: "no randomness for a nonce".into(),
        })?;
    Ok(hello(config, &nonce, lane, attempt))
}

/// The connector's side of joining (steps 1–3 of the wire format) on the
/// lane `lane`, as the attempt `attempt`; the acceptor's attempt.
fn prove_connecting(
    stream: &mut Link,
    config: &MeshConfig,
    (peer, attempt): (usize, u64),
    lane: Lane,
) -> Result<u64, CollectiveError> {
    let io = |source| CollectiveError::Io { peer, source };
    let mine = my_hello(config, peer, lane, attempt)?;
    stream.write_all(&mine).map_err(io)?;
    stream.flush().map_err(io)?;
    let (_, their_lane, their_attempt, theirs) = read_hello(stream, config, Some(peer))?;
    if their_lane != lane {
        return Err(CollectiveError::Refused {
            peer,
            why: format!("answered lane {lane:?} as {their_lane:?}"),
        });
    }
    let transcript = [mine, theirs].concat();
    let mut proof = [0u8; 32];
    stream.read_exact(&mut proof).map_err(io)?;
    check_tag(config, b"accept", &transcript, &proof, peer)?;
    stream
        .write_all(tag(config, b"connect", &transcript).as_ref())
        .map_err(io)?;
    stream.flush().map_err(io)?;
    Ok(their_attempt)
}

/// The acceptor's side, once the connector's hello (`theirs`) is read, as
/// the attempt `attempt`; its hello names the lane the connector's did.
fn prove_accepting(
    stream: &mut Link,
    config: &MeshConfig,
    (peer, lane, attempt): (usize, Lane, u64),
    theirs: &[u8],
) -> Result<(), CollectiveError> {
    let io = |source| CollectiveError::Io { peer, source };
    let mine = my_hello(config, peer, lane, attempt)?;
    let transcript = [theirs, mine.as_slice()].concat();
    stream.write_all(&mine).map_err(io)?;
    stream
        .write_all(tag(config, b"accept", &transcript).as_ref())
        .map_err(io)?;
    stream.flush().map_err(io)?;
    let mut proof = [0u8; 32];
    stream.read_exact(&mut proof).map_err(io)?;
    check_tag(config, b"connect", &transcript, &proof, peer)
}

#[cfg(test)]
#[path = "join_tests.rs"]
mod tests;
