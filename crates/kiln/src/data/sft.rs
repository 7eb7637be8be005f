//! Supervised fine-tuning data, prepared row by row as TRL's `SFTTrainer` prepares it (trl 1.16,
//! `SFTTrainer._prepare_dataset`), and batched as its `DataCollatorForLanguageModeling` batches it.
//!
//! Row formats (TRL's names), decided per row in TRL's order:
//! - prompt-completion: `"prompt"` and `"completion"`, two strings, or two lists of messages
//!   (conversational);
//! - conversational language modeling: `"messages"`, a list of `{role, content}` (or
//!   `"conversations"` of `{from, value}`, which TRL converts to `messages`);
//! - language modeling: the text in `dataset_text_field` (default `"text"`).
//!
//! Tokenization:
//! - plain text gets the EOS token string appended (unless it already ends with it) and is
//!   tokenized with the tokenizer's special tokens (`tokenizer(text)`); a plain prompt-completion is
//!   tokenized as the prompt and as prompt + completion + EOS the same way;
//! - conversations are rendered with the chat template and tokenized without special tokens
//!   (`apply_chat_template`); a conversational prompt is rendered with the generation prompt, the
//!   full conversation (prompt + completion) without it;
//! - the completion starts where the tokenized prompt and prompt + completion first differ (TRL's
//!   `common_prefix_length`);
//! - with `assistant_only_loss`, the tokens overlapping the template's `{% generation %}` blocks
//!   (a template without them: each assistant turn, found by rendering turn by turn)
//!   are the assistant mask (transformers' `return_assistant_tokens_mask`).
//!
//! Labels ([`build_labels`]): a token is a target (its id) unless a mask that applies zeroes it
//! (then -100); the completion mask applies with `completion_only_loss` (default: for
//! prompt-completion rows), the assistant mask whenever present. Then the row is cut to its first
//! `max_length` tokens (TRL's `keep_start`), and a row left with no target is refused
//! ([`SftError::NoTarget`]; TRL drops it from the dataset). Without `max_length` nothing is cut or
//! refused, as in TRL.

use std::borrow::Borrow;
use std::ops::Range;

use serde_json::{Map, Value as Json};
use tokenizers::Tokenizer;

use super::chat_template::{ChatTemplate, ChatTemplateError, Message, RenderOptions};
/// The label of a token that is not a target: the loss's own constant, so the two cannot drift.
pub use crate::contract::IGNORE_INDEX;
use crate::error::json_kind;

/// The roles a message may have.
pub const ROLES: [&str; 7] = [
    "system",
    "developer",
    "user",
    "assistant",
    "tool",
    "ipython",
    "function",
];

/// TRL's dataset formats.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SftFormat {
    /// Language modeling on plain text.
    Text,
    /// A prompt string and a completion string.
    PromptCompletion,
    /// Language modeling on a conversation (`messages`).
    Messages,
    /// A prompt conversation and a completion conversation.
    ConversationalPromptCompletion,
}

impl SftFormat {
    /// Whether rows of this format are rendered with the chat template.
    pub fn is_conversational(self) -> bool {
        matches!(
            self,
            SftFormat::Messages | SftFormat::ConversationalPromptCompletion
        )
    }

    /// Whether rows of this format have a completion mask.
    pub fn is_prompt_completion(self) -> bool {
        matches!(
            self,
            SftFormat::PromptCompletion | SftFormat::ConversationalPromptCompletion
        )
    }
}

/// TRL's `SFTConfig` fields that shape one row.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SftOptions {
    /// The column of plain-text rows (`dataset_text_field`, default `"text"`).
    pub dataset_text_field: String,
    /// Train on the completion only; `None` (default): yes for prompt-completion rows.
    pub completion_only_loss: Option<bool>,
    /// Train on the assistant's turns only (conversational rows): the template's
    /// `{% generation %}` spans, or each turn found by rendering turn by turn where it has none.
    pub assistant_only_loss: bool,
    /// Keep the first `max_length` tokens (default 1024); `None`: no truncation.
    pub max_length: Option<usize>,
    /// The EOS token string appended to plain text and completions (`SFTConfig.eos_token`, else the
    /// tokenizer's `eos_token`); plain rows need it.
    pub eos_token: Option<String>,
}

impl Default for SftOptions {
    fn default() -> Self {
        SftOptions {
            dataset_text_field: "text".into(),
            completion_only_loss: None,
            assistant_only_loss: false,
            max_length: Some(1024),
            eos_token: None,
        }
    }
}

