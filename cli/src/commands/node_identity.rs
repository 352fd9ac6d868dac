//! Node identities: a ServiceAccount per node agent, holding exactly the
//! roles of the agents' shared ServiceAccount. RBAC gives them the same
//! verbs; the operator's admission webhook narrows each to its own node's
//! objects (see `shardplane_operator::admission::review`).
//!
//! ```text
//!  shared SA ◄── ClusterRoleBindings / RoleBindings (chart, or `up`)
//!     │ copied, one per binding, subject replaced
//!     ▼
//!  shardplane-node-<node> ──► TokenRequest ──► kubeconfig
//! ```
//!
//! Revoke a node's identity by deleting its ServiceAccount (its tokens stop
//! working) and the bindings labelled `shardplane.dev/node=<node>`.

use std::collections::BTreeMap;

use anyhow::{Context, bail};
use k8s_openapi::api::core::v1::ServiceAccount;
use k8s_openapi::api::rbac::v1::{ClusterRoleBinding, RoleBinding, Subject};
use kube::api::{Api, ListParams, Patch, PatchParams};
use kube::{Resource, ResourceExt};
use serde_json::json;
use shardplane_crds::identity::node_service_account;
use shardplane_crds::{FIELD_MANAGER, NODE_LABEL, node_label_value};

/// The RBAC of node agents that `up` applies (the Helm chart holds the same
/// rules; its test checks they agree): `NAMESPACE` and `ACCOUNT` are
/// replaced.
const AGENT_RBAC: &str = include_str!("agent_rbac.yaml");

fn labels(node: &str) -> BTreeMap<String, String> {
    BTreeMap::from([
        ("app.kubernetes.io/managed-by".into(), "shardplane".into()),
        (NODE_LABEL.into(), node_label_value(node)),
    ])
}

fn is_shared(subjects: Option<&Vec<Subject>>, namespace: &str, account: &str) -> bool {
    subjects.into_iter().flatten().any(|s| {
        s.kind == "ServiceAccount" && s.name == account && s.namespace.as_deref() == Some(namespace)
    })
}

fn binding_name(binding: &str, node_account: &str) -> anyhow::Result<String> {
    let name = format!("{binding}.{node_account}");
    if name.len() > 253 {
        bail!("the binding {name:?} would pass 253 characters: choose a shorter node name");
    }
    Ok(name)
}

/// Mints `node`'s identity in `namespace` beside the shared ServiceAccount
/// `shared`: its ServiceAccount and a copy of every binding of the shared
/// one. Idempotent. Returns the ServiceAccount's name.
pub async fn mint(
    client: &kube::Client,
    namespace: &str,
    shared: &str,
    node: &str,
) -> anyhow::Result<String> {
    let Some(account) = node_service_account(node) else {
        bail!(
            "{node:?} is not a node name (lowercase letters, digits, '-' and '.', 237 characters at most)"
        );
    };
    let apply = PatchParams::apply(FIELD_MANAGER).force();
    let accounts: Api<ServiceAccount> = Api::namespaced(client.clone(), namespace);
    accounts.get(shared).await.with_context(|| {
        format!("cannot read the agents' ServiceAccount {namespace}/{shared} (is the chart installed there?)")
    })?;
    let mut sa = ServiceAccount::default();
    sa.meta_mut().name = Some(account.clone());
    sa.meta_mut().namespace = Some(namespace.into());
    sa.meta_mut().labels = Some(labels(node));
    sa.automount_service_account_token = Some(false);
    let mut body = serde_json::to_value(&sa)?;
    body["apiVersion"] = json!("v1");
    body["kind"] = json!("ServiceAccount");
    accounts
        .patch(&account, &apply, &Patch::Apply(body))
        .await
        .with_context(|| format!("cannot create ServiceAccount {namespace}/{account}"))?;

    let subject = Subject {
        kind: "ServiceAccount".into(),
        name: account.clone(),
        namespace: Some(namespace.into()),
        api_group: None,
    };
    let mut copied = 0;
    let cluster_bindings: Api<ClusterRoleBinding> = Api::all(client.clone());
    for b in cluster_bindings.list(&ListParams::default()).await? {
        if !is_shared(b.subjects.as_ref(), namespace, shared) {
            continue;
        }
        let name = binding_name(&b.name_any(), &account)?;
        let copy = json!({
            "apiVersion": "rbac.authorization.k8s.io/v1",
            "kind": "ClusterRoleBinding",
            "metadata": { "name": name, "labels": labels(node) },
            "roleRef": b.role_ref,
            "subjects": [subject],
        });
        cluster_bindings
            .patch(&name, &apply, &Patch::Apply(copy))
            .await
            .with_context(|| format!("cannot create ClusterRoleBinding {name}"))?;
        copied += 1;
    }
    let bindings: Api<RoleBinding> = Api::all(client.clone());
    for b in bindings.list(&ListParams::default()).await? {
        if !is_shared(b.subjects.as_ref(), namespace, shared) {
            continue;
        }
        let ns = b.namespace().unwrap_or_default();
        let name = binding_name(&b.name_any(), &account)?;
        let copy = json!({
            "apiVersion": "rbac.authorization.k8s.io/v1",
            "kind": "RoleBinding",
            "metadata": { "name": name, "namespace": ns, "labels": labels(node) },
            "roleRef": b.role_ref,
            "subjects": [subject],
        });
        Api::<RoleBinding>::namespaced(client.clone(), &ns)
            .patch(&name, &apply, &Patch::Apply(copy))
            .await
            .with_context(|| format!("cannot create RoleBinding {ns}/{name}"))?;
        copied += 1;
    }
    if copied == 0 {
        bail!("ServiceAccount {namespace}/{shared} has no role bindings to copy");
    }
    Ok(account)
}

/// Applies the agents' shared ServiceAccount and its roles (what the Helm
/// chart installs), for a cluster without the chart (`up`).
pub async fn ensure_agent_rbac(
    client: &kube::Client,
    namespace: &str,
    account: &str,
) -> anyhow::Result<()> {
    let text = AGENT_RBAC
        .replace("NAMESPACE", namespace)
        .replace("ACCOUNT", account);
    let apply = PatchParams::apply(FIELD_MANAGER).force();
    let discovery = kube::Discovery::new(client.clone()).run().await?;
    for doc in text.split("\n---\n") {
        let value: serde_json::Value = serde_saphyr::from_str(doc)?;
        let object: kube::core::DynamicObject = serde_json::from_value(value.clone())?;
        let types = object.types.clone().context("a manifest without a kind")?;
        let gvk = kube::core::GroupVersionKind::try_from(&types)?;
        let (resource, _) = discovery
            .resolve_gvk(&gvk)
            .with_context(|| format!("the API server does not serve {}", types.kind))?;
        let api: Api<kube::core::DynamicObject> = match object.namespace() {
            Some(ns) => Api::namespaced_with(client.clone(), &ns, &resource),
            None => Api::all_with(client.clone(), &resource),
        };
        api.patch(&object.name_any(), &apply, &Patch::Apply(value))
            .await
            .with_context(|| format!("cannot apply {} {}", types.kind, object.name_any()))?;
    }
    Ok(())
}
