//! Plan: where the deployment's instances go and the Shards that puts them
//! there (pure: the placement crate on what was observed).

use std::collections::BTreeMap;

use kube::ResourceExt;
use kube::api::ObjectMeta;
use kube::core::Resource;
use sha2::{Digest, Sha256};
use shardplane_crds::*;
use shardplane_placement as placement;

use super::cluster_view::{self, TIER_LABEL, deployment_key};
use super::observe::Observed;
use super::validate::Valid;

/// Failures of one stage on one node (its agent's retries) after which the
/// stage is placed on another node when one can take it.
pub const MOVE_AFTER_FAILURES: u32 = 3;

/// What the deployment should look like.
pub struct Planned {
    /// Where each instance's stages run, and why any could not be placed.
    pub plan: placement::Plan,
    /// The Shards that make the plan (spec and labels; no status).
    pub desired: Vec<Shard>,
    /// Instances asked for.
    pub replicas: u32,
    /// Stages this plan moves off a node where they kept failing, in words.
    pub moved: Vec<String>,
    /// The Shards the plan no longer wants: deleted now or kept for now.
    pub retiring: Retiring,
}

/// The nodes where a Shard of this deployment has failed at least
/// [`MOVE_AFTER_FAILURES`] times and is Failed now, with what it said.
pub fn failing_nodes(mine: &[&Shard]) -> BTreeMap<String, String> {
    mine.iter()
        .filter_map(|s| {
            let st = s.status.as_ref()?;
            let failing = st.phase == Some(ShardPhase::Failed)
                && st.restarts.unwrap_or(0) >= MOVE_AFTER_FAILURES;
            failing.then(|| {
                let said = st
                    .last_failure
                    .clone()
                    .or_else(|| st.message.clone())
                    .unwrap_or_default();
                (
                    s.spec.node.clone(),
                    format!(
                        "instance {} stage {} failed {} times on {}: {said}",
                        s.spec.instance,
                        s.spec.stage,
                        st.restarts.unwrap_or(0),
                        s.spec.node
                    ),
                )
            })
        })
        .collect()
}

/// Places the deployment on its pool. Nodes where a stage keeps failing are
/// avoided when the deployment places as fully without them; otherwise the
/// stage stays where it is and its agent keeps retrying.
pub fn plan(d: &ModelDeployment, o: &Observed, v: &Valid<'_>) -> Planned {
    let ns = d.namespace().unwrap_or_default();
    let me = deployment_key(&ns, &d.name_any());
    let cluster = cluster_view::cluster(
        &me,
        v.pool,
        v.model,
        &v.footprint,
        &o.nodes,
        &o.shards,
        &o.models,
    );
    let mine = o.mine(d);
    let current = cluster_view::current_instances(&mine);
    let strategy = cluster_view::strategy(&v.strategy.spec);
    // Validation refuses more; the clamp keeps placement bounded regardless.
    let replicas = d
        .spec
        .replicas
        .clamp(0, shardplane_crds::limits::MAX_REPLICAS) as u32;
    let request = placement::Request {
        deployment: &me,
        tier: match v.pool.spec.tier {
            Tier::Daily => placement::Tier::Daily,
            Tier::Reasoning => placement::Tier::Reasoning,
        },
        replicas,
        footprint: &v.footprint,
        strategy: &strategy,
        current: &current,
    };
    let failing = failing_nodes(&mine);
    let mut moved = Vec::new();
    // `placement::plan` takes what it places out of the view it is given:
    // keep a copy only when a second plan, avoiding failing nodes, needs one.
    let (mut plan, avoiding) = if failing.is_empty() {
        let mut cluster = cluster;
        (placement::plan(&mut cluster, &request), None)
    } else {
        (
            placement::plan(&mut cluster.clone(), &request),
            Some(cluster),
        )
    };
    if let Some(mut avoiding) = avoiding {
        for node in failing.keys() {
            if let Some(n) = avoiding.nodes.get_mut(node) {
                n.schedulable = false;
            }
        }
        let elsewhere = placement::plan(&mut avoiding, &request);
        if elsewhere.instances.len() >= plan.instances.len() {
            let used: std::collections::BTreeSet<&str> = elsewhere
                .instances
                .iter()
                .flat_map(|i| i.stages.iter().map(|s| s.node.as_str()))
                .collect();
            moved = failing
                .iter()
                .filter(|(node, _)| !used.contains(node.as_str()))
                .map(|(_, why)| format!("{why}; placed elsewhere"))
                .collect();
            plan = elsewhere;
        }
    }
    let desired = desired_shards(d, v, &plan);
    let retiring = retiring(&mine, &desired, replicas);
    Planned {
        plan,
        desired,
        replicas,
        moved,
        retiring,
    }
}

