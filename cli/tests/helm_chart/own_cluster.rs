//! The chart on a control plane of its own: install, upgrade from an
//! older chart, uninstall; CRDs and secrets kept.

use super::*;

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
