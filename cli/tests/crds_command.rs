//! `shardplane crds` prints CRDs a real API server accepts as they are.

use shardplane_testkit::control_plane;

#[test]
fn crds_output_is_clean_under_server_dry_run() -> anyhow::Result<()> {
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_shardplane"))
        .arg("crds")
        .output()?;
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let yaml = String::from_utf8(out.stdout)?;
    assert_eq!(
        yaml.matches("kind: CustomResourceDefinition").count(),
        6,
        "{yaml}"
    );
    let applied =
        control_plane().kubectl_output(&["apply", "--dry-run=server", "-f", "-"], &yaml)?;
    assert!(
        applied.success && applied.stderr.trim().is_empty(),
        "{}\n{}",
        applied.stdout,
        applied.stderr
    );
    assert_eq!(
        applied.stdout.matches("(server dry run)").count(),
        6,
        "{}",
        applied.stdout
    );
    Ok(())
}

#[test]
fn crds_dir_writes_the_chart_files() -> anyhow::Result<()> {
    let dir = tempfile::tempdir()?;
    let status = std::process::Command::new(env!("CARGO_BIN_EXE_shardplane"))
        .args(["crds", "--dir"])
        .arg(dir.path())
        .status()?;
    assert!(status.success());
    for (file, yaml) in shardplane_crds::crd_files()? {
        assert_eq!(
            std::fs::read_to_string(dir.path().join(&file))?,
            yaml,
            "{file}"
        );
    }
    Ok(())
}
