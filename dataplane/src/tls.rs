//! TLS on the data plane. Every connection from the gateway to an agent and
//! between agents is encrypted, and a client checks that the server's
//! certificate names the node it meant to reach: a node's certificate has
//! one DNS name, the node's name, signed by the cluster's data-plane CA.
//! Servers require a certificate from every caller too, signed by the same
//! CA: agents present theirs (naming their node), a gateway its client-only
//! one (naming no node). A caller without one is refused in the handshake,
//! before any call is read; the data-plane token every call carries is
//! checked on top.
//!
//! The key material can be swapped while connections run ([`Tls::replace`],
//! [`Tls::watch_dir`]): a renewed certificate is used by the next handshake.
//!
//! ```text
//!  ca.crt, tls.crt, tls.key ──► Tls ──► server_config ─► incoming(listener) ─► tonic server
//!   (files or the operator)      │                       (plain TCP refused: no handshake)
//!        replace / watch_dir ────┘  └─► client_config ─► channel(endpoint, node) ─► Channel
//! ```

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::pin::Pin;
use std::sync::{Arc, RwLock};
use std::task::{Context, Poll};
use std::time::Duration;

use rustls::client::danger::{HandshakeSignatureValid, ServerCertVerified, ServerCertVerifier};
use rustls::client::{ResolvesClientCert, WebPkiServerVerifier};
use rustls::crypto::CryptoProvider;
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer, ServerName, UnixTime};
use rustls::server::danger::{ClientCertVerified, ClientCertVerifier};
use rustls::server::{ClientHello, ResolvesServerCert, WebPkiClientVerifier};
use rustls::sign::CertifiedKey;
use rustls::{DigitallySignedStruct, DistinguishedName, RootCertStore, SignatureScheme};
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::{TcpListener, TcpStream};

/// The CA certificate's file name in a TLS directory (as cert-manager and
/// `kubernetes.io/tls` Secrets name it).
pub const CA_FILE: &str = "ca.crt";
/// The node's certificate (chain), PEM.
pub const CERT_FILE: &str = "tls.crt";
/// The node's private key, PEM.
pub const KEY_FILE: &str = "tls.key";

/// How long a TLS handshake may take before the connection is dropped.
const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(10);

/// What is wrong with TLS material.
#[derive(Debug, thiserror::Error)]
pub enum TlsError {
    /// A file cannot be read.
    #[error("cannot read {}: {source}", path.display())]
    Unreadable {
        /// The file.
        path: PathBuf,
        /// Why.
        source: std::io::Error,
    },
    /// PEM text that holds no usable certificate or key.
    #[error("{what}: {why}")]
    BadPem {
        /// Which text.
        what: &'static str,
        /// Why.
        why: String,
    },
    /// rustls refused the material.
    #[error("{what}: {source}")]
    Rustls {
        /// What was being built.
        what: &'static str,
        /// Why.
        source: rustls::Error,
    },
    /// A server certificate is needed to serve.
    #[error("serving the data plane over TLS needs a certificate and key (tls.crt, tls.key)")]
    NoIdentity,
    /// A node name that cannot be a certificate's DNS name.
    #[error("node name {0:?} cannot name a certificate")]
    BadNodeName(String),
}

/// PEM texts: the CA bundle, and this process's certificate and key when it
/// has them (a client without them can still check servers).
#[derive(Clone, Default, PartialEq, Eq)]
pub struct Material {
    /// The CA certificate(s) peers' certificates must chain to.
    pub ca_pem: String,
    /// This process's certificate (chain) and private key.
    pub identity: Option<(String, String)>,
}

impl std::fmt::Debug for Material {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Material")
            .field("identity", &self.identity.as_ref().map(|_| "…"))
            .finish_non_exhaustive()
    }
}

impl Material {
    /// Reads `ca.crt`, and `tls.crt` with `tls.key` when both exist, from `dir`.
    pub fn read_dir(dir: &Path) -> Result<Material, TlsError> {
        let read = |name: &str| {
            let path = dir.join(name);
            std::fs::read_to_string(&path).map_err(|source| TlsError::Unreadable { path, source })
        };
        let ca_pem = read(CA_FILE)?;
        let identity = if dir.join(CERT_FILE).exists() || dir.join(KEY_FILE).exists() {
            Some((read(CERT_FILE)?, read(KEY_FILE)?))
        } else {
            None
        };
        Ok(Material { ca_pem, identity })
    }
}

