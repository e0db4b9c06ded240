//! Element and block formats of stored weights.
//!
//! A tensor row of `n` elements occupies `row_bytes(n)` bytes: float types store each element,
//! block-quantized types store `n / block_elems` blocks of `block_bytes` bytes each. The numeric
//! ids are GGML's, so a GGUF tensor's type maps 1:1.

use std::fmt;

#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[allow(non_camel_case_types)]
pub enum DType {
    F32,
    F16,
    BF16,
    Q4_0,
    Q4_1,
    Q5_0,
    Q5_1,
    Q8_0,
    Q2_K,
    Q3_K,
    Q4_K,
    Q5_K,
    Q6_K,
    Q8_K,
    MXFP4,
    IQ4_NL,
    IQ4_XS,
    IQ3_XXS,
    IQ3_S,
    IQ2_XXS,
    IQ2_XS,
    IQ2_S,
    IQ1_S,
    IQ1_M,
}

impl DType {
    pub const ALL: [DType; 24] = [
        DType::F32,
        DType::F16,
        DType::BF16,
        DType::Q4_0,
        DType::Q4_1,
        DType::Q5_0,
        DType::Q5_1,
        DType::Q8_0,
        DType::Q2_K,
        DType::Q3_K,
        DType::Q4_K,
        DType::Q5_K,
        DType::Q6_K,
        DType::Q8_K,
        DType::MXFP4,
        DType::IQ4_NL,
        DType::IQ4_XS,
        DType::IQ3_XXS,
        DType::IQ3_S,
        DType::IQ2_XXS,
        DType::IQ2_XS,
        DType::IQ2_S,
        DType::IQ1_S,
        DType::IQ1_M,
    ];

    /// Elements per block (1 for plain float types).
    pub const fn block_elems(self) -> usize {
        match self {
            DType::F32 | DType::F16 | DType::BF16 => 1,
            DType::Q4_0 | DType::Q4_1 | DType::Q5_0 | DType::Q5_1 | DType::Q8_0 | DType::MXFP4 | DType::IQ4_NL => 32,
            DType::Q2_K
            | DType::Q3_K
            | DType::Q4_K
            | DType::Q5_K
            | DType::Q6_K
            | DType::Q8_K
            | DType::IQ4_XS
            | DType::IQ3_XXS
            | DType::IQ3_S
            | DType::IQ2_XXS
            | DType::IQ2_XS
            | DType::IQ2_S
            | DType::IQ1_S
            | DType::IQ1_M => 256,
        }
    }

    /// Bytes per block.
    pub const fn block_bytes(self) -> usize {
        match self {
            DType::F32 => 4,
            DType::F16 | DType::BF16 => 2,
            DType::Q4_0 => 18,
            DType::Q4_1 => 20,
            DType::Q5_0 => 22,
            DType::Q5_1 => 24,
            DType::Q8_0 => 34,
            DType::MXFP4 => 17,
            DType::Q2_K => 84,
            DType::Q3_K => 110,
            DType::Q4_K => 144,
            DType::Q5_K => 176,
            DType::Q6_K => 210,
            DType::Q8_K => 292,
            DType::IQ4_NL => 18,
            DType::IQ4_XS => 136,
            DType::IQ3_XXS => 98,
            DType::IQ3_S => 110,
            DType::IQ2_XXS => 66,
            DType::IQ2_XS => 74,
            DType::IQ2_S => 82,
            DType::IQ1_S => 50,
            DType::IQ1_M => 56,
        }
    }

    pub const fn is_float(self) -> bool {
        matches!(self, DType::F32 | DType::F16 | DType::BF16)
    }

    /// Bytes of a row of `n` elements; `None` when `n` is not a whole number of blocks.
    pub fn row_bytes(self, n: usize) -> Option<usize> {
        if !n.is_multiple_of(self.block_elems()) {
            return None;
        }
        Some(n / self.block_elems() * self.block_bytes())
    }

    /// GGML's numeric type id.
    pub const fn ggml_id(self) -> u32 {
        match self {
            DType::F32 => 0,
            DType::F16 => 1,
            DType::Q4_0 => 2,
            DType::Q4_1 => 3,
            DType::Q5_0 => 6,
            DType::Q5_1 => 7,
            DType::Q8_0 => 8,
            DType::Q2_K => 10,
            DType::Q3_K => 11,
            DType::Q4_K => 12,
            DType::Q5_K => 13,
            DType::Q6_K => 14,
            DType::Q8_K => 15,
            DType::BF16 => 30,
            DType::MXFP4 => 39,
            DType::IQ4_NL => 20,
            DType::IQ4_XS => 23,
            DType::IQ3_XXS => 18,
            DType::IQ3_S => 21,
            DType::IQ2_XXS => 16,
            DType::IQ2_XS => 17,
            DType::IQ2_S => 22,
            DType::IQ1_S => 19,
            DType::IQ1_M => 29,
        }
    }

    pub fn from_ggml_id(id: u32) -> Option<DType> {
        DType::ALL.into_iter().find(|d| d.ggml_id() == id)
    }

    pub const fn name(self) -> &'static str {
        match self {
            DType::F32 => "F32",
            DType::F16 => "F16",
            DType::BF16 => "BF16",
            DType::Q4_0 => "Q4_0",
            DType::Q4_1 => "Q4_1",
            DType::Q5_0 => "Q5_0",
            DType::Q5_1 => "Q5_1",
            DType::Q8_0 => "Q8_0",
            DType::Q2_K => "Q2_K",
            DType::Q3_K => "Q3_K",
            DType::Q4_K => "Q4_K",
            DType::Q5_K => "Q5_K",
            DType::Q6_K => "Q6_K",
            DType::Q8_K => "Q8_K",
            DType::MXFP4 => "MXFP4",
            DType::IQ4_NL => "IQ4_NL",
            DType::IQ4_XS => "IQ4_XS",
            DType::IQ3_XXS => "IQ3_XXS",
            DType::IQ3_S => "IQ3_S",
            DType::IQ2_XXS => "IQ2_XXS",
            DType::IQ2_XS => "IQ2_XS",
            DType::IQ2_S => "IQ2_S",
            DType::IQ1_S => "IQ1_S",
            DType::IQ1_M => "IQ1_M",
        }
    }

    pub fn from_name(s: &str) -> Option<DType> {
        DType::ALL.into_iter().find(|d| d.name().eq_ignore_ascii_case(s))
    }
}

impl fmt::Display for DType {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ids_round_trip_and_rows_need_whole_blocks() {
        for d in DType::ALL {
            assert_eq!(DType::from_ggml_id(d.ggml_id()), Some(d));
            assert_eq!(DType::from_name(d.name()), Some(d));
        }
        assert_eq!(DType::Q4_K.row_bytes(2048), Some(8 * 144));
        assert_eq!(DType::Q4_K.row_bytes(100), None);
        assert_eq!(DType::BF16.row_bytes(3), Some(6));
    }
}