/// One tokenized row, before labels.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SftExample {
    pub format: SftFormat,
    pub input_ids: Vec<u32>,
    /// 1 for the completion's tokens (prompt-completion rows).
    pub completion_mask: Option<Vec<u8>>,
    /// 1 for tokens of the assistant's turns (with `assistant_only_loss`).
    pub assistant_mask: Option<Vec<u8>>,
}

/// A row ready to batch: its tokens and their labels (`IGNORE_INDEX` where not a target).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LabelledExample {
    pub input_ids: Vec<u32>,
    pub labels: Vec<i64>,
}

impl LabelledExample {
    /// The example as a person checks a template's masks: its text in runs of tokens, each run
    /// on a line of its own, `+` where the tokens are trained on (a target) and `·` where they are
    /// not, the text quoted with newlines and other controls escaped.
    pub fn show_masks(&self, tok: &Tokenizer) -> Result<String, SftError> {
        let trained: Vec<bool> = self.labels.iter().map(|&l| l != IGNORE_INDEX).collect();
        let mut out = String::new();
        let mut start = 0;
        while start < self.input_ids.len() {
            let on = trained[start];
            let end = (start..self.input_ids.len())
                .find(|&i| trained[i] != on)
                .unwrap_or(self.input_ids.len());
            let text = tok
                .decode(&self.input_ids[start..end], false)
                .map_err(|e| SftError::Tokenizer(e.to_string()))?;
            let mark = if on { '+' } else { '·' };
            out.push_str(&format!("  {mark} {:>4} tokens {text:?}\n", end - start));
            start = end;
        }
        Ok(out)
    }
}

/// Why a row cannot be prepared (one sentence each).
#[derive(Debug, thiserror::Error)]
pub enum SftError {
    /// The row is malformed; the message names the field.
    #[error("{0}")]
    Row(String),
    /// The options cannot apply to this row or model.
    #[error("{0}")]
    Config(String),
    #[error(transparent)]
    Template(#[from] ChatTemplateError),
    #[error("cannot tokenize the row: {0}")]
    Tokenizer(String),
    /// `assistant_only_loss` found no token of an assistant turn.
    #[error(
        "assistant_only_loss is set but no token of the row lies in an assistant turn (the \
         chat template's {{% generation %}} blocks, or its assistant messages)"
    )]
    NoAssistantTokens,
    /// Truncation left no target token (TRL drops such rows silently).
    #[error("no token of the row is trained on after truncation to max_length={max_length}")]
    NoTarget { max_length: usize },
}

/// The format of `row`, decided as TRL decides it (`prompt` first, then `messages`, then the text
/// field).
pub fn detect_format(
    row: &Map<String, Json>,
    dataset_text_field: &str,
) -> Result<SftFormat, SftError> {
    if let Some(prompt) = row.get("prompt") {
        let Some(completion) = row.get("completion") else {
            return Err(SftError::Row(
                "the row has a \"prompt\" but no \"completion\" field".into(),
            ));
        };
        return match (prompt, completion) {
            (Json::String(_), Json::String(_)) => Ok(SftFormat::PromptCompletion),
            (Json::Array(_), Json::Array(_)) => Ok(SftFormat::ConversationalPromptCompletion),
            _ => Err(SftError::Row(format!(
                "\"prompt\" and \"completion\" must both be strings or both lists of messages, \
                 not {} and {}",
                json_kind(prompt),
                json_kind(completion)
            ))),
        };
    }
    if row.contains_key("messages") || is_from_value(row.get("conversations")) {
        return Ok(SftFormat::Messages);
    }
    match row.get(dataset_text_field) {
        Some(Json::String(_)) => Ok(SftFormat::Text),
        Some(other) => Err(SftError::Row(format!(
            "\"{dataset_text_field}\" must be a string, not {}",
            json_kind(other)
        ))),
        None => Err(SftError::Row(format!(
            "the row has none of the fields \"{dataset_text_field}\", \"prompt\" + \
             \"completion\", \"messages\" or \"conversations\""
        ))),
    }
}

