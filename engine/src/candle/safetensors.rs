//! A stage's weights from a safetensors directory (the MLX-community layout:
//! Hugging Face names, dense or in MLX's affine group quantization) for
//! candle, which otherwise reads GGUF.
//!
//! ```text
//!  blk.3.attn_q.weight ──► Weight::Layer(3, Q) ──► model.layers.3.self_attn.q_proj.weight
//!  dense f32 / f16 / bf16 ─────────────────────────► f32
//!  weight (u32, packed) + scales + biases ─────────► f32: scale · q + bias per group
//! ```
//!
//! The loader asks for weights by their GGUF names, so both formats share it.

use std::collections::HashMap;
use std::fs::File;
use std::io::{Read, Seek, SeekFrom};
use std::path::{Path, PathBuf};

use candle_core::{DType, Device, Tensor};
use shardplane_formats::safetensors::{MAX_HEADER, header_len, parse_tensors};

use crate::config::Architecture;
use crate::error::{Error, Result};
use crate::mxfp4::{E2M1, e8m0};
use crate::names::{Layout, Weight};

/// Where one tensor lies.
struct Entry {
    /// Index into the directory's files.
    file: usize,
    dtype: String,
    shape: Vec<usize>,
    /// Absolute byte offset in the file.
    start: u64,
    len: u64,
}

/// The safetensors files of one model directory: their headers, read at
/// open; a tensor's bytes are read when the stage asks for it, so a stage
/// reads only its own layers.
pub(super) struct SafetensorsDir {
    files: Vec<PathBuf>,
    tensors: HashMap<String, Entry>,
    architecture: Architecture,
    /// `config.json`'s `quantization` entry, when the weights are quantized.
    quantization: Option<serde_json::Value>,
    origin: PathBuf,
}

impl SafetensorsDir {
    /// Reads the headers of every `*.safetensors` file of `dir` (with or
    /// without an index: every tensor is found by name in whichever file
    /// holds it).
    pub fn open(
        dir: &Path,
        architecture: Architecture,
        config: &serde_json::Value,
    ) -> Result<Self> {
        let files = crate::config::safetensors_files(dir)?;
        let mut tensors = HashMap::new();
        for (index, path) in files.iter().enumerate() {
            let corrupt = |reason: String| Error::CorruptModel {
                path: path.clone(),
                reason,
            };
            let io = |source| Error::Io {
                path: path.clone(),
                source,
            };
            let mut f = File::open(path).map_err(io)?;
            let mut first8 = [0u8; 8];
            f.read_exact(&mut first8)
                .map_err(|e| corrupt(format!("no header length: {e}")))?;
            let len = header_len(&first8)
                .filter(|&l| l - 8 <= MAX_HEADER)
                .ok_or_else(|| corrupt("the header is implausibly large".into()))?;
            let mut header = first8.to_vec();
            header.resize(len as usize, 0);
            f.read_exact(&mut header[8..])
                .map_err(|e| corrupt(format!("the header is cut short: {e}")))?;
            for (name, t) in parse_tensors(&header).map_err(|e| corrupt(e.to_string()))? {
                let entry = Entry {
                    file: index,
                    dtype: t.dtype,
                    shape: t.shape.iter().map(|&d| d as usize).collect(),
                    start: len.saturating_add(t.offsets.0),
                    len: t.offsets.1 - t.offsets.0,
                };
                tensors.insert(name, entry);
            }
        }
        let quantization = config
            .get("quantization")
            .or_else(|| config.get("quantization_config"))
            .filter(|q| q.is_object())
            .cloned();
        Ok(SafetensorsDir {
            files,
            tensors,
            architecture,
            quantization,
            origin: dir.to_path_buf(),
        })
    }

    /// The Hugging Face name of the weight GGUF calls `gguf` (`….weight` or
    /// `….bias`), and which weight it is.
    fn name(&self, gguf: &str) -> Result<(String, Weight)> {
        let (prefix, suffix) = gguf.rsplit_once('.').unwrap_or((gguf, ""));
        let weight = Weight::from_gguf_prefix(prefix).ok_or_else(|| Error::CorruptModel {
            path: self.origin.clone(),
            reason: format!("no Hugging Face name is known for {gguf}"),
        })?;
        Ok((
            weight.tensor(Layout::Mlx, self.architecture, suffix),
            weight,
        ))
    }

    /// Whether the directory holds the weight GGUF calls `gguf`.
    pub fn has(&self, gguf: &str) -> bool {
        self.name(gguf)
            .is_ok_and(|(name, _)| self.tensors.contains_key(&name))
    }

