//! What the data-plane signer grants, decided from the request alone:
//! - a node identity (ServiceAccount `shardplane-node-<node>` in the agents'
//!   namespace) gets a certificate naming exactly its node, for server and
//!   client use;
//! - a gateway identity (a user the operator is told of,
//!   `--data-plane-gateway-user`) gets a client-only certificate that names
//!   no node, so it can call agents but can neither serve as one nor pass
//!   for one where a call between agents is checked;
//!
//! each for at most [`MOST_LIFETIME`]. Everything else is denied with the
//! reason.
//!
//! ```text
//!  CSR (username, request, usages, expirationSeconds)
//!    ──► check: node or gateway identity? PKCS#10 parses? names right? usages allowed?
//!    ──► Grant { holder, lifetime } ──► sign (the CA's key; names, usages, dates set here)
//!    └─► Denial { reason, message }
//! ```

use std::time::{Duration, SystemTime};

use k8s_openapi::api::certificates::v1::CertificateSigningRequest;
use rcgen::{
    CertificateParams, CertificateSigningRequestParams, DnType, ExtendedKeyUsagePurpose, Issuer,
    KeyPair, KeyUsagePurpose, SanType,
};
use shardplane_crds::identity::{GATEWAY_COMMON_NAME, NODE_IDENTITY_PREFIX};

/// The life of a certificate whose request does not ask for one.
pub const DEFAULT_LIFETIME: Duration = Duration::from_secs(7 * 24 * 3600);
/// The longest life granted.
pub const MOST_LIFETIME: Duration = Duration::from_secs(30 * 24 * 3600);
/// The shortest life granted.
pub const LEAST_LIFETIME: Duration = Duration::from_secs(3600);
/// Usages a request may ask for.
const ALLOWED_USAGES: [&str; 4] = [
    "digital signature",
    "key encipherment",
    "server auth",
    "client auth",
];

pub use shardplane_cluster::certificate::Holder;

/// What the signer grants.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Grant {
    /// Whom the certificate is for.
    pub holder: Holder,
    /// How long it lasts.
    pub lifetime: Duration,
}

/// Who may ask for a certificate.
#[derive(Clone, Copy, Debug)]
pub struct Requesters<'a> {
    /// The agents' namespace, where node identities live.
    pub namespace: &'a str,
    /// The users that are gateways.
    pub gateways: &'a [String],
}

/// Why a request is denied: a condition's reason and message.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Denial {
    /// CamelCase reason.
    pub reason: &'static str,
    /// For the requester.
    pub message: String,
}

fn deny(reason: &'static str, message: String) -> Denial {
    Denial { reason, message }
}

/// The node a username is the identity of, in `namespace` only (a node
/// identity elsewhere could be made by anyone who may create
/// ServiceAccounts there).
pub fn node_of(username: &str, namespace: &str) -> Option<String> {
    let account = username
        .strip_prefix("system:serviceaccount:")?
        .strip_prefix(namespace)?
        .strip_prefix(':')?;
    let node = account.strip_prefix(NODE_IDENTITY_PREFIX)?;
    shardplane_crds::validation::is_dns_subdomain(node).then(|| node.to_string())
}

