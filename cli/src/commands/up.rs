//! `shardplane up`: a local cluster on this machine, from a checkout of the
//! repository. It installs what it needs (the cached set-up the tests use),
//! starts a real control plane, the operator, the gateway and node agents,
//! applies the quickstart, shows progress until every deployment is Ready,
//! has each served model answer once through the gateway, prints how to
//! chat, and on Ctrl-C stops everything it started, in order.

use std::collections::BTreeMap;
use std::fs::File;
use std::io::Write;
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Stdio};
use std::time::{Duration, Instant};

use anyhow::{Context, bail};
use clap::Args;
use kube::api::ListParams;
use kube::{Api, ResourceExt};
use shardplane_crds::{CONDITION_READY, InferenceNode, ModelDeployment};

use super::agent_kubeconfig::write_private;
use super::kube_client::client;
use super::process::command;
use shardplane_operator::conditions::is_true;

/// Options of `shardplane up`.
#[derive(Args, Debug)]
pub struct UpArgs {
    /// Node agents to start: the first two join the daily pool, the rest the
    /// reasoning pool. Five let every served model survive losing any one
    /// agent (two dedicated daily nodes, a 3-stage pipeline that a lost
    /// stage's node can be repaired from).
    #[arg(long, default_value_t = 5, value_parser = clap::value_parser!(u32).range(3..=32))]
    agents: u32,
    /// The manifests to apply.
    #[arg(long, default_value = "manifests/quickstart")]
    manifests: PathBuf,
    /// Where the control plane, logs, caches, token and API key live.
    #[arg(long, env = "SHARDPLANE_UP_DIR")]
    state: Option<PathBuf>,
    /// Where the gateway listens.
    #[arg(long, default_value = "127.0.0.1:8080")]
    gateway_address: String,
    /// Seconds to wait for every deployment to become Ready.
    #[arg(long, default_value_t = 300)]
    timeout: u64,
    /// Skip `scripts/setup.sh` (when it already ran).
    #[arg(long)]
    no_setup: bool,
}

/// Where the quickstart Model expects the test model file.
const MODELS: &str = "/var/lib/shardplane/models";

