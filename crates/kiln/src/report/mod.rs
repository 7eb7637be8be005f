//! Watching a run: what a training job tells the people and tools looking at it.
//!
//! - [`live`]: each rank's live state, published to the run folder for `kiln top`;
//! - [`tensorboard`]: TensorBoard event files with Hugging Face's tag names;
//! - [`history`]: a run's logged entries read back (log.jsonl or trainer_state.json);
//! - [`plot`]: loss, learning-rate and evaluation curves of one or more runs (PNG or SVG);
//! - [`model_card`]: the README.md Hugging Face's Trainer writes beside a trained model.
//!
//! The trainer calls into this module; nothing here imports the trainer.

pub mod history;
pub mod live;
pub mod model_card;
pub mod plot;
pub mod tensorboard;

/// `s` with every control character (escape sequences, NUL, line breaks) and bidirectional
/// override written as an escape (`\u{1b}`), for printing text that came from data, files or the
/// network: a label name or a host name must not drive the terminal.
pub fn escape_for_terminal(s: &str) -> String {
    let unsafe_char = |c: char| {
        c.is_control()
            || ('\u{202a}'..='\u{202e}').contains(&c)
            || ('\u{2066}'..='\u{2069}').contains(&c)
    };
    if !s.chars().any(unsafe_char) {
        return s.to_string();
    }
    s.chars()
        .map(|c| {
            if unsafe_char(c) {
                c.escape_unicode().to_string()
            } else {
                c.to_string()
            }
        })
        .collect()
}

#[cfg(test)]
mod tests {
    #[test]
    fn control_characters_are_escaped_for_the_terminal() {
        assert_eq!(super::escape_for_terminal("pos"), "pos");
        assert_eq!(
            super::escape_for_terminal("a\u{1b}[2Jb\0c\u{202e}"),
            "a\\u{1b}[2Jb\\u{0}c\\u{202e}"
        );
    }
}
