//! Opening GGUF files: the header (metadata and tensor directory, read by
//! `shardplane-formats` within bounds) read once, tensors read on demand, every
//! failure turned into a clear [`Error`].

use std::fs::File;
use std::io::{BufReader, Read, Seek, SeekFrom};
use std::path::{Path, PathBuf};

use candle_core::Device;
use candle_core::quantized::{GgmlDType, QTensor};
use shardplane_formats::{GgmlType, GgufHeader};

use crate::config::ModelConfig;
use crate::error::{Error, Result};

/// Llama 3's RoPE factors, as llama.cpp's converter stores them.
const ROPE_FREQS: &str = "rope_freqs.weight";

/// A GGUF file whose header has been read.
#[derive(Debug)]
pub struct GgufFile {
    path: PathBuf,
    header: GgufHeader,
    config: ModelConfig,
}

impl GgufFile {
    /// Opens `path` and reads its header and model configuration (with
    /// Llama 3's RoPE factors, a tensor, when the file has them).
    pub fn open(path: impl AsRef<Path>) -> Result<Self> {
        let path = path.as_ref().to_path_buf();
        let file = File::open(&path).map_err(|source| Error::Io {
            path: path.clone(),
            source,
        })?;
        let mut reader = BufReader::new(file);
        let mut opened = Self::from_header(&path.to_string_lossy(), &mut reader)?;
        if opened.has_tensor(ROPE_FREQS) {
            opened.config.rope_factors = Some(opened.rope_factors(&mut reader)?);
        }
        Ok(opened)
    }

    /// Llama 3's RoPE factors (`rope_freqs.weight`): one positive number per
    /// frequency of a head.
    fn rope_factors(&self, reader: &mut BufReader<File>) -> Result<Vec<f32>> {
        let tensor = self.read_tensor(reader, ROPE_FREQS, &Device::Cpu)?;
        let corrupt = |reason: String| Error::CorruptModel {
            path: self.path.clone(),
            reason: format!("tensor {ROPE_FREQS}: {reason}"),
        };
        let factors: Vec<f32> = tensor
            .dequantize(&Device::Cpu)
            .and_then(|t| t.flatten_all()?.to_vec1())
            .map_err(|e| corrupt(e.to_string()))?;
        let want = self.config.head_dim / 2;
        if factors.len() != want {
            return Err(corrupt(format!(
                "{} factors for heads of {} dimensions (want {want})",
                factors.len(),
                self.config.head_dim
            )));
        }
        if let Some(bad) = factors.iter().find(|f| !(f.is_finite() && **f > 0.0)) {
            return Err(corrupt(format!(
                "a factor of {bad} (they must be positive)"
            )));
        }
        Ok(factors)
    }

    /// Reads a header from `reader` (e.g. the first bytes of a remote file);
    /// `origin` names it in errors. Tensors cannot be read from such a file.
    pub fn from_header<R: Read>(origin: &str, reader: &mut R) -> Result<Self> {
        let path = PathBuf::from(origin);
        let header = GgufHeader::read(reader).map_err(|e| header_error(&path, e))?;
        let config = ModelConfig::from_gguf(&header)?;
        Ok(GgufFile {
            path,
            header,
            config,
        })
    }

    /// The file's path.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// The parsed header.
    pub fn header(&self) -> &GgufHeader {
        &self.header
    }

    /// The model configuration.
    pub fn config(&self) -> &ModelConfig {
        &self.config
    }

    /// Whether the file has a tensor named `name`.
    pub fn has_tensor(&self, name: &str) -> bool {
        self.header.tensors.contains_key(name)
    }

    /// The type a tensor is stored in, when the file has it.
    pub fn tensor_type(&self, name: &str) -> Option<GgmlType> {
        self.header.tensors.get(name).map(|t| t.dtype)
    }

    /// Bytes a tensor takes in the file (0 when absent).
    pub fn tensor_bytes(&self, name: &str) -> u64 {
        self.header.tensor_bytes(name)
    }

    /// Reads one tensor through `reader` (a handle on the same file); MXFP4
    /// blocks, which candle lacks, come back as their exact f32 values.
    pub(crate) fn read_tensor(
        &self,
        reader: &mut BufReader<File>,
        name: &str,
        device: &Device,
    ) -> Result<QTensor> {
        self.read(reader, name, device, GgmlDType::F32)
    }

    /// Like [`GgufFile::read_tensor`], with MXFP4 blocks re-quantized to
    /// Q8_0 a chunk at a time (never the whole tensor in f32).
    pub(crate) fn read_tensor_q8_0(
        &self,
        reader: &mut BufReader<File>,
        name: &str,
        device: &Device,
    ) -> Result<QTensor> {
        self.read(reader, name, device, GgmlDType::Q8_0)
    }

