//! Reading a GGUF file's header: its metadata and tensor directory, never the
//! tensor data. Every count and size the file states is checked against a
//! bound before anything is allocated, so a corrupt or hostile header fails
//! with an error instead of exhausting memory.
//!
//! ```text
//!  "GGUF" version tensors metadata-count
//!  metadata: key ─ type ─ value …           (strings, numbers, typed arrays)
//!  tensors:  name ─ dims ─ type ─ offset …  (offsets from the data section)
//!  padding to `general.alignment`, then the tensor data
//! ```

use std::collections::BTreeMap;
use std::io::Read;

use crate::error::{Error, Result};
use crate::ggml::GgmlType;

/// The most tensors a header may list (the largest models list a few thousand).
pub const MAX_TENSORS: u64 = 1 << 16;
/// The most metadata entries a header may hold.
pub const MAX_METADATA: u64 = 1 << 16;
/// The longest string (a key, a value, a tensor name), in bytes.
pub const MAX_STRING: u64 = 16 << 20;
/// The most elements all metadata arrays may hold together (a vocabulary of
/// 256k tokens with its merges and scores is about a million).
pub const MAX_ARRAY_ELEMENTS: u64 = 1 << 23;
/// The deepest nesting of arrays.
pub const MAX_ARRAY_DEPTH: u32 = 3;
/// The most dimensions of a tensor (ggml's limit).
pub const MAX_DIMS: u32 = 4;
/// The largest alignment accepted.
pub const MAX_ALIGNMENT: u64 = 1 << 20;

/// A metadata value.
#[derive(Debug, Clone, PartialEq)]
pub enum Value {
    /// u8.
    U8(u8),
    /// i8.
    I8(i8),
    /// u16.
    U16(u16),
    /// i16.
    I16(i16),
    /// u32.
    U32(u32),
    /// i32.
    I32(i32),
    /// u64.
    U64(u64),
    /// i64.
    I64(i64),
    /// f32.
    F32(f32),
    /// f64.
    F64(f64),
    /// A boolean.
    Bool(bool),
    /// A UTF-8 string.
    String(String),
    /// An array of values of one type.
    Array(Array),
}

/// A metadata array: values of one type, stored compactly.
#[derive(Debug, Clone, PartialEq)]
pub enum Array {
    /// Unsigned integers (u8, u16, u32, u64 in the file).
    Unsigned(Vec<u64>),
    /// Signed integers (i8, i16, i32, i64 in the file).
    Signed(Vec<i64>),
    /// Floats (f32, f64 in the file).
    Float(Vec<f64>),
    /// Booleans.
    Bool(Vec<bool>),
    /// Strings.
    String(Vec<String>),
    /// Arrays.
    Array(Vec<Array>),
}

impl Array {
    /// Number of elements.
    pub fn len(&self) -> usize {
        match self {
            Array::Unsigned(v) => v.len(),
            Array::Signed(v) => v.len(),
            Array::Float(v) => v.len(),
            Array::Bool(v) => v.len(),
            Array::String(v) => v.len(),
            Array::Array(v) => v.len(),
        }
    }

    /// Whether the array is empty.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The elements as signed integers, when they are integers that fit.
    pub fn to_i64s(&self) -> Option<Vec<i64>> {
        match self {
            Array::Signed(v) => Some(v.clone()),
            Array::Unsigned(v) => v.iter().map(|&x| i64::try_from(x).ok()).collect(),
            Array::Bool(_) | Array::Float(_) | Array::String(_) | Array::Array(_) => None,
        }
    }
}

impl Value {
    /// The value as an unsigned integer, when it is a non-negative integer.
    pub fn as_u64(&self) -> Option<u64> {
        match *self {
            Value::U8(x) => Some(x.into()),
            Value::U16(x) => Some(x.into()),
            Value::U32(x) => Some(x.into()),
            Value::U64(x) => Some(x),
            Value::I8(x) => u64::try_from(x).ok(),
            Value::I16(x) => u64::try_from(x).ok(),
            Value::I32(x) => u64::try_from(x).ok(),
            Value::I64(x) => u64::try_from(x).ok(),
            _ => None,
        }
    }

