//! Chat-template rendering with hostile content: messages, tools and
//! template variables built from the input, rendered with the templates
//! models commonly ship (Hermes tool calls, Llama 3, Mistral, a thinking
//! template, gpt-oss's harmony with its `strftime_now`) and with one that
//! prints every message as it is. Rendering must end (the renderer's
//! fuel), stay bounded and never panic, whatever the
//! shapes (contents that are lists or objects, unknown roles, odd tool
//! calls); and a message's content is data: Jinja syntax inside it comes out
//! verbatim, never evaluated. The renderer's own source file is compiled
//! here, with the two small types it needs, so the fuzz build needs none of
//! the engine's other dependencies.
#![no_main]

/// The engine's errors, as far as the renderer uses them.
mod error {
    #[derive(Debug)]
    #[allow(dead_code)] // read through Debug only
    pub enum Error {
        InvalidInput(String),
        ChatTemplate(String),
    }
    pub type Result<T> = std::result::Result<T, Error>;
}

/// The engine's record of a tool call (the renderer only carries it).
mod tools {
    #[derive(Debug, Clone, PartialEq, Eq, Default)]
    pub struct ToolCall {
        pub id: String,
        pub name: String,
        pub arguments: String,
    }
}

#[path = "../../engine/src/reasoning.rs"]
#[allow(dead_code, missing_docs)]
mod reasoning;

#[path = "../../engine/src/chat.rs"]
#[allow(dead_code, missing_docs)]
mod chat;

use chat::{ChatMessage, ChatOptions, ChatTemplate};
use libfuzzer_sys::fuzz_target;

const TEMPLATES: [&str; 5] = [
    include_str!("../../engine/tests/fixtures/chat_templates/hermes.jinja"),
    include_str!("../../engine/tests/fixtures/chat_templates/llama3.jinja"),
    include_str!("../../engine/tests/fixtures/chat_templates/mistral.jinja"),
    include_str!("../../engine/tests/fixtures/chat_templates/thinking.jinja"),
    include_str!("../../engine/tests/fixtures/chat_templates/harmony.jinja"),
];

/// Prints each message's role and content between markers, untouched.
const VERBATIM: &str = "{% for m in messages %}[{{ m.role }}]{{ m.content }}[/]{% endfor %}";

fuzz_target!(|data: &[u8]| {
    let Some((&flags, rest)) = data.split_first() else {
        return;
    };
    let text = String::from_utf8_lossy(rest);
    let generation = flags & 1 == 1;
    let thinking = match (flags >> 1) & 3 {
        0 => None,
        1 => Some(true),
        _ => Some(false),
    };
    // A JSON request body: hostile shapes through every template.
    if let Ok(serde_json::Value::Object(body)) = serde_json::from_str::<serde_json::Value>(&text) {
        let messages = body.get("messages").cloned().unwrap_or_default();
        let tools = body.get("tools");
        let vars = match body.get("vars") {
            Some(serde_json::Value::Object(v)) => v.clone(),
            _ => Default::default(),
        };
        let Ok(options) = ChatOptions::new(vars, thinking) else {
            return;
        };
        for source in TEMPLATES {
            let template = ChatTemplate::new(source, "<s>", "</s>").expect("the fixtures compile");
            let _ = template.render_json(&messages, tools, generation, &options);
        }
        return;
    }
    // Otherwise lines are messages, roles in turn: printed as they are.
    let messages: Vec<ChatMessage> = text
        .split('\n')
        .take(64)
        .enumerate()
        .map(|(i, line)| ChatMessage::new(["user", "assistant"][i % 2], line))
        .collect();
    let options = ChatOptions::new(Default::default(), thinking).expect("no variables");
    let template = ChatTemplate::new(VERBATIM, "", "").expect("compiles");
    let out = template
        .render_with(&messages, generation, &options)
        .expect("plain messages render");
    let want: String = messages
        .iter()
        .map(|m| format!("[{}]{}[/]", m.role, m.content))
        .collect();
    assert_eq!(out, want, "content is printed verbatim, never evaluated");
    for source in TEMPLATES {
        let template = ChatTemplate::new(source, "<s>", "</s>").expect("the fixtures compile");
        let _ = template.render_with(&messages, generation, &options);
    }
});
