//! One module per subcommand.

pub mod agent;
pub mod agent_install;
pub mod agent_kubeconfig;
pub mod bench;
mod bench_gateway;
mod bench_remote;
pub mod convert;
pub mod crds;
pub mod gateway;
pub mod generate;
mod kube_client;
mod model_args;
mod node_identity;
pub mod operator;
mod process;
pub mod status;
pub mod tensor;
pub mod threads;
mod tls_args;
pub mod up;

/// The Hugging Face token: from `file` when given, else the `HF_TOKEN`
/// environment variable; none when neither holds one.
pub(crate) fn hugging_face_token(file: Option<&std::path::Path>) -> anyhow::Result<Option<String>> {
    match file {
        Some(file) => {
            refuse_world_readable(file, "--hugging-face-token-file")?;
            Ok(shardplane_models::hub::read_token(file)?)
        }
        None => Ok(std::env::var("HF_TOKEN")
            .ok()
            .map(|t| t.trim().to_string())
            .filter(|t| !t.is_empty())),
    }
}

/// A key from a file (trimmed), refusing one every user may read or an
/// empty one.
pub(crate) fn read_secret_file(file: &std::path::Path) -> anyhow::Result<String> {
    refuse_world_readable(file, "--ui-key-file")?;
    let key = std::fs::read_to_string(file)?.trim().to_string();
    anyhow::ensure!(!key.is_empty(), "--ui-key-file {} is empty", file.display());
    Ok(key)
}

/// Refuses a secret file every user of this machine may read (or one that
/// cannot be read at all), naming `flag` and the `chmod` that fixes it.
pub(crate) fn refuse_world_readable(file: &std::path::Path, flag: &str) -> anyhow::Result<()> {
    use anyhow::Context;
    use std::os::unix::fs::PermissionsExt;
    let mode = std::fs::metadata(file)
        .with_context(|| format!("{flag} {}: cannot read it", file.display()))?
        .permissions()
        .mode();
    anyhow::ensure!(
        mode & 0o004 == 0,
        "{flag} {} is readable by every user of this machine (mode {:o}); `chmod 600 {}` first",
        file.display(),
        mode & 0o777,
        file.display()
    );
    Ok(())
}
