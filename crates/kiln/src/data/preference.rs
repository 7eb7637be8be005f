//! Preference data (DPO, ORPO), prepared row by row as TRL's `DPOTrainer` prepares it (trl 1.16,
//! `DPOTrainer._prepare_dataset`), and batched as its `DataCollatorForPreference` batches it.
//!
//! Rows: `"prompt"`, `"chosen"` and `"rejected"`, three strings (standard) or three lists of
//! messages (conversational); without `"prompt"` the prompt is implicit, the longest start
//! `"chosen"` and `"rejected"` share (TRL's `extract_prompt`: characters of strings, where a space
//! just before the first difference goes with the completions; whole messages of conversations).
//!
//! Tokenization: standard completions get the EOS token string appended (unless they end with
//! it) and the prompt, prompt + chosen and prompt + rejected are tokenized with the tokenizer's
//! special tokens; conversations are rendered with the chat template (the prompt alone with the
//! generation prompt, prompt + completion without) and tokenized without special tokens. The
//! completions start where the tokenized prompt and either prompt + completion first differ
//! (`common_prefix_length`, the shorter of the two).
//!
//! What TRL keeps silently and kiln counts as skipped (or refuses under `--strict`): a row whose
//! prompt is empty, whose chosen and rejected completions are the same, or whose prompt alone
//! fills `max_length` (TRL drops those rows with `keep_start`).

use serde_json::{Map, Value as Json};
use tokenizers::Tokenizer;

use super::chat_template::{ChatTemplate, Message, RenderOptions};
use super::sft::{
    common_prefix, encode, from_value_to_chatml, no_chat_template, parse_messages,
    template_variables, tools, with_eos, SftError,
};
use crate::error::json_kind;

/// One preference pair, tokenized: the prompt's tokens and each completion's after them.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct PreferenceExample {
    pub prompt_ids: Vec<u32>,
    pub chosen_ids: Vec<u32>,
    pub rejected_ids: Vec<u32>,
    /// How many of the chosen and of the rejected completion's first tokens still belong to that
    /// side's prompt: ORPO tokenizes each side on its own, and a side's prompt may end on a token
    /// its answer did not merge with (0 for DPO, whose prompt is one).
    pub prompt_tail: [usize; 2],
}

/// TRL's `DPOConfig` fields that shape one row.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PreferenceOptions {
    /// Sequences (prompt + completion) keep their first `max_length` tokens (TRL's default
    /// 1024, `keep_start`); `None`: no truncation.
    pub max_length: Option<usize>,
    /// The EOS token string appended to standard completions (the tokenizer's `eos_token`).
    pub eos_token: Option<String>,
}

impl Default for PreferenceOptions {
    fn default() -> Self {
        Self {
            max_length: Some(1024),
            eos_token: None,
        }
    }
}

/// A row's three parts, whichever way it gave its prompt.
enum Parts {
    Standard {
        prompt: String,
        chosen: String,
        rejected: String,
    },
    Conversational {
        prompt: Json,
        chosen: Json,
        rejected: Json,
    },
}

