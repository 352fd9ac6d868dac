//! What an engine holds in memory of a model (GGUF, or the MLX-community
//! safetensors layout): its tensors in the types
//! the engine computes with (not always the file's), grouped as placement
//! counts them, and its KV cache's precision.
//!
//! ```text
//!  tensor (file type, dims) ──► Holder::tensor_bytes ──► bytes in memory
//!    Stored   as in the file
//!    Candle   vectors and biases f32; F32, F16 and BF16 products f32 (the
//!             embedding's lookup table as stored); MXFP4, Q4_1, Q5_0, Q5_1
//!             matrices Q8_0 (its fast type); the others as stored
//!    Mlx      vectors and biases f32; block types as MLX groups of 32 with
//!             f32 scale and bias (MXFP4: a byte scale; Q6_K, Q3_K, Q2_K:
//!             each group of 16 spread to 32); F32, F16, BF16 and the rest f32
//!  every tensor ──► HeldBytes { per layer (blk.N.*), embedding, output head }
//!  safetensors (MLX-community) ──► Holder::safetensors_bytes
//!    Candle   matrices (quantized ones undone) Q8_0, or f32 when rows do
//!             not fill its blocks; vectors and biases f32
//!    Mlx      quantized codes as stored, affine scales and biases f32;
//!             everything else f32
//!  latent attention's per-head maps (DeepSeek, Kimi): f32 on candle; a
//!  joined map beside split ones unread; MLX splits a lone joined map into
//!  an f32 copy beside it
//! ```
//!
//! The engines count what they keep of what they load
//! (`Stage::weight_bytes`); the engine tests load several GGUF types and
//! every family's tiny model (both formats) in both engines and check these
//! rules against that count.

use std::collections::BTreeMap;

use crate::ggml::GgmlType;
use crate::gguf::{GgufHeader, TensorInfo};
use crate::safetensors::TensorEntry;

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

    /// Bytes of tensor `name` (`info`) as held, as a product's weight
    /// (not the embedding's lookup table: see [`Holder::held`]).
    pub fn tensor_bytes(self, name: &str, info: &TensorInfo) -> u64 {
        self.gguf_bytes(name, info, false)
    }

    /// Bytes of a GGUF tensor as held; `lookup`: the token embedding's
    /// table (candle keeps it in the file's type, F16 included).
    fn gguf_bytes(self, name: &str, info: &TensorInfo, lookup: bool) -> u64 {
        let values = info.elements();
        let vector = info.dims.len() < 2 || name.ends_with(".bias");
        let f32 = values.saturating_mul(4);
        match self {
            Holder::Stored => info.bytes,
            _ if vector => f32,
            // Read as values (see `latent`).
            Holder::Candle if latent(name).is_some() => f32,
            Holder::Candle => match info.dtype {
                GgmlType::MXFP4 | GgmlType::Q4_1 | GgmlType::Q5_0 | GgmlType::Q5_1 => {
                    (values / GROUP).saturating_mul(GgmlType::Q8_0.block_bytes())
                }
                // A product of a float matrix is an f32 tensor.
                GgmlType::F32 | GgmlType::F16 | GgmlType::BF16 if !lookup => f32,
                _ => info.bytes,
            },
            Holder::Mlx => {
                let grouped = match mlx_group(info.dtype) {
                    // A group's codes, and its scale and bias (f32 each).
                    Some((bits, false)) => (values / GROUP).saturating_mul(GROUP * bits / 8 + 8),
                    // A scale group of 16 spread to 32 codes.
                    Some((bits, true)) => (values / 16).saturating_mul(GROUP * bits / 8 + 8),
                    // Codes and a byte of scale.
                    None if info.dtype == GgmlType::MXFP4 => (values / GROUP).saturating_mul(17),
                    None => f32,
                };
                // A joined latent map is split into an f32 copy beside it.
                match latent(name) {
                    Some(Latent::Joined) => grouped.saturating_add(f32),
                    _ => grouped,
                }
            }
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
            // A joined latent map beside split ones is not read.
            let unread = self != Holder::Stored
                && latent(name) == Some(Latent::Joined)
                && header.tensors.contains_key(&split_beside(name));
            if let Some(slot) = layer.and_then(|i| layer_bytes.get_mut(i))
                && !unread
            {
                *slot = slot.saturating_add(self.gguf_bytes(name, info, false));
            }
        }
        let bytes = |name: &str, lookup: bool| {
            header
                .tensors
                .get(name)
                .map_or(0, |info| self.gguf_bytes(name, info, lookup))
        };
        let embedding = bytes("token_embd.weight", true);
        // Tied embeddings: the head is the embedding matrix (as a
        // product's weight), and a last stage on another node holds its
        // own copy.
        let head = if header.tensors.contains_key("output.weight") {
            bytes("output.weight", false)
        } else {
            bytes("token_embd.weight", false)
        };
        HeldBytes {
            layer_bytes,
            embedding_bytes: embedding,
            output_bytes: head.saturating_add(bytes("output_norm.weight", false)),
        }
    }
}

