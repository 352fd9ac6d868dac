//! What the webhook decides, as a pure function of one AdmissionRequest.
//!
//! ```text
//!  request ──► user is a node identity? ──► node_may: only its own InferenceNode,
//!     │                                      Lease, Shard status, path-Model status
//!     └──────► a shardplane spec created or changed? ──► validate(): field and reason
//! ```
//!
//! A node identity (`identity::node_of_user`) may, beyond what RBAC lets it:
//! - create and update the InferenceNode named after it (and its status);
//! - create, update and delete the Lease named after it in the node-lease
//!   namespace;
//! - update the status of Shards bound to it (before and after the change);
//! - update the status of a Model whose source is a `path` (the metadata of
//!   a file an agent holds), as its reporter (`status.reportedBy` names it
//!   after the change, and named it or no one before).
//!
//! Everything else it asks for is refused (403) naming what it may do.
//!
//! Every user's new or changed spec of a Model, NodePool, ShardingStrategy or
//! ModelDeployment runs the same `validate()` rules the operator applies
//! (422 with every field and reason). Updates that leave the spec as it was
//! (metadata, finalizers, status) and objects being deleted pass, so an
//! object made invalid before the webhook existed can still be deleted.

use kube::core::admission::{AdmissionRequest, AdmissionResponse, Operation};
use kube::core::{DynamicObject, Status};
use serde::de::DeserializeOwned;
use shardplane_crds::identity::node_of_user;
use shardplane_crds::validation::Validate;
use shardplane_crds::{
    GROUP, Model, ModelDeployment, NODE_LEASE_NAMESPACE, NodePool, ShardingStrategy,
};

/// Why a request is refused.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Refusal {
    /// The HTTP status the API server answers with.
    pub code: u16,
    /// The Kubernetes reason (`Forbidden`, `Invalid`).
    pub reason: &'static str,
    /// What the client is told.
    pub message: String,
}

impl Refusal {
    fn forbidden(message: String) -> Self {
        Self {
            code: 403,
            reason: "Forbidden",
            message,
        }
    }
}

/// The response to `request`.
pub fn review(request: &AdmissionRequest<DynamicObject>) -> AdmissionResponse {
    respond(request, verdict(request))
}

/// The response to `request` for `outcome`.
pub fn respond(
    request: &AdmissionRequest<DynamicObject>,
    outcome: Result<(), Refusal>,
) -> AdmissionResponse {
    let mut response = AdmissionResponse::from(request);
    if let Err(refusal) = outcome {
        response.allowed = false;
        response.result = Status::failure(&refusal.message, refusal.reason).with_code(refusal.code);
    }
    response
}

/// Allowed, or why not.
pub fn verdict(request: &AdmissionRequest<DynamicObject>) -> Result<(), Refusal> {
    let user = request.user_info.username.as_deref().unwrap_or_default();
    if let Some(node) = node_of_user(user) {
        node_may(node, request)?;
    }
    valid_spec(request)
}

/// The object's name: the request's, else the new object's.
fn name_of(request: &AdmissionRequest<DynamicObject>) -> &str {
    if !request.name.is_empty() {
        return &request.name;
    }
    request
        .object
        .as_ref()
        .and_then(|o| o.metadata.name.as_deref())
        .unwrap_or_default()
}

fn operation(op: &Operation) -> &'static str {
    match op {
        Operation::Create => "create",
        Operation::Update => "update",
        Operation::Delete => "delete",
        Operation::Connect => "connect",
    }
}

/// `spec.<field>` of an object, as text.
fn spec_text<'a>(object: Option<&'a DynamicObject>, field: &str) -> Option<&'a str> {
    object?.data.get("spec")?.get(field)?.as_str()
}

