//! `shardplane agent install`: the agent as a service that starts at boot and
//! comes back when it stops.
//!
//! ```text
//!  agent options ─► checked (node name, token file, kubeconfig) ─► argv, every option spelled out
//!     Linux: /etc/systemd/system/shardplane-agent.service ─► systemctl daemon-reload, enable --now
//!     macOS: /Library/LaunchDaemons/dev.shardplane.agent.plist (KeepAlive) ─► launchctl bootstrap
//!  --dry-run prints the file and the commands and changes nothing
//! ```
//!
//! The launchd path is written to launchd's documented keys and unit-tested
//! for its content here; it has not run on a Mac in this repository's tests.

use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::process::Command;

use anyhow::{Context, bail};
use clap::{Args, ValueEnum};

use super::agent::RunArgs;

/// The systemd unit's name.
pub const SYSTEMD_UNIT: &str = "shardplane-agent.service";
/// The launchd daemon's label (and the plist's file name without `.plist`).
pub const LAUNCHD_LABEL: &str = "dev.shardplane.agent";

/// Options of `shardplane agent install`: the agent's own, and these.
#[derive(Args, Debug)]
pub struct InstallArgs {
    #[command(flatten)]
    run: RunArgs,
    /// Print the service file and the commands that would load it; write
    /// and run nothing.
    #[arg(long)]
    dry_run: bool,
    /// The service manager (default: launchd on macOS, systemd elsewhere).
    #[arg(long, value_enum)]
    service_manager: Option<ServiceManager>,
    /// The directory the service file goes to (default:
    /// /etc/systemd/system or /Library/LaunchDaemons).
    #[arg(long)]
    service_dir: Option<PathBuf>,
    /// The binary the service runs (default: this one).
    #[arg(long)]
    binary: Option<PathBuf>,
}

/// Who starts the agent at boot.
#[derive(ValueEnum, Clone, Copy, Debug, PartialEq, Eq)]
pub enum ServiceManager {
    /// A systemd unit (Linux).
    Systemd,
    /// A launchd LaunchDaemon (macOS).
    Launchd,
}

/// A service ready to write: its file, its content and the commands that
/// load it.
#[derive(Debug, PartialEq)]
pub struct Service {
    /// Where the service file goes.
    pub path: PathBuf,
    /// The service file.
    pub content: String,
    /// The commands that (re)load it, each as argv.
    pub load: Vec<Vec<String>>,
}

/// Checks the options, renders the service and writes and loads it (or
/// prints it with `--dry-run`).
pub fn run(args: InstallArgs) -> anyhow::Result<()> {
    let manager = args
        .service_manager
        .unwrap_or(if cfg!(target_os = "macos") {
            ServiceManager::Launchd
        } else {
            ServiceManager::Systemd
        });
    let node = args.run.node()?;
    let engine = args.run.engine().to_string();
    engine.parse::<shardplane_engine::pipeline::EngineKind>()?;
    let run = args.run.with_absolute_paths()?;
    check_token_file(run.token_file()?)?;
    // A service has no KUBECONFIG nor the installing user's home: name it.
    let k = run.kubeconfig().context(
        "--kubeconfig is required for a service: the agent's kubeconfig \
         (`shardplane agent-kubeconfig` writes one)",
    )?;
    std::fs::metadata(k).with_context(|| format!("--kubeconfig {}", k.display()))?;
    let binary = match args.binary {
        Some(b) => std::path::absolute(b)?,
        None => std::env::current_exe().context("cannot tell where this binary is")?,
    };
    let mut argv = vec![binary.display().to_string(), "agent".to_string()];
    argv.extend(run.to_args(&node, &engine));
    let service = match manager {
        ServiceManager::Systemd => systemd(
            &args
                .service_dir
                .unwrap_or_else(|| "/etc/systemd/system".into()),
            &node,
            &argv,
        ),
        ServiceManager::Launchd => launchd(
            &args
                .service_dir
                .unwrap_or_else(|| "/Library/LaunchDaemons".into()),
            &argv,
        ),
    };
    if args.dry_run {
        println!("# {}", service.path.display());
        print!("{}", service.content);
        for cmd in &service.load {
            println!("# then: {}", cmd.join(" "));
        }
        return Ok(());
    }
    if let Some(dir) = service.path.parent() {
        std::fs::create_dir_all(dir).with_context(|| format!("cannot create {}", dir.display()))?;
    }
    std::fs::write(&service.path, &service.content).with_context(|| {
        format!(
            "cannot write {} (installing a service needs root; --dry-run shows what would be written)",
            service.path.display()
        )
    })?;
    std::fs::set_permissions(&service.path, std::fs::Permissions::from_mode(0o644))?;
    eprintln!("wrote {}", service.path.display());
    for cmd in &service.load {
        let status = Command::new(&cmd[0])
            .args(&cmd[1..])
            .status()
            .with_context(|| format!("cannot run {}", cmd[0]))?;
        if !status.success() && !tolerated(cmd) {
            bail!("`{}` failed ({status})", cmd.join(" "));
        }
    }
    eprintln!("the agent runs as node {node:?}");
    Ok(())
}

