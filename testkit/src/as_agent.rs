//! Doing through the API what an agent does, for tests of the operator alone:
//! registering a node with memory in its status, and renewing its Lease.

use k8s_openapi::api::coordination::v1::{Lease, LeaseSpec};
use k8s_openapi::api::core::v1::Namespace;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::MicroTime;
use k8s_openapi::jiff::Timestamp;
use kube::api::{ObjectMeta, Patch, PatchParams, PostParams};
use kube::{Api, Client};
use serde_json::json;
use shardplane_crds::{AGENT_MANAGER, InferenceNode, NODE_LEASE_NAMESPACE};

/// Creates InferenceNode `name` with `labels`, reports `allocatable` memory
/// in its status and takes a Lease of an hour.
pub async fn register_node(
    client: &Client,
    name: &str,
    labels: &[(&str, &str)],
    allocatable: &str,
) {
    let nodes: Api<InferenceNode> = Api::all(client.clone());
    let mut node = crate::fixtures::inference_node(name);
    node.metadata.labels = Some(
        labels
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect(),
    );
    nodes
        .create(&PostParams::default(), &node)
        .await
        .expect("the node registers");
    let status = json!({"apiVersion": "shardplane.dev/v1alpha1", "kind": "InferenceNode", "status": {
        "memory": {"total": "64Gi", "allocatable": allocatable, "available": allocatable},
        "engines": ["candle"],
    }});
    nodes
        .patch_status(
            name,
            &PatchParams::apply(AGENT_MANAGER),
            &Patch::Apply(&status),
        )
        .await
        .expect("the node reports its status");
    renew_lease(client, name, 3600).await;
}

/// Renews node `name`'s Lease for `seconds`, as its agent does every few seconds.
pub async fn renew_lease(client: &Client, name: &str, seconds: i32) {
    let ns = Namespace {
        metadata: ObjectMeta {
            name: Some(NODE_LEASE_NAMESPACE.into()),
            ..Default::default()
        },
        ..Default::default()
    };
    match Api::<Namespace>::all(client.clone())
        .create(&PostParams::default(), &ns)
        .await
    {
        Ok(_) => {}
        Err(kube::Error::Api(e)) if e.code == 409 => {}
        Err(e) => panic!("cannot create namespace {NODE_LEASE_NAMESPACE}: {e}"),
    }
    let lease = Lease {
        metadata: ObjectMeta {
            name: Some(name.to_string()),
            ..Default::default()
        },
        spec: Some(LeaseSpec {
            holder_identity: Some(name.to_string()),
            lease_duration_seconds: Some(seconds),
            renew_time: Some(MicroTime(Timestamp::now())),
            ..Default::default()
        }),
    };
    Api::<Lease>::namespaced(client.clone(), NODE_LEASE_NAMESPACE)
        .patch(
            name,
            &PatchParams::apply(AGENT_MANAGER).force(),
            &Patch::Apply(&lease),
        )
        .await
        .expect("the Lease is renewed");
}