fn node_may(node: &str, request: &AdmissionRequest<DynamicObject>) -> Result<(), Refusal> {
    let resource = &request.resource;
    let sub = request.sub_resource.as_deref();
    let name = name_of(request);
    let op = &request.operation;
    let what = match sub {
        Some(s) => format!("{}/{s}", resource.resource),
        None => resource.resource.clone(),
    };
    let refuse = |why: String| {
        Err(Refusal::forbidden(format!(
            "node {node:?} may not {} {what} {name:?}: {why}",
            operation(op)
        )))
    };
    match (resource.group.as_str(), resource.resource.as_str(), sub) {
        ("coordination.k8s.io", "leases", None) => {
            let ns = request.namespace.as_deref().unwrap_or_default();
            if ns != NODE_LEASE_NAMESPACE {
                return refuse(format!("a node's Lease lives in {NODE_LEASE_NAMESPACE}"));
            }
            if name != node {
                return refuse(format!("a node renews only its own Lease, {node:?}"));
            }
            Ok(())
        }
        (GROUP, "inferencenodes", None | Some("status")) => {
            if matches!(op, Operation::Delete) {
                return refuse("nodes are deleted by their administrators".into());
            }
            if name != node {
                return refuse(format!(
                    "a node writes only its own InferenceNode, {node:?}"
                ));
            }
            Ok(())
        }
        (GROUP, "shards", Some("status")) if matches!(op, Operation::Update) => {
            let before = spec_text(request.old_object.as_ref(), "node");
            let after = spec_text(request.object.as_ref(), "node");
            if before != Some(node) || after != Some(node) {
                return refuse(format!(
                    "the Shard is bound to {:?}; a node reports only Shards bound to it",
                    before.unwrap_or("no node")
                ));
            }
            Ok(())
        }
        (GROUP, "models", Some("status")) if matches!(op, Operation::Update) => {
            let from_path = |o: Option<&DynamicObject>| {
                o.and_then(|o| o.data.get("spec")?.get("source")?.get("path"))
                    .is_some()
            };
            if !from_path(request.old_object.as_ref()) || !from_path(request.object.as_ref()) {
                return refuse(
                    "a node reports only the metadata of a Model whose source is a path it holds"
                        .into(),
                );
            }
            let reporter = |o: Option<&DynamicObject>| {
                o.and_then(|o| o.data.get("status")?.get("reportedBy")?.as_str())
                    .map(String::from)
            };
            if let Some(other) = reporter(request.old_object.as_ref()).filter(|r| r != node) {
                return refuse(format!(
                    "node {other:?} reports this Model's metadata; another node takes over only \
                     once {other:?}'s InferenceNode is deleted (the operator then clears \
                     status.reportedBy)"
                ));
            }
            if reporter(request.object.as_ref()).as_deref() != Some(node) {
                return refuse(format!(
                    "a node reports a Model's metadata as itself: status.reportedBy {node:?}"
                ));
            }
            Ok(())
        }
        _ => refuse(
            "a node writes only its own InferenceNode and Lease and the status of the Shards \
             bound to it"
                .into(),
        ),
    }
}

/// Runs `validate()` on a new or changed spec of a kind that has rules.
fn valid_spec(request: &AdmissionRequest<DynamicObject>) -> Result<(), Refusal> {
    if request.resource.group != GROUP || request.sub_resource.is_some() {
        return Ok(());
    }
    let Some(object) = &request.object else {
        return Ok(());
    };
    match request.operation {
        Operation::Create => {}
        Operation::Update => {
            let old_spec = request.old_object.as_ref().and_then(|o| o.data.get("spec"));
            if object.metadata.deletion_timestamp.is_some() || old_spec == object.data.get("spec") {
                return Ok(());
            }
        }
        Operation::Delete | Operation::Connect => return Ok(()),
    }
    match request.kind.kind.as_str() {
        "Model" => check::<Model>(request, object),
        "NodePool" => check::<NodePool>(request, object),
        "ShardingStrategy" => check::<ShardingStrategy>(request, object),
        "ModelDeployment" => check::<ModelDeployment>(request, object),
        _ => Ok(()),
    }
}

fn check<K: DeserializeOwned + Validate>(
    request: &AdmissionRequest<DynamicObject>,
    object: &DynamicObject,
) -> Result<(), Refusal> {
    let invalid = |detail: String| Refusal {
        code: 422,
        reason: "Invalid",
        message: format!(
            "{}.{} {:?} is invalid: {detail}",
            request.kind.kind,
            GROUP,
            name_of(request)
        ),
    };
    let value = serde_json::to_value(object).map_err(|e| invalid(e.to_string()))?;
    let typed: K = serde_json::from_value(value).map_err(|e| invalid(e.to_string()))?;
    typed.validate().map_err(|e| invalid(e.to_string()))
}

#[cfg(test)]
mod tests {
    use super::*;
    use kube::core::admission::AdmissionReview;
    use serde_json::{Value, json};

    const NODE_A: &str = "system:serviceaccount:shardplane:shardplane-node-a";
    const ADMIN: &str = "admin";

