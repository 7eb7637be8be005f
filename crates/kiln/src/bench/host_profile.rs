//! Where a row's host time goes (`kiln bench --host-profile DIR`, built with `--features
//! host-profile`): the process's call stacks sampled during the row's timed steps, written as
//! folded stacks (`thread;outermost;…;innermost count`, the input of flame-graph tools and of
//! `scripts/host_profile_summary.py`). On a GPU the host's time is the time to queue the step, and
//! which part of Burn's autodiff, CubeCL's launch path or the allocator takes it is what the
//! per-op profile (`--profile`) cannot say. Sampling stops the process SIGPROF-many times a second,
//! so a sampled row's times are not the ones the plain row reports.

use std::cell::RefCell;
use std::path::{Path, PathBuf};

use crate::error::{KilnError, Result};

/// Whether this build can sample (the `host-profile` feature).
pub const AVAILABLE: bool = cfg!(feature = "host-profile");

/// Samples per second of CPU time: a prime, so the timer does not beat with a periodic step.
#[cfg(feature = "host-profile")]
const FREQUENCY_HZ: i32 = 997;

struct Armed {
    // Without the feature `arm` refuses, so nothing is ever written to it.
    #[cfg_attr(not(feature = "host-profile"), allow(dead_code))]
    path: PathBuf,
    #[cfg(feature = "host-profile")]
    guard: Option<pprof::ProfilerGuard<'static>>,
}

thread_local! {
    /// The row this thread is running, when its host time is to be sampled.
    static ARMED: RefCell<Option<Armed>> = const { RefCell::new(None) };
}

/// Refuses `--host-profile` in one sentence where this build cannot sample.
pub fn require() -> Result<()> {
    if AVAILABLE {
        Ok(())
    } else {
        Err(KilnError::Config(
            "`--host-profile` needs a kiln built with `--features host-profile`".into(),
        ))
    }
}

/// Prepares sampling of row `key` into `dir/key.folded`; sampling starts at [`start`].
pub fn arm(dir: &Path, key: &str) -> Result<()> {
    require()?;
    std::fs::create_dir_all(dir)
        .map_err(|e| KilnError::Config(format!("--host-profile {}: {e}", dir.display())))?;
    let path = dir.join(format!("{key}.folded"));
    ARMED.with(|a| {
        *a.borrow_mut() = Some(Armed {
            path,
            #[cfg(feature = "host-profile")]
            guard: None,
        })
    });
    Ok(())
}

/// Starts sampling, if a row is armed (the first timed step; a second call keeps the first start).
pub fn start() -> Result<()> {
    #[cfg(feature = "host-profile")]
    ARMED.with(|a| -> Result<()> {
        if let Some(armed) = a.borrow_mut().as_mut() {
            if armed.guard.is_none() {
                let guard = pprof::ProfilerGuardBuilder::default()
                    .frequency(FREQUENCY_HZ)
                    // Unwinding through these from a signal handler can deadlock or crash.
                    .blocklist(&["libc", "libgcc", "pthread", "vdso"])
                    .build()
                    .map_err(|e| KilnError::Config(format!("host profile: {e}")))?;
                armed.guard = Some(guard);
            }
        }
        Ok(())
    })?;
    Ok(())
}

/// Stops sampling and writes the armed row's folded stacks; returns the file written, if any.
pub fn finish() -> Result<Option<PathBuf>> {
    let Some(armed) = ARMED.with(|a| a.borrow_mut().take()) else {
        return Ok(None);
    };
    #[cfg(feature = "host-profile")]
    if let Some(guard) = armed.guard {
        let report = guard
            .report()
            .build()
            .map_err(|e| KilnError::Config(format!("host profile: {e}")))?;
        let stacks = report.data.iter().map(|(frames, &count)| {
            // pprof lists each sample's frames innermost first, and a frame's inlined functions
            // innermost first too.
            let names = frames
                .frames
                .iter()
                .rev()
                .flat_map(|frame| frame.iter().rev().map(|symbol| symbol.name()));
            (frames.thread_name_or_id(), names, count)
        });
        let text = folded(stacks);
        crate::io::files::atomic_write(&armed.path, text.as_bytes())?;
        return Ok(Some(armed.path));
    }
    #[cfg(not(feature = "host-profile"))]
    let _ = armed;
    Ok(None)
}

