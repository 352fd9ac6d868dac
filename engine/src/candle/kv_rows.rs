//! The rows a layer's KV cache holds, in the precision the stage was loaded
//! with: f16 (half the bytes a long context reads each step) or f32.
//!
//! ```text
//!  append(f32 rows) ─► [f16 | f32 buffer] ─► widen(range) ─► f32 for the sums
//! ```

use half::f16;
use half::slice::HalfFloatSliceExt;

use crate::stage::KvPrecision;

/// A buffer of keys or values, token-major.
#[derive(Debug, Clone, PartialEq)]
pub(super) enum KvRows {
    Half(Vec<f16>),
    Full(Vec<f32>),
}

impl KvRows {
    pub fn new(precision: KvPrecision) -> Self {
        match precision {
            KvPrecision::F16 => KvRows::Half(Vec::new()),
            KvPrecision::F32 => KvRows::Full(Vec::new()),
        }
    }

    /// Floats held.
    pub fn len(&self) -> usize {
        match self {
            KvRows::Half(b) => b.len(),
            KvRows::Full(b) => b.len(),
        }
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Bytes reserved.
    pub fn bytes(&self) -> usize {
        self.capacity() * self.precision().bytes()
    }

    /// Bytes the floats held take (a copy's, whose capacity is its length).
    pub fn held_bytes(&self) -> usize {
        self.len() * self.precision().bytes()
    }

    fn precision(&self) -> KvPrecision {
        match self {
            KvRows::Half(_) => KvPrecision::F16,
            KvRows::Full(_) => KvPrecision::F32,
        }
    }

    /// Floats there is room for.
    pub fn capacity(&self) -> usize {
        match self {
            KvRows::Half(b) => b.capacity(),
            KvRows::Full(b) => b.capacity(),
        }
    }

    /// Room for `more` floats beyond those held; running out of memory is
    /// an error, not an abort.
    pub fn try_reserve_exact(
        &mut self,
        more: usize,
    ) -> Result<(), std::collections::TryReserveError> {
        match self {
            KvRows::Half(b) => b.try_reserve_exact(more),
            KvRows::Full(b) => b.try_reserve_exact(more),
        }
    }

    /// Drops the first `n` floats, moving the rest down.
    pub fn drop_front(&mut self, n: usize) {
        match self {
            KvRows::Half(b) => drop(b.drain(..n)),
            KvRows::Full(b) => drop(b.drain(..n)),
        }
    }

    /// Appends `rows` (rounded to f16 in a half buffer, where a value
    /// beyond f16's range saturates at ±65504 rather than becoming
    /// infinite, which would make every score it meets NaN).
    pub fn extend(&mut self, rows: &[f32]) {
        match self {
            KvRows::Half(b) => {
                let at = b.len();
                b.resize(at + rows.len(), f16::ZERO);
                b[at..].convert_from_f32_slice(rows);
                for (x, r) in b[at..].iter_mut().zip(rows) {
                    if x.is_infinite() && r.is_finite() {
                        *x = if *r > 0.0 { f16::MAX } else { f16::MIN };
                    }
                }
            }
            KvRows::Full(b) => b.extend_from_slice(rows),
        }
    }

    /// Appends the floats `other` holds: as they are in the same precision
    /// (a prefix-cache block's rows seed a cache with the very bits it
    /// held), widened or rounded in another.
    pub fn extend_from(&mut self, other: &KvRows) {
        match (&mut *self, other) {
            (KvRows::Half(b), KvRows::Half(o)) => b.extend_from_slice(o),
            (KvRows::Full(b), KvRows::Full(o)) => b.extend_from_slice(o),
            (KvRows::Full(b), KvRows::Half(o)) => b.extend(o.iter().map(|x| x.to_f32())),
            (KvRows::Half(_), KvRows::Full(o)) => self.extend(o),
        }
    }

    /// A copy of the floats `range`, in their precision.
    pub fn slice(&self, range: std::ops::Range<usize>) -> KvRows {
        match self {
            KvRows::Half(b) => KvRows::Half(b[range].to_vec()),
            KvRows::Full(b) => KvRows::Full(b[range].to_vec()),
        }
    }

    /// The floats `range`, widened into `out` (of the range's length).
    pub fn widen(&self, range: std::ops::Range<usize>, out: &mut [f32]) {
        match self {
            KvRows::Half(b) => b[range].convert_to_f32_slice(out),
            KvRows::Full(b) => out.copy_from_slice(&b[range]),
        }
    }

    /// The floats `range` as f32.
    #[cfg(test)]
    pub fn to_f32_vec(&self, range: std::ops::Range<usize>) -> Vec<f32> {
        match self {
            KvRows::Half(b) => b[range].to_f32_vec(),
            KvRows::Full(b) => b[range].to_vec(),
        }
    }
}
