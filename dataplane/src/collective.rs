//! The all-reduce of a tensor-parallel group over TCP: a full mesh, every
//! rank sending its partial sum to every other and adding all of them up in
//! rank order, so every rank ends with the same, reproducible sum after one
//! hop.
//!
//! ```text
//!   rank 0 ◄────► rank 1        join: rank j connects to every rank i < j,
//!      ▲ ╲        ▲             both prove they hold the data-plane token
//!      │   ╲      │             (HMAC-SHA256 over both nonces), then
//!      ▼     ╲    ▼             each all-reduce is one frame each way
//!   rank 2 ◄────► rank 3        per pair: sum = p0 + p1 + p2 + p3
//! ```
//!
//! # Wire format (version 1, all integers little-endian)
//!
//! Joining, on each connection (the higher rank connects):
//! 1. connector → acceptor: `hello` = magic `b"SPTP"`, version `u8` (1),
//!    group name length `u16` and its UTF-8 bytes, ranks `u32`, sender's
//!    rank `u32`, a random 32-byte nonce;
//! 2. acceptor → connector: its own `hello`, then a 32-byte
//!    `HMAC-SHA256(token, "accept" ‖ transcript)`;
//! 3. connector → acceptor: `HMAC-SHA256(token, "connect" ‖ transcript)`,
//!
//! where the transcript is the connector's hello followed by the
//! acceptor's. Each side checks the other's tag (in constant time) and that
//! the group, size and ranks are the ones it expects.
//!
//! Each all-reduce, on every connection both ways: a 16-byte header —
//! collective number `u64` (counts from 0 on each mesh), values `u32`,
//! sender's rank `u32` — then the values as `f32`. A header that does not
//! match the receiver's own count or number is an error (the ranks are out
//! of step), never a silent wrong sum.
//!
//! Messages (a tensor group's commands and replies, opaque here) share the
//! connections: the same header with the number `u64::MAX`, the message's
//! length in bytes (at most [`MAX_MESSAGE_BYTES`](crate::MAX_MESSAGE_BYTES))
//! and the sender's rank, then the bytes.
//!
//! The token authenticates the peers; the values are not encrypted.

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::time::{Duration, Instant};

use ring::hmac;
use ring::rand::{SecureRandom, SystemRandom};

use crate::Token;

const MAGIC: &[u8; 4] = b"SPTP";
const VERSION: u8 = 1;
const NONCE: usize = 32;
/// Frames up to this size are written before reading the peers' (they fit
/// the socket buffers); larger ones are written from threads of their own
/// while this one reads, so two ranks writing to each other never block.
const INLINE_BYTES: usize = 32 * 1024;
/// Idle time before the first keep-alive probe on a mesh connection.
const KEEPALIVE_IDLE: Duration = Duration::from_secs(10);
/// Time between keep-alive probes.
const KEEPALIVE_INTERVAL: Duration = Duration::from_secs(3);
/// Unanswered probes after which the connection is dropped.
const KEEPALIVE_PROBES: u32 = 3;
/// The collective number that marks a message.
const MESSAGE: u64 = u64::MAX;
/// Handshakes of accepted connections that run at once while a rank joins.
const MAX_HANDSHAKES: usize = 16;
/// The longest an accepted connection may take to send its hello (each
/// read of it).
const HELLO_WITHIN: Duration = Duration::from_secs(3);

/// What can go wrong in a collective.
#[derive(Debug, thiserror::Error)]
pub enum CollectiveError {
    /// A socket failed or timed out.
    #[error("rank {peer}: {source}")]
    Io {
        /// The peer's rank.
        peer: usize,
        /// What the socket said.
        source: std::io::Error,
    },
    /// A peer that did not prove it holds the token, or belongs to another group.
    #[error("rank {peer}: {why}")]
    Refused {
        /// The rank it claimed (or was expected to be).
        peer: usize,
        /// Why it was refused.
        why: String,
    },
    /// A frame out of step with this rank.
    #[error("rank {peer} is out of step: {why}")]
    OutOfStep {
        /// The peer's rank.
        peer: usize,
        /// What did not match.
        why: String,
    },
    /// Not every rank joined in time.
    #[error("{0}")]
    Join(String),
}