/// Unloading a daemon that was not loaded fails; that is fine.
fn tolerated(cmd: &[String]) -> bool {
    cmd.get(1).is_some_and(|c| c == "bootout")
}

/// A token file must exist, hold a token, and not be readable by every user
/// of the machine (a service reads it as root).
pub fn check_token_file(path: &Path) -> anyhow::Result<()> {
    super::refuse_world_readable(path, "--token-file")?;
    shardplane_dataplane::Token::from_file(path)?;
    Ok(())
}

/// The systemd unit for `argv`.
pub fn systemd(dir: &Path, node: &str, argv: &[String]) -> Service {
    let exec = argv
        .iter()
        .map(|a| systemd_quote(a))
        .collect::<Vec<_>>()
        .join(" ");
    let content = format!(
        "# Written by `shardplane agent install`; run it again to change the options.\n\
         [Unit]\n\
         Description=shardplane node agent ({node})\n\
         Wants=network-online.target\n\
         After=network-online.target\n\
         \n\
         [Service]\n\
         ExecStart={exec}\n\
         Restart=always\n\
         RestartSec=5\n\
         # The agent drains on SIGTERM: its shards are unloaded and its Lease given up.\n\
         KillSignal=SIGTERM\n\
         TimeoutStopSec=60\n\
         LimitNOFILE=65536\n\
         \n\
         [Install]\n\
         WantedBy=multi-user.target\n"
    );
    let cmd = |a: &[&str]| a.iter().map(|s| s.to_string()).collect::<Vec<_>>();
    Service {
        path: dir.join(SYSTEMD_UNIT),
        content,
        load: vec![
            cmd(&["systemctl", "daemon-reload"]),
            cmd(&["systemctl", "enable", SYSTEMD_UNIT]),
            cmd(&["systemctl", "restart", SYSTEMD_UNIT]),
        ],
    }
}

/// One argument of an `ExecStart=` line: quoted when it holds spaces or
/// quotes, with `%` (specifiers) and `$` (variables) taken literally.
fn systemd_quote(arg: &str) -> String {
    let literal = arg.replace('%', "%%").replace('$', "$$");
    if !literal.is_empty()
        && !literal
            .chars()
            .any(|c| c.is_whitespace() || matches!(c, '"' | '\'' | '\\' | ';'))
    {
        return literal;
    }
    let mut out = String::from("\"");
    for c in literal.chars() {
        match c {
            '"' | '\\' => {
                out.push('\\');
                out.push(c);
            }
            '\n' => out.push_str("\\n"),
            _ => out.push(c),
        }
    }
    out.push('"');
    out
}

/// The launchd LaunchDaemon for `argv`: started at boot, kept alive.
pub fn launchd(dir: &Path, argv: &[String]) -> Service {
    let args: String = argv
        .iter()
        .map(|a| format!("        <string>{}</string>\n", xml_escape(a)))
        .collect();
    let content = format!(
        "<?xml version=\"1.0\" encoding=\"UTF-8\"?>\n\
         <!DOCTYPE plist PUBLIC \"-//Apple//DTD PLIST 1.0//EN\" \"http://www.apple.com/DTDs/PropertyList-1.0.dtd\">\n\
         <!-- Written by `shardplane agent install`; run it again to change the options. -->\n\
         <plist version=\"1.0\">\n\
         <dict>\n\
         \x20   <key>Label</key>\n\
         \x20   <string>{LAUNCHD_LABEL}</string>\n\
         \x20   <key>ProgramArguments</key>\n\
         \x20   <array>\n\
         {args}\
         \x20   </array>\n\
         \x20   <key>RunAtLoad</key>\n\
         \x20   <true/>\n\
         \x20   <key>KeepAlive</key>\n\
         \x20   <true/>\n\
         \x20   <key>ThrottleInterval</key>\n\
         \x20   <integer>5</integer>\n\
         \x20   <key>ExitTimeOut</key>\n\
         \x20   <integer>60</integer>\n\
         \x20   <key>StandardOutPath</key>\n\
         \x20   <string>/Library/Logs/shardplane-agent.log</string>\n\
         \x20   <key>StandardErrorPath</key>\n\
         \x20   <string>/Library/Logs/shardplane-agent.log</string>\n\
         </dict>\n\
         </plist>\n"
    );
    let path = dir.join(format!("{LAUNCHD_LABEL}.plist"));
    let p = path.display().to_string();
    let cmd = |a: &[&str]| a.iter().map(|s| s.to_string()).collect::<Vec<_>>();
    Service {
        load: vec![
            cmd(&["launchctl", "bootout", &format!("system/{LAUNCHD_LABEL}")]),
            cmd(&["launchctl", "bootstrap", "system", &p]),
        ],
        path,
        content,
    }
}

