//! `shardplane up`, the main job, as a user runs it: it brings up its own
//! control plane, the operator, five agents and the gateway, shows progress
//! until the quickstart is Ready, and both served models answer through the
//! gateway; the web view shows all of it in a real browser (Chromium), live;
//! a killed agent is reported while the other replica keeps serving;
//! Ctrl-C stops everything it started and leaves no process behind.

use std::io::{BufRead, BufReader};
use std::process::{Command, Stdio};
use std::sync::mpsc;
use std::time::Duration;

use shardplane_dataplane as dp;
use shardplane_testkit::{ChildGuard, repo_root};

/// Processes whose command line mentions `needle`.
fn processes_with(needle: &str) -> Vec<(u32, String)> {
    std::fs::read_dir("/proc")
        .unwrap()
        .filter_map(|e| {
            let pid: u32 = e.ok()?.file_name().to_str()?.parse().ok()?;
            let cmdline = std::fs::read(format!("/proc/{pid}/cmdline")).ok()?;
            let cmdline = String::from_utf8_lossy(&cmdline).replace('\0', " ");
            (cmdline.contains(needle) && pid != std::process::id()).then_some((pid, cmdline))
        })
        .collect()
}

fn chat(key: &str, model: &str) -> (u16, String) {
    let body = serde_json::json!({
        "model": model,
        "messages": [{"role": "user", "content": "Say hello."}],
        "max_tokens": 8,
    });
    let runtime = tokio::runtime::Runtime::new().unwrap();
    runtime.block_on(async {
        let r = shardplane_models::http_client()
            .unwrap()
            .post("http://127.0.0.1:8080/v1/chat/completions")
            .bearer_auth(key)
            .header("content-type", "application/json")
            .body(body.to_string())
            .send()
            .await
            .unwrap();
        (r.status().as_u16(), r.text().await.unwrap())
    })
}

