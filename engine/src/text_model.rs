//! The text side of a model: its tokenizer, its chat template, and how its
//! answers are written (plain text with `<think>` reasoning, or gpt-oss's
//! harmony messages), read from a GGUF file or a safetensors model
//! directory.
//!
//! ```text
//!  GGUF header ───────────────────────────────┐
//!  tokenizer.json, tokenizer_config.json,     ├─► TextModel { tokenizer (stop tokens,
//!  chat_template.jinja, config.json,          │               markup kept?), template,
//!  generation_config.json ────────────────────┘               harmony? } ─► prompts, grammars
//! ```

use std::sync::OnceLock;

use serde_json::Value;

use crate::chat::{ChatMessage, ChatOptions, ChatTemplate};
use crate::constraint::{Constraint, Grammar, Grammars};
use crate::error::{Error, Result};
use crate::gguf::GgufFile;
use crate::harmony;
use crate::tokenizer::{TOKENIZER_FILES, Tokenizer};
use crate::tools::{CallSyntax, ToolSet};

/// The text-side parts of a model: tokenizer and chat template.
#[derive(Debug)]
pub struct TextModel {
    /// The tokenizer.
    pub tokenizer: Tokenizer,
    /// The chat template.
    pub template: ChatTemplate,
    /// The grammar compiler for this tokenizer, built on first use.
    grammars: OnceLock<Grammars>,
}

/// The ids of `value` (`eos_token_id`: one id or a list).
fn ids(value: Option<&Value>) -> Vec<u32> {
    match value {
        Some(Value::Array(ids)) => ids
            .iter()
            .filter_map(Value::as_u64)
            .map(|v| v as u32)
            .collect(),
        Some(v) => v.as_u64().map(|v| v as u32).into_iter().collect(),
        None => Vec::new(),
    }
}

/// The default template among a `chat_template` list of named templates
/// (`[{"name": "default", "template": …}, …]`), or the one template.
fn template_source(value: &Value) -> Option<&str> {
    match value {
        Value::String(s) => Some(s),
        Value::Array(list) => list
            .iter()
            .find(|t| t["name"] == "default")
            .or_else(|| list.first())
            .and_then(|t| t["template"].as_str()),
        _ => None,
    }
}

impl TextModel {
    /// A model's text side; a template in the harmony format makes its
    /// answers keep their markup and end on `<|return|>` and `<|call|>`
    /// (never on `<|end|>`).
    fn new(mut tokenizer: Tokenizer, template: ChatTemplate) -> Self {
        let harmony = harmony::speaks(template.source());
        tokenizer.set_keeps_markup(harmony);
        if harmony {
            let stops: Vec<u32> = [harmony::RETURN, harmony::CALL]
                .iter()
                .filter_map(|t| tokenizer.token_id(t))
                .collect();
            tokenizer.add_stop_tokens(&stops);
            // `<|end|>` ends a message, not the answer (GGUF files may name
            // it as their end-of-turn token).
            if let Some(end) = tokenizer.token_id(harmony::END) {
                tokenizer.remove_stop_tokens(&[end]);
            }
        }
        TextModel {
            tokenizer,
            template,
            grammars: OnceLock::new(),
        }
    }

    /// Whether the model answers in the harmony format (gpt-oss).
    pub fn harmony(&self) -> bool {
        self.tokenizer.keeps_markup()
    }

    /// Compiles `grammar` for this model's tokenizer (the first call reads
    /// the vocabulary).
    pub fn constraint(&self, grammar: &Grammar) -> Result<Constraint> {
        let grammars = match self.grammars.get() {
            Some(g) => g,
            None => {
                let built = Grammars::new(&self.tokenizer)?;
                self.grammars.get_or_init(|| built)
            }
        };
        grammars.compile(grammar)
    }

    /// The grammar an answer follows: the request's own (`answer`), or its
    /// tools' calls in the model's syntax, or none. The two cannot go
    /// together. A chat (`chat`: its options) with a harmony model keeps
    /// the format around either, without reasoning when it is off.
    pub fn answer_grammar(
        &self,
        answer: Option<Grammar>,
        tools: Option<&ToolSet>,
        chat: Option<&ChatOptions>,
    ) -> Result<Option<Grammar>> {
        match (answer, tools, chat.filter(|_| self.harmony())) {
            (Some(_), Some(_), _) => Err(Error::InvalidInput(
                "an output grammar cannot go with tools: the answer's grammar is the tools'".into(),
            )),
            (None, None, _) => Ok(None),
            (answer, tools, Some(harmony_chat)) => {
                let reasoning = harmony_chat.thinking() != Some(false);
                harmony::grammar(tools, answer.as_ref(), reasoning).map(Some)
            }
            (answer, None, None) => Ok(answer),
            (None, Some(tools), None) => Ok(Some(tools.grammar(CallSyntax::of(&self.template)))),
        }
    }

    /// Builds both from a GGUF file.
    pub fn from_gguf(file: &GgufFile) -> Result<Self> {
        let tokenizer = Tokenizer::from_gguf(file.header())?;
        let name = |id: Option<u32>| id.and_then(|i| tokenizer.token(i)).unwrap_or_default();
        let bos = name(tokenizer.bos_token());
        let eos = name(tokenizer.stop_tokens().first().copied());
        let template = ChatTemplate::from_gguf(file.header(), &bos, &eos)?;
        Ok(TextModel::new(tokenizer, template))
    }

