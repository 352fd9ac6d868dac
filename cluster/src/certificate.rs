//! A data-plane certificate, for an agent (naming its node: it serves and
//! calls) or a gateway (naming no node: it only calls; agents require a
//! certificate of every caller). By default the operator issues it: the
//! process makes a key that never leaves the machine, asks for a
//! certificate through a Kubernetes CertificateSigningRequest (signer
//! `shardplane.dev/data-plane`), and renews it at two thirds of its life
//! while the data plane keeps running. Certificates can also come as files
//! (a cert-manager Secret mounted as a directory), re-read when they change.
//!
//! ```text
//!  the directory holds a certificate for this holder with over a third of its life left? ──► use it
//!    └─ no ──► new key ──► CertificateSigningRequest ──► operator approves, signs
//!              ──► tls.key, tls.crt, ca.crt written (key 0600; kept in memory without a directory)
//!  at two thirds of its life: the same again, swapped into the running data plane
//! ```

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use k8s_openapi::ByteString;
use k8s_openapi::api::certificates::v1::{
    CertificateSigningRequest, CertificateSigningRequestSpec,
};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;
use kube::api::{Api, PostParams};
use kube::{Client, ResourceExt};
use shardplane_crds::identity::{DATA_PLANE_SIGNER, GATEWAY_COMMON_NAME};
use shardplane_dataplane::tls::{CA_FILE, CERT_FILE, KEY_FILE, Material, Tls};

/// Why there is no usable data-plane certificate.
#[derive(Debug, thiserror::Error)]
#[error("{0}")]
pub struct CertificateError(String);

type Result<T> = std::result::Result<T, CertificateError>;

/// Whom a data-plane certificate is for.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Holder {
    /// A node agent: the certificate names the node.
    Node(String),
    /// A gateway: the certificate names no node (the operator knows its user
    /// as a gateway's, `--data-plane-gateway-user`).
    Gateway,
}

impl Holder {
    /// Whether a certificate of `facts` is this holder's as agents tell
    /// callers apart: a node's names exactly its node; the gateway's names
    /// no DNS name and has the gateway's common name.
    fn fits(&self, facts: &shardplane_dataplane::tls::CertificateFacts) -> bool {
        match self {
            Holder::Node(node) => matches!(facts.names.as_slice(), [name] if name == node),
            Holder::Gateway => {
                facts.names.is_empty() && facts.common_name.as_deref() == Some(GATEWAY_COMMON_NAME)
            }
        }
    }

    /// What this holder's CertificateSigningRequest asks for.
    fn asks(&self) -> Asks {
        match self {
            Holder::Node(node) => Asks {
                names: vec![node.clone()],
                common_name: node.clone(),
                usages: &["digital signature", "server auth", "client auth"],
                name_prefix: format!(
                    "shardplane-node-{}-",
                    node.chars().take(40).collect::<String>()
                ),
                labels: BTreeMap::from([(
                    shardplane_crds::NODE_LABEL.to_string(),
                    shardplane_crds::node_label_value(node),
                )]),
            },
            Holder::Gateway => Asks {
                names: Vec::new(),
                common_name: GATEWAY_COMMON_NAME.into(),
                usages: &["digital signature", "client auth"],
                name_prefix: "shardplane-gateway-".into(),
                labels: BTreeMap::new(),
            },
        }
    }
}

/// What a holder's CertificateSigningRequest asks for.
struct Asks {
    /// DNS names.
    names: Vec<String>,
    /// The subject's common name.
    common_name: String,
    /// Key usages.
    usages: &'static [&'static str],
    /// The request object's `generateName`.
    name_prefix: String,
    /// The request object's labels.
    labels: BTreeMap<String, String>,
}

impl std::fmt::Display for Holder {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Holder::Node(node) => write!(f, "node {node}"),
            Holder::Gateway => f.write_str("the gateway"),
        }
    }
}

/// The life a certificate is asked for (the operator may shorten it).
pub const LIFETIME: Duration = Duration::from_secs(7 * 24 * 3600);
/// How long the operator has to answer a request before it is asked again.
const ANSWER_WITHIN: Duration = Duration::from_secs(60);
/// The longest pause between attempts while no certificate comes.
const MOST_BACKOFF: Duration = Duration::from_secs(30);