/// Runs until Ctrl-C or SIGTERM.
pub fn run(args: UpArgs) -> anyhow::Result<()> {
    let repo = repo_root()?;
    let state = match &args.state {
        Some(s) => s.clone(),
        None => home()?.join(".cache/shardplane/up"),
    };
    let manifests = if args.manifests.is_absolute() {
        args.manifests.clone()
    } else {
        repo.join(&args.manifests)
    };
    if !manifests.exists() {
        bail!("no manifests at {}", manifests.display());
    }
    let bin = std::env::current_exe().context("cannot find this binary")?;
    std::fs::create_dir_all(state.join("logs"))?;

    if !args.no_setup {
        step("installing what is needed (cached after the first run)");
        script(&repo, &["scripts/setup.sh"])?;
        if std::env::var_os("SHARDPLANE_SETUP").is_some_and(|v| v == "check") {
            // scripts/setup.sh only checked what a cold first run depends on.
            step("setup checked (SHARDPLANE_SETUP=check); starting nothing");
            return Ok(());
        }
    }
    script(&repo, &["scripts/model.sh", "--install-to", MODELS])?;

    let mut cluster = Cluster {
        repo: repo.clone(),
        state: state.clone(),
        children: Vec::new(),
        control_plane: false,
    };
    // A control plane left by an earlier run that was killed.
    let _ = cluster.control_plane_script(&["stop"]);
    step("starting the control plane (etcd, kube-apiserver)");
    let kubeconfig = PathBuf::from(cluster.control_plane_script(&["start"])?.trim());
    cluster.control_plane = true;
    let kubectl = |args: &[&str], input: Option<&str>| kubectl(&kubeconfig, args, input);

    let crds = command(&bin).arg("crds").output()?;
    kubectl(
        &["apply", "-f", "-"],
        Some(&String::from_utf8(crds.stdout)?),
    )?;
    // kubectl's wait fails at once ("conditions accessor error") on a CRD
    // the API server has not written any status for yet: ask again.
    let wait = [
        "wait",
        "--for=condition=Established",
        "--timeout=60s",
        "crd",
        "--all",
    ];
    let mut tries = 0;
    while let Err(e) = kubectl(&wait, None) {
        tries += 1;
        if tries == 5 {
            return Err(e);
        }
        std::thread::sleep(std::time::Duration::from_secs(1));
    }

    let token = state.join("data-plane-token");
    if !token.exists() {
        write_private(&token, &random_hex(24))?;
    }
    let keys = state.join("api-keys");
    if !keys.exists() {
        write_private(&keys, &format!("local:sk-{}\n", random_hex(16)))?;
    }
    let api_key = std::fs::read_to_string(&keys)?
        .lines()
        .next()
        .and_then(|l| l.split_once(':').map(|(_, k)| k.trim().to_string()))
        .context("the API key file is empty")?;

    step(&format!(
        "starting the operator, {} agents and the gateway (logs in {})",
        args.agents,
        state.join("logs").display()
    ));
    let runtime = tokio::runtime::Runtime::new()?;
    step("minting one identity per node agent (each may write only its own node's objects)");
    let identities = runtime.block_on(node_identities(&kubeconfig, &state, args.agents))?;
    let kc = kubeconfig.to_str().context("kubeconfig path")?;
    let tf = token.to_str().context("token path")?;
    cluster.spawn(
        &bin,
        "operator",
        &[
            "operator",
            "--kubeconfig",
            kc,
            "--admin-address",
            "127.0.0.1:9090",
            "--gateway-url",
            &format!("http://{}/v1", args.gateway_address),
            "--gateway-metrics",
            "http://127.0.0.1:9092/metrics",
            "--webhook-address",
            WEBHOOK,
            "--webhook-url",
            &format!("https://{WEBHOOK}"),
            // The gateway below runs as the control plane's admin: its
            // client-only data-plane certificate is asked for as that user.
            "--data-plane-gateway-user",
            "admin",
        ],
    )?;
    // The agents share this machine's cores (see `threads`).
    let threads = super::threads::share(args.agents as usize).to_string();
    for (i, identity) in (0..args.agents).zip(&identities) {
        let tier = if i < 2 { "daily" } else { "reasoning" };
        let cache = state.join(format!("cache/node-{i}"));
        cluster.spawn(
            &bin,
            &format!("agent-{i}"),
            &[
                "agent",
                "--kubeconfig",
                identity.to_str().context("identity path")?,
                "--node-name",
                &format!("node-{i}"),
                "--label",
                &format!("tier.shardplane.dev/{tier}=true"),
                "--admin-address",
                &format!("127.0.0.1:{}", 9100 + i),
                "--data-plane-address",
                &format!("127.0.0.1:{}", 7100 + i),
                "--token-file",
                tf,
                "--cache-dir",
                cache.to_str().context("cache path")?,
                "--memory-reserve",
                "1Gi",
                "--threads",
                &threads,
            ],
        )?;
    }
    cluster.spawn(
        &bin,
        "gateway",
        &[
            "gateway",
            "--kubeconfig",
            kc,
            "--listen",
            &args.gateway_address,
            "--admin-address",
            "127.0.0.1:9092",
            "--token-file",
            tf,
            "--data-plane-ca-namespace",
            AGENTS.0,
            "--api-keys-file",
            keys.to_str().context("keys path")?,
        ],
    )?;

    let outcome = runtime.block_on(async {
        let client = client(Some(&kubeconfig)).await?;
        // Every agent registered and Ready first, so the planner sees the
        // whole pool (a pipeline placed on fewer nodes stays so).
        tokio::select! {
            r = wait_nodes(&client, args.agents, &mut cluster) => r?,
            _ = shutdown() => return Ok(false),
        }
        step(&format!("applying {}", manifests.display()));
        print!(
            "{}",
            kubectl(&["apply", "-f", manifests.to_str().context("path")?], None)?
        );
        tokio::select! {
            r = wait_ready(&client, Duration::from_secs(args.timeout), &mut cluster) => r?,
            _ = shutdown() => return Ok(false),
        }
        print!("{}", kubectl(&["get", "shardplane"], None)?);
        let served = served_names(&client).await?;
        for name in &served {
            let answer = chat(&args.gateway_address, &api_key, name).await;
            match answer {
                Ok(text) => println!("\n{name} says: {}", text.trim()),
                Err(e) => println!("\n{name} did not answer: {e:#}"),
            }
        }
        print_howto(&args, &kubeconfig, &keys, &api_key, &served);
        // A component that dies is reported; the rest carry on (the
        // operator re-places what a lost agent held) until Ctrl-C.
        let stop = shutdown();
        tokio::pin!(stop);
        loop {
            tokio::select! {
                _ = &mut stop => break,
                who = cluster.reap() => println!("\n{who} exited; see its log in {}", cluster.state.join("logs").display()),
            }
        }
        anyhow::Ok(true)
    });
    drop(runtime);
    cluster.stop();
    outcome.map(|_| ())
}

