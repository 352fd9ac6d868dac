//! ggml's tensor types: the id GGUF stores, and how many bytes a block of
//! values takes (what a tensor's size in the file follows from).

/// A ggml tensor type, by the id GGUF stores.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct GgmlType(u32);

/// `(id, name, values per block, bytes per block)` of every type this reader
/// knows. The numbers are ggml's type traits.
const TYPES: &[(u32, &str, u64, u64)] = &[
    (0, "F32", 1, 4),
    (1, "F16", 1, 2),
    (2, "Q4_0", 32, 18),
    (3, "Q4_1", 32, 20),
    (6, "Q5_0", 32, 22),
    (7, "Q5_1", 32, 24),
    (8, "Q8_0", 32, 34),
    (9, "Q8_1", 32, 36),
    (10, "Q2_K", 256, 84),
    (11, "Q3_K", 256, 110),
    (12, "Q4_K", 256, 144),
    (13, "Q5_K", 256, 176),
    (14, "Q6_K", 256, 210),
    (15, "Q8_K", 256, 292),
    (16, "IQ2_XXS", 256, 66),
    (17, "IQ2_XS", 256, 74),
    (18, "IQ3_XXS", 256, 98),
    (19, "IQ1_S", 256, 50),
    (20, "IQ4_NL", 32, 18),
    (21, "IQ3_S", 256, 110),
    (22, "IQ2_S", 256, 82),
    (23, "IQ4_XS", 256, 136),
    (24, "I8", 1, 1),
    (25, "I16", 1, 2),
    (26, "I32", 1, 4),
    (27, "I64", 1, 8),
    (28, "F64", 1, 8),
    (29, "IQ1_M", 256, 56),
    (30, "BF16", 1, 2),
    (34, "TQ1_0", 256, 54),
    (35, "TQ2_0", 256, 66),
    (39, "MXFP4", 32, 17),
];

impl GgmlType {
    /// F32.
    pub const F32: GgmlType = GgmlType(0);
    /// F16.
    pub const F16: GgmlType = GgmlType(1);
    /// Q4_0.
    pub const Q4_0: GgmlType = GgmlType(2);
    /// Q4_1.
    pub const Q4_1: GgmlType = GgmlType(3);
    /// Q5_0.
    pub const Q5_0: GgmlType = GgmlType(6);
    /// Q5_1.
    pub const Q5_1: GgmlType = GgmlType(7);
    /// Q8_0.
    pub const Q8_0: GgmlType = GgmlType(8);
    /// Q8_1.
    pub const Q8_1: GgmlType = GgmlType(9);
    /// Q2_K.
    pub const Q2_K: GgmlType = GgmlType(10);
    /// Q3_K.
    pub const Q3_K: GgmlType = GgmlType(11);
    /// Q4_K.
    pub const Q4_K: GgmlType = GgmlType(12);
    /// Q5_K.
    pub const Q5_K: GgmlType = GgmlType(13);
    /// Q6_K.
    pub const Q6_K: GgmlType = GgmlType(14);
    /// Q8_K.
    pub const Q8_K: GgmlType = GgmlType(15);
    /// BF16.
    pub const BF16: GgmlType = GgmlType(30);
    /// MXFP4 (gpt-oss's experts).
    pub const MXFP4: GgmlType = GgmlType(39);

    /// The type with GGUF id `id`, when this reader knows it.
    pub fn from_id(id: u32) -> Option<Self> {
        TYPES.iter().any(|t| t.0 == id).then_some(GgmlType(id))
    }

    /// The id GGUF stores.
    pub fn id(self) -> u32 {
        self.0
    }

    fn traits(self) -> (&'static str, u64, u64) {
        let t = TYPES
            .iter()
            .find(|t| t.0 == self.0)
            .expect("constructed from the table");
        (t.1, t.2, t.3)
    }

    /// ggml's name of the type (`Q4_K`, `F16`, …).
    pub fn name(self) -> &'static str {
        self.traits().0
    }

    /// Values per block.
    pub fn block_values(self) -> u64 {
        self.traits().1
    }

    /// Bytes per block.
    pub fn block_bytes(self) -> u64 {
        self.traits().2
    }

    /// Bytes of `values` values of this type, when they fill whole blocks
    /// and the size fits in 64 bits.
    pub fn bytes_for(self, values: u64) -> Option<u64> {
        let (_, per_block, bytes) = self.traits();
        if !values.is_multiple_of(per_block) {
            return None;
        }
        (values / per_block).checked_mul(bytes)
    }
}

impl std::fmt::Display for GgmlType {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sizes_follow_the_blocks() {
        assert_eq!(
            GgmlType::Q4_1.bytes_for(576 * 1536),
            Some(576 * 1536 / 32 * 20)
        );
        assert_eq!(GgmlType::Q4_K.bytes_for(256), Some(144));
        assert_eq!(GgmlType::F32.bytes_for(3), Some(12));
        assert_eq!(GgmlType::Q8_0.bytes_for(33), None, "not whole blocks");
        assert_eq!(GgmlType::F32.bytes_for(u64::MAX), None, "overflow");
        assert_eq!(GgmlType::from_id(4), None, "a retired id");
        assert_eq!(GgmlType::from_id(39).map(GgmlType::name), Some("MXFP4"));
    }
}