/// Where the data plane's TLS material comes from.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Source {
    /// No TLS: plain TCP, for a test or a closed network (say so).
    Off,
    /// `ca.crt`, `tls.crt`, `tls.key` in a directory, kept current by
    /// someone else (cert-manager); re-read when they change.
    Files(PathBuf),
    /// Issued by the operator, kept in `dir`; the CA comes from the
    /// ConfigMap in `namespace` (the kubeconfig's namespace when unset).
    Operator {
        /// Where the key and certificate are kept between runs (in memory
        /// only, asked for again at each start, when unset).
        dir: Option<PathBuf>,
        /// Where the operator publishes the CA.
        namespace: Option<String>,
    },
}

/// The data plane's TLS for `holder` from `source`, and the task that keeps
/// it current (renewal or reloading); none when TLS is off.
pub async fn start(
    client: &Client,
    source: &Source,
    holder: &Holder,
) -> Result<Option<(Arc<Tls>, tokio::task::JoinHandle<()>)>> {
    let tls_error = |e: shardplane_dataplane::tls::TlsError| CertificateError(e.to_string());
    match source {
        Source::Off => {
            tracing::warn!(
                "the data plane runs without TLS (--data-plane-tls off): its traffic is readable on the network"
            );
            Ok(None)
        }
        Source::Files(dir) => {
            let tls = Tls::new(&Material::read_dir(dir).map_err(tls_error)?).map_err(tls_error)?;
            check_names(&tls, holder)?;
            let task = tls.watch_dir(dir.clone(), Duration::from_secs(30));
            Ok(Some((tls, task)))
        }
        Source::Operator { dir, namespace } => {
            let namespace = namespace
                .clone()
                .unwrap_or_else(|| client.default_namespace().to_string());
            if let Some(d) = dir.as_deref() {
                not_anothers(d, holder)?;
            }
            let mut kept = dir.as_deref().and_then(|d| kept(d, holder));
            if let Some(m) = &kept {
                // Kept only if issued under the CA published now: a new
                // control plane (a new `shardplane up`, say) has a new CA,
                // which its operator may not have published yet when this
                // starts, so wait for it rather than serve the old one.
                let published = crate::trust::wait_for_ca(client, &namespace).await;
                if published != m.ca_pem {
                    tracing::info!(%holder, "the kept data-plane certificate is of another CA: asking for a new one");
                    kept = None;
                }
            }
            let material = match kept {
                Some(m) => m,
                None => {
                    let m = issue(client, holder, &namespace).await;
                    if let Some(dir) = dir {
                        write(dir, &m)?;
                    }
                    m
                }
            };
            let tls = Tls::new(&material).map_err(tls_error)?;
            check_names(&tls, holder)?;
            tracing::info!(%holder, certificate = ?tls.certificate(), "data-plane certificate in use");
            let task = tokio::spawn(renew(
                client.clone(),
                holder.clone(),
                namespace,
                dir.clone(),
                tls.clone(),
            ));
            Ok(Some((tls, task)))
        }
    }
}

/// Gives `report` the certificate's expiry (Unix seconds; 0 without one)
/// now and every 30 s, as renewals or a reloaded directory change it.
pub fn report_expiry(
    tls: Arc<Tls>,
    report: impl Fn(i64) + Send + 'static,
) -> tokio::task::JoinHandle<()> {
    tokio::spawn(async move {
        loop {
            report(tls.certificate().map_or(0, |f| f.not_after));
            tokio::time::sleep(Duration::from_secs(30)).await;
        }
    })
}