#[test]
fn up_serves_the_quickstart_survives_an_agent_and_stops_everything_on_ctrl_c() {
    let state = tempfile::tempdir().unwrap();
    let state_path = state.path().to_str().unwrap().to_string();
    let (mut up, lines) = spawn_up(&state_path);
    let mut printed = Vec::new();
    let mut read_until =
        |marker: &str, within: Duration| read_lines_until(&lines, &mut printed, marker, within);

    let shown = read_until("Press Ctrl-C", Duration::from_secs(300));
    for expected in [
        "default/smollm2-daily: 2/2 ready",
        "default/smollm2-pipeline: 1/1 ready",
        "smollm2 says:",
        "smollm2-pipeline says:",
        "OpenAI base URL: http://127.0.0.1:8080/v1",
        "kubectl get shardplane",
        "Web view: http://127.0.0.1:9090/ui",
        "shardplane status --watch --gateway-metrics http://127.0.0.1:9092/metrics",
    ] {
        assert!(shown.contains(expected), "no {expected:?} in:\n{shown}");
    }
    let keys = std::fs::read_to_string(state.path().join("api-keys")).unwrap();
    let key = keys
        .lines()
        .next()
        .unwrap()
        .split_once(':')
        .unwrap()
        .1
        .trim();
    for model in ["smollm2", "smollm2-pipeline"] {
        let (status, body) = chat(key, model);
        assert_eq!(status, 200, "{model}: {body}");
    }
    assert_eq!(chat("sk-wrong", "smollm2").0, 401);

    // `shardplane status` as `up` suggests it: the deployments with their
    // traffic from the gateway's metrics.
    let kubeconfig = shown
        .lines()
        .find_map(|l| l.trim().strip_prefix("export KUBECONFIG="))
        .unwrap()
        .to_string();
    let status = Command::new(env!("CARGO_BIN_EXE_shardplane"))
        .args([
            "status",
            "--gateway-metrics",
            "http://127.0.0.1:9092/metrics",
        ])
        .env("KUBECONFIG", &kubeconfig)
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&status.stdout);
    eprintln!("shardplane status:\n{text}");
    assert!(
        status.status.success(),
        "{text}{}",
        String::from_utf8_lossy(&status.stderr)
    );
    for expected in [
        "default/smollm2-daily  model smollm2-135m  2/2 ready",
        "default/smollm2-pipeline  model smollm2-135m  1/1 ready",
    ] {
        assert!(text.contains(expected), "no {expected:?} in:\n{text}");
    }
    assert_eq!(
        text.matches("  traffic ").count(),
        2,
        "each deployment's traffic:\n{text}"
    );
    assert!(text.contains("TTFT p50 "), "{text}");

    // Each agent runs as a node identity of its own: node-0's renews its own
    // Lease but may not touch node-1's (the operator's admission webhook
    // refuses), and an invalid spec is refused at apply time, naming the
    // field and the reason.
    let node0 = state.path().join("identities/node-0.kubeconfig");
    let annotate = |lease: &str| {
        Command::new("kubectl")
            .arg("--kubeconfig")
            .arg(&node0)
            .args(["annotate", "--overwrite", "lease", lease])
            .args(["-n", "shardplane-node-lease", "example.com/probe=1"])
            .output()
            .unwrap()
    };
    let own = annotate("node-0");
    assert!(
        own.status.success(),
        "{}",
        String::from_utf8_lossy(&own.stderr)
    );
    let other = annotate("node-1");
    let said = String::from_utf8_lossy(&other.stderr);
    assert!(!other.status.success(), "node-0 annotated node-1's Lease");
    assert!(
        said.contains("denied the request: node \"node-0\" may not update leases \"node-1\""),
        "{said}"
    );
    // Nor rewrite the endpoint of a Shard bound to another node (which would
    // send that node's prompts to it).
    let kubectl = |kubeconfig: &std::path::Path, args: &[&str]| {
        Command::new("kubectl")
            .arg("--kubeconfig")
            .arg(kubeconfig)
            .args(args)
            .output()
            .unwrap()
    };
    let admin = std::path::Path::new(&kubeconfig);
    let theirs = kubectl(
        admin,
        &[
            "get",
            "shards",
            "-A",
            "-l",
            "shardplane.dev/node=node-2",
            "-o",
            "jsonpath={.items[0].metadata.namespace}/{.items[0].metadata.name}",
        ],
    );
    let theirs = String::from_utf8_lossy(&theirs.stdout).to_string();
    let (ns, shard) = theirs.split_once('/').expect("node-2 holds a Shard");
    let hijack = kubectl(
        &node0,
        &[
            "patch",
            "shard",
            shard,
            "-n",
            ns,
            "--subresource=status",
            "--type=merge",
            "-p",
            r#"{"status":{"endpoint":"127.0.0.1:1"}}"#,
        ],
    );
    let said = String::from_utf8_lossy(&hijack.stderr);
    assert!(!hijack.status.success(), "node-0 rewrote a Shard of node-2");
    assert!(
        said.contains(&format!("node \"node-0\" may not update shards/status \"{shard}\": the Shard is bound to \"node-2\"")),
        "{said}"
    );
    let apply = |yaml: &str| {
        let mut apply = Command::new("kubectl")
            .args(["--kubeconfig", kubeconfig.as_str(), "apply", "-f", "-"])
            .stdin(std::process::Stdio::piped())
            .stdout(std::process::Stdio::piped())
            .stderr(std::process::Stdio::piped())
            .spawn()
            .unwrap();
        std::io::Write::write_all(apply.stdin.as_mut().unwrap(), yaml.as_bytes()).unwrap();
        apply.wait_with_output().unwrap()
    };
    let refused = apply(
        "apiVersion: shardplane.dev/v1alpha1\nkind: ModelDeployment\n\
         metadata: {name: loops, namespace: default}\n\
         spec: {model: smollm2-135m, nodePool: daily, strategy: whole, fallback: [{deployment: loops}]}\n",
    );
    let said = String::from_utf8_lossy(&refused.stderr);
    assert!(
        !refused.status.success(),
        "an invalid deployment was applied"
    );
    assert!(
        said.contains("spec.fallback[0].deployment: a deployment cannot fall back to itself"),
        "{said}"
    );
    // A name the default namespace serves cannot be claimed from another.
    let taken = apply(
        "apiVersion: v1\nkind: Namespace\nmetadata: {name: team-b}\n---\n\
         apiVersion: shardplane.dev/v1alpha1\nkind: ModelDeployment\n\
         metadata: {name: mine, namespace: team-b}\n\
         spec: {model: smollm2-135m, nodePool: daily, strategy: whole, aliases: [smollm2]}\n",
    );
    let said = String::from_utf8_lossy(&taken.stderr);
    assert!(
        !taken.status.success(),
        "another namespace took a served name"
    );
    assert!(
        said.contains(
            "the name \"smollm2\" is served by default/smollm2-daily in another namespace"
        ),
        "{said}"
    );
    let runtime = tokio::runtime::Runtime::new().unwrap();

    // The data plane is TLS. node-0 serves a certificate the operator
    // signed (the CA is published for clients), naming node-0: a client
    // that meant another node refuses it, and plain TCP gets no answer.
    // node-0 requires a certificate of its callers too: a peer's (node-1's
    // issued files) is taken, the CA and the token alone are not.
    let ca = kubectl(
        admin,
        &[
            "get",
            "configmap",
            "shardplane-data-plane-ca",
            "-n",
            "shardplane",
            "-o",
            "jsonpath={.data.ca\\.crt}",
        ],
    );
    let ca_pem = String::from_utf8_lossy(&ca.stdout).to_string();
    assert!(
        ca_pem.contains("BEGIN CERTIFICATE"),
        "no CA published: {ca_pem}"
    );
    let token = dp::Token::from_file(&state.path().join("data-plane-token")).unwrap();
    let anonymous = dp::tls::Tls::new(&dp::tls::Material {
        ca_pem,
        identity: None,
    })
    .unwrap();
    let node1_files = dp::tls::Material::read_dir(&state.path().join("cache/node-1-tls")).unwrap();
    let peer = dp::tls::Tls::new(&node1_files).unwrap();
    let ping = |tls: &std::sync::Arc<dp::tls::Tls>, node: Option<&str>| {
        runtime.block_on(async {
            let channel = dp::channel("127.0.0.1:7100", node.map(|n| (tls, n))).unwrap();
            let mut client = dp::client(channel, token.clone());
            let call = client.ping(dp::PingRequest::default());
            match tokio::time::timeout(Duration::from_secs(10), call).await {
                Ok(Ok(_)) => Ok(()),
                Ok(Err(e)) => Err(format!("{e:?}")),
                Err(_) => Err("timed out".to_string()),
            }
        })
    };
    ping(&peer, Some("node-0")).expect("a TLS call to node-0");
    let wrong = ping(&peer, Some("node-1")).unwrap_err();
    assert!(wrong.contains("NotValidForName"), "{wrong}");
    assert!(
        ping(&anonymous, Some("node-0")).is_err(),
        "node-0 answered a caller without a certificate"
    );
    assert!(ping(&peer, None).is_err(), "node-0 answered plain TCP");
    // The gateway (which answered the chats above through node-0 and
    // node-1) asked for its client certificate as a gateway.
    let reasons = kubectl(
        admin,
        &[
            "get",
            "csr",
            "-o",
            "jsonpath={.items[*].status.conditions[*].reason}",
        ],
    );
    let reasons = String::from_utf8_lossy(&reasons.stdout);
    assert!(reasons.contains("GatewayIdentity"), "{reasons}");
    // node-0 counts the refused handshakes and shows when its certificate
    // expires (a week from now: the agents ask for seven days).
    let agent_metrics = || scrape(&runtime, "http://127.0.0.1:9100/metrics");
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    let seen = loop {
        let seen = agent_metrics();
        if seen.contains("shardplane_agent_data_plane_handshake_failures_total{error=\"refused\"}")
            || std::time::Instant::now() > deadline
        {
            break seen;
        }
        std::thread::sleep(Duration::from_millis(200));
    };
    assert!(
        seen.contains("shardplane_agent_data_plane_handshake_failures_total{error=\"refused\"}"),
        "{seen}"
    );
    let expiry: f64 = seen
        .lines()
        .find_map(|l| {
            l.strip_prefix("shardplane_agent_data_plane_certificate_expiry_timestamp_seconds ")
        })
        .expect("the certificate's expiry")
        .trim()
        .parse()
        .unwrap();
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_secs_f64();
    assert!(
        (now + 6.0 * 86400.0..now + 8.0 * 86400.0).contains(&expiry),
        "expires at {expiry}, now {now}"
    );
    // node-0's identity cannot get a certificate naming node-1: the
    // operator denies its request, saying why.
    let csr_key = rcgen::KeyPair::generate().unwrap();
    let request = rcgen::CertificateParams::new(vec!["node-1".to_string()])
        .unwrap()
        .serialize_request(&csr_key)
        .unwrap()
        .pem()
        .unwrap();
    let csr = format!(
        "apiVersion: certificates.k8s.io/v1\nkind: CertificateSigningRequest\n\
         metadata: {{name: node-0-claims-node-1}}\n\
         spec: {{signerName: shardplane.dev/data-plane, usages: [digital signature, server auth], request: {}}}\n",
        base64::Engine::encode(&base64::engine::general_purpose::STANDARD, request)
    );
    let mut create = Command::new("kubectl")
        .arg("--kubeconfig")
        .arg(&node0)
        .args(["create", "-f", "-"])
        .stdin(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    std::io::Write::write_all(create.stdin.as_mut().unwrap(), csr.as_bytes()).unwrap();
    let created = create.wait_with_output().unwrap();
    assert!(
        created.status.success(),
        "{}",
        String::from_utf8_lossy(&created.stderr)
    );
    let deadline = std::time::Instant::now() + Duration::from_secs(30);
    loop {
        let answer = kubectl(
            &node0,
            &[
                "get",
                "csr",
                "node-0-claims-node-1",
                "-o",
                "jsonpath={.status.conditions[0].type}/{.status.conditions[0].reason}",
            ],
        );
        let answer = String::from_utf8_lossy(&answer.stdout).to_string();
        if answer == "Denied/WrongNames" {
            break;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "node-0's request for node-1 is {answer:?}"
        );
        std::thread::sleep(Duration::from_millis(300));
    }

    // Each refusal is counted on the operator's metrics.
    let metrics = scrape(&runtime, "http://127.0.0.1:9090/metrics");
    for (kind, outcome) in [
        ("leases", "forbidden"),
        ("shards", "forbidden"),
        ("modeldeployments", "invalid"),
        ("modeldeployments", "conflict"),
        ("inferencenodes", "allowed"),
    ] {
        let series = format!(
            "shardplane_operator_admission_reviews_total{{kind=\"{kind}\",outcome=\"{outcome}\"}}"
        );
        assert!(
            metrics.contains(&series),
            "no {series} in the operator's metrics"
        );
    }
    // The webhook's answer times are measured (their mean, for the record).
    let total = |name: &str| -> f64 {
        metrics
            .lines()
            .filter(|l| l.starts_with(name))
            .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
            .sum()
    };
    let count = total("shardplane_operator_admission_review_duration_seconds_count");
    let sum = total("shardplane_operator_admission_review_duration_seconds_sum");
    assert!(count >= 5.0, "{count} reviews timed");
    eprintln!(
        "admission webhook: {count} reviews, {:.2} ms each on average",
        1000.0 * sum / count
    );
    // Three agents' certificates issued, node-0's claim on node-1 denied.
    for outcome in ["issued", "denied"] {
        let series =
            format!("shardplane_operator_data_plane_certificates_total{{outcome=\"{outcome}\"}}");
        assert!(
            metrics.contains(&series),
            "no {series} in the operator's metrics"
        );
    }

    // `shardplane bench --gateway` as a client of the gateway: every stream
    // of a concurrent sweep runs to exactly the tokens asked for
    // (`ignore_eos` reaches the agents), and the figures are filled in.
    let bench = Command::new(env!("CARGO_BIN_EXE_shardplane"))
        .args(["bench", "--json", "--runs", "1", "--gen-tokens", "8"])
        .args(["--concurrency", "1,4", "--prompt-tokens", "20"])
        .args([
            "--gateway",
            "http://127.0.0.1:8080",
            "--gateway-model",
            "smollm2",
        ])
        .arg("--model")
        .arg(shardplane_testkit::test_model())
        .env("SHARDPLANE_API_KEY", key)
        .output()
        .unwrap();
    let said = String::from_utf8_lossy(&bench.stdout);
    assert!(
        bench.status.success(),
        "{said}{}",
        String::from_utf8_lossy(&bench.stderr)
    );
    let report: serde_json::Value = serde_json::from_str(&said).unwrap();
    assert_eq!(report["generated_tokens"], 8, "{report}");
    assert_eq!(report["concurrent"][0]["sequences"], 4, "{report}");
    for figure in [
        &report["decode_tokens_per_second"]["median"],
        &report["concurrent"][0]["decode_tokens_per_second"]["median"],
        &report["concurrent"][0]["time_to_first_token_ms"]["p99"],
    ] {
        assert!(figure.as_f64().unwrap() > 0.0, "{report}");
    }

    // The web view in a real browser: every node, deployment and stage,
    // live traffic; then a daily agent is killed while the page is open and
    // its node turns NotReady there.
    let agent = processes_with("--node-name node-0 ");
    assert_eq!(agent.len(), 1, "{agent:?}");
    let shots = std::path::Path::new(env!("CARGO_TARGET_TMPDIR")).join("web-view");
    std::fs::create_dir_all(&shots).unwrap();
    let browser = Command::new(shardplane_testkit::venv_python())
        .arg(repo_root().join("cli/tests/clients/web_view.py"))
        .env("VIEW", "http://127.0.0.1:9090/ui")
        .env("GATEWAY", "http://127.0.0.1:8080/v1")
        .env("API_KEY", key)
        .env("NODES", "node-0,node-1,node-2,node-3,node-4")
        .env(
            "DEPLOYMENTS",
            "default/smollm2-daily,default/smollm2-pipeline",
        )
        .env("STAGES", "5")
        .env("KILL_PID", agent[0].0.to_string())
        .env("KILL_NODE", "node-0")
        .env("SCREENSHOTS", &shots)
        .output()
        .unwrap();
    let said = format!(
        "{}{}",
        String::from_utf8_lossy(&browser.stdout),
        String::from_utf8_lossy(&browser.stderr)
    );
    eprintln!("{said}");
    assert!(browser.status.success(), "the browser test failed:\n{said}");

    // `up` reports the lost agent and the other replica serves on.
    read_until("agent-0 (signal: 9", Duration::from_secs(10));
    for _ in 0..5 {
        let (status, body) = chat(key, "smollm2");
        assert_eq!(status, 200, "{body}");
    }

    // Ctrl-C: everything stops, in order, and nothing is left.
    assert!(!processes_with(&state_path).is_empty());
    up.signal("-INT");
    read_until(
        "nothing of this run is left running",
        Duration::from_secs(60),
    );
    let status = up.0.wait().unwrap();
    assert!(status.success(), "up exited with {status}");
    let left = processes_with(&state_path);
    assert!(left.is_empty(), "still running: {left:?}");

    // `up` again on the same state (the README's command run a second time):
    // a new control plane with a new CA; the agents' kept certificates are
    // of the old one and must not be served (the gateway would refuse them).
    let (mut again, lines) = spawn_up(&state_path);
    let mut printed = Vec::new();
    read_lines_until(
        &lines,
        &mut printed,
        "Press Ctrl-C",
        Duration::from_secs(300),
    );
    // The API keys are kept in the state: the first run's still opens.
    for model in ["smollm2", "smollm2-pipeline"] {
        let (status, body) = chat(key, model);
        assert_eq!(status, 200, "{model} after a second `up`: {body}");
    }
    again.signal("-INT");
    read_lines_until(
        &lines,
        &mut printed,
        "nothing of this run is left running",
        Duration::from_secs(60),
    );
    assert!(again.0.wait().unwrap().success());
}