    /// Builds both from a model directory in the safetensors layouts:
    /// `tokenizer.json` (or tiktoken ranks, `tiktoken.model`, with the
    /// special tokens `tokenizer_config.json` names, as Kimi K2 keeps its
    /// tokenizer); `tokenizer_config.json` for BOS, EOS and the chat
    /// template (`chat_template.jinja`, or `chat_template.json`, when the
    /// template is kept apart); stop tokens from the `eos_token_id` of
    /// `config.json` and `generation_config.json`.
    pub fn from_dir(dir: &std::path::Path) -> Result<Self> {
        let read_text = |name: &str| -> Result<Option<String>> {
            let path = dir.join(name);
            match std::fs::read_to_string(&path) {
                Ok(text) => Ok(Some(text)),
                Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(None),
                Err(source) => Err(Error::Io { path, source }),
            }
        };
        let read = |name: &str| -> Result<Option<Value>> {
            read_text(name)?
                .map(|text| {
                    serde_json::from_str(&text).map_err(|e| Error::CorruptModel {
                        path: dir.join(name),
                        reason: e.to_string(),
                    })
                })
                .transpose()
        };
        let required = |name: &str| -> Result<Value> {
            read(name)?.ok_or_else(|| Error::Io {
                path: dir.join(name),
                source: std::io::ErrorKind::NotFound.into(),
            })
        };
        let tok_cfg = required("tokenizer_config.json")?;
        let config = required("config.json")?;
        let generation = read("generation_config.json")?;
        let token_name = |key: &str| -> Option<String> {
            match tok_cfg.get(key) {
                Some(Value::String(s)) => Some(s.clone()),
                // {"content": "<s>", ...} objects in older files.
                Some(v) => v.get("content").and_then(|c| c.as_str()).map(String::from),
                None => None,
            }
        };
        let mut eos = ids(config.get("eos_token_id"));
        eos.extend(ids(generation.as_ref().and_then(|g| g.get("eos_token_id"))));
        // `tokenizer.json`, or tiktoken ranks (Kimi K2); built once, its
        // BOS and stop tokens set once they are known.
        let [json, tiktoken] = TOKENIZER_FILES.map(|name| dir.join(name));
        let mut tokenizer = match json.is_file() || !tiktoken.is_file() {
            true => Tokenizer::from_file(&json, &[], None)?,
            false => Tokenizer::from_tiktoken(&tiktoken, &tok_cfg, &[], None)?,
        };
        let bos_name = token_name("bos_token");
        let eos_name = token_name("eos_token");
        let bos = config
            .get("bos_token_id")
            .and_then(|v| v.as_u64())
            .map(|v| v as u32)
            .or_else(|| bos_name.as_deref().and_then(|n| tokenizer.token_id(n)));
        if let Some(id) = eos_name.as_deref().and_then(|n| tokenizer.token_id(n)) {
            eos.push(id);
        }
        tokenizer.add_stop_tokens(&eos);
        tokenizer.set_bos_token(bos);
        tokenizer
            .set_adds_bos(tok_cfg.get("add_bos_token").and_then(|v| v.as_bool()) == Some(true));
        let kept_apart = read("chat_template.json")?;
        let source = match read_text("chat_template.jinja")? {
            Some(source) => source,
            None => tok_cfg
                .get("chat_template")
                .or_else(|| kept_apart.as_ref().and_then(|c| c.get("chat_template")))
                .and_then(template_source)
                .map(String::from)
                .ok_or_else(|| Error::MissingMetadata {
                    what: format!(
                        "a chat template in {} (or chat_template.jinja beside it)",
                        dir.join("tokenizer_config.json").display()
                    ),
                    detail: "none is there".into(),
                })?,
        };
        let template = ChatTemplate::new(
            &source,
            bos_name.as_deref().unwrap_or_default(),
            eos_name.as_deref().unwrap_or_default(),
        )?;
        Ok(TextModel::new(tokenizer, template))
    }

    /// The same tokenizer with another chat template (one given apart from
    /// the model's files).
    pub fn with_template(&self, template: ChatTemplate) -> TextModel {
        TextModel::new(self.tokenizer.clone(), template)
    }

    /// Token ids of a conversation, ready for the assistant's reply.
    pub fn chat_prompt(&self, messages: &[ChatMessage]) -> Result<Vec<u32>> {
        self.conversation_prompt(messages, None, &ChatOptions::default())
    }

    /// Token ids of a chat prompt that offers `tools`, or holds earlier tool
    /// calls and results (see [`crate::tools::render`]).
    pub fn tool_prompt(
        &self,
        messages: &[ChatMessage],
        tools: Option<&ToolSet>,
    ) -> Result<Vec<u32>> {
        self.conversation_prompt(messages, tools, &ChatOptions::default())
    }

    /// Token ids of a conversation rendered with `options`: with the
    /// tools' prompt when it offers `tools` or holds earlier calls and
    /// results, with the plain template otherwise.
    pub fn conversation_prompt(
        &self,
        messages: &[ChatMessage],
        tools: Option<&ToolSet>,
        options: &ChatOptions,
    ) -> Result<Vec<u32>> {
        let mut text = if tools.is_some() || messages.iter().any(ChatMessage::is_tool_exchange) {
            crate::tools::render(&self.template, messages, tools, options)?
        } else {
            self.template.render_with(messages, true, options)?
        };
        if self.harmony() && options.thinking() == Some(false) {
            harmony::skip_reasoning(&mut text);
        }
        // The template writes BOS itself where the model wants it.
        self.tokenizer.encode(&text, false)
    }

    /// Token ids of a raw prompt (BOS added where the model wants it).
    pub fn raw_prompt(&self, prompt: &str) -> Result<Vec<u32>> {
        self.tokenizer.encode(prompt, true)
    }
}