/// Tokenizes one row as TRL does (see the module docs); `template` is needed for conversational
/// rows.
pub fn prepare_row(
    row: &Map<String, Json>,
    tokenizer: &Tokenizer,
    template: Option<&ChatTemplate>,
    options: &SftOptions,
) -> Result<SftExample, SftError> {
    let format = detect_format(row, &options.dataset_text_field)?;
    if options.assistant_only_loss && !format.is_conversational() {
        return Err(SftError::Config(
            "assistant_only_loss needs conversational rows (\"messages\", or \"prompt\" and \
             \"completion\" as lists of messages), but this row is plain text"
                .into(),
        ));
    }
    match format {
        SftFormat::Text => {
            let eos = eos_token(options)?;
            let text = row[&options.dataset_text_field]
                .as_str()
                .unwrap_or_default();
            let text = with_eos(text, eos);
            Ok(SftExample {
                format,
                input_ids: encode(tokenizer, &text, true)?,
                completion_mask: None,
                assistant_mask: None,
            })
        }
        SftFormat::PromptCompletion => {
            let eos = eos_token(options)?;
            let prompt = row["prompt"].as_str().unwrap_or_default();
            let completion = row["completion"].as_str().unwrap_or_default();
            if completion.is_empty() {
                return Err(SftError::Row("\"completion\" is empty".into()));
            }
            // TRL's add_eos appends to the text field when the row has one that lacks EOS, and
            // to the completion otherwise.
            let text_field_takes_eos = match row.get(&options.dataset_text_field) {
                Some(Json::String(t)) => !t.ends_with(eos),
                Some(_) => true,
                None => false,
            };
            let completion = if text_field_takes_eos {
                completion.to_string()
            } else {
                with_eos(completion, eos)
            };
            let prompt_ids = encode(tokenizer, prompt, true)?;
            let input_ids = encode(tokenizer, &format!("{prompt}{completion}"), true)?;
            let completion_mask = completion_mask(&prompt_ids, &input_ids);
            Ok(SftExample {
                format,
                input_ids,
                completion_mask: Some(completion_mask),
                assistant_mask: None,
            })
        }
        SftFormat::Messages | SftFormat::ConversationalPromptCompletion => {
            let template = template.ok_or_else(no_chat_template)?;
            let tools = tools(row)?;
            let variables = template_variables(row)?;
            let render = |messages: &[Message], add_generation_prompt: bool| {
                template.render_with(
                    messages,
                    &RenderOptions {
                        add_generation_prompt,
                        tools: tools.as_deref(),
                        variables,
                    },
                )
            };
            let (conversation, prompt_ids) = if format == SftFormat::Messages {
                let (field, value) = match row.get("messages") {
                    Some(m) => ("messages", m.clone()),
                    None => ("conversations", from_value_to_chatml(&row["conversations"])),
                };
                (parse_messages(field, &value)?, None)
            } else {
                let prompt = parse_messages("prompt", &from_value_to_chatml(&row["prompt"]))?;
                let completion =
                    parse_messages("completion", &from_value_to_chatml(&row["completion"]))?;
                let prompt_text = render(&prompt, true)?.text;
                let prompt_ids = encode(tokenizer, &prompt_text, false)?;
                let mut all = prompt;
                all.extend(completion);
                (all, Some(prompt_ids))
            };
            // The assistant's spans: the template's {% generation %} blocks, or for a template
            // without them, each assistant turn found by rendering turn by turn.
            let rendered = if options.assistant_only_loss && !template.has_generation_blocks() {
                template.render_assistant_turns(
                    &conversation,
                    &RenderOptions {
                        add_generation_prompt: false,
                        tools: tools.as_deref(),
                        variables,
                    },
                )?
            } else {
                render(&conversation, false)?
            };
            let encoding = tokenizer
                .encode_char_offsets(rendered.text.as_str(), false)
                .map_err(|e| SftError::Tokenizer(e.to_string()))?;
            let input_ids = encoding.get_ids().to_vec();
            let assistant_mask = if options.assistant_only_loss {
                let mask =
                    assistant_mask(encoding.get_offsets(), &rendered.generation_char_spans());
                if !mask.contains(&1) {
                    return Err(SftError::NoAssistantTokens);
                }
                Some(mask)
            } else {
                None
            };
            Ok(SftExample {
                format,
                completion_mask: prompt_ids.map(|p| completion_mask(&p, &input_ids)),
                input_ids,
                assistant_mask,
            })
        }
    }
}

/// The labels of a tokenized row (TRL's `build_labels`), then truncation to `max_length`.
pub fn build_labels(
    example: &SftExample,
    options: &SftOptions,
) -> Result<LabelledExample, SftError> {
    let completion_only = options
        .completion_only_loss
        .unwrap_or(example.format.is_prompt_completion());
    let mut masks: Vec<&[u8]> = Vec::new();
    if completion_only {
        if let Some(m) = &example.completion_mask {
            masks.push(m);
        }
    }
    if let Some(m) = &example.assistant_mask {
        masks.push(m);
    }
    let mut input_ids = example.input_ids.clone();
    let mut labels: Vec<i64> = input_ids
        .iter()
        .enumerate()
        .map(|(i, &id)| {
            if masks.iter().all(|m| m.get(i) == Some(&1)) {
                i64::from(id)
            } else {
                IGNORE_INDEX
            }
        })
        .collect();
    if let Some(max_length) = options.max_length {
        input_ids.truncate(max_length);
        labels.truncate(max_length);
        if labels.iter().all(|&l| l == IGNORE_INDEX) {
            return Err(SftError::NoTarget { max_length });
        }
    }
    Ok(LabelledExample { input_ids, labels })
}

