//! Chat templates, rendered as transformers' `apply_chat_template` renders them (`tokenize=False`).
//!
//! The template is compiled with [`minijinja`] in the environment transformers builds in
//! `_compile_jinja_template`: `trim_blocks` and `lstrip_blocks` on, the template's single trailing
//! newline dropped (Jinja's default), loop controls (`{% break %}`, `{% continue %}`), Python's
//! string and dict methods (`.strip()`, `.split()`, `.startswith()`, `.items()`, … through
//! `minijinja-contrib`'s `pycompat`), and transformers' globals and filters: `raise_exception(msg)`,
//! `strftime_now(fmt)` and its own `tojson` (Python's `json.dumps`: `ensure_ascii=False`, `indent`,
//! `separators`, `sort_keys`). Values print as Python's `str()` prints them (`True`, `None`,
//! `['a', 1]`).
//!
//! transformers records, through its `AssistantTracker` extension, the text rendered inside
//! `{% generation %}…{% endgeneration %}` blocks (the assistant turns that `assistant_only_loss`
//! trains on). minijinja has no custom tags, so before compiling, each such tag is rewritten into a
//! `{% filter %}…{% endfilter %}` block (a block tag too, so `trim_blocks`, `lstrip_blocks` and the
//! `-`/`+` whitespace controls act on it exactly as on the original tag) whose filter wraps the body
//! in two private-use characters, U+E000 and U+E001. After rendering, they are taken out again and
//! what lay between them becomes a span of [`Rendered::generation_spans`]. Templates and inputs that
//! already contain those characters are refused. A template without the tags still gives the
//! assistant's spans, found by rendering turn by turn ([`ChatTemplate::render_assistant_turns`]).

use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::ops::Range;
use std::path::{Path, PathBuf};

use minijinja::value::ValueKind;
use minijinja::{Environment, Error as JinjaError, ErrorKind, Value};
use serde::{Deserialize, Serialize};
use serde_json::{Map, Value as Json};

use crate::error::json_kind;

mod python;
use python::*;
mod generation;
use generation::*;
mod tokens;
pub use tokens::*;
mod turns;

/// The name errors give the template.
const TEMPLATE_NAME: &str = "chat_template";
/// Why a chat template could not be loaded, compiled or rendered (one sentence each).
#[derive(Debug, thiserror::Error)]
pub enum ChatTemplateError {
    /// A tokenizer file could not be read or holds no usable template.
    #[error("{}: {message}", path.display())]
    File { path: PathBuf, message: String },
    /// The template is not valid Jinja.
    #[error("the chat template does not compile: {0}")]
    Compile(String),
    /// Rendering failed; for `raise_exception(msg)` the message is the template's own.
    #[error("the chat template failed at line {line}: {message}", line = line.map_or("?".to_string(), |l| l.to_string()))]
    Render {
        line: Option<usize>,
        message: String,
    },
    /// The messages, tools or template variables cannot be given to the template.
    #[error("{0}")]
    Input(String),
    /// The rendered text grew past the cap on text kiln tokenizes (a template that expands
    /// without end would otherwise take all memory, or abort the tokenizer).
    #[error("the chat template{} rendered more than {cap} bytes for one conversation, the cap on text kiln tokenizes in one piece; set {var}=N to raise it", origin.as_ref().map_or(String::new(), |p| format!(" of {}", p.display())), var = crate::data::tokenize::MAX_TEXT_BYTES_VAR)]
    TooLong { origin: Option<PathBuf>, cap: usize },
}

/// One chat message: its role, its content and any other keys (`tool_calls`, `name`,
/// `reasoning_content`, …), which the template sees as they are.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Message {
    pub role: String,
    /// A string, a list of content parts (multimodal), or absent (`null`), as some tool-call turns.
    #[serde(default, skip_serializing_if = "Json::is_null")]
    pub content: Json,
    /// Every other key of the message.
    #[serde(flatten)]
    pub extra: Map<String, Json>,
}

impl Message {
    /// A message with a text content and nothing else.
    pub fn new(role: impl Into<String>, content: impl Into<String>) -> Self {
        Message {
            role: role.into(),
            content: Json::String(content.into()),
            extra: Map::new(),
        }
    }
}