/// `shardplane up --no-setup` on `state`, and the lines it prints.
fn spawn_up(state: &str) -> (ChildGuard, mpsc::Receiver<String>) {
    let child = Command::new(env!("CARGO_BIN_EXE_shardplane"))
        .args(["up", "--no-setup", "--state", state])
        .current_dir(repo_root())
        .stdout(Stdio::piped())
        .spawn()
        .unwrap();
    let mut up = ChildGuard(child);
    let stdout = up.0.stdout.take().unwrap();
    let (lines_tx, lines) = mpsc::channel::<String>();
    std::thread::spawn(move || {
        for line in BufReader::new(stdout).lines().map_while(Result::ok) {
            if lines_tx.send(line).is_err() {
                break;
            }
        }
    });
    (up, lines)
}

/// Reads `lines` into `printed` until one holds `marker` (within `within`),
/// and gives all printed so far.
fn read_lines_until(
    lines: &mpsc::Receiver<String>,
    printed: &mut Vec<String>,
    marker: &str,
    within: Duration,
) -> String {
    let deadline = std::time::Instant::now() + within;
    loop {
        let left = deadline.saturating_duration_since(std::time::Instant::now());
        match lines.recv_timeout(left) {
            Ok(line) => {
                let done = line.contains(marker);
                printed.push(line);
                if done {
                    return printed.join("\n");
                }
            }
            Err(_) => panic!("no {marker:?} in:\n{}", printed.join("\n")),
        }
    }
}

