//! The chart installed with Helm: each component's RBAC, checked by the
//! API server's authorizer, and real components running under it.

use super::*;

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
