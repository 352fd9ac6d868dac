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
//!  Q5_0 ──────────► affine 5-bit groups of 32: q,       scale d, bias −16·d
//!  Q5_1 ──────────► affine 5-bit groups of 32: q,       scale d, bias m
//!  Q4_K, Q5_K ────► a super-block of 256 is eight affine 4- or 5-bit groups
//!                   of 32: q, scale d·sc, bias −dmin·m (sc, m: the group's
//!                   6-bit scale and min)
//!  MXFP4 ─────────► mxfp4 groups of 32: the same E2M1 codes, the same E8M0 scale byte
//!  other types ───► f32, dequantized by candle (Q6_K, Q3_K and Q2_K scale
//!                   groups of 16, which MLX's groups of 32 or more cannot hold)
//! ```
//!
//! Every conversion keeps the stored values (the affine forms compute the
//! same products in another order; scales and biases are f32, which hold
//! d·sc exactly). MLX packs a group's codes as one little-endian bit stream
//! in u32 words, value `i` in bits `bits·i` up; a GGUF block of 4-bit codes
//! keeps value `j` in the low nibble of byte `j` and value `j + 16` in its
//! high nibble (a K-quant: value `j` of a pair of groups in the low nibble,
//! of the second group in the high one), and 5-bit types keep the fifth bits
//! apart.

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
            t @ (GgmlType::Q8_0
            | GgmlType::Q4_0
            | GgmlType::Q4_1
            | GgmlType::Q5_0
            | GgmlType::Q5_1
            | GgmlType::Q4_K
            | GgmlType::Q5_K
            | GgmlType::MXFP4) => {
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

/// A block type read as groups: bytes and values per block, bits per code.
struct Block {
    bytes: usize,
    values: usize,
    bits: usize,
}

/// The layout of the block types read as groups.
fn block(dtype: GgmlType) -> Option<Block> {
    let (bytes, values, bits) = match dtype {
        GgmlType::Q8_0 => (34, 32, 8),
        GgmlType::Q4_0 => (18, 32, 4),
        GgmlType::Q4_1 => (20, 32, 4),
        GgmlType::Q5_0 => (22, 32, 5),
        GgmlType::Q5_1 => (24, 32, 5),
        GgmlType::Q4_K => (144, 256, 4),
        GgmlType::Q5_K => (176, 256, 5),
        GgmlType::MXFP4 => (17, 32, 4),
        _ => return None,
    };
    Some(Block {
        bytes,
        values,
        bits,
    })
}

fn f16_at(raw: &[u8], at: usize) -> f32 {
    half::f16::from_le_bytes([raw[at], raw[at + 1]]).to_f32()
}

/// How a group's codes become values.
enum Scale {
    /// `scale · code + bias`.
    Affine(f32, f32),
    /// MXFP4: E2M1 codes times 2 to the power of the E8M0 byte (less 127).
    E8M0(u8),
}

/// The 32 codes of a 4-bit block of one group (Q4_0, Q4_1, MXFP4): value
/// `j` in the low nibble of byte `j`, value `j + 16` in its high nibble.
fn nibbles(qs: &[u8; 16]) -> [u8; GROUP] {
    std::array::from_fn(|j| match j {
        0..16 => qs[j] & 0x0f,
        _ => qs[j - 16] >> 4,
    })
}

/// Group `g` (of 8) of a K-quant's 128 bytes of 4-bit codes: pairs of
/// groups share 32 bytes, the first of a pair in the low nibbles.
fn k_nibbles(qs: &[u8; 128], g: usize) -> [u8; GROUP] {
    let pair = &qs[32 * (g / 2)..32 * (g / 2) + 32];
    std::array::from_fn(|j| {
        if g.is_multiple_of(2) {
            pair[j] & 0x0f
        } else {
            pair[j] >> 4
        }
    })
}

/// A K-quant's 6-bit scale and min of group `j` (of 8), from its 12 bytes.
fn scale_min_k4(j: usize, q: &[u8]) -> (f32, f32) {
    let (sc, m) = if j < 4 {
        (q[j] & 63, q[j + 4] & 63)
    } else {
        (
            (q[j + 4] & 0x0f) | ((q[j - 4] >> 6) << 4),
            (q[j + 4] >> 4) | ((q[j] >> 6) << 4),
        )
    };
    (f32::from(sc), f32::from(m))
}

/// Calls `each` with every group of 32 of one block: its codes and scale.
fn block_groups(dtype: GgmlType, blk: &[u8], mut each: impl FnMut([u8; GROUP], Scale)) {
    // The fifth bits of Q5_0/Q5_1: value j's in bit j of a 32-bit word.
    let fifth = |codes: [u8; GROUP], qh: u32| -> [u8; GROUP] {
        std::array::from_fn(|j| codes[j] | ((((qh >> j) & 1) as u8) << 4))
    };
    let word = |at: usize| u32::from_le_bytes([blk[at], blk[at + 1], blk[at + 2], blk[at + 3]]);
    // The 16 bytes of codes of a one-group block from `at` on.
    let qs = |at: usize| -> &[u8; 16] { blk[at..at + 16].try_into().expect("16 bytes") };
    match dtype {
        GgmlType::Q8_0 => {
            let d = f16_at(blk, 0);
            let codes = std::array::from_fn(|j| (blk[2 + j] as i8 as i16 + 128) as u8);
            each(codes, Scale::Affine(d, -128.0 * d));
        }
        GgmlType::Q4_0 => {
            let d = f16_at(blk, 0);
            each(nibbles(qs(2)), Scale::Affine(d, -8.0 * d));
        }
        GgmlType::Q4_1 => {
            let scale = Scale::Affine(f16_at(blk, 0), f16_at(blk, 2));
            each(nibbles(qs(4)), scale);
        }
        GgmlType::Q5_0 => {
            let d = f16_at(blk, 0);
            each(fifth(nibbles(qs(6)), word(2)), Scale::Affine(d, -16.0 * d));
        }
        GgmlType::Q5_1 => {
            let scale = Scale::Affine(f16_at(blk, 0), f16_at(blk, 2));
            each(fifth(nibbles(qs(8)), word(4)), scale);
        }
        GgmlType::Q4_K | GgmlType::Q5_K => {
            let (d, dmin) = (f16_at(blk, 0), f16_at(blk, 2));
            let scales = &blk[4..16];
            let (qh, at) = match dtype {
                GgmlType::Q5_K => (Some(&blk[16..48]), 48),
                _ => (None, 16),
            };
            let codes: &[u8; 128] = blk[at..at + 128].try_into().expect("128 bytes");
            for g in 0..8 {
                let mut codes = k_nibbles(codes, g);
                if let Some(qh) = qh {
                    // Value j's fifth bit: bit g of byte j.
                    for (c, h) in codes.iter_mut().zip(qh) {
                        *c |= ((h >> g) & 1) << 4;
                    }
                }
                let (sc, m) = scale_min_k4(g, scales);
                each(codes, Scale::Affine(d * sc, -(dmin * m)));
            }
        }
        GgmlType::MXFP4 => each(nibbles(qs(1)), Scale::E8M0(blk[0])),
        other => unreachable!("{} has no groups (see `block`)", other.name()),
    }
}

/// Puts `codes` of `bits` each into `words` as one little-endian bit stream.
fn pack(codes: &[u8; GROUP], bits: usize, words: &mut [u32]) {
    for (i, &c) in codes.iter().enumerate() {
        let (w, shift) = ((bits * i) / 32, (bits * i) % 32);
        words[w] |= u32::from(c) << shift;
        if shift + bits > 32 {
            words[w + 1] |= u32::from(c) >> (32 - shift);
        }
    }
}

/// Blocks of `dtype` as MLX's packed codes and per-group scales (and
/// biases, for the affine types), in `dims` with the last axis grouped.
fn groups(
    dtype: GgmlType,
    raw: &[u8],
    dims: &[usize],
) -> std::result::Result<Vec<(&'static str, Array)>, String> {
    let b = block(dtype).ok_or_else(|| format!("{} is not read as groups", dtype.name()))?;
    let Some((&inner, outer)) = dims.split_last() else {
        return Err("no dimensions".into());
    };
    if !inner.is_multiple_of(b.values) {
        return Err(format!(
            "rows of {inner} values are not whole {} blocks of {}",
            dtype.name(),
            b.values
        ));
    }
    let blocks = raw.len() / b.bytes;
    if raw.len() != blocks * b.bytes || blocks * b.values != dims.iter().product::<usize>() {
        return Err(format!(
            "{} bytes are not the {} blocks of shape {dims:?}",
            raw.len(),
            dtype.name()
        ));
    }
    let n = blocks * b.values / GROUP;
    // A group of 32 codes of `bits` fills `bits` words.
    let mut words = vec![0u32; n * b.bits];
    let mut scales = Vec::with_capacity(n);
    let mut biases = Vec::with_capacity(n);
    let mut scale_bytes = Vec::with_capacity(n);
    let mut g = 0;
    for blk in raw.chunks_exact(b.bytes) {
        block_groups(dtype, blk, |codes, scale| {
            match scale {
                Scale::Affine(s, bias) => {
                    scales.push(s);
                    biases.push(bias);
                }
                Scale::E8M0(e) => scale_bytes.push(e),
            }
            pack(&codes, b.bits, &mut words[g * b.bits..(g + 1) * b.bits]);
            g += 1;
        });
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

    /// The values MLX decodes from `raw` read as groups.
    fn decoded(dtype: GgmlType, raw: &[u8], dims: &[usize]) -> Vec<f32> {
        let mut arrays = groups(dtype, raw, dims).unwrap().into_iter();
        let (_, weight) = arrays.next().unwrap();
        let (_, scales) = arrays.next().unwrap();
        let q = super::super::array::Quant {
            scales,
            biases: arrays.next().map(|(_, b)| b),
            group_size: 32,
            bits: block(dtype).unwrap().bits,
            mode: if dtype == GgmlType::MXFP4 {
                super::super::array::QuantMode::Mxfp4
            } else {
                super::super::array::QuantMode::Affine
            },
        };
        super::super::array::dequantize(&weight, &q)
            .unwrap()
            .astype(Dtype::F32)
            .unwrap()
            .to_f32()
            .unwrap()
    }

    fn assert_close(dtype: GgmlType, got: &[f32], expected: &[f32]) {
        assert_eq!(got.len(), expected.len());
        for (j, (got, want)) in got.iter().zip(expected).enumerate() {
            assert!(
                (got - want).abs() <= 1e-6 * want.abs().max(1.0),
                "{dtype:?} value {j}: {got} vs {want}"
            );
        }
    }

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
            assert_close(dtype, &decoded(dtype, &raw, &[1, 32]), &expected);
        }
        // A row that is not whole blocks is named.
        let e = groups(GgmlType::Q8_0, &[0; 34], &[2, 17]).err().unwrap();
        assert!(e.contains("not whole Q8_0 blocks"), "{e}");
    }

    /// Blocks of every type read as groups, with random codes, scales and
    /// mins (several blocks in a row, two rows), give the values candle's
    /// ggml decoding gives.
    #[test]
    fn random_blocks_become_groups_with_the_values_ggml_decodes() {
        use rand::{Rng, SeedableRng};
        let _guard = super::super::lock();
        let mut rng = rand::rngs::StdRng::seed_from_u64(5);
        for dtype in [
            GgmlType::Q8_0,
            GgmlType::Q4_0,
            GgmlType::Q4_1,
            GgmlType::Q5_0,
            GgmlType::Q5_1,
            GgmlType::Q4_K,
            GgmlType::Q5_K,
        ] {
            let b = block(dtype).unwrap();
            let dims = [2, 2 * b.values];
            let mut raw: Vec<u8> = (0..4 * b.bytes).map(|_| rng.random()).collect();
            // Finite f16 scales (d, and m or dmin where the type has one).
            for blk in raw.chunks_exact_mut(b.bytes) {
                for at in [0, 2] {
                    let v = half::f16::from_f32(rng.random_range(-2.0..2.0f32));
                    blk[at..at + 2].copy_from_slice(&v.to_le_bytes());
                }
            }
            let candle_type = crate::gguf::candle_type(dtype).unwrap();
            let expected = candle_core::quantized::ggml_file::qtensor_from_ggml(
                candle_type,
                &raw,
                dims.to_vec(),
                &Device::Cpu,
            )
            .unwrap()
            .dequantize(&Device::Cpu)
            .unwrap()
            .flatten_all()
            .unwrap()
            .to_vec1::<f32>()
            .unwrap();
            assert_close(dtype, &decoded(dtype, &raw, &dims), &expected);
        }
    }

    #[test]
    fn layers_are_read_from_block_names() {
        assert_eq!(layer_of("blk.12.ffn_gate_exps.weight"), Some(12));
        assert_eq!(layer_of("token_embd.weight"), None);
        assert_eq!(layer_of("blk.x.attn_q.weight"), None);
    }
}