/// What a certificate says about itself.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct CertificateFacts {
    /// Its DNS names.
    pub names: Vec<String>,
    /// Its subject's common name, when it has one.
    pub common_name: Option<String>,
    /// Valid from (Unix seconds).
    pub not_before: i64,
    /// Valid until (Unix seconds).
    pub not_after: i64,
}

/// Reads the first certificate of a PEM text.
pub fn facts(cert_pem: &str) -> Result<CertificateFacts, TlsError> {
    let bad = |why: String| TlsError::BadPem {
        what: "certificate",
        why,
    };
    let der =
        CertificateDer::from_pem_slice(cert_pem.as_bytes()).map_err(|e| bad(e.to_string()))?;
    facts_der(&der).map_err(bad)
}

pub(crate) fn facts_der(der: &CertificateDer<'_>) -> Result<CertificateFacts, String> {
    use x509_parser::extensions::GeneralName;
    let (_, cert) = x509_parser::parse_x509_certificate(der).map_err(|e| e.to_string())?;
    let names = match cert.subject_alternative_name() {
        Ok(Some(san)) => san
            .value
            .general_names
            .iter()
            .filter_map(|n| match n {
                GeneralName::DNSName(d) => Some(d.to_string()),
                _ => None,
            })
            .collect(),
        Ok(None) => Vec::new(),
        Err(e) => return Err(e.to_string()),
    };
    let common_name = cert
        .subject()
        .iter_common_name()
        .next()
        .and_then(|cn| cn.as_str().ok())
        .map(String::from);
    Ok(CertificateFacts {
        names,
        common_name,
        not_before: cert.validity().not_before.timestamp(),
        not_after: cert.validity().not_after.timestamp(),
    })
}

/// The material as rustls uses it.
struct Loaded {
    key: Option<Arc<CertifiedKey>>,
    servers: Arc<WebPkiServerVerifier>,
    clients: Arc<dyn ClientCertVerifier>,
    facts: Option<CertificateFacts>,
}

/// The data plane's TLS material, replaceable while in use.
pub struct Tls {
    provider: Arc<CryptoProvider>,
    now: RwLock<Arc<Loaded>>,
}

impl std::fmt::Debug for Tls {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Tls")
            .field("certificate", &self.current().facts)
            .finish()
    }
}

fn load(provider: &Arc<CryptoProvider>, m: &Material) -> Result<Loaded, TlsError> {
    let bad = |what, why: String| TlsError::BadPem { what, why };
    let rustls = |what| move |source| TlsError::Rustls { what, source };
    let mut roots = RootCertStore::empty();
    for cert in CertificateDer::pem_slice_iter(m.ca_pem.as_bytes()) {
        let cert = cert.map_err(|e| bad("CA certificate", e.to_string()))?;
        roots.add(cert).map_err(rustls("CA certificate"))?;
    }
    if roots.is_empty() {
        return Err(bad("CA certificate", "no certificate in it".into()));
    }
    let roots = Arc::new(roots);
    let servers = WebPkiServerVerifier::builder_with_provider(roots.clone(), provider.clone())
        .build()
        .map_err(|e| bad("CA certificate", e.to_string()))?;
    let clients = WebPkiClientVerifier::builder_with_provider(roots, provider.clone())
        .build()
        .map_err(|e| bad("CA certificate", e.to_string()))?;
    let (key, facts) = match &m.identity {
        None => (None, None),
        Some((cert_pem, key_pem)) => {
            let chain = CertificateDer::pem_slice_iter(cert_pem.as_bytes())
                .collect::<Result<Vec<_>, _>>()
                .map_err(|e| bad("certificate", e.to_string()))?;
            let first = chain
                .first()
                .ok_or_else(|| bad("certificate", "no certificate in it".into()))?;
            let facts = facts_der(first).map_err(|why| bad("certificate", why))?;
            let key = PrivateKeyDer::from_pem_slice(key_pem.as_bytes())
                .map_err(|e| bad("private key", e.to_string()))?;
            let certified = CertifiedKey::from_der(chain, key, provider)
                .map_err(rustls("certificate and key"))?;
            (Some(Arc::new(certified)), Some(facts))
        }
    };
    Ok(Loaded {
        key,
        servers,
        clients,
        facts,
    })
}

impl Tls {
    /// TLS with `material`.
    pub fn new(material: &Material) -> Result<Arc<Tls>, TlsError> {
        let provider = Arc::new(rustls::crypto::ring::default_provider());
        let loaded = load(&provider, material)?;
        Ok(Arc::new(Tls {
            provider,
            now: RwLock::new(Arc::new(loaded)),
        }))
    }

