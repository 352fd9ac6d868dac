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

#[tokio::test]
async fn the_chart_passes_a_server_dry_run_with_default_and_rack_values() {
    let cp = control_plane();
    let client = cp.client().await.unwrap();
    ensure_namespace(NODE_LEASE_NAMESPACE);
    let dir = tempfile::tempdir().unwrap();
    let shared = shared_cluster_values(dir.path());
    let rack = chart().join("ci/studio-rack-values.yaml");
    // The rack values turn on the Prometheus Operator's objects, whose CRDs
    // this API server lacks, so they render offline (where Helm's default API
    // versions hold policy/v1, which this 1.20 API server lacks: no PDBs).
    let no_pdb = dir.path().join("no-pdb.yaml");
    std::fs::write(
        &no_pdb,
        "operator:\n  podDisruptionBudget:\n    enabled: false\n\
         gateway:\n  podDisruptionBudget:\n    enabled: false\n",
    )
    .unwrap();
    for rack_values in [false, true] {
        let ns = cp.namespace(&client, "helm-dry").await.unwrap();
        let docs = if rack_values {
            let with_pdbs = render("shardplane", &ns, &[shared.as_path(), rack.as_path()]);
            for pdb in of_kind(&with_pdbs, "PodDisruptionBudget") {
                assert_eq!(pdb["apiVersion"], "policy/v1", "{pdb}");
            }
            render("shardplane", &ns, &[&shared, &rack, &no_pdb])
        } else {
            dry_run("shardplane", &ns, &[&shared])
        };
        let printed = apply_dry_run(&docs);
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
        agent_roles_agree_with_up(&docs);
        assert!(
            of_kind(&docs, "CustomResourceDefinition").is_empty(),
            "crds.enabled=false leaves the CRDs out"
        );
        if !rack_values {
            // The cluster's API versions: a 1.20 API server has only v1beta1.
            let pdbs = of_kind(&docs, "PodDisruptionBudget");
            assert_eq!(pdbs.len(), 2, "operator and gateway each get one");
            for pdb in pdbs {
                assert_eq!(pdb["apiVersion"], "policy/v1beta1", "{pdb}");
                assert_eq!(pdb["spec"]["maxUnavailable"], 1);
            }
        }
        // Every replicated component spreads over hosts, softly.
        for d in of_kind(&docs, "Deployment") {
            let spread = &d["spec"]["template"]["spec"]["topologySpreadConstraints"][0];
            assert_eq!(spread["topologyKey"], "kubernetes.io/hostname", "{d}");
            assert_eq!(spread["whenUnsatisfiable"], "ScheduleAnyway");
            assert!(labels_match(
                &spread["labelSelector"],
                &d["spec"]["template"]["metadata"]["labels"]
            ));
        }

        // The operator's web view reads every gateway replica through a
        // headless Service that selects the gateway's pods.
        let operator = of_kind(&docs, "Deployment")
            .into_iter()
            .find(|d| {
                d["metadata"]["name"]
                    .as_str()
                    .unwrap()
                    .ends_with("operator")
            })
            .unwrap();
        let env = operator["spec"]["template"]["spec"]["containers"][0]["env"]
            .as_array()
            .unwrap();
        let env_value = |name: &str| {
            env.iter()
                .find(|e| e["name"] == name)
                .and_then(|e| e["value"].as_str())
                .unwrap_or_else(|| panic!("no {name} in the operator's env"))
        };
        let metrics = env_value("SHARDPLANE_GATEWAY_METRICS");
        let host = metrics
            .strip_prefix("dns+http://")
            .and_then(|r| r.split_once('.'))
            .unwrap()
            .0;
        let replicas = of_kind(&docs, "Service")
            .into_iter()
            .find(|s| s["metadata"]["name"] == host)
            .unwrap_or_else(|| panic!("no Service {host}"));
        assert_eq!(replicas["spec"]["clusterIP"], "None", "{replicas}");
        let gateway = of_kind(&docs, "Deployment")
            .into_iter()
            .find(|d| d["metadata"]["name"].as_str().unwrap().ends_with("gateway"))
            .unwrap();
        let selector = serde_json::json!({"matchLabels": replicas["spec"]["selector"]});
        assert!(labels_match(
            &selector,
            &gateway["spec"]["template"]["metadata"]["labels"]
        ));
        assert!(
            replicas["metadata"]["labels"]
                .get("shardplane.dev/job")
                .is_none(),
            "Prometheus scrapes the gateway once, through its metrics Service"
        );
        assert!(env.iter().all(|e| e["name"] != "SHARDPLANE_NO_UI"));
        // The signer knows the gateway's ServiceAccount as a gateway's.
        let gateway_account = gateway["spec"]["template"]["spec"]["serviceAccountName"]
            .as_str()
            .unwrap();
        let gateway_users = env_value("SHARDPLANE_DATA_PLANE_GATEWAY_USERS");
        assert_eq!(
            gateway_users,
            format!("system:serviceaccount:{ns}:{gateway_account}")
        );

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
        if rack_values {
            check_monitoring(&docs);
        } else {
            assert!(monitoring.is_empty(), "monitoring objects are opt-in");
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
    let relabel = &pods[0]["spec"]["podMetricsEndpoints"][0]["relabelings"][0];
    assert_eq!(relabel["targetLabel"], "job");
    assert_eq!(relabel["replacement"], "shardplane-$1");
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

/// The agents' roles `shardplane up` applies (`agent_rbac.yaml`) are the
/// chart's, but for the chart's optional Hugging Face token Secrets.
fn agent_roles_agree_with_up(docs: &[Value]) {
    let up_text =
        std::fs::read_to_string(repo_root().join("cli/src/commands/agent_rbac.yaml")).unwrap();
    let up = yaml_stream(&up_text);
    let rules = |docs: &[Value], kind: &str| -> Vec<Value> {
        let found: Vec<&Value> = of_kind(docs, kind)
            .into_iter()
            .filter(|d| {
                let name = d["metadata"]["name"].as_str().unwrap_or_default();
                name == "ACCOUNT" || name.ends_with("-agent")
            })
            .collect();
        assert_eq!(found.len(), 1, "one agent {kind}: {found:?}");
        found[0]["rules"]
            .as_array()
            .unwrap()
            .iter()
            .filter(|r| r["resources"] != serde_json::json!(["secrets"]))
            .cloned()
            .collect()
    };
    for kind in ["ClusterRole", "Role"] {
        assert_eq!(
            rules(docs, kind),
            rules(&up, kind),
            "the agents' {kind} differs between the chart and up"
        );
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

fn kubeconfig_for(ns: &str, service_account: &str, node: Option<&str>, dir: &Path) -> PathBuf {
    let path = dir.join(format!("{}.kubeconfig", node.unwrap_or(service_account)));
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
        ])
        .args(node.map(|n| ["--node", n]).into_iter().flatten())
        .arg("-o")
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
        let kubeconfig = cp.kubeconfig().to_str().unwrap();
        let _ = helm(&["uninstall", kubeconfig, &self.namespace, &self.name]);
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
        let node = format!("shardplane.dev/node={}", self.node);
        let _ = cp.kubectl(&["delete", "clusterrolebinding", "-l", &node, "--wait=false"]);
        let _ = cp.kubectl(&["delete", "rolebinding", "-A", "-l", &node, "--wait=false"]);
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
    let values_dir = tempfile::tempdir().unwrap();
    let shared = shared_cluster_values(values_dir.path());
    // Models in this namespace may name their own hub token's Secret.
    let models_ns = cp.namespace(&client, "helm-models").await.unwrap();
    let tokens = values_dir.path().join("model-tokens.yaml");
    std::fs::write(
        &tokens,
        format!("modelTokenSecrets:\n  namespaces: [{models_ns}]\n"),
    )
    .unwrap();
    let chart = chart();
    let kubeconfig = cp.kubeconfig().to_str().unwrap();
    let status = helm_ok(&[
        "install",
        kubeconfig,
        chart.to_str().unwrap(),
        &ns,
        &release.name,
        shared.to_str().unwrap(),
        tokens.to_str().unwrap(),
    ]);
    assert_eq!(status.trim(), "deployed");
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
        (
            &operator,
            "watch",
            "certificatesigningrequests.certificates.k8s.io",
            None,
        ),
        (
            &operator,
            "patch",
            "certificatesigningrequests.certificates.k8s.io/status",
            None,
        ),
        (
            &operator,
            "patch",
            "configmaps/shardplane-data-plane-ca",
            own,
        ),
        (&gateway, "get", "configmaps/shardplane-data-plane-ca", own),
        (
            &gateway,
            "create",
            "certificatesigningrequests.certificates.k8s.io",
            None,
        ),
        (
            &operator,
            "patch",
            &format!(
                "validatingwebhookconfigurations.admissionregistration.k8s.io/{full}-operator"
            ),
            None,
        ),
        (
            &operator,
            "update",
            &format!("secrets/{full}-operator-webhook-tls"),
            own,
        ),
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
        (&operator, "get", "secrets", Some(models_ns.as_str())),
        (&agent, "get", "secrets", Some(models_ns.as_str())),
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
        (
            &operator,
            "patch",
            "validatingwebhookconfigurations.admissionregistration.k8s.io/someone-elses",
            None,
        ),
        (&operator, "update", "secrets", own),
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
        (&operator, "list", "secrets", Some(models_ns.as_str())),
        (&agent, "list", "secrets", Some(models_ns.as_str())),
        (&gateway, "get", "secrets", Some(models_ns.as_str())),
    ] {
        assert!(
            !can(who, verb, resource, namespace),
            "{who} can {verb} {resource} in {namespace:?}"
        );
    }
    assert!(can(&gateway, "get", &api_keys, own));

    // A node identity minted by `agent-kubeconfig --node` holds every role
    // of the agents' ServiceAccount (the copies of its bindings), and a real
    // agent on it registers, reports its machine and renews its Lease.
    let dir = tempfile::tempdir().unwrap();
    let agent_kc = kubeconfig_for(
        &ns,
        &format!("{full}-agent"),
        Some(&release.node),
        dir.path(),
    );
    let text = std::fs::read_to_string(&agent_kc).unwrap();
    let node_sa = format!(
        "system:serviceaccount:{ns}:shardplane-node-{}",
        release.node
    );
    assert!(text.contains(&node_sa), "{text}");
    assert_eq!(
        std::os::unix::fs::PermissionsExt::mode(
            &std::fs::metadata(&agent_kc).unwrap().permissions()
        ) & 0o777,
        0o600
    );
    for (verb, resource, namespace) in [
        ("create", "inferencenodes.shardplane.dev", None),
        ("patch", "inferencenodes.shardplane.dev/status", None),
        ("patch", "shards.shardplane.dev/status", None),
        ("patch", "leases.coordination.k8s.io", lease_ns),
        ("get", "secrets", Some(models_ns.as_str())),
        (
            "create",
            "certificatesigningrequests.certificates.k8s.io",
            None,
        ),
        ("get", "configmaps/shardplane-data-plane-ca", own),
    ] {
        assert!(
            can(&node_sa, verb, resource, namespace),
            "{node_sa} cannot {verb} {resource}"
        );
    }
    for (verb, resource, namespace) in [
        ("create", "shards.shardplane.dev", None),
        ("get", "secrets", own),
        ("patch", "leases.coordination.k8s.io", own),
    ] {
        assert!(
            !can(&node_sa, verb, resource, namespace),
            "{node_sa} can {verb} {resource}"
        );
    }
    // The shared identity still works (with a note recommending --node).
    let shared_kc = kubeconfig_for(&ns, &format!("{full}-agent"), None, dir.path());
    assert!(
        std::fs::read_to_string(&shared_kc)
            .unwrap()
            .contains(&format!("system:serviceaccount:{ns}:{full}-agent"))
    );
    // The operator on its ServiceAccount: with the chart's roles it makes
    // the data plane's CA, publishes it, and signs the node's certificate.
    let operator_kc = kubeconfig_for(&ns, &format!("{full}-operator"), None, dir.path());
    let _operator: ChildGuard = spawn_component_as(
        BIN,
        &[
            "operator",
            "--leader-namespace",
            &ns,
            "--agent-namespace",
            &ns,
            "--admin-address",
            &free_address().to_string(),
            "--no-ui",
            // As the chart's Deployment sets it (checked by the render test).
            "--data-plane-gateway-user",
            &format!("system:serviceaccount:{ns}:{full}-gateway"),
        ],
        &operator_kc,
    );
    // The agent asks for its certificate with its node identity and
    // registers once it holds one.
    let tls_on = [("SHARDPLANE_DATA_PLANE_TLS", "operator")];
    let cache = dir.path().join("cache");
    let _agent: ChildGuard = spawn_component_with(
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
        &tls_on,
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
    let gateway_kc = kubeconfig_for(&ns, &format!("{full}-gateway"), None, dir.path());
    let listen = free_address();
    let _gateway = spawn_component_with(
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
        &tls_on,
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
    // The node's certificate was issued (the gateway waited for its own
    // before it served, so the CA was published too).
    let csrs: Api<k8s_openapi::api::certificates::v1::CertificateSigningRequest> =
        Api::all(client.clone());
    let issued = csrs
        .list(
            &kube::api::ListParams::default()
                .labels(&format!("shardplane.dev/node={}", release.node)),
        )
        .await
        .unwrap()
        .items
        .into_iter()
        .filter(|c| {
            c.status
                .as_ref()
                .and_then(|s| s.certificate.as_ref())
                .is_some()
        })
        .count();
    assert!(issued >= 1, "no certificate issued for {}", release.node);
    // So was the gateway's, client-only (agents require one of every caller).
    let gateways = csrs
        .list(&kube::api::ListParams::default())
        .await
        .unwrap()
        .items
        .into_iter()
        .filter(|c| {
            c.spec.username.as_deref()
                == Some(&format!("system:serviceaccount:{ns}:{full}-gateway"))
                && c.status
                    .as_ref()
                    .and_then(|s| s.certificate.as_ref())
                    .is_some()
        })
        .count();
    assert!(gateways >= 1, "no certificate issued for the gateway");

    drop(_agent);
    let _ = nodes.delete(&release.node, &DeleteParams::default()).await;
}

/// The `jsonpath` of object `what` (kind/name, in `namespace` when given).
fn get(cp: &shardplane_testkit::ControlPlane, what: &str, ns: Option<&str>, path: &str) -> String {
    let mut args = vec!["get", what, "-o"];
    let jsonpath = format!("jsonpath={path}");
    args.push(&jsonpath);
    if let Some(ns) = ns {
        args.extend(["-n", ns]);
    }
    cp.kubectl(&args).unwrap()
}

#[test]
fn on_its_own_cluster_the_chart_installs_upgrades_and_uninstalls_keeping_crds_and_secrets() {
    let chart = chart();
    // Offline (helm template, Argo CD) with nothing to take the secrets from:
    // refused, naming what to set, instead of new random secrets per render.
    let out = helm(&["render", chart.to_str().unwrap(), "sp", "shardplane"]);
    let said = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "an offline render generated secrets");
    assert!(
        said.contains("dataPlaneToken.existingSecret")
            && said.contains("without access to the cluster"),
        "{said}"
    );
    let dir = tempfile::tempdir().unwrap();
    let existing = dir.path().join("existing-secrets.yaml");
    std::fs::write(
        &existing,
        "dataPlaneToken:\n  existingSecret: my-token\ngateway:\n  apiKeys:\n    existingSecret: my-keys\n",
    )
    .unwrap();
    let docs = render("shardplane", "sp", &[&existing]);
    // No secret value rendered (the webhook's certificate Secret is made
    // empty, for the operator to fill in).
    assert!(
        of_kind(&docs, "Secret")
            .iter()
            .all(|s| s["type"] != "Opaque" || (s["data"].is_null() && s["stringData"].is_null())),
        "{}",
        list(&of_kind(&docs, "Secret"))
    );
    assert!(list(&docs.iter().collect::<Vec<_>>()).contains("\"my-token\""));

    // The chart as it was: version 0.0.9, whose Shard CRD lacks a column.
    let old = dir.path().join("old-chart");
    let copied = Command::new("cp")
        .arg("-r")
        .arg(&chart)
        .arg(&old)
        .status()
        .unwrap();
    assert!(copied.success());
    let meta = std::fs::read_to_string(old.join("Chart.yaml")).unwrap();
    std::fs::write(
        old.join("Chart.yaml"),
        meta.replace("\nversion: 0.1.0\n", "\nversion: 0.0.9\n"),
    )
    .unwrap();
    let shards_crd = old.join("files/crds/shards.shardplane.dev.yaml");
    let mut crd: Value =
        serde_saphyr::from_str(&std::fs::read_to_string(&shards_crd).unwrap()).unwrap();
    let columns = crd["spec"]["versions"][0]["additionalPrinterColumns"]
        .as_array_mut()
        .unwrap();
    let before = columns.len();
    columns.retain(|c| c["name"] != "Restarts");
    assert_eq!(
        columns.len(),
        before - 1,
        "the Shard CRD has a Restarts column"
    );
    std::fs::write(&shards_crd, crd.to_string()).unwrap();

    let cp = shardplane_testkit::OwnControlPlane::start();
    let kubeconfig = cp.kubeconfig().to_str().unwrap().to_string();
    let ns = "shardplane-system";
    let helm_in = |args: &[&str]| helm_ok(&[&[args[0], kubeconfig.as_str()], &args[1..]].concat());
    let columns = || {
        get(
            &cp,
            "crd/shards.shardplane.dev",
            None,
            "{.spec.versions[0].additionalPrinterColumns[*].name}",
        )
    };
    let secrets = || {
        (
            get(
                &cp,
                "secret/shardplane-data-plane-token",
                Some(ns),
                "{.data.token}",
            ),
            get(
                &cp,
                "secret/shardplane-api-keys",
                Some(ns),
                "{.data.default}",
            ),
        )
    };

    assert_eq!(
        helm_in(&["install", old.to_str().unwrap(), ns, "shardplane"]).trim(),
        "deployed"
    );
    assert!(!columns().contains("Restarts"), "{}", columns());
    let first = secrets();
    assert!(first.0.len() > 40 && first.1.len() > 40, "{first:?}");
    assert_eq!(
        get(
            &cp,
            "crd/shards.shardplane.dev",
            None,
            "{.metadata.annotations.helm\\.sh/resource-policy}"
        ),
        "keep"
    );

    // An upgrade to this chart upgrades the CRDs and keeps the secrets.
    assert_eq!(
        helm_in(&["upgrade", chart.to_str().unwrap(), ns, "shardplane"]).trim(),
        "deployed"
    );
    assert!(columns().contains("Restarts"), "{}", columns());
    assert_eq!(
        get(
            &cp,
            "crd/shards.shardplane.dev",
            None,
            "{.metadata.labels.helm\\.sh/chart}"
        ),
        "shardplane-0.1.0"
    );
    assert_eq!(secrets(), first, "generated secrets change on upgrade");

    // Objects of the chart's kinds, and the secrets, outlive an uninstall.
    let mut strategy =
        shardplane_testkit::fixtures::strategy("kept", shardplane_crds::Parallelism::None);
    strategy.metadata.labels = None;
    cp.kubectl_stdin(
        &["apply", "-f", "-"],
        &serde_json::to_string(&strategy).unwrap(),
    )
    .unwrap();
    let said = helm_in(&["uninstall", ns, "shardplane"]);
    assert!(said.contains("kept due to the resource policy"), "{said}");
    assert!(
        cp.kubectl(&["get", "deployment", "-n", ns, "-o", "name"])
            .unwrap()
            .trim()
            .is_empty()
    );
    assert!(columns().contains("Restarts"));
    assert_eq!(
        get(&cp, "shardingstrategy/kept", None, "{.metadata.name}"),
        "kept"
    );
    assert_eq!(secrets(), first);

    // Installed again, the release takes the kept CRDs and secrets back.
    assert_eq!(
        helm_in(&["install", chart.to_str().unwrap(), ns, "shardplane"]).trim(),
        "deployed"
    );
    assert_eq!(secrets(), first);
}
