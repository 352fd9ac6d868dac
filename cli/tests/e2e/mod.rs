//! What the network-namespace tests share: agents, each in its own
//! namespace, and an operator and a gateway on the machine, over the test
//! model.

use std::time::Duration;

use kube::Api;
use kube::api::PostParams;
use shardplane_crds::Model;
use shardplane_dataplane as dp;
use shardplane_testkit::netns::Network;
use shardplane_testkit::{ChildGuard, fixtures, free_address, spawn_component};

pub const BIN: &str = env!("CARGO_BIN_EXE_shardplane");
pub const WAIT: Duration = Duration::from_secs(120);

/// The running system.
pub struct Cluster {
    pub net: Network,
    /// Node names, one per host.
    #[allow(dead_code)] // not every test that shares this module reads it
    pub nodes: Vec<String>,
    /// The agents, one per host (take one to stop it).
    pub agents: Vec<Option<ChildGuard>>,
    /// The operator (take it to stop it).
    #[allow(dead_code)] // not every test that shares this module reads it
    pub operator: Option<ChildGuard>,
    _gateway: ChildGuard,
    /// Where the gateway listens; its API key is `sk-test`.
    #[allow(dead_code)] // not every test that shares this module reads it
    pub gateway: String,
    /// The gateway's admin address (`/metrics`).
    #[allow(dead_code)] // not every test that shares this module reads it
    pub gateway_admin: String,
    _dir: tempfile::TempDir,
}

/// Hosts on bridge `tag`, subnet `10.<subnet>.0.0/24`, one per pool in
/// `pools`, each running an agent (node `<name>-n<i>`, label `pool=<pool>`,
/// Lease 4 s, plus `agent_args`); the operator (leader Lease in namespace
/// `name`) and the gateway on the machine.
#[allow(dead_code)] // not every test that shares this module calls it
pub fn start(tag: char, subnet: u8, pools: &[&str], name: &str, agent_args: &[&str]) -> Cluster {
    start_with(tag, subnet, pools, name, agent_args, &[], |_| ())
}

/// [`start`], with `gateway_args` added to the gateway's and
/// `before_agents` shaping the network before any agent starts (an agent
/// reads its addresses as it starts). An agent argument
/// `--data-plane-address` replaces the default, the host's address.
#[allow(dead_code)] // not every test that shares this module calls it
pub fn start_with(
    tag: char,
    subnet: u8,
    pools: &[&str],
    name: &str,
    agent_args: &[&str],
    gateway_args: &[&str],
    before_agents: impl FnOnce(&Network),
) -> Cluster {
    shardplane_testkit::install_quickstart_model();
    let net = Network::new(tag, subnet, pools.len());
    before_agents(&net);
    let dir = tempfile::tempdir().unwrap();
    let nodes: Vec<String> = (0..pools.len()).map(|i| format!("{name}-n{i}")).collect();
    let agents = pools
        .iter()
        .enumerate()
        .map(|(i, pool)| {
            let ip = net.hosts[i].ip;
            let cache = dir.path().join(format!("cache-{i}"));
            let (label, admin, data_plane) = (
                format!("pool={pool}"),
                format!("{ip}:9091"),
                format!("{ip}:7070"),
            );
            let mut args = vec![
                "agent",
                "--node-name",
                &nodes[i],
                "--label",
                &label,
                "--admin-address",
                &admin,
                "--memory-reserve",
                "512Mi",
                "--cache-dir",
                cache.to_str().unwrap(),
            ];
            if !agent_args.contains(&"--data-plane-address") {
                args.extend(["--data-plane-address", &data_plane]);
            }
            // Short Leases, so that losing a node is seen quickly.
            if !agent_args.contains(&"--lease-seconds") {
                args.extend(["--lease-seconds", "4"]);
            }
            args.extend(agent_args);
            Some(net.spawn(i, BIN, &args))
        })
        .collect();
    let keys = dir.path().join("keys");
    std::fs::write(&keys, "test: sk-test\n").unwrap();
    let gateway = free_address().to_string();
    let gateway_admin = free_address().to_string();
    let mut args = vec![
        "gateway",
        "--listen",
        &gateway,
        "--admin-address",
        &gateway_admin,
        "--api-keys-file",
        keys.to_str().unwrap(),
    ];
    args.extend(gateway_args);
    let gateway_guard = spawn_component(BIN, &args);
    Cluster {
        net,
        nodes,
        agents,
        operator: Some(operator(name).0),
        _gateway: gateway_guard,
        gateway,
        gateway_admin,
        _dir: dir,
    }
}

/// An operator with 4 s leader and node Leases that reads model paths
/// itself, and where its admin port answers (`shardplane_operator_leader`
/// says it leads).
pub fn operator(leader_namespace: &str) -> (ChildGuard, String) {
    let admin = free_address().to_string();
    let guard = spawn_component(
        BIN,
        &[
            "operator",
            "--admin-address",
            &admin,
            "--leader-namespace",
            leader_namespace,
            "--leader-lease-seconds",
            "4",
            "--node-lease-seconds",
            "4",
            "--read-model-paths",
        ],
    );
    (guard, admin)
}