/// [`prepare_row`] then [`build_labels`].
pub fn prepare_labelled_row(
    row: &Map<String, Json>,
    tokenizer: &Tokenizer,
    template: Option<&ChatTemplate>,
    options: &SftOptions,
) -> Result<LabelledExample, SftError> {
    build_labels(&prepare_row(row, tokenizer, template, options)?, options)
}

/// transformers' assistant mask: 1 for every token whose `(start, end)` offsets overlap a span
/// (both in characters, in order), so a span cut by truncation keeps its remaining tokens.
pub fn assistant_mask(offsets: &[(usize, usize)], spans: &[Range<usize>]) -> Vec<u8> {
    let mut mask = vec![0u8; offsets.len()];
    let mut span = 0;
    for (i, &(start, end)) in offsets.iter().enumerate() {
        while span < spans.len() && start >= spans[span].end {
            span += 1;
        }
        if span == spans.len() {
            break;
        }
        if end > spans[span].start {
            mask[i] = 1;
        }
    }
    mask
}

/// A padded batch, as TRL's `DataCollatorForLanguageModeling` returns it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SftBatch {
    /// `[batch, len]`, right-padded with the pad id; one row with `padding_free`.
    pub input_ids: Vec<Vec<u32>>,
    /// Padded with `IGNORE_INDEX`.
    pub labels: Vec<Vec<i64>>,
    /// 1 for real tokens (not with `padding_free`).
    pub attention_mask: Option<Vec<Vec<u8>>>,
    /// Position of each token in its own row, restarting at 0 for each packed row (padding:
    /// 0); only with `padding_free`.
    pub position_ids: Option<Vec<Vec<u32>>>,
}

/// Pads `examples` to the longest (rounded up to `pad_to_multiple_of`), or with `padding_free`
/// concatenates them into one row with per-row position ids, the first token of each row taken out
/// of the loss so no row learns to predict the next one.
pub fn collate<E: Borrow<LabelledExample>>(
    examples: &[E],
    pad_token_id: u32,
    padding_free: bool,
    pad_to_multiple_of: Option<usize>,
) -> SftBatch {
    let round = |n: usize| super::batch::round_to_multiple(n, pad_to_multiple_of);
    if padding_free {
        let mut ids = Vec::new();
        let mut labels = Vec::new();
        let mut positions = Vec::new();
        for e in examples.iter().map(Borrow::borrow) {
            ids.extend_from_slice(&e.input_ids);
            labels.extend_from_slice(&e.labels);
            positions.extend(0..e.input_ids.len() as u32);
        }
        let len = round(ids.len());
        ids.resize(len, pad_token_id);
        labels.resize(len, IGNORE_INDEX);
        positions.resize(len, 0);
        for (l, &p) in labels.iter_mut().zip(&positions) {
            if p == 0 {
                *l = IGNORE_INDEX;
            }
        }
        return SftBatch {
            input_ids: vec![ids],
            labels: vec![labels],
            attention_mask: None,
            position_ids: Some(vec![positions]),
        };
    }
    let len = round(
        examples
            .iter()
            .map(|e| e.borrow().input_ids.len())
            .max()
            .unwrap_or(0),
    );
    let mut batch = SftBatch {
        input_ids: Vec::with_capacity(examples.len()),
        labels: Vec::with_capacity(examples.len()),
        attention_mask: Some(Vec::with_capacity(examples.len())),
        position_ids: None,
    };
    for e in examples.iter().map(Borrow::borrow) {
        let n = e.input_ids.len();
        let mut ids = e.input_ids.clone();
        ids.resize(len, pad_token_id);
        let mut labels = e.labels.clone();
        labels.resize(len, IGNORE_INDEX);
        let mut mask = vec![1u8; n];
        mask.resize(len, 0);
        batch.input_ids.push(ids);
        batch.labels.push(labels);
        if let Some(m) = batch.attention_mask.as_mut() {
            m.push(mask);
        }
    }
    batch
}

fn eos_token(options: &SftOptions) -> Result<&str, SftError> {
    options.eos_token.as_deref().ok_or_else(|| {
        SftError::Config(
            "plain-text rows need the EOS token to append, and the tokenizer has no eos_token"
                .into(),
        )
    })
}

/// A conversation's row for a model without a chat template (every row alike: it stops the run).
pub(crate) fn no_chat_template() -> SftError {
    SftError::Config(
        "the row is a conversation but the model has no chat template \
         (tokenizer_config.json \"chat_template\" or chat_template.jinja)"
            .into(),
    )
}

