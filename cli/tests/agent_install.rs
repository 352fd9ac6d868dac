//! `shardplane agent install`, run as a Mac or Linux owner would: the unit it
//! would write passes `systemd-analyze verify`, the launchd daemon holds the
//! same arguments, and bad input is refused before anything is written.

use std::os::unix::fs::PermissionsExt;
use std::path::Path;
use std::process::{Command, Output};

fn shardplane(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_shardplane"))
        .args(args)
        .env_remove("SHARDPLANE_NODE_NAME")
        .env_remove("SHARDPLANE_ENGINE")
        .output()
        .expect("run shardplane")
}

fn text(b: &[u8]) -> String {
    String::from_utf8_lossy(b).into_owned()
}

struct Files {
    dir: tempfile::TempDir,
}

impl Files {
    fn new() -> Files {
        let dir = tempfile::tempdir().unwrap();
        let token = dir.path().join("token");
        std::fs::write(&token, "0123456789abcdef0123456789abcdef\n").unwrap();
        std::fs::set_permissions(&token, std::fs::Permissions::from_mode(0o600)).unwrap();
        std::fs::write(
            dir.path().join("kubeconfig"),
            "apiVersion: v1\nkind: Config\n",
        )
        .unwrap();
        Files { dir }
    }
    fn path(&self, name: &str) -> String {
        self.dir.path().join(name).display().to_string()
    }
}

impl Files {
    /// `shardplane agent install --dry-run` for `manager` into `dir` with this
    /// token file and kubeconfig, and `more` options.
    fn dry_run(&self, manager: &str, dir: &str, more: &[&str]) -> Output {
        let (dir, token, kubeconfig) =
            (self.path(dir), self.path("token"), self.path("kubeconfig"));
        let mut args = vec![
            "agent",
            "install",
            "--dry-run",
            "--service-manager",
            manager,
            "--service-dir",
            &dir,
            "--token-file",
            &token,
            "--kubeconfig",
            &kubeconfig,
        ];
        args.extend_from_slice(more);
        shardplane(&args)
    }
}

/// The service file a `--dry-run` prints (everything before the `# then:` lines).
fn service_file(stdout: &str) -> (String, String) {
    let mut lines = stdout.lines();
    let path = lines.next().unwrap().trim_start_matches("# ").to_string();
    let body: Vec<&str> = lines.take_while(|l| !l.starts_with("# then: ")).collect();
    (path, body.join("\n") + "\n")
}

#[test]
fn the_systemd_unit_it_would_write_passes_systemd_analyze_verify() {
    let f = Files::new();
    let out = f.dry_run(
        "systemd",
        "units",
        &[
            "--node-name",
            "mac-studio-1",
            "--label",
            "shardplane.dev/tier=daily",
            "--label",
            "room=the attic",
            "--engine",
            "candle",
            "--memory-reserve",
            "8Gi",
        ],
    );
    let stdout = text(&out.stdout);
    assert!(out.status.success(), "{}{}", stdout, text(&out.stderr));
    let (path, unit) = service_file(&stdout);
    assert_eq!(path, f.path("units/shardplane-agent.service"));
    assert!(!Path::new(&path).exists(), "--dry-run wrote the unit file");
    let bin = env!("CARGO_BIN_EXE_shardplane");
    for want in [
        format!(
            "ExecStart={bin} agent --kubeconfig {} --node-name mac-studio-1",
            f.path("kubeconfig")
        ),
        "--label shardplane.dev/tier=daily --label \"room=the attic\"".to_string(),
        format!("--token-file {}", f.path("token")),
        "--engine candle".to_string(),
        "--memory-reserve 8Gi".to_string(),
        "Restart=always".to_string(),
    ] {
        assert!(unit.contains(&want), "no {want:?} in\n{unit}");
    }
    assert!(
        stdout.contains("# then: systemctl daemon-reload\n"),
        "{stdout}"
    );

    let Ok(verify) = which("systemd-analyze") else {
        panic!(
            "systemd-analyze is missing: `apt-get install systemd` (it checks the unit `agent install` writes)"
        );
    };
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("shardplane-agent.service");
    std::fs::write(&file, &unit).unwrap();
    let checked = Command::new(verify)
        .arg("verify")
        .arg(&file)
        .output()
        .unwrap();
    assert!(
        checked.status.success() && text(&checked.stderr).trim().is_empty(),
        "systemd-analyze verify:\n{}{}\n{unit}",
        text(&checked.stdout),
        text(&checked.stderr)
    );
}