    /// The value as a float, when it is a number.
    pub fn as_f64(&self) -> Option<f64> {
        match *self {
            Value::F32(x) => Some(x.into()),
            Value::F64(x) => Some(x),
            _ => self.as_u64().map(|x| x as f64),
        }
    }

    /// The value as a string.
    pub fn as_str(&self) -> Option<&str> {
        match self {
            Value::String(s) => Some(s),
            _ => None,
        }
    }

    /// The value as a boolean.
    pub fn as_bool(&self) -> Option<bool> {
        match *self {
            Value::Bool(b) => Some(b),
            _ => None,
        }
    }

    /// The value as an array.
    pub fn as_array(&self) -> Option<&Array> {
        match self {
            Value::Array(a) => Some(a),
            _ => None,
        }
    }

    /// A short description of the value's type, for error messages.
    pub fn kind(&self) -> &'static str {
        match self {
            Value::U8(_) | Value::U16(_) | Value::U32(_) | Value::U64(_) => "an unsigned integer",
            Value::I8(_) | Value::I16(_) | Value::I32(_) | Value::I64(_) => "a signed integer",
            Value::F32(_) | Value::F64(_) => "a float",
            Value::Bool(_) => "a boolean",
            Value::String(_) => "a string",
            Value::Array(_) => "an array",
        }
    }
}

/// One tensor of the directory.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TensorInfo {
    /// Its type.
    pub dtype: GgmlType,
    /// Its dimensions, innermost first (as GGUF stores them).
    pub dims: Vec<u64>,
    /// Where its data starts, from the start of the data section.
    pub offset: u64,
    /// Bytes of its data.
    pub bytes: u64,
}

impl TensorInfo {
    /// Number of values.
    pub fn elements(&self) -> u64 {
        self.dims.iter().product()
    }
}

/// A GGUF header.
#[derive(Debug, Clone, PartialEq)]
pub struct GgufHeader {
    /// The format version (2 or 3).
    pub version: u32,
    /// The metadata, by key.
    pub metadata: BTreeMap<String, Value>,
    /// The tensor directory, by name.
    pub tensors: BTreeMap<String, TensorInfo>,
    /// The alignment of the data section and of every tensor in it.
    pub alignment: u64,
    /// Where the data section starts in the file.
    pub data_offset: u64,
}

/// A reader that counts what it consumed.
struct Counting<R> {
    inner: R,
    at: u64,
    elements: u64,
}

impl<R: Read> Counting<R> {
    fn bytes<const N: usize>(&mut self) -> Result<[u8; N]> {
        let mut b = [0u8; N];
        self.inner.read_exact(&mut b).map_err(truncated)?;
        self.at += N as u64;
        Ok(b)
    }

    fn u32(&mut self) -> Result<u32> {
        Ok(u32::from_le_bytes(self.bytes()?))
    }

    fn u64(&mut self) -> Result<u64> {
        Ok(u64::from_le_bytes(self.bytes()?))
    }

    fn string(&mut self, what: &dyn Fn() -> String) -> Result<String> {
        let len = bounded(self.u64()?, MAX_STRING, &|| {
            format!("the length of {}", what())
        })?;
        let mut buf = Vec::new();
        // `take` stops at the end of the input: no allocation past what is there.
        (&mut self.inner)
            .take(len)
            .read_to_end(&mut buf)
            .map_err(truncated)?;
        if buf.len() as u64 != len {
            return Err(truncated(std::io::ErrorKind::UnexpectedEof.into()));
        }
        self.at += len;
        String::from_utf8(buf).map_err(|_| Error::Corrupt(format!("{} is not UTF-8", what())))
    }