fn xml_escape(s: &str) -> String {
    s.replace('&', "&amp;")
        .replace('<', "&lt;")
        .replace('>', "&gt;")
        .replace('"', "&quot;")
        .replace('\'', "&apos;")
}

#[cfg(test)]
mod tests {
    use super::*;

    fn argv() -> Vec<String> {
        [
            "/usr/local/bin/shardplane",
            "agent",
            "--node-name",
            "mac-1",
            "--label",
            "tier=daily & more",
            "--token-file",
            "/etc/shard plane/token",
            "--memory-reserve",
            "10%$HOME",
        ]
        .map(String::from)
        .to_vec()
    }

    #[test]
    fn the_systemd_unit_runs_the_agent_with_every_option_quoted() {
        let s = systemd(Path::new("/etc/systemd/system"), "mac-1", &argv());
        assert_eq!(
            s.path,
            Path::new("/etc/systemd/system/shardplane-agent.service")
        );
        assert!(
            s.content.contains(
                "ExecStart=/usr/local/bin/shardplane agent --node-name mac-1 --label \
                 \"tier=daily & more\" --token-file \"/etc/shard plane/token\" \
                 --memory-reserve 10%%$$HOME\n"
            ),
            "{}",
            s.content
        );
        assert!(s.content.contains("Restart=always\n"));
        assert!(s.content.contains("WantedBy=multi-user.target\n"));
        assert_eq!(
            s.load.last().unwrap(),
            &["systemctl", "restart", SYSTEMD_UNIT]
        );
    }

    #[test]
    fn quoting_keeps_arguments_whole() {
        assert_eq!(systemd_quote("plain"), "plain");
        assert_eq!(systemd_quote(""), "\"\"");
        assert_eq!(systemd_quote("a b"), "\"a b\"");
        assert_eq!(systemd_quote("say \"hi\""), "\"say \\\"hi\\\"\"");
        assert_eq!(systemd_quote("back\\slash"), "\"back\\\\slash\"");
        assert_eq!(systemd_quote("a;b"), "\"a;b\"");
    }

    #[test]
    fn the_launchd_daemon_is_kept_alive_and_escapes_its_arguments() {
        let s = launchd(Path::new("/Library/LaunchDaemons"), &argv());
        assert_eq!(
            s.path,
            Path::new("/Library/LaunchDaemons/dev.shardplane.agent.plist")
        );
        assert!(s.content.contains("<string>tier=daily &amp; more</string>"));
        assert!(
            s.content
                .contains("<string>/etc/shard plane/token</string>")
        );
        assert!(
            s.content
                .contains("<key>KeepAlive</key>\n    <true/>\n    <key>ThrottleInterval</key>")
        );
        assert!(s.content.contains("<key>RunAtLoad</key>\n    <true/>"));
        assert_eq!(
            s.load[1],
            [
                "launchctl",
                "bootstrap",
                "system",
                "/Library/LaunchDaemons/dev.shardplane.agent.plist"
            ]
        );
        // Every element opened is closed, in order.
        let mut open: Vec<&str> = Vec::new();
        for tag in s
            .content
            .split('<')
            .skip(1)
            .map(|t| t.split('>').next().unwrap())
        {
            if tag.starts_with('?') || tag.starts_with('!') || tag.ends_with('/') {
                continue;
            }
            match tag.strip_prefix('/') {
                Some(close) => assert_eq!(open.pop(), Some(close), "{}", s.content),
                None => open.push(tag.split_whitespace().next().unwrap()),
            }
        }
        assert!(open.is_empty());
    }

    #[test]
    fn token_files_readable_by_everyone_or_missing_are_refused() {
        let dir = tempfile::tempdir().unwrap();
        let token = dir.path().join("token");
        std::fs::write(&token, "0123456789abcdef0123456789abcdef\n").unwrap();
        std::fs::set_permissions(&token, std::fs::Permissions::from_mode(0o644)).unwrap();
        let e = check_token_file(&token).unwrap_err().to_string();
        assert!(
            e.contains("readable by every user") && e.contains("chmod 600"),
            "{e}"
        );
        std::fs::set_permissions(&token, std::fs::Permissions::from_mode(0o600)).unwrap();
        check_token_file(&token).unwrap();
        let e = check_token_file(&dir.path().join("nope")).unwrap_err();
        assert!(format!("{e:#}").contains("cannot read it"), "{e:#}");
    }
}
