//! One module per `kiln` command: its arguments (clap) and its `run`. `data_opts` holds the data
//! options `train` and `eval` share.

pub mod bench;
pub mod cache;
pub mod convert;
pub mod data_opts;
pub mod eval;
pub mod generate;
pub mod launch;
pub mod lora_opts;
pub mod merge;
pub mod plot;
pub mod precompile;
pub mod predict;
pub mod sft_opts;
pub mod top;
pub mod train;

use anyhow::Result;

use crate::Command;
use data_opts::LmOpts;
use train::Task;

/// Model, tokenizer and config arguments that name a Hub repo (`org/name[@revision]`) instead of
/// an existing path become the cached files' paths, downloaded first when needed.
pub fn resolve_hub_ids(command: &mut Command) -> Result<()> {
    use kiln::hub::remote::{resolve, Need};
    let tokenizer = |lm: &mut LmOpts| -> Result<()> {
        if let Some(t) = &mut lm.tokenizer {
            *t = resolve(t, Need::Tokenizer)?;
        }
        Ok(())
    };
    match command {
        Command::Train(c) if c.task != Task::MnistMlp => {
            if let Some(m) = &mut c.model {
                *m = resolve(m, Need::Model)?;
            }
            if let Some(f) = &mut c.from_config {
                *f = resolve(f, Need::Config)?;
            }
            tokenizer(&mut c.lm)?;
        }
        Command::Eval(c) if c.task != Task::MnistMlp => {
            c.model = resolve(&c.model, Need::Model)?;
            tokenizer(&mut c.lm)?;
        }
        Command::Predict(c) => c.model = resolve(&c.model, Need::Model)?,
        Command::Generate(c) => c.model = resolve(&c.model, Need::Model)?,
        Command::Merge(c) => c.model = resolve(&c.model, Need::Model)?,
        _ => {}
    }
    Ok(())
}