/// What a render needs besides the messages; `Default` is transformers' default call.
#[derive(Debug, Clone, Copy, Default)]
pub struct RenderOptions<'a> {
    /// End with the header of a new assistant turn (for a prompt to complete).
    pub add_generation_prompt: bool,
    /// JSON schemas of the tools the model may call (`tools=`), passed as they are.
    pub tools: Option<&'a [Json]>,
    /// More template variables (TRL's per-row `chat_template_kwargs`); they override the special
    /// tokens of the same name, as in transformers.
    pub variables: Option<&'a Map<String, Json>>,
}

/// A rendered conversation.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Rendered {
    pub text: String,
    /// Byte ranges of `text` rendered inside `{% generation %}` blocks, in the order the blocks
    /// closed (transformers' `generation_indices` order, there in characters).
    pub generation_spans: Vec<Range<usize>>,
}

impl Rendered {
    /// [`Self::generation_spans`] in characters, as transformers reports them.
    pub fn generation_char_spans(&self) -> Vec<Range<usize>> {
        let to_char = |b: usize| self.text[..b].chars().count();
        self.generation_spans
            .iter()
            .map(|r| to_char(r.start)..to_char(r.end))
            .collect()
    }
}

/// A compiled chat template with the special tokens it is rendered with.
pub struct ChatTemplate {
    env: Environment<'static>,
    source: String,
    /// The file the template was read from, named in errors.
    origin: Option<PathBuf>,
    has_generation: bool,
    variables: BTreeMap<String, Json>,
}

impl std::fmt::Debug for ChatTemplate {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ChatTemplate")
            .field("source", &self.source)
            .field("variables", &self.variables)
            .finish_non_exhaustive()
    }
}

impl ChatTemplate {
    /// Compiles `source`; `bos_token` and `eos_token` are the strings the template sees under those
    /// names (add others with [`Self::with_variable`]).
    pub fn new(
        source: &str,
        bos_token: Option<String>,
        eos_token: Option<String>,
    ) -> Result<Self, ChatTemplateError> {
        if source.contains([GEN_OPEN, GEN_CLOSE]) {
            return Err(ChatTemplateError::Compile(
                "it contains the private-use characters U+E000 or U+E001, which kiln reserves \
                 for marking {% generation %} blocks"
                    .into(),
            ));
        }
        let (rewritten, opens, closes) = rewrite_generation_tags(source);
        if opens != closes {
            return Err(ChatTemplateError::Compile(format!(
                "it has {opens} {{% generation %}} tags but {closes} {{% endgeneration %}} tags"
            )));
        }
        let generation_tags = opens;
        let mut env = Environment::new();
        let mut syntax = minijinja::syntax::SyntaxConfig::builder();
        syntax
            .trim_blocks(true)
            .lstrip_blocks(true)
            .keep_trailing_newline(false);
        env.set_syntax(
            syntax
                .build()
                .map_err(|e| ChatTemplateError::Compile(e.to_string()))?,
        );
        env.set_unknown_method_callback(minijinja_contrib::pycompat::unknown_method_callback);
        env.set_formatter(|out, _state, value| {
            out.write_str(&py_str(value))
                .map_err(|_| JinjaError::new(ErrorKind::WriteFailure, "cannot write output"))
        });
        env.add_filter("tojson", tojson);
        env.add_filter("string", |v: Value| py_str(&v));
        // Python's `iter()`: `none` is not iterable (minijinja iterates it as empty), undefined is.
        env.add_test("iterable", |v: Value| {
            !matches!(
                v.kind(),
                ValueKind::None | ValueKind::Bool | ValueKind::Number | ValueKind::Plain
            )
        });
        env.add_filter(GEN_FILTER, |body: String| {
            format!("{GEN_OPEN}{body}{GEN_CLOSE}")
        });
        env.add_function("raise_exception", raise_exception);
        env.add_function("strftime_now", strftime_now);
        env.add_template_owned(TEMPLATE_NAME, rewritten)
            .map_err(|e| {
                let mut message = describe(&e);
                if generation_tags > 0 {
                    // The rewrite is ours: speak of the tags the author wrote.
                    message = message
                        .replace("endfilter", "endgeneration")
                        .replace(GEN_FILTER, "generation");
                }
                ChatTemplateError::Compile(message)
            })?;
        let mut variables = BTreeMap::new();
        for (name, value) in [("bos_token", bos_token), ("eos_token", eos_token)] {
            if let Some(v) = value {
                variables.insert(name.to_string(), Json::String(v));
            }
        }
        let template = ChatTemplate {
            env,
            source: source.to_string(),
            origin: None,
            has_generation: generation_tags > 0,
            variables,
        };
        template.check_variables()?;
        Ok(template)
    }

