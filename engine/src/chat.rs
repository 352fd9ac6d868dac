//! Chat templates: the Jinja template a model ships (GGUF
//! `tokenizer.chat_template`), rendered with minijinja for OpenAI-style messages.

use minijinja::{Environment, ErrorKind, context};
use serde::{Deserialize, Serialize};
use shardplane_formats::GgufHeader;

use crate::error::{Error, Result};
use crate::tools::ToolCall;

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

impl ChatTemplate {
    /// Compiles `source` as Hugging Face does (trimmed blocks, Python string methods).
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

    /// The template's Jinja source.
    pub fn source(&self) -> &str {
        &self.source
    }

    /// Renders a conversation; with `add_generation_prompt` the text ends where
    /// the assistant's reply begins.
    pub fn render(&self, messages: &[ChatMessage], add_generation_prompt: bool) -> Result<String> {
        let messages =
            serde_json::to_value(messages).map_err(|e| Error::ChatTemplate(e.to_string()))?;
        self.render_json(&messages, None, add_generation_prompt)
    }

    /// Renders messages given as JSON (OpenAI's shapes, `tool_calls`
    /// included), with `tools` (OpenAI function objects) when given.
    pub fn render_json(
        &self,
        messages: &serde_json::Value,
        tools: Option<&serde_json::Value>,
        add_generation_prompt: bool,
    ) -> Result<String> {
        if messages.as_array().is_none_or(|m| m.is_empty()) {
            return Err(Error::ChatTemplate(
                "a conversation needs at least one message".into(),
            ));
        }
        let template = self.env.get_template("chat").expect("added in new");
        let base = context! {
            messages => minijinja::Value::from(minijinja::value::Serde(messages)),
            add_generation_prompt => add_generation_prompt,
            bos_token => self.bos_token.as_str(),
            eos_token => self.eos_token.as_str(),
        };
        // `tools` is left undefined when there are none, as templates expect.
        let ctx = match tools {
            Some(t) => {
                context! { tools => minijinja::Value::from(minijinja::value::Serde(t)), ..base }
            }
            None => base,
        };
        template
            .render(ctx)
            .map_err(|e| Error::ChatTemplate(e.to_string()))
    }
}
