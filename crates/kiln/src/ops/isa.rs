//! Which x86 vector instructions kiln's CPU kernels may use: the widest this CPU has, or fewer when
//! `KILN_CPU_ISA` caps them. One decision for every kernel — kiln's own loops ([`super::cpu`]'s
//! `simd`), the attention register tiles, the bf16 GEMMs (AMX tiles, AVX512-BF16 dot products)
//! and the `gemm` crate's f32 kernels (through the patched `gemm-common`, third_party/gemm-common/PATCHES.md) — so a run capped
//! to `avx2` on an AVX-512 machine takes the code paths, and so the summation orders, of an AVX2-only
//! CPU such as AMD Zen 3. The cap is read once per process.

use std::sync::OnceLock;

use crate::error::{KilnError, Result};

/// The environment variable that caps kiln's run-time dispatch.
pub const ENV: &str = "KILN_CPU_ISA";

/// A vector instruction level kiln has kernels for, from narrowest to widest.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub enum IsaLevel {
    /// No AVX2/FMA: the portable build of each loop.
    Portable,
    /// AVX2 + FMA: 16 registers of 8 f32 lanes.
    Avx2,
    /// AVX-512 F/DQ/BW/VL: 32 registers of 16 lanes.
    Avx512,
}

/// What `KILN_CPU_ISA` asks for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum IsaCap {
    /// Everything the CPU has (the default).
    Native,
    /// AVX-512 with AVX512-BF16 dot products, no AMX tiles (oneDNN's `AVX512_CORE_BF16`): an AMD
    /// Zen 4 / Zen 5's bf16 path, on an AMX machine.
    Avx512Bf16,
    /// At most AVX-512 F/DQ/BW/VL: no bf16 dot products (oneDNN's `AVX512_CORE`).
    Avx512,
    /// At most AVX2 + FMA (oneDNN's `AVX2`, ATen's `avx2`).
    Avx2,
}

impl IsaCap {
    /// The value as `KILN_CPU_ISA` spells it.
    pub fn name(self) -> &'static str {
        match self {
            Self::Native => "native",
            Self::Avx512Bf16 => "avx512bf16",
            Self::Avx512 => "avx512",
            Self::Avx2 => "avx2",
        }
    }
}

impl IsaCap {
    /// The environment that caps the PyTorch side of `kiln bench --python` to the same level,
    /// through each of its libraries' own switches: ATen's vectorised kernels
    /// (`ATEN_CPU_CAPABILITY`, read back by `torch.backends.cpu.get_cpu_capability()`), oneDNN's
    /// (`ONEDNN_MAX_CPU_ISA`: its verbose log names the ISA it runs) and MKL's GEMM
    /// (`MKL_ENABLE_INSTRUCTIONS`; MKL on AMD CPUs takes its own path and may ignore it, see
    /// BENCHMARKS.md). The AVX-512 cap leaves out bf16 dot products, as kiln's does
    /// (oneDNN's `AVX512_CORE`), and the `avx512bf16` cap leaves out AMX (`AVX512_CORE_BF16`).
    /// Empty for `native`.
    pub fn pytorch_env(self) -> &'static [(&'static str, &'static str)] {
        match self {
            Self::Native => &[],
            Self::Avx512Bf16 => &[
                ("ATEN_CPU_CAPABILITY", "avx512"),
                ("ONEDNN_MAX_CPU_ISA", "AVX512_CORE_BF16"),
                ("MKL_ENABLE_INSTRUCTIONS", "AVX512"),
            ],
            Self::Avx512 => &[
                ("ATEN_CPU_CAPABILITY", "avx512"),
                ("ONEDNN_MAX_CPU_ISA", "AVX512_CORE"),
                ("MKL_ENABLE_INSTRUCTIONS", "AVX512"),
            ],
            Self::Avx2 => &[
                ("ATEN_CPU_CAPABILITY", "avx2"),
                ("ONEDNN_MAX_CPU_ISA", "AVX2"),
                ("MKL_ENABLE_INSTRUCTIONS", "AVX2"),
            ],
        }
    }
}

impl std::str::FromStr for IsaCap {
    type Err = KilnError;
    fn from_str(s: &str) -> Result<Self> {
        match s.trim().to_ascii_lowercase().as_str() {
            "" | "native" => Ok(Self::Native),
            "avx512bf16" => Ok(Self::Avx512Bf16),
            "avx512" => Ok(Self::Avx512),
            "avx2" => Ok(Self::Avx2),
            _ => Err(not_a_level(s)),
        }
    }
}

