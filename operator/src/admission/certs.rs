//! The webhook's serving certificate: a cluster CA of the operator's own
//! and a certificate it signs for the webhook's host names, kept in one
//! Secret so that every replica serves with the same CA and a restart keeps
//! it (the API server trusts the CA through the webhook configuration's
//! `caBundle`).
//!
//! ```text
//!  Secret (ca.crt, ca.key, tls.crt, tls.key) ──► still valid for these hosts? ──► serve
//!        └─ missing, expiring or other hosts ──► issue (same CA) ──► write ──► serve
//! ```

use std::collections::BTreeMap;

use k8s_openapi::ByteString;
use k8s_openapi::api::core::v1::Secret;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;
use kube::api::{Api, PostParams};
use rcgen::{
    BasicConstraints, CertificateParams, DnType, ExtendedKeyUsagePurpose, IsCa, Issuer, KeyPair,
    KeyUsagePurpose,
};

use super::{Result, WebhookError as Error};

/// The annotation recording when the serving certificate expires (Unix seconds).
const NOT_AFTER: &str = "shardplane.dev/not-after";
/// The annotation recording the host names the serving certificate names.
const HOSTS: &str = "shardplane.dev/hosts";
/// How long a serving certificate lasts.
const SERVING_DAYS: i64 = 365;
/// How long the CA lasts.
const CA_DAYS: i64 = 3650;
/// A serving certificate with less left than this is replaced.
pub const RENEW_BEFORE_DAYS: i64 = 30;

/// PEM texts the webhook serves with.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ServingTls {
    /// The CA certificate (the webhook configuration's `caBundle`).
    pub ca_pem: String,
    /// The serving certificate.
    pub cert_pem: String,
    /// Its private key.
    pub key_pem: String,
    /// When it expires (Unix seconds).
    pub not_after: i64,
}

fn ca_params() -> Result<CertificateParams> {
    let mut params = CertificateParams::new(Vec::<String>::new()).map_err(cert_error)?;
    params
        .distinguished_name
        .push(DnType::CommonName, "shardplane cluster CA");
    params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
    params.key_usages = vec![KeyUsagePurpose::KeyCertSign, KeyUsagePurpose::CrlSign];
    Ok(params)
}

fn cert_error(e: rcgen::Error) -> Error {
    Error::Certificate(e.to_string())
}

/// The date `days` from now (at midnight UTC): as rcgen takes it, and as
/// Unix seconds.
fn days_from_now(days: i64) -> ((i32, u8, u8), i64) {
    use chrono::Datelike;
    let date = (chrono::Utc::now() + chrono::Duration::days(days)).date_naive();
    let unix = date
        .and_hms_opt(0, 0, 0)
        .map_or(0, |t| t.and_utc().timestamp());
    ((date.year(), date.month() as u8, date.day() as u8), unix)
}

/// A serial number unique enough for a private CA: the issue time's
/// nanoseconds.
pub(crate) fn serial() -> rcgen::SerialNumber {
    let nanos = chrono::Utc::now().timestamp_nanos_opt().unwrap_or_default();
    rcgen::SerialNumber::from_slice(&nanos.to_be_bytes())
}

/// rcgen's time for `days` from now.
macro_rules! at {
    ($days:expr) => {{
        let ((y, m, d), _) = days_from_now($days);
        rcgen::date_time_ymd(y, m, d)
    }};
}

/// A new CA: its certificate and key, PEM.
pub fn new_ca() -> Result<(String, String)> {
    let key = KeyPair::generate().map_err(cert_error)?;
    let mut params = ca_params()?;
    params.not_before = at!(-1);
    params.not_after = at!(CA_DAYS);
    params.serial_number = Some(serial());
    let cert = params.self_signed(&key).map_err(cert_error)?;
    Ok((cert.pem(), key.serialize_pem()))
}

/// A serving certificate for `hosts` (names or IP addresses), signed by the
/// CA whose key is `ca_key_pem`.
pub fn issue(ca_pem: &str, ca_key_pem: &str, hosts: &[String]) -> Result<ServingTls> {
    let ca_key = KeyPair::from_pem(ca_key_pem).map_err(cert_error)?;
    let issuer = Issuer::new(ca_params()?, ca_key);
    let key = KeyPair::generate().map_err(cert_error)?;
    let mut params = CertificateParams::new(hosts.to_vec()).map_err(cert_error)?;
    params.distinguished_name.push(
        DnType::CommonName,
        hosts.first().cloned().unwrap_or_default(),
    );
    params.extended_key_usages = vec![ExtendedKeyUsagePurpose::ServerAuth];
    params.key_usages = vec![KeyUsagePurpose::DigitalSignature];
    params.use_authority_key_identifier_extension = true;
    params.not_before = at!(-1);
    params.not_after = at!(SERVING_DAYS);
    let (_, not_after_unix) = days_from_now(SERVING_DAYS);
    params.serial_number = Some(serial());
    let cert = params.signed_by(&key, &issuer).map_err(cert_error)?;
    Ok(ServingTls {
        ca_pem: ca_pem.to_string(),
        cert_pem: cert.pem(),
        key_pem: key.serialize_pem(),
        not_after: not_after_unix,
    })
}

fn text(secret: &Secret, key: &str) -> Option<String> {
    let data = secret.data.as_ref()?.get(key)?;
    String::from_utf8(data.0.clone()).ok()
}

