//! gpt-oss's harmony format: an answer is a run of messages, each with a
//! header that names its channel (and, for a call, its recipient), so the
//! reasoning, the answer and the tool calls are told apart by the markup
//! the model writes, not by tags in its text.
//!
//! ```text
//!  prompt … <|start|>assistant
//!  answer   <|channel|>analysis<|message|>reasoning…<|end|>
//!           <|start|>assistant<|channel|>final<|message|>the answer…<|return|>
//!       or  <|start|>assistant<|channel|>commentary to=functions.NAME <|constrain|>json<|message|>{args}<|call|>
//!  text (markup kept) ─► HarmonyReader::push ─► reasoning │ answer text │ ToolCall
//! ```
//!
//! `analysis` is reasoning; `final`, and `commentary` without a recipient
//! (a preamble before calls), are the answer; a message to `functions.NAME`
//! is a call of NAME. `<|return|>` and `<|call|>` end the answer (they are
//! stop tokens). A model speaks harmony when its chat template writes
//! `<|channel|>` and `<|message|>`; its output text then keeps the special
//! tokens, which the reader needs.
//!
//! Answers under a grammar (tools, JSON output) keep the format:
//! [`grammar`] lets the model reason first and constrains only the final
//! message or the call.

use serde_json::Value;

use crate::constraint::{Grammar, json_layout};
use crate::error::{Error, Result};
use crate::tools::{ToolCall, ToolChoice, ToolSet};

/// Starts a message (its role follows).
pub const START: &str = "<|start|>";
/// Ends a message that does not end the answer.
pub const END: &str = "<|end|>";
/// Separates a message's header from its text.
pub const MESSAGE: &str = "<|message|>";
/// Names a message's channel.
pub const CHANNEL: &str = "<|channel|>";
/// Names the format of a message's text (`json` for calls).
pub const CONSTRAIN: &str = "<|constrain|>";
/// Ends the answer after its final message (a stop token).
pub const RETURN: &str = "<|return|>";
/// Ends the answer after a call (a stop token).
pub const CALL: &str = "<|call|>";

/// The markers that end a message's text.
const ENDS: [&str; 3] = [END, RETURN, CALL];

/// A header longer than this is not markup: the model has left the format,
/// and what it wrote is given as text.
const MAX_HEADER: usize = 256;

/// What closes a reasoning that must end now (a thinking budget spent).
pub const CLOSE_REASONING: &str = "<|end|><|start|>assistant<|channel|>final<|message|>";

/// What a generation prompt ends with: the answer's first header follows.
pub const ASSISTANT_TURN: &str = "<|start|>assistant";

/// An empty reasoning message and the next turn: a prompt that ends so
/// leaves the model at its final message (reasoning off).
const NO_REASONING: &str = "<|channel|>analysis<|message|><|end|><|start|>assistant";

/// Turns reasoning off in a rendered generation prompt: the answer starts
/// after an empty analysis message.
pub fn skip_reasoning(prompt: &mut String) {
    if prompt.ends_with(ASSISTANT_TURN) {
        prompt.push_str(NO_REASONING);
    }
}

/// Whether a chat template writes the harmony format.
pub fn speaks(template_source: &str) -> bool {
    template_source.contains(CHANNEL) && template_source.contains(MESSAGE)
}

/// Where a message's text goes.
#[derive(Debug, Clone, PartialEq, Eq)]
enum Kind {
    Reasoning,
    Answer,
    /// A call of this tool (its recipient without `functions.`).
    Call(String),
}

/// Where the reader stands.
#[derive(Debug, Clone, PartialEq, Eq)]
enum State {
    /// In a message's header, before `<|message|>`.
    Header,
    /// In a message's text.
    Body(Kind),
}

/// What a piece of an answer gives.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct Read {
    /// Reasoning text (the `analysis` channel).
    pub reasoning: String,
    /// Answer text (`final`, and preambles on `commentary`).
    pub text: String,
    /// Calls completed with the piece.
    pub calls: Vec<ToolCall>,
}

