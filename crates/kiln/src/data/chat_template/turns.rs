//! The assistant's text in a rendered conversation for a template without `{% generation %}`
//! tags (most stock templates): each assistant turn is what rendering the conversation up to and
//! including that turn adds to the rendering of the turns before it with the generation prompt.
//! The generation prompt (`<|im_start|>assistant\n`) is thereby the prompt's, and what the model
//! says after it, its end-of-turn token included, the assistant's — the spans a template's
//! `{% generation %}` block marks. A template that renders an earlier turn differently once later
//! turns follow (one that drops earlier reasoning, or marks the last turn) has no such diff and
//! is refused in one sentence.

use std::ops::Range;

use super::{ChatTemplate, ChatTemplateError, Message, RenderOptions, Rendered};

impl ChatTemplate {
    /// `messages` rendered without the generation prompt, with [`Rendered::generation_spans`]
    /// holding each assistant turn's bytes found by rendering turn by turn (see the module).
    pub fn render_assistant_turns(
        &self,
        messages: &[Message],
        options: &RenderOptions<'_>,
    ) -> Result<Rendered, ChatTemplateError> {
        let with = |end: usize, add_generation_prompt: bool| {
            let options = RenderOptions {
                add_generation_prompt,
                ..*options
            };
            self.render_with(&messages[..end], &options).map(|r| r.text)
        };
        let text = with(messages.len(), false)?;
        let mut spans: Vec<Range<usize>> = Vec::new();
        for (i, m) in messages.iter().enumerate() {
            if m.role != "assistant" {
                continue;
            }
            let before = with(i, true)?;
            let upto = with(i + 1, false)?;
            let n = i + 1;
            if !upto.starts_with(&before) {
                return Err(ChatTemplateError::Input(format!(
                    "the chat template renders the messages before message {n} (the \
                     assistant's) differently once it follows, so the assistant's text cannot \
                     be told apart without {{% generation %}} tags; add them to the template"
                )));
            }
            if !text.starts_with(&upto) {
                return Err(ChatTemplateError::Input(format!(
                    "the chat template renders message {n} (the assistant's) differently once \
                     later messages follow, so the assistant's text cannot be told apart \
                     without {{% generation %}} tags; add them to the template"
                )));
            }
            if upto.len() > before.len() {
                spans.push(before.len()..upto.len());
            }
        }
        Ok(Rendered {
            text,
            generation_spans: spans,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const CHATML: &str = "{% for m in messages %}{{ '<|im_start|>' + m.role + '\n' + m.content + '<|im_end|>\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}";
    /// The same template with the assistant's text (and its end of turn) in generation tags.
    const CHATML_TAGGED: &str = "{% for m in messages %}{% if m.role == 'assistant' %}{{ '<|im_start|>assistant\n' }}{% generation %}{{ m.content + '<|im_end|>\n' }}{% endgeneration %}{% else %}{{ '<|im_start|>' + m.role + '\n' + m.content + '<|im_end|>\n' }}{% endif %}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}";

    fn conversation() -> Vec<Message> {
        vec![
            Message::new("system", "Be brief."),
            Message::new("user", "Hi"),
            Message::new("assistant", "Hello!"),
            Message::new("user", "2+2?"),
            Message::new("assistant", "4"),
        ]
    }

    /// Turn by turn, an untagged template gives the spans its tagged variant marks.
    #[test]
    fn turn_diffs_equal_generation_tags() {
        let plain = ChatTemplate::new(CHATML, None, None).unwrap();
        let tagged = ChatTemplate::new(CHATML_TAGGED, None, None).unwrap();
        let messages = conversation();
        let want = tagged.render(&messages, false).unwrap();
        let got = plain
            .render_assistant_turns(&messages, &RenderOptions::default())
            .unwrap();
        assert_eq!(got, want);
        let texts: Vec<&str> = got
            .generation_spans
            .iter()
            .map(|r| &got.text[r.clone()])
            .collect();
        assert_eq!(texts, ["Hello!<|im_end|>\n", "4<|im_end|>\n"]);
    }

    /// A template that renders the last assistant turn apart from the earlier ones (here: only the
    /// last keeps its content) cannot be diffed: one sentence naming the turn.
    #[test]
    fn templates_that_re_render_earlier_turns_are_refused() {
        let last_only = "{% for m in messages %}{% if m.role == 'assistant' and not loop.last %}{{ 'assistant: …\n' }}{% else %}{{ m.role + ': ' + m.content + '\n' }}{% endif %}{% endfor %}{% if add_generation_prompt %}assistant: {% endif %}";
        let t = ChatTemplate::new(last_only, None, None).unwrap();
        let e = t
            .render_assistant_turns(&conversation(), &RenderOptions::default())
            .unwrap_err()
            .to_string();
        assert!(e.contains("renders message 3 (the assistant's)"), "{e}");
        assert!(e.contains("{% generation %}"), "{e}");
    }
}
