//! The machine's arithmetic peak, the ceiling every bench row is a fraction of. It is measured, not
//! looked up: a VM's clock and how its vCPUs map onto cores are unknown, while a loop of
//! independent multiply-adds held in registers (no memory traffic) runs at exactly the rate the
//! vector units allow on the threads the bench uses. A GEMM cannot beat it.

use std::hint::black_box;
use std::time::Instant;

/// FLOP/s ceilings of this machine on the bench's threads.
#[derive(Debug, Clone, serde::Serialize)]
pub struct MachinePeak {
    pub fp32_gflops: f64,
    /// The ceiling of bf16 GEMM arithmetic (AVX512-BF16 dot products, AMX tiles, or fp32 FMAs
    /// after widening where the CPU has neither).
    pub bf16_gflops: f64,
    /// How each was obtained, for the table's footer.
    pub how: String,
}

/// Independent accumulator chains: enough to hide a 4-cycle FMA latency on two FMA ports.
const CHAINS: usize = 12;

/// The peak on every thread of the current rayon pool at once, of the instructions kiln's kernels
/// may use ([`crate::ops::isa`]). `None` where no vector unit kiln knows is present.
pub fn measure() -> Option<MachinePeak> {
    #[cfg(target_arch = "x86_64")]
    {
        use crate::ops::isa::{cpu_isa, IsaLevel};
        // The peak of the instructions kiln may use (`KILN_CPU_ISA` lowers it with the kernels).
        let isa = cpu_isa();
        let (fp32_per_iter, fp32_isa, fp32): (f64, &str, fn(u64) -> f32) = match isa.level {
            IsaLevel::Avx512 => (CHAINS as f64 * 32.0, "AVX-512 FMA", |n| unsafe {
                x86::fma512(n)
            }),
            IsaLevel::Avx2 => (CHAINS as f64 * 16.0, "AVX2 FMA", |n| unsafe {
                x86::fma256(n)
            }),
            IsaLevel::Portable => return None,
        };
        let fp32_gflops = rate(fp32_per_iter, fp32);
        let (bf16_gflops, bf16_how) = if isa.amx {
            (
                rate(crate::ops::amx::PEAK_FLOP_PER_ROUND, |n| unsafe {
                    crate::ops::amx::peak_loop(n)
                }),
                "a register-only AMX tile loop (tdpbf16ps)".to_string(),
            )
        } else if isa.bf16_dot {
            (
                rate(CHAINS as f64 * 64.0, |n| unsafe { x86::dpbf16(n) }),
                "a register-only vdpbf16ps loop".to_string(),
            )
        } else {
            let why = if isa.slow_dot {
                "bf16 products run in f32: vdpbf16ps is slower here"
            } else {
                "no bf16 arithmetic"
            };
            (fp32_gflops, format!("the fp32 loop ({why})"))
        };
        Some(MachinePeak {
            fp32_gflops,
            bf16_gflops,
            how: format!(
                "machine peak on {} threads: fp32 {fp32_gflops:.0} GFLOP/s from a register-only {fp32_isa} loop, bf16 {bf16_gflops:.0} GFLOP/s from {bf16_how}",
                rayon::current_num_threads()
            ),
        })
    }
    #[cfg(not(target_arch = "x86_64"))]
    None
}

/// GFLOP/s of `kernel` (doing `flop_per_iter` per iteration) run on every pool thread at once: the
/// best of three rounds of about 0.1 s, so a busy moment on a shared machine does not lower it.
#[cfg_attr(not(target_arch = "x86_64"), allow(dead_code))]
fn rate(flop_per_iter: f64, kernel: fn(u64) -> f32) -> f64 {
    let threads = rayon::current_num_threads() as f64;
    let mut iters = 1u64 << 16;
    loop {
        let t0 = Instant::now();
        black_box(kernel(black_box(iters)));
        if t0.elapsed().as_secs_f64() > 0.02 {
            break;
        }
        iters *= 2;
    }
    iters *= 5;
    (0..3)
        .map(|_| {
            let t0 = Instant::now();
            rayon::broadcast(|_| black_box(kernel(black_box(iters))));
            flop_per_iter * iters as f64 * threads / t0.elapsed().as_secs_f64() / 1e9
        })
        .fold(0.0, f64::max)
}

