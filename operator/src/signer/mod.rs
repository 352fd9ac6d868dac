//! The data-plane signer: the cluster CA that agents' data-plane
//! certificates chain to, and a controller that approves and signs their
//! CertificateSigningRequests (signer `shardplane.dev/data-plane`) by
//! [`policy`], and the gateways' (client-only certificates). The CA and its key stay in a Secret in the operator's
//! namespace; its certificate is published for agents and the gateway in
//! ConfigMap `shardplane-data-plane-ca` in the agents' namespace.
//!
//! ```text
//!  leader start ──► Secret shardplane-data-plane-ca (ca.crt, ca.key; made once)
//!               └─► ConfigMap shardplane-data-plane-ca {ca.crt} (agents' namespace)
//!  CSR (our signer) ──► new: policy::check ──► Approved | Denied (reason)
//!                   ──► Approved, no certificate: policy::sign ──► status.certificate | Failed
//!                   ──► answered an hour ago: deleted (nobody else cleans up after us)
//! ```

pub mod policy;

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;

use futures::StreamExt;
use k8s_openapi::ByteString;
use k8s_openapi::api::certificates::v1::CertificateSigningRequest;
use k8s_openapi::api::core::v1::{ConfigMap, Secret};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;
use kube::api::{Api, DeleteParams, Patch, PatchParams, PostParams};
use kube::runtime::controller::{Action, Controller};
use kube::runtime::watcher;
use kube::{Client, ResourceExt};
use serde_json::json;
use shardplane_cluster::trust::{CA_KEY, DATA_PLANE_CA};
use shardplane_crds::identity::DATA_PLANE_SIGNER;

use crate::controllers::{Context, instrumented, retry_after_error};
use crate::error::Error;

/// How long an answered request is kept before it is deleted.
const KEEP_ANSWERED: Duration = Duration::from_secs(3600);

/// Where the signer keeps and publishes its CA.
#[derive(Clone, Debug)]
pub struct SignerConfig {
    /// The operator's namespace: the Secret with the CA's key.
    pub secret_namespace: String,
    /// The agents' namespace: their node identities live here, and the
    /// ConfigMap with the CA certificate.
    pub agent_namespace: String,
    /// The users that are gateways: each gets a client-only certificate.
    pub gateway_users: Vec<String>,
}

/// The CA (certificate, key) the signer signs with.
#[derive(Clone)]
pub struct SigningCa {
    ca_pem: String,
    ca_key_pem: String,
    namespace: String,
    gateways: Vec<String>,
}

fn text(data: &Option<BTreeMap<String, ByteString>>, key: &str) -> Option<String> {
    String::from_utf8(data.as_ref()?.get(key)?.0.clone()).ok()
}

/// The CA from its Secret, made the first time; its certificate published
/// in the agents' namespace.
pub async fn ensure_ca(client: &Client, config: &SignerConfig) -> Result<SigningCa, Error> {
    crate::leader::ensure_namespace(client, &config.agent_namespace).await?;
    let secrets: Api<Secret> = Api::namespaced(client.clone(), &config.secret_namespace);
    let (ca_pem, ca_key_pem) = loop {
        let existing = secrets.get_opt(DATA_PLANE_CA).await?;
        let held = existing
            .as_ref()
            .and_then(|s| text(&s.data, "ca.crt").zip(text(&s.data, "ca.key")));
        if let Some(pair) = held {
            break pair;
        }
        let (ca_pem, ca_key) = crate::admission::certs::new_ca()
            .map_err(|e| Error::Certificate(format!("cannot make the data-plane CA: {e}")))?;
        let mut secret = Secret {
            metadata: ObjectMeta {
                name: Some(DATA_PLANE_CA.into()),
                namespace: Some(config.secret_namespace.clone()),
                labels: Some(BTreeMap::from([(
                    "app.kubernetes.io/managed-by".to_string(),
                    "shardplane-operator".to_string(),
                )])),
                ..Default::default()
            },
            data: Some(BTreeMap::from([
                (
                    "ca.crt".to_string(),
                    ByteString(ca_pem.clone().into_bytes()),
                ),
                (
                    "ca.key".to_string(),
                    ByteString(ca_key.clone().into_bytes()),
                ),
            ])),
            ..Default::default()
        };
        let written = match existing {
            // One made empty (by hand, or by a chart): filled in.
            Some(old) => {
                secret.metadata.resource_version = old.metadata.resource_version;
                secrets
                    .replace(DATA_PLANE_CA, &PostParams::default(), &secret)
                    .await
            }
            None => secrets.create(&PostParams::default(), &secret).await,
        };
        match written {
            Ok(_) => {
                tracing::info!(secret = %format!("{}/{DATA_PLANE_CA}", config.secret_namespace), "made the data plane's CA");
                break (ca_pem, ca_key);
            }
            // A replica that led before made it meanwhile: read that one.
            Err(kube::Error::Api(e)) if e.code == 409 => continue,
            Err(e) => return Err(e.into()),
        }
    };
    let maps: Api<ConfigMap> = Api::namespaced(client.clone(), &config.agent_namespace);
    let published = ConfigMap {
        metadata: ObjectMeta {
            name: Some(DATA_PLANE_CA.into()),
            namespace: Some(config.agent_namespace.clone()),
            ..Default::default()
        },
        data: Some(BTreeMap::from([(CA_KEY.to_string(), ca_pem.clone())])),
        ..Default::default()
    };
    maps.patch(
        DATA_PLANE_CA,
        &PatchParams::apply("shardplane-operator").force(),
        &Patch::Apply(&published),
    )
    .await?;
    Ok(SigningCa {
        ca_pem,
        ca_key_pem,
        namespace: config.agent_namespace.clone(),
        gateways: config.gateway_users.clone(),
    })
}

