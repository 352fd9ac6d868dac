//! The all-reduce of a tensor-parallel group over TCP: a full mesh, every
//! rank sending its partial sum to every other and adding all of them up in
//! rank order, so every rank ends with the same, reproducible sum after one
//! hop.
//!
//! ```text
//!   rank 0 ◄────► rank 1        join: rank j opens two connections to every
//!      ▲ ╲        ▲             rank i < j (a lane each way), TLS when the
//!      │   ╲      │             data plane runs it; on each both prove they
//!      ▼     ╲    ▼             hold the data-plane token; then each
//!   rank 2 ◄────► rank 3        all-reduce is one frame each way per pair:
//!                               sum = p0 + p1 + p2 + p3
//! ```
//!
//! # Wire format (version 4, all integers little-endian)
//!
//! With TLS on the data plane, every connection is TLS 1.3 first (ALPN
//! `shardplane-tensor/4`), with the data plane's certificates: the
//! connector checks that the acceptor's certificate names the node of the
//! rank it dials, the acceptor that the connector's names the node of the
//! rank its hello claims. Plain connections are then refused (they fail the
//! handshake). What follows runs inside TLS, or on plain TCP without it.
//!
//! Joining, on each connection (the higher rank connects, twice):
//! 1. connector → acceptor: `hello` = magic `b"SPTP"`, version `u8` (4),
//!    group name length `u16` and its UTF-8 bytes, ranks `u32`, sender's
//!    rank `u32`, lane `u8` (0: the connector writes on this connection,
//!    1: the acceptor does), the sender's join attempt `u64` (a number that
//!    only grows: a new one each time a rank begins its join or dials a
//!    peer again), a random 32-byte nonce;
//! 2. acceptor → connector: its own `hello` (naming the same lane), then a
//!    32-byte `HMAC-SHA256(token, "accept" ‖ transcript)`;
//! 3. connector → acceptor: `HMAC-SHA256(token, "connect" ‖ transcript)`,
//!
//! where the transcript is the connector's hello followed by the
//! acceptor's. Each side checks the other's tag (in constant time) and that
//! the group, size, ranks and lane are the ones it expects. Both lanes
//! between two ranks come from one attempt of each: an acceptor shuts a
//! lane of an older attempt of the connector's than one it holds (and
//! those it holds when a newer one comes), and a connector whose two lanes
//! were answered by two attempts of the acceptor's dials both again as a
//! new attempt.
//!
//! 4. Once a rank holds every lane of its group, it writes one byte `0x52`
//!    (`ready`) on each lane it writes, then reads the same from each lane
//!    it reads. The join ends when every peer's has come (waiting up to the
//!    join's timeout and 5 s more, as long as a peer still joining may take,
//!    so that no rank gives up after sending its own while others go on: the
//!    ranks must share the timeout): a rank that gave up meanwhile closed
//!    its lanes, and its peers fail their join too.
//!
//! Each connection then carries frames one way only (a TLS session cannot
//! be written on one thread while read on another, and a large frame is
//! written while the peers' are read). Each all-reduce, on every lane a
//! rank writes: a 16-byte header — collective number `u64` (counts from 0
//! on each mesh), values `u32`, sender's rank `u32` — then the values as
//! `f32`. A header that does not match the receiver's own count or number
//! is an error (the ranks are out of step), never a silent wrong sum.
//!
//! Messages (a tensor group's commands and replies, opaque here) share the
//! lanes: the same header with the number `u64::MAX`, the message's
//! length in bytes (at most [`MAX_MESSAGE_BYTES`](crate::MAX_MESSAGE_BYTES))
//! and the sender's rank, then the bytes.
//!
//! The token authenticates the peers; with TLS the certificates name their
//! nodes and the frames are encrypted.

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::time::Duration;

use crate::Token;

mod join;
mod link;
use link::Link;
pub use link::MeshTls;
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
/// Handshakes of accepted connections that run at once while a rank joins
/// (one more takes the place of the one that has run longest).
const MAX_HANDSHAKES: usize = 16;
/// The longest an accepted connection may take to send its hello (each
/// read of it), and to prove itself in all (its TLS handshake, hello and
/// proofs: a few round trips for a real peer).
const HELLO_WITHIN: Duration = Duration::from_secs(5);

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
    /// The lanes this rank writes, indexed by rank; `None` at this rank.
    outs: Vec<Option<Link>>,
    /// The lanes this rank reads, likewise.
    ins: Vec<Option<Link>>,
    collectives: u64,
    /// The longest wait for a peer.
    timeout: Duration,
}

impl std::fmt::Debug for Mesh {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Mesh(rank {} of {})", self.rank, self.outs.len())
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
    /// How long joining may take (the closing `ready` exchange may add the
    /// timeout and 5 s more, and a handshake under way at the end half a
    /// second), and the longest wait for a peer's frame. Every rank of a
    /// group must use the same.
    pub timeout: Duration,
    /// TLS on every connection (the data plane's certificates, each rank's
    /// node); none: plain TCP.
    pub tls: Option<MeshTls>,
}