    /// Adds (or replaces) a variable every render sees, e.g. `pad_token` or `date_string`.
    pub fn with_variable(mut self, name: &str, value: Json) -> Result<Self, ChatTemplateError> {
        self.variables.insert(name.to_string(), value);
        self.check_variables()?;
        Ok(self)
    }

    /// The template of a model folder, as transformers loads it: `chat_template.jinja`, else
    /// `tokenizer_config.json`'s `"chat_template"` (a string, or a list of `{name, template}` or a
    /// name → template object, of which `"default"` is taken); `None` if neither. Every special token of
    /// `tokenizer_config.json` (else `special_tokens_map.json`) is given to the template.
    pub fn from_model_dir(dir: &Path) -> Result<Option<Self>, ChatTemplateError> {
        let config_path = dir.join("tokenizer_config.json");
        let config = read_json_object(&config_path)?;
        let jinja_path = dir.join("chat_template.jinja");
        let source = if jinja_path.is_file() {
            std::fs::read_to_string(&jinja_path).map_err(|e| ChatTemplateError::File {
                path: jinja_path.clone(),
                message: format!("cannot read the chat template: {e}"),
            })?
        } else {
            match config.as_ref().and_then(|c| c.get("chat_template")) {
                None | Some(Json::Null) => return Ok(None),
                Some(Json::String(s)) => s.clone(),
                Some(Json::Array(list)) => default_of_named(list, &config_path)?,
                Some(Json::Object(named)) => match named.get("default") {
                    Some(Json::String(s)) => s.clone(),
                    _ => {
                        return Err(ChatTemplateError::File {
                            path: config_path,
                            message: "\"chat_template\" names several templates but no \
                                      \"default\" string"
                                .into(),
                        })
                    }
                },
                Some(other) => {
                    return Err(ChatTemplateError::File {
                        path: config_path,
                        message: format!(
                            "\"chat_template\" must be a string or a list of {{name, template}}, \
                             not {}",
                            json_kind(other)
                        ),
                    })
                }
            }
        };
        let tokens = special_tokens(dir)?;
        let mut template = ChatTemplate::new(&source, None, None)?;
        template.origin = Some(if jinja_path.is_file() {
            jinja_path
        } else {
            config_path
        });
        for (name, value) in tokens {
            template = template.with_variable(&name, Json::String(value))?;
        }
        Ok(Some(template))
    }

    /// The template as written (before the `{% generation %}` rewrite).
    pub fn source(&self) -> &str {
        &self.source
    }

    /// Whether the template marks assistant text with `{% generation %}` blocks (which
    /// `assistant_only_loss` needs).
    pub fn has_generation_blocks(&self) -> bool {
        self.has_generation
    }

    /// A template variable, e.g. `"eos_token"`.
    pub fn variable(&self, name: &str) -> Option<&Json> {
        self.variables.get(name)
    }

    /// Renders `messages` as `apply_chat_template(messages, tokenize=False,
    /// add_generation_prompt=…)` does.
    pub fn render(
        &self,
        messages: &[Message],
        add_generation_prompt: bool,
    ) -> Result<Rendered, ChatTemplateError> {
        self.render_with(
            messages,
            &RenderOptions {
                add_generation_prompt,
                ..Default::default()
            },
        )
    }

