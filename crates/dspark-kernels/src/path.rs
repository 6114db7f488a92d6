//! Which instruction set runs the quantized kernels: chosen once per process, from what the CPU
//! has or from `DSPARK_KERNELS`, never per call or per batch size. Every path computes the same
//! integer sums and applies scales in the same float order, so the choice changes speed, never a
//! result.

use std::sync::OnceLock;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum KernelPath {
    /// The AVX-512 VNNI path with each block's integer sums from AMX-INT8 tiles (`tdpbsud`).
    /// Bit for bit the other paths' results (its test passed on a Xeon with AMX), but not
    /// faster: every 32-value block needs its own tile product, stored and rescaled in vector
    /// registers, and that epilogue costs what VNNI's `vpdpbusd`s do (Q4_K) or more (Q6_K;
    /// docs/BENCHMARKS.md, "AMX-INT8 measured"). So it stays opt-in (`DSPARK_KERNELS=amx`).
    Amx,
    /// AVX-512 BW + VNNI (512-bit registers, `vpdpbusd`/`vpdpwssd`).
    Avx512Vnni,
    /// AVX2 + FMA + F16C.
    Avx2,
    /// Portable Rust; the reference the SIMD paths are tested against.
    Scalar,
}

impl KernelPath {
    pub const ALL: [KernelPath; 4] =
        [KernelPath::Amx, KernelPath::Avx512Vnni, KernelPath::Avx2, KernelPath::Scalar];

    pub fn name(self) -> &'static str {
        match self {
            Self::Amx => "amx-int8",
            Self::Avx512Vnni => "avx512-vnni",
            Self::Avx2 => "avx2",
            Self::Scalar => "scalar",
        }
    }

    /// Whether this CPU can run the path.
    pub fn available(self) -> bool {
        #[cfg(target_arch = "x86_64")]
        {
            use std::arch::is_x86_feature_detected as has;
            let avx2 = has!("avx2") && has!("fma") && has!("f16c");
            let vnni = avx2 && has!("avx512f") && has!("avx512bw") && has!("avx512vnni");
            match self {
                Self::Amx => vnni && amx_granted(),
                Self::Avx512Vnni => vnni,
                Self::Avx2 => avx2,
                Self::Scalar => true,
            }
        }
        #[cfg(not(target_arch = "x86_64"))]
        {
            self == Self::Scalar
        }
    }

    /// The fastest path this CPU has; AMX is never faster than VNNI (see [`KernelPath::Amx`]).
    pub fn detected() -> Self {
        Self::ALL.into_iter().filter(|&p| p != Self::Amx).find(|p| p.available()).unwrap_or(Self::Scalar)
    }

    /// Parses a `DSPARK_KERNELS` value: `Ok(None)` for `auto`, the kernel implementations that
    /// are not paths (`candle`, `ours`) and an unset variable.
    pub fn from_env_value(v: &str) -> Result<Option<Self>, String> {
        let p = match v {
            "" | "auto" | "ours" | "candle" => return Ok(None),
            "amx" | "amx-int8" => Self::Amx,
            "avx512" | "avx512-vnni" => Self::Avx512Vnni,
            "avx2" => Self::Avx2,
            "scalar" => Self::Scalar,
            other => {
                return Err(format!(
                    "DSPARK_KERNELS={other:?} is not a kernel path; use auto, amx, avx512, avx2, scalar or candle"
                ))
            }
        };
        if !p.available() {
            return Err(format!(
                "DSPARK_KERNELS={v}: this CPU cannot run the {} kernels (it has: {})",
                p.name(),
                Self::detected().name()
            ));
        }
        Ok(Some(p))
    }
}

/// The `DSPARK_KERNELS` setting's error, if it names no usable path (binaries check this at
/// start-up and refuse to run; the library falls back to the detected path).
pub fn kernel_env_error() -> Option<String> {
    std::env::var("DSPARK_KERNELS").ok().and_then(|v| KernelPath::from_env_value(&v).err())
}

/// The path every quantized matmul of this process takes.
pub fn kernel_path() -> KernelPath {
    static PATH: OnceLock<KernelPath> = OnceLock::new();
    *PATH.get_or_init(|| {
        let forced =
            std::env::var("DSPARK_KERNELS").ok().and_then(|v| KernelPath::from_env_value(&v).ok().flatten());
        forced.unwrap_or_else(KernelPath::detected)
    })
}

/// Whether the CPU has AMX-TILE and AMX-INT8 and Linux let this process use the tile state.
#[cfg(target_arch = "x86_64")]
fn amx_granted() -> bool {
    // Asked once: `available()` runs per product, and CPUID traps to a hypervisor.
    static AMX_INT8: OnceLock<bool> = OnceLock::new();
    *AMX_INT8.get_or_init(|| amx_with(1 << 25))
}

/// Whether the CPU has AMX-TILE and the AMX extensions in `edx_bits` (CPUID leaf 7's EDX:
/// bit 22 AMX-BF16, bit 25 AMX-INT8), and Linux let this process use the tile state (asked
/// once: `arch_prctl(ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA)`; a refusal, or an older kernel,
/// leaves the AVX-512 paths).
#[cfg(target_arch = "x86_64")]
pub(crate) fn amx_with(edx_bits: u32) -> bool {
    if !std::arch::is_x86_feature_detected!("avx2") {
        return false;
    }
    // CPUID leaf 7 exists on every CPU with AVX2.
    let leaf7 = std::arch::x86_64::__cpuid_count(7, 0);
    let tile = leaf7.edx & (1 << 24) != 0;
    tile && leaf7.edx & edx_bits == edx_bits && tile_permission()
}

#[cfg(target_arch = "x86_64")]
fn tile_permission() -> bool {
    static GRANTED: OnceLock<bool> = OnceLock::new();
    *GRANTED.get_or_init(|| {
        #[cfg(target_os = "linux")]
        {
            const ARCH_REQ_XCOMP_PERM: libc::c_long = 0x1023;
            const XFEATURE_XTILEDATA: libc::c_long = 18;
            // SAFETY: a request for a permission; no memory is passed.
            unsafe { libc::syscall(libc::SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) == 0 }
        }
        #[cfg(not(target_os = "linux"))]
        false
    })
}