    fn value(&mut self, kind: u32, key: &str, depth: u32) -> Result<Value> {
        Ok(match kind {
            0 => Value::U8(u8::from_le_bytes(self.bytes()?)),
            1 => Value::I8(i8::from_le_bytes(self.bytes()?)),
            2 => Value::U16(u16::from_le_bytes(self.bytes()?)),
            3 => Value::I16(i16::from_le_bytes(self.bytes()?)),
            4 => Value::U32(self.u32()?),
            5 => Value::I32(i32::from_le_bytes(self.bytes()?)),
            6 => Value::F32(f32::from_le_bytes(self.bytes()?)),
            7 => match self.bytes::<1>()?[0] {
                0 => Value::Bool(false),
                1 => Value::Bool(true),
                b => return Err(Error::Corrupt(format!("{key}: {b} is not a boolean"))),
            },
            8 => Value::String(self.string(&|| format!("metadata value {key}"))?),
            9 => Value::Array(self.array(key, depth)?),
            10 => Value::U64(self.u64()?),
            11 => Value::I64(i64::from_le_bytes(self.bytes()?)),
            12 => Value::F64(f64::from_le_bytes(self.bytes()?)),
            other => {
                return Err(Error::Corrupt(format!(
                    "{key}: value type {other} is not a GGUF type"
                )));
            }
        })
    }

    fn array(&mut self, key: &str, depth: u32) -> Result<Array> {
        if depth >= MAX_ARRAY_DEPTH {
            return Err(Error::TooLarge {
                what: format!("the nesting of arrays in {key}"),
                found: u64::from(depth) + 1,
                limit: MAX_ARRAY_DEPTH.into(),
            });
        }
        let kind = self.u32()?;
        let len = self.u64()?;
        self.elements = self.elements.saturating_add(len);
        bounded(self.elements, MAX_ARRAY_ELEMENTS, &|| {
            "the elements of all metadata arrays".into()
        })?;
        let n = len as usize;
        // Elements are read one at a time: a length past the input fails at
        // its end rather than allocating up front.
        let mut out = match kind {
            0 | 2 | 4 | 10 => Array::Unsigned(Vec::new()),
            1 | 3 | 5 | 11 => Array::Signed(Vec::new()),
            6 | 12 => Array::Float(Vec::new()),
            7 => Array::Bool(Vec::new()),
            8 => Array::String(Vec::new()),
            9 => Array::Array(Vec::new()),
            other => {
                return Err(Error::Corrupt(format!(
                    "{key}: array element type {other} is not a GGUF type"
                )));
            }
        };
        for _ in 0..n {
            match (&mut out, self.value(kind, key, depth + 1)?) {
                (
                    Array::Unsigned(v),
                    x @ (Value::U8(_) | Value::U16(_) | Value::U32(_) | Value::U64(_)),
                ) => v.push(x.as_u64().expect("unsigned")),
                (Array::Signed(v), Value::I8(x)) => v.push(x.into()),
                (Array::Signed(v), Value::I16(x)) => v.push(x.into()),
                (Array::Signed(v), Value::I32(x)) => v.push(x.into()),
                (Array::Signed(v), Value::I64(x)) => v.push(x),
                (Array::Float(v), Value::F32(x)) => v.push(x.into()),
                (Array::Float(v), Value::F64(x)) => v.push(x),
                (Array::Bool(v), Value::Bool(x)) => v.push(x),
                (Array::String(v), Value::String(x)) => v.push(x),
                (Array::Array(v), Value::Array(x)) => v.push(x),
                _ => unreachable!("the element kind decides the array kind"),
            }
        }
        Ok(out)
    }
}

fn truncated(e: std::io::Error) -> Error {
    if e.kind() == std::io::ErrorKind::UnexpectedEof {
        Error::Corrupt("the header ends early (truncated file?)".into())
    } else {
        Error::Io(e)
    }
}

