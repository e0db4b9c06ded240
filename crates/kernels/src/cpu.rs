//! Which SIMD level the kernels use, chosen once per process at run time.
//!
//! Every variant of a kernel computes the same reduction order (see `float`), so the choice
//! changes speed, never results. `SLUICE_ISA=scalar|avx2|avx512` forces a lower level (for
//! tests and the kernel lab); asking for a level the CPU lacks falls back to the best it has.

use std::sync::OnceLock;

#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub enum Isa {
    Scalar,
    /// AVX2 + FMA + F16C.
    Avx2,
    /// AVX-512 F/BW/VL/DQ (+ VNNI when present).
    Avx512,
}

impl Isa {
    pub fn name(self) -> &'static str {
        match self {
            Isa::Scalar => "scalar",
            Isa::Avx2 => "avx2",
            Isa::Avx512 => "avx512",
        }
    }

    /// Whether kernels at this level may use the AVX-512 VNNI int8 dot products: the level is
    /// AVX-512 and the CPU has them.
    pub fn uses_vnni(self) -> bool {
        self == Isa::Avx512 && has_vnni()
    }

    /// The best level this CPU supports.
    pub fn detect() -> Isa {
        #[cfg(target_arch = "x86_64")]
        {
            if is_x86_feature_detected!("avx512f")
                && is_x86_feature_detected!("avx512bw")
                && is_x86_feature_detected!("avx512vl")
                && is_x86_feature_detected!("avx512dq")
                && is_x86_feature_detected!("fma")
                && is_x86_feature_detected!("f16c")
            {
                return Isa::Avx512;
            }
            if is_x86_feature_detected!("avx2") && is_x86_feature_detected!("fma") && is_x86_feature_detected!("f16c") {
                return Isa::Avx2;
            }
        }
        Isa::Scalar
    }

    /// Levels this CPU can run, lowest first.
    pub fn supported() -> Vec<Isa> {
        let best = Isa::detect();
        [Isa::Scalar, Isa::Avx2, Isa::Avx512].into_iter().filter(|i| *i <= best).collect()
    }
}

/// The level in use: the best detected, lowered by `SLUICE_ISA` if set.
pub fn isa() -> Isa {
    static ISA: OnceLock<Isa> = OnceLock::new();
    *ISA.get_or_init(|| {
        let best = Isa::detect();
        match std::env::var("SLUICE_ISA").ok().as_deref() {
            Some("scalar") => Isa::Scalar,
            Some("avx2") => best.min(Isa::Avx2),
            _ => best,
        }
    })
}

/// Whether the AVX-512 VNNI instructions (int8 dot products) are available.
pub fn has_vnni() -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        static V: OnceLock<bool> = OnceLock::new();
        *V.get_or_init(|| is_x86_feature_detected!("avx512vnni"))
    }
    #[cfg(not(target_arch = "x86_64"))]
    false
}