/// Whether `csr` may have a certificate, and which.
pub fn check(csr: &CertificateSigningRequest, who: Requesters<'_>) -> Result<Grant, Denial> {
    let spec = &csr.spec;
    let username = spec.username.clone().unwrap_or_default();
    let namespace = who.namespace;
    let holder = match node_of(&username, namespace) {
        Some(node) => Holder::Node(node),
        None if who.gateways.contains(&username) => Holder::Gateway,
        None => {
            return Err(deny(
                "UnknownRequester",
                format!(
                    "only a node identity (ServiceAccount {NODE_IDENTITY_PREFIX}<node> in namespace {namespace}, \
                     from `shardplane agent-kubeconfig --node`) or a gateway identity (the operator's \
                     --data-plane-gateway-user: {:?}) gets a data-plane certificate; {username:?} is neither",
                    who.gateways
                ),
            ));
        }
    };
    let pem = std::str::from_utf8(&spec.request.0)
        .map_err(|_| deny("BadRequest", "the request is not PEM text".into()))?;
    let request = CertificateSigningRequestParams::from_pem(pem).map_err(|e| {
        deny(
            "BadRequest",
            format!("the request is not a PKCS#10 request: {e}"),
        )
    })?;
    let names: Vec<String> = request
        .params
        .subject_alt_names
        .iter()
        .map(|n| match n {
            SanType::DnsName(d) => d.as_str().to_string(),
            other => format!("{other:?}"),
        })
        .collect();
    match &holder {
        Holder::Node(node) if names != [node.clone()] => {
            return Err(deny(
                "WrongNames",
                format!(
                    "a node's certificate names its node only, DNS name {node:?}; the request names {names:?}"
                ),
            ));
        }
        Holder::Gateway if !names.is_empty() => {
            return Err(deny(
                "WrongNames",
                format!(
                    "a gateway's certificate names no node (nor anything else); the request names {names:?}"
                ),
            ));
        }
        _ => {}
    }
    let usages = spec.usages.clone().unwrap_or_default();
    if let Some(u) = usages
        .iter()
        .find(|u| !ALLOWED_USAGES.contains(&u.as_str()))
    {
        return Err(deny(
            "WrongUsages",
            format!("usage {u:?} is not granted; allowed: {ALLOWED_USAGES:?}"),
        ));
    }
    let asks = |u: &str| usages.iter().any(|x| x == u);
    match &holder {
        Holder::Node(_) if !asks("server auth") => {
            return Err(deny(
                "WrongUsages",
                "a node's data-plane certificate is for serving: ask for \"server auth\"".into(),
            ));
        }
        Holder::Gateway if asks("server auth") || !asks("client auth") => {
            return Err(deny(
                "WrongUsages",
                "a gateway's data-plane certificate is for calling agents only: ask for \"client \
                 auth\", not \"server auth\""
                    .into(),
            ));
        }
        _ => {}
    }
    let lifetime = spec
        .expiration_seconds
        .map_or(DEFAULT_LIFETIME, |s| Duration::from_secs(s.max(0) as u64))
        .clamp(LEAST_LIFETIME, MOST_LIFETIME);
    Ok(Grant { holder, lifetime })
}

/// The certificate (PEM) for `grant`, over the request's public key, signed
/// by the CA. Names, usages and dates are the signer's, not the request's.
pub fn sign(
    request_pem: &str,
    grant: &Grant,
    ca_pem: &str,
    ca_key_pem: &str,
) -> Result<String, String> {
    let mut request =
        CertificateSigningRequestParams::from_pem(request_pem).map_err(|e| e.to_string())?;
    let mut params = match &grant.holder {
        Holder::Node(node) => {
            let mut p = CertificateParams::new(vec![node.clone()]).map_err(|e| e.to_string())?;
            p.distinguished_name.push(DnType::CommonName, node.clone());
            p.extended_key_usages = vec![
                ExtendedKeyUsagePurpose::ServerAuth,
                ExtendedKeyUsagePurpose::ClientAuth,
            ];
            p
        }
        Holder::Gateway => {
            let mut p = CertificateParams::new(Vec::<String>::new()).map_err(|e| e.to_string())?;
            p.distinguished_name
                .push(DnType::CommonName, GATEWAY_COMMON_NAME);
            p.extended_key_usages = vec![ExtendedKeyUsagePurpose::ClientAuth];
            p
        }
    };
    params.key_usages = vec![KeyUsagePurpose::DigitalSignature];
    params.use_authority_key_identifier_extension = true;
    let now = SystemTime::now();
    // A few minutes back, for clocks a little behind.
    params.not_before = (now - Duration::from_secs(300)).into();
    params.not_after = (now + grant.lifetime).into();
    params.serial_number = Some(crate::admission::certs::serial());
    request.params = params;
    let key = KeyPair::from_pem(ca_key_pem).map_err(|e| e.to_string())?;
    let ca_der = rustls::pki_types::pem::PemObject::from_pem_slice(ca_pem.as_bytes())
        .map_err(|e: rustls::pki_types::pem::Error| e.to_string())?;
    let ca_der: rustls::pki_types::CertificateDer<'_> = ca_der;
    let (_, ca) = x509_parser::parse_x509_certificate(&ca_der).map_err(|e| e.to_string())?;
    if ca.public_key().raw != rcgen::PublicKeyData::subject_public_key_info(&key).as_slice() {
        return Err("the CA's key is not the CA certificate's".into());
    }
    let issuer = Issuer::from_ca_cert_pem(ca_pem, key).map_err(|e| e.to_string())?;
    Ok(request.signed_by(&issuer).map_err(|e| e.to_string())?.pem())
}