/// Tokenizes one preference row as TRL does (see the module docs); `template` is needed for
/// conversational rows.
pub fn prepare_preference_row(
    row: &Map<String, Json>,
    tokenizer: &Tokenizer,
    template: Option<&ChatTemplate>,
    options: &PreferenceOptions,
) -> Result<PreferenceExample, SftError> {
    let (prompt_ids, chosen_full, rejected_full) = match parts(row)? {
        Parts::Standard {
            prompt,
            chosen,
            rejected,
        } => {
            let eos = options.eos_token.as_deref().ok_or_else(|| {
                SftError::Config(
                    "standard preference rows need the EOS token to append to each completion, \
                     and the tokenizer has no eos_token"
                        .into(),
                )
            })?;
            let (chosen, rejected) = (with_eos(&chosen, eos), with_eos(&rejected, eos));
            (
                encode(tokenizer, &prompt, true)?,
                encode(tokenizer, &format!("{prompt}{chosen}"), true)?,
                encode(tokenizer, &format!("{prompt}{rejected}"), true)?,
            )
        }
        Parts::Conversational {
            prompt,
            chosen,
            rejected,
        } => {
            let [p, c, r] =
                render_conversation(row, template, [&prompt, &chosen, &rejected], true)?;
            (
                encode(tokenizer, &p, false)?,
                encode(tokenizer, &c, false)?,
                encode(tokenizer, &r, false)?,
            )
        }
    };
    let prompt_len =
        common_prefix(&prompt_ids, &chosen_full).min(common_prefix(&prompt_ids, &rejected_full));
    if prompt_len == 0 {
        return Err(SftError::Row(
            "the prompt has no token before the completions begin: a preference pair needs a \
             prompt to prefer one answer to"
                .into(),
        ));
    }
    if let Some(max) = options.max_length {
        if prompt_len >= max {
            return Err(SftError::Row(format!(
                "the prompt's {prompt_len} tokens fill max_length={max}: no completion token \
                 would be left"
            )));
        }
    }
    let example = PreferenceExample {
        prompt_ids: prompt_ids[..prompt_len].to_vec(),
        chosen_ids: chosen_full[prompt_len..].to_vec(),
        rejected_ids: rejected_full[prompt_len..].to_vec(),
        prompt_tail: [0, 0],
    };
    if example.chosen_ids == example.rejected_ids {
        return Err(SftError::Row(
            "\"chosen\" and \"rejected\" are the same completion: the pair prefers nothing".into(),
        ));
    }
    Ok(example)
}

/// The special tokens ORPO's preparation adds by id.
#[derive(Debug, Clone, Copy, Default)]
pub struct SpecialIds {
    /// Put before a prompt that does not start with it (TRL's `add_bos_token_if_needed`).
    pub bos: Option<u32>,
    /// Put after an answer that does not end with it (`add_eos_token_if_needed`).
    pub eos: Option<u32>,
}

