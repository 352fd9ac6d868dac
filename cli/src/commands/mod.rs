//! One module per subcommand.

pub mod agent;
pub mod agent_install;
pub mod agent_kubeconfig;
pub mod bench;
mod bench_remote;
pub mod convert;
pub mod crds;
pub mod gateway;
pub mod generate;
mod kube_client;
mod model_args;
pub mod operator;
mod process;
pub mod threads;
pub mod up;

/// The Hugging Face token: from `file` when given, else the `HF_TOKEN`
/// environment variable; none when neither holds one.
pub(crate) fn hugging_face_token(file: Option<&std::path::Path>) -> anyhow::Result<Option<String>> {
    match file {
        Some(file) => {
            use std::os::unix::fs::PermissionsExt;
            let mode = std::fs::metadata(file)
                .map(|m| m.permissions().mode())
                .unwrap_or(0);
            anyhow::ensure!(
                mode & 0o004 == 0,
                "--hugging-face-token-file {} is readable by every user of this machine (mode {:o}); `chmod 600 {}` first",
                file.display(),
                mode & 0o777,
                file.display()
            );
            shardplane_models::hub::read_token(file).map_err(anyhow::Error::msg)
        }
        None => Ok(std::env::var("HF_TOKEN")
            .ok()
            .map(|t| t.trim().to_string())
            .filter(|t| !t.is_empty())),
    }
}