/// Reads an answer in the harmony format as it streams.
#[derive(Debug)]
pub struct HarmonyReader {
    state: State,
    /// Text not yet given: the header so far, or the end of a message's
    /// text that could begin a marker.
    pending: String,
    /// The arguments of the call being written.
    arguments: String,
    /// Whether calls are read as calls (tools were offered); otherwise a
    /// message to a recipient is given as reasoning.
    tools: bool,
    /// Whether the current message has given no text yet.
    fresh: bool,
    /// Whether reasoning, and answer text, were given by an earlier message
    /// (a new message's text is set apart from it by a blank line).
    given: [bool; 2],
    calls: usize,
}

/// The length of the longest end of `text` that could begin one of `markers`.
fn partial_marker(text: &str, markers: &[&str]) -> usize {
    let Some(at) = text.rfind('<') else {
        return 0;
    };
    let tail = &text[at..];
    if markers
        .iter()
        .any(|m| m.starts_with(tail) && m.len() > tail.len())
    {
        text.len() - at
    } else {
        0
    }
}

/// The word after `marker` in `header` (up to whitespace or the next marker).
fn word_after<'h>(header: &'h str, marker: &str) -> Option<&'h str> {
    let at = header.find(marker)? + marker.len();
    let rest = &header[at..];
    let end = rest
        .find(|c: char| c.is_whitespace() || c == '<')
        .unwrap_or(rest.len());
    Some(&rest[..end])
}

impl HarmonyReader {
    /// A reader at an answer's start (the prompt ended with
    /// `<|start|>assistant`, so the first header follows); `tools` when the
    /// request offered tools.
    pub fn new(tools: bool) -> Self {
        Self::after(tools, true)
    }

    /// A reader at an answer's start: at a header when the prompt ended
    /// with `<|start|>assistant` (`at_header`), else inside a final message
    /// (the prompt began the answer itself).
    pub fn after(tools: bool, at_header: bool) -> Self {
        HarmonyReader {
            state: match at_header {
                true => State::Header,
                false => State::Body(Kind::Answer),
            },
            fresh: false,
            given: [false; 2],
            pending: String::new(),
            arguments: String::new(),
            tools,
            calls: 0,
        }
    }

    /// Whether the answer is in a reasoning message.
    pub fn in_reasoning(&self) -> bool {
        self.state == State::Body(Kind::Reasoning)
    }

    /// Whether the answer has called tools.
    pub fn called(&self) -> bool {
        self.calls > 0
    }

    /// The kind of the message a header opens.
    fn kind(&self, header: &str) -> Kind {
        let recipient = word_after(header, "to=").filter(|r| !r.is_empty() && *r != "assistant");
        match recipient {
            Some(r) if self.tools => Kind::Call(r.strip_prefix("functions.").unwrap_or(r).into()),
            Some(_) => Kind::Reasoning,
            None => match word_after(header, CHANNEL) {
                Some("analysis") => Kind::Reasoning,
                _ => Kind::Answer,
            },
        }
    }

    /// Gives `text` of the current message to where it goes.
    fn give(&mut self, text: &str, out: &mut Read) {
        let (slot, sink) = match &self.state {
            State::Body(Kind::Reasoning) => (0, &mut out.reasoning),
            State::Body(Kind::Answer) => (1, &mut out.text),
            State::Body(Kind::Call(_)) => return self.arguments.push_str(text),
            State::Header => return,
        };
        if text.is_empty() {
            return;
        }
        if std::mem::take(&mut self.fresh) && self.given[slot] {
            sink.push_str("\n\n");
        }
        self.given[slot] = true;
        sink.push_str(text);
    }

