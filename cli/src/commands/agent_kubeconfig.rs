//! `shardplane agent-kubeconfig`: a kubeconfig for node agents that run off
//! the cluster, holding a token of the agents' ServiceAccount (which the Helm
//! chart creates with only the rights an agent needs).

use std::path::PathBuf;
use std::time::Duration;

use anyhow::{Context, bail};
use base64::Engine;
use clap::Args;
use k8s_openapi::api::authentication::v1::{TokenRequest, TokenRequestSpec};
use k8s_openapi::api::core::v1::{Secret, ServiceAccount};
use kube::Api;
use kube::api::PostParams;
use kube::config::Kubeconfig;
use serde_json::json;

use super::kube_client::client;

/// Options of `shardplane agent-kubeconfig`.
#[derive(Args, Debug)]
pub struct AgentKubeconfigArgs {
    /// The administrator's kubeconfig (KUBECONFIG or ~/.kube/config when unset).
    #[arg(long, env = "SHARDPLANE_KUBECONFIG")]
    kubeconfig: Option<PathBuf>,
    /// Namespace of the agents' ServiceAccount (the chart's release namespace).
    #[arg(long, short = 'n', default_value = "shardplane")]
    namespace: String,
    /// The agents' ServiceAccount.
    #[arg(long, default_value = "shardplane-agent")]
    service_account: String,
    /// Lifetime of a requested token (e.g. `720h`, `30d`); the API server may
    /// shorten it.
    #[arg(long, default_value = "8760h", value_parser = parse_duration, conflicts_with = "from_secret")]
    duration: Duration,
    /// Take the long-lived token from this `kubernetes.io/service-account-token`
    /// Secret instead of requesting one.
    #[arg(long, conflicts_with = "node")]
    from_secret: Option<String>,
    /// Mint an identity for this one node: a ServiceAccount of its own
    /// (`shardplane-node-<node>`) with every role the agents' ServiceAccount
    /// has. The operator's admission webhook then lets it write only that
    /// node's InferenceNode, Lease and Shard status. Recommended: without it
    /// every agent shares one identity that can write any node's objects.
    #[arg(long)]
    node: Option<String>,
    /// API server URL the agents use, when it differs from the administrator's.
    #[arg(long)]
    server: Option<String>,
    /// Write here (mode 0600) instead of standard output.
    #[arg(long, short = 'o')]
    output: Option<PathBuf>,
}

/// `720h`, `30d`, `90m` or plain seconds.
fn parse_duration(s: &str) -> Result<Duration, String> {
    let (number, unit) = s
        .find(|c: char| !c.is_ascii_digit())
        .map_or((s, "s"), |i| s.split_at(i));
    let n: u64 = number
        .parse()
        .map_err(|_| format!("{s:?} is not a duration such as 720h"))?;
    let seconds = match unit {
        "s" => n,
        "m" => n * 60,
        "h" => n * 3600,
        "d" => n * 86400,
        _ => return Err(format!("{s:?}: the unit must be s, m, h or d")),
    };
    if seconds < 600 {
        return Err("a token must last at least 10m".into());
    }
    Ok(Duration::from_secs(seconds))
}

/// Writes the kubeconfig.
pub fn run(args: AgentKubeconfigArgs) -> anyhow::Result<()> {
    let admin = match &args.kubeconfig {
        Some(path) => Kubeconfig::read_from(path)
            .with_context(|| format!("cannot read kubeconfig {}", path.display()))?,
        None => Kubeconfig::read().context("no kubeconfig: pass --kubeconfig or set KUBECONFIG")?,
    };
    let cluster = current_cluster(&admin)?;
    let server = match &args.server {
        Some(s) => s.clone(),
        None => cluster
            .server
            .clone()
            .context("the current cluster has no server URL: pass --server")?,
    };
    let entry = cluster_entry(&cluster, server)?;
    let runtime = tokio::runtime::Runtime::new()?;
    let (account, (token, expires)) = runtime.block_on(async {
        let client = client(args.kubeconfig.as_deref()).await?;
        let account = match &args.node {
            Some(node) => {
                super::node_identity::mint(&client, &args.namespace, &args.service_account, node)
                    .await?
            }
            None => {
                eprintln!(
                    "note: every agent on this kubeconfig shares one identity; pass --node NAME \
                     to mint one that may write only its own node's objects"
                );
                args.service_account.clone()
            }
        };
        let token = token(&client, &args, &account).await?;
        anyhow::Ok((account, token))
    })?;
    let user = format!("system:serviceaccount:{}:{account}", args.namespace);
    let text = kubeconfig_text(entry, &args.namespace, &account, &token, expires.as_deref())?;
    match &args.output {
        Some(path) => {
            write_private(path, &text)?;
            eprintln!("wrote {} ({user})", path.display());
        }
        None => print!("{text}"),
    }
    Ok(())
}

