//! The gRPC data plane: the protocol (`proto/shardplane/dataplane/v1`), the
//! data-plane token every call carries, and the TLS every connection runs
//! over (`tls`: a server's certificate names its node).
//!
//! ```text
//!  gateway ──Generate──► head stage ──Forward──► stage 1 ──Forward──► last stage
//!          ◄─ text ──────┘          ◄────────── sampled tokens ◄──────┘
//! ```

#[allow(missing_docs, clippy::all)]
mod generated {
    tonic::include_proto!("shardplane.dataplane.v1");
}

pub mod collective;
pub mod tls;

pub use generated::*;
/// The protobuf library of the messages (to decode or encode them by hand).
pub use prost;
/// The gRPC library the protocol is built on, for callers' status codes and requests.
pub use tonic;

/// The response header a later stage answers a `Forward` open with when it
/// started the sequence from its prefix cache: the tokens it took (the
/// open's `cached`). A stage that leaves it out did not (an agent from
/// before pipelines reused prefixes ignores the field), and the stage
/// before takes that as `ABORTED`. A stage that refuses the open with
/// `ABORTED` for holding fewer names in the refusal's metadata, under the
/// same key, how many it holds.
pub const CACHED_HEADER: &str = "shardplane-cached";

use std::path::{Path, PathBuf};
use std::sync::Arc;

use tonic::metadata::MetadataValue;
use tonic::service::Interceptor;
use tonic::{Request, Status};

/// What can go wrong before a call is made.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// The token's text is not a usable token.
    #[error("the data-plane token must be {0}")]
    InvalidToken(&'static str),
    /// The token file holds no usable token.
    #[error("{}: the data-plane token must be {why}", path.display())]
    InvalidTokenFile {
        /// The file.
        path: PathBuf,
        /// What a token must be.
        why: &'static str,
    },
    /// The token file cannot be read.
    #[error("cannot read data-plane token {}: {source}", path.display())]
    TokenUnreadable {
        /// The file.
        path: PathBuf,
        /// Why.
        source: std::io::Error,
    },
    /// An endpoint that is no URI.
    #[error("bad data-plane endpoint {endpoint:?}: {source}")]
    BadEndpoint {
        /// What was given.
        endpoint: String,
        /// Why it is no URI.
        source: tonic::transport::Error,
    },
    /// TLS material that cannot be used.
    #[error("data-plane TLS: {0}")]
    Tls(#[from] tls::TlsError),
    /// Hidden states whose bytes do not fill their shape.
    #[error("hidden states of {bytes} bytes cannot be {tokens} rows of {width} f32 values")]
    BadHidden {
        /// Bytes sent.
        bytes: usize,
        /// Rows claimed.
        tokens: u32,
        /// Values per row claimed.
        width: u32,
    },
}

/// The largest HTTP/2 frame either side accepts: bulk copies and prefill
/// chunks go in few frames instead of thousands of 16 KiB ones.
pub const MAX_FRAME_BYTES: u32 = 1 << 20;

/// The largest message either side accepts: a prefill chunk of hidden states.
pub const MAX_MESSAGE_BYTES: usize = 64 * 1024 * 1024;

/// The cluster's shared data-plane secret. Servers refuse calls without it;
/// clients attach it to every call.
#[derive(Clone)]
pub struct Token(Arc<str>);

impl std::fmt::Debug for Token {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Token(…)")
    }
}

impl Token {
    /// A token from its text (surrounding white space is dropped).
    pub fn new(text: &str) -> Result<Self, Error> {
        let t = text.trim();
        if t.len() < 16 {
            return Err(Error::InvalidToken("at least 16 characters"));
        }
        if !t.bytes().all(|b| b.is_ascii_graphic()) {
            return Err(Error::InvalidToken("printable ASCII without spaces"));
        }
        Ok(Token(t.into()))
    }

    /// A fresh random token (64 hex digits), for a group whose members are
    /// all started by one process.
    pub fn random() -> Result<Self, Error> {
        use ring::rand::SecureRandom;
        let mut bytes = [0u8; 32];
        ring::rand::SystemRandom::new()
            .fill(&mut bytes)
            .map_err(|_| Error::InvalidToken("random, and the system has no randomness"))?;
        let hex: String = bytes.iter().map(|b| format!("{b:02x}")).collect();
        Token::new(&hex)
    }