/// What a Secret holds, if it is a serving certificate for `hosts` with
/// more than [`RENEW_BEFORE_DAYS`] left; and the CA it holds either way.
fn read(secret: &Secret, hosts: &[String]) -> (Option<ServingTls>, Option<(String, String)>) {
    let ca = text(secret, "ca.crt").zip(text(secret, "ca.key"));
    let annotations = secret.metadata.annotations.clone().unwrap_or_default();
    let not_after = annotations
        .get(NOT_AFTER)
        .and_then(|t| t.parse::<i64>().ok());
    let same_hosts = annotations.get(HOSTS) == Some(&hosts.join(","));
    let fresh =
        not_after.is_some_and(|t| t > chrono::Utc::now().timestamp() + RENEW_BEFORE_DAYS * 86400);
    let serving = match (
        &ca,
        text(secret, "tls.crt"),
        text(secret, "tls.key"),
        not_after,
    ) {
        (Some((ca_pem, _)), Some(cert_pem), Some(key_pem), Some(not_after))
            if same_hosts && fresh =>
        {
            Some(ServingTls {
                ca_pem: ca_pem.clone(),
                cert_pem,
                key_pem,
                not_after,
            })
        }
        _ => None,
    };
    (serving, ca)
}

fn secret_of(
    name: &str,
    namespace: &str,
    tls: &ServingTls,
    ca_key: &str,
    hosts: &[String],
) -> Secret {
    let data = [
        ("ca.crt", &tls.ca_pem),
        ("ca.key", &ca_key.to_string()),
        ("tls.crt", &tls.cert_pem),
        ("tls.key", &tls.key_pem),
    ]
    .into_iter()
    .map(|(k, v)| (k.to_string(), ByteString(v.as_bytes().to_vec())))
    .collect();
    Secret {
        metadata: ObjectMeta {
            name: Some(name.into()),
            namespace: Some(namespace.into()),
            annotations: Some(BTreeMap::from([
                (NOT_AFTER.to_string(), tls.not_after.to_string()),
                (HOSTS.to_string(), hosts.join(",")),
            ])),
            labels: Some(BTreeMap::from([(
                "app.kubernetes.io/managed-by".to_string(),
                "shardplane-operator".to_string(),
            )])),
            ..Default::default()
        },
        type_: Some("kubernetes.io/tls".into()),
        data: Some(data),
        ..Default::default()
    }
}

/// The serving certificate in Secret `namespace/name`, issued (and the CA
/// made, the first time) when it is missing, expiring or for other hosts.
/// Replicas racing to write it settle on the first write.
pub async fn ensure(
    client: &kube::Client,
    namespace: &str,
    name: &str,
    hosts: &[String],
) -> Result<ServingTls> {
    let api: Api<Secret> = Api::namespaced(client.clone(), namespace);
    for _ in 0..5 {
        let existing = api.get_opt(name).await.map_err(Error::Kube)?;
        let (serving, ca) = existing.as_ref().map_or((None, None), |s| read(s, hosts));
        if let Some(serving) = serving {
            return Ok(serving);
        }
        let (ca_pem, ca_key) = match ca {
            Some(ca) => ca,
            None => new_ca()?,
        };
        let tls = issue(&ca_pem, &ca_key, hosts)?;
        let mut secret = secret_of(name, namespace, &tls, &ca_key, hosts);
        let written = match existing {
            Some(old) => {
                // A Secret the chart made (empty, `Opaque`) keeps its type,
                // which cannot change.
                secret.metadata.resource_version = old.metadata.resource_version;
                secret.type_ = old.type_;
                api.replace(name, &PostParams::default(), &secret).await
            }
            None => api.create(&PostParams::default(), &secret).await,
        };
        match written {
            Ok(_) => {
                tracing::info!(secret = %format!("{namespace}/{name}"), hosts = %hosts.join(","), "issued the webhook's serving certificate");
                return Ok(tls);
            }
            // Another replica wrote first: read what it wrote.
            Err(kube::Error::Api(e)) if e.code == 409 => continue,
            Err(e) => return Err(Error::Kube(e)),
        }
    }
    Err(Error::Certificate(format!(
        "Secret {namespace}/{name} kept changing while it was written"
    )))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_secret_is_reused_only_for_the_same_hosts_while_fresh() {
        let (ca, ca_key) = new_ca().unwrap();
        let hosts = vec![
            "127.0.0.1".to_string(),
            "webhook.shardplane.svc".to_string(),
        ];
        let tls = issue(&ca, &ca_key, &hosts).unwrap();
        assert!(tls.cert_pem.starts_with("-----BEGIN CERTIFICATE-----"));
        let secret = secret_of("s", "ns", &tls, &ca_key, &hosts);
        let (serving, kept) = read(&secret, &hosts);
        assert_eq!(serving.as_ref(), Some(&tls));
        assert_eq!(kept, Some((ca.clone(), ca_key.clone())));
        // Other hosts: a new certificate, the same CA.
        let (serving, kept) = read(&secret, &hosts[..1]);
        assert_eq!(serving, None);
        assert_eq!(kept, Some((ca, ca_key)));
        // Expiring: replaced.
        let mut old = secret.clone();
        let soon = chrono::Utc::now().timestamp() + 86400;
        old.metadata
            .annotations
            .as_mut()
            .unwrap()
            .insert(NOT_AFTER.into(), soon.to_string());
        assert_eq!(read(&old, &hosts).0, None);
    }
}