/// The README's main command on a machine where nothing is cached, up to what
/// can be checked without compiling kube-apiserver: `up` run with the
/// variables `cargo run` gives it (`OUT_DIR` among them) and an empty cache
/// starts `scripts/setup.sh` without them, and the kube-apiserver build step
/// (source fetched as on a cold machine, `make -n`) writes only in its own
/// tree. That build once wrote under cargo's `OUT_DIR` and failed on every
/// new machine while the tests, run with a warm cache, passed.
#[test]
fn the_readme_main_command_starts_setup_cleanly_under_cargo_run_on_a_cold_machine() {
    let readme = std::fs::read_to_string(repo_root().join("README.md")).unwrap();
    let main = "cargo run --release --locked -p shardplane -- up";
    assert!(
        readme.lines().any(|l| l.trim() == main),
        "the README's main command is no longer `{main}`: check it as this test does"
    );
    let cold = tempfile::tempdir().unwrap();
    let cargo_out = cold.path().join("target/release/build/shardplane-0123/out");
    let out = Command::new(env!("CARGO_BIN_EXE_shardplane"))
        .arg("up")
        .current_dir(repo_root())
        .env("SHARDPLANE_SETUP", "check")
        .env("SHARDPLANE_CACHE", cold.path().join("cache"))
        // What `cargo run` sets for the program it runs.
        .env("OUT_DIR", &cargo_out)
        .env("CARGO", "cargo")
        .env("CARGO_MANIFEST_DIR", repo_root().join("cli"))
        .env("CARGO_PKG_NAME", "shardplane")
        .env("CARGO_CRATE_NAME", "shardplane")
        .output()
        .unwrap();
    let (stdout, stderr) = (
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr),
    );
    assert!(
        out.status.success(),
        "up failed ({}):\n{stdout}\n{stderr}",
        out.status
    );
    assert!(
        stderr.contains("checked: the kube-apiserver build writes only under its source tree"),
        "{stderr}"
    );
    assert!(stdout.contains("setup checked"), "{stdout}");
    assert!(
        !cold.path().join("target").exists(),
        "something wrote under cargo's OUT_DIR"
    );
}

/// The text a metrics endpoint serves.
fn scrape(runtime: &tokio::runtime::Runtime, url: &str) -> String {
    runtime.block_on(async {
        let r = shardplane_models::http_client()
            .unwrap()
            .get(url)
            .send()
            .await
            .unwrap();
        r.text().await.unwrap()
    })
}
