//! Chat templates: the Jinja template a model ships (GGUF
//! `tokenizer.chat_template`), rendered with minijinja for OpenAI-style messages.
//!
//! ```text
//!  messages, tools ─┐
//!  ChatOptions ─────┼─► template ─► prompt text ─► (thinking off and the
//!  (vars, thinking) │                              text opens <think>?
//!  bos, eos ────────┘                              then "</think>" closes it)
//! ```

use minijinja::{Environment, ErrorKind, context};
use serde::{Deserialize, Serialize};
use shardplane_formats::GgufHeader;

use crate::error::{Error, Result};
use crate::reasoning::{THINK_CLOSE, prompt_opens_reasoning};
use crate::tools::ToolCall;

/// Instructions one rendering may run (a template's loops over a long
/// conversation take a few per message; a template that loops for ever
/// fails within about a second instead).
const RENDER_FUEL: u64 = 50_000_000;

/// The longest prompt text a rendering may give (far beyond any context).
const MAX_PROMPT_BYTES: usize = 32 << 20;

/// The names a template always gets, which a request cannot set.
const STANDARD_VARS: &[&str] = &[
    "messages",
    "tools",
    "add_generation_prompt",
    "bos_token",
    "eos_token",
];

/// How a conversation is rendered besides its messages and tools.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct ChatOptions {
    vars: serde_json::Map<String, serde_json::Value>,
    thinking: Option<bool>,
}

impl ChatOptions {
    /// Options with extra template variables (a request's
    /// `chat_template_kwargs`) and whether the model may reason (`None`:
    /// the template's default). `enable_thinking` among `vars` is read as
    /// `thinking`; the two must agree.
    pub fn new(
        mut vars: serde_json::Map<String, serde_json::Value>,
        thinking: Option<bool>,
    ) -> Result<Self> {
        if let Some(name) = vars.keys().find(|k| STANDARD_VARS.contains(&k.as_str())) {
            return Err(Error::InvalidInput(format!(
                "the chat template variable `{name}` is the gateway's to set"
            )));
        }
        let from_vars = match vars.remove("enable_thinking") {
            None => None,
            Some(serde_json::Value::Bool(b)) => Some(b),
            Some(other) => {
                return Err(Error::InvalidInput(format!(
                    "the chat template variable `enable_thinking` must be true or false, not {other}"
                )));
            }
        };
        let thinking = match (thinking, from_vars) {
            (Some(a), Some(b)) if a != b => {
                return Err(Error::InvalidInput(
                    "`enable_thinking` contradicts the request's thinking setting".into(),
                ));
            }
            (a, b) => a.or(b),
        };
        Ok(ChatOptions { vars, thinking })
    }

    /// Whether the model may reason (`None`: the template decides).
    pub fn thinking(&self) -> Option<bool> {
        self.thinking
    }
}

/// ChatML, for models that ship no template.
const CHATML: &str = "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}";

/// One message of a conversation.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ChatMessage {
    /// `system`, `user`, `assistant` (or `tool`).
    pub role: String,
    /// The text of the message.
    pub content: String,
    /// The tools an assistant's message called (rendered by
    /// [`crate::tools::render`]).
    #[serde(skip)]
    pub tool_calls: Vec<ToolCall>,
    /// On a `tool` message: the call whose result it holds.
    #[serde(skip)]
    pub tool_call_id: Option<String>,
}

impl ChatMessage {
    /// A message with `role` and `content`.
    pub fn new(role: impl Into<String>, content: impl Into<String>) -> Self {
        ChatMessage {
            role: role.into(),
            content: content.into(),
            tool_calls: Vec::new(),
            tool_call_id: None,
        }
    }

    /// Whether the message belongs to a tool exchange (a call or a result).
    pub fn is_tool_exchange(&self) -> bool {
        !self.tool_calls.is_empty() || self.role == "tool"
    }
}

/// A compiled chat template.
pub struct ChatTemplate {
    env: Environment<'static>,
    source: String,
    bos_token: String,
    eos_token: String,
}

impl std::fmt::Debug for ChatTemplate {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ChatTemplate").finish_non_exhaustive()
    }
}

fn raise_exception(message: String) -> std::result::Result<String, minijinja::Error> {
    Err(minijinja::Error::new(ErrorKind::InvalidOperation, message))
}

/// `strftime_now(format)`: the local time now, formatted as Python's
/// `strftime` formats it (templates write today's date into the prompt:
/// gpt-oss's, Llama 3.1's).
fn strftime_now(format: String) -> std::result::Result<String, minijinja::Error> {
    use std::fmt::Write;
    let mut out = String::new();
    write!(out, "{}", chrono::Local::now().format(&format)).map_err(|_| {
        minijinja::Error::new(
            ErrorKind::InvalidOperation,
            format!("strftime_now: {format:?} is not a date format"),
        )
    })?;
    Ok(out)
}