fn bounded(found: u64, limit: u64, what: &dyn Fn() -> String) -> Result<u64> {
    if found > limit {
        return Err(Error::TooLarge {
            what: what(),
            found,
            limit,
        });
    }
    Ok(found)
}

impl GgufHeader {
    /// Reads a header from the start of a GGUF file.
    pub fn read<R: Read>(reader: R) -> Result<Self> {
        let mut r = Counting {
            inner: reader,
            at: 0,
            elements: 0,
        };
        if &r.bytes::<4>()? != b"GGUF" {
            return Err(Error::Corrupt("the file does not start with GGUF".into()));
        }
        let version = r.u32()?;
        if !(2..=3).contains(&version) {
            return Err(Error::Corrupt(format!(
                "GGUF version {version} is not supported (2 and 3 are)"
            )));
        }
        let tensor_count = bounded(r.u64()?, MAX_TENSORS, &|| "the number of tensors".into())?;
        let metadata_count = bounded(r.u64()?, MAX_METADATA, &|| {
            "the number of metadata entries".into()
        })?;
        let mut metadata = BTreeMap::new();
        for i in 0..metadata_count {
            let key = r.string(&|| format!("metadata key {i}"))?;
            let kind = r.u32()?;
            let value = r.value(kind, &key, 0)?;
            if metadata.insert(key.clone(), value).is_some() {
                return Err(Error::Corrupt(format!("metadata key {key} appears twice")));
            }
        }
        let alignment = match metadata.get("general.alignment") {
            None => 32,
            Some(v) => match v.as_u64() {
                Some(a) if a.is_power_of_two() && a <= MAX_ALIGNMENT => a,
                _ => {
                    return Err(Error::Corrupt(format!(
                        "general.alignment {v:?} is not a power of two up to {MAX_ALIGNMENT}"
                    )));
                }
            },
        };
        let mut tensors = BTreeMap::new();
        for i in 0..tensor_count {
            let name = r.string(&|| format!("the name of tensor {i}"))?;
            let n_dims = r.u32()?;
            if n_dims == 0 || n_dims > MAX_DIMS {
                return Err(Error::Corrupt(format!(
                    "tensor {name} has {n_dims} dimensions (1 to {MAX_DIMS} allowed)"
                )));
            }
            let mut dims = Vec::with_capacity(n_dims as usize);
            for _ in 0..n_dims {
                dims.push(r.u64()?);
            }
            let id = r.u32()?;
            let offset = r.u64()?;
            let dtype = GgmlType::from_id(id).ok_or_else(|| Error::UnsupportedTensorType {
                tensor: name.clone(),
                dtype: format!("ggml type {id}"),
            })?;
            let elements = dims
                .iter()
                .try_fold(1u64, |acc, &d| acc.checked_mul(d))
                .ok_or_else(|| Error::Corrupt(format!("tensor {name}: {dims:?} overflows")))?;
            let bytes = dtype.bytes_for(elements).ok_or_else(|| {
                Error::Corrupt(format!(
                    "tensor {name}: {elements} values do not fill whole {dtype} blocks"
                ))
            })?;
            if !offset.is_multiple_of(alignment) || offset.checked_add(bytes).is_none() {
                return Err(Error::Corrupt(format!(
                    "tensor {name}: offset {offset} is not aligned to {alignment}"
                )));
            }
            let info = TensorInfo {
                dtype,
                dims,
                offset,
                bytes,
            };
            if tensors.insert(name.clone(), info).is_some() {
                return Err(Error::Corrupt(format!("tensor {name} appears twice")));
            }
        }
        let data_offset = r.at.next_multiple_of(alignment);
        Ok(GgufHeader {
            version,
            metadata,
            tensors,
            alignment,
            data_offset,
        })
    }

