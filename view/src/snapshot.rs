//! The cluster as a person looks at it, made from its objects: the nodes
//! (with their links and the memory their shards hold) and each
//! deployment's instances and stages. Built purely from lists, so the same
//! objects always make the same snapshot; `shardplane status -o json` prints
//! it as is and the web view draws it.

use std::collections::BTreeMap;

use k8s_openapi::apimachinery::pkg::apis::meta::v1::Condition;
use kube::ResourceExt;
use serde::Serialize;
use shardplane_crds::quantity::parse_bytes;
use shardplane_crds::v1alpha1::{
    CONDITION_READY, InferenceNode, ModelDeployment, Shard, ShardPhase,
};
use shardplane_crds::{DEPLOYMENT_LABEL, INSTANCE_LABEL};

/// The cluster at one moment.
#[derive(Debug, Clone, Serialize, PartialEq)]
#[serde(rename_all = "camelCase")]
pub struct Snapshot {
    /// Every InferenceNode, by name.
    pub nodes: Vec<Node>,
    /// Every ModelDeployment, by namespace and name.
    pub deployments: Vec<Deployment>,
}

/// One machine.
#[derive(Debug, Clone, Serialize, PartialEq)]
#[serde(rename_all = "camelCase")]
pub struct Node {
    /// Its name.
    pub name: String,
    /// `Ready`, `NotReady` (with the condition's reason) or `Unknown`.
    pub ready: String,
    /// Cordoned: no new shards.
    pub unschedulable: bool,
    /// The chip, as the agent reported it.
    pub chip: Option<String>,
    /// The accelerator.
    pub accelerator: Option<String>,
    /// The engines its agent runs.
    pub engines: Vec<String>,
    /// Bytes the node's loaded shards hold.
    pub used_bytes: u64,
    /// Memory shards may use.
    pub allocatable_bytes: Option<u64>,
    /// Memory in all (a node), or the weights' size (a stage).
    pub total_bytes: Option<u64>,
    /// Models in its cache: key and bytes.
    pub cached_models: Vec<(String, u64)>,
    /// Its measured links.
    pub links: Vec<Link>,
}

/// A measured link from a node to a peer.
#[derive(Debug, Clone, Serialize, PartialEq)]
#[serde(rename_all = "camelCase")]
pub struct Link {
    /// The peer.
    pub to: String,
    /// How it was measured.
    pub kind: String,
    /// Round-trip latency, microseconds.
    pub latency_micros: u32,
    /// Bandwidth, megabits per second.
    pub bandwidth_mbps: Option<u32>,
}

/// A deployment and its instances.
#[derive(Debug, Clone, Serialize, PartialEq)]
#[serde(rename_all = "camelCase")]
pub struct Deployment {
    /// Its namespace.
    pub namespace: String,
    /// Its name.
    pub name: String,
    /// The Model it serves.
    pub model: String,
    /// Instances wanted (the spec's replicas).
    pub replicas: i32,
    /// Instances serving.
    pub ready_replicas: i32,
    /// Conditions that are not as they should be (`type: reason: message`).
    pub problems: Vec<String>,
    /// Every condition, as the operator wrote it.
    pub conditions: Vec<ConditionView>,
    /// Where clients send requests.
    pub endpoint: Option<String>,
    /// The names clients ask for it by: the served name, then the aliases.
    pub served_as: Vec<String>,
    /// Its instances by index.
    pub instances: Vec<Instance>,
    /// The gateway's traffic for it, when its metrics were read.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub traffic: Option<crate::traffic::Traffic>,
}

/// A condition of a deployment.
#[derive(Debug, Clone, Serialize, PartialEq)]
#[serde(rename_all = "camelCase")]
pub struct ConditionView {
    /// Its type.
    #[serde(rename = "type")]
    pub type_: String,
    /// `True`, `False` or `Unknown`.
    pub status: String,
    /// Why, in a word.
    pub reason: String,
    /// Why, for a person.
    pub message: String,
}

/// One instance: its stages in pipeline order.
#[derive(Debug, Clone, Serialize, PartialEq)]
#[serde(rename_all = "camelCase")]
pub struct Instance {
    /// Its index in the deployment.
    pub index: u32,
    /// Its stages in pipeline order.
    pub stages: Vec<Stage>,
}

