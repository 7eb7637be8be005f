//! `kiln precompile`: fills the GPU kernel cache by running a training command's first steps.

use anyhow::{bail, Context, Result};
use clap::Args;

use crate::hf_flags::normalize_flag;

#[derive(Args)]
pub struct PrecompileCmd {
    /// The training command, as given to `kiln`: `train --model ... --train-file ...`.
    #[arg(last = true, required = true)]
    pub command: Vec<String>,
}

/// Runs `kiln train ...` in a child process that takes one step on a batch of every shape the
/// run can meet, and one evaluation batch of every evaluation shape (`kiln::train::precompile`),
/// without checkpoints or outputs; then reports the shapes and what the kernel cache gained.
pub fn run(device: &str, threads: Option<usize>, cmd: &PrecompileCmd) -> Result<()> {
    if cmd.command.first().map(String::as_str) != Some("train") {
        bail!("precompile runs a training command: kiln precompile -- train --model ...");
    }
    let scratch = std::env::temp_dir().join(format!("kiln-precompile-{}", std::process::id()));
    let mut args = vec!["--device".to_string(), device.to_string()];
    if let Some(t) = threads {
        args.push(format!("--threads={t}"));
    }
    // The command's outputs give way to a scratch folder; its schedule does not matter.
    let replaced = ["--save-strategy", "--output-dir", "--report-to"];
    let mut rest = cmd.command.iter().map(|a| normalize_flag(a.clone()));
    while let Some(a) = rest.next() {
        let name = a.split('=').next().unwrap_or_default();
        if replaced.contains(&name) {
            if !a.contains('=') {
                rest.next(); // its value
            }
            continue;
        }
        args.push(a);
    }
    args.extend([
        "--precompile-shapes".into(),
        "--save-strategy=no".into(),
        "--report-to=none".into(),
        format!("--output-dir={}", scratch.display()),
    ]);
    let (before, files_before) = kiln::backend::kernel_cache_usage();
    let status = std::process::Command::new(std::env::current_exe()?)
        .args(&args)
        .status()?;
    let summary = std::fs::read(scratch.join(kiln::train::precompile::SUMMARY_FILE));
    let _ = std::fs::remove_dir_all(&scratch);
    if !status.success() {
        bail!("the training command failed ({status})");
    }
    let summary: kiln::train::precompile::PrecompileSummary =
        serde_json::from_slice(&summary.context("the precompile run wrote no summary")?)?;
    let (after, files) = kiln::backend::kernel_cache_usage();
    let shapes = |s: &[(usize, usize)]| {
        s.iter()
            .map(|(b, t)| format!("{b}×{t}"))
            .collect::<Vec<_>>()
            .join(" ")
    };
    println!(
        "precompile: {} training shapes ({}), {} evaluation shapes ({}), {} failed, in {:.1} s",
        summary.train_shapes.len(),
        shapes(&summary.train_shapes),
        summary.eval_shapes.len(),
        shapes(&summary.eval_shapes),
        summary.failed.len(),
        summary.seconds
    );
    for f in &summary.failed {
        println!("  failed: {f}");
    }
    if let (Some(compiled), Some(hits)) = (summary.kernels_compiled, summary.kernel_cache_hits) {
        println!(
            "kernels: {} ({compiled} compiled, {hits} cache hits)",
            compiled + hits
        );
    }
    if device == "cpu" {
        println!("(CPU kernels are compiled ahead of time: there is nothing to cache on the CPU)");
    } else {
        println!(
            "kernel cache {}: {files} files, {:.1} MiB; this run compiled and stored {} (+{:.1} MiB), the rest were cache hits",
            kiln::backend::kernel_cache_dir().display(),
            after as f64 / (1 << 20) as f64,
            files.saturating_sub(files_before),
            after.saturating_sub(before) as f64 / (1 << 20) as f64
        );
    }
    if !summary.failed.is_empty() {
        bail!("{} shapes failed to run", summary.failed.len());
    }
    Ok(())
}
