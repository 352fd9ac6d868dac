//! `shardplane convert`: a GGUF model to the MLX-community safetensors layout.
//!
//! ```text
//!  model.gguf ──► MLX's GGUF reader ──► Hugging Face names, Llama Q/K rows
//!                                       un-permuted (halves RoPE again)
//!             ──► out/model.safetensors   quantized weights stay as they are
//!                 out/config.json         incl. "quantization" per module
//!                 out/tokenizer.json, tokenizer_config.json (chat template)
//! ```
//!
//! Q4_0, Q4_1 and Q8_0 tensors keep their values exactly (MLX reads them as
//! affine groups of 32); tensors of other GGUF types arrive as f16 and are
//! written dense.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use super::{Array, TensorMap, lock};
use crate::error::{Error, Result};
use crate::gguf::GgufFile;
use crate::names::{Layout, Part, Weight};
use crate::pipeline::TextModel;

/// What a conversion wrote.
#[derive(Debug, Clone)]
pub struct Converted {
    /// The directory.
    pub dir: PathBuf,
    /// Tensors written.
    pub tensors: usize,
    /// Bytes of `model.safetensors`.
    pub bytes: u64,
    /// Quantization of the quantized modules: (bits, group size) → count.
    pub quantization: BTreeMap<(usize, usize), usize>,
}

/// GGUF Llama stores Q and K rows permuted for interleaved RoPE; this puts
/// them back in the halves order (rows are whole, so packed quantized rows,
/// their scales and biases move alike).
fn unpermute(a: &Array, heads: usize) -> Result<Array> {
    let shape = a.shape();
    let rows = shape[0];
    let half = rows / heads / 2;
    if heads == 0 || half * 2 * heads != rows {
        return Err(Error::InvalidInput(format!(
            "cannot split {rows} rows into {heads} heads"
        )));
    }
    let rest: Vec<usize> = shape[1..].to_vec();
    let mut split = vec![heads, half, 2];
    split.extend(&rest);
    let mut axes = vec![0, 2, 1];
    axes.extend((3..3 + rest.len()).collect::<Vec<_>>());
    a.reshape(&split)?.transpose(&axes)?.reshape(&shape)
}

