//! The header of a safetensors file: an 8-byte little-endian length, then
//! that many bytes of JSON naming each tensor with its `data_offsets`.
//! Bounded: a header longer than any real one is refused before it is read.
//!
//! ```text
//!  [len: u64 LE][{"name": {"dtype", "shape", "data_offsets": [start, end]}, "__metadata__": {...}}][data…]
//! ```

use std::collections::BTreeMap;

use serde_json::Value;

/// The longest header accepted (the largest real ones are a few MB).
pub const MAX_HEADER: u64 = 100 << 20;

/// Why a safetensors header cannot be read.
#[derive(Debug, thiserror::Error)]
pub enum HeaderError {
    /// A file too short to hold its header's length.
    #[error("shorter than the 8-byte header length")]
    NoHeaderLength,
    /// A header longer than any real one.
    #[error("header of {0} bytes is implausibly large")]
    HeaderTooLarge(u64),
    /// A header that ends before its stated length.
    #[error("header of {0} bytes is cut short")]
    HeaderCutShort(u64),
    /// A header that is not JSON.
    #[error("header is not JSON: {0}")]
    HeaderNotJson(#[source] serde_json::Error),
    /// A tensor without its place in the file.
    #[error("tensor {0} has no valid data_offsets")]
    NoDataOffsets(String),
}

/// Where one tensor lies in a safetensors file, and what it holds.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TensorEntry {
    /// The element type as the header spells it (`F32`, `BF16`, `U32`, …).
    pub dtype: String,
    /// Dimensions, outermost first.
    pub shape: Vec<u64>,
    /// Byte range relative to the end of the header.
    pub offsets: (u64, u64),
}

/// Every tensor named in a safetensors header (`bytes` starts with the
/// 8-byte length).
pub fn parse_tensors(bytes: &[u8]) -> Result<BTreeMap<String, TensorEntry>, HeaderError> {
    let len = bytes
        .get(..8)
        .map(|b| u64::from_le_bytes(b.try_into().expect("8 bytes")))
        .ok_or(HeaderError::NoHeaderLength)?;
    if len > MAX_HEADER {
        return Err(HeaderError::HeaderTooLarge(len));
    }
    let json = bytes
        .get(8..8 + len as usize)
        .ok_or(HeaderError::HeaderCutShort(len))?;
    let header: BTreeMap<String, Value> =
        serde_json::from_slice(json).map_err(HeaderError::HeaderNotJson)?;
    header
        .into_iter()
        .filter(|(name, _)| name != "__metadata__")
        .map(|(name, info)| {
            let offsets = info["data_offsets"].as_array().filter(|o| o.len() == 2);
            let offsets = offsets
                .and_then(|o| Some((o[0].as_u64()?, o[1].as_u64()?)))
                .filter(|(start, end)| start <= end)
                .ok_or_else(|| HeaderError::NoDataOffsets(name.clone()))?;
            let entry = TensorEntry {
                dtype: info["dtype"].as_str().unwrap_or_default().to_string(),
                shape: info["shape"]
                    .as_array()
                    .map(|d| d.iter().filter_map(Value::as_u64).collect())
                    .unwrap_or_default(),
                offsets,
            };
            Ok((name, entry))
        })
        .collect()
}

/// Bytes of each tensor named in a safetensors header (`bytes` starts with
/// the 8-byte length).
pub fn parse_header(bytes: &[u8]) -> Result<BTreeMap<String, u64>, HeaderError> {
    Ok(parse_tensors(bytes)?
        .into_iter()
        .map(|(name, t)| (name, t.offsets.1 - t.offsets.0))
        .collect())
}

/// Length of the header (with its 8-byte prefix) from the first 8 bytes.
pub fn header_len(first8: &[u8]) -> Option<u64> {
    8u64.checked_add(u64::from_le_bytes(first8.get(..8)?.try_into().ok()?))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn file(json: &str) -> Vec<u8> {
        let mut out = (json.len() as u64).to_le_bytes().to_vec();
        out.extend_from_slice(json.as_bytes());
        out
    }

    #[test]
    fn sizes_come_from_the_offsets_and_bad_headers_are_named() {
        let ok = file(r#"{"a": {"data_offsets": [0, 64]}, "__metadata__": {"format": "mlx"}}"#);
        assert_eq!(
            parse_header(&ok).unwrap(),
            BTreeMap::from([("a".into(), 64)])
        );
        assert!(matches!(
            parse_header(&[1, 2]),
            Err(HeaderError::NoHeaderLength)
        ));
        let mut huge = ok.clone();
        huge[..8].copy_from_slice(&u64::MAX.to_le_bytes());
        assert!(matches!(
            parse_header(&huge),
            Err(HeaderError::HeaderTooLarge(_))
        ));
        assert!(matches!(
            parse_header(&ok[..12]),
            Err(HeaderError::HeaderCutShort(_))
        ));
        assert!(matches!(
            parse_header(&file("{")),
            Err(HeaderError::HeaderNotJson(_))
        ));
        assert!(matches!(
            parse_header(&file(r#"{"b": {}}"#)),
            Err(HeaderError::NoDataOffsets(n)) if n == "b"
        ));
        assert_eq!(header_len(&u64::MAX.to_le_bytes()), None);
        let t = file(r#"{"w": {"dtype": "U32", "shape": [4, 2], "data_offsets": [64, 96]}}"#);
        assert_eq!(
            parse_tensors(&t).unwrap()["w"],
            TensorEntry {
                dtype: "U32".into(),
                shape: vec![4, 2],
                offsets: (64, 96),
            }
        );
        // A range that ends before it starts is no place in the file.
        let backwards = file(r#"{"w": {"dtype": "F32", "shape": [1], "data_offsets": [8, 4]}}"#);
        assert!(matches!(
            parse_tensors(&backwards),
            Err(HeaderError::NoDataOffsets(n)) if n == "w"
        ));
    }
}
