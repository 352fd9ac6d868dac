//! `shardplane convert`: a GGUF model to the MLX-community safetensors layout
//! (`config.json`, `model.safetensors`, `tokenizer.json`,
//! `tokenizer_config.json`), which `--engine mlx` and MLX's own tools read.

use std::path::PathBuf;

use clap::Args;

/// Options of `shardplane convert`.
#[derive(Args, Debug)]
pub struct ConvertArgs {
    /// The GGUF model to convert (Q4_0, Q4_1 and Q8_0 weights stay quantized;
    /// other types are written as f16).
    #[arg(long)]
    model: PathBuf,
    /// The directory to write.
    #[arg(long)]
    out: PathBuf,
    /// Write into a directory that already holds files (replacing ours).
    #[arg(long)]
    force: bool,
}

/// Converts and prints what was written.
pub fn run(args: ConvertArgs) -> anyhow::Result<()> {
    if !args.force && std::fs::read_dir(&args.out).is_ok_and(|mut entries| entries.next().is_some())
    {
        anyhow::bail!(
            "{} is not empty: choose another --out or pass --force",
            args.out.display()
        );
    }
    convert(&args)
}

#[cfg(feature = "mlx")]
fn convert(args: &ConvertArgs) -> anyhow::Result<()> {
    use anyhow::Context;
    let done = shardplane_engine::mlx::convert::gguf_to_mlx(&args.model, &args.out)
        .with_context(|| format!("cannot convert {}", args.model.display()))?;
    let quant: Vec<String> = done
        .quantization
        .iter()
        .map(|((bits, group), n)| format!("{n} × {bits}-bit/{group}"))
        .collect();
    println!(
        "wrote {} ({} tensors, {:.1} MB; quantized modules: {})",
        done.dir.display(),
        done.tensors,
        done.bytes as f64 / 1e6,
        if quant.is_empty() {
            "none".into()
        } else {
            quant.join(", ")
        }
    );
    Ok(())
}

#[cfg(not(feature = "mlx"))]
fn convert(_: &ConvertArgs) -> anyhow::Result<()> {
    anyhow::bail!(
        "convert reads GGUF through MLX, and this binary is built without it: \
         build with `--features mlx` (after `bash scripts/mlx.sh`)"
    )
}