    /// A request as the API server sends it.
    #[allow(clippy::too_many_arguments)]
    fn request(
        user: &str,
        operation: &str,
        (group, resource, sub): (&str, &str, Option<&str>),
        kind: &str,
        namespace: Option<&str>,
        name: &str,
        object: Value,
        old: Value,
    ) -> AdmissionRequest<DynamicObject> {
        let review = json!({
            "apiVersion": "admission.k8s.io/v1",
            "kind": "AdmissionReview",
            "request": {
                "uid": "u1",
                "kind": { "group": group, "version": "v1alpha1", "kind": kind },
                "resource": { "group": group, "version": "v1alpha1", "resource": resource },
                "subResource": sub,
                "name": name,
                "namespace": namespace,
                "operation": operation,
                "userInfo": { "username": user },
                "object": object,
                "oldObject": old,
                "dryRun": false,
            }
        });
        let review: AdmissionReview<DynamicObject> = serde_json::from_value(review).unwrap();
        review.try_into().unwrap()
    }

    fn object(kind: &str, name: &str, spec: Value) -> Value {
        json!({
            "apiVersion": "shardplane.dev/v1alpha1",
            "kind": kind,
            "metadata": { "name": name, "namespace": "default" },
            "spec": spec,
        })
    }

    fn shard(node: &str) -> Value {
        object("Shard", "s", json!({ "node": node }))
    }

    fn lease(user: &str, namespace: &str, name: &str, op: &str) -> Result<(), Refusal> {
        let obj = json!({ "apiVersion": "coordination.k8s.io/v1", "kind": "Lease", "metadata": { "name": name, "namespace": namespace } });
        verdict(&request(
            user,
            op,
            ("coordination.k8s.io", "leases", None),
            "Lease",
            Some(namespace),
            name,
            if op == "DELETE" {
                Value::Null
            } else {
                obj.clone()
            },
            obj,
        ))
    }

    #[test]
    fn a_node_renews_only_its_own_lease() {
        for op in ["CREATE", "UPDATE", "DELETE"] {
            assert_eq!(lease(NODE_A, NODE_LEASE_NAMESPACE, "a", op), Ok(()));
            let refused = lease(NODE_A, NODE_LEASE_NAMESPACE, "b", op).unwrap_err();
            assert_eq!(refused.code, 403);
            assert!(
                refused.message.contains("only its own Lease"),
                "{refused:?}"
            );
            assert!(lease(NODE_A, "default", "a", op).is_err());
            assert_eq!(lease(ADMIN, NODE_LEASE_NAMESPACE, "b", op), Ok(()));
        }
    }

    #[test]
    fn a_node_writes_only_its_own_inference_node() {
        let node = |name: &str| object("InferenceNode", name, json!({}));
        for (user, name, sub, op, allowed) in [
            (NODE_A, "a", None, "CREATE", true),
            (NODE_A, "a", Some("status"), "UPDATE", true),
            (NODE_A, "b", Some("status"), "UPDATE", false),
            (NODE_A, "b", None, "CREATE", false),
            (ADMIN, "b", Some("status"), "UPDATE", true),
        ] {
            let r = request(
                user,
                op,
                (GROUP, "inferencenodes", sub),
                "InferenceNode",
                None,
                name,
                node(name),
                node(name),
            );
            assert_eq!(verdict(&r).is_ok(), allowed, "{user} {op} {name} {sub:?}");
        }
    }

    #[test]
    fn a_node_reports_only_shards_bound_to_it() {
        let status = (GROUP, "shards", Some("status"));
        let r = |user: &str, new: &str, old: &str| {
            verdict(&request(
                user,
                "UPDATE",
                status,
                "Shard",
                Some("default"),
                "s",
                shard(new),
                shard(old),
            ))
        };
        assert_eq!(r(NODE_A, "a", "a"), Ok(()));
        let refused = r(NODE_A, "b", "b").unwrap_err();
        assert!(refused.message.contains("bound to \"b\""), "{refused:?}");
        assert!(r(NODE_A, "a", "b").is_err(), "taking another node's Shard");
        assert!(
            r(NODE_A, "b", "a").is_err(),
            "handing a Shard to another node"
        );
        assert_eq!(r(ADMIN, "b", "b"), Ok(()));
        // Never the spec, nor a new Shard.
        let spec = verdict(&request(
            NODE_A,
            "UPDATE",
            (GROUP, "shards", None),
            "Shard",
            Some("default"),
            "s",
            shard("a"),
            shard("a"),
        ));
        assert!(spec.is_err());
        let create = verdict(&request(
            NODE_A,
            "CREATE",
            (GROUP, "shards", None),
            "Shard",
            Some("default"),
            "s",
            shard("a"),
            Value::Null,
        ));
        assert!(create.is_err());
    }