/// One stage: a Shard.
#[derive(Debug, Clone, Serialize, PartialEq)]
#[serde(rename_all = "camelCase")]
pub struct Stage {
    /// The Shard's name.
    pub shard: String,
    /// The node it is bound to.
    pub node: String,
    /// Its layer range.
    pub layers: String,
    /// Its phase.
    pub phase: String,
    /// Why it is in that phase, in a word.
    pub reason: Option<String>,
    /// Why, for a person.
    pub message: Option<String>,
    /// Bytes of its weights fetched so far.
    pub downloaded_bytes: Option<u64>,
    /// Memory in all (a node), or the weights' size (a stage).
    pub total_bytes: Option<u64>,
    /// Download rate, bytes per second, from two refreshes (`--watch`).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub download_rate: Option<f64>,
    /// Times its agent restarted it.
    pub restarts: u32,
}

fn condition<'a>(conditions: &'a [Condition], kind: &str) -> Option<&'a Condition> {
    conditions.iter().find(|c| c.type_ == kind)
}

/// The snapshot of these objects (nodes by name, deployments by namespace
/// and name, instances by index, stages in order).
pub fn snapshot(
    nodes: &[InferenceNode],
    deployments: &[ModelDeployment],
    shards: &[Shard],
) -> Snapshot {
    let mut used: BTreeMap<&str, u64> = BTreeMap::new();
    for s in shards {
        if let Some(bytes) = s.status.as_ref().and_then(|st| st.memory_bytes) {
            *used.entry(s.spec.node.as_str()).or_default() += bytes;
        }
    }
    let mut nodes: Vec<Node> = nodes
        .iter()
        .map(|n| {
            let st = n.status.clone().unwrap_or_default();
            let ready = match condition(&st.conditions, CONDITION_READY) {
                Some(c) if c.status == "True" => "Ready".to_string(),
                Some(c) => format!("NotReady ({})", c.reason),
                None => "Unknown".to_string(),
            };
            let name = n.name_any();
            Node {
                ready,
                unschedulable: n.spec.unschedulable,
                chip: st.chip,
                accelerator: st.accelerator.map(|a| format!("{a:?}")),
                engines: st.engines.iter().map(|e| format!("{e:?}")).collect(),
                used_bytes: used.get(name.as_str()).copied().unwrap_or(0),
                allocatable_bytes: st
                    .memory
                    .as_ref()
                    .and_then(|m| parse_bytes(&m.allocatable).ok()),
                total_bytes: st.memory.as_ref().and_then(|m| parse_bytes(&m.total).ok()),
                cached_models: st
                    .cached_models
                    .iter()
                    .map(|c| (c.key.clone(), c.bytes))
                    .collect(),
                links: st
                    .links
                    .iter()
                    .map(|l| Link {
                        to: l.node.clone(),
                        kind: format!("{:?}", l.kind),
                        latency_micros: l.latency_micros,
                        bandwidth_mbps: l.bandwidth_mbps,
                    })
                    .collect(),
                name,
            }
        })
        .collect();
    nodes.sort_by(|a, b| a.name.cmp(&b.name));

    let mut deployments: Vec<Deployment> = deployments
        .iter()
        .map(|d| {
            let namespace = d.namespace().unwrap_or_default();
            let name = d.name_any();
            let st = d.status.clone().unwrap_or_default();
            // Shards of this deployment, by instance, in stage order.
            let mut instances: BTreeMap<u32, Vec<&Shard>> = BTreeMap::new();
            for s in shards.iter().filter(|s| {
                s.namespace().as_deref() == Some(namespace.as_str())
                    && s.labels().get(DEPLOYMENT_LABEL) == Some(&name)
            }) {
                let index = s
                    .labels()
                    .get(INSTANCE_LABEL)
                    .and_then(|i| i.parse().ok())
                    .unwrap_or(s.spec.instance);
                instances.entry(index).or_default().push(s);
            }
            let instances = instances
                .into_iter()
                .map(|(index, mut stages)| {
                    stages.sort_by_key(|s| s.spec.stage);
                    Instance {
                        index,
                        stages: stages.into_iter().map(stage).collect(),
                    }
                })
                .collect();
            // The endpoint's name (the first alias, or the Model's served
            // name when there is none) and every alias, once each.
            let mut served_as: Vec<String> = Vec::new();
            for name in st
                .endpoint
                .iter()
                .map(|e| &e.model)
                .chain(d.spec.aliases.iter())
            {
                if !served_as.contains(name) {
                    served_as.push(name.clone());
                }
            }
            Deployment {
                model: d.spec.model.clone(),
                replicas: d.spec.replicas,
                ready_replicas: st.ready_replicas,
                problems: problems(&st.conditions),
                conditions: st
                    .conditions
                    .iter()
                    .map(|c| ConditionView {
                        type_: c.type_.clone(),
                        status: c.status.clone(),
                        reason: c.reason.clone(),
                        message: c.message.clone(),
                    })
                    .collect(),
                endpoint: st
                    .endpoint
                    .map(|e| format!("{} (model {})", e.url, e.model)),
                served_as,
                instances,
                traffic: None,
                namespace,
                name,
            }
        })
        .collect();
    deployments.sort_by(|a, b| (&a.namespace, &a.name).cmp(&(&b.namespace, &b.name)));
    Snapshot { nodes, deployments }
}