    /// The metadata value at `key`.
    pub fn get(&self, key: &str) -> Result<&Value> {
        self.metadata
            .get(key)
            .ok_or_else(|| Error::metadata(key, "the key is absent"))
    }

    /// The metadata value at `key` as a non-negative integer that fits in u32.
    pub fn get_u32(&self, key: &str) -> Result<u32> {
        let v = self.get(key)?;
        v.as_u64()
            .and_then(|x| u32::try_from(x).ok())
            .ok_or_else(|| {
                Error::metadata(
                    key,
                    format!("expected a non-negative 32-bit integer, found {v:?}"),
                )
            })
    }

    /// The metadata value at `key` as a float.
    pub fn get_f32(&self, key: &str) -> Result<f32> {
        let v = self.get(key)?;
        match v {
            Value::F32(x) => Ok(*x),
            Value::F64(x) => Ok(*x as f32),
            _ => Err(Error::metadata(
                key,
                format!("expected a float, found {v:?}"),
            )),
        }
    }

    /// The metadata value at `key` as a string.
    pub fn get_str(&self, key: &str) -> Result<&str> {
        let v = self.get(key)?;
        v.as_str()
            .ok_or_else(|| Error::metadata(key, format!("expected a string, found {}", v.kind())))
    }

    /// The metadata value at `key` as an array of strings.
    pub fn get_strings(&self, key: &str) -> Result<&[String]> {
        match self.get(key)? {
            Value::Array(Array::String(s)) => Ok(s),
            v => Err(Error::metadata(
                key,
                format!("expected an array of strings, found {}", v.kind()),
            )),
        }
    }

    /// The tensor named `name`.
    pub fn tensor(&self, name: &str) -> Result<&TensorInfo> {
        self.tensors
            .get(name)
            .ok_or_else(|| Error::metadata(format!("tensor {name}"), "the tensor is absent"))
    }

    /// Bytes a tensor takes in the file (0 when absent).
    pub fn tensor_bytes(&self, name: &str) -> u64 {
        self.tensors.get(name).map_or(0, |t| t.bytes)
    }

    /// Where the data of tensor `name` starts in the file, and its length.
    pub fn tensor_range(&self, name: &str) -> Result<(u64, u64)> {
        let t = self.tensor(name)?;
        let start = self
            .data_offset
            .checked_add(t.offset)
            .ok_or_else(|| Error::Corrupt(format!("tensor {name}: offset overflows")))?;
        Ok((start, t.bytes))
    }
}

/// Writes GGUF files: small models made in tests, and files a test wants
/// malformed on purpose.
pub mod write {
    use super::{Array, Value};
    use crate::ggml::GgmlType;

    /// A tensor to write: name, dimensions (innermost first), type, raw data.
    pub struct Tensor {
        /// Its name.
        pub name: String,
        /// Its dimensions, innermost first.
        pub dims: Vec<u64>,
        /// Its type.
        pub dtype: GgmlType,
        /// Its bytes, as the type lays them out.
        pub data: Vec<u8>,
    }

    fn string(out: &mut Vec<u8>, s: &str) {
        out.extend_from_slice(&(s.len() as u64).to_le_bytes());
        out.extend_from_slice(s.as_bytes());
    }

    fn kind(v: &Value) -> u32 {
        match v {
            Value::U8(_) => 0,
            Value::I8(_) => 1,
            Value::U16(_) => 2,
            Value::I16(_) => 3,
            Value::U32(_) => 4,
            Value::I32(_) => 5,
            Value::F32(_) => 6,
            Value::Bool(_) => 7,
            Value::String(_) => 8,
            Value::Array(_) => 9,
            Value::U64(_) => 10,
            Value::I64(_) => 11,
            Value::F64(_) => 12,
        }
    }