/// Folded-stack text: one `thread;outer;…;inner count` line per distinct stack, sorted so that
/// two profiles of the same row diff line by line. `;` inside a name (Rust's `[T; N]`) would split
/// a frame, so it is written as `,`.
#[cfg_attr(not(feature = "host-profile"), allow(dead_code))]
fn folded<S: IntoIterator<Item = String>>(
    stacks: impl Iterator<Item = (String, S, isize)>,
) -> String {
    let mut lines: Vec<String> = stacks
        .map(|(thread, names, count)| {
            let mut line = thread.replace(';', ",");
            for name in names {
                line.push(';');
                line.push_str(&name.replace(';', ","));
            }
            format!("{line} {count}")
        })
        .collect();
    lines.sort();
    let mut text = lines.join("\n");
    text.push('\n');
    text
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn folded_lines_run_outermost_first_and_keep_names_whole() {
        let stacks = vec![
            (
                "main".to_string(),
                vec![
                    "main".to_string(),
                    "step".to_string(),
                    "f<[u8; 4]>".to_string(),
                ],
                3isize,
            ),
            ("pool-1".to_string(), vec!["work".to_string()], 1),
        ];
        let text = folded(stacks.into_iter());
        assert_eq!(text, "main;main;step;f<[u8, 4]> 3\npool-1;work 1\n");
    }

    #[test]
    fn a_row_not_armed_writes_nothing() {
        start().unwrap();
        assert_eq!(finish().unwrap(), None);
    }

    #[cfg(feature = "host-profile")]
    #[test]
    fn an_armed_row_writes_the_stacks_of_its_busy_loop() {
        let dir = std::env::temp_dir().join(format!("kiln-host-profile-{}", std::process::id()));
        arm(&dir, "busy").unwrap();
        start().unwrap();
        /// This thread's CPU time: the timer counts the process's CPU time, and each sample lands
        /// on the thread that spent it, so tests running beside this one take their own share.
        fn thread_cpu_ms() -> f64 {
            // SAFETY: clock_gettime fills the timespec it is given.
            let mut ts: libc::timespec = unsafe { std::mem::zeroed() };
            unsafe { libc::clock_gettime(libc::CLOCK_THREAD_CPUTIME_ID, &mut ts) };
            ts.tv_sec as f64 * 1e3 + ts.tv_nsec as f64 / 1e6
        }
        #[inline(never)]
        fn kiln_host_profile_busy_loop() -> u64 {
            let t0 = thread_cpu_ms();
            let mut x = 1u64;
            while thread_cpu_ms() - t0 < 300.0 {
                for _ in 0..10_000 {
                    x = std::hint::black_box(x.wrapping_mul(6364136223846793005).wrapping_add(1));
                }
            }
            x
        }
        std::hint::black_box(kiln_host_profile_busy_loop());
        let path = finish().unwrap().expect("written");
        let text = std::fs::read_to_string(&path).unwrap();
        let samples: i64 = text
            .lines()
            .filter(|l| l.contains("kiln_host_profile_busy_loop"))
            .map(|l| l.rsplit(' ').next().unwrap().parse::<i64>().unwrap())
            .sum();
        // 300 ms of this thread's CPU at 997 Hz is about 300 samples alone; with other tests
        // busy beside it, timer signals that arrive while one is pending are lost (50 seen).
        assert!(samples >= 10, "{samples} samples in the loop:\n{text}");
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[cfg(not(feature = "host-profile"))]
    #[test]
    fn without_the_feature_arming_is_refused_in_one_sentence() {
        let e = arm(Path::new("/nonexistent"), "row")
            .unwrap_err()
            .to_string();
        assert!(e.contains("--features host-profile"), "{e}");
    }
}