    /// Renders `messages` with tools and extra variables.
    pub fn render_with(
        &self,
        messages: &[Message],
        options: &RenderOptions<'_>,
    ) -> Result<Rendered, ChatTemplateError> {
        let messages: Vec<Json> = messages.iter().map(normalize_message).collect();
        let tools = options.tools.map(|t| Json::Array(t.to_vec()));
        for (what, value) in [
            ("a message", Some(&Json::Array(messages.clone()))),
            ("a tool", tools.as_ref()),
        ] {
            if value.is_some_and(contains_sentinel) {
                return Err(sentinel_error(what));
            }
        }
        let mut ctx: BTreeMap<String, Value> = BTreeMap::new();
        for (k, v) in &self.variables {
            ctx.insert(k.clone(), to_value(v));
        }
        if let Some(vars) = options.variables {
            if contains_sentinel(&Json::Object(vars.clone())) {
                return Err(sentinel_error("a template variable"));
            }
            for (k, v) in vars {
                ctx.insert(k.clone(), to_value(v));
            }
        }
        ctx.insert(
            "messages".into(),
            Value::from(messages.iter().map(to_value).collect::<Vec<_>>()),
        );
        ctx.insert(
            "tools".into(),
            tools.map_or(Value::from(()), |t| to_value(&t)),
        );
        ctx.insert("documents".into(), Value::from(()));
        ctx.insert(
            "add_generation_prompt".into(),
            Value::from(options.add_generation_prompt),
        );
        let template = self
            .env
            .get_template(TEMPLATE_NAME)
            .map_err(|e| ChatTemplateError::Compile(describe(&e)))?;
        let cap = crate::data::tokenize::max_text_bytes();
        let mut out = CappedText {
            text: Vec::new(),
            cap,
            over: false,
        };
        let rendered = template.render_captured_to(Value::from_pairs(ctx), &mut out);
        if out.over {
            return Err(ChatTemplateError::TooLong {
                origin: self.origin.clone(),
                cap,
            });
        }
        rendered.map_err(|e| ChatTemplateError::Render {
            line: e.line(),
            message: describe(&e),
        })?;
        let raw = String::from_utf8(out.text).map_err(|_| ChatTemplateError::Render {
            line: None,
            message: "the rendered text is not UTF-8".into(),
        })?;
        split_generation_spans(&raw)
    }

    fn check_variables(&self) -> Result<(), ChatTemplateError> {
        let all = Json::Object(self.variables.clone().into_iter().collect());
        if contains_sentinel(&all) {
            return Err(sentinel_error("a special token"));
        }
        Ok(())
    }
}

/// The rendered text, refused past `cap` bytes: a write that would pass it fails, which stops
/// the render there.
struct CappedText {
    text: Vec<u8>,
    cap: usize,
    over: bool,
}

impl std::io::Write for CappedText {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        if self.text.len() + buf.len() > self.cap {
            self.over = true;
            return Err(std::io::Error::other("over the cap"));
        }
        self.text.extend_from_slice(buf);
        Ok(buf.len())
    }

    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

/// transformers' message clean-up: keys whose value is `None` are dropped, and a reasoning given as
/// `reasoning_content`, `thinking` or `reasoning` is also passed as `thinking` (unless the message
/// has one) and as `reasoning_content`.
fn normalize_message(m: &Message) -> Json {
    let mut obj = Map::new();
    obj.insert("role".into(), Json::String(m.role.clone()));
    if !m.content.is_null() {
        obj.insert("content".into(), m.content.clone());
    }
    for (k, v) in &m.extra {
        if !v.is_null() && k != "role" && k != "content" {
            obj.insert(k.clone(), v.clone());
        }
    }
    let reasoning = ["reasoning_content", "thinking", "reasoning"]
        .iter()
        .find_map(|k| obj.get(*k).cloned());
    if let Some(r) = reasoning {
        if !obj.contains_key("thinking") {
            let mut with = Map::new();
            with.insert("thinking".into(), r.clone());
            with.extend(obj);
            obj = with;
        }
        obj.insert("reasoning_content".into(), r);
    }
    Json::Object(obj)
}

/// A JSON value as a template value (objects keep their key order).
fn to_value(v: &Json) -> Value {
    match v {
        Json::Null => Value::from(()),
        Json::Bool(b) => Value::from(*b),
        Json::Number(n) => match (n.as_i64(), n.as_u64(), n.as_f64()) {
            (Some(i), _, _) => Value::from(i),
            (_, Some(u), _) => Value::from(u),
            (_, _, Some(f)) => Value::from(f),
            _ => Value::from(n.to_string()),
        },
        Json::String(s) => Value::from(s.as_str()),
        Json::Array(a) => Value::from(a.iter().map(to_value).collect::<Vec<_>>()),
        Json::Object(o) => Value::from_pairs(o.iter().map(|(k, v)| (k.as_str(), to_value(v)))),
    }
}

