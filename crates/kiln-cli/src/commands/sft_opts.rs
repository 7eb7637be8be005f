//! The options of `kiln train --task sft`, under TRL's `SFTConfig` names.

use anyhow::{bail, Result};
use clap::Args;
use kiln::data::sft::SftOptions;
use kiln::tasks::sft::SftData;

#[derive(Args, Clone, Default)]
#[command(next_help_heading = "Supervised fine-tuning (TRL)")]
pub struct SftOpts {
    /// Train on the completion's tokens only [default: true for prompt/completion rows].
    #[arg(long, value_name = "BOOL")]
    completion_only_loss: Option<bool>,
    /// Train on the assistant's tokens only: those the chat template marks with
    /// {% generation %} … {% endgeneration %}, or, for a template without those tags, each
    /// assistant turn found by rendering the conversation turn by turn.
    #[arg(long)]
    assistant_only_loss: bool,
    /// Print the first N training examples with the tokens trained on marked, to check what a
    /// chat template's masks select.
    #[arg(long, value_name = "N", default_value_t = 0)]
    print_masks: usize,
    /// Pack rows best-fit-decreasing into sequences of at most --max-length tokens, a batch's
    /// sequences in one row with no attention and no positions crossing from one row to the
    /// next (TRL's packing with padding_free): no padding, unless --pad-to-multiple-of asks
    /// for it.
    #[arg(long)]
    packing: bool,
}

impl SftOpts {
    /// `max_length`: `--max-length` when given, else TRL's 1024. `text_field`: the column of
    /// plain-text rows (`--dataset-text-field`). `pad_to_multiple_of`: `--pad-to-multiple-of`.
    pub fn data(
        &self,
        max_length: Option<usize>,
        text_field: &str,
        pad_to_multiple_of: Option<usize>,
    ) -> Result<SftData> {
        let max_length = max_length.unwrap_or(1024);
        if max_length < 2 {
            bail!("--max-length {max_length}: a row needs at least two tokens to have a target");
        }
        Ok(SftData {
            options: SftOptions {
                dataset_text_field: text_field.to_string(),
                completion_only_loss: self.completion_only_loss,
                assistant_only_loss: self.assistant_only_loss,
                max_length: Some(max_length),
                eos_token: None,
            },
            packing: self.packing,
            pad_to_multiple_of,
            print_masks: self.print_masks,
        })
    }

    /// Whether any SFT option was given (they mean nothing to the other tasks).
    pub fn any(&self) -> bool {
        self.completion_only_loss.is_some()
            || self.assistant_only_loss
            || self.packing
            || self.print_masks > 0
    }
}
