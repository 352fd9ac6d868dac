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
            other => {
                return Err(Error::UnsupportedTensorType {
                    tensor: name.to_string(),
                    dtype: format!(
                        "safetensors {other} (candle reads F32, F16, BF16 and MLX's U32 packs)"
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
            let (bits, group) = self.quantization_of(module)?;
            self.dequantize(
                &self.tensor(&name, device)?,
                &self.tensor(&scales, device)?,
                &self.tensor(&format!("{module}.biases"), device)?,
                bits,
                group,
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

    /// Bits and group size of `module`: its own entry in `quantization`, else
    /// the default there.
    fn quantization_of(&self, module: &str) -> Result<(usize, usize)> {
        let q = self
            .quantization
            .as_ref()
            .ok_or_else(|| Error::CorruptModel {
                path: self.origin.clone(),
                reason: format!("{module} is quantized but config.json has no quantization entry"),
            })?;
        let entry = q.get(module).filter(|e| e.is_object()).unwrap_or(q);
        let number = |key: &str| {
            entry
                .get(key)
                .or_else(|| q.get(key))
                .and_then(serde_json::Value::as_u64)
                .map(|x| x as usize)
        };
        match (number("bits"), number("group_size")) {
            (Some(bits), Some(group)) => Ok((bits, group)),
            _ => Err(Error::CorruptModel {
                path: self.origin.clone(),
                reason: format!(
                    "config.json's quantization gives no bits and group_size for {module}"
                ),
            }),
        }
    }

    /// MLX's affine quantization undone: a row's codes are one little-endian
    /// stream of `bits`-bit values (so a 3-, 5- or 6-bit code may straddle
    /// two u32 words); each group of `group` values along a row shares a
    /// scale and a bias.
    fn dequantize(
        &self,
        packed: &Tensor,
        scales: &Tensor,
        biases: &Tensor,
        bits: usize,
        group: usize,
        name: &str,
    ) -> Result<Tensor> {
        let bad = |reason: String| Error::CorruptModel {
            path: self.origin.clone(),
            reason: format!("tensor {name}: {reason}"),
        };
        if !matches!(bits, 2..=6 | 8) || group == 0 {
            return Err(Error::UnsupportedTensorType {
                tensor: name.to_string(),
                dtype: format!(
                    "MLX {bits}-bit groups of {group} (MLX writes 2 to 6 and 8 bits, in groups)"
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
            || biases.dims() != scales.dims()
        {
            return Err(bad(format!(
                "{:?} packed words do not match scales {:?} and biases {:?} at {bits} bits in groups of {group}",
                packed.dims(),
                scales.dims(),
                biases.dims()
            )));
        }
        let codes: Vec<u32> = packed
            .flatten_all()?
            .to_vec1()
            .map_err(|e| bad(e.to_string()))?;
        let scales: Vec<f32> = scales.to_dtype(DType::F32)?.flatten_all()?.to_vec1()?;
        let biases: Vec<f32> = biases.to_dtype(DType::F32)?.flatten_all()?.to_vec1()?;
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
                values.push(scales[g] * (q & mask) as f32 + biases[g]);
            }
        }
        let mut shape = lead;
        shape.push(cols);
        Ok(Tensor::from_vec(values, shape, packed.device())?)
    }
}
