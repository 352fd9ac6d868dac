//! MXFP4: 4-bit floats (E2M1: sign, two exponent bits, one mantissa bit)
//! sharing a power-of-two scale (E8M0, a byte: `2^(e − 127)`) per 32
//! values. MLX packs the codes eight to a u32 with the scales apart; GGUF
//! (type 39) keeps each 32 as a 17-byte block:
//!
//! ```text
//!  byte 0: e (the scale)   bytes 1..17: qs[j], low nibble = value j, high nibble = value j + 16
//!  value = E2M1[code] · 2^(e − 127)     (ggml writes it as a doubled table times 2^(e − 128))
//! ```
//!
//! A scale of 255 is not a number here (as OCP's MX format defines it);
//! ggml reads it as 2^127. No trained weight uses it.

use crate::error::{Error, Result};

/// The values of the sixteen E2M1 codes.
pub const E2M1: [f32; 16] = [
    0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0,
];

/// Values in one GGUF block.
pub const BLOCK_VALUES: usize = 32;

/// Bytes of one GGUF block.
pub const BLOCK_BYTES: usize = 17;

/// An E8M0 scale: `2^(e − 127)` (255 is not a number).
pub fn e8m0(e: u8) -> f32 {
    match e {
        255 => f32::NAN,
        e => 2f32.powi(i32::from(e) - 127),
    }
}

/// The values of GGUF MXFP4 blocks, in order.
pub fn decode_gguf(raw: &[u8]) -> Result<Vec<f32>> {
    if !raw.len().is_multiple_of(BLOCK_BYTES) {
        return Err(Error::Tensor(format!(
            "{} bytes of MXFP4 blocks are not whole {BLOCK_BYTES}-byte blocks",
            raw.len()
        )));
    }
    let mut out = vec![0f32; raw.len() / BLOCK_BYTES * BLOCK_VALUES];
    for (block, values) in raw
        .chunks_exact(BLOCK_BYTES)
        .zip(out.chunks_exact_mut(BLOCK_VALUES))
    {
        let scale = e8m0(block[0]);
        for (j, &q) in block[1..].iter().enumerate() {
            values[j] = E2M1[usize::from(q & 0xF)] * scale;
            values[j + 16] = E2M1[usize::from(q >> 4)] * scale;
        }
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn gguf_blocks_decode_low_nibbles_first_then_high() {
        // Scale 2^(128 − 127) = 2; value j has code j % 16 in the low
        // nibble, value j + 16 code 15 − j in the high one.
        let mut block = vec![128u8];
        block.extend((0..16u8).map(|j| j | ((15 - j) << 4)));
        let v = decode_gguf(&block).unwrap();
        assert_eq!(v.len(), 32);
        for j in 0..16 {
            assert_eq!(v[j], 2.0 * E2M1[j]);
            assert_eq!(v[j + 16], 2.0 * E2M1[15 - j]);
        }
        assert!(decode_gguf(&block[..16]).is_err());
        assert!(decode_gguf(&[255; 17]).unwrap()[0].is_nan());
    }
}
