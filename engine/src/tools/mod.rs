//! Tool calling: the tools a chat offers are shown to the model, its calls
//! are written under a grammar so their arguments always parse and validate
//! against the tool's schema, and the calls are told apart from text as the
//! answer streams.
//!
//! ```text
//!  messages + ToolSet ─► render: the model's template with `tools` (when it
//!                        speaks a call syntax of its own) or the generic prompt
//!                     ─► grammar(syntax): start: calls | TEXT (auto), start: calls (required, named)
//!                                         calls in the syntax, each %json{name + arguments schema}
//!  text pieces ─► CallDetector(syntax) ─► text for the client, or ToolCall { id, name, arguments }
//! ```
//!
//! A template that renders `tools` and speaks one of the syntaxes of
//! [`CallSyntax`] (Hermes `<tool_call>` tags: Qwen 2.5 and 3 among others;
//! Llama 3's bare JSON; Mistral's `[TOOL_CALLS]`) is used as is, and the
//! answer is written and read in that syntax. Any other template gets the
//! generic prompt ([`ToolSet::instructions`]) in its system message, tool
//! results as user messages inside `<tool_response>`, and earlier calls
//! written in the Hermes syntax, which answers use too.

mod syntax;

use serde_json::{Value, json};

pub use self::syntax::{CLOSE, CallSyntax, MISTRAL_CALLS, OPEN, PYTHON_TAG};
use crate::chat::{ChatMessage, ChatOptions, ChatTemplate};
use crate::constraint::{Grammar, json_layout};
use crate::error::{Error, Result};

/// A tool (function) the model may call.
#[derive(Debug, Clone, PartialEq)]
pub struct Tool {
    /// Its name.
    pub name: String,
    /// What it does, for the model.
    pub description: String,
    /// The JSON Schema of its arguments.
    pub parameters: Value,
}

/// Whether the model must call a tool.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ToolChoice {
    /// Text or calls, as the model sees fit.
    Auto,
    /// At least one call.
    Required,
    /// A call of this tool.
    Function(String),
}

/// The tools of a request.
#[derive(Debug, Clone, PartialEq)]
pub struct ToolSet {
    /// The tools.
    pub tools: Vec<Tool>,
    /// Whether a call is required.
    pub choice: ToolChoice,
    /// Whether several calls may come in one answer.
    pub parallel: bool,
}

/// A call the model made.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct ToolCall {
    /// Its id (`call_…`), for the result to refer to.
    pub id: String,
    /// The tool.
    pub name: String,
    /// The arguments, as JSON text.
    pub arguments: String,
}

/// A fresh call id (`call_` and 24 letters and digits).
pub fn call_id() -> String {
    let id: String = (0..24)
        .map(|_| char::from(b"abcdefghijklmnopqrstuvwxyz0123456789"[rand::random_range(0..36)]))
        .collect();
    format!("call_{id}")
}

impl ToolSet {
    /// Checks the set: tools with distinct names that are not empty,
    /// arguments schemas that are objects, and a named choice among them.
    pub fn validate(&self) -> Result<()> {
        let bad = |m: String| Err(Error::InvalidInput(m));
        if self.tools.is_empty() {
            return bad("a tool set without tools".into());
        }
        for (i, t) in self.tools.iter().enumerate() {
            if t.name.is_empty() {
                return bad(format!("tool {i} has no name"));
            }
            if self.tools[..i].iter().any(|o| o.name == t.name) {
                return bad(format!("two tools are named {:?}", t.name));
            }
            if !t.parameters.is_object() {
                return bad(format!(
                    "the parameters of tool {:?} are not a JSON Schema object",
                    t.name
                ));
            }
        }
        if let ToolChoice::Function(name) = &self.choice
            && !self.tools.iter().any(|t| &t.name == name)
        {
            return bad(format!(
                "the tool to call, {name:?}, is not among the tools"
            ));
        }
        Ok(())
    }