#[cfg(test)]
mod tests {
    use super::*;
    use k8s_openapi::ByteString;
    use k8s_openapi::api::certificates::v1::CertificateSigningRequestSpec;

    fn request(names: &[&str]) -> String {
        keyed_request(names).0
    }

    /// A request and its key (PEM).
    fn keyed_request(names: &[&str]) -> (String, String) {
        let key = KeyPair::generate().unwrap();
        let params =
            CertificateParams::new(names.iter().map(|n| n.to_string()).collect::<Vec<_>>())
                .unwrap();
        let pem = params.serialize_request(&key).unwrap().pem().unwrap();
        (pem, key.serialize_pem())
    }

    fn csr(
        user: &str,
        pem: &str,
        usages: &[&str],
        seconds: Option<i32>,
    ) -> CertificateSigningRequest {
        CertificateSigningRequest {
            spec: CertificateSigningRequestSpec {
                username: Some(user.into()),
                request: ByteString(pem.as_bytes().to_vec()),
                signer_name: shardplane_crds::identity::DATA_PLANE_SIGNER.into(),
                usages: Some(usages.iter().map(|u| u.to_string()).collect()),
                expiration_seconds: seconds,
                ..Default::default()
            },
            ..Default::default()
        }
    }

    const NODE_A: &str = "system:serviceaccount:shardplane:shardplane-node-node-a";
    const GATEWAY: &str = "system:serviceaccount:shardplane:shardplane-gateway";
    const USAGES: [&str; 3] = ["digital signature", "server auth", "client auth"];
    const CALLING: [&str; 2] = ["digital signature", "client auth"];