fn contains_sentinel(v: &Json) -> bool {
    match v {
        Json::String(s) => s.contains([GEN_OPEN, GEN_CLOSE]),
        Json::Array(a) => a.iter().any(contains_sentinel),
        Json::Object(o) => o
            .iter()
            .any(|(k, v)| k.contains([GEN_OPEN, GEN_CLOSE]) || contains_sentinel(v)),
        _ => false,
    }
}

fn sentinel_error(what: &str) -> ChatTemplateError {
    ChatTemplateError::Input(format!(
        "{what} contains the private-use characters U+E000 or U+E001, which kiln reserves for \
         marking {{% generation %}} blocks"
    ))
}

impl std::fmt::Display for Raised {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("raised by the template")
    }
}

impl std::error::Error for Raised {}

/// One clause for a minijinja error: the template's own message for `raise_exception`, else the
/// kind of error and its detail.
fn describe(e: &JinjaError) -> String {
    let raised = std::iter::successors(std::error::Error::source(e), |s| s.source())
        .any(|s| s.is::<Raised>());
    let detail = e.detail().unwrap_or_default();
    if raised {
        return detail.to_string();
    }
    let kind = e.kind().to_string();
    let mut message = if detail.is_empty() {
        kind
    } else {
        format!("{kind}: {detail}")
    };
    if let (ErrorKind::SyntaxError, Some(line)) = (e.kind(), e.line()) {
        let _ = write!(message, " (line {line})");
    }
    message
}

#[cfg(test)]
mod tests {
    use super::generation::*;
    use super::python::*;
    use super::*;

    const SMOLLM2: &str = "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}{{ '<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n' }}{% endif %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}";

    const MISTRAL: &str = "{{ bos_token }}{% for message in messages %}{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}{% endif %}{% if message['role'] == 'user' %}{{ '[INST] ' + message['content'] + ' [/INST]' }}{% elif message['role'] == 'assistant' %}{{ message['content'] + eos_token}}{% else %}{{ raise_exception('Only user and assistant roles are supported!') }}{% endif %}{% endfor %}";

    /// SmolLM2's template with generation blocks on lines of their own (check.py's SMOL_GEN).
    const SMOL_GEN: &str = "{% for message in messages %}\n{% if loop.first and messages[0]['role'] != 'system' %}\n{{ '<|im_start|>system\\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\\n' }}\n{% endif %}\n{% if message['role'] == 'assistant' %}\n{{ '<|im_start|>assistant\\n' }}\n    {% generation %}\n{{ message['content'] + '<|im_end|>' }}\n    {%- endgeneration %}\n\n{{ '\\n' }}\n{% else %}\n{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}\n{% endif %}\n{% endfor %}\n{% if add_generation_prompt %}\n{{ '<|im_start|>assistant\\n' }}\n{% endif %}\n";

    fn system_conv() -> Vec<Message> {
        vec![
            Message::new("system", "You are terse."),
            Message::new("user", "  Hi  there \u{e9}\u{4e16} "),
            Message::new("assistant", "Hello."),
            Message::new("user", "2+2?"),
            Message::new("assistant", "4"),
        ]
    }

    #[test]
    fn smollm2_matches_transformers() {
        let t = ChatTemplate::new(
            SMOLLM2,
            Some("<|im_start|>".into()),
            Some("<|im_end|>".into()),
        )
        .unwrap();
        let r = t.render(&system_conv(), false).unwrap();
        // transformers 5.24 apply_chat_template(tokenize=False), from check.py
        assert_eq!(
            r.text,
            "<|im_start|>system\nYou are terse.<|im_end|>\n<|im_start|>user\n  Hi  there é世 <|im_end|>\n<|im_start|>assistant\nHello.<|im_end|>\n<|im_start|>user\n2+2?<|im_end|>\n<|im_start|>assistant\n4<|im_end|>\n"
        );
        assert!(r.generation_spans.is_empty());
        let two = [Message::new("user", "Hello there!")];
        let r = t.render(&two, true).unwrap();
        assert_eq!(r.text, "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n<|im_start|>user\nHello there!<|im_end|>\n<|im_start|>assistant\n");
    }