    /// Ends the current message; a call's arguments must be JSON.
    fn end_message(&mut self, out: &mut Read) -> Result<()> {
        if let State::Body(Kind::Call(name)) = &self.state {
            let arguments = std::mem::take(&mut self.arguments);
            let arguments = arguments.trim();
            let parsed: Value = serde_json::from_str(arguments).map_err(|e| {
                Error::InvalidInput(format!(
                    "the arguments of a call of {name:?} are not JSON ({e}): {arguments}"
                ))
            })?;
            out.calls.push(ToolCall {
                id: crate::tools::call_id(),
                name: name.clone(),
                arguments: parsed.to_string(),
            });
            self.calls += 1;
        }
        self.state = State::Header;
        Ok(())
    }

    /// Takes the next piece of the answer's text (markup included).
    pub fn push(&mut self, piece: &str) -> Result<Read> {
        let mut out = Read::default();
        self.pending.push_str(piece);
        loop {
            match self.state {
                State::Header => {
                    if let Some(at) = self.pending.find(MESSAGE) {
                        let kind = self.kind(&self.pending[..at]);
                        self.pending.drain(..at + MESSAGE.len());
                        self.state = State::Body(kind);
                        self.fresh = true;
                    } else if self.pending.len() > MAX_HEADER {
                        // Not markup: the model left the format.
                        self.state = State::Body(Kind::Answer);
                    } else {
                        break;
                    }
                }
                State::Body(_) => {
                    let end = ENDS
                        .iter()
                        .filter_map(|m| self.pending.find(m).map(|at| (at, m.len())))
                        .min();
                    if let Some((at, len)) = end {
                        let text: String = self.pending.drain(..at + len).collect();
                        self.give(&text[..at], &mut out);
                        self.end_message(&mut out)?;
                    } else {
                        let keep = partial_marker(&self.pending, &ENDS);
                        let cut = self.pending.len() - keep;
                        let text: String = self.pending.drain(..cut).collect();
                        self.give(&text, &mut out);
                        break;
                    }
                }
            }
        }
        Ok(out)
    }

    /// Ends the answer. `stopped`: it ended on a stop token (`<|call|>` and
    /// `<|return|>` end their message) or a stop string, rather than at the
    /// token limit. Returns what was still held, and whether a call was left
    /// unfinished (cut by the limit, or by a stop string inside its
    /// arguments; it is dropped, never given as text).
    pub fn finish(mut self, stopped: bool) -> Result<(Read, bool)> {
        let mut out = Read::default();
        let rest = std::mem::take(&mut self.pending);
        match &self.state {
            // Held text with no markup in it is text the model wrote without
            // a header; a header cut short is markup, not text.
            State::Header if !rest.contains("<|") => {
                self.state = State::Body(Kind::Answer);
                self.give(&rest, &mut out);
                Ok((out, false))
            }
            State::Header => Ok((out, false)),
            State::Body(Kind::Call(_)) if !stopped => Ok((out, true)),
            State::Body(Kind::Call(_)) => {
                self.give(&rest, &mut out);
                match self.end_message(&mut out) {
                    Ok(()) => Ok((out, false)),
                    // A stop string inside the arguments cut the call.
                    Err(_) => Ok((out, true)),
                }
            }
            State::Body(_) => {
                self.give(&rest, &mut out);
                self.end_message(&mut out)?;
                Ok((out, false))
            }
        }
    }
}

