//! What an engine holds in memory of a GGUF model: its tensors in the types
//! the engine computes with (not always the file's), grouped as placement
//! counts them, and its KV cache's precision.
//!
//! ```text
//!  tensor (file type, dims) ──► Holder::tensor_bytes ──► bytes in memory
//!    Stored   as in the file
//!    Candle   vectors and biases f32; MXFP4, Q4_1, Q5_0, Q5_1 matrices Q8_0
//!             (its fast type); the others as stored
//!    Mlx      vectors and biases f32; block types as MLX groups of 32 with
//!             f32 scale and bias (MXFP4: a byte scale; Q6_K, Q3_K, Q2_K:
//!             each group of 16 spread to 32); F32, F16, BF16 and the rest f32
//!  every tensor ──► HeldBytes { per layer (blk.N.*), embedding, output head }
//! ```
//!
//! The engines count what they load (`Stage::weight_bytes`), and a test
//! loads every type in both and checks these rules against that count.

use crate::ggml::GgmlType;
use crate::gguf::{GgufHeader, TensorInfo};

/// Who holds the tensors.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Holder {
    /// The file itself: bytes as stored.
    Stored,
    /// The candle engine, with its default options (slow types re-quantized,
    /// KV as f16).
    Candle,
    /// The MLX engine, with its default options (KV as f32).
    Mlx,
}

/// Values of one MLX group.
const GROUP: u64 = 32;

impl Holder {
    /// Bytes of one key or value element in the engine's KV cache (what
    /// `ModelConfig::kv_bytes_per_token_per_layer`, counted as f32, scales
    /// by).
    pub fn kv_element_bytes(self) -> u64 {
        match self {
            Holder::Candle => 2,
            Holder::Stored | Holder::Mlx => 4,
        }
    }

    /// Bytes of tensor `name` (`info`) as held.
    pub fn tensor_bytes(self, name: &str, info: &TensorInfo) -> u64 {
        let values = info.elements();
        let vector = info.dims.len() < 2 || name.ends_with(".bias");
        match self {
            Holder::Stored => info.bytes,
            _ if vector => values.saturating_mul(4),
            Holder::Candle => match info.dtype {
                GgmlType::MXFP4 | GgmlType::Q4_1 | GgmlType::Q5_0 | GgmlType::Q5_1 => {
                    (values / GROUP).saturating_mul(GgmlType::Q8_0.block_bytes())
                }
                _ => info.bytes,
            },
            Holder::Mlx => match mlx_group(info.dtype) {
                // A group's codes, and its scale and bias (f32 each).
                Some((bits, false)) => (values / GROUP).saturating_mul(GROUP * bits / 8 + 8),
                // A scale group of 16 spread to 32 codes.
                Some((bits, true)) => (values / 16).saturating_mul(GROUP * bits / 8 + 8),
                // Codes and a byte of scale.
                None if info.dtype == GgmlType::MXFP4 => (values / GROUP).saturating_mul(17),
                None => values.saturating_mul(4),
            },
        }
    }

    /// The bytes of `header`'s tensors as held, grouped as placement counts
    /// them (`layers` transformer layers).
    pub fn held(self, header: &GgufHeader, layers: usize) -> HeldBytes {
        let mut layer_bytes = vec![0u64; layers];
        for (name, info) in &header.tensors {
            let layer = name
                .strip_prefix("blk.")
                .and_then(|rest| rest.split('.').next())
                .and_then(|i| i.parse::<usize>().ok());
            if let Some(slot) = layer.and_then(|i| layer_bytes.get_mut(i)) {
                *slot = slot.saturating_add(self.tensor_bytes(name, info));
            }
        }
        let bytes = |name: &str| {
            header
                .tensors
                .get(name)
                .map_or(0, |info| self.tensor_bytes(name, info))
        };
        let embedding = bytes("token_embd.weight");
        // Tied embeddings: the head is the embedding matrix, and a last
        // stage on another node holds its own copy.
        let head = if header.tensors.contains_key("output.weight") {
            bytes("output.weight")
        } else {
            embedding
        };
        HeldBytes {
            layer_bytes,
            embedding_bytes: embedding,
            output_bytes: head.saturating_add(bytes("output_norm.weight")),
        }
    }
}