/// This rank's connections to every other rank of its group.
pub struct Mesh {
    rank: usize,
    /// Indexed by rank; `None` at this rank.
    peers: Vec<Option<TcpStream>>,
    collectives: u64,
    /// The longest wait for a peer.
    timeout: Duration,
}

impl std::fmt::Debug for Mesh {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Mesh(rank {} of {})", self.rank, self.peers.len())
    }
}

/// Shuts a mesh's connections (see [`Mesh::closer`]).
#[derive(Debug)]
pub struct MeshCloser(Vec<TcpStream>);

impl MeshCloser {
    /// Shuts every connection both ways; the mesh's next read or write fails.
    pub fn close(&self) {
        for s in &self.0 {
            let _ = s.shutdown(std::net::Shutdown::Both);
        }
    }
}

/// Who joins, and how.
#[derive(Debug, Clone)]
pub struct MeshConfig {
    /// The group's name: peers of another group are refused.
    pub group: String,
    /// This rank.
    pub rank: usize,
    /// Every rank's address, in rank order.
    pub addresses: Vec<SocketAddr>,
    /// Proves membership.
    pub token: Token,
    /// How long joining may take, and the longest wait for a peer's frame.
    pub timeout: Duration,
}

impl Mesh {
    /// Joins the group: accepts the higher ranks on `listener` (bound to
    /// this rank's address) and connects to the lower ones, retrying until
    /// they listen or `config.timeout` passes.
    pub fn join(listener: &TcpListener, config: &MeshConfig) -> Result<Mesh, CollectiveError> {
        let ranks = config.addresses.len();
        let me = config.rank;
        if me >= ranks {
            return Err(CollectiveError::Join(format!(
                "rank {me} of a group of {ranks}"
            )));
        }
        let deadline = Instant::now() + config.timeout;
        let mut peers: Vec<Option<TcpStream>> = (0..ranks).map(|_| None).collect();
        for (peer, address) in config.addresses.iter().enumerate().take(me) {
            let stream = connect(*address, deadline, peer)?;
            prepare(&stream, config.timeout, peer)?;
            prove_connecting(&stream, config, peer)?;
            peers[peer] = Some(stream);
        }
        listener
            .set_nonblocking(true)
            .map_err(|source| CollectiveError::Io { peer: me, source })?;
        // Each accepted connection proves itself on a thread of its own, so
        // a stranger that connects and says nothing holds up no real peer:
        // it is dropped when its hello does not come within `HELLO_WITHIN`.
        // While `MAX_HANDSHAKES` run, further connections wait in the
        // listener's backlog.
        let mut handshakes = Handshakes::new(config, deadline);
        let missing = |peers: &[Option<TcpStream>]| -> Vec<usize> {
            (me + 1..ranks).filter(|&p| peers[p].is_none()).collect()
        };
        loop {
            for (peer, stream) in handshakes.proven(Duration::ZERO) {
                // A rank that connects again gave up on its earlier
                // connection: the newest stays.
                peers[peer] = Some(stream);
            }
            if missing(&peers).is_empty() {
                break;
            }
            if Instant::now() > deadline {
                // Handshakes under way end by the deadline: a peer proven
                // just in time still counts.
                let grace = Instant::now() + Duration::from_millis(500);
                while handshakes.running() > 0 && Instant::now() < grace {
                    for (peer, stream) in handshakes.proven(Duration::from_millis(50)) {
                        peers[peer] = Some(stream);
                    }
                }
                let missing = missing(&peers);
                if missing.is_empty() {
                    break;
                }
                return Err(CollectiveError::Join(format!(
                    "ranks {missing:?} did not join rank {me} within {:?}",
                    config.timeout
                )));
            }
            if handshakes.running() >= MAX_HANDSHAKES {
                std::thread::sleep(Duration::from_millis(2));
                continue;
            }
            match listener.accept() {
                Ok((stream, _)) => handshakes.start(stream),
                Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {
                    std::thread::sleep(Duration::from_millis(2));
                }
                Err(source) => return Err(CollectiveError::Io { peer: me, source }),
            }
        }
        Ok(Mesh {
            rank: me,
            peers,
            collectives: 0,
            timeout: config.timeout,
        })
    }