fn check_names(tls: &Tls, holder: &Holder) -> Result<()> {
    let Some(facts) = tls.certificate() else {
        let why = match holder {
            Holder::Node(_) => "an agent serves only with one",
            Holder::Gateway => "agents refuse callers without one",
        };
        return Err(CertificateError(format!(
            "no certificate (tls.crt, tls.key) for {holder}: {why}"
        )));
    };
    if !holder.fits(&facts) {
        let why = match holder {
            Holder::Node(node) => {
                format!("a node's names its node {node:?} alone: peers would refuse it")
            }
            Holder::Gateway => format!(
                "a gateway's names no node (it could pass for one) and has the common name \
                 {GATEWAY_COMMON_NAME} (agents refuse any other)"
            ),
        };
        return Err(CertificateError(format!(
            "the certificate names {:?} (common name {:?}); {why}",
            facts.names, facts.common_name
        )));
    }
    Ok(())
}

/// Refuses a directory holding a certificate of the other kind (a node's
/// for the gateway, the gateway's for a node): it belongs to another
/// process, whose key would be overwritten.
fn not_anothers(dir: &Path, holder: &Holder) -> Result<()> {
    let Some((cert, _)) = Material::read_dir(dir).ok().and_then(|m| m.identity) else {
        return Ok(());
    };
    let Ok(facts) = shardplane_dataplane::tls::facts(&cert) else {
        return Ok(());
    };
    let a_gateways = facts.names.is_empty();
    if a_gateways != matches!(holder, Holder::Gateway) {
        let whose = if a_gateways {
            "the gateway's".to_string()
        } else {
            format!("a node's ({:?})", facts.names)
        };
        return Err(CertificateError(format!(
            "{} holds {whose} certificate, not one for {holder}: give each its own directory",
            dir.display()
        )));
    }
    Ok(())
}

fn now() -> i64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_secs() as i64)
}

/// When a certificate valid from `not_before` to `not_after` is renewed:
/// at two thirds of its life.
pub fn renew_at(not_before: i64, not_after: i64) -> i64 {
    not_before + (not_after - not_before).max(0) * 2 / 3
}

/// The material kept in `dir`, if it is `holder`'s and not yet due for renewal.
fn kept(dir: &Path, holder: &Holder) -> Option<Material> {
    let m = Material::read_dir(dir).ok()?;
    let (cert, _) = m.identity.as_ref()?;
    let facts = shardplane_dataplane::tls::facts(cert).ok()?;
    let fresh = now() < renew_at(facts.not_before, facts.not_after);
    (fresh && holder.fits(&facts) && Tls::new(&m).is_ok()).then_some(m)
}

/// Writes the material into `dir` (each file replaced whole; the key
/// readable by this user only).
fn write(dir: &Path, m: &Material) -> Result<()> {
    use std::os::unix::fs::{OpenOptionsExt, PermissionsExt};
    let io = |what: &Path, e: std::io::Error| {
        CertificateError(format!("cannot write {}: {e}", what.display()))
    };
    std::fs::create_dir_all(dir).map_err(|e| io(dir, e))?;
    std::fs::set_permissions(dir, std::fs::Permissions::from_mode(0o700))
        .map_err(|e| io(dir, e))?;
    let (cert, key) = m.identity.clone().unwrap_or_default();
    for (name, text, mode) in [
        (KEY_FILE, key, 0o600),
        (CERT_FILE, cert, 0o644),
        (CA_FILE, m.ca_pem.clone(), 0o644),
    ] {
        let path = dir.join(name);
        let part = dir.join(format!(".{name}.new"));
        let _ = std::fs::remove_file(&part);
        let mut f = std::fs::OpenOptions::new()
            .write(true)
            .create_new(true)
            .mode(mode)
            .open(&part)
            .map_err(|e| io(&part, e))?;
        std::io::Write::write_all(&mut f, text.as_bytes()).map_err(|e| io(&part, e))?;
        f.sync_all().map_err(|e| io(&part, e))?;
        std::fs::rename(&part, &path).map_err(|e| io(&path, e))?;
    }
    Ok(())
}

/// A certificate for `holder`, asked for until one is issued (a denial is
/// logged with the operator's reason, and asked again later: the cause is
/// a setting someone can fix while the process waits).
async fn issue(client: &Client, holder: &Holder, namespace: &str) -> Material {
    let mut pause = Duration::from_secs(1);
    loop {
        match request(client, holder, namespace).await {
            Ok(m) => return m,
            Err(why) => {
                tracing::warn!(%holder, error = %why, retry_in = ?pause, "no data-plane certificate yet");
                tokio::time::sleep(pause).await;
                pause = (pause * 2).min(MOST_BACKOFF);
            }
        }
    }
}

