//! Fixtures for tests on real parts.
//!
//! [`control_plane`] gives every test of a test binary the same real
//! kube-apiserver and etcd on loopback, with the shardplane CRDs installed:
//!
//! * when `SHARDPLANE_TEST_KUBECONFIG` names a kubeconfig (the test script starts
//!   one control plane for the whole run and sets it), that one is used;
//! * otherwise the first test starts one with `scripts/control-plane.sh`, which
//!   also stops it once this process exits, however it exits.
//!
//! Tests share the server, so each works in its own namespace
//! ([`ControlPlane::namespace`]) and gives cluster-scoped objects unique names
//! ([`unique_name`]). Namespaces are never deleted: the test server has no
//! controller-manager to finish deleting them, and it is thrown away afterwards.
//!
//! [`OwnControlPlane`] starts one for a single test, without the CRDs, for
//! tests that install cluster-scoped things the shared one holds (a Helm
//! release owning the CRDs).
//!
//! [`test_model`] gives the path of the real test model.

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::OnceLock;
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::{SystemTime, UNIX_EPOCH};

use anyhow::{Context, bail};
use k8s_openapi::api::core::v1::Namespace;
use kube::api::{ObjectMeta, PostParams};
use kube::config::{KubeConfigOptions, Kubeconfig};
use kube::{Api, Client, Config};

pub mod agent_calls;
pub mod as_agent;
pub mod data_plane;
pub mod fixtures;
pub mod hub;
pub mod metrics;
pub mod netns;
pub mod sse;
pub mod tls;

/// The root of the repository (where `scripts/` lives).
pub fn repo_root() -> PathBuf {
    // The running package's directory first (cargo sets it for tests): a build
    // directory shared by several checkouts may hold a testkit compiled in
    // another one, whose path is baked in below.
    let here = std::env::var_os("CARGO_MANIFEST_DIR").map(PathBuf::from);
    here.iter()
        .flat_map(|d| d.ancestors())
        .find(|d| d.join("scripts/control-plane.sh").is_file())
        .map(Path::to_path_buf)
        .unwrap_or_else(|| {
            Path::new(env!("CARGO_MANIFEST_DIR"))
                .parent()
                .expect("testkit lives one level below the repository root")
                .to_path_buf()
        })
}

/// A running control plane with the shardplane CRDs installed.
#[derive(Debug)]
pub struct ControlPlane {
    kubeconfig: PathBuf,
}

static CONTROL_PLANE: OnceLock<Result<ControlPlane, String>> = OnceLock::new();

/// The control plane shared by this test binary, started on first use.
///
/// Panics with the setup command to run when the control plane is not installed.
pub fn control_plane() -> &'static ControlPlane {
    match CONTROL_PLANE.get_or_init(|| ControlPlane::start_or_reuse().map_err(|e| format!("{e:#}")))
    {
        Ok(cp) => cp,
        Err(e) => panic!(
            "no test control plane: {e}\n\
             Set it up with `bash scripts/control-plane.sh install` (or run the whole suite with `bash scripts/test.sh`)."
        ),
    }
}

/// A control plane of one test's own, without the shardplane CRDs; stopped
/// when dropped (and, should the test process die, by the script's watcher).
#[derive(Debug)]
pub struct OwnControlPlane {
    cp: ControlPlane,
    dir: PathBuf,
}

impl OwnControlPlane {
    /// Starts one; panics with the set-up command when it cannot.
    pub fn start() -> OwnControlPlane {
        match start_control_plane() {
            Ok((cp, dir)) => OwnControlPlane { cp, dir },
            Err(e) => panic!(
                "cannot start a control plane: {e:#}\n\
                 Set it up with `bash scripts/control-plane.sh install` (or run the whole suite with `bash scripts/test.sh`)."
            ),
        }
    }
}

impl OwnControlPlane {
    /// [`OwnControlPlane::start`], with the shardplane CRDs installed.
    pub fn start_with_crds() -> OwnControlPlane {
        let cp = OwnControlPlane::start();
        if let Err(e) = cp.install_crds() {
            panic!("cannot install the CRDs on a test control plane: {e:#}");
        }
        cp
    }

    /// The kube-apiserver's process id (to stop and continue it).
    pub fn api_server_pid(&self) -> u32 {
        let path = self.dir.join("apiserver.pid");
        std::fs::read_to_string(&path)
            .ok()
            .and_then(|s| s.trim().parse().ok())
            .unwrap_or_else(|| panic!("no process id in {}", path.display()))
    }
}