    /// `ranks` meshes joined over loopback in this process (rank order), for
    /// running a group's ranks on one machine with the same code as across
    /// machines.
    pub fn loopback(
        ranks: usize,
        token: &Token,
        timeout: Duration,
    ) -> Result<Vec<Mesh>, CollectiveError> {
        let listeners = (0..ranks)
            .map(|rank| {
                TcpListener::bind(("127.0.0.1", 0))
                    .map_err(|source| CollectiveError::Io { peer: rank, source })
            })
            .collect::<Result<Vec<_>, _>>()?;
        let addresses = listeners
            .iter()
            .enumerate()
            .map(|(rank, l)| {
                l.local_addr()
                    .map_err(|source| CollectiveError::Io { peer: rank, source })
            })
            .collect::<Result<Vec<_>, _>>()?;
        std::thread::scope(|s| {
            let joins: Vec<_> = listeners
                .iter()
                .enumerate()
                .map(|(rank, listener)| {
                    let config = MeshConfig {
                        group: "loopback".into(),
                        rank,
                        addresses: addresses.clone(),
                        token: token.clone(),
                        timeout,
                    };
                    s.spawn(move || Mesh::join(listener, &config))
                })
                .collect();
            joins
                .into_iter()
                .map(|j| j.join().expect("joining does not panic"))
                .collect()
        })
    }

    /// A handle that shuts this mesh's connections from another thread (a
    /// rank blocked waiting for its leader then wakes to a closed mesh).
    pub fn closer(&self) -> Result<MeshCloser, CollectiveError> {
        let streams = self
            .peers
            .iter()
            .enumerate()
            .filter_map(|(peer, s)| Some((peer, s.as_ref()?)))
            .map(|(peer, s)| {
                s.try_clone()
                    .map_err(|source| CollectiveError::Io { peer, source })
            })
            .collect::<Result<Vec<_>, _>>()?;
        Ok(MeshCloser(streams))
    }

    /// Sets the longest wait for a peer's frame from now on (joining may
    /// have used another).
    pub fn set_timeout(&mut self, timeout: Duration) -> Result<(), CollectiveError> {
        self.timeout = timeout;
        for (peer, stream) in self.peers.iter().enumerate() {
            if let Some(stream) = stream {
                prepare(stream, timeout, peer)?;
            }
        }
        Ok(())
    }

    /// Checks, without waiting, that no peer has gone while the group is
    /// idle (nothing in flight, so nothing is read): a peer whose connection
    /// was closed (its process died) or failed (reset, or keep-alive probes
    /// unanswered) is an error. Bytes waiting to be read are left there.
    pub fn check_idle(&self) -> Result<(), CollectiveError> {
        for (peer, stream) in self.peers.iter().enumerate() {
            let Some(stream) = stream else { continue };
            let io = |source| CollectiveError::Io { peer, source };
            stream.set_nonblocking(true).map_err(io)?;
            let peeked = stream.peek(&mut [0u8; 1]);
            stream.set_nonblocking(false).map_err(io)?;
            match peeked {
                Ok(0) => {
                    return Err(io(std::io::Error::new(
                        std::io::ErrorKind::UnexpectedEof,
                        "the connection was closed while the group was idle",
                    )));
                }
                Ok(_) => {}
                Err(e)
                    if matches!(
                        e.kind(),
                        std::io::ErrorKind::WouldBlock | std::io::ErrorKind::Interrupted
                    ) => {}
                Err(e) => return Err(io(e)),
            }
        }
        Ok(())
    }

    /// This rank.
    pub fn rank(&self) -> usize {
        self.rank
    }

    /// Ranks in the group.
    pub fn ranks(&self) -> usize {
        self.peers.len()
    }

    /// Sends `bytes` to rank `peer` as one message.
    pub fn send_message(&mut self, peer: usize, bytes: &[u8]) -> Result<(), CollectiveError> {
        let stream = self.peer(peer)?;
        if bytes.len() > crate::MAX_MESSAGE_BYTES {
            return Err(CollectiveError::OutOfStep {
                peer,
                why: format!("a message of {} bytes is too long", bytes.len()),
            });
        }
        let mut frame = Vec::with_capacity(16 + bytes.len());
        frame.extend_from_slice(&MESSAGE.to_le_bytes());
        frame.extend_from_slice(&(bytes.len() as u32).to_le_bytes());
        frame.extend_from_slice(&(self.rank as u32).to_le_bytes());
        frame.extend_from_slice(bytes);
        let mut stream = stream;
        stream
            .write_all(&frame)
            .map_err(|source| CollectiveError::Io { peer, source })
    }