/// The instructions kiln's kernels use in this process.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CpuIsa {
    /// What `KILN_CPU_ISA` asked for.
    pub cap: IsaCap,
    /// The vector level every kernel dispatches to: the CPU's, lowered to the cap.
    pub level: IsaLevel,
    /// Whether the bf16 GEMM may use AVX512-BF16's `vdpbf16ps` (else it rounds operands to bf16
    /// and multiplies them in f32, and `--bf16` keeps Linear's products in f32).
    pub bf16_dot: bool,
    /// The CPU has AVX512-BF16 but its `vdpbf16ps` multiplies slower than its f32 FMAs
    /// ([`dot_outruns_fma`]), so kiln leaves it out unless `KILN_CPU_ISA=avx512bf16` asks for it.
    pub slow_dot: bool,
    /// Whether the bf16 GEMM runs on AMX tiles (`TDPBF16PS`): the CPU has AMX-BF16, the kernel
    /// let this process use the tile registers, and the cap allows it.
    pub amx: bool,
}

impl CpuIsa {
    /// What this CPU has, lowered to `cap`.
    pub fn capped(cap: IsaCap) -> Self {
        let (level, has_dot, amx) = detected();
        // An AMX CPU keeps the dot products too: its tiles' packing converts with them, and the
        // tests compare every kernel below the best.
        let slow_dot = has_dot && !amx && !dot_outruns_fma();
        let (level, bf16_dot, amx) = match cap {
            IsaCap::Native => (level, has_dot && !slow_dot, amx),
            IsaCap::Avx512Bf16 => (level, has_dot, false),
            IsaCap::Avx512 => (level, false, false),
            IsaCap::Avx2 => (level.min(IsaLevel::Avx2), false, false),
        };
        Self {
            cap,
            level,
            bf16_dot,
            slow_dot: slow_dot && cap == IsaCap::Native,
            amx,
        }
    }

    /// One line for logs and the bench footer: `avx512 (KILN_CPU_ISA=avx2 caps it to avx2)`.
    pub fn describe(&self) -> String {
        let level = match self.level {
            IsaLevel::Portable => "portable",
            IsaLevel::Avx2 => "avx2",
            IsaLevel::Avx512 if self.amx => "avx512 + avx512_bf16 + amx",
            IsaLevel::Avx512 if self.bf16_dot => "avx512 + avx512_bf16",
            IsaLevel::Avx512 if self.slow_dot => {
                "avx512 (avx512_bf16 left out: its vdpbf16ps is slower than the f32 FMAs here)"
            }
            IsaLevel::Avx512 => "avx512",
        };
        match self.cap {
            IsaCap::Native => format!("kiln dispatch {level}"),
            cap => format!("kiln dispatch {level} ({ENV}={})", cap.name()),
        }
    }
}

/// The CPU's own level, whether it has AVX512-BF16, and whether this process may use AMX-BF16
/// tiles (the CPU has them and Linux granted the tile state, [`request_tiles`]).
fn detected() -> (IsaLevel, bool, bool) {
    #[cfg(target_arch = "x86_64")]
    {
        let avx512 = std::is_x86_feature_detected!("avx512f")
            && std::is_x86_feature_detected!("avx512dq")
            && std::is_x86_feature_detected!("avx512bw")
            && std::is_x86_feature_detected!("avx512vl");
        let avx2 = std::is_x86_feature_detected!("avx2") && std::is_x86_feature_detected!("fma");
        let level = match (avx512 && avx2, avx2) {
            (true, _) => IsaLevel::Avx512,
            (false, true) => IsaLevel::Avx2,
            _ => IsaLevel::Portable,
        };
        let bf16_dot = level == IsaLevel::Avx512 && std::is_x86_feature_detected!("avx512bf16");
        // The AMX kernel packs its operands with AVX512-BF16 conversions (every AMX CPU has them).
        let amx = bf16_dot && request_tiles();
        (level, bf16_dot, amx)
    }
    #[cfg(not(target_arch = "x86_64"))]
    (IsaLevel::Portable, false, false)
}

