//! Sizes checked before anything is allocated: a config whose parameters cannot fit in this
//! machine's memory is one clear sentence, not an allocator abort minutes later.

use std::path::Path;

use crate::error::{KilnError, Result};

/// Bytes the host needs per parameter just to load a model: the f32 weights and the file's bytes
/// read beside them. Training needs more (gradients, AdamW moments, activations); this is the lower
/// bound every command shares, so the check never refuses a model that could run.
pub const LOAD_BYTES_PER_PARAM: f64 = 8.0;

/// Memory this process may still use: `MemAvailable`, capped by the cgroup's limit (containers),
/// or `None` where neither can be read.
pub fn available_memory() -> Option<u64> {
    let meminfo = std::fs::read_to_string("/proc/meminfo").ok();
    let avail = meminfo.as_deref().and_then(|m| {
        m.lines()
            .find(|l| l.starts_with("MemAvailable:"))
            .and_then(|l| l.split_whitespace().nth(1))
            .and_then(|kb| kb.parse::<u64>().ok())
            .map(|kb| kb * 1024)
    });
    let read_u64 = |p: &str| {
        std::fs::read_to_string(p)
            .ok()
            .and_then(|s| s.trim().parse::<u64>().ok())
    };
    let cgroup = match (
        read_u64("/sys/fs/cgroup/memory.max"),
        read_u64("/sys/fs/cgroup/memory.current"),
    ) {
        (Some(max), Some(cur)) => Some(max.saturating_sub(cur)),
        _ => None,
    };
    match (avail, cgroup) {
        (Some(a), Some(c)) => Some(a.min(c)),
        (a, c) => a.or(c),
    }
}

fn gb(bytes: f64) -> String {
    format!("{:.1} GB", bytes / 1e9)
}

/// An error when `params` parameters (a count that may exceed any integer type, hence f64) cannot be
/// loaded in the memory available; `path` is the config that asked for them.
pub fn ensure_params_fit(path: &Path, params: f64) -> Result<()> {
    let need = params * LOAD_BYTES_PER_PARAM;
    let Some(avail) = available_memory() else {
        return Ok(());
    };
    if need > avail as f64 {
        return Err(KilnError::Config(format!(
            "{}: this model has {params:.3e} parameters, which need at least {} of memory to load \
             (f32 weights and the file read beside them), but {} is available; check the config's sizes",
            path.display(),
            gb(need),
            gb(avail as f64)
        )));
    }
    Ok(())
}

/// `Err` naming `name` unless `v ≥ 1`.
pub fn positive(name: &str, v: usize) -> std::result::Result<(), String> {
    if v == 0 {
        return Err(format!("{name} must be at least 1, got 0"));
    }
    Ok(())
}

/// `Err` naming `name` unless `v` is finite and `v > 0` (`strict`) or `v ≥ 0`.
pub fn non_negative(name: &str, v: f64, strict: bool) -> std::result::Result<(), String> {
    let ok = v.is_finite() && if strict { v > 0.0 } else { v >= 0.0 };
    if !ok {
        let bound = if strict { "above 0" } else { "at least 0" };
        return Err(format!("{name} must be a finite number {bound}, got {v}"));
    }
    Ok(())
}

/// `Err` naming `name` unless `p` is a dropout probability in [0, 1).
pub fn probability(name: &str, p: f64) -> std::result::Result<(), String> {
    if !(0.0..1.0).contains(&p) {
        return Err(format!("{name} must be a probability in [0, 1), got {p}"));
    }
    Ok(())
}

/// `Err` naming `name` unless token id `id` (when set) has a row among `vocab_size` embeddings.
pub fn token_in_vocab(
    name: &str,
    id: Option<usize>,
    vocab_size: usize,
) -> std::result::Result<(), String> {
    match id {
        Some(id) if id >= vocab_size => Err(format!(
            "{name} {id} is outside the vocabulary (vocab_size {vocab_size})"
        )),
        _ => Ok(()),
    }
}

/// `layer_types` (transformers 5), when given: one `full_attention` or `sliding_attention` per
/// layer.
pub fn layer_types(types: Option<&[String]>, layers: usize) -> std::result::Result<(), String> {
    let Some(types) = types else { return Ok(()) };
    if types.len() != layers {
        return Err(format!(
            "layer_types has {} entries for {layers} layers",
            types.len()
        ));
    }
    match types
        .iter()
        .find(|t| !["full_attention", "sliding_attention"].contains(&t.as_str()))
    {
        Some(t) => Err(format!(
            "layer_types: {t:?} is not \"full_attention\" or \"sliding_attention\""
        )),
        None => Ok(()),
    }
}

/// `model_type` must be one this model family reads (an absent one is taken as the family's).
pub fn model_type(found: Option<&str>, family: &[&str]) -> std::result::Result<(), String> {
    match found {
        None => Ok(()),
        Some(t) if family.contains(&t) => Ok(()),
        Some(t) => Err(format!(
            "model_type {t:?} is not supported here (this command reads {}); its weights would \
             not load into such a model",
            family.join(", ")
        )),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn absurd_sizes_do_not_fit() {
        let e = ensure_params_fit(Path::new("config.json"), 2f64.powi(60)).unwrap_err();
        assert!(e.to_string().contains("config.json: this model has"), "{e}");
        ensure_params_fit(Path::new("config.json"), 1e6).unwrap();
        assert!(available_memory().is_some());
    }
}