/// What becomes of the Shards the plan no longer wants.
#[derive(Debug, Default, PartialEq, Eq)]
pub struct Retiring {
    /// Deleted now.
    pub delete: Vec<String>,
    /// Kept for now, each with why (in words).
    pub keep: Vec<(String, String)>,
}

/// Which of `mine` that `desired` leaves out are deleted now. Nothing that
/// may still serve is deleted before something replaces it: a Shard that is
/// Ready (or Unknown: its node went quiet, and may come back) stays until
/// every Shard of its instance's new placement is Ready, or for good while
/// its instance cannot be placed at all. It goes at once when its instance
/// is scaled away, when it serves nothing (Pending, loading, Failed), or
/// when the new placement uses its node (whose memory it would hold twice).
pub fn retiring(mine: &[&Shard], desired: &[Shard], replicas: u32) -> Retiring {
    let phase = |name: &str| {
        mine.iter()
            .find(|s| s.metadata.name.as_deref() == Some(name))
            .and_then(|s| s.status.as_ref()?.phase)
    };
    let wanted: std::collections::BTreeSet<&str> = desired
        .iter()
        .filter_map(|s| s.metadata.name.as_deref())
        .collect();
    let mut out = Retiring::default();
    for s in mine {
        let name = s.name_any();
        if wanted.contains(name.as_str()) || s.metadata.deletion_timestamp.is_some() {
            continue;
        }
        let serving = matches!(
            s.status.as_ref().and_then(|st| st.phase),
            Some(ShardPhase::Ready | ShardPhase::Unknown)
        );
        let replacement: Vec<&Shard> = desired
            .iter()
            .filter(|d| d.spec.instance == s.spec.instance)
            .collect();
        let goes_now = s.spec.instance >= replicas
            || !serving
            || desired.iter().any(|d| d.spec.node == s.spec.node);
        let keep = if goes_now {
            None
        } else if replacement.is_empty() {
            Some(format!(
                "{name} on {} is kept: instance {} cannot be placed elsewhere",
                s.spec.node, s.spec.instance
            ))
        } else if replacement
            .iter()
            .all(|d| phase(&d.name_any()) == Some(ShardPhase::Ready))
        {
            None
        } else {
            Some(format!(
                "{name} on {} is kept until instance {}'s new placement is Ready",
                s.spec.node, s.spec.instance
            ))
        };
        match keep {
            Some(why) => out.keep.push((name, why)),
            None => out.delete.push(name),
        }
    }
    out
}

/// A Shard's name: deployment, instance, stage and a hash of where it runs,
/// so a stage moved to another node is a new Shard (as a moved Pod is a new
/// Pod). The hash is the first four bytes of the SHA-256 of
/// `<node>/<first layer>/<end layer>` (followed by `/tensor <rank> of
/// <ranks>` for a rank of a tensor group), in hex: fixed by this
/// definition, so names survive upgrades of the operator and of Rust.
pub fn shard_name(deployment: &str, instance: u32, stage: usize, s: &placement::Stage) -> String {
    let mut hashed = format!("{}/{}/{}", s.node, s.layers.start, s.layers.end);
    if let Some(t) = &s.tensor {
        hashed.push_str(&format!("/tensor {} of {}", t.rank, t.weights.len()));
    }
    let digest = Sha256::digest(hashed);
    let hash: String = digest[..4].iter().map(|b| format!("{b:02x}")).collect();
    format!("{deployment}-{instance}-{stage}-{hash}")
}

/// Every entry of `instance` with its pipeline stage's index and its Shard's
/// name, in order.
pub fn named_stages<'i>(
    deployment: &str,
    instance: &'i placement::Instance,
) -> Vec<Vec<(&'i placement::Stage, String)>> {
    instance
        .pipeline()
        .into_iter()
        .enumerate()
        .map(|(i, group)| {
            group
                .iter()
                .map(|s| (s, shard_name(deployment, instance.index, i, s)))
                .collect()
        })
        .collect()
}

