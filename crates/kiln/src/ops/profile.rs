//! A per-kernel wall-time profile of the fused CPU ops, for `kiln bench --profile`. Off by default:
//! a disabled scope costs one relaxed atomic load.

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Mutex;
use std::time::Instant;

static ENABLED: AtomicBool = AtomicBool::new(false);
static TOTALS: Mutex<BTreeMap<&'static str, (u64, f64)>> = Mutex::new(BTreeMap::new());

pub fn enable(on: bool) {
    ENABLED.store(on, Ordering::Relaxed);
}

/// Clears and returns `(kernel, calls, seconds)` sorted by time, largest first.
pub fn take() -> Vec<(&'static str, u64, f64)> {
    let mut m = TOTALS.lock().expect("profile lock");
    let mut v: Vec<_> = m.iter().map(|(k, (n, s))| (*k, *n, *s)).collect();
    m.clear();
    v.sort_by(|a, b| b.2.total_cmp(&a.2));
    v
}

pub struct Scope(Option<(&'static str, Instant)>);

/// Times the enclosing block under `name` while profiling is enabled.
pub fn scope(name: &'static str) -> Scope {
    Scope(
        ENABLED
            .load(Ordering::Relaxed)
            .then(|| (name, Instant::now())),
    )
}

impl Drop for Scope {
    fn drop(&mut self) {
        if let Some((name, t0)) = self.0 {
            let mut m = TOTALS.lock().expect("profile lock");
            let e = m.entry(name).or_insert((0, 0.0));
            e.0 += 1;
            e.1 += t0.elapsed().as_secs_f64();
        }
    }
}
