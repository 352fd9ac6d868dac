//! Registration and heartbeat: the InferenceNode this machine is, kept fresh,
//! and a Lease renewed every few seconds (as kubelet does with its node Lease).

use std::collections::BTreeMap;
use std::time::Duration;

use k8s_openapi::api::coordination::v1::{Lease, LeaseSpec};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::MicroTime;
use k8s_openapi::jiff::Timestamp;
use kube::api::{DeleteParams, ObjectMeta, Patch, PatchParams, PostParams};
use kube::{Api, Client};
use serde_json::json;
use shardplane_crds::quantity::format_bytes;
use shardplane_crds::{
    AGENT_MANAGER, CachedModel, Engine, InferenceNode, InferenceNodeSpec, NODE_LEASE_NAMESPACE,
    NodeMemory,
};

use crate::machine::Machine;
use crate::metrics::Metrics;

/// Who this node is and how it registers.
#[derive(Debug, Clone)]
pub struct Registration {
    /// The InferenceNode's name.
    pub node: String,
    /// Labels put on the InferenceNode when it is created (pool membership).
    pub labels: BTreeMap<String, String>,
    /// Memory kept back from shards.
    pub memory_reserve: u64,
    /// How long the Lease holds.
    pub lease_duration: Duration,
    /// The data plane's advertised endpoint (set once it listens).
    pub data_plane_endpoint: Option<String>,
    /// The engines this agent runs, the one its stages load into first (set
    /// from the agent's engine when it starts).
    pub engines: Vec<Engine>,
    /// Prompt tokens a step of its stages takes at most (set from the
    /// agent's scheduler budget when it starts).
    pub prompt_step: Option<u32>,
}

impl Registration {
    /// Creates the InferenceNode if it is missing (a person's labels and
    /// cordon on an existing one are left alone).
    pub async fn ensure_node(&self, client: &Client) -> kube::Result<()> {
        let api: Api<InferenceNode> = Api::all(client.clone());
        if api.get_opt(&self.node).await?.is_none() {
            let node = InferenceNode {
                metadata: ObjectMeta {
                    name: Some(self.node.clone()),
                    labels: Some(self.labels.clone()),
                    ..Default::default()
                },
                spec: InferenceNodeSpec::default(),
                status: None,
            };
            match api.create(&PostParams::default(), &node).await {
                Ok(_) => {}
                Err(kube::Error::Api(e)) if e.code == 409 => {}
                Err(e) => return Err(e),
            }
        }
        Ok(())
    }

    /// Writes the machine's facts into the InferenceNode's status (conditions
    /// are the operator's).
    pub async fn report(
        &self,
        client: &Client,
        machine: &Machine,
        draining: bool,
        cached: &[CachedModel],
        metrics: &Metrics,
    ) -> kube::Result<()> {
        // On a Mac, what Metal may wire, not all of RAM.
        let allocatable = machine.memory_usable.saturating_sub(self.memory_reserve);
        metrics
            .memory_bytes
            .with_label_values(&["total"])
            .set(machine.memory_total as i64);
        metrics
            .memory_bytes
            .with_label_values(&["available"])
            .set(machine.memory_available as i64);
        metrics
            .memory_bytes
            .with_label_values(&["allocatable"])
            .set(allocatable as i64);
        let status = json!({
            "chip": machine.chip,
            "cpuCores": machine.cores,
            "os": std::env::consts::OS,
            "arch": std::env::consts::ARCH,
            "memory": NodeMemory {
                total: format_bytes(machine.memory_total),
                allocatable: format_bytes(allocatable),
                available: format_bytes(machine.memory_available),
            },
            "accelerator": machine.accelerator,
            "engines": self.engines,
            "addresses": machine.addresses,
            "draining": draining,
            "dataPlaneEndpoint": self.data_plane_endpoint,
            "cachedModels": cached,
            "agentVersion": env!("CARGO_PKG_VERSION"),
            "promptStepTokens": self.prompt_step,
        });
        let api = Api::<InferenceNode>::all(client.clone());
        shardplane_cluster::apply_status(&api, &self.node, AGENT_MANAGER, &status).await
    }

    /// Renews (or creates) the node's Lease.
    pub async fn renew(&self, client: &Client) -> kube::Result<()> {
        let lease = Lease {
            metadata: ObjectMeta {
                name: Some(self.node.clone()),
                ..Default::default()
            },
            spec: Some(LeaseSpec {
                holder_identity: Some(self.node.clone()),
                lease_duration_seconds: Some(self.lease_duration.as_secs() as i32),
                renew_time: Some(MicroTime(Timestamp::now())),
                ..Default::default()
            }),
        };
        Api::<Lease>::namespaced(client.clone(), NODE_LEASE_NAMESPACE)
            .patch(
                &self.node,
                &PatchParams::apply(AGENT_MANAGER).force(),
                &Patch::Apply(&lease),
            )
            .await?;
        Ok(())
    }

    /// Gives the Lease up, so the operator sees the node go at once.
    pub async fn release(&self, client: &Client) -> kube::Result<()> {
        match Api::<Lease>::namespaced(client.clone(), NODE_LEASE_NAMESPACE)
            .delete(&self.node, &DeleteParams::default())
            .await
        {
            Ok(_) => Ok(()),
            Err(kube::Error::Api(e)) if e.code == 404 => Ok(()),
            Err(e) => Err(e),
        }
    }
}