    fn value(out: &mut Vec<u8>, v: &Value) {
        match v {
            Value::U8(x) => out.push(*x),
            Value::I8(x) => out.extend_from_slice(&x.to_le_bytes()),
            Value::U16(x) => out.extend_from_slice(&x.to_le_bytes()),
            Value::I16(x) => out.extend_from_slice(&x.to_le_bytes()),
            Value::U32(x) => out.extend_from_slice(&x.to_le_bytes()),
            Value::I32(x) => out.extend_from_slice(&x.to_le_bytes()),
            Value::U64(x) => out.extend_from_slice(&x.to_le_bytes()),
            Value::I64(x) => out.extend_from_slice(&x.to_le_bytes()),
            Value::F32(x) => out.extend_from_slice(&x.to_le_bytes()),
            Value::F64(x) => out.extend_from_slice(&x.to_le_bytes()),
            Value::Bool(x) => out.push(u8::from(*x)),
            Value::String(s) => string(out, s),
            Value::Array(a) => array(out, a),
        }
    }

    /// Arrays are written with the widest element type of their kind
    /// (u64, i64, f64).
    fn array(out: &mut Vec<u8>, a: &Array) {
        let (kind, len): (u32, usize) = match a {
            Array::Unsigned(v) => (10, v.len()),
            Array::Signed(v) => (11, v.len()),
            Array::Float(v) => (12, v.len()),
            Array::Bool(v) => (7, v.len()),
            Array::String(v) => (8, v.len()),
            Array::Array(v) => (9, v.len()),
        };
        out.extend_from_slice(&kind.to_le_bytes());
        out.extend_from_slice(&(len as u64).to_le_bytes());
        match a {
            Array::Unsigned(v) => v
                .iter()
                .for_each(|x| out.extend_from_slice(&x.to_le_bytes())),
            Array::Signed(v) => v
                .iter()
                .for_each(|x| out.extend_from_slice(&x.to_le_bytes())),
            Array::Float(v) => v
                .iter()
                .for_each(|x| out.extend_from_slice(&x.to_le_bytes())),
            Array::Bool(v) => v.iter().for_each(|x| out.push(u8::from(*x))),
            Array::String(v) => v.iter().for_each(|s| string(out, s)),
            Array::Array(v) => v.iter().for_each(|a| array(out, a)),
        }
    }