    /// Reads tensor `name` from its file.
    fn tensor(&self, name: &str, device: &Device) -> Result<Tensor> {
        let e = self.tensors.get(name).ok_or_else(|| Error::CorruptModel {
            path: self.origin.clone(),
            reason: format!("the weights have no tensor {name}"),
        })?;
        let path = &self.files[e.file];
        let corrupt = |reason: String| Error::CorruptModel {
            path: path.clone(),
            reason: format!("tensor {name}: {reason}"),
        };
        let dtype = match e.dtype.as_str() {
            "F32" => DType::F32,
            "F16" => DType::F16,
            "BF16" => DType::BF16,
            "U32" => DType::U32,
            "U8" => DType::U8,
            other => {
                return Err(Error::UnsupportedTensorType {
                    tensor: name.to_string(),
                    dtype: format!(
                        "safetensors {other} (candle reads F32, F16, BF16, and MLX's U32 packs and U8 scales)"
                    ),
                });
            }
        };
        let elements: usize = e.shape.iter().product();
        if elements.checked_mul(dtype.size_in_bytes()) != Some(e.len as usize) {
            return Err(corrupt(format!(
                "{} bytes cannot hold {:?} {}",
                e.len, e.shape, e.dtype
            )));
        }
        let mut f = File::open(path).map_err(|source| Error::Io {
            path: path.clone(),
            source,
        })?;
        // A header may promise more than the file holds: check before
        // allocating, so a hostile header is an error, not an abort.
        let size = f.metadata().map(|m| m.len()).unwrap_or(0);
        if e.start.checked_add(e.len).is_none_or(|end| end > size) {
            return Err(corrupt(format!(
                "bytes {}..+{} lie past the file's {size} bytes",
                e.start, e.len
            )));
        }
        let mut raw = vec![0u8; e.len as usize];
        f.seek(SeekFrom::Start(e.start))
            .and_then(|_| f.read_exact(&mut raw))
            .map_err(|err| corrupt(format!("{err} (truncated file?)")))?;
        Tensor::from_raw_buffer(&raw, dtype, &e.shape, device)
            .map_err(|err| corrupt(err.to_string()))
    }

    /// The weight GGUF calls `gguf`, as f32: dequantized when the file holds
    /// it quantized, and Gemma's norm offsets made whole weights (`1 + w`,
    /// as GGUF stores them).
    pub fn read(&self, gguf: &str, device: &Device) -> Result<Tensor> {
        let (name, weight) = self.name(gguf)?;
        let module = name.rsplit_once('.').map_or(name.as_str(), |(m, _)| m);
        let scales = format!("{module}.scales");
        let quantized = name.ends_with(".weight") && self.tensors.contains_key(&scales);
        let mut values = if quantized {
            let q = self.quantization_of(module)?;
            let biases = format!("{module}.biases");
            let biases = match q.mode {
                QuantMode::Affine => Some(self.tensor(&biases, device)?),
                QuantMode::Mxfp4 => None,
            };
            self.dequantize(
                &self.tensor(&name, device)?,
                &self.tensor(&scales, device)?,
                biases.as_ref(),
                q,
                &name,
            )?
        } else {
            self.tensor(&name, device)?.to_dtype(DType::F32)?
        };
        if weight.is_norm() && self.architecture.hf_norm_offset() {
            values = (values + 1.0)?;
        }
        Ok(values)
    }

    /// How `module` is quantized: its own entry in `quantization` (a module
    /// entry without `mode` is affine, as mlx-lm reads it), else the default
    /// there.
    fn quantization_of(&self, module: &str) -> Result<Quantization> {
        let q = self
            .quantization
            .as_ref()
            .ok_or_else(|| Error::CorruptModel {
                path: self.origin.clone(),
                reason: format!("{module} is quantized but config.json has no quantization entry"),
            })?;
        let own = q.get(module).filter(|e| e.is_object());
        let entry = own.unwrap_or(q);
        let number = |key: &str| {
            entry
                .get(key)
                .or_else(|| q.get(key))
                .and_then(serde_json::Value::as_u64)
                .map(|x| x as usize)
        };
        let mode = match entry.get("mode").and_then(serde_json::Value::as_str) {
            None | Some("affine") => QuantMode::Affine,
            Some("mxfp4") => QuantMode::Mxfp4,
            Some(other) => {
                return Err(Error::UnsupportedTensorType {
                    tensor: module.to_string(),
                    dtype: format!("MLX quantization mode {other:?} (affine and mxfp4 are read)"),
                });
            }
        };
        match (number("bits"), number("group_size")) {
            (Some(bits), Some(group)) => Ok(Quantization { bits, group, mode }),
            _ => Err(Error::CorruptModel {
                path: self.origin.clone(),
                reason: format!(
                    "config.json's quantization gives no bits and group_size for {module}"
                ),
            }),
        }
    }