pub(crate) fn with_eos(text: &str, eos: &str) -> String {
    if text.ends_with(eos) {
        text.to_string()
    } else {
        format!("{text}{eos}")
    }
}

pub(crate) fn encode(
    tokenizer: &Tokenizer,
    text: &str,
    add_special_tokens: bool,
) -> Result<Vec<u32>, SftError> {
    let cap = crate::data::tokenize::max_text_bytes();
    if text.len() > cap {
        return Err(SftError::Tokenizer(crate::data::tokenize::too_long(
            "the example's text",
            text.len(),
            cap,
        )));
    }
    tokenizer
        .encode(text, add_special_tokens)
        .map(|e| e.get_ids().to_vec())
        .map_err(|e| SftError::Tokenizer(e.to_string()))
}

/// How many tokens `a` and `b` share at their start (TRL's `common_prefix_length`).
pub(crate) fn common_prefix(a: &[u32], b: &[u32]) -> usize {
    a.iter().zip(b).take_while(|(x, y)| x == y).count()
}

/// 0 for the tokens `prompt_ids` and `input_ids` share at their start, 1 after.
fn completion_mask(prompt_ids: &[u32], input_ids: &[u32]) -> Vec<u8> {
    let shared = common_prefix(prompt_ids, input_ids);
    (0..input_ids.len())
        .map(|i| u8::from(i >= shared))
        .collect()
}

/// Whether `v` is a list whose first item is a `{from, value}` message (TRL's
/// `is_conversational_from_value`).
fn is_from_value(v: Option<&Json>) -> bool {
    v.and_then(Json::as_array)
        .and_then(|a| a.first())
        .and_then(Json::as_object)
        .is_some_and(|m| m.contains_key("from") && m.contains_key("value"))
}

/// TRL's `maybe_convert_to_chatml` on one list: `from` becomes `role`, `value` becomes `content`.
pub(crate) fn from_value_to_chatml(v: &Json) -> Json {
    match v {
        Json::Array(items) => Json::Array(
            items
                .iter()
                .map(|m| match m {
                    Json::Object(o) => Json::Object(
                        o.iter()
                            .map(|(k, v)| {
                                let k = match k.as_str() {
                                    "from" => "role",
                                    "value" => "content",
                                    k => k,
                                };
                                (k.to_string(), v.clone())
                            })
                            .collect(),
                    ),
                    other => other.clone(),
                })
                .collect(),
        ),
        other => other.clone(),
    }
}

/// The messages of `field`, each checked: an object with a known role and a string, a list of
/// content parts, or no content.
pub(crate) fn parse_messages(field: &str, value: &Json) -> Result<Vec<Message>, SftError> {
    let Json::Array(items) = value else {
        return Err(SftError::Row(format!(
            "\"{field}\" must be a list of messages, not {}",
            json_kind(value)
        )));
    };
    if items.is_empty() {
        return Err(SftError::Row(format!(
            "\"{field}\" is an empty list of messages"
        )));
    }
    items
        .iter()
        .enumerate()
        .map(|(i, item)| {
            let Json::Object(obj) = item else {
                return Err(SftError::Row(format!(
                    "{field}[{i}] must be an object with \"role\" and \"content\", not {}",
                    json_kind(item)
                )));
            };
            let role = match obj.get("role") {
                Some(Json::String(r)) if ROLES.contains(&r.as_str()) => r.clone(),
                Some(Json::String(r)) => {
                    return Err(SftError::Row(format!(
                        "{field}[{i}].role: unknown role \"{r}\" (expected one of {})",
                        ROLES.join(", ")
                    )))
                }
                Some(other) => {
                    return Err(SftError::Row(format!(
                        "{field}[{i}].role must be a string, not {}",
                        json_kind(other)
                    )))
                }
                None => {
                    return Err(SftError::Row(format!("{field}[{i}] has no \"role\"")));
                }
            };
            let content = obj.get("content").cloned().unwrap_or(Json::Null);
            if !matches!(content, Json::String(_) | Json::Array(_) | Json::Null) {
                return Err(SftError::Row(format!(
                    "{field}[{i}].content must be a string or a list of content parts, not {}",
                    json_kind(&content)
                )));
            }
            let extra = obj
                .iter()
                .filter(|(k, _)| *k != "role" && *k != "content")
                .map(|(k, v)| (k.clone(), v.clone()))
                .collect();
            Ok(Message {
                role,
                content,
                extra,
            })
        })
        .collect()
}