    /// The token's text, to hand to a process the caller starts (never log it).
    pub fn expose(&self) -> &str {
        &self.0
    }

    /// Reads a token file.
    pub fn from_file(path: &Path) -> Result<Self, Error> {
        let text = std::fs::read_to_string(path).map_err(|source| Error::TokenUnreadable {
            path: path.to_path_buf(),
            source,
        })?;
        Token::new(&text).map_err(|e| match e {
            Error::InvalidToken(why) => Error::InvalidTokenFile {
                path: path.to_path_buf(),
                why,
            },
            e => e,
        })
    }

    /// Whether `presented` (an `authorization` header value) carries this token.
    /// The comparison takes the same time wherever the first difference is.
    pub fn accepts(&self, presented: &[u8]) -> bool {
        let Some(given) = presented.strip_prefix(b"Bearer ") else {
            return false;
        };
        let want = self.0.as_bytes();
        given.len() == want.len() && given.iter().zip(want).fold(0u8, |d, (a, b)| d | (a ^ b)) == 0
    }
}

/// Server side: refuses calls that do not carry the token.
#[derive(Clone, Debug)]
pub struct RequireToken(pub Token);

impl Interceptor for RequireToken {
    fn call(&mut self, request: Request<()>) -> Result<Request<()>, Status> {
        match request.metadata().get("authorization") {
            Some(v) if self.0.accepts(v.as_bytes()) => Ok(request),
            Some(_) => Err(Status::unauthenticated("wrong data-plane token")),
            None => Err(Status::unauthenticated(
                "no data-plane token: send `authorization: Bearer <token>`",
            )),
        }
    }
}

/// Client side: attaches the token to every call.
#[derive(Clone, Debug)]
pub struct AttachToken(pub Token);

impl Interceptor for AttachToken {
    fn call(&mut self, mut request: Request<()>) -> Result<Request<()>, Status> {
        let value = MetadataValue::try_from(format!("Bearer {}", self.0.0))
            .map_err(|_| Status::internal("the data-plane token is not a valid header"))?;
        request.metadata_mut().insert("authorization", value);
        Ok(request)
    }
}

/// A client of a peer's data plane that carries the token.
pub type Client = data_plane_client::DataPlaneClient<
    tonic::service::interceptor::InterceptedService<tonic::transport::Channel, AttachToken>,
>;

/// A client for `channel` carrying `token`, with the data plane's message limits.
pub fn client(channel: tonic::transport::Channel, token: Token) -> Client {
    data_plane_client::DataPlaneClient::with_interceptor(channel, AttachToken(token))
        .max_decoding_message_size(MAX_MESSAGE_BYTES)
        .max_encoding_message_size(MAX_MESSAGE_BYTES)
}

/// A lazily connected channel to `endpoint` (`host:port`), tuned for the
/// data plane: no Nagle delay, large HTTP/2 windows for bulk copies. With
/// `tls` (the material and the node the endpoint belongs to) the connection
/// is TLS and the server's certificate must name that node.
pub fn channel(
    endpoint: &str,
    tls: Option<(&Arc<tls::Tls>, &str)>,
) -> Result<tonic::transport::Channel, Error> {
    let uri = if endpoint.contains("://") {
        endpoint.to_string()
    } else {
        format!("http://{endpoint}")
    };
    let endpoint = tonic::transport::Endpoint::from_shared(uri)
        .map_err(|source| Error::BadEndpoint {
            endpoint: endpoint.to_string(),
            source,
        })?
        .tcp_nodelay(true)
        .connect_timeout(std::time::Duration::from_secs(5))
        .http2_keep_alive_interval(std::time::Duration::from_secs(10))
        .keep_alive_timeout(std::time::Duration::from_secs(10))
        // Pinged while idle too: a peer that died between calls is found
        // before the next call waits on it.
        .keep_alive_while_idle(true)
        .initial_stream_window_size(Some(8 << 20))
        .initial_connection_window_size(Some(32 << 20))
        .max_frame_size(MAX_FRAME_BYTES);
    Ok(match tls {
        Some((tls, node)) => endpoint.connect_with_connector_lazy(tls::connector(tls, node)?),
        None => endpoint.connect_lazy(),
    })
}