impl std::ops::Deref for OwnControlPlane {
    type Target = ControlPlane;
    fn deref(&self) -> &ControlPlane {
        &self.cp
    }
}

impl Drop for OwnControlPlane {
    fn drop(&mut self) {
        let _ = Command::new("bash")
            .arg(repo_root().join("scripts/control-plane.sh"))
            .arg("stop")
            .arg(&self.dir)
            .output();
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

/// Starts a control plane with `scripts/control-plane.sh` in a new directory;
/// the script's watcher stops it and removes the directory once this process
/// exits.
fn start_control_plane() -> anyhow::Result<(ControlPlane, PathBuf)> {
    let dir = tempfile::Builder::new()
        .prefix("shardplane-cp-")
        .tempdir()?
        .keep();
    let script = repo_root().join("scripts/control-plane.sh");
    let out = Command::new("bash")
        .arg(&script)
        .arg("start")
        .arg(&dir)
        .arg(std::process::id().to_string())
        .stderr(Stdio::inherit())
        .output()
        .with_context(|| format!("cannot run {}", script.display()))?;
    if !out.status.success() {
        bail!("{} start failed ({})", script.display(), out.status);
    }
    let cp = ControlPlane {
        kubeconfig: dir.join("kubeconfig"),
    };
    Ok((cp, dir))
}

impl ControlPlane {
    fn start_or_reuse() -> anyhow::Result<ControlPlane> {
        let cp = match std::env::var_os("SHARDPLANE_TEST_KUBECONFIG").filter(|v| !v.is_empty()) {
            Some(path) => ControlPlane {
                kubeconfig: PathBuf::from(path),
            },
            None => start_control_plane()?.0,
        };
        cp.install_crds()?;
        Ok(cp)
    }

    fn install_crds(&self) -> anyhow::Result<()> {
        let yaml = shardplane_crds::all_crds_yaml()?;
        // As a person installs them, so later `kubectl apply`s of them are quiet.
        self.kubectl_stdin(&["apply", "-f", "-"], &yaml)?;
        let names: Vec<String> = shardplane_crds::all_crds()
            .iter()
            .map(|crd| format!("crd/{}", crd.metadata.name.as_deref().unwrap_or_default()))
            .collect();
        let mut args = vec!["wait", "--for=condition=Established", "--timeout=60s"];
        args.extend(names.iter().map(String::as_str));
        self.kubectl(&args)?;
        Ok(())
    }

    /// The kubeconfig of the control plane (cluster admin).
    pub fn kubeconfig(&self) -> &Path {
        &self.kubeconfig
    }

    /// A new client (one per test: a client belongs to the runtime that made it).
    pub async fn client(&self) -> anyhow::Result<Client> {
        let kc = Kubeconfig::read_from(&self.kubeconfig)?;
        let config = Config::from_custom_kubeconfig(kc, &KubeConfigOptions::default()).await?;
        Ok(Client::try_from(config)?)
    }

    /// Creates a fresh namespace for one test and returns its name.
    pub async fn namespace(&self, client: &Client, prefix: &str) -> anyhow::Result<String> {
        let name = unique_name(prefix);
        let ns = Namespace {
            metadata: ObjectMeta {
                name: Some(name.clone()),
                ..Default::default()
            },
            ..Default::default()
        };
        Api::<Namespace>::all(client.clone())
            .create(&PostParams::default(), &ns)
            .await
            .with_context(|| format!("cannot create namespace {name}"))?;
        Ok(name)
    }

    /// Runs kubectl against the control plane; returns stdout, fails with stderr.
    pub fn kubectl(&self, args: &[&str]) -> anyhow::Result<String> {
        self.kubectl_stdin(args, "")
    }

    /// Runs kubectl with `input` on its standard input.
    pub fn kubectl_stdin(&self, args: &[&str], input: &str) -> anyhow::Result<String> {
        let out = self.kubectl_output(args, input)?;
        if !out.success {
            bail!("kubectl {} failed: {}", args.join(" "), out.stderr);
        }
        Ok(out.stdout)
    }

    /// Runs kubectl and returns its output whether or not it succeeded.
    pub fn kubectl_output(&self, args: &[&str], input: &str) -> anyhow::Result<KubectlOutput> {
        use std::io::Write;
        let mut child = Command::new("kubectl")
            .arg("--kubeconfig")
            .arg(&self.kubeconfig)
            .args(args)
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .context("cannot run kubectl: install kubectl (>= 1.28) on PATH")?;
        let mut stdin = child.stdin.take().expect("stdin is piped");
        let input = input.to_owned();
        let writer = std::thread::spawn(move || stdin.write_all(input.as_bytes()));
        let out = child.wait_with_output()?;
        writer.join().expect("stdin writer panicked")?;
        Ok(KubectlOutput {
            success: out.status.success(),
            stdout: String::from_utf8_lossy(&out.stdout).into_owned(),
            stderr: String::from_utf8_lossy(&out.stderr).into_owned(),
        })
    }
}

/// What kubectl printed.
#[derive(Debug)]
pub struct KubectlOutput {
    /// Whether kubectl exited 0.
    pub success: bool,
    /// Standard output.
    pub stdout: String,
    /// Standard error.
    pub stderr: String,
}

/// A name no other test (in this or another process) uses: `prefix-<pid>-<n>-<time>`.
pub fn unique_name(prefix: &str) -> String {
    static COUNTER: AtomicU32 = AtomicU32::new(0);
    let n = COUNTER.fetch_add(1, Ordering::Relaxed);
    let t = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.subsec_micros())
        .unwrap_or_default();
    format!("{prefix}-{}-{n}-{t:x}", std::process::id())
}

/// The download cache of an agent for `node`, under `scratch` (a test
/// binary's `CARGO_TARGET_TMPDIR`) in `agent-cache/`.
///
/// The scratch directory outlives test runs, and each agent cache holds a
/// model, so the first call in a process removes the caches that earlier
/// test processes left: those whose name carries (as [`unique_name`] writes
/// it) the id of a process no longer running. A cache of this process is
/// kept, so an agent restarted on the same node finds its files.
pub fn agent_cache(scratch: &str, node: &str) -> PathBuf {
    static SWEPT: OnceLock<()> = OnceLock::new();
    let root = Path::new(scratch).join("agent-cache");
    SWEPT.get_or_init(|| sweep_stale(&root));
    root.join(node)
}

/// Removes the entries of `root` named by [`unique_name`] for a process that
/// is gone.
fn sweep_stale(root: &Path) {
    // Without /proc (macOS) no process can be told gone: keep everything.
    if !Path::new("/proc").is_dir() {
        return;
    }
    let Ok(entries) = std::fs::read_dir(root) else {
        return;
    };
    for entry in entries.flatten() {
        let name = entry.file_name();
        let Some(pid) = name
            .to_str()
            .and_then(|n| n.split('-').find(|part| part.parse::<u32>().is_ok()))
        else {
            continue;
        };
        let running = pid.parse::<u32>().ok() == Some(std::process::id())
            || Path::new("/proc").join(pid).exists();
        if !running {
            let _ = std::fs::remove_dir_all(entry.path());
        }
    }
}

/// The line `shardplane generate --print-tokens` writes to stderr with the
/// generated token ids.
pub fn tokens_line(stderr: &str) -> String {
    stderr
        .lines()
        .find(|l| l.starts_with("tokens: "))
        .unwrap_or_else(|| panic!("no token line in:\n{stderr}"))
        .to_string()
}

/// The test model (SmolLM2-135M-Instruct, GGUF Q4_1), fetched once into the cache.
///
/// Panics with the setup command when it cannot be had.
pub fn test_model() -> PathBuf {
    static MODEL: OnceLock<Result<PathBuf, String>> = OnceLock::new();
    let found = MODEL.get_or_init(|| {
        let script = repo_root().join("scripts/model.sh");
        let out = Command::new("bash")
            .arg(&script)
            .stderr(Stdio::inherit())
            .output()
            .map_err(|e| format!("cannot run {}: {e}", script.display()))?;
        if !out.status.success() {
            return Err(format!("{} failed ({})", script.display(), out.status));
        }
        Ok(PathBuf::from(String::from_utf8_lossy(&out.stdout).trim()))
    });
    match found {
        Ok(path) => path.clone(),
        Err(e) => panic!(
            "no test model: {e}\nSet it up with `bash scripts/model.sh` (or `bash scripts/setup.sh`)."
        ),
    }
}

/// Polls `check` every 250 ms until it gives `Some`, or panics after `within`
/// naming `what` was awaited.
pub async fn eventually<T, F, Fut>(what: &str, within: std::time::Duration, check: F) -> T
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = Option<T>>,
{
    eventually_or(what, within, check, String::new).await
}

/// [`eventually`], saying what `explain` gives when it times out (the last
/// state the check saw, say).
pub async fn eventually_or<T, F, Fut>(
    what: &str,
    within: std::time::Duration,
    mut check: F,
    explain: impl Fn() -> String,
) -> T
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = Option<T>>,
{
    let deadline = std::time::Instant::now() + within;
    loop {
        if let Some(v) = check().await {
            return v;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "timed out after {within:?} waiting for: {what}. {}",
            explain()
        );
        tokio::time::sleep(std::time::Duration::from_millis(250)).await;
    }
}

/// A child process killed (and reaped) when dropped, so a failing test leaves
/// nothing running.
#[derive(Debug)]
pub struct ChildGuard(pub std::process::Child);

impl ChildGuard {
    /// Sends `signal` (e.g. `-TERM`, `-KILL`) to the process.
    pub fn signal(&self, signal: &str) {
        let status = Command::new("kill")
            .args([signal, &self.0.id().to_string()])
            .status()
            .expect("kill runs");
        assert!(status.success(), "kill {signal} failed");
    }
}

impl Drop for ChildGuard {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// A loopback address with a port free right now (`127.0.0.1:N`) for a
/// component to listen on.
///
/// The port is below the kernel's ephemeral range: a port the kernel hands
/// out for `:0` is also what it gives the next outgoing connection, which
/// could take it before the component binds it (seen in CI as "Address
/// already in use"). Ports are handed out in turn from a point that differs
/// per process, so two calls, or two test processes, do not pick the same.
pub fn free_address() -> std::net::SocketAddr {
    use std::sync::atomic::{AtomicU32, Ordering};
    static NEXT: AtomicU32 = AtomicU32::new(0);
    let ephemeral_start = std::fs::read_to_string("/proc/sys/net/ipv4/ip_local_port_range")
        .ok()
        .and_then(|r| r.split_whitespace().next()?.parse::<u32>().ok())
        .unwrap_or(32768);
    let (low, high) = (10_000u32, ephemeral_start.clamp(11_000, 65_536));
    let start = std::process::id().wrapping_mul(7919);
    for _ in 0..2_000 {
        let port = low + start.wrapping_add(NEXT.fetch_add(1, Ordering::Relaxed)) % (high - low);
        if let Ok(address) =
            std::net::TcpListener::bind(("127.0.0.1", port as u16)).and_then(|l| l.local_addr())
        {
            return address;
        }
    }
    std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .expect("a free loopback port")
}

/// Starts the `shardplane` binary at `bin` with `args` against the test control
/// plane (quiet logs, stdout discarded); it is killed when the guard drops.
pub fn spawn_component(bin: &str, args: &[&str]) -> ChildGuard {
    spawn_component_as(bin, args, control_plane().kubeconfig())
}

/// [`spawn_component`] with another identity's kubeconfig.
pub fn spawn_component_as(bin: &str, args: &[&str], kubeconfig: &Path) -> ChildGuard {
    spawn_component_with(bin, args, kubeconfig, &[])
}

/// [`spawn_component_as`] with more environment variables (e.g. `FAILPOINTS`).
pub fn spawn_component_with(
    bin: &str,
    args: &[&str],
    kubeconfig: &Path,
    env: &[(&str, &str)],
) -> ChildGuard {
    let child = Command::new("setpriv")
        .args(PARENT_DEATH)
        .arg(bin)
        .args(args)
        .arg("--kubeconfig")
        .arg(kubeconfig)
        // Components started here run under the admin's credentials, which
        // get no data-plane certificate (`shardplane up` and its test run
        // the data plane over TLS with node identities); a test may turn it on.
        .env("SHARDPLANE_DATA_PLANE_TLS", "off")
        .envs(env.iter().copied())
        .env("RUST_LOG", component_log())
        // Several components share the machine's cores: one compute thread each.
        .env("RAYON_NUM_THREADS", "1")
        .env("SHARDPLANE_DATA_PLANE_TOKEN_FILE", token_file())
        .env("SHARDPLANE_DATA_PLANE_ADDRESS", "127.0.0.1:0")
        .stdout(Stdio::null())
        .spawn()
        .unwrap_or_else(|e| panic!("cannot start {bin}: {e}"));
    ChildGuard(child)
}

/// The log filter of the components a test starts: `SHARDPLANE_TEST_LOG`
/// when set (for example `info,kube=warn` to follow a failing test), else
/// warnings only.
pub fn component_log() -> String {
    std::env::var("SHARDPLANE_TEST_LOG").unwrap_or_else(|_| "warn,kube_client=error".into())
}

/// `setpriv` (util-linux) arguments that kill a component when the test
/// process dies without running its guards (a killed or timed-out test).
pub const PARENT_DEATH: [&str; 3] = ["--pdeathsig", "KILL", "--"];

/// The data-plane token every component a test starts shares.
pub const DATA_PLANE_TOKEN: &str = "test-data-plane-token-0123456789";

/// A file holding [`DATA_PLANE_TOKEN`] (written once per test binary).
pub fn token_file() -> &'static Path {
    static FILE: OnceLock<PathBuf> = OnceLock::new();
    FILE.get_or_init(|| {
        let dir = std::env::temp_dir().join(format!("shardplane-test-{}", std::process::id()));
        std::fs::create_dir_all(&dir).expect("a scratch directory");
        let path = dir.join("data-plane-token");
        std::fs::write(&path, DATA_PLANE_TOKEN).expect("write the token file");
        // Agents refuse a token file every user may read.
        std::fs::set_permissions(&path, std::os::unix::fs::PermissionsExt::from_mode(0o600))
            .expect("make the token file private");
        path
    })
}

/// Serves the test model at `/m.gguf` on loopback; returns the base URL and
/// the log of requests for it: each request's Range header, or `full`.
/// Requests for other paths are not logged: the port is an ephemeral one a
/// dead agent of an earlier test may have had, and live agents may still
/// probe that agent's old address.
pub async fn serve_test_model() -> (String, std::sync::Arc<std::sync::Mutex<Vec<String>>>) {
    use axum::extract::Request;
    use axum::middleware::{self, Next};
    let log = std::sync::Arc::new(std::sync::Mutex::new(Vec::new()));
    let seen = log.clone();
    let app = axum::Router::new()
        .route_service(
            "/m.gguf",
            tower_http::services::ServeFile::new(test_model()),
        )
        .route_layer(middleware::from_fn(move |req: Request, next: Next| {
            let seen = seen.clone();
            async move {
                let range = req.headers().get("range").and_then(|v| v.to_str().ok());
                seen.lock()
                    .expect("log lock")
                    .push(range.unwrap_or("full").to_string());
                next.run(req).await
            }
        }));
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .expect("a loopback port");
    let base = format!("http://{}", listener.local_addr().expect("bound"));
    tokio::spawn(async move { axum::serve(listener, app).await.expect("serve the model") });
    (base, log)
}

/// Puts the test model where the quickstart's Model says it is on the nodes
/// (`/var/lib/shardplane/models`, which needs root).
pub fn install_quickstart_model() {
    let installed = Command::new("bash")
        .arg(repo_root().join("scripts/model.sh"))
        .args(["--install-to", "/var/lib/shardplane/models"])
        .status()
        .expect("bash runs");
    assert!(
        installed.success(),
        "cannot install the model: run as root, or run `bash scripts/model.sh --install-to /var/lib/shardplane/models`"
    );
}

/// The Python of the venv `name` under the cache, which `scripts/setup.sh`
/// fills with `what`.
fn cached_python(name: &str, what: &str) -> PathBuf {
    let venv = std::env::var_os("HOME")
        .map(PathBuf::from)
        .unwrap_or_default()
        .join(".cache/shardplane")
        .join(name)
        .join("bin/python");
    assert!(
        venv.exists(),
        "the {name} venv is missing: run `bash scripts/setup.sh` (it installs {what} into {})",
        venv.display()
    );
    venv
}

/// The Python of the reference venv (mlx-lm on the MLX CPU wheel, the `gguf`
/// writer, SentencePiece): the model families' reference implementations.
pub fn reference_python() -> PathBuf {
    cached_python("reference", "mlx-lm, mlx[cpu], gguf and sentencepiece")
}

/// Runs the reference script `script` with `args` in the reference venv and
/// fails, with its error output, when it fails.
pub fn run_reference(script: &Path, args: &[&std::ffi::OsStr]) {
    let out = Command::new(reference_python())
        .arg(script)
        .args(args)
        .output()
        .expect("the reference Python runs");
    assert!(
        out.status.success(),
        "{} failed: {}",
        script.display(),
        String::from_utf8_lossy(&out.stderr)
    );
}

/// The Python of the test venv (the official API clients, Helm's SDK).
pub fn venv_python() -> PathBuf {
    cached_python("venv", "openai, anthropic, ollama and helm-python-sdk")
}