    /// Receives the next message from rank `peer`: `None` when it closed
    /// the connection between messages. `idle`: wait as long as it takes
    /// (a follower waiting for its leader's next command), else at most
    /// the mesh's timeout.
    pub fn receive_message(
        &mut self,
        peer: usize,
        idle: bool,
    ) -> Result<Option<Vec<u8>>, CollectiveError> {
        let timeout = self.timeout;
        let mut stream = self.peer(peer)?;
        let io = |source| CollectiveError::Io { peer, source };
        let mut header = [0u8; 16];
        if idle {
            stream.set_read_timeout(None).map_err(io)?;
        }
        let first = stream.read(&mut header);
        if idle {
            stream.set_read_timeout(Some(timeout)).map_err(io)?;
        }
        match first.map_err(io)? {
            0 => return Ok(None),
            n => stream.read_exact(&mut header[n..]).map_err(io)?,
        }
        let number = u64::from_le_bytes(header[..8].try_into().expect("8 bytes"));
        let len = u32::from_le_bytes(header[8..12].try_into().expect("4 bytes")) as usize;
        let rank = u32::from_le_bytes(header[12..].try_into().expect("4 bytes")) as usize;
        if number != MESSAGE || rank != peer || len > crate::MAX_MESSAGE_BYTES {
            return Err(CollectiveError::OutOfStep {
                peer,
                why: format!(
                    "expected a message, got collective {number} of {len} values from rank {rank}"
                ),
            });
        }
        let mut bytes = vec![0u8; len];
        stream.read_exact(&mut bytes).map_err(io)?;
        Ok(Some(bytes))
    }

    fn peer(&self, peer: usize) -> Result<&TcpStream, CollectiveError> {
        self.peers
            .get(peer)
            .and_then(Option::as_ref)
            .ok_or_else(|| {
                CollectiveError::Join(format!("rank {peer} is not a peer of rank {}", self.rank))
            })
    }

    /// Replaces `values` with the sum over every rank of its `values`,
    /// added in rank order.
    pub fn all_reduce(&mut self, values: &mut [f32]) -> Result<(), CollectiveError> {
        if self.peers.len() == 1 {
            return Ok(());
        }
        let number = self.collectives;
        self.collectives += 1;
        let mut frame = Vec::with_capacity(16 + values.len() * 4);
        frame.extend_from_slice(&number.to_le_bytes());
        frame.extend_from_slice(&(values.len() as u32).to_le_bytes());
        frame.extend_from_slice(&(self.rank as u32).to_le_bytes());
        for v in values.iter() {
            frame.extend_from_slice(&v.to_le_bytes());
        }
        let me = self.rank;
        let mut partials: Vec<Option<Vec<f32>>> = (0..self.peers.len()).map(|_| None).collect();
        let peers = &self.peers;
        let received = if frame.len() <= INLINE_BYTES {
            send_all(peers, &frame)?;
            receive_all(peers, number, values.len())?
        } else {
            std::thread::scope(|s| {
                let sending = s.spawn(|| send_all(peers, &frame));
                let received = receive_all(peers, number, values.len());
                let sent = sending.join().expect("sending does not panic");
                sent.and(received)
            })?
        };
        for (peer, p) in received {
            partials[peer] = Some(p);
        }
        // Rank order, this rank's own values included at its place.
        let mine = values.to_vec();
        values.fill(0.0);
        for (peer, partial) in partials.iter().enumerate() {
            let partial = if peer == me {
                &mine
            } else {
                partial.as_ref().expect("a partial from every peer")
            };
            for (v, p) in values.iter_mut().zip(partial) {
                *v += p;
            }
        }
        Ok(())
    }
}

fn send_all(peers: &[Option<TcpStream>], frame: &[u8]) -> Result<(), CollectiveError> {
    for (peer, stream) in peers.iter().enumerate() {
        if let Some(mut stream) = stream.as_ref() {
            stream
                .write_all(frame)
                .map_err(|source| CollectiveError::Io { peer, source })?;
        }
    }
    Ok(())
}