/// The row's `"chat_template_kwargs"`: more template variables, or none.
pub(crate) fn template_variables(
    row: &Map<String, Json>,
) -> Result<Option<&Map<String, Json>>, SftError> {
    match row.get("chat_template_kwargs") {
        None | Some(Json::Null) => Ok(None),
        Some(Json::Object(o)) => Ok(Some(o)),
        Some(other) => Err(SftError::Row(format!(
            "\"chat_template_kwargs\" must be an object, not {}",
            json_kind(other)
        ))),
    }
}

/// The row's `"tools"`: a list of JSON schemas, or that list as a JSON string.
pub(crate) fn tools(row: &Map<String, Json>) -> Result<Option<Vec<Json>>, SftError> {
    match row.get("tools") {
        None | Some(Json::Null) => Ok(None),
        Some(Json::Array(a)) => Ok(Some(a.clone())),
        Some(Json::String(s)) => match serde_json::from_str(s) {
            Ok(Json::Array(a)) => Ok(Some(a)),
            Ok(Json::Null) => Ok(None),
            _ => Err(SftError::Row(
                "\"tools\" is a string but not a JSON list of tool schemas".into(),
            )),
        },
        Some(other) => Err(SftError::Row(format!(
            "\"tools\" must be a list of tool schemas, not {}",
            json_kind(other)
        ))),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::path::Path;

    const SMOLLM2_GGUF: &str = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../../assets/smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
    );

    /// SmolLM2's tokenizer and chat template, from the GGUF asset (scripts/fetch-assets), or `None`
    /// (the test then skips, unless KILN_REQUIRE_ASSETS says the assets must be there).
    fn smollm2() -> Option<(Tokenizer, ChatTemplate, String)> {
        let gguf = Path::new(SMOLLM2_GGUF);
        if !gguf.is_file() {
            assert!(
                std::env::var_os("KILN_REQUIRE_ASSETS").is_none(),
                "{} missing: run scripts/fetch-assets",
                gguf.display()
            );
            eprintln!("skipped: {} is absent", gguf.display());
            return None;
        }
        let dir = tempfile::tempdir().unwrap();
        crate::models::llama::gguf::tokenizer_to_hf(gguf, dir.path()).unwrap();
        let tok = Tokenizer::from_file(dir.path().join("tokenizer.json")).unwrap();
        let template = ChatTemplate::from_model_dir(dir.path()).unwrap().unwrap();
        let eos =
            super::super::chat_template::special_tokens(dir.path()).unwrap()["eos_token"].clone();
        Some((tok, template, eos))
    }

    fn row(json: &str) -> Map<String, Json> {
        serde_json::from_str(json).unwrap()
    }

    fn opts(eos: &str) -> SftOptions {
        SftOptions {
            eos_token: Some(eos.to_string()),
            ..Default::default()
        }
    }

    /// SmolLM2's default system turn, as TRL tokenizes it.
    const SYSTEM_IDS: [u32; 21] = [
        1, 9690, 198, 2683, 359, 253, 5356, 5646, 11173, 3365, 3511, 308, 34519, 28, 7018, 411,
        407, 19712, 8182, 2, 198,
    ];

    #[test]
    fn text_gets_eos_like_trl() {
        let Some((tok, _, eos)) = smollm2() else {
            return;
        };
        let o = opts(&eos);
        // trl 1.16 SFTTrainer on SmolLM2 (check.py)
        let e = prepare_labelled_row(&row(r#"{"text": "The sky is blue."}"#), &tok, None, &o);
        assert_eq!(
            e.unwrap(),
            LabelledExample {
                input_ids: vec![504, 6376, 314, 4461, 30, 2],
                labels: vec![504, 6376, 314, 4461, 30, 2],
            }
        );
        let already = prepare_row(&row(r#"{"text": "x<|im_end|>"}"#), &tok, None, &o).unwrap();
        assert_eq!(already.input_ids.iter().filter(|&&i| i == 2).count(), 1);
    }

    #[test]
    fn prompt_completion_masks_the_prompt() {
        let Some((tok, _, eos)) = smollm2() else {
            return;
        };
        let r = row(r#"{"prompt": "The sky is", "completion": " blue."}"#);
        let e = prepare_labelled_row(&r, &tok, None, &opts(&eos)).unwrap();
        assert_eq!(e.input_ids, vec![504, 6376, 314, 4461, 30, 2]);
        assert_eq!(e.labels, vec![-100, -100, -100, 4461, 30, 2]);
        let all = SftOptions {
            completion_only_loss: Some(false),
            ..opts(&eos)
        };
        let e = prepare_labelled_row(&r, &tok, None, &all).unwrap();
        assert_eq!(e.labels, vec![504, 6376, 314, 4461, 30, 2]);
    }

    #[test]
    fn conversational_prompt_completion_like_trl() {
        let Some((tok, template, eos)) = smollm2() else {
            return;
        };
        let r = row(
            r#"{"prompt": [{"role": "user", "content": "What color is the sky?"}],
                "completion": [{"role": "assistant", "content": "It is blue."}]}"#,
        );
        let e = prepare_labelled_row(&r, &tok, Some(&template), &opts(&eos)).unwrap();
        let mut want = SYSTEM_IDS.to_vec();
        want.extend([1, 4093, 198, 1780, 2380, 314, 260, 6376, 47, 2, 198]);
        let prompt_len = want.len() + 4; // "<|im_start|>assistant\n" ends the prompt
        want.extend([1, 520, 9531, 198, 1589, 314, 4461, 30, 2, 198]);
        assert_eq!(e.input_ids, want);
        for (i, (&l, &id)) in e.labels.iter().zip(&want).enumerate() {
            assert_eq!(
                l,
                if i < prompt_len { -100 } else { i64::from(id) },
                "token {i}"
            );
        }
        // max_length=8 leaves only prompt tokens: TRL drops the row
        let short = SftOptions {
            max_length: Some(8),
            ..opts(&eos)
        };
        let err = prepare_labelled_row(&r, &tok, Some(&template), &short).unwrap_err();
        assert!(matches!(err, SftError::NoTarget { max_length: 8 }), "{err}");
    }

    #[test]
    fn assistant_only_loss_uses_generation_blocks() {
        let Some((tok, _, eos)) = smollm2() else {
            return;
        };
        let template = ChatTemplate::new(
            "{% for m in messages %}{{ '<|im_start|>' + m.role + '\n' }}{% if m.role == 'assistant' %}{% generation %}{{ m.content + '<|im_end|>' }}{% endgeneration %}{% else %}{{ m.content + '<|im_end|>' }}{% endif %}{{ '\n' }}{% endfor %}",
            None,
            Some(eos.clone()),
        )
        .unwrap();
        let r = row(
            r#"{"messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello there"}]}"#,
        );
        let o = SftOptions {
            assistant_only_loss: true,
            ..opts(&eos)
        };
        // The text of the tokens a template's masks train on.
        let trained = |template: &ChatTemplate| {
            let e = prepare_labelled_row(&r, &tok, Some(template), &o).unwrap();
            let targets: Vec<u32> = e
                .labels
                .iter()
                .filter(|&&l| l != IGNORE_INDEX)
                .map(|&l| l as u32)
                .collect();
            tok.decode(&targets, false).unwrap()
        };
        assert_eq!(trained(&template), "Hello there<|im_end|>");
        // SmolLM2's own template has no generation blocks: the assistant's turn is found by
        // rendering turn by turn (its template ends a turn with "<|im_end|>\n").
        let Some((_, plain, _)) = smollm2() else {
            return;
        };
        assert!(!plain.has_generation_blocks());
        assert_eq!(trained(&plain), "Hello there<|im_end|>\n");
        // and plain text cannot be masked by role
        let err = prepare_row(&row(r#"{"text": "x"}"#), &tok, None, &o).unwrap_err();
        assert!(matches!(err, SftError::Config(_)), "{err}");
    }

    #[test]
    fn from_value_conversations_are_converted() {
        let Some((tok, template, eos)) = smollm2() else {
            return;
        };
        let r = row(
            r#"{"conversations": [{"from": "user", "value": "Hi"}, {"from": "assistant", "value": "Yo"}]}"#,
        );
        let e = prepare_labelled_row(&r, &tok, Some(&template), &opts(&eos)).unwrap();
        let mut want = SYSTEM_IDS.to_vec();
        want.extend([
            1, 4093, 198, 26843, 2, 198, 1, 520, 9531, 198, 73, 95, 2, 198,
        ]);
        assert_eq!(e.input_ids, want);
        assert_eq!(
            e.labels,
            want.iter().map(|&i| i64::from(i)).collect::<Vec<_>>()
        );
    }

    #[test]
    fn invalid_rows_name_the_field() {
        let cases = [
            (r#"{"prompt": "a"}"#, "no \"completion\""),
            (
                r#"{"prompt": "a", "completion": [{"role": "assistant", "content": "b"}]}"#,
                "both be strings",
            ),
            (r#"{"other": 1}"#, "none of the fields"),
            (r#"{"text": 3}"#, "\"text\" must be a string"),
        ];
        for (json, want) in cases {
            let err = detect_format(&row(json), "text").unwrap_err().to_string();
            assert!(err.contains(want), "{json}: {err}");
        }
        let bad = [
            (
                json_msgs(r#"[{"role": "bot", "content": "x"}]"#),
                "messages[0].role: unknown role \"bot\"",
            ),
            (
                json_msgs(r#"[{"content": "x"}]"#),
                "messages[0] has no \"role\"",
            ),
            (
                json_msgs(r#"[{"role": "user", "content": 5}]"#),
                "messages[0].content must be",
            ),
            (json_msgs(r#"[]"#), "empty list"),
            (json_msgs(r#""hi""#), "must be a list of messages"),
        ];
        for (value, want) in bad {
            let err = parse_messages("messages", &value).unwrap_err().to_string();
            assert!(err.contains(want), "{err}");
        }
        let Some((tok, template, eos)) = smollm2() else {
            return;
        };
        let empty = row(r#"{"prompt": [{"role": "user", "content": "a"}], "completion": []}"#);
        let err = prepare_row(&empty, &tok, Some(&template), &opts(&eos)).unwrap_err();
        assert!(
            err.to_string().contains("\"completion\" is an empty list"),
            "{err}"
        );
        let empty = row(r#"{"prompt": "a", "completion": ""}"#);
        let err = prepare_row(&empty, &tok, None, &opts(&eos)).unwrap_err();
        assert!(err.to_string().contains("\"completion\" is empty"), "{err}");
        let conv = row(r#"{"messages": [{"role": "user", "content": "a"}]}"#);
        let err = prepare_row(&conv, &tok, None, &opts(&eos)).unwrap_err();
        assert!(err.to_string().contains("no chat template"), "{err}");
        let err = prepare_row(&row(r#"{"text": "a"}"#), &tok, None, &SftOptions::default());
        assert!(err.unwrap_err().to_string().contains("eos_token"));
    }

    fn json_msgs(s: &str) -> Json {
        serde_json::from_str(s).unwrap()
    }

    #[test]
    fn mask_overlaps_like_transformers() {
        let offsets = [(0, 2), (2, 5), (5, 6), (6, 9), (9, 9), (9, 12)];
        assert_eq!(
            assistant_mask(&offsets, &[Range { start: 3, end: 7 }]),
            vec![0, 1, 1, 1, 0, 0]
        );
        assert_eq!(
            assistant_mask(&offsets, &[0..0, 9..12]),
            vec![0, 0, 0, 0, 0, 1]
        );
        assert_eq!(assistant_mask(&offsets, &[]), vec![0; 6]);
    }

    #[test]
    fn labels_and_truncation() {
        let e = SftExample {
            format: SftFormat::ConversationalPromptCompletion,
            input_ids: vec![10, 11, 12, 13],
            completion_mask: Some(vec![0, 0, 1, 1]),
            assistant_mask: Some(vec![0, 1, 1, 0]),
        };
        let o = SftOptions::default();
        assert_eq!(
            build_labels(&e, &o).unwrap().labels,
            vec![-100, -100, 12, -100]
        );
        let o = SftOptions {
            completion_only_loss: Some(false),
            max_length: Some(2),
            ..Default::default()
        };
        let l = build_labels(&e, &o).unwrap();
        assert_eq!((l.input_ids, l.labels), (vec![10, 11], vec![-100, 11]));
        let o = SftOptions {
            max_length: Some(2),
            ..Default::default()
        };
        assert!(matches!(
            build_labels(&e, &o),
            Err(SftError::NoTarget { max_length: 2 })
        ));
    }

    #[test]
    fn collate_like_trl() {
        // DataCollatorForLanguageModeling's docstring examples
        let ex = [
            LabelledExample {
                input_ids: vec![1, 2, 3],
                labels: vec![-100, 2, 3],
            },
            LabelledExample {
                input_ids: vec![4, 5],
                labels: vec![-100, 5],
            },
        ];
        let b = collate(&ex, 0, false, None);
        assert_eq!(b.input_ids, vec![vec![1, 2, 3], vec![4, 5, 0]]);
        assert_eq!(b.labels, vec![vec![-100, 2, 3], vec![-100, 5, -100]]);
        assert_eq!(b.attention_mask, Some(vec![vec![1, 1, 1], vec![1, 1, 0]]));
        assert_eq!(b.position_ids, None);
        let b = collate(&ex, 0, true, None);
        assert_eq!(b.input_ids, vec![vec![1, 2, 3, 4, 5]]);
        assert_eq!(b.labels, vec![vec![-100, 2, 3, -100, 5]]);
        assert_eq!(b.position_ids, Some(vec![vec![0, 1, 2, 0, 1]]));
        assert_eq!(b.attention_mask, None);
        let b = collate(&ex, 9, false, Some(4));
        assert_eq!(b.input_ids, vec![vec![1, 2, 3, 9], vec![4, 5, 9, 9]]);
    }
}
