//! The Helm chart, rendered by Helm's own Go SDK (the helm-python-sdk package:
//! lint, values.schema.json, templates) and checked against the real API
//! server:
//! - default values and a rack-of-Studios values file with every option on
//!   pass `kubectl apply --dry-run=server` without a warning;
//! - the schema turns away bad values;
//! - installed for real, the chart's RBAC gives the operator, the gateway and
//!   the agents what they use and nothing more (the API server's RBAC
//!   authorizer answers), and a real agent and a real gateway run with
//!   kubeconfigs made by `shardplane agent-kubeconfig` for their
//!   ServiceAccounts.
//!
//! The Prometheus Operator's CRDs are not in this API server, so its objects
//! (ServiceMonitor, PodMonitor, ScrapeConfig, PrometheusRule) are checked by
//! what they must agree with instead: the rules are `files/alerts.yaml`
//! (promtool checks them), and the monitors select the metrics Services.

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
    unique_name, venv_python,
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

/// The chart rendered as release `release` in `namespace`, as JSON objects.
fn render(release: &str, namespace: &str, values: Option<&Path>) -> Vec<Value> {
    let chart = chart();
    let mut args = vec!["render", chart.to_str().unwrap(), namespace, release];
    if let Some(v) = values {
        args.push(v.to_str().unwrap());
    }
    let out = helm(&args);
    assert!(
        out.status.success(),
        "helm render failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    serde_saphyr::from_multiple::<Value>(&String::from_utf8(out.stdout).unwrap())
        .expect("the rendered chart is YAML")
        .into_iter()
        .filter(|d| !d.is_null())
        .collect()
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

/// `kubectl apply` (or its server dry run) of everything but the Prometheus
/// Operator's objects; returns what kubectl printed.
fn apply(docs: &[Value], dry_run: bool) -> String {
    let cp = control_plane();
    let objects: Vec<&Value> = docs.iter().filter(|d| !is_prometheus_operator(d)).collect();
    // Server-side, as Helm 4 applies.
    let mut args = vec!["apply", "--server-side", "--field-manager=helm", "-f", "-"];
    if dry_run {
        args.push("--dry-run=server");
    }
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

#[tokio::test]
async fn the_chart_passes_a_server_dry_run_with_default_and_rack_values() {
    let cp = control_plane();
    let client = cp.client().await.unwrap();
    ensure_namespace(NODE_LEASE_NAMESPACE);
    let rack = chart().join("ci/studio-rack-values.yaml");
    for values in [None, Some(rack.as_path())] {
        let ns = cp.namespace(&client, "helm-dry").await.unwrap();
        let docs = render("shardplane", &ns, values);
        let printed = apply(&docs, true);
        assert!(printed.contains("(server dry run)"), "{printed}");
        for kind in [
            "Deployment",
            "ServiceAccount",
            "ClusterRole",
            "Role",
            "Secret",
            "Service",
        ] {
            assert!(!of_kind(&docs, kind).is_empty(), "no {kind} rendered");
        }
        assert_eq!(of_kind(&docs, "Deployment").len(), 2);

        // The dashboards, one ConfigMap each, exactly the shipped JSON.
        let maps = of_kind(&docs, "ConfigMap");
        let shipped = std::fs::read_dir(chart().join("files/dashboards")).unwrap();
        let mut shipped: Vec<_> = shipped.map(|e| e.unwrap().path()).collect();
        shipped.sort();
        assert_eq!(maps.len(), shipped.len());
        for path in &shipped {
            let file = path.file_name().unwrap().to_str().unwrap();
            let map = maps
                .iter()
                .find(|m| m["data"].get(format!("shardplane-{file}")).is_some())
                .unwrap_or_else(|| panic!("no ConfigMap holds {file}"));
            assert_eq!(map["metadata"]["labels"]["grafana_dashboard"], "1");
            let held: Value =
                serde_json::from_str(map["data"][format!("shardplane-{file}")].as_str().unwrap())
                    .unwrap();
            let want: Value =
                serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap();
            assert_eq!(held, want, "{file}");
        }

        let monitoring: Vec<&Value> = docs.iter().filter(|d| is_prometheus_operator(d)).collect();
        if values.is_none() {
            assert!(monitoring.is_empty(), "monitoring objects are opt-in");
        } else {
            check_monitoring(&docs);
        }
        cp.kubectl(&["delete", "namespace", &ns, "--wait=false"])
            .unwrap();
    }
}

/// The rack values turn every Prometheus Operator object on.
fn check_monitoring(docs: &[Value]) {
    let rule = of_kind(docs, "PrometheusRule");
    assert_eq!(rule.len(), 1);
    let alerts: Value = serde_saphyr::from_str(
        &std::fs::read_to_string(chart().join("files/alerts.yaml")).unwrap(),
    )
    .unwrap();
    assert_eq!(
        rule[0]["spec"], alerts,
        "the PrometheusRule is files/alerts.yaml"
    );
    let file = tempfile::NamedTempFile::new().unwrap();
    std::fs::write(
        file.path(),
        serde_json::to_string(&rule[0]["spec"]).unwrap(),
    )
    .unwrap();
    let checked = Command::new("promtool")
        .args(["check", "rules"])
        .arg(file.path())
        .output()
        .expect("promtool is missing: run `bash scripts/setup.sh`");
    assert!(
        checked.status.success(),
        "{}",
        String::from_utf8_lossy(&checked.stderr)
    );

    let services = of_kind(docs, "Service");
    let monitor = of_kind(docs, "ServiceMonitor");
    assert_eq!(monitor.len(), 1);
    assert_eq!(
        monitor[0]["metadata"]["labels"]["release"],
        "kube-prometheus-stack"
    );
    let selector = &monitor[0]["spec"]["selector"];
    let mut jobs: Vec<&str> = services
        .iter()
        .filter(|s| labels_match(selector, &s["metadata"]["labels"]))
        .map(|s| {
            let ports = s["spec"]["ports"].as_array().unwrap();
            assert!(ports.iter().any(|p| p["name"] == "metrics"), "{s}");
            s["metadata"]["labels"]["shardplane.dev/job"]
                .as_str()
                .unwrap()
        })
        .collect();
    jobs.sort();
    assert_eq!(jobs, ["shardplane-gateway", "shardplane-operator"]);

    let pods = of_kind(docs, "PodMonitor");
    assert_eq!(pods.len(), 1);
    for d in of_kind(docs, "Deployment") {
        let labels = &d["spec"]["template"]["metadata"]["labels"];
        assert!(labels_match(&pods[0]["spec"]["selector"], labels), "{d}");
        let ports = d["spec"]["template"]["spec"]["containers"][0]["ports"]
            .as_array()
            .unwrap();
        assert!(ports.iter().any(|p| p["name"] == "metrics"));
    }

    // The agents, off the cluster, by address, under the job the alerts use.
    let scrape = of_kind(docs, "ScrapeConfig");
    assert_eq!(scrape.len(), 1);
    let targets: Vec<&str> = scrape[0]["spec"]["staticConfigs"]
        .as_array()
        .unwrap()
        .iter()
        .map(|c| c["targets"][0].as_str().unwrap())
        .collect();
    assert_eq!(
        targets,
        ["10.20.0.11:9091", "10.20.0.12:9091", "10.20.0.13:9091"]
    );
    assert_eq!(
        scrape[0]["spec"]["relabelings"][0]["replacement"],
        "shardplane-agent"
    );
    assert!(alerts.to_string().contains("job=\\\"shardplane-agent\\\""));
}

#[test]
fn the_values_schema_turns_away_bad_values() {
    let cases = [
        ("operator:\n  replicas: two\n", "replicas"),
        ("gatway:\n  replicas: 2\n", "gatway"),
        ("gateway:\n  service:\n    type: Ingress\n", "type"),
        ("dataPlaneToken:\n  value: short\n", "value"),
        ("monitoring:\n  interval: often\n", "interval"),
        (
            "agents:\n  metrics:\n    endpoints:\n      - node: studio-1\n",
            "ip",
        ),
    ];
    let chart = chart();
    for (values, names) in cases {
        let file = tempfile::NamedTempFile::new().unwrap();
        std::fs::write(file.path(), values).unwrap();
        let out = helm(&[
            "reject",
            chart.to_str().unwrap(),
            file.path().to_str().unwrap(),
        ]);
        let said = String::from_utf8_lossy(&out.stdout);
        assert!(
            out.status.success(),
            "{values:?} was accepted: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        assert!(said.contains(names), "{values:?}: {said}");
    }
}

/// `kubectl auth can-i` as a ServiceAccount: the API server's RBAC answers.
fn can(sa: &str, verb: &str, resource: &str, namespace: Option<&str>) -> bool {
    // `kind/status` is the status subresource; `kind/name` one object.
    let (resource, subresource) = match resource.strip_suffix("/status") {
        Some(r) => (r, Some("--subresource=status")),
        None => (resource, None),
    };
    let mut args = vec!["auth", "can-i", verb, resource, "--as", sa];
    args.extend(subresource);
    if let Some(ns) = namespace {
        args.extend(["-n", ns]);
    }
    let out = control_plane().kubectl_output(&args, "").unwrap();
    match out.stdout.trim() {
        "yes" => true,
        "no" => false,
        other => panic!("kubectl auth can-i {args:?}: {other} {}", out.stderr),
    }
}

fn kubeconfig_for(ns: &str, service_account: &str, dir: &Path) -> PathBuf {
    let path = dir.join(format!("{service_account}.kubeconfig"));
    let out = Command::new(BIN)
        .args(["agent-kubeconfig", "--kubeconfig"])
        .arg(control_plane().kubeconfig())
        .args([
            "-n",
            ns,
            "--service-account",
            service_account,
            "--duration",
            "1h",
            "-o",
        ])
        .arg(&path)
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "agent-kubeconfig failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    path
}

/// Removes what the installed release made, even when the test fails.
struct Release {
    name: String,
    namespace: String,
    node: String,
}

impl Drop for Release {
    fn drop(&mut self) {
        let cp = control_plane();
        let selector = format!("app.kubernetes.io/instance={}", self.name);
        for kind in ["clusterrole", "clusterrolebinding"] {
            let _ = cp.kubectl(&["delete", kind, "-l", &selector, "--wait=false"]);
        }
        for (ns, kind) in [
            (NODE_LEASE_NAMESPACE, "role"),
            (NODE_LEASE_NAMESPACE, "rolebinding"),
        ] {
            let _ = cp.kubectl(&["delete", kind, "-n", ns, "-l", &selector, "--wait=false"]);
        }
        let _ = cp.kubectl(&["delete", "inferencenode", &self.node, "--wait=false"]);
        let _ = cp.kubectl(&["delete", "namespace", &self.namespace, "--wait=false"]);
    }
}

#[tokio::test]
async fn the_installed_chart_grants_each_component_what_it_uses_and_no_more() {
    let cp = control_plane();
    let client = cp.client().await.unwrap();
    ensure_namespace(NODE_LEASE_NAMESPACE);
    let ns = cp.namespace(&client, "helm-rbac").await.unwrap();
    let release = Release {
        name: format!("r{}", std::process::id()),
        namespace: ns.clone(),
        node: unique_name("helm-agent"),
    };
    let docs = render(&release.name, &ns, None);
    apply(&docs, false);
    let full = format!("{}-shardplane", release.name);
    let sa = |c: &str| format!("system:serviceaccount:{ns}:{full}-{c}");
    let (operator, gateway, agent) = (sa("operator"), sa("gateway"), sa("agent"));
    let lease_ns = Some(NODE_LEASE_NAMESPACE);
    let own = Some(ns.as_str());

    // What each one does.
    for (who, verb, resource, namespace) in [
        (&operator, "watch", "modeldeployments.shardplane.dev", None),
        (
            &operator,
            "patch",
            "modeldeployments.shardplane.dev/status",
            None,
        ),
        (&operator, "patch", "modeldeployments.shardplane.dev", None),
        (&operator, "create", "shards.shardplane.dev", None),
        (&operator, "delete", "shards.shardplane.dev", None),
        (
            &operator,
            "patch",
            "inferencenodes.shardplane.dev/status",
            None,
        ),
        (&operator, "patch", "nodepools.shardplane.dev/status", None),
        (&operator, "patch", "models.shardplane.dev/status", None),
        (&operator, "list", "shardingstrategies.shardplane.dev", None),
        (&operator, "create", "events.events.k8s.io", None),
        (&operator, "watch", "leases.coordination.k8s.io", lease_ns),
        (&operator, "create", "leases.coordination.k8s.io", own),
        (
            &operator,
            "update",
            "leases.coordination.k8s.io/shardplane-operator",
            own,
        ),
        (&operator, "get", "namespaces/shardplane-node-lease", None),
        (&gateway, "watch", "modeldeployments.shardplane.dev", None),
        (&gateway, "watch", "models.shardplane.dev", None),
        (&gateway, "watch", "shards.shardplane.dev", None),
        (&agent, "create", "inferencenodes.shardplane.dev", None),
        (
            &agent,
            "patch",
            "inferencenodes.shardplane.dev/status",
            None,
        ),
        (&agent, "watch", "shards.shardplane.dev", None),
        (&agent, "patch", "shards.shardplane.dev/status", None),
        (&agent, "watch", "models.shardplane.dev", None),
        (&agent, "patch", "leases.coordination.k8s.io", lease_ns),
        (&agent, "delete", "leases.coordination.k8s.io", lease_ns),
    ] {
        assert!(
            can(who, verb, resource, namespace),
            "{who} cannot {verb} {resource} in {namespace:?}"
        );
    }
    // And no more.
    let api_keys = format!("secrets/{full}-api-keys");
    let token = format!("secrets/{full}-data-plane-token");
    for (who, verb, resource, namespace) in [
        (&operator, "get", "secrets", own),
        (&operator, "get", "secrets", Some("default")),
        (
            &operator,
            "update",
            "leases.coordination.k8s.io/someone-else",
            own,
        ),
        (&operator, "delete", "leases.coordination.k8s.io", lease_ns),
        (&operator, "delete", "modeldeployments.shardplane.dev", None),
        (&operator, "patch", "inferencenodes.shardplane.dev", None),
        (&operator, "create", "namespaces", None),
        (&gateway, "list", "secrets", own),
        (&gateway, "get", &token, own),
        (&gateway, "get", "secrets", Some("default")),
        (&gateway, "patch", "shards.shardplane.dev/status", None),
        (&gateway, "list", "inferencenodes.shardplane.dev", None),
        (&agent, "get", "secrets", own),
        (&agent, "get", &api_keys, own),
        (&agent, "create", "shards.shardplane.dev", None),
        (&agent, "delete", "shards.shardplane.dev", None),
        (&agent, "patch", "shards.shardplane.dev", None),
        (&agent, "delete", "inferencenodes.shardplane.dev", None),
        (
            &agent,
            "patch",
            "modeldeployments.shardplane.dev/status",
            None,
        ),
        (&agent, "patch", "leases.coordination.k8s.io", own),
    ] {
        assert!(
            !can(who, verb, resource, namespace),
            "{who} can {verb} {resource} in {namespace:?}"
        );
    }
    assert!(can(&gateway, "get", &api_keys, own));

    // A real agent on a kubeconfig made for its ServiceAccount registers,
    // reports its machine and renews its Lease.
    let dir = tempfile::tempdir().unwrap();
    let agent_kc = kubeconfig_for(&ns, &format!("{full}-agent"), dir.path());
    let text = std::fs::read_to_string(&agent_kc).unwrap();
    assert!(
        text.contains(&format!("system:serviceaccount:{ns}:{full}-agent")),
        "{text}"
    );
    assert_eq!(
        std::os::unix::fs::PermissionsExt::mode(
            &std::fs::metadata(&agent_kc).unwrap().permissions()
        ) & 0o777,
        0o600
    );
    let cache = dir.path().join("cache");
    let _agent: ChildGuard = spawn_component_as(
        BIN,
        &[
            "agent",
            "--node-name",
            &release.node,
            "--admin-address",
            &free_address().to_string(),
            "--lease-seconds",
            "5",
            "--cache-dir",
            cache.to_str().unwrap(),
        ],
        &agent_kc,
    );
    let nodes: Api<InferenceNode> = Api::all(client.clone());
    let leases: Api<Lease> = Api::namespaced(client.clone(), NODE_LEASE_NAMESPACE);
    eventually(
        "the agent registers and reports",
        Duration::from_secs(60),
        || async {
            let node = nodes.get_opt(&release.node).await.ok().flatten()?;
            let status = node.status?;
            status.memory.as_ref()?;
            status.data_plane_endpoint.as_ref()?;
            leases.get_opt(&release.node).await.ok().flatten()
        },
    )
    .await;

    // A real gateway on its ServiceAccount's kubeconfig reads its API keys
    // from the chart's Secret and serves the model list.
    let gateway_kc = kubeconfig_for(&ns, &format!("{full}-gateway"), dir.path());
    let listen = free_address();
    let _gateway = spawn_component_as(
        BIN,
        &[
            "gateway",
            "--listen",
            &listen.to_string(),
            "--admin-address",
            &free_address().to_string(),
            "--api-keys-secret",
            &format!("{ns}/{full}-api-keys"),
        ],
        &gateway_kc,
    );
    let keys: Secret = Api::namespaced(client.clone(), &ns)
        .get(&format!("{full}-api-keys"))
        .await
        .unwrap();
    let key = String::from_utf8(keys.data.unwrap()["default"].0.clone()).unwrap();
    assert!(key.starts_with("sk-") && key.len() > 40, "{key}");
    let http = shardplane_models::http_client().unwrap();
    let url = format!("http://{listen}/v1/models");
    let status = eventually("the gateway serves", Duration::from_secs(60), || async {
        let r = http.get(&url).bearer_auth(&key).send().await.ok()?;
        Some(r.status())
    })
    .await;
    assert_eq!(status, 200);
    let refused = http.get(&url).bearer_auth("sk-wrong").send().await.unwrap();
    assert_eq!(refused.status(), 401);

    drop(_agent);
    let _ = nodes.delete(&release.node, &DeleteParams::default()).await;
}
