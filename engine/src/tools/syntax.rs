//! The call syntaxes models are trained on, told from their chat templates:
//! each has its own grammar rules and its own way to be read back.
//!
//! ```text
//!  Hermes (Qwen 2.5/3, the generic prompt): <tool_call>\n{"name": …, "arguments": {…}}\n</tool_call>, one per line
//!  Llama 3 (3.1–3.3 JSON tool calling):     {"name": …, "parameters": {…}}, one call
//!  Mistral (v3 templates):                  [TOOL_CALLS][{"name": …, "arguments": {…}}, …]
//! ```

use serde_json::{Value, json};

use super::ToolCall;
use crate::chat::ChatTemplate;
use crate::error::{Error, Result};

/// How a model writes its calls.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CallSyntax {
    /// Each call in `<tool_call>` tags, one per line.
    Hermes,
    /// One bare JSON object, the arguments under `parameters` (Llama 3.1,
    /// 3.2 and 3.3 templates' JSON tool calling).
    Llama3,
    /// `[TOOL_CALLS]` and a JSON array of calls (Mistral's v3 templates).
    Mistral,
}

/// Opens a Hermes call.
pub const OPEN: &str = "<tool_call>";
/// Closes a Hermes call.
pub const CLOSE: &str = "</tool_call>";
/// Opens Mistral's calls.
pub const MISTRAL_CALLS: &str = "[TOOL_CALLS]";
/// Llama 3's tag before a call (built-in tools; JSON calls may carry it too).
pub const PYTHON_TAG: &str = "<|python_tag|>";

/// The next JSON value at the start of `s` (after whitespace): the value and
/// how many bytes it took; `None` when `s` ends before the value does.
fn next_json(s: &str) -> Result<Option<(Value, usize)>> {
    let mut values = serde_json::Deserializer::from_str(s).into_iter::<Value>();
    match values.next() {
        Some(Ok(v)) => Ok(Some((v, values.byte_offset()))),
        Some(Err(e)) if e.is_eof() => Ok(None),
        None => Ok(None),
        Some(Err(e)) => Err(Error::InvalidInput(format!(
            "a tool call is not JSON ({e}): {s}"
        ))),
    }
}

impl CallSyntax {
    /// The syntax `template` speaks when it presents tools itself; none
    /// when it does not (the generic prompt is used then).
    pub fn native(template: &ChatTemplate) -> Option<CallSyntax> {
        let source = template.source();
        if !source.contains("tools") {
            return None;
        }
        if source.contains(MISTRAL_CALLS) {
            Some(CallSyntax::Mistral)
        } else if source.contains(OPEN) {
            Some(CallSyntax::Hermes)
        } else if source.contains(PYTHON_TAG) || source.contains("ipython") {
            Some(CallSyntax::Llama3)
        } else {
            None
        }
    }

    /// The syntax of answers for `template`: its own, else the generic
    /// prompt's (Hermes).
    pub fn of(template: &ChatTemplate) -> CallSyntax {
        CallSyntax::native(template).unwrap_or(CallSyntax::Hermes)
    }

