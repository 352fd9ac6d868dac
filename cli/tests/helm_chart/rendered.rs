//! The chart rendered: server dry runs of default and rack values, the
//! monitors and rules, the values schema, the agents' roles.

use super::*;

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