    /// Uses `material` from the next handshake on; on an error the old
    /// material stays.
    pub fn replace(&self, material: &Material) -> Result<(), TlsError> {
        let loaded = load(&self.provider, material)?;
        *self.now.write().expect("tls lock") = Arc::new(loaded);
        Ok(())
    }

    fn current(&self) -> Arc<Loaded> {
        self.now.read().expect("tls lock").clone()
    }

    /// What this process's certificate says, when it has one.
    pub fn certificate(&self) -> Option<CertificateFacts> {
        self.current().facts.clone()
    }

    /// Re-reads `dir` every `every` and uses what changed (a certificate
    /// renewed by cert-manager, say). A change that does not load is
    /// logged and the old material kept.
    pub fn watch_dir(
        self: &Arc<Self>,
        dir: PathBuf,
        every: Duration,
    ) -> tokio::task::JoinHandle<()> {
        let tls = self.clone();
        tokio::spawn(async move {
            let mut last = Material::read_dir(&dir).ok();
            loop {
                tokio::time::sleep(every).await;
                match Material::read_dir(&dir) {
                    Ok(m) if Some(&m) != last.as_ref() => match tls.replace(&m) {
                        Ok(()) => {
                            tracing::info!(dir = %dir.display(), certificate = ?tls.certificate(), "data-plane TLS material reloaded");
                            last = Some(m);
                        }
                        Err(e) => {
                            tracing::warn!(dir = %dir.display(), error = %e, "new data-plane TLS material does not load; the old stays")
                        }
                    },
                    Ok(_) => {}
                    Err(e) => {
                        tracing::warn!(dir = %dir.display(), error = %e, "cannot re-read data-plane TLS material")
                    }
                }
            }
        })
    }

    /// The server side: TLS 1.3, HTTP/2, this process's certificate, and
    /// a certificate required of every caller and verified.
    pub fn server_config(self: &Arc<Self>) -> Result<Arc<rustls::ServerConfig>, TlsError> {
        if self.current().key.is_none() {
            return Err(TlsError::NoIdentity);
        }
        let live = Arc::new(Live(self.clone()));
        let mut config = rustls::ServerConfig::builder_with_provider(self.provider.clone())
            .with_protocol_versions(&[&rustls::version::TLS13])
            .map_err(|source| TlsError::Rustls {
                what: "server configuration",
                source,
            })?
            .with_client_cert_verifier(live.clone())
            .with_cert_resolver(live);
        config.alpn_protocols = vec![b"h2".to_vec()];
        Ok(Arc::new(config))
    }

    /// The client side: TLS 1.3, HTTP/2, servers checked against the CA and
    /// the name asked for, this process's certificate presented when it has one.
    pub fn client_config(self: &Arc<Self>) -> Result<Arc<rustls::ClientConfig>, TlsError> {
        let live = Arc::new(Live(self.clone()));
        let mut config = rustls::ClientConfig::builder_with_provider(self.provider.clone())
            .with_protocol_versions(&[&rustls::version::TLS13])
            .map_err(|source| TlsError::Rustls {
                what: "client configuration",
                source,
            })?
            .dangerous()
            .with_custom_certificate_verifier(live.clone())
            .with_client_cert_resolver(live);
        config.alpn_protocols = vec![b"h2".to_vec()];
        Ok(Arc::new(config))
    }
}

/// The current material, as rustls asks for it at each handshake.
struct Live(Arc<Tls>);

impl std::fmt::Debug for Live {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        self.0.fmt(f)
    }
}

impl ResolvesServerCert for Live {
    fn resolve(&self, _: ClientHello<'_>) -> Option<Arc<CertifiedKey>> {
        self.0.current().key.clone()
    }
}

impl ResolvesClientCert for Live {
    fn resolve(&self, _: &[&[u8]], _: &[SignatureScheme]) -> Option<Arc<CertifiedKey>> {
        self.0.current().key.clone()
    }

    fn has_certs(&self) -> bool {
        self.0.current().key.is_some()
    }
}