fn desired_shards(d: &ModelDeployment, v: &Valid<'_>, plan: &placement::Plan) -> Vec<Shard> {
    let name = d.name_any();
    let owner = d.controller_owner_ref(&()).into_iter().collect::<Vec<_>>();
    let mut out = Vec::new();
    for inst in &plan.instances {
        let stages = named_stages(&name, inst);
        // The stages before and after name each other's leaders (rank 0).
        let leader = |i: usize| stages.get(i).map(|g| g[0].1.clone());
        for (i, group) in stages.iter().enumerate() {
            let names: Vec<String> = group.iter().map(|(_, n)| n.clone()).collect();
            for (s, shard) in group {
                let labels = BTreeMap::from([
                    (NODE_LABEL.to_string(), node_label_value(&s.node)),
                    (DEPLOYMENT_LABEL.to_string(), name.clone()),
                    (INSTANCE_LABEL.to_string(), inst.index.to_string()),
                    (TIER_LABEL.to_string(), v.pool.spec.tier.to_string()),
                ]);
                let leads = s.tensor.as_ref().is_none_or(|t| t.rank == 0);
                out.push(Shard {
                    metadata: ObjectMeta {
                        name: Some(shard.clone()),
                        namespace: d.namespace(),
                        labels: Some(labels),
                        owner_references: Some(owner.clone()),
                        ..Default::default()
                    },
                    spec: ShardSpec {
                        deployment: name.clone(),
                        model: v.model.name_any(),
                        source: v.model.pinned_source(),
                        format: v.model.spec.format,
                        node: s.node.clone(),
                        instance: inst.index,
                        stage: i as u32,
                        stage_count: stages.len() as u32,
                        layers: LayerRange {
                            start: s.layers.start,
                            end: s.layers.end,
                        },
                        total_layers: v.footprint.layers(),
                        kv_cache: v.strategy.spec.kv_cache,
                        next: leader(i + 1),
                        previous: i.checked_sub(1).and_then(leader),
                        chat_template: (i == 0 && leads)
                            .then(|| v.model.spec.chat_template.clone())
                            .flatten(),
                        tensor: s.tensor.as_ref().map(|t| TensorRankSpec {
                            rank: t.rank,
                            weights: t.weights.clone(),
                            group: names.clone(),
                        }),
                    },
                    status: None,
                });
            }
        }
    }
    out
}

/// The plan in a line a person reads in an event or a condition.
pub fn describe(plan: &placement::Plan) -> String {
    plan.instances
        .iter()
        .map(|i| {
            let stages: Vec<String> = i
                .pipeline()
                .iter()
                .map(|group| {
                    let nodes: Vec<&str> = group.iter().map(|s| s.node.as_str()).collect();
                    let layers = &group[0].layers;
                    format!("{}[{}-{})", nodes.join("+"), layers.start, layers.end)
                })
                .collect();
            format!("instance {}: {}", i.index, stages.join(" -> "))
        })
        .collect::<Vec<_>>()
        .join("; ")
}

#[cfg(test)]
mod tests {
    use super::*;

    fn shard(node: &str, phase: ShardPhase, restarts: u32) -> Shard {
        let layers = LayerRange { start: 0, end: 30 };
        let mut s = shardplane_testkit::fixtures::shard("chat", node, 0, 1, layers);
        s.status = Some(ShardStatus {
            phase: Some(phase),
            restarts: Some(restarts),
            last_failure: Some("load: out of memory".into()),
            ..Default::default()
        });
        s
    }

    #[test]
    fn only_a_stage_failed_often_enough_marks_its_node() {
        let (often, twice, healed) = (
            shard("a", ShardPhase::Failed, MOVE_AFTER_FAILURES),
            shard("b", ShardPhase::Failed, MOVE_AFTER_FAILURES - 1),
            shard("c", ShardPhase::Loading, MOVE_AFTER_FAILURES + 2),
        );
        let nodes = failing_nodes(&[&often, &twice, &healed]);
        assert_eq!(nodes.keys().collect::<Vec<_>>(), ["a"]);
        assert_eq!(
            nodes["a"],
            "instance 0 stage 0 failed 3 times on a: load: out of memory"
        );
    }

