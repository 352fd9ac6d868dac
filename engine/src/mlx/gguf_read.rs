//! GGUF files read for MLX stages, tensor by tensor and only what the
//! stage's layers need (MLX's own reader materializes every tensor of the
//! file, so each stage of a split model would first hold all of it, and it
//! returns nothing at all for a file holding a type it lacks, such as the
//! MXFP4 blocks of gpt-oss as llama.cpp converts it).
//!
//! ```text
//!  GGUF type         MLX arrays under the tensor's name (.weight, .scales, .biases)
//!  F32, F16, BF16 ─► as stored
//!  Q8_0 ──────────► affine 8-bit groups of 32: q + 128, scale d, bias −128·d
//!  Q4_0 ──────────► affine 4-bit groups of 32: q,       scale d, bias −8·d
//!  Q4_1 ──────────► affine 4-bit groups of 32: q,       scale d, bias m
//!  MXFP4 ─────────► mxfp4 groups of 32: the same E2M1 codes, the same E8M0 scale byte
//!  other types ───► f32, dequantized by candle
//! ```
//!
//! Every conversion keeps the stored values (the affine forms compute the
//! same products in another order). MLX packs a group's codes into u32
//! words, value `i` of a word in bits `bits·i` up; a GGUF block of 4-bit
//! codes keeps value `j` in the low nibble of byte `j` and value `j + 16`
//! in its high nibble.

use std::ops::Range;

use candle_core::Device;
use shardplane_formats::GgmlType;

use super::array::{Array, Dtype, TensorMap};
use crate::error::{Error, Result};
use crate::gguf::GgufFile;

/// Values in a block of every type read here as groups.
const GROUP: usize = 32;

/// The tensors of `file` that a stage of `layers` (of `total` layers)
/// reads.
pub(super) fn load(file: &GgufFile, layers: Range<usize>, total: usize) -> Result<TensorMap> {
    let (first, last) = (layers.start == 0, layers.end == total);
    let tied = !file.has_tensor("output.weight");
    let wanted = |name: &str| match layer_of(name) {
        Some(n) => layers.contains(&n),
        None => match name {
            "token_embd.weight" => first || (last && tied),
            "output.weight" | "output_norm.weight" => last,
            _ => true,
        },
    };
    // In file order: one pass forward through the file.
    let mut names = Vec::new();
    for name in file.header().tensors.keys().filter(|n| wanted(n)) {
        names.push((file.header().tensor_range(name)?.0, name));
    }
    names.sort();
    let mut reader = file.reader()?;
    let mut map = TensorMap::new();
    for (_, name) in names {
        let info = file.header().tensor(name)?;
        let dims = file.dims(name)?;
        let corrupt = |reason: String| Error::CorruptModel {
            path: file.path().to_path_buf(),
            reason: format!("tensor {name}: {reason}"),
        };
        let arrays = match info.dtype {
            GgmlType::F32 => {
                let raw = file.read_raw(&mut reader, name)?;
                let values: Vec<f32> = raw
                    .chunks_exact(4)
                    .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
                    .collect();
                vec![("weight", Array::from_f32(&values, &dims)?)]
            }
            GgmlType::F16 | GgmlType::BF16 => {
                let raw = file.read_raw(&mut reader, name)?;
                let halves: Vec<u16> = raw
                    .chunks_exact(2)
                    .map(|b| u16::from_le_bytes([b[0], b[1]]))
                    .collect();
                let dtype = match info.dtype {
                    GgmlType::F16 => Dtype::F16,
                    _ => Dtype::BF16,
                };
                vec![("weight", Array::from_halves(&halves, &dims, dtype)?)]
            }
            t @ (GgmlType::Q8_0 | GgmlType::Q4_0 | GgmlType::Q4_1 | GgmlType::MXFP4) => {
                let raw = file.read_raw(&mut reader, name)?;
                groups(t, &raw, &dims).map_err(corrupt)?
            }
            _ => {
                let values = file
                    .read_tensor(&mut reader, name, &Device::Cpu)?
                    .dequantize(&Device::Cpu)?
                    .flatten_all()?
                    .to_vec1::<f32>()?;
                vec![("weight", Array::from_f32(&values, &dims)?)]
            }
        };
        let base = name.strip_suffix(".weight");
        for (suffix, a) in arrays {
            let key = match (base, suffix) {
                (_, "weight") => name.clone(),
                (Some(base), s) => format!("{base}.{s}"),
                (None, _) => return Err(corrupt("a quantized tensor not named *.weight".into())),
            };
            // Made on the loading thread: evaluate it here (see `Loader::vector`).
            Array::eval(&[&a])?;
            map.insert(&key, &a)?;
        }
    }
    Ok(map)
}