/// An MLX affine group type's bits, and whether its scale groups of 16 are
/// spread to 32.
fn mlx_group(dtype: GgmlType) -> Option<(u64, bool)> {
    Some(match dtype {
        GgmlType::Q8_0 => (8, false),
        GgmlType::Q4_0 | GgmlType::Q4_1 | GgmlType::Q4_K => (4, false),
        GgmlType::Q5_0 | GgmlType::Q5_1 | GgmlType::Q5_K => (5, false),
        GgmlType::Q6_K => (6, true),
        GgmlType::Q3_K => (3, true),
        GgmlType::Q2_K => (2, true),
        _ => return None,
    })
}

/// A model's weights as one holder holds them.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct HeldBytes {
    /// Bytes of each layer (`blk.N.*`), in layer order.
    pub layer_bytes: Vec<u64>,
    /// Bytes of the token embedding (the first stage's).
    pub embedding_bytes: u64,
    /// Bytes of the output head and final norm (the last stage's).
    pub output_bytes: u64,
}

#[cfg(test)]
mod tests {
    use super::*;

    fn info(dtype: GgmlType, dims: &[u64]) -> TensorInfo {
        let elements: u64 = dims.iter().product();
        TensorInfo {
            dtype,
            dims: dims.to_vec(),
            offset: 0,
            bytes: dtype.bytes_for(elements).unwrap(),
        }
    }

    #[test]
    fn each_engine_holds_a_type_as_it_computes_with_it() {
        let m = |dtype| info(dtype, &[256, 64]);
        let values = 256 * 64;
        // Candle: MXFP4 doubles (17 → 34 bytes a block), Q4_K stays.
        assert_eq!(
            Holder::Candle.tensor_bytes("blk.0.ffn_up_exps.weight", &m(GgmlType::MXFP4)),
            values / 32 * 34
        );
        assert_eq!(
            Holder::Candle.tensor_bytes("w", &m(GgmlType::Q4_1)),
            values / 32 * 34
        );
        assert_eq!(
            Holder::Candle.tensor_bytes("w", &m(GgmlType::Q4_K)),
            values / 256 * 144
        );
        assert_eq!(
            Holder::Candle.tensor_bytes("w", &m(GgmlType::F16)),
            values * 2
        );
        // MLX: 4-bit groups of 32 with f32 scale and bias take 24 bytes;
        // Q6_K's groups of 16 spread to 32 codes take 2 bytes a value; F16 f32.
        assert_eq!(
            Holder::Mlx.tensor_bytes("w", &m(GgmlType::Q4_K)),
            values / 32 * 24
        );
        assert_eq!(
            Holder::Mlx.tensor_bytes("w", &m(GgmlType::Q6_K)),
            values * 2
        );
        assert_eq!(
            Holder::Mlx.tensor_bytes("w", &m(GgmlType::MXFP4)),
            values / 32 * 17
        );
        assert_eq!(Holder::Mlx.tensor_bytes("w", &m(GgmlType::F16)), values * 4);
        // Vectors and biases are f32 in both; the file holds them as stored.
        let norm = info(GgmlType::F16, &[64]);
        assert_eq!(
            Holder::Candle.tensor_bytes("blk.0.attn_norm.weight", &norm),
            256
        );
        assert_eq!(
            Holder::Mlx.tensor_bytes("blk.0.attn_norm.weight", &norm),
            256
        );
        assert_eq!(
            Holder::Stored.tensor_bytes("blk.0.attn_norm.weight", &norm),
            128
        );
        let bias = info(GgmlType::F16, &[64, 4]);
        assert_eq!(
            Holder::Candle.tensor_bytes("blk.0.ffn_up_exps.bias", &bias),
            1024
        );
        assert_eq!(Holder::Candle.kv_element_bytes(), 2);
        assert_eq!(Holder::Mlx.kv_element_bytes(), 4);
    }
}
