//! Every process a subcommand starts gets this program's environment minus
//! the variables cargo sets for a program it builds and runs (`cargo run`):
//! `OUT_DIR` and friends describe *this* crate's build, and a build tool a
//! child runs (the kube-apiserver `make` in `scripts/control-plane.sh`)
//! would otherwise write its output where cargo keeps ours.
//!
//! ```text
//!  cargo run -- up ──► up (OUT_DIR, CARGO_PKG_*, …) ──► command("bash") ──► scripts: no OUT_DIR
//! ```

use std::ffi::{OsStr, OsString};
use std::process::Command;

/// A [`Command`] for `program` that inherits no cargo build variable.
pub fn command(program: impl AsRef<OsStr>) -> Command {
    let mut command = Command::new(program);
    without_build_variables(&mut command, std::env::vars_os().map(|(name, _)| name));
    command
}

/// Removes from `command`'s environment those of `names` that cargo sets for
/// the program it runs.
fn without_build_variables(command: &mut Command, names: impl Iterator<Item = OsString>) {
    for name in names {
        if name.to_str().is_some_and(is_build_variable) {
            command.env_remove(name);
        }
    }
}

/// Whether cargo sets `name` for the program it runs or tests (`cargo run`,
/// `cargo test`); the user's own cargo settings (`CARGO_HOME`,
/// `CARGO_TARGET_DIR`, …) stay.
fn is_build_variable(name: &str) -> bool {
    const EXACT: &[&str] = &[
        "OUT_DIR",
        "CARGO",
        "CARGO_MANIFEST_DIR",
        "CARGO_MANIFEST_PATH",
        "CARGO_CRATE_NAME",
        "CARGO_BIN_NAME",
        "CARGO_PRIMARY_PACKAGE",
        "CARGO_TARGET_TMPDIR",
        "CARGO_RUSTC_CURRENT_DIR",
    ];
    const PREFIXES: &[&str] = &["CARGO_PKG_", "CARGO_BIN_EXE_"];
    EXACT.contains(&name) || PREFIXES.iter().any(|p| name.starts_with(p))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cargo_build_variables_are_removed_and_the_users_settings_kept() {
        let mut command = Command::new("env");
        let names = [
            "OUT_DIR",
            "CARGO_PKG_NAME",
            "CARGO_MANIFEST_DIR",
            "CARGO_BIN_EXE_shardplane",
            "CARGO_HOME",
            "CARGO_TARGET_DIR",
            "PATH",
            "HOME",
            "SHARDPLANE_CACHE",
        ];
        without_build_variables(&mut command, names.iter().map(OsString::from));
        let removed: Vec<_> = command
            .get_envs()
            .filter(|(_, value)| value.is_none())
            .map(|(name, _)| name.to_str().unwrap().to_string())
            .collect();
        assert_eq!(
            removed,
            [
                "CARGO_BIN_EXE_shardplane",
                "CARGO_MANIFEST_DIR",
                "CARGO_PKG_NAME",
                "OUT_DIR"
            ]
        );
    }

    #[test]
    fn a_child_does_not_see_out_dir() {
        // This test binary runs under cargo, which sets some of them.
        let out = command("env").output().unwrap();
        let seen = String::from_utf8(out.stdout).unwrap();
        for line in seen.lines() {
            let name = line.split('=').next().unwrap();
            assert!(!is_build_variable(name), "{line}");
        }
        assert!(seen.lines().any(|l| l.starts_with("PATH=")));
    }
}
