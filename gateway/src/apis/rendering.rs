//! How a chat is rendered besides its messages: whether the model may
//! reason (and for how long), and further chat template variables. Each
//! dialect names these its own way; they all end in one
//! `dp::Conversation`.
//!
//! ```text
//!  OpenAI     reasoning_effort, chat_template_kwargs ─┐
//!  Responses  reasoning.effort ───────────────────────┤
//!  Anthropic  thinking {type, budget_tokens} ─────────┼─► Rendering ─► Conversation
//!  Ollama     think (bool or level) ──────────────────┘   (template_vars, thinking,
//!                                                          thinking_budget)
//! ```

use serde_json::{Map, Value};
use shardplane_dataplane as dp;

use crate::protocol::ApiError;

/// Effort levels: `none` turns thinking off; the others turn it on.
const EFFORTS: &[&str] = &["none", "minimal", "low", "medium", "high"];

/// The rendering settings a request gave.
#[derive(Debug, Default)]
pub struct Rendering {
    vars: Map<String, Value>,
    thinking: Option<bool>,
    budget: u32,
}

impl Rendering {
    /// Template variables (`chat_template_kwargs`): a JSON object whose
    /// names reach the template as they are.
    pub fn template_vars(&mut self, field: &str, v: &Value) -> Result<(), ApiError> {
        match v {
            Value::Null => Ok(()),
            Value::Object(m) => {
                self.vars.extend(m.clone());
                Ok(())
            }
            _ => Err(ApiError::invalid(format!("`{field}` must be an object"))),
        }
    }

    /// An effort level (`reasoning_effort`, `reasoning.effort`, Ollama's
    /// `think` levels): `none` turns thinking off; any other level turns it
    /// on and reaches the template as `reasoning_effort` (gpt-oss's template
    /// reads it; templates that do not simply let the model reason).
    pub fn effort(&mut self, field: &str, v: &Value) -> Result<(), ApiError> {
        match v.as_str() {
            None if v.is_null() => Ok(()),
            Some("none") => {
                self.thinking = Some(false);
                Ok(())
            }
            Some(level) if EFFORTS.contains(&level) => {
                self.thinking = Some(true);
                self.vars.insert("reasoning_effort".into(), level.into());
                Ok(())
            }
            _ => Err(ApiError::invalid(format!(
                "`{field}` {v} is not an effort level (one of {})",
                EFFORTS.join(", ")
            ))),
        }
    }

    /// Turns thinking on or off.
    pub fn thinking(&mut self, on: bool) {
        self.thinking = Some(on);
    }

    /// Bounds the reasoning to `tokens` (at least 1).
    pub fn budget(&mut self, tokens: u32) {
        self.budget = tokens;
    }

    /// The conversation of `messages`, rendered so.
    pub fn conversation(self, messages: Vec<dp::ChatMessage>) -> dp::Conversation {
        dp::Conversation {
            messages,
            template_vars: if self.vars.is_empty() {
                String::new()
            } else {
                Value::Object(self.vars).to_string()
            },
            thinking: self.thinking,
            thinking_budget: self.budget,
        }
    }
}

/// Whether a conversation asks for anything beyond the template's defaults.
pub fn is_plain(c: &dp::Conversation) -> bool {
    c.template_vars.is_empty() && c.thinking.is_none() && c.thinking_budget == 0
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::apis::{Anthropic, Dialect, Ollama, OpenAi, Request};
    use serde_json::json;

    #[test]
    fn efforts_and_variables_make_one_conversation() {
        let mut r = Rendering::default();
        r.template_vars(
            "chat_template_kwargs",
            &json!({"enable_thinking": false, "x": 1}),
        )
        .unwrap();
        let c = r.conversation(Vec::new());
        let vars: Value = serde_json::from_str(&c.template_vars).unwrap();
        assert_eq!(vars, json!({"enable_thinking": false, "x": 1}));
        assert!(!is_plain(&c));

        let mut r = Rendering::default();
        r.effort("reasoning_effort", &json!("none")).unwrap();
        let c = r.conversation(Vec::new());
        assert_eq!((c.thinking, c.template_vars.as_str()), (Some(false), ""));

        let mut r = Rendering::default();
        r.effort("reasoning_effort", &json!("low")).unwrap();
        let c = r.conversation(Vec::new());
        assert_eq!(c.thinking, Some(true));
        assert!(c.template_vars.contains(r#""reasoning_effort":"low""#));

        let mut r = Rendering::default();
        let e = r.effort("reasoning_effort", &json!("extreme")).unwrap_err();
        assert!(e.message.contains("`reasoning_effort`"), "{}", e.message);
        let e = r
            .template_vars("chat_template_kwargs", &json!([1]))
            .unwrap_err();
        assert!(
            e.message.contains("`chat_template_kwargs`"),
            "{}",
            e.message
        );
        assert!(is_plain(&Rendering::default().conversation(Vec::new())));
    }

    #[test]
    fn each_dialects_thinking_switch_reaches_the_conversation() {
        let conversation = |d: &dyn Fn(&Value) -> Result<Request, ApiError>, v: Value| match d(&v)
            .unwrap()
            .prompt
            .input
        {
            crate::protocol::Input::Chat(c) => c,
            crate::protocol::Input::Text(_) => panic!("a chat"),
        };
        let hi = json!([{"role": "user", "content": "hi"}]);
        let openai = |v: &Value| OpenAi::Chat.parse(v);
        let c = conversation(
            &openai,
            json!({"model": "m", "messages": hi, "reasoning_effort": "none"}),
        );
        assert_eq!(c.thinking, Some(false));
        let c = conversation(
            &openai,
            json!({"model": "m", "messages": hi, "chat_template_kwargs": {"enable_thinking": false}}),
        );
        assert_eq!(
            (c.thinking, c.template_vars.as_str()),
            (None, r#"{"enable_thinking":false}"#)
        );
        let c = conversation(&openai, json!({"model": "m", "messages": hi}));
        assert!(is_plain(&c));
        let anthropic = |v: &Value| Anthropic.parse(v);
        let c = conversation(
            &anthropic,
            json!({"model": "m", "max_tokens": 40, "messages": hi, "thinking": {"type": "enabled", "budget_tokens": 8}}),
        );
        assert_eq!((c.thinking, c.thinking_budget), (Some(true), 8));
        let c = conversation(
            &anthropic,
            json!({"model": "m", "max_tokens": 40, "messages": hi, "thinking": {"type": "disabled"}}),
        );
        assert_eq!((c.thinking, c.thinking_budget), (Some(false), 0));
        let ollama = |v: &Value| Ollama::Chat.parse(v);
        for (think, thinking) in [
            (json!(true), true),
            (json!(false), false),
            (json!("high"), true),
        ] {
            let c = conversation(
                &ollama,
                json!({"model": "m", "messages": hi, "think": think}),
            );
            assert_eq!(c.thinking, Some(thinking));
        }
        let generate = |v: &Value| Ollama::Generate.parse(v);
        let c = conversation(
            &generate,
            json!({"model": "m", "prompt": "hi", "think": false}),
        );
        assert_eq!(c.thinking, Some(false));
    }
}
