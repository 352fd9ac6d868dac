//! A data-plane CA for tests, and the certificates the cluster's signer
//! issues (a node's, the gateway's) or does not (any other).
//!
//! ```text
//!  TestCa::new() ─► node("n")   ─► (cert, key): DNS name n, server and client use
//!               ├─► gateway()   ─► (cert, key): no DNS name, CN shardplane-gateway, client use
//!               ├─► issue(names, cn, usages) ─► anything else
//!               └─► tls(identity) ─► Arc<Tls> (trusting the CA)
//! ```

use std::sync::Arc;

use rcgen::{
    BasicConstraints, CertificateParams, DnType, ExtendedKeyUsagePurpose, IsCa, Issuer, KeyPair,
};
use shardplane_crds::identity::GATEWAY_COMMON_NAME;
use shardplane_dataplane::tls::{Material, Tls};

/// A PEM certificate and its PEM key.
pub type Identity = (String, String);

/// A CA of its own: its PEM certificate and its signing key.
pub struct TestCa {
    /// The CA's certificate (PEM).
    pub pem: String,
    issuer: Issuer<'static, KeyPair>,
}

impl Default for TestCa {
    fn default() -> Self {
        Self::new()
    }
}

impl TestCa {
    /// A new CA.
    pub fn new() -> TestCa {
        let key = KeyPair::generate().expect("a key");
        let mut params = CertificateParams::new(Vec::<String>::new()).expect("no names");
        params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
        let pem = params.self_signed(&key).expect("self-signed").pem();
        TestCa {
            pem,
            issuer: Issuer::new(params, key),
        }
    }

    /// A certificate naming the DNS `names`, with `common_name` (rcgen's
    /// default when none), for `usages`.
    pub fn issue(
        &self,
        names: &[&str],
        common_name: Option<&str>,
        usages: Vec<ExtendedKeyUsagePurpose>,
    ) -> Identity {
        let key = KeyPair::generate().expect("a key");
        let names: Vec<String> = names.iter().map(|n| n.to_string()).collect();
        let mut params = CertificateParams::new(names).expect("valid names");
        if let Some(cn) = common_name {
            params.distinguished_name.push(DnType::CommonName, cn);
        }
        params.extended_key_usages = usages;
        let cert = params.signed_by(&key, &self.issuer).expect("signed");
        (cert.pem(), key.serialize_pem())
    }

    /// A node's certificate, as the signer issues it: its name, for
    /// serving and calling.
    pub fn node(&self, node: &str) -> Identity {
        self.issue(
            &[node],
            None,
            vec![
                ExtendedKeyUsagePurpose::ServerAuth,
                ExtendedKeyUsagePurpose::ClientAuth,
            ],
        )
    }

    /// The gateway's certificate, as the signer issues it: no DNS name,
    /// its common name, for calling only.
    pub fn gateway(&self) -> Identity {
        self.issue(
            &[],
            Some(GATEWAY_COMMON_NAME),
            vec![ExtendedKeyUsagePurpose::ClientAuth],
        )
    }

    /// TLS trusting this CA, with `identity` (none: a caller without a
    /// certificate).
    pub fn tls(&self, identity: Option<Identity>) -> Arc<Tls> {
        Tls::new(&Material {
            ca_pem: self.pem.clone(),
            identity,
        })
        .expect("valid TLS material")
    }
}