    #[test]
    fn mistral_raise_exception_surfaces_its_message() {
        let t = ChatTemplate::new(MISTRAL, Some("<s>".into()), Some("</s>".into())).unwrap();
        let ok = [Message::new("user", "Hi"), Message::new("assistant", "Yo")];
        assert_eq!(
            t.render(&ok, false).unwrap().text,
            "<s>[INST] Hi [/INST]Yo</s>"
        );
        let bad = [Message::new("user", "a"), Message::new("user", "b")];
        let err = t.render(&bad, false).unwrap_err();
        let text = err.to_string();
        assert_eq!(
            text,
            "the chat template failed at line 1: Conversation roles must alternate user/assistant/user/assistant/..."
        );
    }

    #[test]
    fn generation_blocks_trim_like_block_tags() {
        let t = ChatTemplate::new(SMOL_GEN, None, None).unwrap();
        assert!(t.has_generation_blocks());
        let r = t.render(&system_conv(), false).unwrap();
        // transformers' render_jinja_template(return_assistant_tokens_mask=True), from check.py
        assert_eq!(
            r.text,
            "<|im_start|>system\nYou are terse.<|im_end|>\n\n<|im_start|>user\n  Hi  there é世 <|im_end|>\n\n<|im_start|>assistant\n\nHello.<|im_end|>\n\n\n<|im_start|>user\n2+2?<|im_end|>\n\n<|im_start|>assistant\n\n4<|im_end|>\n\n\n"
        );
        assert_eq!(r.generation_char_spans(), vec![112..128, 187..198]);
        assert_eq!(&r.text[r.generation_spans[0].clone()], "Hello.<|im_end|>");
    }

    #[test]
    fn generation_tag_variants_are_rewritten() {
        let (s, opens, closes) = rewrite_generation_tags(
            "a{%generation%}b{%- endgeneration -%}{%+ generation\n%}{% endgeneration+%}{% generations %}{{ '{%' }}",
        );
        assert_eq!((opens, closes), (2, 2));
        assert_eq!(
            s,
            "a{%filter __kiln_generation%}b{%- endfilter -%}{%+ filter __kiln_generation\n%}{% endfilter+%}{% generations %}{{ '{%' }}"
        );
        let t = ChatTemplate::new(
            "{% for m in messages %}{% generation %}{% set x = m.content %}{{ x }}{% endgeneration %}|{% endfor %}",
            None,
            None,
        )
        .unwrap();
        let r = t
            .render(&[Message::new("a", "xy"), Message::new("b", "")], false)
            .unwrap();
        assert_eq!(r.text, "xy||");
        assert_eq!(r.generation_spans, vec![0..2, 3..3]);
    }

    #[test]
    fn sentinels_are_refused() {
        assert!(ChatTemplate::new("{{ '\u{e000}' }}", None, None).is_err());
        let t = ChatTemplate::new(SMOLLM2, None, None).unwrap();
        let err = t
            .render(&[Message::new("user", "a\u{e001}")], false)
            .unwrap_err();
        assert!(err.to_string().contains("U+E000"), "{err}");
    }

    #[test]
    fn python_compat() {
        let t = ChatTemplate::new(
            "{{ m.content.strip() }}|{{ m.content.split(' ') | length }}|{{ m.content.startswith('  H') }}|{% for k, v in m.items() %}{{ k }}={{ v }};{% endfor %}|{{ true }} {{ none }} {{ [1, 'a', none, 1.5] }} {{ {'x': 'it\\'s'} }} {{ 2.0 }} {{ 1e20 }}|{{ m | tojson }}|{{ {'b': 1, 'a': [1.5, 1e20, 'é'], 'c': none} | tojson(sort_keys=true) }}|{{ {'k': 'ü😀'} | tojson(ensure_ascii=true) }}|{{ [1, {'a': []}] | tojson(indent=2) }}|{{ [1, 2] | tojson(separators=(',', ':')) }}|{% for i in range(5) %}{% if i == 1 %}{% continue %}{% endif %}{% if i == 3 %}{% break %}{% endif %}{{ i }}{% endfor %}",
            None,
            None,
        )
        .unwrap();
        let r = t
            .render_with(
                &[],
                &RenderOptions {
                    variables: Some(
                        &serde_json::from_str(
                            r#"{"m": {"content": "  Hi  there ", "role": "user"}}"#,
                        )
                        .unwrap(),
                    ),
                    ..Default::default()
                },
            )
            .unwrap();
        assert_eq!(
            r.text,
            "Hi  there|6|True|content=  Hi  there ;role=user;|True None [1, 'a', None, 1.5] {'x': \"it's\"} 2.0 1e+20|{\"content\": \"  Hi  there \", \"role\": \"user\"}|{\"a\": [1.5, 1e+20, \"é\"], \"b\": 1, \"c\": null}|{\"k\": \"\\u00fc\\ud83d\\ude00\"}|[\n  1,\n  {\n    \"a\": []\n  }\n]|[1,2]|02"
        );
    }