/// The `cluster` entry of a kubeconfig for `cluster`, reached at `server`.
pub(crate) fn cluster_entry(
    cluster: &kube::config::Cluster,
    server: String,
) -> anyhow::Result<serde_json::Value> {
    let mut entry = json!({ "server": server });
    if let Some(data) = &cluster.certificate_authority_data {
        entry["certificate-authority-data"] = json!(data);
    } else if let Some(path) = &cluster.certificate_authority {
        let pem = std::fs::read(path).with_context(|| format!("cannot read CA {path}"))?;
        entry["certificate-authority-data"] =
            json!(base64::engine::general_purpose::STANDARD.encode(pem));
    }
    if cluster.insecure_skip_tls_verify == Some(true) {
        entry["insecure-skip-tls-verify"] = json!(true);
    }
    if let Some(name) = &cluster.tls_server_name {
        entry["tls-server-name"] = json!(name);
    }
    Ok(entry)
}

/// A kubeconfig for ServiceAccount `namespace/account` holding `token`.
pub(crate) fn kubeconfig_text(
    cluster: serde_json::Value,
    namespace: &str,
    account: &str,
    token: &str,
    expires: Option<&str>,
) -> anyhow::Result<String> {
    let user = format!("system:serviceaccount:{namespace}:{account}");
    let kubeconfig = json!({
        "apiVersion": "v1",
        "kind": "Config",
        "clusters": [{ "name": "shardplane", "cluster": cluster }],
        "users": [{ "name": account, "user": { "token": token } }],
        "contexts": [{
            "name": "shardplane-agent",
            "context": { "cluster": "shardplane", "user": account, "namespace": namespace },
        }],
        "current-context": "shardplane-agent",
    });
    Ok(format!(
        "# A kubeconfig for shardplane node agents, as {user}.\n# Token expires: {}.\n{}",
        expires.unwrap_or("never (revoke by deleting its Secret)"),
        serde_saphyr::to_string(&kubeconfig)?
    ))
}

/// A token of ServiceAccount `namespace/account` lasting `duration` (the API
/// server may shorten it) and when it expires.
pub(crate) async fn request_token(
    client: &kube::Client,
    namespace: &str,
    account: &str,
    duration: Duration,
) -> anyhow::Result<(String, Option<String>)> {
    let request = TokenRequest {
        spec: TokenRequestSpec {
            audiences: Vec::new(),
            expiration_seconds: Some(duration.as_secs() as i64),
            ..Default::default()
        },
        ..Default::default()
    };
    let api = Api::<ServiceAccount>::namespaced(client.clone(), namespace);
    let answer = api
        .create_token_request(account, &PostParams::default(), &request)
        .await
        .with_context(|| {
            format!(
                "cannot request a token for ServiceAccount {namespace}/{account} (is the chart installed there?)"
            )
        })?;
    let Some(status) = answer.status else {
        bail!("the API server answered the token request without a token");
    };
    Ok((
        status.token,
        Some(status.expiration_timestamp.0.to_string()),
    ))
}

/// The token and when it expires (None: it does not).
async fn token(
    client: &kube::Client,
    args: &AgentKubeconfigArgs,
    account: &str,
) -> anyhow::Result<(String, Option<String>)> {
    if let Some(secret) = &args.from_secret {
        let s = Api::<Secret>::namespaced(client.clone(), &args.namespace)
            .get(secret)
            .await
            .with_context(|| format!("cannot read Secret {}/{secret}", args.namespace))?;
        let token = s.data.and_then(|d| d.get("token").cloned()).with_context(|| {
            format!(
                "Secret {}/{secret} has no token yet: the cluster's token controller fills \
                 kubernetes.io/service-account-token Secrets; request a token instead (drop --from-secret)",
                args.namespace
            )
        })?;
        return Ok((
            String::from_utf8(token.0).context("the token is not UTF-8")?,
            None,
        ));
    }
    request_token(client, &args.namespace, account, args.duration).await
}

pub(crate) fn current_cluster(kc: &Kubeconfig) -> anyhow::Result<kube::config::Cluster> {
    let context_name = kc
        .current_context
        .as_deref()
        .context("the kubeconfig has no current context")?;
    let context = kc
        .contexts
        .iter()
        .find(|c| c.name == context_name)
        .and_then(|c| c.context.as_ref())
        .with_context(|| format!("the kubeconfig has no context {context_name}"))?;
    kc.clusters
        .iter()
        .find(|c| c.name == context.cluster)
        .and_then(|c| c.cluster.clone())
        .with_context(|| format!("the kubeconfig has no cluster {}", context.cluster))
}

/// Writes `text` to `path`, readable by its owner only.
pub(crate) fn write_private(path: &std::path::Path, text: &str) -> anyhow::Result<()> {
    use std::io::Write;
    #[cfg(unix)]
    use std::os::unix::fs::OpenOptionsExt;
    let mut options = std::fs::OpenOptions::new();
    options.write(true).create(true).truncate(true);
    #[cfg(unix)]
    options.mode(0o600);
    let mut f = options
        .open(path)
        .with_context(|| format!("cannot write {}", path.display()))?;
    f.write_all(text.as_bytes())?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::parse_duration;

    #[test]
    fn durations() {
        assert_eq!(parse_duration("720h").unwrap().as_secs(), 720 * 3600);
        assert_eq!(parse_duration("30d").unwrap().as_secs(), 30 * 86400);
        assert_eq!(parse_duration("3600").unwrap().as_secs(), 3600);
        assert!(parse_duration("5m").is_err());
        assert!(parse_duration("1w").is_err());
        assert!(parse_duration("h").is_err());
    }
}
