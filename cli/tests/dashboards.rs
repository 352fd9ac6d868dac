//! The Grafana dashboards against real Prometheus: a running system (operator,
//! four agents, the gateway, the quickstart deployments) under traffic is
//! scraped by Debian's Prometheus, and every query of every dashboard is
//! evaluated through Prometheus' HTTP API: each must parse and return series.

use std::time::Duration;

use kube::Api;
use shardplane_crds::*;
use shardplane_testkit::{
    ChildGuard as Process, control_plane, eventually, free_address, repo_root, unique_name,
};

fn shardplane(args: &[&str]) -> Process {
    shardplane_testkit::spawn_component(env!("CARGO_BIN_EXE_shardplane"), args)
}

/// Every query of every dashboard, with Grafana's variables filled in.
fn queries() -> Vec<(String, String, String)> {
    let dir = repo_root().join("monitoring/dashboards");
    let mut out = Vec::new();
    let mut files: Vec<_> = std::fs::read_dir(&dir)
        .unwrap()
        .map(|e| e.unwrap().path())
        .collect();
    files.sort();
    for path in files {
        let d: serde_json::Value = serde_json::from_slice(&std::fs::read(&path).unwrap()).unwrap();
        for panel in d["panels"].as_array().unwrap() {
            for t in panel["targets"].as_array().unwrap() {
                // "All" of each variable: `.*` also matches series without
                // the label (no `cluster` label in this test's Prometheus).
                let expr = t["expr"]
                    .as_str()
                    .unwrap()
                    .replace("$__rate_interval", "20s")
                    .replace("$model", ".+")
                    .replace("$instance", ".+")
                    .replace("$cluster", ".*")
                    .replace("$job", ".*");
                assert!(
                    !expr.contains('$'),
                    "{} / {}: a variable this test does not fill in: {expr}",
                    path.display(),
                    panel["title"]
                );
                out.push((
                    path.file_name().unwrap().to_string_lossy().into_owned(),
                    panel["title"].as_str().unwrap().to_string(),
                    expr,
                ));
            }
        }
    }
    out
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_dashboard_query_returns_series_from_a_running_system() {
    let prometheus = which("prometheus").expect(
        "prometheus is missing: run `bash scripts/setup.sh` (it installs Debian's prometheus package)",
    );
    shardplane_testkit::install_quickstart_model();
    let client = control_plane().client().await.unwrap();
    let ns = control_plane()
        .namespace(&client, "dashboards")
        .await
        .unwrap();
    let tag = unique_name("dash");

    let operator_admin = free_address().to_string();
    let _operator = shardplane(&[
        "operator",
        "--admin-address",
        &operator_admin,
        "--leader-namespace",
        &tag,
    ]);
    let agent_admins: Vec<String> = (0..4).map(|_| free_address().to_string()).collect();
    let _agents: Vec<Process> = (0..4)
        .map(|i| {
            let tier = if i < 2 { "daily" } else { "reasoning" };
            shardplane(&[
                "agent",
                "--node-name",
                &format!("{tag}-{i}"),
                "--label",
                &format!("dashboards/{tier}={tag}"),
                "--admin-address",
                &agent_admins[i],
                "--lease-seconds",
                "3",
                "--probe-links-seconds",
                "2",
                "--cache-dir",
                std::path::Path::new(env!("CARGO_TARGET_TMPDIR"))
                    .join("dashboards-cache")
                    .join(i.to_string())
                    .to_str()
                    .unwrap(),
            ])
        })
        .collect();
    let (listen, gateway_admin) = (free_address().to_string(), free_address().to_string());
    let _gateway = shardplane(&[
        "gateway",
        "--listen",
        &listen,
        "--admin-address",
        &gateway_admin,
        "--allow-anonymous",
    ]);
    // The quickstart, with pools of this test's own (pools are cluster-scoped:
    // the quickstart's would also take other tests' nodes, and theirs ours).
    let mut yaml = String::new();
    for file in [
        "model.yaml",
        "node-pools.yaml",
        "sharding-strategies.yaml",
        "model-deployments.yaml",
    ] {
        yaml.push_str(
            &std::fs::read_to_string(repo_root().join("manifests/quickstart").join(file)).unwrap(),
        );
        yaml.push_str("\n---\n");
    }
    for tier in ["daily", "reasoning"] {
        yaml = yaml
            .replace(&format!("name: {tier}\n"), &format!("name: {tag}-{tier}\n"))
            .replace(
                &format!("nodePool: {tier}\n"),
                &format!("nodePool: {tag}-{tier}\n"),
            )
            .replace(
                &format!("tier.shardplane.dev/{tier}: \"true\""),
                &format!("dashboards/{tier}: {tag}"),
            );
    }
    control_plane()
        .kubectl_stdin(&["apply", "-n", &ns, "-f", "-"], &yaml)
        .unwrap();
    let deployments: Api<ModelDeployment> = Api::namespaced(client.clone(), &ns);
    // A deployment that cannot be placed: requests for it get a 503.
    let mut broken = shardplane_testkit::fixtures::deployment(
        "broken",
        "smollm2-135m",
        "no-such-pool",
        "whole-model",
    );
    broken.spec.aliases = vec![format!("{tag}-broken")];
    deployments
        .create(&kube::api::PostParams::default(), &broken)
        .await
        .unwrap();
    for (name, replicas) in [("smollm2-daily", 2), ("smollm2-pipeline", 1)] {
        eventually(
            &format!("{name} is Ready"),
            Duration::from_secs(120),
            || async {
                let d = deployments.get(name).await.ok()?;
                (d.status?.ready_replicas == replicas).then_some(())
            },
        )
        .await;
    }

    // Prometheus scrapes everything every second.
    let scratch = tempfile::tempdir().unwrap();
    let targets = |list: &[&String]| {
        list.iter()
            .map(|a| format!("'{a}'"))
            .collect::<Vec<_>>()
            .join(", ")
    };
    let config = format!(
        "global: {{scrape_interval: 1s, evaluation_interval: 1s}}\nscrape_configs:\n\
         - {{job_name: shardplane-operator, static_configs: [{{targets: [{}]}}]}}\n\
         - {{job_name: shardplane-agent, static_configs: [{{targets: [{}]}}]}}\n\
         - {{job_name: shardplane-gateway, static_configs: [{{targets: [{}]}}]}}\n",
        targets(&[&operator_admin]),
        targets(&agent_admins.iter().collect::<Vec<_>>()),
        targets(&[&gateway_admin]),
    );
    std::fs::write(scratch.path().join("prometheus.yml"), config).unwrap();
    let prom_address = free_address().to_string();
    let _prometheus = Process(
        std::process::Command::new(prometheus)
            .arg(format!(
                "--config.file={}",
                scratch.path().join("prometheus.yml").display()
            ))
            .arg(format!(
                "--storage.tsdb.path={}",
                scratch.path().join("data").display()
            ))
            .arg(format!("--web.listen-address={prom_address}"))
            .stdout(std::process::Stdio::null())
            .stderr(std::process::Stdio::null())
            .spawn()
            .unwrap(),
    );

    // Traffic through the gateway for a while: both deployments, and a model
    // that does not exist.
    let http = shardplane_models::http_client().unwrap();
    let until = std::time::Instant::now() + Duration::from_secs(15);
    let mut n = 0;
    while std::time::Instant::now() < until {
        let broken = format!("{tag}-broken");
        for model in [
            "smollm2",
            "smollm2-pipeline",
            "no-such-model",
            broken.as_str(),
        ] {
            let body = serde_json::json!({
                "model": model,
                "messages": [{"role": "user", "content": format!("Say {n}.")}],
                "max_tokens": 6,
                "temperature": 0,
            });
            let _ = http
                .post(format!("http://{listen}/v1/chat/completions"))
                .header("content-type", "application/json")
                .body(body.to_string())
                .send()
                .await;
            n += 1;
        }
    }

    let api = format!("http://{prom_address}/api/v1/query");
    let mut empty = Vec::new();
    for (file, panel, expr) in queries() {
        let url = reqwest::Url::parse_with_params(&api, &[("query", expr.as_str())]).unwrap();
        let text = http.get(url).send().await.unwrap().text().await.unwrap();
        let r: serde_json::Value = serde_json::from_str(&text).unwrap();
        assert_eq!(r["status"], "success", "{file} / {panel}: {expr}: {r}");
        if r["data"]["result"].as_array().is_none_or(|a| a.is_empty()) {
            empty.push(format!("{file} / {panel}: {expr}"));
        }
    }
    assert!(
        empty.is_empty(),
        "queries without series:\n{}",
        empty.join("\n")
    );
}

fn which(cmd: &str) -> Option<std::path::PathBuf> {
    std::env::var_os("PATH")?
        .to_str()?
        .split(':')
        .map(|d| std::path::Path::new(d).join(cmd))
        .find(|p| p.is_file())
}
