//! Reward-model data (`--task reward-modeling`), prepared row by row as TRL's `RewardTrainer`
//! prepares it (trl 1.16, `RewardTrainer._prepare_dataset`) and batched as its
//! `DataCollatorForPreference` batches it.
//!
//! Rows: `"chosen"` and `"rejected"`, two strings (standard) or two lists of messages
//! (conversational), with an optional `"prompt"` of the same kind before each, and an optional
//! numeric `"margin"` (how far the chosen reward should lead). Unlike DPO there is no prompt to
//! find: each side is scored whole. Standard sides get the EOS token string appended (unless they
//! end with it) and `prompt + side` is tokenized with the tokenizer's special tokens;
//! conversations (`prompt` messages, then the side's) are rendered with the chat template, no
//! generation prompt, and tokenized without special tokens.
//!
//! A side longer than `max_length` drops the row (TRL filters it; nothing is ever cut), which kiln
//! counts as skipped, or refuses under `--strict`; so is a row whose two sides are the same.

use serde_json::{Map, Value as Json};
use tokenizers::Tokenizer;

use super::chat_template::{ChatTemplate, RenderOptions};
use super::sft::{
    encode, from_value_to_chatml, no_chat_template, parse_messages, template_variables, tools,
    with_eos, SftError,
};
use crate::error::json_kind;

/// One reward pair, tokenized: each side whole (prompt included), and its margin.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct RewardExample {
    pub chosen_ids: Vec<u32>,
    pub rejected_ids: Vec<u32>,
    /// Subtracted from the reward difference in the loss (TRL's `margin` column); 0 without one.
    pub margin: f32,
}

/// TRL's `RewardConfig` fields that shape one row.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RewardOptions {
    /// Rows with a side longer than this are dropped (TRL's default 1024); `None`: no limit.
    pub max_length: Option<usize>,
    /// The EOS token string appended to standard sides (the tokenizer's `eos_token`).
    pub eos_token: Option<String>,
}

impl Default for RewardOptions {
    fn default() -> Self {
        Self {
            max_length: Some(1024),
            eos_token: None,
        }
    }
}