impl Mesh {
    /// Joins the group: accepts the higher ranks on `listener` (bound to
    /// this rank's address) and connects to the lower ones, retrying until
    /// they listen or `config.timeout` passes.
    pub fn join(listener: &TcpListener, config: &MeshConfig) -> Result<Mesh, CollectiveError> {
        let (outs, ins) = join::join(listener, config)?;
        Ok(Mesh {
            rank: config.rank,
            outs,
            ins,
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
                        tls: None,
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
            .links()
            .map(|(peer, l)| {
                l.socket()
                    .try_clone()
                    .map_err(|source| CollectiveError::Io { peer, source })
            })
            .collect::<Result<Vec<_>, _>>()?;
        Ok(MeshCloser(streams))
    }

    /// Every lane, both ways, with its peer's rank.
    fn links(&self) -> impl Iterator<Item = (usize, &Link)> {
        let outs = self.outs.iter().enumerate();
        outs.chain(self.ins.iter().enumerate())
            .filter_map(|(peer, l)| Some((peer, l.as_ref()?)))
    }

    /// Sets the longest wait for a peer's frame from now on (joining may
    /// have used another).
    pub fn set_timeout(&mut self, timeout: Duration) -> Result<(), CollectiveError> {
        self.timeout = timeout;
        for (peer, link) in self.links() {
            join::prepare(link.socket(), timeout, peer)?;
        }
        Ok(())
    }

    /// Checks, without waiting, that no peer has gone while the group is
    /// idle (nothing in flight, so nothing is read): a peer whose connection
    /// was closed (its process died) or failed (reset, or keep-alive probes
    /// unanswered) is an error. Bytes waiting to be read are left there.
    pub fn check_idle(&self) -> Result<(), CollectiveError> {
        for (peer, link) in self.links() {
            let stream = link.socket();
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
        self.outs.len()
    }

    /// Sends `bytes` to rank `peer` as one message.
    pub fn send_message(&mut self, peer: usize, bytes: &[u8]) -> Result<(), CollectiveError> {
        let rank = self.rank;
        let stream = lane(&mut self.outs, peer, rank)?;
        if bytes.len() > crate::MAX_MESSAGE_BYTES {
            return Err(CollectiveError::OutOfStep {
                peer,
                why: format!("a message of {} bytes is too long", bytes.len()),
            });
        }
        let mut frame = Vec::with_capacity(16 + bytes.len());
        frame.extend_from_slice(&MESSAGE.to_le_bytes());
        frame.extend_from_slice(&(bytes.len() as u32).to_le_bytes());
        frame.extend_from_slice(&(rank as u32).to_le_bytes());
        frame.extend_from_slice(bytes);
        let io = |source| CollectiveError::Io { peer, source };
        stream.write_all(&frame).map_err(io)?;
        stream.flush().map_err(io)
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
        let (timeout, rank) = (self.timeout, self.rank);
        let stream = lane(&mut self.ins, peer, rank)?;
        let io = |source| CollectiveError::Io { peer, source };
        let mut header = [0u8; 16];
        if idle {
            stream.socket().set_read_timeout(None).map_err(io)?;
        }
        let first = stream.read(&mut header);
        if idle {
            stream
                .socket()
                .set_read_timeout(Some(timeout))
                .map_err(io)?;
        }
        match first {
            Ok(0) => return Ok(None),
            // A TLS peer's process that ended sent no close_notify.
            Err(e) if e.kind() == std::io::ErrorKind::UnexpectedEof => return Ok(None),
            Ok(n) => stream.read_exact(&mut header[n..]).map_err(io)?,
            Err(e) => return Err(io(e)),
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

    /// Replaces `values` with the sum over every rank of its `values`,
    /// added in rank order.
    pub fn all_reduce(&mut self, values: &mut [f32]) -> Result<(), CollectiveError> {
        if self.outs.len() == 1 {
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
        let mut partials: Vec<Option<Vec<f32>>> = (0..self.outs.len()).map(|_| None).collect();
        let (outs, ins) = (&mut self.outs, &mut self.ins);
        let received = if frame.len() <= INLINE_BYTES {
            send_all(outs, &frame)?;
            receive_all(ins, number, values.len())?
        } else {
            std::thread::scope(|s| {
                let sending = s.spawn(|| send_all(outs, &frame));
                let received = receive_all(ins, number, values.len());
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

/// The lane to or from rank `peer` among `lanes` (this rank: `me`).
fn lane(lanes: &mut [Option<Link>], peer: usize, me: usize) -> Result<&mut Link, CollectiveError> {
    lanes
        .get_mut(peer)
        .and_then(Option::as_mut)
        .ok_or_else(|| CollectiveError::Join(format!("rank {peer} is not a peer of rank {me}")))
}

fn send_all(outs: &mut [Option<Link>], frame: &[u8]) -> Result<(), CollectiveError> {
    for (peer, stream) in outs.iter_mut().enumerate() {
        if let Some(stream) = stream.as_mut() {
            let io = |source| CollectiveError::Io { peer, source };
            stream.write_all(frame).map_err(io)?;
            stream.flush().map_err(io)?;
        }
    }
    Ok(())
}

fn receive_all(
    ins: &mut [Option<Link>],
    number: u64,
    count: usize,
) -> Result<Vec<(usize, Vec<f32>)>, CollectiveError> {
    let mut out = Vec::with_capacity(ins.len());
    let mut bytes = vec![0u8; count * 4];
    for (peer, stream) in ins.iter_mut().enumerate() {
        let Some(stream) = stream.as_mut() else {
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