impl ChatTemplate {
    /// Compiles `source` as Hugging Face does (trimmed blocks, Python string
    /// methods, `raise_exception` and `strftime_now`).
    pub fn new(source: &str, bos_token: &str, eos_token: &str) -> Result<Self> {
        let mut env = Environment::new();
        let syntax = minijinja::syntax::SyntaxConfig::builder()
            .trim_blocks(true)
            .lstrip_blocks(true)
            .build()
            .expect("the default delimiters are valid");
        env.set_syntax(syntax);
        env.set_unknown_method_callback(minijinja_contrib::pycompat::unknown_method_callback);
        env.add_function("raise_exception", raise_exception);
        env.add_function("strftime_now", strftime_now);
        env.set_fuel(Some(RENDER_FUEL));
        env.add_template_owned("chat", source.to_string())
            .map_err(|e| {
                Error::ChatTemplate(format!("the model's template does not compile: {e}"))
            })?;
        Ok(ChatTemplate {
            env,
            source: source.to_string(),
            bos_token: bos_token.to_string(),
            eos_token: eos_token.to_string(),
        })
    }

    /// The template a GGUF file ships, or ChatML when it has none.
    pub fn from_gguf(header: &GgufHeader, bos_token: &str, eos_token: &str) -> Result<Self> {
        let source = header
            .get_str("tokenizer.chat_template")
            .unwrap_or_else(|_| {
                tracing::warn!("the model ships no chat template; using ChatML");
                CHATML
            });
        Self::new(source, bos_token, eos_token)
    }

    /// Another template (given apart from the model's files) with the same
    /// BOS and EOS tokens.
    pub fn with_source(&self, source: &str) -> Result<Self> {
        Self::new(source, &self.bos_token, &self.eos_token)
    }

    /// The template's Jinja source.
    pub fn source(&self) -> &str {
        &self.source
    }

    /// Renders a conversation; with `add_generation_prompt` the text ends where
    /// the assistant's reply begins.
    pub fn render(&self, messages: &[ChatMessage], add_generation_prompt: bool) -> Result<String> {
        self.render_with(messages, add_generation_prompt, &ChatOptions::default())
    }

    /// [`Self::render`] with options.
    pub fn render_with(
        &self,
        messages: &[ChatMessage],
        add_generation_prompt: bool,
        options: &ChatOptions,
    ) -> Result<String> {
        let messages =
            serde_json::to_value(messages).map_err(|e| Error::ChatTemplate(e.to_string()))?;
        self.render_json(&messages, None, add_generation_prompt, options)
    }

    /// Renders messages given as JSON (OpenAI's shapes, `tool_calls`
    /// included), with `tools` (OpenAI function objects) when given.
    ///
    /// With thinking off, the template gets `enable_thinking = false` (as
    /// Qwen 3's reads it), and a generation prompt that still opens
    /// reasoning (R1-style templates end in `<think>`) is closed at once,
    /// so the answer starts after an empty reasoning.
    pub fn render_json(
        &self,
        messages: &serde_json::Value,
        tools: Option<&serde_json::Value>,
        add_generation_prompt: bool,
        options: &ChatOptions,
    ) -> Result<String> {
        if messages.as_array().is_none_or(|m| m.is_empty()) {
            return Err(Error::ChatTemplate(
                "a conversation needs at least one message".into(),
            ));
        }
        let template = self.env.get_template("chat").expect("added in new");
        let mut vars = options.vars.clone();
        if let Some(t) = options.thinking {
            vars.insert("enable_thinking".into(), t.into());
        }
        // `tools` is left undefined when there are none, as templates expect.
        if let Some(t) = tools {
            vars.insert("tools".into(), t.clone());
        }
        let ctx = context! {
            messages => minijinja::Value::from(minijinja::value::Serde(messages)),
            add_generation_prompt => add_generation_prompt,
            bos_token => self.bos_token.as_str(),
            eos_token => self.eos_token.as_str(),
            ..minijinja::Value::from(minijinja::value::Serde(&vars))
        };
        let mut out = Capped(Vec::new());
        template.render_captured_to(ctx, &mut out).map_err(|e| {
            Error::ChatTemplate(match out.0.len() >= MAX_PROMPT_BYTES {
                true => format!("the rendered prompt passes {MAX_PROMPT_BYTES} bytes"),
                false => e.to_string(),
            })
        })?;
        let mut text = String::from_utf8(out.0)
            .map_err(|e| Error::ChatTemplate(format!("the rendered prompt is not UTF-8: {e}")))?;
        if add_generation_prompt && options.thinking == Some(false) && prompt_opens_reasoning(&text)
        {
            text.truncate(text.trim_end().len());
            text.push_str("\n\n");
            text.push_str(THINK_CLOSE);
            text.push_str("\n\n");
        }
        Ok(text)
    }
}

/// A buffer that refuses to grow past [`MAX_PROMPT_BYTES`].
struct Capped(Vec<u8>);

