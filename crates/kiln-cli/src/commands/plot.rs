//! `kiln plot`: runs' training curves drawn into a PNG or SVG.

use std::path::PathBuf;

use anyhow::Result;
use clap::Args;

#[derive(Args)]
pub struct PlotCmd {
    /// Output folders of runs: kiln's (log.jsonl) or Hugging Face Trainer's (trainer_state.json).
    #[arg(required = true)]
    run_dirs: Vec<PathBuf>,
    /// The picture to write: .png or .svg.
    #[arg(long, default_value = "curves.png")]
    out: PathBuf,
}

pub fn run(cmd: PlotCmd) -> Result<()> {
    let runs = cmd
        .run_dirs
        .iter()
        .map(|d| kiln::report::history::RunHistory::read(d))
        .collect::<kiln::error::Result<Vec<_>>>()?;
    kiln::report::plot::plot_runs(&runs, &cmd.out)?;
    println!("wrote {}", cmd.out.display());
    Ok(())
}
