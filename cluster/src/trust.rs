//! The data plane's CA certificate as the operator publishes it: ConfigMap
//! `shardplane-data-plane-ca` (key `ca.crt`) in the agents' namespace.
//! Agents and the gateway trust the certificates it signed. Each takes the
//! CA with its own certificate (`certificate`), so a new CA reaches it with
//! its next certificate: at renewal, or at a start that finds its kept
//! certificate issued under another CA.
//!
//! ```text
//!  operator ──► ConfigMap shardplane-data-plane-ca {ca.crt} ──► read_ca / wait_for_ca ──► Material ──► Tls
//! ```

use std::time::Duration;

use k8s_openapi::api::core::v1::ConfigMap;
use kube::{Api, Client};

/// The ConfigMap (in the agents' namespace) publishing the data plane's CA
/// certificate under `ca.crt`; also the Secret (in the operator's
/// namespace) holding the CA and its key.
pub const DATA_PLANE_CA: &str = "shardplane-data-plane-ca";
/// The key of the CA certificate in the ConfigMap.
pub const CA_KEY: &str = "ca.crt";

/// The published CA certificate (PEM), if there is one.
pub async fn read_ca(client: &Client, namespace: &str) -> Result<Option<String>, kube::Error> {
    let api: Api<ConfigMap> = Api::namespaced(client.clone(), namespace);
    Ok(api
        .get_opt(DATA_PLANE_CA)
        .await?
        .and_then(|c| c.data?.remove(CA_KEY))
        .filter(|pem| !pem.trim().is_empty()))
}

/// The published CA certificate, waiting (and saying so every so often)
/// until the operator has published it.
pub async fn wait_for_ca(client: &Client, namespace: &str) -> String {
    let mut waited = Duration::ZERO;
    loop {
        match read_ca(client, namespace).await {
            Ok(Some(pem)) => return pem,
            Ok(None) if waited.as_secs().is_multiple_of(10) => tracing::warn!(
                configmap = %format!("{namespace}/{DATA_PLANE_CA}"),
                "waiting for the operator to publish the data plane's CA (is it running, with its signer on?)"
            ),
            Ok(None) => {}
            Err(e) if waited.as_secs().is_multiple_of(10) => tracing::warn!(
                configmap = %format!("{namespace}/{DATA_PLANE_CA}"),
                error = %e,
                "cannot read the data plane's CA yet"
            ),
            Err(_) => {}
        }
        tokio::time::sleep(Duration::from_secs(1)).await;
        waited += Duration::from_secs(1);
    }
}
