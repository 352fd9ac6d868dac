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
//!  Q6_K, Q3_K, ───► spread: each scale group of 16 becomes an affine group
//!  Q2_K             of 32 whose last 16 codes are padding (0), and inputs
//!                   are spread to match (see `Quant::spread`): 6-bit q,
//!                   scale d·sc, bias −32·d·sc; 3-bit q, d·(sc − 32),
//!                   −4·d·(sc − 32); 2-bit q, d·sc, −dmin·m
//!  other types ───► f32, dequantized by candle
//! ```
//!
//! Every conversion keeps the stored values (the affine forms compute the
//! same products in another order; scales and biases are f32, which hold
//! d·sc exactly). Spreading doubles a matrix's codes: a Q6_K matrix takes 16
//! bits a value (12 of codes, 4 of scale and bias), half of f32; Q3_K 10,
//! Q2_K 8. MLX packs a group's codes as one little-endian bit stream
//! in u32 words, value `i` in bits `bits·i` up; a GGUF block of 4-bit codes
//! keeps value `j` in the low nibble of byte `j` and value `j + 16` in its
//! high nibble (a K-quant: value `j` of a pair of groups in the low nibble,
//! of the second group in the high one), and 5-bit types keep the fifth bits
//! apart.

use std::collections::BTreeSet;
use std::ops::Range;

use candle_core::Device;
use shardplane_formats::GgmlType;

use super::array::{Array, Dtype, SPREAD_GROUP, TensorMap};
use crate::error::{Error, Result};
use crate::gguf::GgufFile;

/// Values in a block of every type read here as groups.
const GROUP: usize = 32;

/// The tensors a stage reads from a GGUF file.
pub(super) struct Read {
    /// The arrays by name.
    pub(super) map: TensorMap,
    /// The weights (`….weight`) held spread: the loader takes a matrix as
    /// spread only when it is named here, so a matrix twice as wide as
    /// expected is refused rather than read as spread.
    pub(super) spread: BTreeSet<String>,
}

/// The tensors of `file` that a stage of `layers` (of `total` layers)
/// reads.
pub(super) fn load(file: &GgufFile, layers: Range<usize>, total: usize) -> Result<Read> {
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
    let mut spread = BTreeSet::new();
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
            | GgmlType::Q6_K
            | GgmlType::Q3_K
            | GgmlType::Q2_K
            | GgmlType::MXFP4) => {
                let raw = file.read_raw(&mut reader, name)?;
                if block(t).is_some_and(|b| b.spread) {
                    spread.insert(name.clone());
                }
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
    Ok(Read { map, spread })
}

/// The layer of a `blk.N.…` tensor.
fn layer_of(name: &str) -> Option<usize> {
    name.strip_prefix("blk.")?.split('.').next()?.parse().ok()
}

/// A block type read as groups: bytes and values per block, bits per code,
/// and whether its groups of 16 are spread to 32.
struct Block {
    bytes: usize,
    values: usize,
    bits: usize,
    spread: bool,
}

