//! The Helm chart, rendered and installed by Helm's own Go SDK (the
//! helm-python-sdk package: lint, values.schema.json, templates, install,
//! upgrade, uninstall) and checked against the real API server:
//! - default values (rendered as `helm install --dry-run=server` does) and a
//!   rack-of-Studios values file with every option on (as `helm template`
//!   does) pass `kubectl apply --dry-run=server` without a warning;
//! - the schema turns away bad values;
//! - installed for real with Helm, the chart's RBAC gives the operator, the
//!   gateway and the agents what they use and nothing more (the API server's
//!   RBAC authorizer answers), and a real agent and a real gateway run with
//!   kubeconfigs made by `shardplane agent-kubeconfig` for their
//!   ServiceAccounts;
//! - on a control plane of its own (the chart owns the CRDs there): install,
//!   upgrade from an older chart (the CRDs follow it), uninstall (CRDs and
//!   secrets stay), and generated secrets that never change; rendered offline
//!   (Argo CD) without given secrets the chart refuses, naming the values.
//!
//! The Prometheus Operator's CRDs are not in this API server, so its objects
//! (ServiceMonitor, PodMonitor, ScrapeConfig, PrometheusRule) are checked by
//! what they must agree with instead: the rules are `files/alerts.yaml`
//! (promtool checks them), and the monitors select the metrics Services.
//!
//! Rooms: [`rendered`] (dry runs, the schema, the monitors), [`installed`]
//! (RBAC of an installed release, real components under it), [`own_cluster`]
//! (install, upgrade and uninstall on a control plane of its own).

mod installed;
mod own_cluster;
mod rendered;

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

use k8s_openapi::api::coordination::v1::Lease;
use k8s_openapi::api::core::v1::Secret;
use kube::Api;
use kube::api::DeleteParams;
use serde_json::Value;
use shardplane_crds::{InferenceNode, NODE_LEASE_NAMESPACE};
use shardplane_testkit::{
    ChildGuard, control_plane, eventually, free_address, repo_root, spawn_component_as,
    spawn_component_with, unique_name, venv_python,
};

const BIN: &str = env!("CARGO_BIN_EXE_shardplane");

fn chart() -> PathBuf {
    repo_root().join("charts/shardplane")
}

fn helm(args: &[&str]) -> std::process::Output {
    Command::new(venv_python())
        .arg(repo_root().join("cli/tests/clients/helm_chart.py"))
        .args(args)
        .output()
        .expect("python runs")
}

/// `helm_chart.py args`, which must succeed; its stdout.
fn helm_ok(args: &[&str]) -> String {
    let out = helm(args);
    assert!(
        out.status.success(),
        "helm {} failed: {}",
        args[0],
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8(out.stdout).unwrap()
}

fn yaml_stream(text: &str) -> Vec<Value> {
    serde_saphyr::from_multiple::<Value>(text)
        .expect("the rendered chart is YAML")
        .into_iter()
        .filter(|d| !d.is_null())
        .collect()
}

fn paths(values: &[&Path]) -> Vec<String> {
    values
        .iter()
        .map(|p| p.to_str().unwrap().to_string())
        .collect()
}

/// The chart rendered offline as release `release` in `namespace`, as JSON
/// objects (`helm template`, as Argo CD renders).
fn render(release: &str, namespace: &str, values: &[&Path]) -> Vec<Value> {
    let chart = chart();
    let mut args = vec!["render", chart.to_str().unwrap(), namespace, release];
    let values = paths(values);
    args.extend(values.iter().map(String::as_str));
    yaml_stream(&helm_ok(&args))
}

/// The chart as `helm install --dry-run=server` renders it against the test
/// control plane: `lookup` and the API versions come from the cluster.
fn dry_run(release: &str, namespace: &str, values: &[&Path]) -> Vec<Value> {
    let chart = chart();
    let kubeconfig = control_plane().kubeconfig().to_str().unwrap().to_string();
    let mut args = vec![
        "dry-run",
        &kubeconfig,
        chart.to_str().unwrap(),
        namespace,
        release,
    ];
    let values = paths(values);
    args.extend(values.iter().map(String::as_str));
    yaml_stream(&helm_ok(&args))
}

/// Values for a release in the shared test control plane, whose CRDs and
/// node-lease namespace the test set-up owns (Helm refuses to adopt them).
fn shared_cluster_values(dir: &Path) -> PathBuf {
    let path = dir.join("shared-cluster-values.yaml");
    std::fs::write(
        &path,
        "crds:\n  enabled: false\nnodeLeaseNamespace:\n  create: false\n",
    )
    .unwrap();
    path
}

/// The objects as one `v1 List`, in order.
fn list(docs: &[&Value]) -> String {
    serde_json::json!({"apiVersion": "v1", "kind": "List", "items": docs}).to_string()
}

fn of_kind<'a>(docs: &'a [Value], kind: &str) -> Vec<&'a Value> {
    docs.iter().filter(|d| d["kind"] == kind).collect()
}

fn ensure_namespace(name: &str) {
    let cp = control_plane();
    if cp.kubectl(&["get", "namespace", name]).is_err() {
        let _ = cp.kubectl(&["create", "namespace", name]);
    }
}

fn is_prometheus_operator(d: &Value) -> bool {
    d["apiVersion"]
        .as_str()
        .is_some_and(|v| v.starts_with("monitoring.coreos.com/"))
}

/// The server dry run of `kubectl apply` of everything but the Prometheus
/// Operator's objects; returns what kubectl printed.
fn apply_dry_run(docs: &[Value]) -> String {
    let cp = control_plane();
    let objects: Vec<&Value> = docs.iter().filter(|d| !is_prometheus_operator(d)).collect();
    // Server-side, as Helm 4 applies.
    let args = [
        "apply",
        "--server-side",
        "--field-manager=helm",
        "-f",
        "-",
        "--dry-run=server",
    ];
    let out = cp.kubectl_output(&args, &list(&objects)).unwrap();
    assert!(out.success, "kubectl apply failed:\n{}", out.stderr);
    assert!(
        !out.stderr.contains("Warning"),
        "kubectl apply warned:\n{}",
        out.stderr
    );
    let lines = out.stdout.lines().count();
    assert_eq!(lines, objects.len(), "one line per object:\n{}", out.stdout);
    out.stdout
}

fn labels_match(selector: &Value, labels: &Value) -> bool {
    let exact = selector["matchLabels"]
        .as_object()
        .into_iter()
        .flatten()
        .all(|(k, v)| labels[k] == *v);
    let expressions = selector["matchExpressions"]
        .as_array()
        .into_iter()
        .flatten()
        .all(|e| {
            let key = e["key"].as_str().unwrap();
            match e["operator"].as_str().unwrap() {
                "Exists" => labels.get(key).is_some(),
                "In" => e["values"]
                    .as_array()
                    .unwrap()
                    .iter()
                    .any(|v| labels[key] == *v),
                other => panic!("operator {other} not handled"),
            }
        });
    exact && expressions
}
