//! One lane of a mesh: a TCP connection that carries frames one way, plain
//! or TLS 1.3 with the data plane's certificates, each peer's certificate
//! naming the node of the rank it claims.
//!
//! ```text
//!  Tls (the data plane's CA, this node's certificate) ─► MeshTls::new(tls, nodes by rank)
//!    connector: TcpStream ─► Link::Client (the acceptor's certificate must name its rank's node)
//!    acceptor:  TcpStream ─► Link::Server (the connector's certificate checked against its hello)
//! ```
//!
//! A TLS session cannot be read on one thread while it is written on
//! another, so each pair of ranks has two connections, each written by one
//! side only (see the module above).

use std::io::{Read, Write};
use std::net::TcpStream;
use std::sync::Arc;

use rustls::pki_types::ServerName;
use rustls::{ClientConnection, ServerConnection, StreamOwned};

use super::CollectiveError;
use crate::tls::{Tls, TlsError, facts_der};

/// The protocol a mesh's TLS sessions name (ALPN): a data-plane port that
/// is reached by mistake refuses it rather than reading frames as HTTP/2.
const ALPN: &[u8] = b"shardplane-tensor/4";

/// TLS on a mesh: the data plane's certificates, and the node each rank's
/// certificate must name.
#[derive(Clone, Debug)]
pub struct MeshTls {
    client: Arc<rustls::ClientConfig>,
    server: Arc<rustls::ServerConfig>,
    /// Each rank's node, in rank order.
    nodes: Vec<String>,
}

impl MeshTls {
    /// Mesh sessions with `tls`'s material (renewals apply to the next
    /// handshake); `nodes`: each rank's node, in rank order.
    pub fn new(tls: &Arc<Tls>, nodes: Vec<String>) -> Result<MeshTls, TlsError> {
        let mut client = (*tls.client_config()?).clone();
        client.alpn_protocols = vec![ALPN.to_vec()];
        client.resumption = rustls::client::Resumption::disabled();
        let mut server = (*tls.server_config()?).clone();
        server.alpn_protocols = vec![ALPN.to_vec()];
        server.send_tls13_tickets = 0;
        Ok(MeshTls {
            client: Arc::new(client),
            server: Arc::new(server),
            nodes,
        })
    }

    /// The node rank `rank` runs on.
    fn node(&self, rank: usize) -> Result<&str, CollectiveError> {
        self.nodes
            .get(rank)
            .map(String::as_str)
            .ok_or_else(|| CollectiveError::Refused {
                peer: rank,
                why: format!("no node is known for rank {rank}"),
            })
    }

    /// TLS over a connection to rank `peer`, whose certificate must name
    /// its node.
    pub(super) fn connect(&self, socket: TcpStream, peer: usize) -> Result<Link, CollectiveError> {
        let name = ServerName::try_from(self.node(peer)?.to_string()).map_err(|e| {
            CollectiveError::Refused {
                peer,
                why: format!("its node's name is not a certificate name: {e}"),
            }
        })?;
        let conn =
            ClientConnection::new(self.client.clone(), name).map_err(|e| refused(peer, e))?;
        let mut stream = StreamOwned::new(conn, socket);
        handshake(&mut stream.conn, &mut stream.sock, peer)?;
        let link = Link::Client(Box::new(stream));
        // Its names compared as the acceptor compares them (exactly; the
        // handshake's check also takes wildcards and other cases).
        self.check(&link, peer)?;
        Ok(link)
    }

    /// TLS over an accepted connection; the peer's certificate is checked
    /// once its hello names its rank ([`MeshTls::check`]).
    pub(super) fn accept(&self, socket: TcpStream) -> Result<Link, CollectiveError> {
        let peer = usize::MAX;
        let conn = ServerConnection::new(self.server.clone()).map_err(|e| refused(peer, e))?;
        let mut stream = StreamOwned::new(conn, socket);
        handshake(&mut stream.conn, &mut stream.sock, peer)?;
        Ok(Link::Server(Box::new(stream)))
    }

    /// Whether `link`'s peer, which claims rank `peer`, presented a
    /// certificate naming that rank's node.
    pub(super) fn check(&self, link: &Link, peer: usize) -> Result<(), CollectiveError> {
        let node = self.node(peer)?;
        let certificate = match link {
            Link::Server(s) => s.conn.peer_certificates().and_then(<[_]>::first),
            Link::Client(s) => s.conn.peer_certificates().and_then(<[_]>::first),
            Link::Plain(_) => None,
        };
        let names = certificate
            .and_then(|c| facts_der(c).ok())
            .map(|f| f.names)
            .unwrap_or_default();
        if names.iter().any(|n| n == node) {
            return Ok(());
        }
        Err(CollectiveError::Refused {
            peer,
            why: format!("its certificate names {names:?}, not rank {peer}'s node {node:?}"),
        })
    }
}

fn refused(peer: usize, e: rustls::Error) -> CollectiveError {
    CollectiveError::Refused {
        peer,
        why: format!("TLS: {e}"),
    }
}

/// Runs a TLS handshake to its end (each read bounded by the socket's
/// timeout); both sides must have agreed on the mesh's protocol ([`ALPN`]).
fn handshake<S: rustls::SideData>(
    conn: &mut rustls::ConnectionCommon<S>,
    socket: &mut TcpStream,
    peer: usize,
) -> Result<(), CollectiveError> {
    while conn.is_handshaking() {
        conn.complete_io(socket).map_err(|e| match e.kind() {
            std::io::ErrorKind::InvalidData => CollectiveError::Refused {
                peer,
                why: format!("TLS: {e}"),
            },
            _ => CollectiveError::Io { peer, source: e },
        })?;
    }
    if conn.alpn_protocol() != Some(ALPN) {
        return Err(CollectiveError::Refused {
            peer,
            why: "its TLS session names no tensor-group protocol (ALPN)".into(),
        });
    }
    Ok(())
}

/// One lane of a mesh.
pub(super) enum Link {
    /// Plain TCP (the data plane without TLS).
    Plain(TcpStream),
    /// TLS, this rank connecting.
    Client(Box<StreamOwned<ClientConnection, TcpStream>>),
    /// TLS, this rank accepting.
    Server(Box<StreamOwned<ServerConnection, TcpStream>>),
}

impl Link {
    /// The connection under it (timeouts, shutdown, peeking).
    pub(super) fn socket(&self) -> &TcpStream {
        match self {
            Link::Plain(s) => s,
            Link::Client(s) => &s.sock,
            Link::Server(s) => &s.sock,
        }
    }
}

impl Read for Link {
    fn read(&mut self, buf: &mut [u8]) -> std::io::Result<usize> {
        match self {
            Link::Plain(s) => s.read(buf),
            Link::Client(s) => s.read(buf),
            Link::Server(s) => s.read(buf),
        }
    }
}

impl Write for Link {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        match self {
            Link::Plain(s) => s.write(buf),
            Link::Client(s) => s.write(buf),
            Link::Server(s) => s.write(buf),
        }
    }

    fn flush(&mut self) -> std::io::Result<()> {
        match self {
            Link::Plain(s) => s.flush(),
            Link::Client(s) => s.flush(),
            Link::Server(s) => s.flush(),
        }
    }
}