/// Model `m`, the test model, served as `served`, in namespace `ns`.
pub async fn create_model(client: &kube::Client, ns: &str, served: &str) {
    let mut model = fixtures::model("m");
    model.spec.served_name = Some(served.to_string());
    Api::<Model>::namespaced(client.clone(), ns)
        .create(&PostParams::default(), &model)
        .await
        .unwrap();
}

/// Daily pool `pool` (nodes labelled `pool=<pool>`), strategy `strategy`
/// (whole models) and deployment `chat` of Model `m` in `ns` with
/// `replicas`; returns the deployments' API.
#[allow(dead_code)] // not every test that shares this module calls it
pub async fn create_daily(
    client: &kube::Client,
    ns: &str,
    pool: &str,
    strategy: &str,
    replicas: i32,
) -> Api<shardplane_crds::ModelDeployment> {
    use shardplane_crds::{NodePool, Parallelism, ShardingStrategy, Tier};
    Api::<NodePool>::all(client.clone())
        .create(
            &PostParams::default(),
            &fixtures::node_pool(pool, Tier::Daily),
        )
        .await
        .unwrap();
    Api::<ShardingStrategy>::all(client.clone())
        .create(
            &PostParams::default(),
            &fixtures::strategy(strategy, Parallelism::None),
        )
        .await
        .unwrap();
    let deployments = Api::namespaced(client.clone(), ns);
    let mut d = fixtures::deployment("chat", "m", pool, strategy);
    d.spec.replicas = replicas;
    deployments
        .create(&PostParams::default(), &d)
        .await
        .unwrap();
    deployments
}

/// What the agent at `endpoint` serves, or None when it does not answer.
#[allow(dead_code)] // not every test that shares this module calls it
pub async fn agent_status(endpoint: &str) -> Option<dp::StatusResponse> {
    let token = dp::Token::new(shardplane_testkit::DATA_PLANE_TOKEN).unwrap();
    let mut c = dp::client(dp::channel(endpoint, None).unwrap(), token);
    Some(c.status(dp::StatusRequest {}).await.ok()?.into_inner())
}

/// A chat completion of `body` to the gateway, with its API key `sk-test`.
#[allow(dead_code)] // not every test that shares this module calls it
pub fn chat_request(
    http: &reqwest::Client,
    gateway: &str,
    body: &serde_json::Value,
) -> reqwest::RequestBuilder {
    http.post(format!("http://{gateway}/v1/chat/completions"))
        .bearer_auth("sk-test")
        .header("content-type", "application/json")
        .body(body.to_string())
}

/// One short chat through the gateway (API key `sk-test`), given `timeout`:
/// Ok(()) on 200.
#[allow(dead_code)] // not every test that shares this module calls it
pub async fn chat(
    http: &reqwest::Client,
    gateway: &str,
    model: &str,
    timeout: Duration,
) -> Result<(), String> {
    chat_saying(http, gateway, model, "Say hi.", timeout).await
}

/// [`chat`] with `content` as the user's message.
pub async fn chat_saying(
    http: &reqwest::Client,
    gateway: &str,
    model: &str,
    content: &str,
    timeout: Duration,
) -> Result<(), String> {
    let body = serde_json::json!({
        "model": model,
        "messages": [{"role": "user", "content": content}],
        "max_tokens": 4,
    });
    let r = chat_request(http, gateway, &body)
        .timeout(timeout)
        .send()
        .await
        .map_err(|e| format!("{e:?}"))?;
    let status = r.status();
    let text = r.text().await.map_err(|e| e.to_string())?;
    if status != 200 {
        return Err(format!("{status}: {text}"));
    }
    Ok(())
}

/// Reads an OpenAI chat stream to its end: the text when it ended whole
/// (`[DONE]`, a finish reason, some text, no error event), else what went
/// wrong.
#[allow(dead_code)] // not every test that shares this module calls it
pub async fn read_chat_stream(r: reqwest::Response) -> Result<String, String> {
    let (mut text, mut finished, mut done) = (String::new(), false, false);
    shardplane_testkit::sse::each_event(r.bytes_stream(), |data| {
        if data == "[DONE]" {
            done = true;
            return Ok(false);
        }
        let v: serde_json::Value = serde_json::from_str(data).unwrap_or_default();
        if v.get("error").is_some() {
            return Err(format!("an error mid-stream: {data}"));
        }
        if let Some(t) = v["choices"][0]["delta"]["content"].as_str() {
            text.push_str(t);
        }
        finished |= v["choices"][0]["finish_reason"].is_string();
        Ok(false)
    })
    .await
    .map_err(|e| format!("after {text:?}: {e}"))?;
    if done && finished && !text.is_empty() {
        Ok(text)
    } else {
        Err(format!(
            "the stream ended early: [DONE] {done}, finish reason {finished}, text {text:?}"
        ))
    }
}