/// Tokenizes one preference row as TRL's `ORPOTrainer` does (`tokenize_row`), which differs from
/// DPO's preparation: conversations are rendered to text first (the prompt with the generation
/// prompt when it ends on a user's turn, each answer as what its whole conversation adds), each
/// side is tokenized on its own without special tokens (`tok(prompt + answer)`, the answer
/// starting after `tok(prompt)`, one token earlier where the prompt's last token merged into the
/// answer), the BOS id goes before the prompt and the EOS id after each answer where missing, and
/// an answer is cut to what `max_length` leaves after its prompt.
pub fn prepare_orpo_row(
    row: &Map<String, Json>,
    tokenizer: &Tokenizer,
    template: Option<&ChatTemplate>,
    options: &PreferenceOptions,
    special: SpecialIds,
) -> Result<PreferenceExample, SftError> {
    let (prompt, chosen, rejected) = match parts(row)? {
        Parts::Standard {
            prompt,
            chosen,
            rejected,
        } => (prompt, chosen, rejected),
        Parts::Conversational {
            prompt,
            chosen,
            rejected,
        } => {
            // TRL's ORPO renders the generation prompt only after a user's turn.
            let ends_on_user = prompt
                .as_array()
                .and_then(|m| m.last())
                .is_some_and(|m| m.get("role").and_then(Json::as_str) == Some("user"));
            let [p, c, r] =
                render_conversation(row, template, [&prompt, &chosen, &rejected], ends_on_user)?;
            // The prompt's text as both conversations render it (TRL keeps the shared start).
            let shared = |a: &str, b: &str| {
                a.char_indices()
                    .zip(b.chars())
                    .find(|((_, x), y)| x != y)
                    .map_or(a.len().min(b.len()), |((i, _), _)| i)
            };
            let cut = shared(&p, &c).min(shared(&p, &r));
            (
                p[..cut].to_string(),
                c[cut..].to_string(),
                r[cut..].to_string(),
            )
        }
    };
    if prompt.is_empty() {
        return Err(SftError::Row("\"prompt\" is empty".into()));
    }
    let prompt_ids = encode(tokenizer, &prompt, false)?;
    // One side: its prompt's tokens and its answer's, as TRL's `build_tokenized_answer` splits
    // `tok(prompt + answer)`.
    let side = |answer: &str| -> Result<(Vec<u32>, Vec<u32>), SftError> {
        let full = encode(tokenizer, &format!("{prompt}{answer}"), false)?;
        let mut start = prompt_ids.len().min(full.len());
        if full[..start] != prompt_ids[..] {
            start = start.saturating_sub(1);
        }
        Ok((full[..start].to_vec(), full[start..].to_vec()))
    };
    let (mut chosen_prompt, mut chosen_answer) = side(&chosen)?;
    let (mut rejected_prompt, mut rejected_answer) = side(&rejected)?;
    let differing = chosen_prompt
        .iter()
        .zip(&rejected_prompt)
        .filter(|(a, b)| a != b)
        .count();
    if differing > 1 || chosen_prompt.len().abs_diff(rejected_prompt.len()) > 1 {
        return Err(SftError::Row(
            "the prompt tokenizes differently before \"chosen\" and before \"rejected\" by more \
             than the one token a merge with the answer can change"
                .into(),
        ));
    }
    if let Some(bos) = special.bos {
        if chosen_prompt.first() != Some(&bos) {
            chosen_prompt.insert(0, bos);
            rejected_prompt.insert(0, bos);
        }
    }
    if let Some(eos) = special.eos {
        for answer in [&mut chosen_answer, &mut rejected_answer] {
            if answer.last() != Some(&eos) {
                answer.push(eos);
            }
        }
    }
    if let Some(max) = options.max_length {
        for (prompt, answer) in [
            (&chosen_prompt, &mut chosen_answer),
            (&rejected_prompt, &mut rejected_answer),
        ] {
            answer.truncate(max.saturating_sub(prompt.len()));
        }
        if chosen_answer.is_empty() || rejected_answer.is_empty() {
            return Err(SftError::Row(format!(
                "the prompt's {} tokens fill max_length={max}: no answer token would be left",
                chosen_prompt.len().min(rejected_prompt.len())
            )));
        }
    }
    if chosen_prompt == rejected_prompt && chosen_answer == rejected_answer {
        return Err(SftError::Row(
            "\"chosen\" and \"rejected\" are the same completion: the pair prefers nothing".into(),
        ));
    }
    // The shared prompt, and each side's tokens after it (its own prompt's last token, where it
    // differs, among them but not scored).
    let shared = common_prefix(&chosen_prompt, &rejected_prompt);
    let rest = |prompt: &[u32], answer: Vec<u32>| -> Vec<u32> {
        prompt[shared..].iter().copied().chain(answer).collect()
    };
    Ok(PreferenceExample {
        prompt_ids: chosen_prompt[..shared].to_vec(),
        prompt_tail: [chosen_prompt.len() - shared, rejected_prompt.len() - shared],
        chosen_ids: rest(&chosen_prompt, chosen_answer),
        rejected_ids: rest(&rejected_prompt, rejected_answer),
    })
}

/// A conversational row's texts with the chat template: the prompt alone (with the generation
/// prompt if `add_generation_prompt`), and the prompt followed by each answer.
fn render_conversation(
    row: &Map<String, Json>,
    template: Option<&ChatTemplate>,
    [prompt, chosen, rejected]: [&Json; 3],
    add_generation_prompt: bool,
) -> Result<[String; 3], SftError> {
    let template = template.ok_or_else(no_chat_template)?;
    let tools = tools(row)?;
    let variables = template_variables(row)?;
    let prompt = parse_messages("prompt", prompt)?;
    let render = |messages: &[Message], add_generation_prompt: bool| -> Result<String, SftError> {
        let options = RenderOptions {
            add_generation_prompt,
            tools: tools.as_deref(),
            variables,
        };
        Ok(template.render_with(messages, &options)?.text)
    };
    let whole = |field: &str, answer: &Json| -> Result<String, SftError> {
        let mut all = prompt.clone();
        all.extend(parse_messages(field, answer)?);
        render(&all, false)
    };
    Ok([
        render(&prompt, add_generation_prompt)?,
        whole("chosen", chosen)?,
        whole("rejected", rejected)?,
    ])
}