    /// Reads one tensor; MXFP4 blocks come back as `mxfp4_as` (F32: their
    /// exact values; Q8_0).
    fn read(
        &self,
        reader: &mut BufReader<File>,
        name: &str,
        device: &Device,
        mxfp4_as: GgmlDType,
    ) -> Result<QTensor> {
        let info = self.header.tensor(name)?;
        let mxfp4 = info.dtype == GgmlType::MXFP4;
        let dtype = match candle_type(info.dtype) {
            Some(t) => t,
            // candle has no MXFP4.
            None if mxfp4 => mxfp4_as,
            None => {
                return Err(Error::UnsupportedTensorType {
                    tensor: name.to_string(),
                    dtype: info.dtype.name().to_string(),
                });
            }
        };
        let mut raw = self.read_raw(reader, name)?;
        let corrupt = |reason: String| self.corrupt(name, reason);
        let dims = self.dims(name)?;
        if mxfp4 {
            raw = match dtype {
                GgmlDType::Q8_0 => mxfp4_to_q8_0(&raw),
                _ => crate::mxfp4::decode_gguf(&raw)
                    .map(|v| v.into_iter().flat_map(f32::to_le_bytes).collect()),
            }
            .map_err(|e| corrupt(e.to_string()))?;
        }
        candle_core::quantized::ggml_file::qtensor_from_ggml(dtype, &raw, dims, device)
            .map_err(|e| corrupt(e.to_string()))
    }

    /// The bytes of tensor `name` as the file stores them.
    pub(crate) fn read_raw(&self, reader: &mut BufReader<File>, name: &str) -> Result<Vec<u8>> {
        let (start, len) = self.header.tensor_range(name)?;
        let len = usize::try_from(len).map_err(|_| self.corrupt(name, format!("{len} bytes")))?;
        let mut raw = Vec::new();
        raw.try_reserve_exact(len)
            .map_err(|e| self.corrupt(name, format!("no memory for {len} bytes: {e}")))?;
        raw.resize(len, 0);
        reader
            .seek(SeekFrom::Start(start))
            .and_then(|_| reader.read_exact(&mut raw))
            .map_err(|e| self.corrupt(name, format!("{e} (truncated file?)")))?;
        Ok(raw)
    }

    /// Tensor `name`'s dimensions, outermost first (GGUF lists them
    /// innermost first).
    pub(crate) fn dims(&self, name: &str) -> Result<Vec<usize>> {
        let info = self.header.tensor(name)?;
        info.dims
            .iter()
            .rev()
            .map(|&d| usize::try_from(d).map_err(|_| self.corrupt(name, format!("dimension {d}"))))
            .collect()
    }

    fn corrupt(&self, name: &str, reason: String) -> Error {
        Error::CorruptModel {
            path: self.path.clone(),
            reason: format!("tensor {name}: {reason}"),
        }
    }

    /// A new reader on the file, for reading tensors.
    pub(crate) fn reader(&self) -> Result<BufReader<File>> {
        let file = File::open(&self.path).map_err(|source| Error::Io {
            path: self.path.clone(),
            source,
        })?;
        Ok(BufReader::new(file))
    }
}

/// GGUF MXFP4 blocks as Q8_0 blocks (each 32 values one block of each),
/// decoded a chunk at a time.
fn mxfp4_to_q8_0(raw: &[u8]) -> Result<Vec<u8>> {
    const CHUNK_BLOCKS: usize = 1 << 15;
    let mut out = Vec::with_capacity(raw.len() / crate::mxfp4::BLOCK_BYTES * 34);
    for chunk in raw.chunks(CHUNK_BLOCKS * crate::mxfp4::BLOCK_BYTES) {
        let values = crate::mxfp4::decode_gguf(chunk)?;
        let n = values.len();
        let t = candle_core::Tensor::from_vec(values, n, &Device::Cpu)?;
        out.extend_from_slice(&QTensor::quantize(&t, GgmlDType::Q8_0)?.data()?);
    }
    Ok(out)
}

/// candle's name for a tensor type it computes with.
pub(crate) fn candle_type(t: GgmlType) -> Option<GgmlDType> {
    Some(match t {
        GgmlType::F32 => GgmlDType::F32,
        GgmlType::F16 => GgmlDType::F16,
        GgmlType::BF16 => GgmlDType::BF16,
        GgmlType::Q4_0 => GgmlDType::Q4_0,
        GgmlType::Q4_1 => GgmlDType::Q4_1,
        GgmlType::Q5_0 => GgmlDType::Q5_0,
        GgmlType::Q5_1 => GgmlDType::Q5_1,
        GgmlType::Q8_0 => GgmlDType::Q8_0,
        GgmlType::Q8_1 => GgmlDType::Q8_1,
        GgmlType::Q2_K => GgmlDType::Q2K,
        GgmlType::Q3_K => GgmlDType::Q3K,
        GgmlType::Q4_K => GgmlDType::Q4K,
        GgmlType::Q5_K => GgmlDType::Q5K,
        GgmlType::Q6_K => GgmlDType::Q6K,
        GgmlType::Q8_K => GgmlDType::Q8K,
        _ => return None,
    })
}

fn header_error(path: &Path, e: shardplane_formats::Error) -> Error {
    match e {
        shardplane_formats::Error::Io(source) => Error::Io {
            path: path.to_path_buf(),
            source,
        },
        shardplane_formats::Error::Corrupt(_) | shardplane_formats::Error::TooLarge { .. } => {
            Error::CorruptModel {
                path: path.to_path_buf(),
                reason: e.to_string(),
            }
        }
        other => other.into(),
    }
}