/// The grammar of a harmony answer: any reasoning (unless `reasoning` is
/// off) and, with tools, preambles first,
/// then, with tools, one call (required) or a call or a final message
/// (auto); without tools, a final message that follows `answer`. One call
/// per answer: `<|call|>` ends it.
pub fn grammar(
    tools: Option<&ToolSet>,
    answer: Option<&Grammar>,
    reasoning: bool,
) -> Result<Grammar> {
    let final_text = match answer {
        None => "/[\\s\\S]*/".to_string(),
        Some(Grammar::JsonObject) => {
            format!(
                "%json {}",
                json_layout(serde_json::json!({"type": "object"}))
            )
        }
        Some(Grammar::JsonSchema(schema)) => format!("%json {}", json_layout(schema.clone())),
        Some(Grammar::Regex(_) | Grammar::Lark(_)) => {
            return Err(Error::InvalidInput(
                "a regular expression or Lark grammar cannot constrain a model that answers in \
                 the harmony format (gpt-oss); JSON output (a schema or any object) can"
                    .into(),
            ));
        }
    };
    // Reasoning (when it is on), and preambles (commentary to no one)
    // before calls only: the final message alone is the answer a grammar
    // shapes.
    let channels: Vec<&str> = [
        (reasoning, "\"analysis\""),
        (tools.is_some(), "\"commentary\""),
    ]
    .into_iter()
    .filter_map(|(on, channel)| on.then_some(channel))
    .collect();
    let mut lark = match channels.is_empty() {
        true => "start: ending\n".to_string(),
        false => format!(
            "start: (aside <|end|> <|start|> \"assistant\")* ending\n\
             aside: <|channel|> ({}) <|message|> TEXT\nTEXT: /[\\s\\S]*/\n",
            channels.join(" | ")
        ),
    };
    let final_rule = format!("final: <|channel|> \"final\" <|message|> {final_text}\n");
    match tools {
        None => {
            lark.push_str("ending: final\n");
            lark.push_str(&final_rule);
        }
        Some(tools) => {
            let callable: Vec<_> = tools
                .tools
                .iter()
                .filter(|t| match &tools.choice {
                    ToolChoice::Function(name) => &t.name == name,
                    _ => true,
                })
                .collect();
            let names: Vec<String> = (0..callable.len()).map(|i| format!("call{i}")).collect();
            lark.push_str(&match tools.choice {
                ToolChoice::Auto => format!("ending: final | {}\n", names.join(" | ")),
                _ => format!("ending: {}\n", names.join(" | ")),
            });
            lark.push_str(&final_rule);
            for (rule, tool) in names.iter().zip(&callable) {
                let head = Value::String(format!("commentary to=functions.{} ", tool.name));
                lark.push_str(&format!(
                    "{rule}: <|channel|> {head} <|constrain|> \"json\" <|message|> %json {} <|call|>\n",
                    json_layout(tool.parameters.clone())
                ));
            }
        }
    }
    Ok(Grammar::Lark(lark))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::tools::Tool;

    /// Reads `pieces` whole, ended as `stopped` says.
    fn read(tools: bool, pieces: &[&str], stopped: bool) -> (Read, bool) {
        let mut r = HarmonyReader::new(tools);
        let mut all = Read::default();
        let add = |all: &mut Read, got: Read| {
            all.reasoning.push_str(&got.reasoning);
            all.text.push_str(&got.text);
            all.calls.extend(got.calls);
        };
        for p in pieces {
            let got = r.push(p).unwrap();
            add(&mut all, got);
        }
        let (got, cut) = r.finish(stopped).unwrap();
        add(&mut all, got);
        (all, cut)
    }

    fn chars(s: &str) -> Vec<String> {
        s.chars().map(String::from).collect()
    }

    #[test]
    fn reasoning_and_answer_are_told_apart_whatever_the_pieces() {
        let whole = "<|channel|>analysis<|message|>The user greets; <b> is fine.<|end|>\
                     <|start|>assistant<|channel|>final<|message|>Hello <there>!";
        for pieces in [vec![whole.to_string()], chars(whole)] {
            let pieces: Vec<&str> = pieces.iter().map(String::as_str).collect();
            let (got, cut) = read(false, &pieces, true);
            assert_eq!(got.reasoning, "The user greets; <b> is fine.");
            assert_eq!(got.text, "Hello <there>!");
            assert!(got.calls.is_empty() && !cut);
        }
    }

    #[test]
    fn calls_are_read_in_either_header_order_and_preambles_are_text() {
        let whole = "<|channel|>analysis<|message|>Need weather.<|end|>\
                     <|start|>assistant<|channel|>commentary<|message|>Checking.<|end|>\
                     <|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json\
                     <|message|>{\"city\": \"Paris\"}";
        for pieces in [vec![whole.to_string()], chars(whole)] {
            let pieces: Vec<&str> = pieces.iter().map(String::as_str).collect();
            let (got, cut) = read(true, &pieces, true);
            assert_eq!(got.reasoning, "Need weather.");
            assert_eq!(got.text, "Checking.");
            assert_eq!(got.calls.len(), 1);
            assert_eq!(got.calls[0].name, "get_weather");
            assert_eq!(got.calls[0].arguments, r#"{"city":"Paris"}"#);
            assert!(got.calls[0].id.starts_with("call_"));
            assert!(!cut);
        }
        // The recipient before the channel, as templates write history.
        let (got, _) = read(
            true,
            &["<|start|>assistant to=functions.f<|channel|>commentary json<|message|>{}<|call|>"],
            false,
        );
        assert_eq!((got.calls[0].name.as_str(), got.text.as_str()), ("f", ""));
    }

    #[test]
    fn messages_of_one_kind_are_set_apart_and_headerless_text_is_kept() {
        let (got, _) = read(
            true,
            &[
                "<|channel|>analysis<|message|>One.<|end|><|start|>assistant<|channel|>analysis",
                "<|message|>Two.<|end|><|start|>assistant<|channel|>commentary<|message|>Hm.",
                "<|end|><|start|>assistant<|channel|>final<|message|>Done.",
            ],
            true,
        );
        assert_eq!(
            (got.reasoning.as_str(), got.text.as_str()),
            ("One.\n\nTwo.", "Hm.\n\nDone.")
        );
        // A prompt that began the answer itself: the text is the answer.
        let mut r = HarmonyReader::after(false, false);
        assert_eq!(r.push("Paris.").unwrap().text, "Paris.");
        // Text the model wrote without a header is not lost at the end.
        let (got, _) = read(false, &["Paris."], true);
        assert_eq!(got.text, "Paris.");
        // A stop string inside a call's arguments cuts it.
        let (got, cut) = read(
            true,
            &["<|channel|>commentary to=functions.f <|constrain|>json<|message|>{\"a\": 1"],
            true,
        );
        assert!(got.calls.is_empty() && cut);
    }

    #[test]
    fn cut_answers_and_bad_calls_lose_nothing_silently() {
        // Cut by the limit inside a call: dropped, and said so.
        let (got, cut) = read(
            true,
            &["<|channel|>commentary to=functions.f <|constrain|>json<|message|>{\"a\""],
            false,
        );
        assert!(got.calls.is_empty() && cut);
        // Cut inside the reasoning: it stays reasoning; a header cut short is dropped.
        let (got, cut) = read(false, &["<|channel|>analysis<|message|>hmm <|e"], false);
        assert_eq!((got.reasoning.as_str(), cut), ("hmm <|e", false));
        let (got, _) = read(false, &["<|channel|>fin"], false);
        assert_eq!(got, Read::default());
        // Arguments that are not JSON are an error, not text.
        let mut r = HarmonyReader::new(true);
        let e = r
            .push("<|channel|>commentary to=functions.f<|message|>{oops<|call|>")
            .unwrap_err();
        assert!(e.to_string().contains("not JSON"), "{e}");
        // Without tools a message to a recipient is not an answer.
        let (got, _) = read(
            false,
            &["<|channel|>commentary to=functions.f<|message|>{}<|end|>"],
            true,
        );
        assert_eq!((got.reasoning.as_str(), got.calls.len()), ("{}", 0));
        // Text that never reaches <|message|> is given, not held for ever.
        let long = "x".repeat(MAX_HEADER + 1);
        let (got, _) = read(false, &[&long], true);
        assert_eq!(got.text, long);
    }

    #[test]
    fn a_harmony_template_presents_tools_and_replays_a_tool_exchange() {
        use crate::chat::{ChatMessage, ChatOptions, ChatTemplate};
        let source = include_str!("../tests/fixtures/chat_templates/harmony.jinja");
        let template = ChatTemplate::new(source, "", RETURN).unwrap();
        assert!(speaks(template.source()));
        let mut call = ChatMessage::new("assistant", "");
        call.tool_calls = vec![ToolCall {
            id: "call_1".into(),
            name: "get_weather".into(),
            arguments: r#"{"city": "Paris"}"#.into(),
        }];
        let mut result = ChatMessage::new("tool", r#"{"celsius": 20}"#);
        result.tool_call_id = Some("call_1".into());
        let messages = [
            ChatMessage::new("system", "Be brief."),
            ChatMessage::new("user", "Weather in Paris?"),
            call,
            result,
        ];
        let tools = ToolSet {
            tools: vec![Tool {
                name: "get_weather".into(),
                description: "The weather in a city".into(),
                parameters: serde_json::json!({"type": "object"}),
            }],
            choice: ToolChoice::Auto,
            parallel: false,
        };
        let mut vars = serde_json::Map::new();
        vars.insert("reasoning_effort".into(), "low".into());
        let options = ChatOptions::new(vars, None).unwrap();
        let mut text = crate::tools::render(&template, &messages, Some(&tools), &options).unwrap();
        let today = chrono::Local::now().format("%Y-%m-%d").to_string();
        for part in [
            format!("Current date: {today}\n\nReasoning: low"),
            "<|start|>developer<|message|># Instructions\n\nBe brief.".into(),
            "// The weather in a city\ntype get_weather = (_: {\"type\": \"object\"}) => any;"
                .into(),
            "<|start|>user<|message|>Weather in Paris?<|end|>".into(),
            "<|start|>assistant to=functions.get_weather<|channel|>commentary <|constrain|>json\
             <|message|>{\"city\": \"Paris\"}<|call|>"
                .into(),
            "<|start|>functions.get_weather to=assistant<|channel|>commentary\
             <|message|>{\"celsius\": 20}<|end|><|start|>assistant"
                .into(),
        ] {
            assert!(text.contains(&part), "{part:?} is not in {text}");
        }
        assert!(text.ends_with("<|start|>assistant"));
        // Reasoning off: the answer starts after an empty analysis.
        skip_reasoning(&mut text);
        assert!(text.ends_with(
            "<|start|>assistant<|channel|>analysis<|message|><|end|><|start|>assistant"
        ));
    }

    #[test]
    fn grammars_name_every_callable_tool_and_refuse_what_cannot_compose() {
        let tool = |name: &str| Tool {
            name: name.into(),
            description: String::new(),
            parameters: serde_json::json!({"type": "object"}),
        };
        let set = |choice| ToolSet {
            tools: vec![tool("a"), tool("b")],
            choice,
            parallel: true,
        };
        let Grammar::Lark(auto) = grammar(Some(&set(ToolChoice::Auto)), None, true).unwrap() else {
            panic!()
        };
        assert!(auto.contains("ending: final | call0 | call1"), "{auto}");
        assert!(auto.contains("\"commentary to=functions.b \""), "{auto}");
        let Grammar::Lark(named) =
            grammar(Some(&set(ToolChoice::Function("b".into()))), None, true).unwrap()
        else {
            panic!()
        };
        assert!(named.contains("ending: call0\n") && !named.contains("functions.a"));
        let Grammar::Lark(json) = grammar(None, Some(&Grammar::JsonObject), true).unwrap() else {
            panic!()
        };
        assert!(json.contains("<|message|> %json"), "{json}");
        let e = grammar(None, Some(&Grammar::Regex("a+".into())), true).unwrap_err();
        assert!(e.to_string().contains("harmony"), "{e}");
        // Reasoning off: no analysis; without tools, nothing before the end.
        let Grammar::Lark(off) = grammar(Some(&set(ToolChoice::Auto)), None, false).unwrap() else {
            panic!()
        };
        assert!(
            off.contains("(\"commentary\")") && !off.contains("analysis"),
            "{off}"
        );
        let Grammar::Lark(off) = grammar(None, None, false).unwrap() else {
            panic!()
        };
        assert!(
            off.starts_with("start: ending\n") && !off.contains("aside"),
            "{off}"
        );
    }
}
