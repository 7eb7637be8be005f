//! Tokenization through Hugging Face's `tokenizers` crate, reading the model's own `tokenizer.json`.

use std::path::Path;

use tokenizers::{Tokenizer, TruncationDirection, TruncationParams, TruncationStrategy};

use crate::error::{KilnError, Result};

/// The largest text kiln renders or tokenizes in one piece by default: 16 MiB, over 30 times a
/// 128K-token context, far below what makes the tokenizer's regex engine abort (gigabytes).
pub const DEFAULT_MAX_TEXT_BYTES: usize = 16 << 20;

/// The environment variable that raises (or lowers) [`DEFAULT_MAX_TEXT_BYTES`].
pub const MAX_TEXT_BYTES_VAR: &str = "KILN_MAX_TEXT_BYTES";

/// The largest text one chat-template render may produce and one tokenizer call may take, in
/// bytes: `KILN_MAX_TEXT_BYTES` where set to a number, else [`DEFAULT_MAX_TEXT_BYTES`].
pub fn max_text_bytes() -> usize {
    std::env::var(MAX_TEXT_BYTES_VAR)
        .ok()
        .and_then(|v| v.trim().parse().ok())
        .unwrap_or(DEFAULT_MAX_TEXT_BYTES)
}

/// An error unless `text` (what `what` names: "the prompt", "a conversation") fits under
/// [`max_text_bytes`], checked before it reaches the tokenizer.
pub fn check_text_size(text: &str, what: &str) -> Result<()> {
    let cap = max_text_bytes();
    if text.len() > cap {
        return Err(KilnError::Data(too_long(what, text.len(), cap)));
    }
    Ok(())
}

/// The sentence of a text over the cap (shared by the template renderer).
pub fn too_long(what: &str, bytes: usize, cap: usize) -> String {
    format!(
        "{what} is {bytes} bytes, over the {cap}-byte cap on text kiln tokenizes in one piece; \
         set {MAX_TEXT_BYTES_VAR}=N to raise it"
    )
}

/// The largest id `tok` can produce (its vocabulary and added tokens).
pub fn max_token_id(tok: &Tokenizer) -> Option<u32> {
    tok.get_vocab(true).into_values().max()
}

/// An error unless every id `tok` (read from `tok_path`) can produce is below `vocab_size`, the
/// rows of the model's embedding: checked once per tokenizer, so no batch can index past it.
pub fn check_ids_fit(tok: &Tokenizer, tok_path: &Path, vocab_size: usize) -> Result<()> {
    match max_token_id(tok) {
        Some(max) if max as usize >= vocab_size => Err(KilnError::Config(format!(
            "{}: the tokenizer produces token ids up to {max}, but the model's vocab_size is \
             {vocab_size} (config.json): this tokenizer does not belong to this model",
            tok_path.display()
        ))),
        _ => Ok(()),
    }
}

/// One tokenized example (no padding: batches pad dynamically).
#[derive(Debug, Clone, PartialEq)]
pub struct Encoded {
    pub input_ids: Vec<u32>,
    pub token_type_ids: Vec<u32>,
}

/// A tokenizer that truncates to `max_length` and never pads (padding is the batcher's job).
pub struct TextTokenizer {
    inner: Tokenizer,
    pub max_length: usize,
    pub pad_id: u32,
}

impl TextTokenizer {
    /// Loads `tokenizer.json`, overriding any padding or truncation baked into the file
    /// (all-MiniLM-L6-v2's forces both to 128).
    pub fn from_file(path: &Path, max_length: usize) -> Result<Self> {
        if max_length == 0 {
            return Err(KilnError::Config(
                "--max-length must be at least 1 (0 would mean no truncation at all)".into(),
            ));
        }
        crate::io::files::ensure_regular(path, "tokenizer")?;
        let mut inner = Tokenizer::from_file(path).map_err(|e| {
            KilnError::Config(format!("{}: cannot load tokenizer: {e}", path.display()))
        })?;
        let pad_id = inner
            .get_padding()
            .map(|p| p.pad_id)
            .or_else(|| inner.token_to_id("[PAD]"))
            .or_else(|| inner.token_to_id("<pad>"))
            .unwrap_or(0);
        inner.with_padding(None);
        inner
            .with_truncation(Some(TruncationParams {
                max_length,
                strategy: TruncationStrategy::LongestFirst,
                stride: 0,
                direction: TruncationDirection::Right,
            }))
            .map_err(|e| KilnError::Config(format!("{}: {e}", path.display())))?;
        Ok(Self {
            inner,
            max_length,
            pad_id,
        })
    }

    /// Encodes a batch of texts (or text pairs) with special tokens, in parallel.
    pub fn encode(&self, texts: &[(String, Option<String>)]) -> Result<Vec<Encoded>> {
        for (a, b) in texts {
            check_text_size(a, "a text")?;
            if let Some(b) = b {
                check_text_size(b, "a text")?;
            }
        }
        let inputs: Vec<tokenizers::EncodeInput> = texts
            .iter()
            .map(|(a, b)| match b {
                Some(b) => (a.as_str(), b.as_str()).into(),
                None => a.as_str().into(),
            })
            .collect();
        let encodings = self
            .inner
            .encode_batch(inputs, true)
            .map_err(|e| KilnError::Data(format!("tokenization failed: {e}")))?;
        Ok(encodings
            .into_iter()
            .map(|e| Encoded {
                input_ids: e.get_ids().to_vec(),
                token_type_ids: e.get_type_ids().to_vec(),
            })
            .collect())
    }

    /// The largest id the tokenizer can produce (its vocabulary and added tokens).
    pub fn max_id(&self) -> Option<u32> {
        max_token_id(&self.inner)
    }

    /// The tokenizer file as loaded (padding/truncation overrides are not saved into it).
    pub fn inner(&self) -> &Tokenizer {
        &self.inner
    }
}