#[test]
fn the_launchd_daemon_carries_the_same_arguments() {
    let f = Files::new();
    let out = f.dry_run(
        "launchd",
        "daemons",
        &["--node-name", "johns-macbook-pro", "--label", "a=b&c"],
    );
    let stdout = text(&out.stdout);
    assert!(out.status.success(), "{}{}", stdout, text(&out.stderr));
    let (path, plist) = service_file(&stdout);
    assert_eq!(path, f.path("daemons/dev.shardplane.agent.plist"));
    for want in [
        "<string>dev.shardplane.agent</string>".to_string(),
        format!("<string>{}</string>", env!("CARGO_BIN_EXE_shardplane")),
        "<string>--node-name</string>\n        <string>johns-macbook-pro</string>".to_string(),
        "<string>a=b&amp;c</string>".to_string(),
        "<key>KeepAlive</key>".to_string(),
    ] {
        assert!(plist.contains(&want), "no {want:?} in\n{plist}");
    }
    assert!(stdout.contains(&format!("# then: launchctl bootstrap system {path}")));
}

#[test]
fn without_a_node_name_the_host_name_gives_one() {
    let f = Files::new();
    let out = f.dry_run("systemd", "units", &[]);
    assert!(out.status.success(), "{}", text(&out.stderr));
    let host = std::fs::read_to_string("/proc/sys/kernel/hostname").unwrap();
    let first = host.trim().split('.').next().unwrap().to_lowercase();
    assert!(
        text(&out.stdout).contains(&format!("--node-name {first} ")),
        "host {host:?}:\n{}",
        text(&out.stdout)
    );
}

#[test]
fn bad_input_is_refused_before_anything_is_written() {
    let f = Files::new();
    let refused = |args: &[&str], why: &str| {
        let mut all = vec!["agent", "install", "--service-dir"];
        let dir = f.path("units");
        all.push(&dir);
        all.extend_from_slice(args);
        let out = shardplane(&all);
        let err = text(&out.stderr);
        assert!(!out.status.success(), "{args:?} was accepted");
        assert!(err.contains(why), "{args:?}: {err}");
        assert!(!Path::new(&dir).exists(), "{args:?} wrote {dir}");
    };
    let token = f.path("token");
    let kubeconfig = f.path("kubeconfig");
    refused(&["--token-file", &token], "--kubeconfig is required");
    refused(
        &[
            "--token-file",
            &token,
            "--kubeconfig",
            &kubeconfig,
            "--node-name",
            "Mac_1",
        ],
        "--node-name \"Mac_1\" is not a valid node name",
    );
    refused(
        &[
            "--token-file",
            &f.path("missing"),
            "--kubeconfig",
            &kubeconfig,
        ],
        "cannot read it",
    );
    refused(
        &[
            "--token-file",
            &token,
            "--kubeconfig",
            &f.path("no-kubeconfig"),
        ],
        "--kubeconfig",
    );
    refused(
        &["--token-file", &token, "--engine", "tpu"],
        "engine \"tpu\" is not known",
    );
    std::fs::set_permissions(&token, std::fs::Permissions::from_mode(0o644)).unwrap();
    refused(
        &["--token-file", &token, "--kubeconfig", &kubeconfig],
        "readable by every user",
    );
    // Running the agent still needs its token file, and one only its user reads.
    let out = shardplane(&["agent"]);
    assert!(!out.status.success());
    assert!(
        text(&out.stderr).contains("--token-file"),
        "{}",
        text(&out.stderr)
    );
    let out = shardplane(&["agent", "--token-file", &token, "--kubeconfig", &kubeconfig]);
    assert!(!out.status.success(), "a world-readable token was taken");
    assert!(
        text(&out.stderr).contains("readable by every user"),
        "{}",
        text(&out.stderr)
    );
    std::fs::set_permissions(&token, std::fs::Permissions::from_mode(0o600)).unwrap();
    let hf = f.path("hf-token");
    std::fs::write(&hf, "hf_abc\n").unwrap();
    std::fs::set_permissions(&hf, std::fs::Permissions::from_mode(0o644)).unwrap();
    let out = shardplane(&[
        "agent",
        "--token-file",
        &token,
        "--kubeconfig",
        &kubeconfig,
        "--hugging-face-token-file",
        &hf,
    ]);
    assert!(!out.status.success());
    assert!(
        text(&out.stderr).contains("--hugging-face-token-file")
            && text(&out.stderr).contains("readable by every user"),
        "{}",
        text(&out.stderr)
    );
}

fn which(name: &str) -> Result<std::path::PathBuf, ()> {
    std::env::var_os("PATH")
        .into_iter()
        .flat_map(|p| std::env::split_paths(&p).collect::<Vec<_>>())
        .map(|d| d.join(name))
        .find(|p| p.is_file())
        .ok_or(())
}