/// Clients of other data planes: one connection per node and endpoint,
/// shared by every call to it, each call carrying the token (and, with TLS,
/// each connection checking the node's certificate).
#[derive(Clone)]
pub struct Peers {
    token: Token,
    tls: Option<Arc<tls::Tls>>,
    channels: Arc<
        std::sync::Mutex<std::collections::HashMap<(String, String), tonic::transport::Channel>>,
    >,
}

impl Peers {
    /// No connection yet; TLS to every peer when `tls` is given.
    pub fn new(token: Token, tls: Option<Arc<tls::Tls>>) -> Self {
        Peers {
            token,
            tls,
            channels: Arc::default(),
        }
    }

    /// The same peers with `tls` (connections made so far are dropped).
    pub fn with_tls(self, tls: Option<Arc<tls::Tls>>) -> Self {
        Peers::new(self.token, tls)
    }

    /// Whether connections are TLS.
    pub fn tls(&self) -> Option<&Arc<tls::Tls>> {
        self.tls.as_ref()
    }

    /// A client of node `node`'s data plane at `endpoint` (connected on first use).
    pub fn client(&self, node: &str, endpoint: &str) -> Result<Client, Error> {
        let mut channels = self.channels.lock().expect("peer lock");
        let key = (node.to_string(), endpoint.to_string());
        let channel = match channels.get(&key) {
            Some(c) => c.clone(),
            None => {
                let c = channel(endpoint, self.tls.as_ref().map(|t| (t, node)))?;
                channels.insert(key, c.clone());
                c
            }
        };
        Ok(client(channel, self.token.clone()))
    }
}

/// The `Open` a `Forward` stream starts with; any other first message is
/// the caller's error.
pub async fn read_open(inbound: &mut tonic::Streaming<ForwardRequest>) -> Result<Open, Status> {
    match inbound.message().await? {
        Some(ForwardRequest {
            message: Some(forward_request::Message::Open(open)),
        }) => Ok(open),
        _ => Err(Status::invalid_argument(
            "a Forward stream starts with an Open message",
        )),
    }
}

/// Encodes f32 rows as little-endian bytes.
pub fn encode_f32(values: &[f32]) -> prost::bytes::Bytes {
    let mut out = Vec::with_capacity(values.len() * 4);
    for v in values {
        out.extend_from_slice(&v.to_le_bytes());
    }
    out.into()
}

/// Decodes hidden states, checking their shape.
pub fn decode_hidden(h: &Hidden) -> Result<Vec<f32>, Error> {
    let want = (h.tokens as u64)
        .checked_mul(h.width as u64)
        .and_then(|n| n.checked_mul(4));
    if h.tokens == 0 || h.width == 0 || Some(h.data.len() as u64) != want {
        return Err(Error::BadHidden {
            bytes: h.data.len(),
            tokens: h.tokens,
            width: h.width,
        });
    }
    Ok(h.data
        .chunks_exact(4)
        .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
        .collect())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tokens_are_checked_exactly() {
        let t = Token::new("  0123456789abcdef\n").unwrap();
        assert!(t.accepts(b"Bearer 0123456789abcdef"));
        assert!(!t.accepts(b"Bearer 0123456789abcdeg"));
        assert!(!t.accepts(b"Bearer 0123456789abcde"));
        assert!(!t.accepts(b"0123456789abcdef"));
        assert!(Token::new("short").is_err());
        assert!(Token::new("has a space in it!!").is_err());
    }

    #[test]
    fn hidden_states_round_trip_and_bad_shapes_are_refused() {
        let v = vec![1.5f32, -2.0, 0.0, f32::MIN_POSITIVE, 3.25, 7.0];
        let h = Hidden {
            tokens: 2,
            width: 3,
            data: encode_f32(&v),
        };
        assert_eq!(decode_hidden(&h).unwrap(), v);
        for (tokens, width) in [(3, 3), (0, 6), (6, 0), (u32::MAX, u32::MAX)] {
            let bad = Hidden {
                tokens,
                width,
                data: h.data.clone(),
            };
            assert!(decode_hidden(&bad).is_err(), "{tokens}x{width}");
        }
    }
}