    #[test]
    fn a_node_reports_metadata_only_of_path_models_and_only_as_their_reporter() {
        let model =
            |source: Value| object("Model", "m", json!({ "format": "gguf", "source": source }));
        let reported = |mut m: Value, by: Option<&str>| {
            m["status"] = json!({ "layers": 2 });
            if let Some(by) = by {
                m["status"]["reportedBy"] = json!(by);
            }
            m
        };
        let unreported = model(json!({ "path": { "path": "/models/m.gguf" } }));
        let path = reported(unreported.clone(), Some("a"));
        let hub = reported(
            model(json!({ "huggingFace": { "repo": "o/m", "file": "m.gguf" } })),
            Some("a"),
        );
        let status = (GROUP, "models", Some("status"));
        let r = |new: &Value, old: &Value| {
            verdict(&request(
                NODE_A,
                "UPDATE",
                status,
                "Model",
                Some("default"),
                "m",
                new.clone(),
                old.clone(),
            ))
        };
        assert_eq!(r(&path, &path), Ok(()));
        assert_eq!(r(&path, &unreported), Ok(()), "the first to report");
        assert!(r(&hub, &hub).is_err());
        assert!(r(&path, &hub).is_err());
        // Another node's report stays its own; a report names its reporter.
        let by_b = reported(unreported.clone(), Some("b"));
        let e = r(&path, &by_b).unwrap_err();
        assert!(e.message.contains("node \"b\" reports"), "{}", e.message);
        assert!(r(&by_b, &unreported).is_err());
        assert!(r(&reported(unreported.clone(), None), &unreported).is_err());
        assert!(r(&reported(unreported.clone(), None), &path).is_err());
    }

    fn deployment(fallback_to: &str) -> Value {
        object(
            "ModelDeployment",
            "d",
            json!({
                "model": "m", "nodePool": "p", "strategy": "s", "replicas": 1,
                "fallback": [{ "deployment": fallback_to }],
            }),
        )
    }

    #[test]
    fn an_invalid_spec_is_refused_with_its_field_but_may_still_be_deleted() {
        let kind = (GROUP, "modeldeployments", None);
        let create = |obj: Value| {
            verdict(&request(
                ADMIN,
                "CREATE",
                kind,
                "ModelDeployment",
                Some("default"),
                "d",
                obj,
                Value::Null,
            ))
        };
        assert_eq!(create(deployment("other")), Ok(()));
        let refused = create(deployment("d")).unwrap_err();
        assert_eq!((refused.code, refused.reason), (422, "Invalid"));
        assert!(
            refused.message.starts_with("ModelDeployment.shardplane.dev \"d\" is invalid: spec.fallback[0].deployment: a deployment cannot fall back to itself"),
            "{}",
            refused.message
        );
        // Made invalid before the webhook existed: metadata changes (the
        // operator's finalizer) and deletion pass; a spec change is checked.
        let bad = deployment("d");
        let mut finalized = bad.clone();
        finalized["metadata"]["finalizers"] = json!([]);
        let update = |new: Value, old: Value| {
            verdict(&request(
                ADMIN,
                "UPDATE",
                kind,
                "ModelDeployment",
                Some("default"),
                "d",
                new,
                old,
            ))
        };
        assert_eq!(update(finalized, bad.clone()), Ok(()));
        let mut deleting = bad.clone();
        deleting["metadata"]["deletionTimestamp"] = json!("2026-01-01T00:00:00Z");
        deleting["spec"]["replicas"] = json!(2);
        assert_eq!(update(deleting, bad.clone()), Ok(()));
        let mut changed = bad.clone();
        changed["spec"]["replicas"] = json!(2);
        assert!(update(changed, bad.clone()).is_err());
        assert_eq!(update(deployment("other"), bad), Ok(()), "mending it");
    }

    #[test]
    fn the_response_carries_the_code_and_reason() {
        let r = request(
            NODE_A,
            "UPDATE",
            ("coordination.k8s.io", "leases", None),
            "Lease",
            Some(NODE_LEASE_NAMESPACE),
            "b",
            json!({"metadata": {"name": "b"}}),
            Value::Null,
        );
        let response = review(&r);
        assert!(!response.allowed);
        assert_eq!(response.uid, "u1");
        assert_eq!(response.result.code, 403);
        assert_eq!(response.result.reason, "Forbidden");
        assert!(
            response
                .result
                .message
                .starts_with("node \"a\" may not update leases \"b\""),
            "{}",
            response.result.message
        );
    }
}