/// Where the operator serves its admission webhook.
const WEBHOOK: &str = "127.0.0.1:9443";
/// The namespace and ServiceAccount of the agents' shared roles.
const AGENTS: (&str, &str) = ("shardplane", "shardplane-agent");

/// The agents' roles, then a ServiceAccount per node (`node-<i>`) holding
/// them and a kubeconfig for each, in `state/identities`.
async fn node_identities(
    kubeconfig: &Path,
    state: &Path,
    agents: u32,
) -> anyhow::Result<Vec<PathBuf>> {
    use super::agent_kubeconfig::{cluster_entry, current_cluster, kubeconfig_text, request_token};
    use super::node_identity::{ensure_agent_rbac, mint};
    let (namespace, shared) = AGENTS;
    let client = client(Some(kubeconfig)).await?;
    ensure_agent_rbac(&client, namespace, shared).await?;
    let admin = kube::config::Kubeconfig::read_from(kubeconfig)?;
    let cluster = current_cluster(&admin)?;
    let server = cluster
        .server
        .clone()
        .context("the kubeconfig names no server")?;
    let dir = state.join("identities");
    std::fs::create_dir_all(&dir)?;
    let mut paths = Vec::new();
    for i in 0..agents {
        let node = format!("node-{i}");
        let account = mint(&client, namespace, shared, &node).await?;
        let year = Duration::from_secs(365 * 86400);
        let (token, expires) = request_token(&client, namespace, &account, year).await?;
        let entry = cluster_entry(&cluster, server.clone())?;
        let text = kubeconfig_text(entry, namespace, &account, &token, expires.as_deref())?;
        let path = dir.join(format!("{node}.kubeconfig"));
        write_private(&path, &text)?;
        paths.push(path);
    }
    Ok(paths)
}

/// What this run started; stopped in reverse order on drop.
struct Cluster {
    repo: PathBuf,
    state: PathBuf,
    children: Vec<(String, Child)>,
    control_plane: bool,
}

impl Cluster {
    fn control_plane_script(&self, args: &[&str]) -> anyhow::Result<String> {
        let state = self.state.to_str().context("state path")?;
        let mut all = vec!["scripts/control-plane.sh", args[0], state];
        all.extend(&args[1..]);
        script(&self.repo, &all)
    }

    fn spawn(&mut self, bin: &Path, name: &str, args: &[&str]) -> anyhow::Result<()> {
        let log = File::create(self.state.join(format!("logs/{name}.log")))?;
        // setpriv (util-linux) sets the parent-death signal: should `up`
        // itself be killed, the component is stopped too.
        let mut command = command("setpriv");
        command
            .args(["--pdeathsig", "TERM", "--"])
            .arg(bin)
            .args(args)
            .stdin(Stdio::null())
            .stdout(log.try_clone()?)
            .stderr(log)
            // Its own process group: Ctrl-C reaches `up`, which stops the
            // components in order (gateway, agents, operator).
            .process_group(0);
        let child = command
            .spawn()
            .with_context(|| format!("cannot start {name}"))?;
        self.children.push((name.to_string(), child));
        Ok(())
    }

    /// Waits `d`, failing if a component exits meanwhile.
    async fn pause(&mut self, d: Duration) -> anyhow::Result<()> {
        tokio::select! {
            who = self.reap() => bail!("{who} exited; see its log in {}", self.state.join("logs").display()),
            _ = tokio::time::sleep(d) => Ok(()),
        }
    }

    /// Waits for a component to exit, forgets it and returns what it was.
    async fn reap(&mut self) -> String {
        loop {
            let exited = self
                .children
                .iter_mut()
                .position(|(_, child)| matches!(child.try_wait(), Ok(Some(_))));
            if let Some(i) = exited {
                let (name, mut child) = self.children.remove(i);
                let status = child.wait().map(|s| s.to_string()).unwrap_or_default();
                return format!("{name} ({status})");
            }
            tokio::time::sleep(Duration::from_millis(500)).await;
        }
    }

    fn stop(&mut self) {
        step("stopping");
        // Gateway first, then the agents (they drain), then the operator.
        for (name, child) in self.children.iter_mut().rev() {
            let _ = command("kill")
                .args(["-TERM", &child.id().to_string()])
                .stderr(Stdio::null())
                .status();
            let deadline = Instant::now() + Duration::from_secs(15);
            loop {
                match child.try_wait() {
                    Ok(Some(_)) => break,
                    Ok(None) if Instant::now() < deadline => {
                        std::thread::sleep(Duration::from_millis(100))
                    }
                    _ => {
                        eprintln!("{name} did not stop in 15 s: killed");
                        let _ = child.kill();
                        let _ = child.wait();
                        break;
                    }
                }
            }
        }
        self.children.clear();
        if self.control_plane {
            let _ = self.control_plane_script(&["stop"]);
            self.control_plane = false;
        }
        println!("stopped; nothing of this run is left running");
    }
}

