//! An answer's text told apart as it streams: reasoning, the answer, and
//! tool calls, each read in the model's own format. Head stages give the
//! three apart to the gateway; `generate --chat` reads a harmony model's
//! answers with it too.
//!
//! ```text
//!  plain:   text ─► ThinkSplitter (<think>…</think>) ─► CallDetector (the template's call syntax) ─► Split
//!  harmony: text, markup kept ─► HarmonyReader (channels and recipients) ─────────────────────────► Split
//! ```

use crate::error::Result;
use crate::harmony::{self, HarmonyReader};
use crate::reasoning::{THINK_CLOSE, ThinkSplitter, prompt_opens_reasoning};
use crate::text_model::TextModel;
use crate::tools::{CallDetector, CallSyntax, ToolCall};

/// A piece of an answer, told apart.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct Split {
    /// Reasoning text.
    pub reasoning: String,
    /// Answer text.
    pub text: String,
    /// Calls completed with the piece.
    pub tool_calls: Vec<ToolCall>,
    /// Whether the answer is inside its reasoning after the piece.
    pub thinking: bool,
}

/// How an answer ended.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct Ending {
    /// What the reader still held.
    pub split: Split,
    /// Whether the answer called tools.
    pub called: bool,
    /// Whether a call was cut short by the token limit (and dropped).
    pub cut: bool,
}

enum Inner {
    Plain {
        thoughts: Option<ThinkSplitter>,
        calls: Option<CallDetector>,
    },
    Harmony(HarmonyReader),
}

/// Reads one answer's text as it streams.
pub struct AnswerReader {
    inner: Inner,
    opened: bool,
}

impl AnswerReader {
    /// A reader for an answer of `text`'s model to `prompt`: `chat` when the
    /// prompt is a chat (only then are reasoning and calls told apart),
    /// `tools` when the chat offered tools.
    pub fn new(text: &TextModel, prompt: &[u32], chat: bool, tools: bool) -> Self {
        // The prompt's last tokens, special ones spelled out.
        let tail = |n: usize| {
            text.tokenizer
                .decode(&prompt[prompt.len().saturating_sub(n)..], false)
                .unwrap_or_default()
        };
        if chat && text.harmony() {
            // A generation prompt leaves the model at the answer's first
            // header; a prompt that began the answer itself, inside it.
            let at_header = tail(16).ends_with(harmony::ASSISTANT_TURN);
            return AnswerReader {
                inner: Inner::Harmony(HarmonyReader::after(tools, at_header)),
                opened: false,
            };
        }
        // R1-style templates end the generation prompt with `<think>`.
        let opened = chat && prompt_opens_reasoning(&tail(4));
        AnswerReader {
            inner: Inner::Plain {
                thoughts: chat.then(|| ThinkSplitter::new(opened)),
                calls: tools.then(|| CallDetector::new(CallSyntax::of(&text.template))),
            },
            opened,
        }
    }

    /// Whether the prompt left the model inside its reasoning.
    pub fn opened_reasoning(&self) -> bool {
        self.opened
    }

    /// The text that ends the reasoning at once (a thinking budget spent).
    pub fn reasoning_close(&self) -> String {
        match self.inner {
            Inner::Harmony(_) => harmony::CLOSE_REASONING.to_string(),
            Inner::Plain { .. } => format!("\n{THINK_CLOSE}\n\n"),
        }
    }

    fn thinking(&self) -> bool {
        match &self.inner {
            Inner::Harmony(h) => h.in_reasoning(),
            Inner::Plain { thoughts, .. } => {
                thoughts.as_ref().is_some_and(ThinkSplitter::in_reasoning)
            }
        }
    }

    /// Takes the next piece of the answer's text.
    pub fn push(&mut self, piece: &str) -> Result<Split> {
        let (reasoning, text, tool_calls) = match &mut self.inner {
            Inner::Harmony(h) => {
                let read = h.push(piece)?;
                (read.reasoning, read.text, read.calls)
            }
            Inner::Plain { thoughts, calls } => {
                let (reasoning, text) = match thoughts {
                    Some(t) => t.push(piece),
                    None => (String::new(), piece.to_string()),
                };
                let (text, tool_calls) = match calls {
                    Some(d) => d.push(&text)?,
                    None => (text, Vec::new()),
                };
                (reasoning, text, tool_calls)
            }
        };
        Ok(Split {
            reasoning,
            text,
            tool_calls,
            thinking: self.thinking(),
        })
    }

    /// Ends the answer; `stopped` when it ended on a stop token or string
    /// rather than at the token limit.
    pub fn finish(self, stopped: bool) -> Result<Ending> {
        match self.inner {
            Inner::Harmony(h) => {
                let called = h.called();
                let (read, cut) = h.finish(stopped)?;
                Ok(Ending {
                    called: called || !read.calls.is_empty(),
                    cut,
                    split: Split {
                        reasoning: read.reasoning,
                        text: read.text,
                        tool_calls: read.calls,
                        thinking: false,
                    },
                })
            }
            Inner::Plain { thoughts, calls } => {
                // What the splitter still holds: reasoning cut short, or text.
                let (reasoning, held) = match thoughts {
                    Some(t) => t.finish(),
                    None => (String::new(), String::new()),
                };
                let mut split = Split {
                    reasoning,
                    ..Split::default()
                };
                let (called, cut) = match calls {
                    Some(mut d) => {
                        let (text, more) = d.push(&held)?;
                        split.text.push_str(&text);
                        split.tool_calls = more;
                        let called = d.called();
                        let (held, cut) = d.finish();
                        split.text.push_str(&held);
                        (called, cut)
                    }
                    None => {
                        split.text = held;
                        (false, false)
                    }
                };
                Ok(Ending { split, called, cut })
            }
        }
    }
}