    /// The key a call's arguments go under.
    pub fn arguments_key(self) -> &'static str {
        match self {
            CallSyntax::Llama3 => "parameters",
            CallSyntax::Hermes | CallSyntax::Mistral => "arguments",
        }
    }

    /// What the calls start with; an answer in text may not start so.
    fn opening(self) -> &'static str {
        match self {
            CallSyntax::Hermes => OPEN,
            CallSyntax::Llama3 => "{",
            CallSyntax::Mistral => MISTRAL_CALLS,
        }
    }

    /// Lark rules for `calls` (whose JSON follows `schema`), and the rule
    /// for the `TEXT` an answer may give instead (it cannot start like
    /// calls).
    pub fn rules(self, schema: &Value, parallel: bool) -> (String, String) {
        let call = match self {
            CallSyntax::Hermes => format!("call: \"{OPEN}\\n\" %json {schema} \"\\n{CLOSE}\""),
            CallSyntax::Llama3 | CallSyntax::Mistral => format!("call: %json {schema}"),
        };
        let calls = match (self, parallel) {
            (CallSyntax::Hermes, true) => "calls: call (\"\\n\" call)*",
            // Llama 3's templates read one call per answer.
            (CallSyntax::Hermes, false) | (CallSyntax::Llama3, _) => "calls: call",
            (CallSyntax::Mistral, true) => "calls: \"[TOOL_CALLS][\" call (\", \" call)* \"]\"",
            (CallSyntax::Mistral, false) => "calls: \"[TOOL_CALLS][\" call \"]\"",
        };
        let first = match self {
            CallSyntax::Hermes => "<",
            CallSyntax::Llama3 => "{",
            CallSyntax::Mistral => "\\[",
        };
        (
            format!("{calls}\n{call}\n"),
            format!("TEXT: /[^{first}\\s][\\s\\S]*/\n"),
        )
    }

    /// Where an answer's start stands: calls, text, or not yet known.
    pub(super) fn starts_calls(self, start: &str) -> Option<bool> {
        let opening = self.opening();
        let t = start.trim_start();
        let t = match self {
            CallSyntax::Llama3 => t.strip_prefix(PYTHON_TAG).unwrap_or(t).trim_start(),
            _ => t,
        };
        if t.starts_with(opening) {
            Some(true)
        } else if t.is_empty()
            || opening.starts_with(t)
            || (self == CallSyntax::Llama3 && PYTHON_TAG.starts_with(t))
        {
            None
        } else {
            Some(false)
        }
    }

    /// Takes the calls complete at the start of `pending` out of it.
    pub(super) fn take_calls(self, pending: &mut String) -> Result<Vec<ToolCall>> {
        let mut calls = Vec::new();
        match self {
            // The call's JSON is read first and the closing tag expected
            // after it: a string argument may itself hold `</tool_call>`.
            CallSyntax::Hermes => {
                while let Some(start) = pending.find(OPEN) {
                    let body = start + OPEN.len();
                    let Some((v, used)) = next_json(&pending[body..])? else {
                        break;
                    };
                    let after = &pending[body + used..];
                    let rest = after.trim_start();
                    if rest.starts_with(CLOSE) {
                        let end = body + used + (after.len() - rest.len()) + CLOSE.len();
                        calls.push(self.call_value(&v)?);
                        pending.drain(..end);
                    } else if CLOSE.starts_with(rest) {
                        break;
                    } else {
                        return Err(Error::InvalidInput(format!(
                            "a tool call's JSON is not followed by {CLOSE}: {}",
                            &pending[start..]
                        )));
                    }
                }
            }
            CallSyntax::Llama3 => loop {
                let t = pending.trim_start().trim_start_matches(PYTHON_TAG);
                let t = t.trim_start_matches(|c: char| c == ';' || c.is_whitespace());
                let skipped = pending.len() - t.len();
                match next_json(t)? {
                    Some((v, used)) => {
                        calls.push(self.call_value(&v)?);
                        pending.drain(..skipped + used);
                    }
                    None => break,
                }
            },
            CallSyntax::Mistral => {
                if let Some(at) = pending.find(MISTRAL_CALLS)
                    && let Some((v, used)) = next_json(&pending[at + MISTRAL_CALLS.len()..])?
                {
                    let list = match v {
                        Value::Array(list) => list,
                        one => vec![one],
                    };
                    for v in &list {
                        calls.push(self.call_value(v)?);
                    }
                    pending.drain(..at + MISTRAL_CALLS.len() + used);
                }
            }
        }
        Ok(calls)
    }

    /// A call's JSON: its name and arguments (under either key), with a
    /// fresh id.
    fn call_value(self, v: &Value) -> Result<ToolCall> {
        let name = v["name"]
            .as_str()
            .ok_or_else(|| Error::InvalidInput(format!("a tool call names no tool: {v}")))?;
        let arguments = match (&v[self.arguments_key()], &v["arguments"]) {
            (Value::String(s), _) | (Value::Null, Value::String(s)) => s.clone(),
            (Value::Null, Value::Null) => "{}".to_string(),
            (Value::Null, a) | (a, _) => a.to_string(),
        };
        Ok(ToolCall {
            id: super::call_id(),
            name: name.to_string(),
            arguments,
        })
    }

    /// A call id as the template wants it: Mistral's templates take ids of
    /// exactly nine letters and digits (the same id always maps the same).
    pub(super) fn template_id(self, id: &str) -> String {
        match self {
            CallSyntax::Mistral => {
                let alnum: String = id.chars().filter(char::is_ascii_alphanumeric).collect();
                let tail: String = alnum
                    .chars()
                    .rev()
                    .take(9)
                    .collect::<Vec<_>>()
                    .into_iter()
                    .rev()
                    .collect();
                format!("{tail:0>9}")
            }
            _ => id.to_string(),
        }
    }

    /// An earlier call as the answer wrote it (for the generic prompt).
    pub(super) fn call_text(self, c: &ToolCall) -> String {
        let arguments: Value = serde_json::from_str(&c.arguments).unwrap_or(Value::Null);
        let call = json!({"name": c.name, self.arguments_key(): arguments});
        match self {
            CallSyntax::Hermes => format!("{OPEN}\n{call}\n{CLOSE}"),
            CallSyntax::Llama3 => call.to_string(),
            CallSyntax::Mistral => format!("{MISTRAL_CALLS}[{call}]"),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::chat::ChatMessage;
    use crate::tools::tests::weather;
    use crate::tools::{CallDetector, render};

    const FIXTURES: [(&str, CallSyntax); 3] = [
        (
            include_str!("../../tests/fixtures/chat_templates/hermes.jinja"),
            CallSyntax::Hermes,
        ),
        (
            include_str!("../../tests/fixtures/chat_templates/llama3.jinja"),
            CallSyntax::Llama3,
        ),
        (
            include_str!("../../tests/fixtures/chat_templates/mistral.jinja"),
            CallSyntax::Mistral,
        ),
    ];

    fn template(source: &str) -> ChatTemplate {
        ChatTemplate::new(source, "<s>", "</s>").unwrap()
    }

    /// Text read piece by piece (each character a piece): the text given
    /// and the calls, and whether a call was cut.
    fn read(syntax: CallSyntax, answer: &str) -> (String, Vec<ToolCall>, bool) {
        let mut d = CallDetector::new(syntax);
        let (mut text, mut calls) = (String::new(), Vec::new());
        for c in answer.chars() {
            let (t, more) = d.push(&c.to_string()).unwrap();
            text.push_str(&t);
            calls.extend(more);
        }
        let (held, cut) = d.finish();
        (text + &held, calls, cut)
    }

    #[test]
    fn the_syntax_is_told_from_the_template() {
        for (source, syntax) in FIXTURES {
            assert_eq!(CallSyntax::native(&template(source)), Some(syntax));
        }
        let plain = template("{% for m in messages %}{{ m.content }}{% endfor %}");
        assert_eq!(CallSyntax::native(&plain), None);
        assert_eq!(CallSyntax::of(&plain), CallSyntax::Hermes);
    }

    #[test]
    fn native_templates_get_the_tools_and_earlier_calls_in_their_syntax() {
        let messages = vec![
            ChatMessage::new("user", "Weather in Paris?"),
            ChatMessage {
                tool_calls: vec![ToolCall {
                    id: "call_abcdefghijklmnop".into(),
                    name: "get_weather".into(),
                    arguments: r#"{"city":"Paris"}"#.into(),
                }],
                ..ChatMessage::new("assistant", "")
            },
            ChatMessage {
                tool_call_id: Some("call_abcdefghijklmnop".into()),
                ..ChatMessage::new("tool", "22 C")
            },
        ];
        for (source, syntax) in FIXTURES {
            let text = render(
                &template(source),
                &messages,
                Some(&weather(false)),
                &Default::default(),
            )
            .unwrap();
            assert!(
                text.contains("get_weather") && text.contains("The weather in a city"),
                "{syntax:?}: {text}"
            );
            let call = match syntax {
                CallSyntax::Hermes => {
                    "<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\"}}\n</tool_call>"
                }
                CallSyntax::Llama3 => {
                    "{\"name\": \"get_weather\", \"parameters\": {\"city\": \"Paris\"}}"
                }
                CallSyntax::Mistral => {
                    "[TOOL_CALLS][{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\"}, \"id\": \"hijklmnop\"}]"
                }
            };
            assert!(text.contains(call), "{syntax:?}: {text}");
            assert!(text.contains("22 C"), "{syntax:?}: {text}");
            if syntax == CallSyntax::Mistral {
                assert!(text.contains("\"call_id\": \"hijklmnop\""), "{text}");
            }
        }
    }

    #[test]
    fn each_syntax_is_read_back_whatever_the_pieces() {
        let paris = |c: &ToolCall| {
            serde_json::from_str::<Value>(&c.arguments).unwrap() == json!({"city": "Paris"})
                && c.name == "get_weather"
        };
        for (syntax, answer, n) in [
            (
                CallSyntax::Hermes,
                "<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\"}}\n</tool_call>",
                1,
            ),
            (
                CallSyntax::Llama3,
                "{\"name\": \"get_weather\", \"parameters\": {\"city\": \"Paris\"}}",
                1,
            ),
            (
                CallSyntax::Llama3,
                "<|python_tag|>{\"name\": \"get_weather\", \"parameters\": {\"city\": \"Paris\"}}",
                1,
            ),
            (
                CallSyntax::Mistral,
                "[TOOL_CALLS][{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\"}}, {\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\"}}]",
                2,
            ),
        ] {
            let (text, calls, cut) = read(syntax, answer);
            assert_eq!(
                (text.as_str(), calls.len(), cut),
                ("", n, false),
                "{syntax:?}: {answer}"
            );
            assert!(calls.iter().all(paris), "{calls:?}");
        }
        for syntax in [CallSyntax::Hermes, CallSyntax::Llama3, CallSyntax::Mistral] {
            let (text, calls, _) = read(syntax, "It is sunny.");
            assert_eq!((text.as_str(), calls.len()), ("It is sunny.", 0));
        }
        let (text, calls, cut) = read(CallSyntax::Mistral, "[TOOL_CALLS][{\"name\": \"get_we");
        assert_eq!((text.as_str(), calls.len(), cut), ("", 0, true));
        // A closing tag inside a string argument is the argument's.
        let (text, calls, cut) = read(
            CallSyntax::Hermes,
            "<tool_call>\n{\"name\": \"write\", \"arguments\": {\"text\": \"]}</tool_call>\"}}\n</tool_call>",
        );
        assert_eq!((text.as_str(), calls.len(), cut), ("", 1, false));
        assert_eq!(calls[0].arguments, r#"{"text":"]}</tool_call>"}"#);
        let (_, calls, cut) = read(
            CallSyntax::Hermes,
            "<tool_call>\n{\"name\": \"write\", \"arguments\": {\"text\": \"]}</tool_call>",
        );
        assert_eq!((calls.len(), cut), (0, true), "cut inside the string");
        assert!(
            CallDetector::new(CallSyntax::Llama3)
                .push("{\"name\": 1}")
                .is_err()
        );
    }

    #[test]
    fn grammars_write_each_syntax() {
        for (syntax, parallel, needle) in [
            (CallSyntax::Hermes, true, "calls: call (\"\\n\" call)*"),
            (CallSyntax::Llama3, true, "calls: call\n"),
            (
                CallSyntax::Mistral,
                true,
                "calls: \"[TOOL_CALLS][\" call (\", \" call)* \"]\"",
            ),
            (
                CallSyntax::Mistral,
                false,
                "calls: \"[TOOL_CALLS][\" call \"]\"",
            ),
        ] {
            let crate::constraint::Grammar::Lark(lark) = weather(parallel).grammar(syntax) else {
                panic!("a Lark grammar");
            };
            assert!(lark.contains(needle), "{syntax:?}: {lark}");
            assert!(
                lark.contains(&format!("\"{}\"", syntax.arguments_key())),
                "{lark}"
            );
        }
    }
}