impl Drop for Cluster {
    fn drop(&mut self) {
        if !self.children.is_empty() || self.control_plane {
            self.stop();
        }
    }
}

/// Shows each deployment's progress as it changes until all are Ready.
async fn wait_ready(
    client: &kube::Client,
    within: Duration,
    cluster: &mut Cluster,
) -> anyhow::Result<()> {
    let api: Api<ModelDeployment> = Api::all(client.clone());
    let started = Instant::now();
    let mut shown: BTreeMap<String, String> = BTreeMap::new();
    loop {
        let list = api.list(&ListParams::default()).await?;
        let mut all_ready = !list.items.is_empty();
        for d in &list.items {
            let (line, ready) = progress(d);
            all_ready &= ready;
            let key = format!("{}/{}", d.namespace().unwrap_or_default(), d.name_any());
            if shown.get(&key) != Some(&line) {
                println!("  [{:>3}s] {key}: {line}", started.elapsed().as_secs());
                shown.insert(key, line);
            }
        }
        if all_ready {
            return Ok(());
        }
        if started.elapsed() > within {
            bail!(
                "the deployments did not become Ready in {} s; see the logs in {}",
                within.as_secs(),
                cluster.state.join("logs").display()
            );
        }
        cluster.pause(Duration::from_secs(1)).await?;
    }
}

/// Waits until the agents' InferenceNodes (`node-0`…) are all Ready.
async fn wait_nodes(
    client: &kube::Client,
    agents: u32,
    cluster: &mut Cluster,
) -> anyhow::Result<()> {
    let api: Api<InferenceNode> = Api::all(client.clone());
    let started = Instant::now();
    let mut shown = usize::MAX;
    loop {
        let ready = api
            .list(&ListParams::default())
            .await?
            .items
            .iter()
            .filter(|n| {
                n.name_any()
                    .strip_prefix("node-")
                    .and_then(|i| i.parse::<u32>().ok())
                    .is_some_and(|i| i < agents)
                    && n.status
                        .as_ref()
                        .is_some_and(|s| is_true(&s.conditions, CONDITION_READY))
            })
            .count();
        if ready != shown {
            println!(
                "  [{:>3}s] {ready}/{agents} agents Ready",
                started.elapsed().as_secs()
            );
            shown = ready;
        }
        if ready == agents as usize {
            return Ok(());
        }
        if started.elapsed() > Duration::from_secs(120) {
            bail!(
                "only {ready} of {agents} agents became Ready in 120 s; see the logs in {}",
                cluster.state.join("logs").display()
            );
        }
        cluster.pause(Duration::from_millis(500)).await?;
    }
}

/// One line on a deployment, and whether it is Ready.
fn progress(d: &ModelDeployment) -> (String, bool) {
    let Some(status) = &d.status else {
        return ("waiting for the operator".into(), false);
    };
    let ready = status
        .conditions
        .iter()
        .find(|c| c.type_ == CONDITION_READY);
    let is_ready = ready.is_some_and(|c| c.status == "True");
    let mut stages: Vec<String> = Vec::new();
    for i in &status.instances {
        for s in &i.stages {
            let phase = s.phase.as_ref().map_or("Pending".into(), |p| p.to_string());
            stages.push(format!("{}@{} {phase}", s.layers, s.node));
        }
    }
    let why = ready
        .filter(|_| !is_ready)
        .map(|c| format!(" ({}: {})", c.reason, c.message))
        .unwrap_or_default();
    (
        format!(
            "{}/{} ready [{}]{why}",
            status.ready_replicas,
            d.spec.replicas,
            stages.join(", ")
        ),
        is_ready,
    )
}

/// The names the gateway serves the deployments under, as the operator
/// wrote them in each deployment's `status.endpoint`.
async fn served_names(client: &kube::Client) -> anyhow::Result<Vec<String>> {
    let api: Api<ModelDeployment> = Api::all(client.clone());
    api.list(&ListParams::default())
        .await?
        .items
        .iter()
        .map(|d| {
            d.status
                .as_ref()
                .and_then(|s| s.endpoint.as_ref())
                .map(|e| e.model.clone())
                .with_context(|| format!("{} has no status.endpoint", d.name_any()))
        })
        .collect()
}

