//! TRL's `{% generation %}` blocks: the tags rewritten into markers a template renders around the
//! assistant's text, and the rendered text split at them into the spans the loss is computed on.

use std::fmt::Write as _;

use super::*;

/// Opens a `{% generation %}` span in the rendered text before it is taken apart.
pub(crate) const GEN_OPEN: char = '\u{E000}';

/// Closes a `{% generation %}` span.
pub(crate) const GEN_CLOSE: char = '\u{E001}';

/// The filter a `{% generation %}` tag is rewritten into.
pub(crate) const GEN_FILTER: &str = "__kiln_generation";

/// Rewrites `{% generation %}` / `{% endgeneration %}` (any `-`/`+` whitespace control, any
/// spacing, line breaks kept so error lines stay right) into a filter block; returns the new
/// source and how many opening and closing tags were rewritten.
pub(crate) fn rewrite_generation_tags(source: &str) -> (String, usize, usize) {
    let bytes = source.as_bytes();
    let mut out = String::with_capacity(source.len() + 64);
    let (mut opens, mut closes) = (0, 0);
    let mut copied = 0;
    let mut i = 0;
    while let Some(off) = source[i..].find("{%") {
        let start = i + off;
        i = start + 2;
        let mut j = i;
        let ctl_open = match bytes.get(j) {
            Some(b'-') | Some(b'+') => {
                j += 1;
                &source[j - 1..j]
            }
            _ => "",
        };
        let ws1_start = j;
        while j < bytes.len() && bytes[j].is_ascii_whitespace() {
            j += 1;
        }
        let ws1 = &source[ws1_start..j];
        let word_start = j;
        while j < bytes.len() && (bytes[j].is_ascii_alphanumeric() || bytes[j] == b'_') {
            j += 1;
        }
        let opening = match &source[word_start..j] {
            "generation" => true,
            "endgeneration" => false,
            _ => continue,
        };
        let replacement = if opening {
            format!("filter {GEN_FILTER}")
        } else {
            "endfilter".to_string()
        };
        let ws2_start = j;
        while j < bytes.len() && bytes[j].is_ascii_whitespace() {
            j += 1;
        }
        let ws2 = &source[ws2_start..j];
        let ctl_close = match bytes.get(j) {
            Some(b'-') | Some(b'+') => {
                j += 1;
                &source[j - 1..j]
            }
            _ => "",
        };
        if !source[j..].starts_with("%}") {
            continue;
        }
        j += 2;
        out.push_str(&source[copied..start]);
        let _ = write!(out, "{{%{ctl_open}{ws1}{replacement}{ws2}{ctl_close}%}}");
        copied = j;
        i = j;
        if opening {
            opens += 1;
        } else {
            closes += 1;
        }
    }
    out.push_str(&source[copied..]);
    (out, opens, closes)
}

/// Takes the generation markers out of `raw`, returning the text and the spans they enclosed.
pub(crate) fn split_generation_spans(raw: &str) -> Result<Rendered, ChatTemplateError> {
    if !raw.contains([GEN_OPEN, GEN_CLOSE]) {
        return Ok(Rendered {
            text: raw.to_string(),
            generation_spans: Vec::new(),
        });
    }
    let mut text = String::with_capacity(raw.len());
    let mut open = Vec::new();
    let mut spans = Vec::new();
    for c in raw.chars() {
        match c {
            GEN_OPEN => open.push(text.len()),
            GEN_CLOSE => match open.pop() {
                Some(start) => spans.push(start..text.len()),
                None => return Err(unbalanced()),
            },
            c => text.push(c),
        }
    }
    if !open.is_empty() {
        return Err(unbalanced());
    }
    Ok(Rendered {
        text,
        generation_spans: spans,
    })
}

pub(crate) fn unbalanced() -> ChatTemplateError {
    ChatTemplateError::Render {
        line: None,
        message: "the template's output holds U+E000 / U+E001 characters of its own (they mark \
                  {% generation %} blocks), so its generation spans cannot be told apart"
            .into(),
    }
}