    /// The schema of one call in `syntax`: the name of a callable tool and
    /// its arguments, laid out as the JSON grammar lays out any JSON.
    fn call_schema(&self, syntax: CallSyntax) -> Value {
        let callable: Vec<&Tool> = match &self.choice {
            ToolChoice::Function(name) => self.tools.iter().filter(|t| &t.name == name).collect(),
            _ => self.tools.iter().collect(),
        };
        let key = syntax.arguments_key();
        let one = |t: &Tool| {
            json!({
                "type": "object",
                "properties": {"name": {"const": t.name}, key: t.parameters},
                "required": ["name", key],
                "additionalProperties": false,
            })
        };
        json_layout(match callable.as_slice() {
            [t] => one(t),
            many => json!({"anyOf": many.iter().map(|t| one(t)).collect::<Vec<_>>()}),
        })
    }

    /// The grammar of an answer in `syntax`: calls only when one is
    /// required; with `auto`, either calls or text that does not start as
    /// calls do.
    pub fn grammar(&self, syntax: CallSyntax) -> Grammar {
        let (calls, text) = syntax.rules(&self.call_schema(syntax), self.parallel);
        Grammar::Lark(match self.choice {
            ToolChoice::Auto => format!("start: calls | TEXT\n{text}{calls}"),
            _ => format!("start: calls\n{calls}"),
        })
    }

    /// The tools as OpenAI-style function objects (what templates read).
    fn for_template(&self) -> Value {
        self.tools
            .iter()
            .map(|t| {
                json!({"type": "function", "function": {
                    "name": t.name, "description": t.description, "parameters": t.parameters,
                }})
            })
            .collect()
    }

    /// The generic prompt: the tools and how to call them, for a template
    /// that does not present tools itself.
    pub fn instructions(&self) -> String {
        let mut s = String::from(
            "You can call tools (functions) to help with the user's request. The tools:\n<tools>\n",
        );
        for t in &self.tools {
            s.push_str(
                &json!({"name": t.name, "description": t.description, "parameters": t.parameters})
                    .to_string(),
            );
            s.push('\n');
        }
        s.push_str(
            "</tools>\nTo call a tool, answer with nothing but the call:\n<tool_call>\n\
             {\"name\": \"<tool name>\", \"arguments\": {<the arguments as JSON>}}\n</tool_call>\n",
        );
        if self.parallel {
            s.push_str("Several calls go one per line.\n");
        }
        s.push_str("A tool's result comes back inside <tool_response></tool_response>.");
        s
    }
}

/// Renders a conversation that offers `tools` (or, without them, one that
/// holds earlier calls and results): with the model's own template when it
/// presents tools in a syntax of its own ([`CallSyntax::native`]),
/// otherwise with the generic prompt in the system message.
pub fn render(
    template: &ChatTemplate,
    messages: &[ChatMessage],
    tools: Option<&ToolSet>,
    options: &ChatOptions,
) -> Result<String> {
    let native = CallSyntax::native(template);
    // A harmony template presents tools and reads calls itself (calls and
    // results are matched by order, not id).
    if native.is_some() || crate::harmony::speaks(template.source()) {
        let template_id = |id: &str| native.map_or(id.to_string(), |s| s.template_id(id));
        let messages: Vec<Value> = messages
            .iter()
            .map(|m| {
                let mut v = json!({"role": m.role, "content": m.content});
                if !m.tool_calls.is_empty() {
                    v["tool_calls"] = m
                        .tool_calls
                        .iter()
                        .map(|c| {
                            let arguments: Value =
                                serde_json::from_str(&c.arguments).unwrap_or(Value::Null);
                            json!({"id": template_id(&c.id), "type": "function",
                                   "function": {"name": c.name, "arguments": arguments}})
                        })
                        .collect();
                }
                if let Some(id) = &m.tool_call_id {
                    v["tool_call_id"] = json!(template_id(id));
                }
                v
            })
            .collect();
        let tools = tools.map(ToolSet::for_template);
        return template.render_json(&Value::Array(messages), tools.as_ref(), true, options);
    }
    let mut out: Vec<ChatMessage> = Vec::with_capacity(messages.len() + 1);
    let mut rest = messages;
    if let Some(tools) = tools {
        let instructions = tools.instructions();
        match messages.first() {
            Some(first) if first.role == "system" => {
                out.push(ChatMessage::new(
                    "system",
                    format!("{}\n\n{instructions}", first.content),
                ));
                rest = &messages[1..];
            }
            _ => out.push(ChatMessage::new("system", instructions)),
        }
    }
    for m in rest {
        if m.role == "tool" {
            out.push(ChatMessage::new(
                "user",
                format!("<tool_response>\n{}\n</tool_response>", m.content),
            ));
        } else if !m.tool_calls.is_empty() {
            let mut content = m.content.clone();
            for c in &m.tool_calls {
                if !content.is_empty() {
                    content.push('\n');
                }
                content.push_str(&CallSyntax::Hermes.call_text(c));
            }
            out.push(ChatMessage::new(m.role.clone(), content));
        } else {
            out.push(ChatMessage::new(m.role.clone(), m.content.clone()));
        }
    }
    template.render_with(&out, true, options)
}