    /// A whole GGUF (version 3) file: metadata, then tensors laid out at
    /// `alignment` (what `general.alignment` says, or 32).
    pub fn file(metadata: &[(&str, Value)], tensors: &[Tensor]) -> Vec<u8> {
        let alignment = metadata
            .iter()
            .find(|(k, _)| *k == "general.alignment")
            .and_then(|(_, v)| v.as_u64())
            .filter(|a| a.is_power_of_two())
            .unwrap_or(32);
        let mut out = Vec::new();
        out.extend_from_slice(b"GGUF");
        out.extend_from_slice(&3u32.to_le_bytes());
        out.extend_from_slice(&(tensors.len() as u64).to_le_bytes());
        out.extend_from_slice(&(metadata.len() as u64).to_le_bytes());
        for (k, v) in metadata {
            string(&mut out, k);
            out.extend_from_slice(&kind(v).to_le_bytes());
            value(&mut out, v);
        }
        let mut offset = 0u64;
        for t in tensors {
            string(&mut out, &t.name);
            out.extend_from_slice(&(t.dims.len() as u32).to_le_bytes());
            for d in &t.dims {
                out.extend_from_slice(&d.to_le_bytes());
            }
            out.extend_from_slice(&t.dtype.id().to_le_bytes());
            out.extend_from_slice(&offset.to_le_bytes());
            offset = (offset + t.data.len() as u64).next_multiple_of(alignment);
        }
        out.resize((out.len() as u64).next_multiple_of(alignment) as usize, 0);
        for t in tensors {
            out.extend_from_slice(&t.data);
            out.resize((out.len() as u64).next_multiple_of(alignment) as usize, 0);
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::write::{Tensor, file};
    use super::*;

    fn small() -> Vec<u8> {
        file(
            &[
                ("general.architecture", Value::String("llama".into())),
                ("llama.block_count", Value::U32(2)),
                (
                    "tokenizer.ggml.tokens",
                    Value::Array(Array::String(vec!["a".into(), "b".into()])),
                ),
            ],
            &[Tensor {
                name: "blk.0.attn_norm.weight".into(),
                dims: vec![8],
                dtype: GgmlType::F32,
                data: vec![0; 32],
            }],
        )
    }

    #[test]
    fn a_written_header_reads_back() {
        let bytes = small();
        let h = GgufHeader::read(&bytes[..]).unwrap();
        assert_eq!(h.get_str("general.architecture").unwrap(), "llama");
        assert_eq!(h.get_u32("llama.block_count").unwrap(), 2);
        assert_eq!(h.get_strings("tokenizer.ggml.tokens").unwrap().len(), 2);
        let (start, len) = h.tensor_range("blk.0.attn_norm.weight").unwrap();
        assert_eq!(len, 32);
        assert_eq!(start % 32, 0);
        assert_eq!(start as usize + 32, bytes.len());
    }

    #[test]
    fn every_truncation_is_an_error_not_a_panic() {
        let bytes = small();
        let header_end = GgufHeader::read(&bytes[..]).unwrap().data_offset as usize;
        for cut in 0..header_end.min(bytes.len()) {
            if cut + 32 > header_end {
                // Only the padding is cut: the header itself is whole.
                continue;
            }
            assert!(GgufHeader::read(&bytes[..cut]).is_err(), "cut at {cut}");
        }
    }

    #[test]
    fn hostile_counts_and_alignment_are_refused() {
        let alignment_zero = file(&[("general.alignment", Value::U32(0))], &[]);
        let e = GgufHeader::read(&alignment_zero[..]).unwrap_err();
        assert!(e.to_string().contains("general.alignment"), "{e}");

        let mut huge = b"GGUF".to_vec();
        huge.extend_from_slice(&3u32.to_le_bytes());
        huge.extend_from_slice(&u64::MAX.to_le_bytes());
        huge.extend_from_slice(&0u64.to_le_bytes());
        assert!(matches!(
            GgufHeader::read(&huge[..]),
            Err(Error::TooLarge { .. })
        ));

        // An array claiming 2^40 elements in a file of a few bytes.
        let mut arr = b"GGUF".to_vec();
        arr.extend_from_slice(&3u32.to_le_bytes());
        arr.extend_from_slice(&0u64.to_le_bytes());
        arr.extend_from_slice(&1u64.to_le_bytes());
        arr.extend_from_slice(&1u64.to_le_bytes());
        arr.push(b'k');
        arr.extend_from_slice(&9u32.to_le_bytes());
        arr.extend_from_slice(&0u32.to_le_bytes());
        arr.extend_from_slice(&(1u64 << 40).to_le_bytes());
        assert!(matches!(
            GgufHeader::read(&arr[..]),
            Err(Error::TooLarge { .. })
        ));

        // A string claiming a terabyte.
        let mut s = b"GGUF".to_vec();
        s.extend_from_slice(&3u32.to_le_bytes());
        s.extend_from_slice(&0u64.to_le_bytes());
        s.extend_from_slice(&1u64.to_le_bytes());
        s.extend_from_slice(&(1u64 << 40).to_le_bytes());
        assert!(matches!(
            GgufHeader::read(&s[..]),
            Err(Error::TooLarge { .. })
        ));
    }

    proptest::proptest! {
        #[test]
        fn random_bytes_after_the_magic_never_panic(tail in proptest::collection::vec(proptest::num::u8::ANY, 0..512)) {
            let mut bytes = b"GGUF\x03\x00\x00\x00".to_vec();
            bytes.extend(tail);
            let _ = GgufHeader::read(&bytes[..]);
        }
    }
}
