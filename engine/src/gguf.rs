//! Opening GGUF files: the header (metadata and tensor directory) read once,
//! tensors read on demand, every failure turned into a clear [`Error`].

use std::fs::File;
use std::io::BufReader;
use std::path::{Path, PathBuf};

use candle_core::Device;
use candle_core::quantized::QTensor;
use candle_core::quantized::gguf_file::Content;

use crate::config::ModelConfig;
use crate::error::{Error, Result};

/// A GGUF file whose header has been read.
#[derive(Debug)]
pub struct GgufFile {
    path: PathBuf,
    content: Content,
    config: ModelConfig,
}

impl GgufFile {
    /// Opens `path` and reads its header and model configuration.
    pub fn open(path: impl AsRef<Path>) -> Result<Self> {
        let path = path.as_ref().to_path_buf();
        let file = File::open(&path).map_err(|source| Error::Io {
            path: path.clone(),
            source,
        })?;
        let mut reader = BufReader::new(file);
        let content = Content::read(&mut reader).map_err(|e| header_error(&path, e))?;
        let config = ModelConfig::from_gguf(&content)?;
        Ok(GgufFile {
            path,
            content,
            config,
        })
    }

    /// Reads a header from `reader` (e.g. the first bytes of a remote file);
    /// `origin` names it in errors. Tensors cannot be read from such a file.
    pub fn from_header<R: std::io::Read + std::io::Seek>(
        origin: &str,
        reader: &mut R,
    ) -> Result<Self> {
        let path = PathBuf::from(origin);
        let content = Content::read(reader).map_err(|e| header_error(&path, e))?;
        let config = ModelConfig::from_gguf(&content)?;
        Ok(GgufFile {
            path,
            content,
            config,
        })
    }

    /// The file's path.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// The parsed header.
    pub fn content(&self) -> &Content {
        &self.content
    }

    /// The model configuration.
    pub fn config(&self) -> &ModelConfig {
        &self.config
    }

    /// Whether the file has a tensor named `name`.
    pub fn has_tensor(&self, name: &str) -> bool {
        self.content.tensor_infos.contains_key(name)
    }

    /// Bytes a tensor takes in the file (0 when absent).
    pub fn tensor_bytes(&self, name: &str) -> u64 {
        self.content.tensor_infos.get(name).map_or(0, |info| {
            let elems = info.shape.elem_count();
            (elems / info.ggml_dtype.block_size() * info.ggml_dtype.type_size()) as u64
        })
    }

    /// Reads one tensor through `reader` (a handle on the same file).
    pub(crate) fn read_tensor(
        &self,
        reader: &mut BufReader<File>,
        name: &str,
        device: &Device,
    ) -> Result<QTensor> {
        if !self.has_tensor(name) {
            return Err(Error::MissingMetadata {
                what: format!("tensor {name}"),
                detail: "the tensor is absent".into(),
            });
        }
        self.content
            .tensor(reader, name, device)
            .map_err(|e| Error::CorruptModel {
                path: self.path.clone(),
                reason: format!("tensor {name}: {e}"),
            })
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

fn header_error(path: &Path, e: candle_core::Error) -> Error {
    let reason = e.to_string();
    // candle reports a tensor type it does not know while reading the tensor
    // directory, before any tensor name is at hand.
    if let Some(code) = reason.strip_prefix("unknown dtype for tensor ") {
        return Error::UnsupportedTensorType {
            tensor: "(listed in the header)".into(),
            dtype: format!("ggml type {code}"),
        };
    }
    Error::CorruptModel {
        path: path.to_path_buf(),
        reason,
    }
}