/// The row's prompt, chosen and rejected parts, the prompt extracted where it is implicit.
fn parts(row: &Map<String, Json>) -> Result<Parts, SftError> {
    let side = |field: &str| {
        row.get(field).map(from_value_to_chatml).ok_or_else(|| {
            SftError::Row(format!(
                "the row has no \"{field}\" field (a preference row needs \"chosen\" and \
                 \"rejected\", and a \"prompt\" unless both start with it)"
            ))
        })
    };
    let (chosen, rejected) = (side("chosen")?, side("rejected")?);
    let prompt = row.get("prompt").map(from_value_to_chatml);
    match (prompt, chosen, rejected) {
        (Some(Json::String(p)), Json::String(c), Json::String(r)) => {
            if p.is_empty() {
                return Err(SftError::Row("\"prompt\" is empty".into()));
            }
            Ok(Parts::Standard {
                prompt: p,
                chosen: c,
                rejected: r,
            })
        }
        (None, Json::String(c), Json::String(r)) => {
            let at = shared_text_prefix(&c, &r);
            if at == 0 {
                return Err(SftError::Row(
                    "\"chosen\" and \"rejected\" share no start, and the row has no \"prompt\""
                        .into(),
                ));
            }
            Ok(Parts::Standard {
                prompt: c[..at].to_string(),
                chosen: c[at..].to_string(),
                rejected: r[at..].to_string(),
            })
        }
        (Some(p @ Json::Array(_)), c @ Json::Array(_), r @ Json::Array(_)) => {
            Ok(Parts::Conversational {
                prompt: p,
                chosen: c,
                rejected: r,
            })
        }
        (None, Json::Array(c), Json::Array(r)) => {
            let at = shared_message_prefix(&c, &r);
            if at == 0 {
                return Err(SftError::Row(
                    "\"chosen\" and \"rejected\" share no first message, and the row has no \
                     \"prompt\""
                        .into(),
                ));
            }
            Ok(Parts::Conversational {
                prompt: Json::Array(c[..at].to_vec()),
                chosen: Json::Array(c[at..].to_vec()),
                rejected: Json::Array(r[at..].to_vec()),
            })
        }
        (prompt, c, r) => Err(SftError::Row(format!(
            "{}\"chosen\" and \"rejected\" must all be strings or all lists of messages, not \
             {}{} and {}",
            if prompt.is_some() { "\"prompt\", " } else { "" },
            prompt
                .as_ref()
                .map_or(String::new(), |p| format!("{}, ", json_kind(p))),
            json_kind(&c),
            json_kind(&r)
        ))),
    }
}

/// Where TRL's `extract_prompt` cuts two strings: at their first differing character, one earlier
/// when the character before it is a space (the space goes with the completions). Where one
/// string starts the other, TRL's loop ends on the shorter one's last character, and so does
/// this. In bytes, on a character boundary.
fn shared_text_prefix(a: &str, b: &str) -> usize {
    let pairs: Vec<((usize, char), char)> = a.char_indices().zip(b.chars()).collect();
    let Some(last) = pairs.len().checked_sub(1) else {
        return 0;
    };
    let at = match pairs.iter().position(|((_, x), y)| x != y) {
        Some(at) if at > 0 && pairs[at - 1].0 .1 == ' ' => at - 1,
        Some(at) => at,
        None => last,
    };
    pairs.get(at).map_or(a.len(), |((byte, _), _)| *byte)
}

/// How many whole messages two conversations share at their start (TRL's `extract_prompt` on
/// lists; where one starts the other, one fewer than the shorter's length, as TRL's loop ends).
fn shared_message_prefix(a: &[Json], b: &[Json]) -> usize {
    let n = a.len().min(b.len());
    a.iter()
        .zip(b)
        .position(|(x, y)| x != y)
        .unwrap_or(n.saturating_sub(1))
}

/// A batch of preference pairs as TRL's `DataCollatorForPreference` lays it out: every pair's
/// prompt + chosen, then every pair's prompt + rejected, each cut to `max_length` (keep the start)
/// and right-padded to the longest (rounded up to `pad_to_multiple_of`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PreferenceBatch {
    /// `[2 × pairs, seq]`.
    pub input_ids: Vec<Vec<u32>>,
    /// 1 for the tokens of a completion (the chosen or rejected answer), 0 for the prompt and
    /// padding.
    pub completion_mask: Vec<Vec<u8>>,
    /// Each row's length before padding.
    pub lengths: Vec<usize>,
}