fn stage(s: &Shard) -> Stage {
    let st = s.status.clone().unwrap_or_default();
    Stage {
        shard: s.name_any(),
        node: s.spec.node.clone(),
        layers: s.spec.layers.to_string(),
        phase: st.phase.unwrap_or(ShardPhase::Pending).to_string(),
        reason: st.reason,
        message: st.message,
        downloaded_bytes: st.downloaded_bytes,
        total_bytes: st.total_bytes,
        download_rate: None,
        restarts: st.restarts.unwrap_or(0),
    }
}

impl Snapshot {
    /// Gives each deployment its traffic between two readings of the
    /// gateways' metrics (the names it is served as, summed).
    pub fn with_traffic(
        &mut self,
        earlier: Option<&crate::traffic::Sample>,
        later: &crate::traffic::Sample,
    ) {
        for d in &mut self.deployments {
            d.traffic = crate::traffic::traffic(earlier, later, &d.served_as);
        }
    }

    /// Fills each downloading stage's rate from what `earlier` (taken
    /// `seconds` before) showed of the same Shard.
    pub fn rates_since(&mut self, earlier: &Snapshot, seconds: f64) {
        if seconds <= 0.0 {
            return;
        }
        let before: BTreeMap<(&str, &str), u64> = earlier
            .deployments
            .iter()
            .flat_map(|d| {
                d.instances.iter().flat_map(move |i| {
                    i.stages.iter().filter_map(move |s| {
                        Some((
                            (d.namespace.as_str(), s.shard.as_str()),
                            s.downloaded_bytes?,
                        ))
                    })
                })
            })
            .collect();
        for d in &mut self.deployments {
            for s in d.instances.iter_mut().flat_map(|i| i.stages.iter_mut()) {
                if let (Some(now), Some(then)) = (
                    s.downloaded_bytes,
                    before.get(&(d.namespace.as_str(), s.shard.as_str())),
                ) && now >= *then
                {
                    s.download_rate = Some((now - then) as f64 / seconds);
                }
            }
        }
    }
}

/// Conditions that say something is wrong: Ready or Placed not true,
/// Degraded or Conflicted true.
fn problems(conditions: &[Condition]) -> Vec<String> {
    conditions
        .iter()
        .filter(|c| match c.type_.as_str() {
            "Degraded" | "Conflicted" => c.status == "True",
            "Progressing" => false,
            _ => c.status != "True",
        })
        .map(|c| format!("{}: {}: {}", c.type_, c.reason, c.message))
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn condition(type_: &str, status: &str) -> Condition {
        Condition {
            type_: type_.into(),
            status: status.into(),
            reason: "R".into(),
            message: "m".into(),
            last_transition_time: k8s_openapi::apimachinery::pkg::apis::meta::v1::Time(
                k8s_openapi::jiff::Timestamp::UNIX_EPOCH,
            ),
            observed_generation: None,
        }
    }

    #[test]
    fn problems_are_conditions_in_their_bad_state() {
        let all = [
            condition("Ready", "True"),
            condition("Placed", "False"),
            condition("Progressing", "True"),
            condition("Degraded", "False"),
            condition("Conflicted", "False"),
        ];
        assert_eq!(problems(&all), ["Placed: R: m"]);
        let bad = [
            condition("Degraded", "True"),
            condition("Conflicted", "True"),
        ];
        assert_eq!(problems(&bad).len(), 2);
    }
}