impl Holder {
    /// Bytes of tensor `name` (`entry`) of a safetensors model (the
    /// MLX-community layout, `tensors` all of its tensors) as held;
    /// `bits(module)`: the bits of a quantized module's codes, as
    /// `config.json`'s `quantization` gives them. candle reads every matrix
    /// as values (quantized ones undone) and holds it as Q8_0 when its rows
    /// fill blocks of 32, else f32; MLX holds quantized codes as stored,
    /// affine scales and biases as f32, everything else as f32.
    pub fn safetensors_bytes(
        self,
        name: &str,
        entry: &TensorEntry,
        tensors: &BTreeMap<String, TensorEntry>,
        bits: &dyn Fn(&str) -> Option<u64>,
    ) -> u64 {
        let stored = entry.offsets.1.saturating_sub(entry.offsets.0);
        let elements = entry
            .shape
            .iter()
            .fold(1u64, |product, d| product.saturating_mul(*d));
        let module = name.rsplit_once('.').map_or(name, |(m, _)| m);
        let has = |suffix: &str| tensors.contains_key(&format!("{module}.{suffix}"));
        let quantized = name.ends_with(".weight") && has("scales");
        let quantization = (name.ends_with(".scales") || name.ends_with(".biases"))
            && has("weight")
            && has("scales");
        let last = entry.shape.last().copied().unwrap_or(0);
        // Values of the matrix, and of a row: a quantized one's codes at
        // its bits (32 / bits values a u32 word).
        let (values, row) = match (quantized, bits(module).filter(|b| *b > 0)) {
            (true, Some(bits)) => (
                elements.saturating_mul(32) / bits,
                last.saturating_mul(32) / bits,
            ),
            (true, None) => return stored,
            (false, _) => (elements, last),
        };
        let map = latent(name);
        if self != Holder::Stored
            && map == Some(Latent::Joined)
            && tensors.contains_key(&split_beside(name))
        {
            return 0;
        }
        let f32 = values.saturating_mul(4);
        // A vector, a bias, or a one-row matrix (a gate's row).
        let vector = entry.shape.len() < 2 || name.ends_with(".bias") || entry.shape[0] == 1;
        match self {
            Holder::Stored => stored,
            // Folded into the values of their weight.
            Holder::Candle if quantization => 0,
            Holder::Candle if map.is_some() || vector => f32,
            Holder::Candle => q8_0_or_f32(values, row),
            Holder::Mlx => {
                let held = if quantized || (quantization && entry.dtype == "U8") {
                    stored
                } else {
                    elements.saturating_mul(4)
                };
                match map {
                    Some(Latent::Joined) if !quantization => held.saturating_add(f32),
                    _ => held,
                }
            }
        }
    }
}

/// Bytes of `values` values in rows of `row` as candle holds a matrix read
/// as values: Q8_0 when rows fill its blocks, else f32.
fn q8_0_or_f32(values: u64, row: u64) -> u64 {
    if row > 0 && row.is_multiple_of(GROUP) {
        (values / GROUP).saturating_mul(GgmlType::Q8_0.block_bytes())
    } else {
        values.saturating_mul(4)
    }
}

/// Latent attention's per-head maps (DeepSeek, Kimi): both engines read
/// them apart from other matrices. candle reads them as values and holds
/// f32; MLX splits a joined map into an f32 copy beside it; a joined map
/// beside split ones is not read at all.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Latent {
    /// The key map and the value map, apart.
    Split,
    /// Both in one (`kv_b`).
    Joined,
}

const SPLIT_MAPS: [&str; 4] = [
    ".attn_k_b.",
    ".attn_v_b.",
    ".self_attn.embed_q.",
    ".self_attn.unembed_out.",
];
const JOINED_MAPS: [(&str, &str); 2] = [
    (".attn_kv_b.", ".attn_k_b."),
    (".self_attn.kv_b_proj.", ".self_attn.embed_q."),
];

fn latent(name: &str) -> Option<Latent> {
    if SPLIT_MAPS.iter().any(|m| name.contains(m)) {
        Some(Latent::Split)
    } else if JOINED_MAPS.iter().any(|(m, _)| name.contains(m)) {
        Some(Latent::Joined)
    } else {
        None
    }
}

/// The weight of the split key map of a joined map's layer.
fn split_beside(joined: &str) -> String {
    let (layer, split) = JOINED_MAPS
        .iter()
        .find_map(|(m, split)| joined.split_once(m).map(|(layer, _)| (layer, split)))
        .unwrap_or((joined, &""));
    format!("{layer}{split}weight")
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
        // A float matrix's product is an f32 tensor on candle.
        assert_eq!(
            Holder::Candle.tensor_bytes("w", &m(GgmlType::F16)),
            values * 4
        );
        // Latent attention's maps are read as values: f32.
        assert_eq!(
            Holder::Candle.tensor_bytes("blk.0.attn_k_b.weight", &m(GgmlType::Q8_0)),
            values * 4
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
