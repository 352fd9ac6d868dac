//! `shardplane crds`: the CRDs generated from the Rust types.

use std::io::Write;
use std::path::PathBuf;

use anyhow::Context;
use clap::Args;

/// Options of `shardplane crds`.
#[derive(Args, Debug)]
pub struct CrdsArgs {
    /// Write one `<name>.yaml` file per CRD into this directory instead of
    /// printing a YAML stream (e.g. `charts/shardplane/files/crds`).
    #[arg(long, value_name = "DIR")]
    dir: Option<PathBuf>,
}

/// Prints or writes the CRDs.
pub fn run(args: CrdsArgs) -> anyhow::Result<()> {
    match args.dir {
        None => {
            let yaml = shardplane_crds::all_crds_yaml()?;
            std::io::stdout().lock().write_all(yaml.as_bytes())?;
        }
        Some(dir) => {
            std::fs::create_dir_all(&dir)
                .with_context(|| format!("cannot create {}", dir.display()))?;
            for (file, yaml) in shardplane_crds::crd_files()? {
                let path = dir.join(file);
                std::fs::write(&path, yaml)
                    .with_context(|| format!("cannot write {}", path.display()))?;
            }
        }
    }
    Ok(())
}