fn receive_all(
    peers: &[Option<TcpStream>],
    number: u64,
    count: usize,
) -> Result<Vec<(usize, Vec<f32>)>, CollectiveError> {
    let mut out = Vec::with_capacity(peers.len());
    let mut bytes = vec![0u8; count * 4];
    for (peer, stream) in peers.iter().enumerate() {
        let Some(mut stream) = stream.as_ref() else {
            continue;
        };
        let io = |source| CollectiveError::Io { peer, source };
        let mut header = [0u8; 16];
        stream.read_exact(&mut header).map_err(io)?;
        let got_number = u64::from_le_bytes(header[..8].try_into().expect("8 bytes"));
        let got_count = u32::from_le_bytes(header[8..12].try_into().expect("4 bytes")) as usize;
        let got_rank = u32::from_le_bytes(header[12..].try_into().expect("4 bytes")) as usize;
        if (got_number, got_count, got_rank) != (number, count, peer) {
            return Err(CollectiveError::OutOfStep {
                peer,
                why: format!(
                    "collective {got_number} of {got_count} values from rank {got_rank}, \
                     expected collective {number} of {count}"
                ),
            });
        }
        stream.read_exact(&mut bytes).map_err(io)?;
        let values = bytes
            .chunks_exact(4)
            .map(|b| f32::from_le_bytes(b.try_into().expect("4 bytes")))
            .collect();
        out.push((peer, values));
    }
    Ok(out)
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

/// What a handshake thread reports: its number, and the rank it proved
/// with its connection (none: dropped).
type Handshake = (u64, Option<(usize, TcpStream)>);

/// The handshakes of the connections a joining rank accepted, each on a
/// thread of its own. Those still running when the join ends (a stranger
/// that sends a byte now and then) are cut then: their connections are
/// shut, which ends their threads' reads.
struct Handshakes {
    config: std::sync::Arc<MeshConfig>,
    deadline: Instant,
    report: std::sync::mpsc::Sender<Handshake>,
    reports: std::sync::mpsc::Receiver<Handshake>,
    /// The running ones' connections (clones), by number.
    running: std::collections::BTreeMap<u64, TcpStream>,
    next: u64,
}

impl Handshakes {
    fn new(config: &MeshConfig, deadline: Instant) -> Self {
        let (report, reports) = std::sync::mpsc::channel();
        Handshakes {
            config: std::sync::Arc::new(config.clone()),
            deadline,
            report,
            reports,
            running: Default::default(),
            next: 0,
        }
    }

    fn running(&self) -> usize {
        self.running.len()
    }

    /// Proves `stream` on a thread of its own (dropped when it cannot be
    /// cloned or no thread starts).
    fn start(&mut self, stream: TcpStream) {
        let Ok(clone) = stream.try_clone() else {
            return;
        };
        let (n, config, report, deadline) = (
            self.next,
            self.config.clone(),
            self.report.clone(),
            self.deadline,
        );
        self.next += 1;
        let handshake = move || {
            let proven = accept_peer(&stream, &config, deadline).map(|peer| (peer, stream));
            let _ = report.send((n, proven));
        };
        if std::thread::Builder::new()
            .name("tensor-join".into())
            .spawn(handshake)
            .is_ok()
        {
            self.running.insert(n, clone);
        }
    }

    /// The peers proven since last asked, waiting up to `wait` for a first
    /// report.
    fn proven(&mut self, wait: Duration) -> Vec<(usize, TcpStream)> {
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

impl Drop for Handshakes {
    fn drop(&mut self) {
        for stream in self.running.values() {
            let _ = stream.shutdown(std::net::Shutdown::Both);
        }
    }
}

/// Sets up an accepted connection and has it prove it is a higher rank of
/// the group, within `deadline` (the join's); its rank, or `None` for a
/// stranger, a rank out of turn, one that fails its proof or a connection
/// that cannot be set up (reset already), which are dropped: the real peer
/// may still come, and one that never does is named when the join times out.
fn accept_peer(stream: &TcpStream, config: &MeshConfig, deadline: Instant) -> Option<usize> {
    let me = config.rank;
    let left = deadline
        .saturating_duration_since(Instant::now())
        .max(Duration::from_millis(1));
    stream.set_nonblocking(false).ok()?;
    prepare(stream, config.timeout, me).ok()?;
    // A real peer sends its hello as it connects: a connection that says
    // nothing for a while is dropped, its place taken by the next.
    stream.set_read_timeout(Some(left.min(HELLO_WITHIN))).ok()?;
    stream.set_write_timeout(Some(left)).ok()?;
    let (peer, theirs) = read_hello(stream, config, None).ok()?;
    if peer <= me {
        return None;
    }
    // The rest may take no longer than the join has left.
    stream.set_read_timeout(Some(left)).ok()?;
    prove_accepting(stream, config, peer, &theirs).ok()?;
    stream.set_read_timeout(Some(config.timeout)).ok()?;
    stream.set_write_timeout(Some(config.timeout)).ok()?;
    Some(peer)
}

fn prepare(stream: &TcpStream, timeout: Duration, peer: usize) -> Result<(), CollectiveError> {
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

/// A `hello` message.
fn hello(config: &MeshConfig, nonce: &[u8; NONCE]) -> Vec<u8> {
    let mut m = Vec::new();
    m.extend_from_slice(MAGIC);
    m.push(VERSION);
    m.extend_from_slice(&(config.group.len() as u16).to_le_bytes());
    m.extend_from_slice(config.group.as_bytes());
    m.extend_from_slice(&(config.addresses.len() as u32).to_le_bytes());
    m.extend_from_slice(&(config.rank as u32).to_le_bytes());
    m.extend_from_slice(nonce);
    m
}

/// Reads a peer's `hello`; returns its rank and the message's bytes.
fn read_hello(
    mut stream: &TcpStream,
    config: &MeshConfig,
    expected: Option<usize>,
) -> Result<(usize, Vec<u8>), CollectiveError> {
    let peer = expected.unwrap_or(usize::MAX);
    let io = |source| CollectiveError::Io { peer, source };
    let refused = |why: String| CollectiveError::Refused { peer, why };
    let mut head = [0u8; 7];
    stream.read_exact(&mut head).map_err(io)?;
    if &head[..4] != MAGIC || head[4] != VERSION {
        return Err(refused(
            "not a shardplane tensor-group peer (version 1)".into(),
        ));
    }
    let len = u16::from_le_bytes([head[5], head[6]]) as usize;
    if len != config.group.len() {
        return Err(refused("a peer of another group".into()));
    }
    let mut rest = vec![0u8; len + 8 + NONCE];
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
    let mut message = head.to_vec();
    message.extend_from_slice(&rest);
    Ok((rank, message))
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

/// This rank's hello with a fresh nonce.
fn my_hello(config: &MeshConfig, peer: usize) -> Result<Vec<u8>, CollectiveError> {
    let mut nonce = [0u8; NONCE];
    SystemRandom::new()
        .fill(&mut nonce)
        .map_err(|_| CollectiveError::Refused {
            peer,
            why: "no randomness for a nonce".into(),
        })?;
    Ok(hello(config, &nonce))
}

/// The connector's side of joining (steps 1–3 of the wire format).
fn prove_connecting(
    mut stream: &TcpStream,
    config: &MeshConfig,
    peer: usize,
) -> Result<(), CollectiveError> {
    let io = |source| CollectiveError::Io { peer, source };
    let mine = my_hello(config, peer)?;
    stream.write_all(&mine).map_err(io)?;
    let (_, theirs) = read_hello(stream, config, Some(peer))?;
    let transcript = [mine, theirs].concat();
    let mut proof = [0u8; 32];
    stream.read_exact(&mut proof).map_err(io)?;
    check_tag(config, b"accept", &transcript, &proof, peer)?;
    stream
        .write_all(tag(config, b"connect", &transcript).as_ref())
        .map_err(io)
}

/// The acceptor's side, once the connector's hello (`theirs`) is read.
fn prove_accepting(
    mut stream: &TcpStream,
    config: &MeshConfig,
    peer: usize,
    theirs: &[u8],
) -> Result<(), CollectiveError> {
    let io = |source| CollectiveError::Io { peer, source };
    let mine = my_hello(config, peer)?;
    let transcript = [theirs, mine.as_slice()].concat();
    stream.write_all(&mine).map_err(io)?;
    stream
        .write_all(tag(config, b"accept", &transcript).as_ref())
        .map_err(io)?;
    let mut proof = [0u8; 32];
    stream.read_exact(&mut proof).map_err(io)?;
    check_tag(config, b"connect", &transcript, &proof, peer)
}