impl std::io::Write for Capped {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        if self.0.len() + buf.len() > MAX_PROMPT_BYTES {
            self.0.resize(MAX_PROMPT_BYTES, 0);
            return Err(std::io::Error::other("prompt too long"));
        }
        self.0.extend_from_slice(buf);
        Ok(buf.len())
    }

    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    /// A template that would loop for ever or print without end fails
    /// soon, naming why; a long conversation still renders.
    #[test]
    fn runaway_templates_fail_and_long_conversations_render() {
        let hi = [ChatMessage::new("user", "Hi")];
        let forever = "{% for a in range(100000) %}{% for b in range(100000) %}{{ '' }}{% endfor %}{% endfor %}";
        let started = std::time::Instant::now();
        let e = ChatTemplate::new(forever, "", "")
            .unwrap()
            .render(&hi, true)
            .unwrap_err()
            .to_string();
        assert!(e.contains("fuel"), "{e}");
        eprintln!("out of fuel after {:?}", started.elapsed());
        let huge = "{% for a in range(100000) %}{{ 'x' * 10000 }}{% endfor %}";
        let e = ChatTemplate::new(huge, "", "")
            .unwrap()
            .render(&hi, true)
            .unwrap_err()
            .to_string();
        assert!(e.contains("passes 33554432 bytes"), "{e}");
        let long: Vec<ChatMessage> = (0..20_000)
            .map(|i| ChatMessage::new(["user", "assistant"][i % 2], format!("message {i}")))
            .collect();
        let text = ChatTemplate::new(CHATML, "", "")
            .unwrap()
            .render(&long, true)
            .unwrap();
        assert!(text.contains("message 19999"));
    }

    /// Qwen 3's switch: an empty reasoning when `enable_thinking` is false.
    const HYBRID: &str = "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% if enable_thinking is defined and enable_thinking is false %}<think>\n\n</think>\n\n{% endif %}{% endif %}{{ style | default('') }}";
    /// R1's: the generation prompt always opens reasoning.
    const OPENS: &str = "{% for m in messages %}{{ m.role }}: {{ m.content }}\n{% endfor %}{% if add_generation_prompt %}assistant: <think>\n{% endif %}";

    fn vars(v: serde_json::Value) -> serde_json::Map<String, serde_json::Value> {
        v.as_object().unwrap().clone()
    }

    #[test]
    fn thinking_off_reaches_the_template_or_closes_the_opened_reasoning() {
        let hi = [ChatMessage::new("user", "Hi")];
        let off = ChatOptions::new(Default::default(), Some(false)).unwrap();
        let on = ChatOptions::new(Default::default(), Some(true)).unwrap();
        let hybrid = ChatTemplate::new(HYBRID, "", "").unwrap();
        assert!(
            hybrid
                .render_with(&hi, true, &off)
                .unwrap()
                .ends_with("assistant\n<think>\n\n</think>\n\n")
        );
        for options in [&on, &ChatOptions::default()] {
            assert!(
                hybrid
                    .render_with(&hi, true, options)
                    .unwrap()
                    .ends_with("assistant\n")
            );
        }
        let opens = ChatTemplate::new(OPENS, "", "").unwrap();
        assert!(
            opens
                .render_with(&hi, true, &on)
                .unwrap()
                .ends_with("assistant: <think>\n")
        );
        let closed = opens.render_with(&hi, true, &off).unwrap();
        assert!(
            closed.ends_with("assistant: <think>\n\n</think>\n\n"),
            "{closed:?}"
        );
        assert!(!prompt_opens_reasoning(&closed));
        // Without a generation prompt nothing is added.
        assert!(
            opens
                .render_with(&hi, false, &off)
                .unwrap()
                .ends_with("user: Hi\n")
        );
    }

    #[test]
    fn extra_variables_reach_the_template_and_standard_names_are_refused() {
        let hi = [ChatMessage::new("user", "Hi")];
        let t = ChatTemplate::new(HYBRID, "", "").unwrap();
        let o = ChatOptions::new(vars(json!({"style": "terse"})), None).unwrap();
        assert!(t.render_with(&hi, true, &o).unwrap().ends_with("terse"));
        // enable_thinking among the variables is the thinking switch.
        let o = ChatOptions::new(vars(json!({"enable_thinking": false})), None).unwrap();
        assert_eq!(o.thinking(), Some(false));
        assert_eq!(
            ChatOptions::new(vars(json!({"enable_thinking": true})), Some(true))
                .unwrap()
                .thinking(),
            Some(true)
        );
        for (v, thinking, says) in [
            (json!({"messages": []}), None, "`messages`"),
            (json!({"bos_token": "x"}), None, "`bos_token`"),
            (json!({"enable_thinking": "no"}), None, "true or false"),
            (json!({"enable_thinking": true}), Some(false), "contradicts"),
        ] {
            let e = ChatOptions::new(vars(v), thinking).unwrap_err().to_string();
            assert!(e.contains(says), "{e}");
        }
    }
}