/// The layer of a `blk.N.…` tensor.
fn layer_of(name: &str) -> Option<usize> {
    name.strip_prefix("blk.")?.split('.').next()?.parse().ok()
}

/// A block type's bytes and bits per code.
struct Block {
    bytes: usize,
    bits: usize,
}

fn block(dtype: GgmlType) -> Block {
    match dtype {
        GgmlType::Q8_0 => Block { bytes: 34, bits: 8 },
        GgmlType::Q4_0 => Block { bytes: 18, bits: 4 },
        GgmlType::Q4_1 => Block { bytes: 20, bits: 4 },
        _ => Block { bytes: 17, bits: 4 },
    }
}

fn f16_at(raw: &[u8], at: usize) -> f32 {
    half::f16::from_le_bytes([raw[at], raw[at + 1]]).to_f32()
}

/// Blocks of `dtype` as MLX's packed codes and per-group scales (and
/// biases, for the affine types), in `dims` with the last axis grouped.
fn groups(
    dtype: GgmlType,
    raw: &[u8],
    dims: &[usize],
) -> std::result::Result<Vec<(&'static str, Array)>, String> {
    let b = block(dtype);
    let Some((&inner, outer)) = dims.split_last() else {
        return Err("no dimensions".into());
    };
    if !inner.is_multiple_of(GROUP) {
        return Err(format!(
            "rows of {inner} values are not whole blocks of {GROUP}"
        ));
    }
    let blocks = raw.len() / b.bytes;
    if raw.len() != blocks * b.bytes || blocks * GROUP != dims.iter().product::<usize>() {
        return Err(format!(
            "{} bytes are not the {:?} blocks of shape {dims:?}",
            raw.len(),
            dtype
        ));
    }
    let words_per_group = GROUP * b.bits / 32;
    let mut words = vec![0u32; blocks * words_per_group];
    let mut scales = Vec::with_capacity(blocks);
    let mut biases = Vec::with_capacity(blocks);
    let mut scale_bytes = Vec::with_capacity(blocks);
    for (i, blk) in raw.chunks_exact(b.bytes).enumerate() {
        let codes: [u8; GROUP] = match dtype {
            GgmlType::Q8_0 => std::array::from_fn(|j| (blk[2 + j] as i8 as i16 + 128) as u8),
            _ => {
                let qs = &blk[b.bytes - 16..];
                std::array::from_fn(|j| match j {
                    0..16 => qs[j] & 0x0f,
                    _ => qs[j - 16] >> 4,
                })
            }
        };
        match dtype {
            GgmlType::MXFP4 => scale_bytes.push(blk[0]),
            GgmlType::Q8_0 => {
                let d = f16_at(blk, 0);
                scales.push(d);
                biases.push(-128.0 * d);
            }
            GgmlType::Q4_0 => {
                let d = f16_at(blk, 0);
                scales.push(d);
                biases.push(-8.0 * d);
            }
            _ => {
                scales.push(f16_at(blk, 0));
                biases.push(f16_at(blk, 2));
            }
        }
        let per_word = 32 / b.bits;
        for (w, chunk) in codes.chunks_exact(per_word).enumerate() {
            words[i * words_per_group + w] = chunk
                .iter()
                .enumerate()
                .fold(0u32, |acc, (k, &c)| acc | (u32::from(c) << (b.bits * k)));
        }
    }
    let shape = |last: usize| -> Vec<usize> { outer.iter().copied().chain([last]).collect() };
    let mlx_err = |e: Error| e.to_string();
    let weight = Array::from_u32(&words, &shape(inner * b.bits / 32)).map_err(mlx_err)?;
    let group_shape = shape(inner / GROUP);
    Ok(match dtype {
        GgmlType::MXFP4 => vec![
            ("weight", weight),
            (
                "scales",
                Array::from_bytes(&scale_bytes, &group_shape).map_err(mlx_err)?,
            ),
        ],
        _ => vec![
            ("weight", weight),
            (
                "scales",
                Array::from_f32(&scales, &group_shape).map_err(mlx_err)?,
            ),
            (
                "biases",
                Array::from_f32(&biases, &group_shape).map_err(mlx_err)?,
            ),
        ],
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Q8_0, Q4_0, Q4_1 and MXFP4 blocks read as MLX groups give the values
    /// ggml's own decoding gives.
    #[test]
    fn blocks_become_groups_with_the_same_values() {
        let _guard = super::super::lock();
        let d = half::f16::from_f32(0.25).to_le_bytes();
        let m = half::f16::from_f32(-1.5).to_le_bytes();
        let qs: Vec<u8> = (0..16u8).map(|j| j | ((15 - j) << 4)).collect();
        let nibble = |j: usize| -> u8 {
            match j {
                0..16 => j as u8,
                _ => 15 - (j as u8 - 16),
            }
        };
        let signed: Vec<u8> = (0..32).map(|j| (j as i8 * 7 - 100) as u8).collect();
        let cases: Vec<(GgmlType, Vec<u8>, Vec<f32>)> = vec![
            (
                GgmlType::Q8_0,
                [&d[..], &signed].concat(),
                (0..32)
                    .map(|j| 0.25 * f32::from(j as i8 * 7 - 100))
                    .collect(),
            ),
            (
                GgmlType::Q4_0,
                [&d[..], &qs].concat(),
                (0..32)
                    .map(|j| 0.25 * (f32::from(nibble(j)) - 8.0))
                    .collect(),
            ),
            (
                GgmlType::Q4_1,
                [&d[..], &m, &qs].concat(),
                (0..32).map(|j| 0.25 * f32::from(nibble(j)) - 1.5).collect(),
            ),
            (
                GgmlType::MXFP4,
                [&[130u8][..], &qs].concat(),
                (0..32)
                    .map(|j| crate::mxfp4::E2M1[nibble(j) as usize] * 8.0)
                    .collect(),
            ),
        ];
        for (dtype, raw, expected) in cases {
            let mut arrays = groups(dtype, &raw, &[1, 32]).unwrap().into_iter();
            let (_, weight) = arrays.next().unwrap();
            let (_, scales) = arrays.next().unwrap();
            let biases = arrays.next().map(|(_, b)| b);
            let mode = if dtype == GgmlType::MXFP4 {
                super::super::array::QuantMode::Mxfp4
            } else {
                super::super::array::QuantMode::Affine
            };
            let q = super::super::array::Quant {
                scales,
                biases,
                group_size: 32,
                bits: block(dtype).bits,
                mode,
            };
            let values = super::super::array::dequantize(&weight, &q)
                .unwrap()
                .astype(Dtype::F32)
                .unwrap()
                .to_f32()
                .unwrap();
            for (j, (got, want)) in values.iter().zip(&expected).enumerate() {
                assert!(
                    (got - want).abs() <= 1e-6 * want.abs().max(1.0),
                    "{dtype:?} value {j}: {got} vs {want}"
                );
            }
        }
        // A row that is not whole blocks is named.
        let e = groups(GgmlType::Q8_0, &[0; 34], &[2, 17]).err().unwrap();
        assert!(e.contains("not whole blocks"), "{e}");
    }

    #[test]
    fn layers_are_read_from_block_names() {
        assert_eq!(layer_of("blk.12.ffn_gate_exps.weight"), Some(12));
        assert_eq!(layer_of("token_embd.weight"), None);
        assert_eq!(layer_of("blk.x.attn_q.weight"), None);
    }
}