impl ServerCertVerifier for Live {
    fn verify_server_cert(
        &self,
        end_entity: &CertificateDer<'_>,
        intermediates: &[CertificateDer<'_>],
        server_name: &ServerName<'_>,
        ocsp_response: &[u8],
        now: UnixTime,
    ) -> Result<ServerCertVerified, rustls::Error> {
        self.0.current().servers.verify_server_cert(
            end_entity,
            intermediates,
            server_name,
            ocsp_response,
            now,
        )
    }

    fn verify_tls12_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        self.0
            .current()
            .servers
            .verify_tls12_signature(message, cert, dss)
    }

    fn verify_tls13_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        self.0
            .current()
            .servers
            .verify_tls13_signature(message, cert, dss)
    }

    fn supported_verify_schemes(&self) -> Vec<SignatureScheme> {
        self.0.current().servers.supported_verify_schemes()
    }
}

impl ClientCertVerifier for Live {
    fn offer_client_auth(&self) -> bool {
        true
    }

    fn client_auth_mandatory(&self) -> bool {
        true
    }

    fn root_hint_subjects(&self) -> &[DistinguishedName] {
        &[]
    }

    fn verify_client_cert(
        &self,
        end_entity: &CertificateDer<'_>,
        intermediates: &[CertificateDer<'_>],
        now: UnixTime,
    ) -> Result<ClientCertVerified, rustls::Error> {
        self.0
            .current()
            .clients
            .verify_client_cert(end_entity, intermediates, now)
    }

    fn verify_tls12_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        self.0
            .current()
            .clients
            .verify_tls12_signature(message, cert, dss)
    }

    fn verify_tls13_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        self.0
            .current()
            .clients
            .verify_tls13_signature(message, cert, dss)
    }

    fn supported_verify_schemes(&self) -> Vec<SignatureScheme> {
        self.0.current().clients.supported_verify_schemes()
    }
}

/// Who is at the other end of an accepted connection.
#[derive(Clone, Debug)]
pub struct PeerInfo {
    /// Its address.
    pub remote: Option<SocketAddr>,
    /// The node its (verified) certificate names: its one DNS name; none
    /// for a certificate naming no DNS name or several, or with TLS off.
    pub node: Option<String>,
    /// The common name of a (verified) certificate naming no DNS name at
    /// all: a client's, as the gateway's; none otherwise.
    pub client: Option<String>,
}

impl PeerInfo {
    /// Who a verified certificate's `facts` say the caller is.
    fn of(remote: SocketAddr, facts: Option<CertificateFacts>) -> PeerInfo {
        let (node, client) = match facts {
            Some(f) if f.names.len() == 1 => (f.names.into_iter().next(), None),
            Some(f) if f.names.is_empty() => (None, f.common_name),
            _ => (None, None),
        };
        PeerInfo {
            remote: Some(remote),
            node,
            client,
        }
    }
}

/// An accepted data-plane connection: TLS, or plain TCP when TLS is off.
pub struct Conn {
    stream: Stream,
    peer: PeerInfo,
}

enum Stream {
    Plain(TcpStream),
    Tls(Box<tokio_rustls::server::TlsStream<TcpStream>>),
}

impl tonic::transport::server::Connected for Conn {
    type ConnectInfo = PeerInfo;

    fn connect_info(&self) -> PeerInfo {
        self.peer.clone()
    }
}

impl AsyncRead for Conn {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<std::io::Result<()>> {
        match &mut self.get_mut().stream {
            Stream::Plain(s) => Pin::new(s).poll_read(cx, buf),
            Stream::Tls(s) => Pin::new(s.as_mut()).poll_read(cx, buf),
        }
    }
}

impl AsyncWrite for Conn {
    fn poll_write(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<std::io::Result<usize>> {
        match &mut self.get_mut().stream {
            Stream::Plain(s) => Pin::new(s).poll_write(cx, buf),
            Stream::Tls(s) => Pin::new(s.as_mut()).poll_write(cx, buf),
        }
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        match &mut self.get_mut().stream {
            Stream::Plain(s) => Pin::new(s).poll_flush(cx),
            Stream::Tls(s) => Pin::new(s.as_mut()).poll_flush(cx),
        }
    }

    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        match &mut self.get_mut().stream {
            Stream::Plain(s) => Pin::new(s).poll_shutdown(cx),
            Stream::Tls(s) => Pin::new(s.as_mut()).poll_shutdown(cx),
        }
    }