/// The layout of the block types read as groups.
fn block(dtype: GgmlType) -> Option<Block> {
    let (bytes, values, bits, spread) = match dtype {
        GgmlType::Q8_0 => (34, 32, 8, false),
        GgmlType::Q4_0 => (18, 32, 4, false),
        GgmlType::Q4_1 => (20, 32, 4, false),
        GgmlType::Q5_0 => (22, 32, 5, false),
        GgmlType::Q5_1 => (24, 32, 5, false),
        GgmlType::Q4_K => (144, 256, 4, false),
        GgmlType::Q5_K => (176, 256, 5, false),
        GgmlType::Q6_K => (210, 256, 6, true),
        GgmlType::Q3_K => (110, 256, 3, true),
        GgmlType::Q2_K => (84, 256, 2, true),
        GgmlType::MXFP4 => (17, 32, 4, false),
        _ => return None,
    };
    Some(Block {
        bytes,
        values,
        bits,
        spread,
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

/// Q3_K's sixteen 6-bit scales from its 12 bytes: the low four bits of
/// scale `j` in a nibble of bytes 0–7 (low nibbles first), its high two in
/// a bit pair of bytes 8–11.
fn scales_q3k(b: &[u8]) -> [u8; 16] {
    std::array::from_fn(|j| {
        let low = match j {
            0..8 => b[j] & 0x0f,
            _ => b[j - 8] >> 4,
        };
        let high = (b[8 + j % 4] >> (2 * (j / 4))) & 3;
        low | (high << 4)
    })
}

/// A group of 16 codes as a spread group of 32: the codes, then padding.
fn padded(codes: [u8; SPREAD_GROUP]) -> [u8; GROUP] {
    std::array::from_fn(|j| if j < SPREAD_GROUP { codes[j] } else { 0 })
}

/// Calls `each` with every group of 32 of one block (for the spread types,
/// every group of 16, padded to 32): its codes and scale.
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
        GgmlType::Q6_K => {
            // ql[128] (low four bits), qh[64] (high two), 16 i8 scales, d.
            let (ql, qh, sc, d) = (
                &blk[..128],
                &blk[128..192],
                &blk[192..208],
                f16_at(blk, 208),
            );
            for (g, &sc) in sc.iter().enumerate() {
                // Value v = 128·half + 32·k + l: ql[64·half + l + 32·(k % 2)]'s
                // low nibble for k < 2, high for k ≥ 2; qh[32·half + l]'s bits 2k.
                let (half, k, l0) = (g / 8, (g % 8) / 2, 16 * (g % 2));
                let codes = std::array::from_fn(|i| {
                    let l = l0 + i;
                    let low = (ql[64 * half + l + 32 * (k % 2)] >> (4 * (k / 2))) & 0x0f;
                    let high = (qh[32 * half + l] >> (2 * k)) & 3;
                    low | (high << 4)
                });
                let scale = d * f32::from(sc as i8);
                each(padded(codes), Scale::Affine(scale, -32.0 * scale));
            }
        }
        GgmlType::Q3_K => {
            // hmask[32] (third bits), qs[64] (low two bits), 12 bytes of
            // scales, d.
            let (hmask, q, d) = (&blk[..32], &blk[32..96], f16_at(blk, 108));
            let scales = scales_q3k(&blk[96..108]);
            for (g, &sc) in scales.iter().enumerate() {
                // Group g = 8·half + 2·j + second: qs[32·half + 16·second + i]'s
                // bits 2j, hmask[16·second + i]'s bit 4·half + j.
                let (half, j, second) = (g / 8, (g % 8) / 2, g % 2);
                let codes = std::array::from_fn(|i| {
                    let low = (q[32 * half + 16 * second + i] >> (2 * j)) & 3;
                    let high = (hmask[16 * second + i] >> (4 * half + j)) & 1;
                    low | (high << 2)
                });
                let scale = d * (f32::from(sc) - 32.0);
                each(padded(codes), Scale::Affine(scale, -4.0 * scale));
            }
        }
        GgmlType::Q2_K => {
            // 16 bytes of scales (low nibble) and mins (high), qs[64], d, dmin.
            let (sc, q) = (&blk[..16], &blk[16..80]);
            let (d, dmin) = (f16_at(blk, 80), f16_at(blk, 82));
            for (g, &sc) in sc.iter().enumerate() {
                let (half, j, second) = (g / 8, (g % 8) / 2, g % 2);
                let codes =
                    std::array::from_fn(|i| (q[32 * half + 16 * second + i] >> (2 * j)) & 3);
                let scale = d * f32::from(sc & 0x0f);
                each(
                    padded(codes),
                    Scale::Affine(scale, -(dmin * f32::from(sc >> 4))),
                );
            }
        }
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
    // Stored values a row: spread types hold each group of 16 in 32.
    let width = if b.spread { 2 * inner } else { inner };
    let n = blocks * b.values / inner * width / GROUP;
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
    let weight = Array::from_u32(&words, &shape(width * b.bits / 32)).map_err(mlx_err)?;
    let group_shape = shape(width / GROUP);
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
            spread: block(dtype).unwrap().spread,
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

    /// Blocks of every type read as groups (spread ones too), with random
    /// codes, scales and mins (several blocks in a row, two rows), give the
    /// values candle's ggml decoding gives.
    #[test]
    fn random_blocks_become_groups_with_the_values_ggml_decodes() {
        use rand::SeedableRng;
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
            GgmlType::Q6_K,
            GgmlType::Q3_K,
            GgmlType::Q2_K,
        ] {
            let b = block(dtype).unwrap();
            let dims = [2, 2 * b.values];
            let raw = random_blocks(&mut rng, dtype, 4);
            let expected = ggml_values(dtype, &raw, &dims);
            assert_close(dtype, &decoded(dtype, &raw, &dims), &expected);
        }
    }

    /// `blocks` random blocks of `dtype`, with finite f16 scales (d, and m
    /// or dmin where the type has one).
    fn random_blocks(rng: &mut impl rand::Rng, dtype: GgmlType, blocks: usize) -> Vec<u8> {
        let b = block(dtype).unwrap();
        let mut raw: Vec<u8> = (0..blocks * b.bytes).map(|_| rng.random()).collect();
        let halves: &[usize] = match dtype {
            GgmlType::Q6_K => &[208],
            GgmlType::Q3_K => &[108],
            GgmlType::Q2_K => &[80, 82],
            _ => &[0, 2],
        };
        for blk in raw.chunks_exact_mut(b.bytes) {
            for &at in halves {
                let v = half::f16::from_f32(rng.random_range(-2.0..2.0f32));
                blk[at..at + 2].copy_from_slice(&v.to_le_bytes());
            }
        }
        raw
    }

    /// The values candle's ggml decoding gives `raw` of `dims`.
    fn ggml_values(dtype: GgmlType, raw: &[u8], dims: &[usize]) -> Vec<f32> {
        let candle_type = crate::gguf::candle_type(dtype).unwrap();
        candle_core::quantized::ggml_file::qtensor_from_ggml(
            candle_type,
            raw,
            dims.to_vec(),
            &Device::Cpu,
        )
        .unwrap()
        .dequantize(&Device::Cpu)
        .unwrap()
        .flatten_all()
        .unwrap()
        .to_vec1::<f32>()
        .unwrap()
    }

    /// Spread matrices (Q6_K, Q3_K, Q2_K held as padded groups of 32)
    /// multiply, multiply by each token's expert, and give rows (an
    /// embedding lookup) as the values they stand for do.
    #[test]
    fn spread_matrices_compute_with_the_values_they_stand_for() {
        use super::super::array::{Quant, QuantMode, gather_quantized_matmul, quantized_matmul};
        use super::super::weights::Linear;
        use rand::{Rng, SeedableRng};
        let _guard = super::super::lock();
        let mut rng = rand::rngs::StdRng::seed_from_u64(9);
        let as_quant = |dtype: GgmlType, raw: &[u8], dims: &[usize]| -> (Array, Quant) {
            let mut arrays = groups(dtype, raw, dims).unwrap().into_iter();
            let (_, w) = arrays.next().unwrap();
            let (_, scales) = arrays.next().unwrap();
            let (_, biases) = arrays.next().unwrap();
            let q = Quant {
                scales,
                biases: Some(biases),
                group_size: 32,
                bits: block(dtype).unwrap().bits,
                mode: QuantMode::Affine,
                spread: true,
            };
            (w, q)
        };
        let close = |what: &str, got: &[f32], want: &[f32]| {
            assert_eq!(got.len(), want.len(), "{what}");
            let scale = want.iter().fold(1.0f32, |m, v| m.max(v.abs()));
            for (j, (g, w)) in got.iter().zip(want).enumerate() {
                assert!((g - w).abs() <= 1e-5 * scale, "{what} {j}: {g} vs {w}");
            }
        };
        for dtype in [GgmlType::Q6_K, GgmlType::Q3_K, GgmlType::Q2_K] {
            let (experts, out, inp) = (2, 3, 2 * block(dtype).unwrap().values);
            let raw = random_blocks(&mut rng, dtype, experts * out * inp / 256);
            let values = ggml_values(dtype, &raw, &[experts * out, inp]);
            let tokens = 2;
            let x: Vec<f32> = (0..tokens * inp)
                .map(|_| rng.random_range(-1.0..1.0))
                .collect();
            let product = |t: usize, row: usize| -> f32 {
                (0..inp)
                    .map(|i| x[t * inp + i] * values[row * inp + i])
                    .sum()
            };
            // Expert 0 alone: a plain product.
            let first = &raw[..raw.len() / experts];
            let (w, q) = as_quant(dtype, first, &[out, inp]);
            let xa = Array::from_f32(&x, &[tokens, inp]).unwrap();
            let y = quantized_matmul(&xa, &w, &q).unwrap().to_f32().unwrap();
            let want: Vec<f32> = (0..tokens)
                .flat_map(|t| (0..out).map(move |o| (t, o)))
                .map(|(t, o)| product(t, o))
                .collect();
            close(&format!("{dtype:?} product"), &y, &want);
            // Its rows 2 and 0, as an embedding looks them up.
            let linear = Linear {
                w,
                quant: Some(q),
                bias: None,
            };
            let ids = Array::from_u32(&[2, 0], &[2]).unwrap();
            let rows = linear.rows(&ids).unwrap().to_f32().unwrap();
            let want: Vec<f32> = [2, 0]
                .iter()
                .flat_map(|&r| values[r * inp..(r + 1) * inp].to_vec())
                .collect();
            close(&format!("{dtype:?} rows"), &rows, &want);
            // Both experts stacked; token 0 takes expert 1, token 1 expert 0.
            let (w, q) = as_quant(dtype, &raw, &[experts, out, inp]);
            let xs = xa.reshape(&[tokens, 1, 1, inp]).unwrap();
            let ids = Array::from_u32(&[1, 0], &[tokens, 1]).unwrap();
            let y = gather_quantized_matmul(&xs, &w, &q, &ids)
                .unwrap()
                .to_f32()
                .unwrap();
            let want: Vec<f32> = (0..tokens)
                .flat_map(|t| (0..out).map(move |o| (t, o)))
                .map(|(t, o)| product(t, (1 - t) * out + o))
                .collect();
            close(&format!("{dtype:?} experts"), &y, &want);
        }
    }

    /// A matrix is taken as spread only when the reader names it so: one
    /// twice as wide as expected is refused, not read as spread.
    #[test]
    fn only_matrices_read_spread_are_taken_as_spread() {
        use super::super::weights::Loader;
        use crate::config::Architecture;
        use crate::names::{Layout, Part, Weight};
        use rand::SeedableRng;
        let _guard = super::super::lock();
        let mut rng = rand::rngs::StdRng::seed_from_u64(11);
        let (out, inp) = (2, 256);
        let name = "blk.0.ffn_down.weight";
        let mut loader = |dtype: GgmlType, width: usize, spread: &[&str]| {
            let raw = random_blocks(&mut rng, dtype, out * width / block(dtype).unwrap().values);
            let mut map = TensorMap::new();
            for (suffix, a) in groups(dtype, &raw, &[out, width]).unwrap() {
                map.insert(&format!("blk.0.ffn_down.{suffix}"), &a).unwrap();
            }
            Loader {
                maps: vec![map],
                layout: Layout::Gguf,
                architecture: Architecture::Llama,
                origin: "test.gguf".into(),
                bytes: 0,
                dequantize: false,
                spread: spread.iter().map(|s| s.to_string()).collect(),
            }
        };
        let down = Weight::Layer(0, Part::Down);
        // Q6_K read spread: [2, 256] stored as [2, 512] of 6 bits.
        let mut l = loader(GgmlType::Q6_K, inp, &[name]);
        let linear = l.linear(down, out, inp).unwrap();
        assert!(
            linear
                .quant
                .as_ref()
                .is_some_and(|q| q.spread && q.bits == 6)
        );
        // Q8_0 of twice the width, not named spread: refused, as before.
        let mut l = loader(GgmlType::Q8_0, 2 * inp, &[]);
        let e = l.linear(down, out, inp).err().unwrap().to_string();
        assert!(e.contains(name), "{e}");
        // Named spread but not of that shape: refused too.
        let mut l = loader(GgmlType::Q8_0, inp, &[name]);
        let e = l.linear(down, out, inp).err().unwrap().to_string();
        assert!(e.contains("spread to twice the width"), "{e}");
    }

    #[test]
    fn layers_are_read_from_block_names() {
        assert_eq!(layer_of("blk.12.ffn_gate_exps.weight"), Some(12));
        assert_eq!(layer_of("token_embd.weight"), None);
        assert_eq!(layer_of("blk.x.attn_q.weight"), None);
    }
}