    fn who(gateways: &[String]) -> Requesters<'_> {
        Requesters {
            namespace: "shardplane",
            gateways,
        }
    }

    #[test]
    fn a_node_identity_gets_a_certificate_for_its_own_node_only() {
        let grant = check(&csr(NODE_A, &request(&["node-a"]), &USAGES, None), who(&[])).unwrap();
        assert_eq!(
            grant,
            Grant {
                holder: Holder::Node("node-a".into()),
                lifetime: DEFAULT_LIFETIME
            }
        );
        let refused = |c: CertificateSigningRequest| check(&c, who(&[])).unwrap_err().reason;
        // Another node's name, or one more name.
        assert_eq!(
            refused(csr(NODE_A, &request(&["node-b"]), &USAGES, None)),
            "WrongNames"
        );
        assert_eq!(
            refused(csr(NODE_A, &request(&["node-a", "node-b"]), &USAGES, None)),
            "WrongNames"
        );
        assert_eq!(
            refused(csr(NODE_A, &request(&["127.0.0.1"]), &USAGES, None)),
            "WrongNames"
        );
        // Not a node identity: the shared account, a user, one in another namespace.
        for user in [
            "system:serviceaccount:shardplane:shardplane-agent",
            "admin",
            "system:serviceaccount:elsewhere:shardplane-node-node-a",
        ] {
            assert_eq!(
                refused(csr(user, &request(&["node-a"]), &USAGES, None)),
                "UnknownRequester",
                "{user}"
            );
        }
        assert_eq!(refused(csr(NODE_A, "garbage", &USAGES, None)), "BadRequest");
        assert_eq!(
            refused(csr(NODE_A, &request(&["node-a"]), &["client auth"], None)),
            "WrongUsages"
        );
        assert_eq!(
            refused(csr(
                NODE_A,
                &request(&["node-a"]),
                &["server auth", "cert sign"],
                None
            )),
            "WrongUsages"
        );
        // Lifetimes are bounded.
        let life = |s| {
            check(
                &csr(NODE_A, &request(&["node-a"]), &USAGES, Some(s)),
                who(&[]),
            )
            .unwrap()
            .lifetime
        };
        assert_eq!(life(600), LEAST_LIFETIME);
        assert_eq!(life(i32::MAX), MOST_LIFETIME);
        assert_eq!(life(86400), Duration::from_secs(86400));
    }

    #[test]
    fn a_gateway_identity_gets_a_calling_certificate_that_names_no_node() {
        let gateways = [GATEWAY.to_string()];
        let grant = check(&csr(GATEWAY, &request(&[]), &CALLING, None), who(&gateways)).unwrap();
        assert_eq!(grant.holder, Holder::Gateway);
        let refused = |c: CertificateSigningRequest| check(&c, who(&gateways)).unwrap_err();
        // Not listed: the same request from another user, or with no list.
        let other = "system:serviceaccount:shardplane:someone";
        let e = refused(csr(other, &request(&[]), &CALLING, None));
        assert_eq!(e.reason, "UnknownRequester");
        assert!(e.message.contains(GATEWAY), "{}", e.message);
        assert_eq!(
            check(&csr(GATEWAY, &request(&[]), &CALLING, None), who(&[]))
                .unwrap_err()
                .reason,
            "UnknownRequester"
        );
        // A gateway names no node (it could then serve as one) and does not serve.
        assert_eq!(
            refused(csr(GATEWAY, &request(&["node-a"]), &CALLING, None)).reason,
            "WrongNames"
        );
        assert_eq!(
            refused(csr(GATEWAY, &request(&[]), &USAGES, None)).reason,
            "WrongUsages"
        );
        assert_eq!(
            refused(csr(GATEWAY, &request(&[]), &["digital signature"], None)).reason,
            "WrongUsages"
        );
        // A node identity listed as a gateway is still a node.
        let both = [NODE_A.to_string()];
        assert_eq!(
            check(
                &csr(NODE_A, &request(&["node-a"]), &USAGES, None),
                who(&both)
            )
            .unwrap()
            .holder,
            Holder::Node("node-a".into())
        );
    }

    #[test]
    fn a_gateway_certificate_calls_but_cannot_serve() {
        let (ca_pem, ca_key) = crate::admission::certs::new_ca().unwrap();
        let grant = Grant {
            holder: Holder::Gateway,
            lifetime: Duration::from_secs(86400),
        };
        // Asking for a name gets none: the signer sets the names.
        let (pem, key) = keyed_request(&["node-a"]);
        let cert = sign(&pem, &grant, &ca_pem, &ca_key).unwrap();
        let facts = shardplane_dataplane::tls::facts(&cert).unwrap();
        assert!(facts.names.is_empty(), "{:?}", facts.names);
        let (_, x509) = x509_parser::pem::parse_x509_pem(cert.as_bytes()).unwrap();
        let x509 = x509.parse_x509().unwrap();
        let eku = x509.extended_key_usage().unwrap().unwrap().value;
        assert!(eku.client_auth && !eku.server_auth, "{eku:?}");
        assert!(
            shardplane_dataplane::tls::Tls::new(&shardplane_dataplane::tls::Material {
                ca_pem,
                identity: Some((cert, key)),
            })
            .is_ok()
        );
    }

    #[test]
    fn what_is_signed_names_the_node_and_chains_to_the_ca() {
        let (ca_pem, ca_key) = crate::admission::certs::new_ca().unwrap();
        // The request asks for more than it gets: the signer sets the names.
        let grant = Grant {
            holder: Holder::Node("node-a".into()),
            lifetime: Duration::from_secs(86400),
        };
        let (pem, key) = keyed_request(&["node-a"]);
        let cert = sign(&pem, &grant, &ca_pem, &ca_key).unwrap();
        let facts = shardplane_dataplane::tls::facts(&cert).unwrap();
        assert_eq!(facts.names, vec!["node-a"]);
        let life = facts.not_after - facts.not_before;
        assert!((86400..=86400 + 301).contains(&life), "{life}");
        // The certificate goes with the requester's key, under the CA.
        let material = shardplane_dataplane::tls::Material {
            ca_pem: ca_pem.clone(),
            identity: Some((cert, key)),
        };
        assert!(shardplane_dataplane::tls::Tls::new(&material).is_ok());
        assert!(sign("garbage", &grant, &ca_pem, &ca_key).is_err());
        // A CA key that is not the CA certificate's cannot sign for it.
        let (_, other_key) = crate::admission::certs::new_ca().unwrap();
        let forged = sign(&pem, &grant, &ca_pem, &other_key);
        assert!(forged.is_err(), "{forged:?}");
    }
}