    fn poll_write_vectored(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[std::io::IoSlice<'_>],
    ) -> Poll<std::io::Result<usize>> {
        match &mut self.get_mut().stream {
            Stream::Plain(s) => Pin::new(s).poll_write_vectored(cx, bufs),
            Stream::Tls(s) => Pin::new(s.as_mut()).poll_write_vectored(cx, bufs),
        }
    }

    fn is_write_vectored(&self) -> bool {
        match &self.stream {
            Stream::Plain(s) => s.is_write_vectored(),
            Stream::Tls(s) => s.is_write_vectored(),
        }
    }
}

/// The connections `listener` accepts, for `Server::serve_with_incoming`:
/// with `tls`, only those that complete a TLS handshake in time (each
/// handshake runs apart, so a slow one holds up no other; `failed` hears of
/// each one dropped, `"refused"` or `"timeout"`); without, plain TCP. The
/// accepting stops when the stream is dropped.
pub fn incoming(
    listener: TcpListener,
    tls: Option<Arc<Tls>>,
    failed: impl Fn(&'static str) + Send + Sync + 'static,
) -> Result<tokio_stream::wrappers::ReceiverStream<std::io::Result<Conn>>, TlsError> {
    let failed = Arc::new(failed);
    let acceptor = tls
        .map(|t| t.server_config().map(tokio_rustls::TlsAcceptor::from))
        .transpose()?;
    let (tx, rx) = tokio::sync::mpsc::channel(64);
    tokio::spawn(async move {
        loop {
            let (tcp, remote) = tokio::select! {
                accepted = listener.accept() => match accepted {
                    Ok(a) => a,
                    Err(e) => {
                        // Out of descriptors and the like: pause, go on.
                        tracing::warn!(error = %e, "data plane cannot accept a connection");
                        tokio::time::sleep(Duration::from_millis(100)).await;
                        continue;
                    }
                },
                () = tx.closed() => return,
            };
            let _ = tcp.set_nodelay(true);
            let Some(acceptor) = acceptor.clone() else {
                let peer = PeerInfo {
                    remote: Some(remote),
                    node: None,
                    client: None,
                };
                let conn = Conn {
                    stream: Stream::Plain(tcp),
                    peer,
                };
                if tx.send(Ok(conn)).await.is_err() {
                    return;
                }
                continue;
            };
            let (tx, failed) = (tx.clone(), failed.clone());
            tokio::spawn(async move {
                match tokio::time::timeout(HANDSHAKE_TIMEOUT, acceptor.accept(tcp)).await {
                    Ok(Ok(stream)) => {
                        let facts = stream
                            .get_ref()
                            .1
                            .peer_certificates()
                            .and_then(|c| c.first())
                            .and_then(|c| facts_der(c).ok());
                        let peer = PeerInfo::of(remote, facts);
                        let conn = Conn {
                            stream: Stream::Tls(Box::new(stream)),
                            peer,
                        };
                        let _ = tx.send(Ok(conn)).await;
                    }
                    Ok(Err(e)) => {
                        failed("refused");
                        tracing::debug!(%remote, error = %e, "data-plane TLS handshake failed");
                    }
                    Err(_) => {
                        failed("timeout");
                        tracing::debug!(%remote, "data-plane TLS handshake timed out");
                    }
                }
            });
        }
    });
    Ok(tokio_stream::wrappers::ReceiverStream::new(rx))
}

/// A connector for tonic's `Endpoint::connect_with_connector_lazy` that
/// opens TLS to the node named `node` at the endpoint's `host:port`.
pub(crate) fn connector(
    tls: &Arc<Tls>,
    node: &str,
) -> Result<
    impl tower::Service<
        tonic::codegen::http::Uri,
        Response = hyper_util::rt::TokioIo<tokio_rustls::client::TlsStream<TcpStream>>,
        Error = std::io::Error,
        Future = impl Send,
    > + Send
    + Clone
    + 'static,
    TlsError,
> {
    let name = ServerName::try_from(node.to_string())
        .map_err(|_| TlsError::BadNodeName(node.to_string()))?;
    let connector = tokio_rustls::TlsConnector::from(tls.client_config()?);
    Ok(tower::service_fn(move |uri: tonic::codegen::http::Uri| {
        let (connector, name) = (connector.clone(), name.clone());
        async move {
            let authority = uri
                .authority()
                .ok_or_else(|| std::io::Error::other(format!("no host:port in {uri}")))?
                .to_string();
            let tcp = TcpStream::connect(authority).await?;
            tcp.set_nodelay(true)?;
            let stream = connector.connect(name, tcp).await?;
            Ok(hyper_util::rt::TokioIo::new(stream))
        }
    }))
}

#[cfg(test)]
#[path = "tls_tests.rs"]
mod tests;