/// Whether this CPU's `vdpbf16ps` (32 bf16 multiply-adds a register) outruns its f32 FMAs (16):
/// true on AMD, whose Zen 4 and Zen 5 issue it at their FMAs' rate (the bench's register-only
/// loops: 455–461 against 223–230 GFLOP/s on a Zen 4, 994 against 537 on a Zen 5, 2 threads);
/// false on Intel, whose cores issue it on one port, at a quarter of their two ports' FMAs (166
/// against 326 on an Emerald Rapids without AMX). There a bf16 GEMM on dot products runs at half
/// the f32 GEMM's rate: `--bf16`'s MiniLM step took 1.47–1.56 s against the f32 step's 0.86–0.93.
/// Decided by the vendor, not timed, so that every process of a run, restarts included,
/// multiplies in the same order.
fn dot_outruns_fma() -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        // CPUID leaf 0: the vendor string in EBX, EDX, ECX ("Auth", "enti", "cAMD").
        let leaf0 = std::arch::x86_64::__cpuid(0);
        let word = |s: &[u8; 4]| u32::from_le_bytes(*s);
        (leaf0.ebx, leaf0.edx, leaf0.ecx) == (word(b"Auth"), word(b"enti"), word(b"cAMD"))
    }
    #[cfg(not(target_arch = "x86_64"))]
    false
}

/// `KILN_CPU_ISA` from the environment.
pub fn cap_from_env() -> Result<IsaCap> {
    match std::env::var(ENV) {
        Ok(v) => v.parse(),
        Err(std::env::VarError::NotPresent) => Ok(IsaCap::Native),
        Err(std::env::VarError::NotUnicode(v)) => Err(not_a_level(&v.to_string_lossy())),
    }
}

fn not_a_level(value: &str) -> KilnError {
    KilnError::Config(format!(
        "{ENV}={value:?} is not an instruction level kiln dispatches to: use avx2, avx512, avx512bf16 or native"
    ))
}

static ISA: OnceLock<CpuIsa> = OnceLock::new();

/// The instructions kiln's kernels use, decided on first use from `KILN_CPU_ISA` and the CPU. A bad
/// `KILN_CPU_ISA` is an error here; the CLI calls this before any work, so kernels never see one.
pub fn init() -> Result<CpuIsa> {
    if let Some(isa) = ISA.get() {
        return Ok(*isa);
    }
    let isa = CpuIsa::capped(cap_from_env()?);
    Ok(*ISA.get_or_init(|| {
        if isa.level < IsaLevel::Avx512 {
            // The `gemm` crate picks its kernels once, on its first product: capped before any.
            gemm_common::cap_x86_to_avx2();
        }
        isa
    }))
}

/// [`init`]'s result, for the kernels. Panics on a bad `KILN_CPU_ISA` (a library user that skipped
/// [`init`]): running wider or narrower code than asked for would be silent.
pub fn cpu_isa() -> CpuIsa {
    match ISA.get() {
        Some(isa) => *isa,
        None => init().unwrap_or_else(|e| panic!("{e}")),
    }
}