    /// Shard `name` of instance `instance` on `node`, in `phase`.
    fn placed(name: &str, instance: u32, node: &str, phase: Option<ShardPhase>) -> Shard {
        let layers = LayerRange { start: 0, end: 30 };
        let mut s = shardplane_testkit::fixtures::shard("chat", node, 0, 1, layers);
        s.metadata.name = Some(name.into());
        s.spec.instance = instance;
        s.status = phase.map(|p| ShardStatus {
            phase: Some(p),
            ..Default::default()
        });
        s
    }

    #[test]
    fn a_serving_shard_stays_until_its_replacement_is_ready() {
        use ShardPhase::*;
        let old = placed("old", 0, "lost", Some(Unknown));
        let other = placed("other", 1, "b", Some(Ready));
        let new_loading = placed("new", 0, "spare", Some(Loading));
        let desired = vec![new_loading.clone(), other.clone()];
        let r = retiring(&[&old, &other, &new_loading], &desired, 2);
        assert!(r.delete.is_empty());
        assert_eq!(r.keep.len(), 1);
        assert_eq!(
            r.keep[0].1,
            "old on lost is kept until instance 0's new placement is Ready"
        );
        // The replacement is Ready: the old one goes.
        let new_ready = placed("new", 0, "spare", Some(Ready));
        let r = retiring(&[&old, &other, &new_ready], &desired, 2);
        assert_eq!((r.delete, r.keep), (vec!["old".to_string()], vec![]));
        // Nowhere to place the instance: kept for good.
        let r = retiring(&[&old, &other], std::slice::from_ref(&other), 2);
        assert_eq!(r.keep.len(), 1);
        assert!(r.keep[0].1.contains("cannot be placed elsewhere"));
    }

    #[test]
    fn what_serves_nothing_or_is_scaled_away_goes_at_once() {
        use ShardPhase::*;
        let new = placed("new", 0, "spare", Some(Loading));
        for old in [
            placed("old", 0, "a", Some(Failed)),
            placed("old", 0, "a", Some(Loading)),
            placed("old", 0, "a", None),
        ] {
            let r = retiring(&[&old, &new], std::slice::from_ref(&new), 1);
            assert_eq!(r.delete, ["old"], "{:?}", old.status);
        }
        // Scaled from two to one.
        let second = placed("second", 1, "b", Some(Ready));
        let r = retiring(&[&second, &new], std::slice::from_ref(&new), 1);
        assert_eq!(r.delete, ["second"]);
        // The new placement uses the old one's node (a new layer range there).
        let here = placed("here", 0, "a", Some(Loading));
        let old = placed("old", 0, "a", Some(Ready));
        let r = retiring(&[&old, &here], std::slice::from_ref(&here), 1);
        assert_eq!(r.delete, ["old"]);
        // One already being deleted is left alone.
        let mut going = placed("going", 0, "c", Some(Ready));
        going.metadata.deletion_timestamp =
            Some(k8s_openapi::apimachinery::pkg::apis::meta::v1::Time(
                k8s_openapi::jiff::Timestamp::UNIX_EPOCH,
            ));
        assert_eq!(
            retiring(&[&going, &new], std::slice::from_ref(&new), 1),
            Retiring::default()
        );
    }

    #[test]
    fn shard_names_are_pinned() {
        let stage = |node: &str, layers: std::ops::Range<u32>| placement::Stage::new(node, layers);
        // Fixed by the definition (checked against `sha256sum` of
        // "node-0/0/30" and "studio-3/40/80"): a change here renames every
        // Shard of every cluster on upgrade.
        assert_eq!(
            shard_name("chat", 0, 0, &stage("node-0", 0..30)),
            "chat-0-0-68a4cf76"
        );
        assert_eq!(
            shard_name("big", 1, 2, &stage("studio-3", 40..80)),
            "big-1-2-f759ce16"
        );
        assert_ne!(
            shard_name("chat", 0, 0, &stage("node-1", 0..30)),
            shard_name("chat", 0, 0, &stage("node-0", 0..30))
        );
    }
}