/// Tokenizes one reward row as TRL does (see the module docs); `template` is needed for
/// conversational rows.
pub fn prepare_reward_row(
    row: &Map<String, Json>,
    tokenizer: &Tokenizer,
    template: Option<&ChatTemplate>,
    options: &RewardOptions,
) -> Result<RewardExample, SftError> {
    let side = |field: &str| {
        row.get(field).map(from_value_to_chatml).ok_or_else(|| {
            SftError::Row(format!(
                "the row has no \"{field}\" field (a reward pair needs \"chosen\" and \
                 \"rejected\")"
            ))
        })
    };
    let (chosen, rejected) = (side("chosen")?, side("rejected")?);
    let prompt = row.get("prompt").map(from_value_to_chatml);
    let (chosen_ids, rejected_ids) = match (prompt, chosen, rejected) {
        (p @ (None | Some(Json::String(_))), Json::String(c), Json::String(r)) => {
            let p = p.as_ref().and_then(Json::as_str).unwrap_or("");
            let eos = options.eos_token.as_deref().ok_or_else(|| {
                SftError::Config(
                    "standard reward rows need the EOS token to append to each side, and the \
                     tokenizer has no eos_token"
                        .into(),
                )
            })?;
            let whole =
                |side: &str| encode(tokenizer, &format!("{p}{}", with_eos(side, eos)), true);
            (whole(&c)?, whole(&r)?)
        }
        (p @ (None | Some(Json::Array(_))), c @ Json::Array(_), r @ Json::Array(_)) => {
            let template = template.ok_or_else(no_chat_template)?;
            let tools = tools(row)?;
            let options = RenderOptions {
                add_generation_prompt: false,
                tools: tools.as_deref(),
                variables: template_variables(row)?,
            };
            let prompt = match &p {
                Some(p) => parse_messages("prompt", p)?,
                None => Vec::new(),
            };
            let whole = |field: &str, side: &Json| -> Result<Vec<u32>, SftError> {
                let mut all = prompt.clone();
                all.extend(parse_messages(field, side)?);
                encode(
                    tokenizer,
                    &template.render_with(&all, &options)?.text,
                    false,
                )
            };
            (whole("chosen", &c)?, whole("rejected", &r)?)
        }
        (p, c, r) => {
            return Err(SftError::Row(format!(
                "{}\"chosen\" and \"rejected\" must all be strings or all lists of messages, \
                 not {}{} and {}",
                if p.is_some() { "\"prompt\", " } else { "" },
                p.as_ref()
                    .map_or(String::new(), |p| format!("{}, ", json_kind(p))),
                json_kind(&c),
                json_kind(&r)
            )))
        }
    };
    if chosen_ids == rejected_ids {
        return Err(SftError::Row(
            "\"chosen\" and \"rejected\" are the same text: the pair prefers nothing".into(),
        ));
    }
    if let Some(max) = options.max_length {
        let longest = chosen_ids.len().max(rejected_ids.len());
        if longest > max {
            return Err(SftError::Row(format!(
                "a side has {longest} tokens, more than max_length={max} (TRL drops such rows; \
                 raise --max-length to keep it)"
            )));
        }
    }
    let margin = match row.get("margin") {
        None | Some(Json::Null) => 0.0,
        Some(Json::Number(n)) => match n.as_f64().map(|m| m as f32) {
            Some(m) if m.is_finite() => m,
            _ => {
                return Err(SftError::Row(format!(
                    "\"margin\" {n} is not a finite 32-bit float"
                )))
            }
        },
        Some(other) => {
            return Err(SftError::Row(format!(
                "\"margin\" must be a number, not {}",
                json_kind(other)
            )))
        }
    };
    Ok(RewardExample {
        chosen_ids,
        rejected_ids,
        margin,
    })
}

/// A batch of reward pairs as TRL's `DataCollatorForPreference` lays it out: every pair's chosen
/// sequence, then every pair's rejected one, right-padded with `pad_id` to the longest (rounded
/// up to `pad_to_multiple_of`): `[2 × pairs]` rows of `seq` ids, and each row's real length.
pub fn collate_rewards(
    examples: &[&RewardExample],
    pad_id: u32,
    pad_to_multiple_of: Option<usize>,
) -> (Vec<Vec<u32>>, Vec<usize>) {
    let rows: Vec<&Vec<u32>> = examples
        .iter()
        .map(|e| &e.chosen_ids)
        .chain(examples.iter().map(|e| &e.rejected_ids))
        .collect();
    let longest = rows.iter().map(|r| r.len()).max().unwrap_or(0);
    let seq = super::batch::round_to_multiple(longest, pad_to_multiple_of);
    let lengths = rows.iter().map(|r| r.len()).collect();
    let ids = rows
        .into_iter()
        .map(|r| {
            let mut r = r.clone();
            r.resize(seq, pad_id);
            r
        })
        .collect();
    (ids, lengths)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pairs_batch_chosen_rows_first_right_padded() {
        let a = RewardExample {
            chosen_ids: vec![1, 2, 3],
            rejected_ids: vec![1, 4],
            margin: 0.5,
        };
        let b = RewardExample {
            chosen_ids: vec![5],
            rejected_ids: vec![6, 7, 8, 9],
            margin: 0.0,
        };
        let (ids, lengths) = collate_rewards(&[&a, &b], 0, None);
        assert_eq!(
            ids,
            vec![
                vec![1, 2, 3, 0],
                vec![5, 0, 0, 0],
                vec![1, 4, 0, 0],
                vec![6, 7, 8, 9]
            ]
        );
        assert_eq!(lengths, vec![3, 1, 2, 4]);
        let (ids, _) = collate_rewards(&[&a], 0, Some(4));
        assert_eq!(ids, vec![vec![1, 2, 3, 0], vec![1, 4, 0, 0]]);
    }
}