/// Asks Linux for the AMX tile data state (`arch_prctl(ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA)`,
/// needed since kernel 5.16 before the first tile instruction) once per process, after checking that
/// the CPU has AMX-TILE and AMX-BF16. False on other CPUs and systems, or when the kernel refuses.
fn request_tiles() -> bool {
    static GRANTED: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *GRANTED.get_or_init(|| {
        #[cfg(all(target_arch = "x86_64", target_os = "linux"))]
        {
            // CPUID leaf 7, subleaf 0: EDX bit 22 is AMX-BF16, bit 24 AMX-TILE.
            // CPUID exists on every x86_64 CPU; leaf 7 on every one with AVX2.
            let leaf7 = std::arch::x86_64::__cpuid_count(7, 0);
            let has = |bit: u32| leaf7.edx & (1 << bit) != 0;
            if !(has(22) && has(24)) {
                return false;
            }
            const ARCH_REQ_XCOMP_PERM: libc::c_long = 0x1023;
            const XFEATURE_XTILEDATA: libc::c_long = 18;
            // SAFETY: arch_prctl with these arguments only changes this process's permissions.
            let rc = unsafe {
                libc::syscall(
                    libc::SYS_arch_prctl,
                    ARCH_REQ_XCOMP_PERM,
                    XFEATURE_XTILEDATA,
                )
            };
            rc == 0
        }
        #[cfg(not(all(target_arch = "x86_64", target_os = "linux")))]
        false
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn caps_parse_and_lower_the_detected_level() {
        assert_eq!("AVX2".parse::<IsaCap>().unwrap(), IsaCap::Avx2);
        assert_eq!(" avx512 ".parse::<IsaCap>().unwrap(), IsaCap::Avx512);
        assert_eq!("".parse::<IsaCap>().unwrap(), IsaCap::Native);
        let e = "sse4".parse::<IsaCap>().unwrap_err().to_string();
        assert!(
            e.contains("KILN_CPU_ISA=\"sse4\"") && e.contains("avx2, avx512, avx512bf16 or native"),
            "{e}"
        );
        assert_eq!("AVX512BF16".parse::<IsaCap>().unwrap(), IsaCap::Avx512Bf16);
        let (native, bf16, amx) = detected();
        let avx2 = CpuIsa::capped(IsaCap::Avx2);
        assert_eq!(avx2.level, native.min(IsaLevel::Avx2));
        assert!(!avx2.bf16_dot && !CpuIsa::capped(IsaCap::Avx512).bf16_dot);
        assert!(!avx2.amx && !CpuIsa::capped(IsaCap::Avx512).amx);
        let dot = CpuIsa::capped(IsaCap::Avx512Bf16);
        assert_eq!((dot.bf16_dot, dot.amx, dot.slow_dot), (bf16, false, false));
        let own = CpuIsa::capped(IsaCap::Native);
        assert_eq!(own.amx, amx);
        // Natively the dot products run where the CPU has them and they pay (AMD), or with AMX.
        let pays = bf16 && (amx || dot_outruns_fma());
        assert_eq!((own.bf16_dot, own.slow_dot), (pays, bf16 && !pays));
        if own.slow_dot {
            assert!(
                own.describe().contains("avx512_bf16 left out"),
                "{}",
                own.describe()
            );
        }
        // AMX is there exactly when the CPU lists it (and Linux grants it: every kernel since 5.16).
        let flags = std::fs::read_to_string("/proc/cpuinfo").unwrap_or_default();
        let listed = flags
            .lines()
            .any(|l| l.starts_with("flags") && l.split_whitespace().any(|f| f == "amx_bf16"));
        if cfg!(target_arch = "x86_64") && !flags.is_empty() {
            assert_eq!(amx, listed && bf16, "AMX detected {amx}, listed {listed}");
        }
        assert!(avx2.describe().ends_with("(KILN_CPU_ISA=avx2)"));
        // The kernels follow this process's KILN_CPU_ISA (scripts/test runs the suite capped).
        assert_eq!(cpu_isa(), CpuIsa::capped(cap_from_env().unwrap()));
    }

    /// `kiln bench --python`'s cap takes effect in the reference PyTorch: ATen reports the level
    /// and oneDNN's verbose log names the ISA its convolution ran with (no bf16 dot products at
    /// the AVX-512 cap; below AVX-512 PyTorch sends no bf16 work to oneDNN at all). Skips without the reference venv or when the CPU lacks the level.
    #[test]
    fn the_pytorch_side_is_capped_to_the_same_level() {
        let py = match kiln_testkit::common::python_with("torch") {
            Ok(py) => py,
            Err(why) => {
                eprintln!("skipped: {why}");
                return;
            }
        };
        let probe = "import torch\n\
            print('aten', torch.backends.cpu.get_cpu_capability(), flush=True)\n\
            x = torch.randn(8, 64, 32, 32)\n\
            y = torch.nn.functional.conv2d(x, torch.randn(64, 64, 3, 3))\n";
        let (native, _, _) = detected();
        for (cap, level, aten, onednn) in [
            (IsaCap::Avx2, IsaLevel::Avx2, "aten AVX2", "isa:Intel AVX2"),
            (
                IsaCap::Avx512,
                IsaLevel::Avx512,
                "aten AVX512",
                "isa:Intel AVX-512 with AVX512BW, AVX512VL, and AVX512DQ extensions",
            ),
        ] {
            if native < level {
                continue;
            }
            let out = std::process::Command::new(&py)
                .args(["-c", probe])
                .envs(cap.pytorch_env().iter().copied())
                .env("ONEDNN_VERBOSE", "1")
                .output()
                .unwrap();
            let text = String::from_utf8_lossy(&out.stdout);
            assert!(out.status.success(), "{text}");
            assert!(text.lines().any(|l| l == aten), "{cap:?}: {text}");
            assert!(text.lines().any(|l| l.ends_with(onednn)), "{cap:?}: {text}");
        }
    }
}