/// Where an answer stands: not yet known, text, or calls.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Mode {
    Undecided,
    Text,
    Calls,
}

/// Tells an answer's calls from its text as it streams: text passes as
/// soon as it cannot be the start of a call; a call is held until it
/// closes, then returned parsed.
#[derive(Debug)]
pub struct CallDetector {
    syntax: CallSyntax,
    mode: Mode,
    pending: String,
    calls: usize,
}

impl CallDetector {
    /// A detector at the start of an answer written in `syntax`.
    pub fn new(syntax: CallSyntax) -> Self {
        CallDetector {
            syntax,
            mode: Mode::Undecided,
            pending: String::new(),
            calls: 0,
        }
    }

    /// Whether the answer has called tools.
    pub fn called(&self) -> bool {
        self.calls > 0
    }

    /// Takes the next piece of the answer's text: the text to give now and
    /// the calls completed with it.
    pub fn push(&mut self, text: &str) -> Result<(String, Vec<ToolCall>)> {
        if self.mode == Mode::Text {
            return Ok((text.to_string(), Vec::new()));
        }
        self.pending.push_str(text);
        if self.mode == Mode::Undecided {
            match self.syntax.starts_calls(&self.pending) {
                Some(true) => self.mode = Mode::Calls,
                None => return Ok((String::new(), Vec::new())),
                Some(false) => {
                    self.mode = Mode::Text;
                    return Ok((std::mem::take(&mut self.pending), Vec::new()));
                }
            }
        }
        let calls = self.syntax.take_calls(&mut self.pending)?;
        self.calls += calls.len();
        Ok((String::new(), calls))
    }