/// Collates `examples` (see [`PreferenceBatch`]), padding with `pad_id`.
pub fn collate_preferences(
    examples: &[&PreferenceExample],
    pad_id: u32,
    max_length: Option<usize>,
    pad_to_multiple_of: Option<usize>,
) -> PreferenceBatch {
    let mut rows: Vec<(Vec<u32>, Vec<u8>)> = Vec::with_capacity(2 * examples.len());
    for side in [0, 1] {
        for e in examples {
            let completion = [&e.chosen_ids, &e.rejected_ids][side];
            let prompt = e.prompt_ids.len() + e.prompt_tail[side];
            let mut ids: Vec<u32> = e.prompt_ids.iter().chain(completion).copied().collect();
            let mut mask: Vec<u8> = std::iter::repeat_n(0, prompt)
                .chain(std::iter::repeat_n(1, ids.len() - prompt))
                .collect();
            if let Some(max) = max_length {
                ids.truncate(max);
                mask.truncate(max);
            }
            rows.push((ids, mask));
        }
    }
    let longest = rows.iter().map(|(ids, _)| ids.len()).max().unwrap_or(0);
    let seq = super::batch::round_to_multiple(longest, pad_to_multiple_of);
    let mut batch = PreferenceBatch {
        input_ids: Vec::with_capacity(rows.len()),
        completion_mask: Vec::with_capacity(rows.len()),
        lengths: Vec::with_capacity(rows.len()),
    };
    for (mut ids, mut mask) in rows {
        batch.lengths.push(ids.len());
        ids.resize(seq, pad_id);
        mask.resize(seq, 0);
        batch.input_ids.push(ids);
        batch.completion_mask.push(mask);
    }
    batch
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn implicit_prompts_are_cut_where_trl_cuts_them() {
        // The space before the first difference goes with the completions.
        let s = "The sky is blue.";
        let r = "The sky is green.";
        let at = shared_text_prefix(s, r);
        assert_eq!(&s[..at], "The sky is");
        // One string starts the other: TRL's loop ends on the shorter one's last character.
        assert_eq!(shared_text_prefix("abc", "abcd"), 2);
        assert_eq!(shared_text_prefix("ab ", "ab c"), 2);
        // Multi-byte characters cut on a boundary.
        assert_eq!(
            &"héllo wörld"[..shared_text_prefix("héllo wörld", "héllo warld")],
            "héllo w"
        );
        assert_eq!(shared_text_prefix("", "x"), 0);

        let m = |role: &str, c: &str| serde_json::json!({"role": role, "content": c});
        let a = [m("user", "hi"), m("assistant", "hello")];
        let b = [m("user", "hi"), m("assistant", "go away")];
        assert_eq!(shared_message_prefix(&a, &b), 1);
        assert_eq!(shared_message_prefix(&a, &a[..1]), 0);
    }

    #[test]
    fn batches_put_every_chosen_row_before_every_rejected_row() {
        // TRL's own docstring example of DataCollatorForPreference.
        let a = PreferenceExample {
            prompt_ids: vec![1, 2, 3],
            chosen_ids: vec![4, 5],
            rejected_ids: vec![6],
            prompt_tail: [0, 0],
        };
        let b = PreferenceExample {
            prompt_ids: vec![7, 8],
            chosen_ids: vec![9],
            rejected_ids: vec![10, 11],
            prompt_tail: [0, 0],
        };
        let batch = collate_preferences(&[&a, &b], 0, None, None);
        assert_eq!(
            batch.input_ids,
            vec![
                vec![1, 2, 3, 4, 5],
                vec![7, 8, 9, 0, 0],
                vec![1, 2, 3, 6, 0],
                vec![7, 8, 10, 11, 0]
            ]
        );
        assert_eq!(
            batch.completion_mask,
            vec![
                vec![0, 0, 0, 1, 1],
                vec![0, 0, 1, 0, 0],
                vec![0, 0, 0, 1, 0],
                vec![0, 0, 1, 1, 0]
            ]
        );
        assert_eq!(batch.lengths, vec![5, 3, 4, 4]);
        // keep_start truncation to 4, padded to a multiple of 3.
        let cut = collate_preferences(&[&a, &b], 0, Some(4), Some(3));
        assert_eq!(cut.input_ids[0], vec![1, 2, 3, 4, 0, 0]);
        assert_eq!(cut.completion_mask[0], vec![0, 0, 0, 1, 0, 0]);
        assert_eq!(cut.lengths, vec![4, 3, 4, 4]);
    }
}
