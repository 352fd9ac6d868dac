//! `scripts/package.sh`: the binary and the MLX libraries it links in one
//! directory that runs on a machine without this checkout's cache. The
//! package is run with the build machine's MLX directory hidden (a private
//! mount namespace with an empty tmpfs over it) and generates with
//! `--engine mlx`, so its libraries can only come from the package.
#![cfg(feature = "mlx")]

use std::path::Path;
use std::process::Command;

use shardplane_testkit::{repo_root, test_model};

fn run(cmd: &mut Command) -> String {
    let out = cmd.output().expect("the command runs");
    let (stdout, stderr) = (
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    );
    assert!(
        out.status.success(),
        "{cmd:?} failed\nstdout:\n{stdout}\nstderr:\n{stderr}"
    );
    stdout
}

#[test]
fn the_package_runs_with_the_build_machines_mlx_hidden() {
    let root = repo_root();
    let uid = run(Command::new("id").arg("-u"));
    assert_eq!(
        uid.trim(),
        "0",
        "this test hides a directory in a mount namespace: run it as root"
    );
    let out = tempfile::tempdir().unwrap();
    let pkg = run(Command::new("bash")
        .arg(root.join("scripts/package.sh"))
        .arg(env!("CARGO_BIN_EXE_shardplane"))
        .arg(out.path()));
    let pkg = Path::new(pkg.trim());
    let lib = if cfg!(target_os = "macos") {
        "libmlx.dylib"
    } else {
        "libmlx.so"
    };
    assert!(pkg.join("shardplane").is_file(), "{}", pkg.display());
    assert!(pkg.join("mlx/lib").join(lib).is_file());
    assert!(Path::new(&format!("{}.tar.gz", pkg.display())).is_file());

    // Where the build machine keeps libmlx: hidden for the run below.
    let mlx = run(Command::new("bash").arg(root.join("scripts/mlx.sh")));
    let cache = Path::new(mlx.trim()).parent().unwrap();
    let model = test_model();
    let script = r#"
        mount -t tmpfs hidden "$1"
        if [ -e "$1/mlx/lib" ]; then echo "not hidden" >&2; exit 1; fi
        ldd "$2" | grep libmlx
        exec "$2" generate --engine mlx --model "$3" --prompt "Name a colour." --max-tokens 4
    "#;
    let shown = run(Command::new("unshare")
        .args([
            "--mount",
            "--propagation",
            "private",
            "sh",
            "-c",
            script,
            "sh",
        ])
        .arg(cache)
        .arg(pkg.join("shardplane"))
        .arg(&model)
        .env_remove("LD_LIBRARY_PATH")
        .env_remove("SHARDPLANE_MODEL"));
    let ldd = shown.lines().next().unwrap_or_default();
    assert!(
        ldd.contains(&pkg.join("mlx/lib").join(lib).display().to_string()),
        "libmlx must come from the package: {ldd}"
    );
    assert!(
        shown.lines().skip(1).any(|l| !l.trim().is_empty()),
        "no text generated: {shown}"
    );
}