/// The controller over requests to this signer.
pub fn controller(client: &Client) -> Controller<CertificateSigningRequest> {
    let api: Api<CertificateSigningRequest> = Api::all(client.clone());
    Controller::new(
        api,
        watcher::Config::default().fields(&format!("spec.signerName={DATA_PLANE_SIGNER}")),
    )
}

/// Runs the signer until the stream ends.
pub async fn run(
    controller: Controller<CertificateSigningRequest>,
    ctx: Arc<Context>,
    ca: SigningCa,
) {
    let ca = Arc::new(ca);
    controller
        .shutdown_on_signal()
        .run(
            move |csr, ctx| {
                let ca = ca.clone();
                async move { instrumented(&ctx, "signer", reconcile(csr, ctx.clone(), ca)).await }
            },
            retry_after_error,
            ctx,
        )
        .for_each(|_| async {})
        .await;
}

/// Whether `csr` has a true condition of `kind`.
fn has(csr: &CertificateSigningRequest, kind: &str) -> bool {
    csr.status
        .as_ref()
        .and_then(|s| s.conditions.as_ref())
        .is_some_and(|c| c.iter().any(|c| c.type_ == kind && c.status == "True"))
}

fn condition(kind: &str, reason: &str, message: &str) -> serde_json::Value {
    json!({
        "type": kind,
        "status": "True",
        "reason": reason,
        "message": message,
        "lastUpdateTime": k8s_openapi::jiff::Timestamp::now(),
    })
}

async fn reconcile(
    csr: Arc<CertificateSigningRequest>,
    ctx: Arc<Context>,
    ca: Arc<SigningCa>,
) -> Result<Action, Error> {
    if csr.spec.signer_name != DATA_PLANE_SIGNER {
        return Ok(Action::await_change());
    }
    let api: Api<CertificateSigningRequest> = Api::all(ctx.client.clone());
    let name = csr.name_any();
    let issued = csr
        .status
        .as_ref()
        .and_then(|s| s.certificate.as_ref())
        .is_some_and(|c| !c.0.is_empty());
    if issued || has(&csr, "Denied") || has(&csr, "Failed") {
        let age = csr
            .creation_timestamp()
            .map(|t| k8s_openapi::jiff::Timestamp::now().duration_since(t.0))
            .and_then(|d| Duration::try_from(d).ok())
            .unwrap_or_default();
        if age < KEEP_ANSWERED {
            return Ok(Action::requeue(KEEP_ANSWERED - age));
        }
        ctx.fence()?;
        match api.delete(&name, &DeleteParams::default()).await {
            Ok(_) => {}
            Err(kube::Error::Api(e)) if e.code == 404 => {}
            Err(e) => return Err(e.into()),
        }
        return Ok(Action::await_change());
    }
    let who = policy::Requesters {
        namespace: &ca.namespace,
        gateways: &ca.gateways,
    };
    let decision = policy::check(&csr, who);
    let outcome = |o: &str| ctx.metrics.certificates.with_label_values(&[o]).inc();
    if !has(&csr, "Approved") {
        ctx.fence()?;
        let (kind, reason, message) = match &decision {
            Ok(policy::Grant {
                holder: policy::Holder::Node(node),
                ..
            }) => (
                "Approved",
                "NodeIdentity",
                format!("node identity of {node}: a data-plane certificate naming it"),
            ),
            Ok(_) => (
                "Approved",
                "GatewayIdentity",
                "a gateway identity: a client-only data-plane certificate naming no node".into(),
            ),
            Err(d) => ("Denied", d.reason, d.message.clone()),
        };
        let patch = json!({"status": {"conditions": [condition(kind, reason, &message)]}});
        api.patch_approval(&name, &PatchParams::default(), &Patch::Merge(&patch))
            .await?;
        if let Err(d) = &decision {
            outcome("denied");
            tracing::warn!(request = %name, user = ?csr.spec.username, reason = d.reason, message = %d.message, "denied a data-plane certificate");
            return Ok(Action::await_change());
        }
        // Signed below, on this approval's own event.
        return Ok(Action::await_change());
    }
    // Approved (by this signer, or by someone else: the policy still holds).
    let pem = std::str::from_utf8(&csr.spec.request.0).unwrap_or_default();
    let signed = decision
        .map_err(|d| format!("{}: {}", d.reason, d.message))
        .and_then(|grant| {
            policy::sign(pem, &grant, &ca.ca_pem, &ca.ca_key_pem).map(|cert| (grant, cert))
        });
    ctx.fence()?;
    match signed {
        Ok((grant, cert)) => {
            let patch = json!({"status": {"certificate": ByteString(cert.into_bytes())}});
            api.patch_status(&name, &PatchParams::default(), &Patch::Merge(&patch))
                .await?;
            outcome("issued");
            tracing::info!(request = %name, holder = %grant.holder, lifetime = ?grant.lifetime, "issued a data-plane certificate");
        }
        Err(why) => {
            let mut conditions: Vec<serde_json::Value> = csr
                .status
                .as_ref()
                .and_then(|s| s.conditions.clone())
                .unwrap_or_default()
                .into_iter()
                .filter_map(|c| serde_json::to_value(c).ok())
                .collect();
            conditions.push(condition("Failed", "NotSignable", &why));
            let patch = json!({"status": {"conditions": conditions}});
            api.patch_status(&name, &PatchParams::default(), &Patch::Merge(&patch))
                .await?;
            outcome("failed");
            tracing::warn!(request = %name, error = %why, "cannot sign an approved data-plane certificate request");
        }
    }
    Ok(Action::await_change())
}