    /// Ends the answer: the text still held (an answer that only looked
    /// like the start of a call), and whether a call was left unfinished
    /// (cut by the token limit). An unfinished call is dropped, never given
    /// as text: the answer then ended by its length, not by calling.
    pub fn finish(self) -> (String, bool) {
        match self.mode {
            Mode::Calls => (String::new(), !self.pending.trim().is_empty()),
            _ => (self.pending, false),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A required call of `get_weather(city)`.
    pub(super) fn weather(parallel: bool) -> ToolSet {
        ToolSet {
            tools: vec![Tool {
                name: "get_weather".into(),
                description: "The weather in a city".into(),
                parameters: json!({"type": "object", "properties": {"city": {"type": "string"}},
                                   "required": ["city"]}),
            }],
            choice: ToolChoice::Required,
            parallel,
        }
    }

    #[test]
    fn calls_are_told_from_text_as_the_answer_streams() {
        let mut d = CallDetector::new(CallSyntax::Hermes);
        let mut calls = Vec::new();
        for piece in [
            "  <tool",
            "_call>\n{\"name\": \"get_weather\", ",
            "\"arguments\": {\"city\": \"Paris\"}}\n</tool_call>",
            "\n<tool_call>\n{\"name\": \"f\", \"arguments\": {}}\n</tool_call>",
        ] {
            let (text, c) = d.push(piece).unwrap();
            assert_eq!(text, "");
            calls.extend(c);
        }
        assert_eq!(calls.len(), 2);
        assert_eq!(
            (calls[0].name.as_str(), calls[0].arguments.as_str()),
            ("get_weather", r#"{"city":"Paris"}"#)
        );
        assert!(calls[0].id.starts_with("call_") && calls[0].id != calls[1].id);
        assert!(d.called());
        assert_eq!(d.finish(), (String::new(), false));
        // A call the limit cut short is dropped, and says so.
        let mut d = CallDetector::new(CallSyntax::Hermes);
        let (_, whole) = d
            .push("<tool_call>\n{\"name\": \"f\", \"arguments\": {}}\n</tool_call>\n<tool_call>\n{\"na")
            .unwrap();
        assert_eq!(whole.len(), 1);
        assert_eq!(d.finish(), (String::new(), true));

        let mut d = CallDetector::new(CallSyntax::Hermes);
        assert_eq!(d.push("<to").unwrap().0, "");
        assert_eq!(d.push("day is sunny").unwrap().0, "<today is sunny");
        assert_eq!(d.push(", warm").unwrap().0, ", warm");
        assert!(!d.called());
        let mut d = CallDetector::new(CallSyntax::Hermes);
        assert_eq!(d.push("<tool_ca").unwrap().0, "");
        assert_eq!(d.finish(), ("<tool_ca".to_string(), false));
        assert!(
            CallDetector::new(CallSyntax::Hermes)
                .push("<tool_call>nope</tool_call>")
                .is_err()
        );
    }

    /// An assistant's call of `get_weather` for Paris.
    fn called_paris() -> ChatMessage {
        ChatMessage {
            tool_calls: vec![ToolCall {
                id: "call_1".into(),
                name: "get_weather".into(),
                arguments: r#"{"city":"Paris"}"#.into(),
            }],
            ..ChatMessage::new("assistant", "")
        }
    }

    #[test]
    fn tool_sets_are_checked() {
        weather(false).validate().unwrap();
        let mut bad = weather(false);
        bad.choice = ToolChoice::Function("nope".into());
        assert!(bad.validate().unwrap_err().to_string().contains("nope"));
        let mut bad = weather(false);
        bad.tools.push(bad.tools[0].clone());
        assert!(bad.validate().is_err());
        let mut bad = weather(false);
        bad.tools[0].parameters = json!([1]);
        assert!(bad.validate().is_err());
    }

    #[test]
    fn the_generic_prompt_goes_in_the_system_message_and_results_come_as_user_turns() {
        let template = ChatTemplate::new(
            "{% for m in messages %}[{{ m.role }}]{{ m.content }}\n{% endfor %}",
            "",
            "",
        )
        .unwrap();
        assert_eq!(CallSyntax::native(&template), None);
        let messages = vec![
            ChatMessage::new("user", "Weather in Paris?"),
            called_paris(),
            ChatMessage {
                tool_call_id: Some("call_1".into()),
                ..ChatMessage::new("tool", "22 C")
            },
        ];
        let text = render(
            &template,
            &messages,
            Some(&weather(false)),
            &Default::default(),
        )
        .unwrap();
        assert!(text.starts_with("[system]You can call tools"), "{text}");
        assert!(text.contains("\"name\":\"get_weather\""), "{text}");
        assert!(text.contains("[assistant]<tool_call>\n{\"arguments\":{\"city\":\"Paris\"},\"name\":\"get_weather\"}\n</tool_call>")
            || text.contains("[assistant]<tool_call>\n{\"name\":\"get_weather\",\"arguments\":{\"city\":\"Paris\"}}\n</tool_call>"), "{text}");
        assert!(
            text.contains("[user]<tool_response>\n22 C\n</tool_response>"),
            "{text}"
        );
    }

    #[test]
    fn a_template_that_speaks_tools_gets_them() {
        let template = ChatTemplate::new(
            "{% if tools %}<tools>{% for t in tools %}{{ t.function.name }};{% endfor %}</tools> answer in <tool_call>{% endif %}\
             {% for m in messages %}[{{ m.role }}]{{ m.content }}{% if m.tool_calls %}{% for c in m.tool_calls %}<tool_call>{{ c.function.arguments | tojson }}</tool_call>{% endfor %}{% endif %}\n{% endfor %}",
            "",
            "",
        )
        .unwrap();
        assert_eq!(CallSyntax::native(&template), Some(CallSyntax::Hermes));
        let messages = vec![ChatMessage::new("user", "Weather?"), called_paris()];
        let text = render(
            &template,
            &messages,
            Some(&weather(false)),
            &Default::default(),
        )
        .unwrap();
        assert!(text.starts_with("<tools>get_weather;</tools>"), "{text}");
        assert!(
            text.contains(r#"<tool_call>{"city":"Paris"}</tool_call>"#)
                || text.contains(r#"<tool_call>{"city": "Paris"}</tool_call>"#),
            "{text}"
        );
    }
}