/// Converts the GGUF model at `gguf` into `out` (created; existing files of
/// the same names are replaced).
pub fn gguf_to_mlx(gguf: &Path, out: &Path) -> Result<Converted> {
    let file = GgufFile::open(gguf)?;
    let config = file.config().clone();
    if config.rope_factors.is_some() {
        return Err(Error::UnsupportedArchitecture(
            "converting a GGUF with Llama 3's RoPE factors (rope_freqs): config.json has no \
             place for them (serve the GGUF itself, or convert the Hugging Face checkpoint)"
                .into(),
        ));
    }
    if config.latent.is_some() {
        return Err(Error::UnsupportedArchitecture(
            "converting a deepseek2 GGUF (latent attention): serve the GGUF itself, or the \
             MLX-community safetensors"
                .into(),
        ));
    }
    if let Some((name, _)) = file
        .header()
        .tensors
        .iter()
        .find(|(_, t)| t.dtype == shardplane_formats::GgmlType::MXFP4)
    {
        return Err(Error::UnsupportedTensorType {
            tensor: name.clone(),
            dtype: "MXFP4 blocks, which a conversion does not write (serve the GGUF itself: \
                    both engines read it; or the MLX-community safetensors)"
                .into(),
        });
    }
    let text = TextModel::from_gguf(&file)?;
    let io = |path: &Path, source| Error::Io {
        path: path.to_path_buf(),
        source,
    };
    std::fs::create_dir_all(out).map_err(|e| io(out, e))?;
    let _guard = lock();
    let map = TensorMap::load_gguf(gguf)?;
    let mut written = TensorMap::new();
    let mut quantization: BTreeMap<String, (usize, usize)> = BTreeMap::new();
    let mut tensors = 0;
    // GGUF Llama (and Mixtral) permute Q/K for interleaved RoPE.
    let llama = config.architecture.interleaved_rope();
    for name in map.names() {
        let Some((prefix, suffix)) = name.rsplit_once('.') else {
            continue;
        };
        let Some(weight) = Weight::from_gguf_prefix(prefix) else {
            // e.g. rope_freqs: not a weight this layout carries.
            continue;
        };
        let mut a = map.get(&name)?;
        if llama {
            match weight {
                Weight::Layer(_, Part::Q) => a = unpermute(&a, config.heads)?,
                Weight::Layer(_, Part::K) => a = unpermute(&a, config.kv_heads)?,
                _ => {}
            }
        }
        // Gemma's Hugging Face norms are offsets from one; GGUF stores `1 + w`.
        if weight.is_norm() && config.architecture.hf_norm_offset() {
            a = a.add(&Array::from_f32(&[-1.0], &[1])?)?;
        }
        let target = weight.prefix(Layout::Mlx, config.architecture);
        if suffix == "scales" {
            let w = map.get(&format!("{prefix}.weight"))?;
            // Matrices are `[out, packed]`, stacked experts `[experts, out, packed]`.
            let last = |s: Vec<usize>| s.last().copied().unwrap_or(0);
            let (packed, groups) = (last(w.shape()), last(a.shape()));
            let inp = match weight {
                Weight::Layer(_, Part::O) => config.heads * config.head_dim,
                Weight::Layer(_, Part::Down) => config.intermediate_size,
                Weight::Layer(_, Part::ExpertDown) => config
                    .moe
                    .as_ref()
                    .map_or(0, |m| m.expert_intermediate_size),
                _ => config.hidden_size,
            };
            let bits = packed * 32 / inp.max(1);
            quantization.insert(target.clone(), (bits, inp / groups.max(1)));
        }
        written.insert(&format!("{target}.{suffix}"), &a)?;
        tensors += 1;
    }
    let tied = !map.contains("output.weight");
    let weights = out.join("model.safetensors");
    written.save_safetensors(&weights)?;
    drop(written);
    drop(map);
    drop(_guard);

    // The most common (bits, group) is the default; other modules are listed.
    let mut counts: BTreeMap<(usize, usize), usize> = BTreeMap::new();
    for q in quantization.values() {
        *counts.entry(*q).or_default() += 1;
    }
    let mut cfg = config.to_hf_json(tied);
    if let Some((&(bits, group), _)) = counts.iter().max_by_key(|(_, n)| **n) {
        let mut q = serde_json::json!({ "group_size": group, "bits": bits, "mode": "affine" });
        for (module, &(b, g)) in &quantization {
            if (b, g) != (bits, group) {
                q[module] = serde_json::json!({ "group_size": g, "bits": b });
            }
        }
        cfg["quantization"] = q.clone();
        cfg["quantization_config"] = q;
    }
    let tok = &text.tokenizer;
    let name = |id: Option<u32>| id.and_then(|i| tok.token(i));
    cfg["bos_token_id"] = serde_json::json!(tok.bos_token());
    cfg["eos_token_id"] = serde_json::json!(tok.stop_tokens());
    let write = |file: &str, body: String| -> Result<()> {
        let p = out.join(file);
        std::fs::write(&p, body).map_err(|e| io(&p, e))
    };
    write("config.json", pretty(&cfg))?;
    write("tokenizer.json", tok.to_json()?)?;
    let tok_cfg = serde_json::json!({
        "bos_token": name(tok.bos_token()),
        "eos_token": name(tok.stop_tokens().first().copied()),
        "add_bos_token": tok.adds_bos(),
        "chat_template": text.template.source(),
        "tokenizer_class": "PreTrainedTokenizerFast",
    });
    write("tokenizer_config.json", pretty(&tok_cfg))?;
    let bytes = std::fs::metadata(&weights)
        .map_err(|e| io(&weights, e))?
        .len();
    Ok(Converted {
        dir: out.to_path_buf(),
        tensors,
        bytes,
        quantization: counts,
    })
}

fn pretty(v: &serde_json::Value) -> String {
    serde_json::to_string_pretty(v).expect("JSON values serialize") + "\n"
}