#[cfg(target_arch = "x86_64")]
mod x86 {
    use super::CHAINS;
    use std::arch::x86_64::*;

    /// `n` rounds of `CHAINS` independent 16-lane FMAs.
    #[target_feature(enable = "avx512f")]
    pub unsafe fn fma512(n: u64) -> f32 {
        let (a, b) = (_mm512_set1_ps(0.999_999), _mm512_set1_ps(1e-7));
        let mut acc = [_mm512_set1_ps(1.0); CHAINS];
        for _ in 0..n {
            for c in acc.iter_mut() {
                *c = _mm512_fmadd_ps(*c, a, b);
            }
        }
        acc.iter().map(|&c| _mm512_reduce_add_ps(c)).sum()
    }

    /// `n` rounds of `CHAINS` independent 8-lane FMAs.
    #[target_feature(enable = "avx2,fma")]
    pub unsafe fn fma256(n: u64) -> f32 {
        let (a, b) = (_mm256_set1_ps(0.999_999), _mm256_set1_ps(1e-7));
        let mut acc = [_mm256_set1_ps(1.0); CHAINS];
        for _ in 0..n {
            for c in acc.iter_mut() {
                *c = _mm256_fmadd_ps(*c, a, b);
            }
        }
        let mut out = [0f32; 8];
        for c in acc {
            let mut lanes = [0f32; 8];
            _mm256_storeu_ps(lanes.as_mut_ptr(), c);
            for (o, l) in out.iter_mut().zip(lanes) {
                *o += l;
            }
        }
        out.iter().sum()
    }

    /// `n` rounds of `CHAINS` independent `vdpbf16ps` (32 bf16 products summed into 16 lanes).
    #[target_feature(enable = "avx512f,avx512bf16")]
    pub unsafe fn dpbf16(n: u64) -> f32 {
        // bf16 0.5 in both halves of every 32-bit lane.
        let half: __m512bh = std::mem::transmute(_mm512_set1_epi32(0x3f00_3f00));
        let mut acc = [_mm512_set1_ps(1.0); CHAINS];
        for _ in 0..n {
            for c in acc.iter_mut() {
                *c = _mm512_dpbf16_ps(*c, half, half);
            }
        }
        acc.iter().map(|&c| _mm512_reduce_add_ps(c)).sum()
    }
}

#[cfg(test)]
mod tests {
    #[test]
    fn the_peak_loops_compute_what_they_claim() {
        // The loops' arithmetic, checked against scalar references, so the count of FLOP per
        // iteration stands for work actually done.
        #[cfg(target_arch = "x86_64")]
        {
            let chain = |n: u64| (0..n).fold(1f32, |c, _| c.mul_add(0.999_999, 1e-7));
            if std::is_x86_feature_detected!("avx512f") {
                let got = unsafe { super::x86::fma512(1000) };
                let want = super::CHAINS as f32 * 16.0 * chain(1000);
                assert!((got - want).abs() < 1e-3 * want, "{got} vs {want}");
            }
            if std::is_x86_feature_detected!("avx2") && std::is_x86_feature_detected!("fma") {
                let got = unsafe { super::x86::fma256(1000) };
                let want = super::CHAINS as f32 * 8.0 * chain(1000);
                assert!((got - want).abs() < 1e-3 * want, "{got} vs {want}");
            }
            if std::is_x86_feature_detected!("avx512bf16") {
                // Each round adds 2 × 0.5 × 0.5 to every lane.
                let got = unsafe { super::x86::dpbf16(100) };
                let want = super::CHAINS as f32 * 16.0 * (1.0 + 100.0 * 0.5);
                assert_eq!(got, want);
            }
            if crate::ops::isa::cpu_isa().amx {
                // SAFETY: the tiles were granted (`amx`); each round adds 32 × 1 × 0.5.
                assert_eq!(unsafe { crate::ops::amx::peak_loop(100) }, 1600.0);
            } else {
                eprintln!("no amx_bf16 on this CPU (or KILN_CPU_ISA caps it): AMX loop not run");
            }
            let peak = super::measure().expect("x86 CI machines have AVX2");
            assert!(peak.fp32_gflops > 0.0 && peak.bf16_gflops > 0.0);
        }
    }
}