async fn chat(address: &str, key: &str, model: &str) -> anyhow::Result<String> {
    let body = serde_json::json!({
        "model": model,
        "messages": [{"role": "user", "content": "In one sentence, what is a GPU?"}],
        "max_tokens": 48,
    });
    let response = shardplane_models::http_client()
        .map_err(anyhow::Error::msg)?
        .post(format!("http://{address}/v1/chat/completions"))
        .bearer_auth(key)
        .header("content-type", "application/json")
        .body(body.to_string())
        .timeout(Duration::from_secs(60))
        .send()
        .await?;
    let status = response.status();
    let value: serde_json::Value = serde_json::from_slice(&response.bytes().await?)?;
    if !status.is_success() {
        bail!("{status}: {value}");
    }
    Ok(value["choices"][0]["message"]["content"]
        .as_str()
        .unwrap_or_default()
        .to_string())
}

fn print_howto(args: &UpArgs, kubeconfig: &Path, keys: &Path, key: &str, served: &[String]) {
    let address = &args.gateway_address;
    let model = served.first().map_or("smollm2", String::as_str);
    println!(
        "
shardplane is up: a control plane, the operator, {agents} agents and the gateway.

Chat (OpenAI API; the Anthropic and Ollama APIs are on the same address):
  curl -s http://{address}/v1/chat/completions -H 'Authorization: Bearer {key}' \\
    -H 'content-type: application/json' \\
    -d '{{\"model\": \"{model}\", \"messages\": [{{\"role\": \"user\", \"content\": \"Why is the sky blue?\"}}]}}'
  OpenAI base URL: http://{address}/v1   models: {models}   API key in {keys}

Look:
  Web view: http://127.0.0.1:9090/ui   (nodes, links, instances, tokens/s; this machine only)
  export KUBECONFIG={kubeconfig}
  shardplane status --watch --gateway-metrics http://127.0.0.1:9092/metrics
  kubectl get shardplane
  kubectl get shards -o wide
  curl -s 127.0.0.1:9090/metrics | grep ^shardplane_

Press Ctrl-C to stop everything.",
        agents = args.agents,
        models = served.join(", "),
        keys = keys.display(),
        kubeconfig = kubeconfig.display(),
    );
}

async fn shutdown() {
    let mut term = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())
        .expect("a SIGTERM handler");
    tokio::select! {
        _ = tokio::signal::ctrl_c() => {}
        _ = term.recv() => {}
    }
}

fn step(what: &str) {
    println!("==> {what}");
    let _ = std::io::stdout().flush();
}

/// The checkout this runs from: the current directory or one above it.
fn repo_root() -> anyhow::Result<PathBuf> {
    let here = std::env::current_dir()?;
    here.ancestors()
        .find(|d| d.join("scripts/control-plane.sh").exists())
        .map(Path::to_path_buf)
        .with_context(|| {
            format!(
                "{} is not inside a shardplane checkout: `shardplane up` runs its scripts/ and manifests/",
                here.display()
            )
        })
}

fn home() -> anyhow::Result<PathBuf> {
    std::env::var_os("HOME")
        .map(PathBuf::from)
        .context("HOME is not set")
}

/// Runs `bash SCRIPT ARGS…` in the checkout; returns its output, fails with
/// what it printed on error.
fn script(repo: &Path, args: &[&str]) -> anyhow::Result<String> {
    let out = command("bash")
        .args(args)
        .current_dir(repo)
        .stderr(Stdio::inherit())
        .output()
        .with_context(|| format!("cannot run bash {}", args[0]))?;
    if !out.status.success() {
        bail!("{} failed ({})", args.join(" "), out.status);
    }
    Ok(String::from_utf8_lossy(&out.stdout).into_owned())
}

fn kubectl(kubeconfig: &Path, args: &[&str], input: Option<&str>) -> anyhow::Result<String> {
    let mut child = command("kubectl")
        .arg("--kubeconfig")
        .arg(kubeconfig)
        .args(args)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .context("cannot run kubectl: install kubectl (>= 1.28) on PATH")?;
    let mut stdin = child.stdin.take().expect("piped");
    if let Some(input) = input {
        stdin.write_all(input.as_bytes())?;
    }
    drop(stdin);
    let out = child.wait_with_output()?;
    if !out.status.success() {
        bail!(
            "kubectl {} failed: {}",
            args.join(" "),
            String::from_utf8_lossy(&out.stderr)
        );
    }
    Ok(String::from_utf8_lossy(&out.stdout).into_owned())
}

fn random_hex(bytes: usize) -> String {
    let mut buf = vec![0u8; bytes];
    File::open("/dev/urandom")
        .and_then(|mut f| std::io::Read::read_exact(&mut f, &mut buf))
        .expect("/dev/urandom");
    buf.iter().map(|b| format!("{b:02x}")).collect()
}