    /// MLX's quantization undone: a row's codes are one little-endian
    /// stream of `bits`-bit values (so a 3-, 5- or 6-bit code may straddle
    /// two u32 words); each group of `group` values along a row shares a
    /// scale and (affine) a bias: `scale · code + bias`. In MXFP4 each code
    /// is a 4-bit float (E2M1) and each group of 32 shares a power of two
    /// (E8M0, a byte: `2^(s − 127)`).
    fn dequantize(
        &self,
        packed: &Tensor,
        scales: &Tensor,
        biases: Option<&Tensor>,
        q: Quantization,
        name: &str,
    ) -> Result<Tensor> {
        let Quantization { bits, group, mode } = q;
        let bad = |reason: String| Error::CorruptModel {
            path: self.origin.clone(),
            reason: format!("tensor {name}: {reason}"),
        };
        let supported = match mode {
            QuantMode::Affine => matches!(bits, 2..=6 | 8) && group > 0 && biases.is_some(),
            QuantMode::Mxfp4 => bits == 4 && group == 32 && scales.dtype() == DType::U8,
        };
        if !supported {
            return Err(Error::UnsupportedTensorType {
                tensor: name.to_string(),
                dtype: format!(
                    "MLX {mode:?} {bits}-bit groups of {group} with {} scales{} (MLX writes \
                     affine 2 to 6 and 8 bits with biases, and MXFP4 as 4 bits in groups of 32 \
                     with byte scales)",
                    scales.dtype().as_str(),
                    if biases.is_some() { " and biases" } else { "" },
                ),
            });
        }
        // `[..., rows, words]`: a matrix, or stacked experts.
        let split = |t: &Tensor| match t.dims() {
            [lead @ .., last] if !lead.is_empty() => Ok((lead.to_vec(), *last)),
            other => Err(bad(format!("a quantized weight of shape {other:?}"))),
        };
        let (lead, words) = split(packed)?;
        let (scale_lead, groups) = split(scales)?;
        let rows: usize = lead.iter().product();
        let cols = words * 32 / bits;
        if !(words * 32).is_multiple_of(bits)
            || scale_lead != lead
            || groups * group != cols
            || biases.is_some_and(|b| b.dims() != scales.dims())
        {
            return Err(bad(format!(
                "{:?} packed words do not match scales {:?} and biases {:?} at {bits} bits in groups of {group}",
                packed.dims(),
                scales.dims(),
                biases.map(Tensor::dims)
            )));
        }
        let codes: Vec<u32> = packed
            .flatten_all()?
            .to_vec1()
            .map_err(|e| bad(e.to_string()))?;
        let (scales, biases): (Vec<f32>, Vec<f32>) = match biases {
            Some(b) => (
                scales.to_dtype(DType::F32)?.flatten_all()?.to_vec1()?,
                b.to_dtype(DType::F32)?.flatten_all()?.to_vec1()?,
            ),
            None => {
                let exponents: Vec<u8> = scales.flatten_all()?.to_vec1()?;
                (exponents.iter().map(|&e| e8m0(e)).collect(), Vec::new())
            }
        };
        let mask = (1u64 << bits) - 1;
        let mut values = Vec::with_capacity(rows * cols);
        for r in 0..rows {
            let row = &codes[r * words..(r + 1) * words];
            for c in 0..cols {
                let (word, shift) = ((c * bits) / 32, (c * bits) % 32);
                let mut q = u64::from(row[word]) >> shift;
                if shift + bits > 32 {
                    q |= u64::from(row[word + 1]) << (32 - shift);
                }
                let g = r * groups + c / group;
                values.push(match mode {
                    QuantMode::Affine => scales[g] * (q & mask) as f32 + biases[g],
                    QuantMode::Mxfp4 => scales[g] * E2M1[(q & mask) as usize],
                });
            }
        }
        let mut shape = lead;
        shape.push(cols);
        Ok(Tensor::from_vec(values, shape, packed.device())?)
    }
}

/// How MLX quantized a module.
#[derive(Debug, Clone, Copy)]
struct Quantization {
    bits: usize,
    group: usize,
    mode: QuantMode,
}

/// MLX's quantization modes that candle reads back.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum QuantMode {
    /// `scale · code + bias` per group.
    Affine,
    /// 4-bit floats (E2M1) sharing a power-of-two scale per 32.
    Mxfp4,
}