/// Renews `tls` at two thirds of its certificate's life, for ever.
async fn renew(
    client: Client,
    holder: Holder,
    namespace: String,
    dir: Option<PathBuf>,
    tls: Arc<Tls>,
) {
    loop {
        let due = tls
            .certificate()
            .map_or(0, |f| renew_at(f.not_before, f.not_after));
        let wait = (due - now()).max(0) as u64;
        tokio::time::sleep(Duration::from_secs(wait)).await;
        let m = issue(&client, &holder, &namespace).await;
        let written = dir.as_deref().map_or(Ok(()), |d| write(d, &m));
        match written.and_then(|()| tls.replace(&m).map_err(|e| CertificateError(e.to_string()))) {
            Ok(()) => {
                tracing::info!(%holder, certificate = ?tls.certificate(), "data-plane certificate renewed")
            }
            Err(e) => {
                tracing::warn!(%holder, error = %e, "cannot use the renewed data-plane certificate");
                tokio::time::sleep(MOST_BACKOFF).await;
            }
        }
    }
}

/// One request: a new key, a CertificateSigningRequest for `holder`, and
/// its answer.
async fn request(
    client: &Client,
    holder: &Holder,
    namespace: &str,
) -> std::result::Result<Material, String> {
    let asks = holder.asks();
    let key = rcgen::KeyPair::generate().map_err(|e| e.to_string())?;
    let mut params = rcgen::CertificateParams::new(asks.names).map_err(|e| e.to_string())?;
    params
        .distinguished_name
        .push(rcgen::DnType::CommonName, asks.common_name);
    let csr = params
        .serialize_request(&key)
        .and_then(|r| r.pem())
        .map_err(|e| e.to_string())?;
    let object = CertificateSigningRequest {
        metadata: ObjectMeta {
            generate_name: Some(asks.name_prefix),
            labels: Some(asks.labels),
            ..Default::default()
        },
        spec: CertificateSigningRequestSpec {
            request: ByteString(csr.into_bytes()),
            signer_name: DATA_PLANE_SIGNER.into(),
            usages: Some(asks.usages.iter().map(|u| u.to_string()).collect()),
            expiration_seconds: Some(LIFETIME.as_secs() as i32),
            ..Default::default()
        },
        status: None,
    };
    let api: Api<CertificateSigningRequest> = Api::all(client.clone());
    let created = api
        .create(&PostParams::default(), &object)
        .await
        .map_err(|e| format!("cannot create a CertificateSigningRequest: {e}"))?;
    let name = created.name_any();
    tracing::info!(%holder, request = %name, "asked the operator for a data-plane certificate");
    let deadline = tokio::time::Instant::now() + ANSWER_WITHIN;
    let cert = loop {
        if tokio::time::Instant::now() >= deadline {
            return Err(format!(
                "CertificateSigningRequest {name} has no answer after {ANSWER_WITHIN:?}: is the operator running with its data-plane signer?"
            ));
        }
        tokio::time::sleep(Duration::from_millis(300)).await;
        let Ok(Some(csr)) = api.get_opt(&name).await else {
            continue;
        };
        let status = csr.status.unwrap_or_default();
        if let Some(c) = status
            .conditions
            .iter()
            .flatten()
            .find(|c| (c.type_ == "Denied" || c.type_ == "Failed") && c.status == "True")
        {
            return Err(format!(
                "CertificateSigningRequest {name} {}: {}: {}",
                c.type_.to_lowercase(),
                c.reason.clone().unwrap_or_default(),
                c.message.clone().unwrap_or_default()
            ));
        }
        if let Some(cert) = status.certificate.filter(|c| !c.0.is_empty()) {
            break String::from_utf8(cert.0)
                .map_err(|_| "the certificate is not text".to_string())?;
        }
    };
    let ca_pem = crate::trust::wait_for_ca(client, namespace).await;
    Ok(Material {
        ca_pem,
        identity: Some((cert, key.serialize_pem())),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn certificates_are_renewed_at_two_thirds_of_their_life() {
        assert_eq!(renew_at(0, 900), 600);
        assert_eq!(renew_at(1000, 1000 + 7 * 86400), 1000 + 7 * 86400 * 2 / 3);
        assert_eq!(renew_at(10, 5), 10);
    }

    #[test]
    fn material_is_written_whole_with_a_private_key_and_kept_only_while_fresh() {
        use std::os::unix::fs::PermissionsExt;
        let dir = tempfile::tempdir().unwrap();
        let tls_dir = dir.path().join("tls");
        let ca_key = rcgen::KeyPair::generate().unwrap();
        let mut ca_params = rcgen::CertificateParams::new(Vec::<String>::new()).unwrap();
        ca_params.is_ca = rcgen::IsCa::Ca(rcgen::BasicConstraints::Unconstrained);
        let ca_pem = ca_params.self_signed(&ca_key).unwrap().pem();
        let issuer = rcgen::Issuer::new(ca_params, ca_key);
        let key = rcgen::KeyPair::generate().unwrap();
        let cert = rcgen::CertificateParams::new(vec!["node-a".to_string()])
            .unwrap()
            .signed_by(&key, &issuer)
            .unwrap()
            .pem();
        let m = Material {
            ca_pem,
            identity: Some((cert, key.serialize_pem())),
        };
        write(&tls_dir, &m).unwrap();
        let mode = |p: &Path| std::fs::metadata(p).unwrap().permissions().mode() & 0o777;
        assert_eq!(mode(&tls_dir.join(KEY_FILE)), 0o600);
        assert_eq!(mode(&tls_dir), 0o700);
        // rcgen's default validity runs to the year 4096: fresh.
        let node = |n: &str| Holder::Node(n.into());
        assert_eq!(kept(&tls_dir, &node("node-a")), Some(m.clone()));
        assert_eq!(kept(&tls_dir, &node("node-b")), None, "another node's");
        assert_eq!(kept(&tls_dir, &Holder::Gateway), None, "a node's");
        let e = not_anothers(&tls_dir, &Holder::Gateway).unwrap_err();
        assert!(e.to_string().contains("a node's ([\"node-a\"])"), "{e}");
        assert!(not_anothers(&tls_dir, &node("node-a")).is_ok());
        assert!(not_anothers(&tls_dir, &node("renamed")).is_ok());
        write(&tls_dir, &m).unwrap();
        std::fs::write(tls_dir.join(KEY_FILE), "broken").unwrap();
        assert_eq!(
            kept(&tls_dir, &node("node-a")),
            None,
            "a key that does not load"
        );
    }

    #[test]
    fn a_certificate_is_its_holder_s_only_as_agents_tell_callers_apart() {
        let key = rcgen::KeyPair::generate().unwrap();
        let facts = |names: &[&str], cn: Option<&str>| {
            let names: Vec<String> = names.iter().map(|n| n.to_string()).collect();
            let mut params = rcgen::CertificateParams::new(names).unwrap();
            if let Some(cn) = cn {
                params
                    .distinguished_name
                    .push(rcgen::DnType::CommonName, cn);
            }
            shardplane_dataplane::tls::facts(&params.self_signed(&key).unwrap().pem()).unwrap()
        };
        let node = Holder::Node("node-a".into());
        assert!(node.fits(&facts(&["node-a"], None)));
        assert!(
            !node.fits(&facts(&["node-a", "node-a.local"], None)),
            "two names"
        );
        assert!(!node.fits(&facts(&["node-b"], None)));
        assert!(Holder::Gateway.fits(&facts(&[], Some(GATEWAY_COMMON_NAME))));
        assert!(!Holder::Gateway.fits(&facts(&[], Some("someone"))));
        assert!(!Holder::Gateway.fits(&facts(&["node-a"], Some(GATEWAY_COMMON_NAME))));
    }
}