    #[test]
    fn chat_template_is_send_and_sync() {
        fn check<T: Send + Sync>() {}
        check::<ChatTemplate>();
    }

    #[test]
    fn float_repr_matches_python() {
        for (f, s) in [
            (1.0, "1.0"),
            (-0.0, "-0.0"),
            (1e16, "1e+16"),
            (1e15, "1000000000000000.0"),
            (0.0001, "0.0001"),
            (0.00001, "1e-05"),
            (123456789012345680.0, "1.2345678901234568e+17"),
            (0.1, "0.1"),
            (2.5e-7, "2.5e-07"),
        ] {
            assert_eq!(py_float_repr(f), s);
        }
    }

    #[test]
    fn reasoning_and_none_keys_are_normalized() {
        let m: Message = serde_json::from_str(
            r#"{"role": "assistant", "content": "ok", "reasoning": "hmm", "tool_calls": null}"#,
        )
        .unwrap();
        let n = normalize_message(&m);
        assert_eq!(n["thinking"], "hmm");
        assert_eq!(n["reasoning_content"], "hmm");
        assert!(n.get("tool_calls").is_none());
    }

    #[test]
    fn strftime_now_formats_today() {
        let t = ChatTemplate::new("{{ strftime_now('%Y') }}", None, None).unwrap();
        let year = t.render(&[], false).unwrap().text;
        assert_eq!(year.len(), 4);
        assert!(year.parse::<u32>().unwrap() >= 2024);
    }

    #[test]
    fn errors_name_the_line() {
        let err = ChatTemplate::new("ok\n{% if %}", None, None).unwrap_err();
        assert!(err.to_string().contains("line 2"), "{err}");
        let err = ChatTemplate::new("{% generation %}x", None, None).unwrap_err();
        assert!(err.to_string().contains("endgeneration"), "{err}");
        let t = ChatTemplate::new("a\nb\n{{ messages[0].content.nope() }}", None, None).unwrap();
        let err = t.render(&[Message::new("user", "x")], false).unwrap_err();
        assert!(
            err.to_string()
                .starts_with("the chat template failed at line 3:"),
            "{err}"
        );
    }

    #[test]
    fn model_dir_template_and_tokens() {
        let dir = std::env::temp_dir().join(format!("kiln-chat-template-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        std::fs::write(
            dir.join("tokenizer_config.json"),
            r#"{"bos_token": {"content": "<s>", "__type": "AddedToken"}, "eos_token": "</s>",
                "chat_template": [{"name": "tool_use", "template": "T"}, {"name": "default", "template": "{{ bos_token }}{{ eos_token }}{{ messages | length }}"}]}"#,
        )
        .unwrap();
        let t = ChatTemplate::from_model_dir(&dir).unwrap().unwrap();
        assert_eq!(t.render(&[], false).unwrap().text, "<s></s>0");
        std::fs::write(dir.join("chat_template.jinja"), "J{{ eos_token }}\n").unwrap();
        let t = ChatTemplate::from_model_dir(&dir).unwrap().unwrap();
        assert_eq!(t.render(&[], false).unwrap().text, "J</s>");
        std::fs::remove_dir_all(&dir).unwrap();
        let empty = std::env::temp_dir().join(format!("kiln-chat-none-{}", std::process::id()));
        std::fs::create_dir_all(&empty).unwrap();
        assert!(ChatTemplate::from_model_dir(&empty).unwrap().is_none());
        std::fs::remove_dir_all(&empty).unwrap();
    }
}
