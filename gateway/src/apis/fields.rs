//! Reading a request body's fields, with the same messages in every dialect:
//! a field of the wrong type or out of range is a 400 that names it.

use serde_json::Value;

use shardplane_dataplane as dp;

use crate::protocol::ApiError;

/// The body as a JSON object.
pub fn object(body: &[u8]) -> Result<Value, ApiError> {
    let v: Value = serde_json::from_slice(body)
        .map_err(|e| ApiError::invalid(format!("the body is not valid JSON: {e}")))?;
    if !v.is_object() {
        return Err(ApiError::invalid("the body must be a JSON object"));
    }
    Ok(v)
}

/// A field counts as given unless it is null, an empty array or an empty
/// object (clients send those for "none").
pub fn given(v: &Value) -> bool {
    match v {
        Value::Null => false,
        Value::Array(a) => !a.is_empty(),
        Value::Object(o) => !o.is_empty(),
        _ => true,
    }
}

/// Refuses the fields of the object `v` that are not in `known`: a 400
/// naming each (as `{at}{field}`), so a client learns at once that a field
/// it relies on is not implemented here instead of getting an answer that
/// ignored it.
pub fn known_only(v: &Value, at: &str, known: &[&str]) -> Result<(), ApiError> {
    let Some(fields) = v.as_object() else {
        return Ok(());
    };
    let unknown: Vec<String> = fields
        .iter()
        .filter(|(name, value)| given(value) && !known.contains(&name.as_str()))
        .map(|(name, _)| format!("`{at}{name}`"))
        .collect();
    match unknown.len() {
        0 => Ok(()),
        1 => Err(ApiError::invalid(format!(
            "{} is not supported by this gateway; remove it from the request",
            unknown[0]
        ))),
        _ => Err(ApiError::invalid(format!(
            "{} are not supported by this gateway; remove them from the request",
            unknown.join(", ")
        ))),
    }
}

/// Refuses `field` when it is given with a value `supported` does not
/// accept: a 400 saying what is supported.
pub fn only_value(
    v: &Value,
    field: &str,
    supported: impl Fn(&Value) -> bool,
    what: &str,
) -> Result<(), ApiError> {
    let value = &v[field];
    if !given(value) || supported(value) {
        return Ok(());
    }
    Err(ApiError::invalid(format!(
        "`{field}` {value} is not supported by this gateway (supported: {what})"
    )))
}

/// Checks each message of the list `field` has only the `known` fields.
pub fn message_fields(v: &Value, field: &str, known: &[&str]) -> Result<(), ApiError> {
    for (i, m) in v[field].as_array().into_iter().flatten().enumerate() {
        known_only(m, &format!("{field}[{i}]."), known)?;
    }
    Ok(())
}

/// The `model` field.
pub fn model(v: &Value) -> Result<String, ApiError> {
    match &v["model"] {
        Value::String(s) if !s.is_empty() => Ok(s.clone()),
        Value::Null => Err(ApiError::invalid("`model` is required")),
        _ => Err(ApiError::invalid("`model` must be a non-empty string")),
    }
}

/// Message content: a string, or an array of `{type: "text", text}` blocks.
pub fn content_text(v: &Value, field: &str) -> Result<String, ApiError> {
    match v {
        Value::String(s) => Ok(s.clone()),
        Value::Null => Ok(String::new()),
        Value::Array(blocks) => {
            let mut out = String::new();
            for b in blocks {
                match (b["type"].as_str(), b["text"].as_str()) {
                    (Some("text"), Some(t)) => out.push_str(t),
                    (Some(other), _) => {
                        return Err(ApiError::invalid(format!(
                            "{field}: content blocks of type {other:?} are not supported (text only)"
                        )));
                    }
                    _ => {
                        return Err(ApiError::invalid(format!(
                            "{field}: a content block needs `type`"
                        )));
                    }
                }
            }
            Ok(out)
        }
        _ => Err(ApiError::invalid(format!(
            "{field} must be a string or an array of text blocks"
        ))),
    }
}

/// A message with `role` and `content` only.
pub fn chat_message(role: impl Into<String>, content: impl Into<String>) -> dp::ChatMessage {
    dp::ChatMessage {
        role: role.into(),
        content: content.into(),
        ..Default::default()
    }
}

/// The message list `field`: roles, text, and (OpenAI's shape) the tool
/// calls of assistant messages and the call a `tool` message answers. A
/// dialect refuses the fields it does not take before this reads them.
pub fn messages(v: &Value, field: &str) -> Result<Vec<dp::ChatMessage>, ApiError> {
    let Some(list) = v[field].as_array() else {
        return Err(ApiError::invalid(format!(
            "`{field}` must be an array of messages"
        )));
    };
    if list.is_empty() {
        return Err(ApiError::invalid(format!("`{field}` is empty")));
    }
    list.iter()
        .enumerate()
        .map(|(i, m)| {
            let role = m["role"]
                .as_str()
                .ok_or_else(|| ApiError::invalid(format!("{field}[{i}].role is required")))?;
            if !["system", "developer", "user", "assistant", "tool"].contains(&role) {
                return Err(ApiError::invalid(format!(
                    "{field}[{i}].role {role:?} is not system, user, assistant or tool"
                )));
            }
            let role = if role == "developer" { "system" } else { role };
            let mut message = chat_message(
                role,
                content_text(&m["content"], &format!("{field}[{i}].content"))?,
            );
            for (j, c) in m["tool_calls"].as_array().into_iter().flatten().enumerate() {
                let at = format!("{field}[{i}].tool_calls[{j}]");
                known_only(c, &format!("{at}."), &["id", "type", "function"])?;
                known_only(
                    &c["function"],
                    &format!("{at}.function."),
                    &["name", "arguments"],
                )?;
                let name = c["function"]["name"]
                    .as_str()
                    .ok_or_else(|| ApiError::invalid(format!("{at}.function.name is required")))?;
                let arguments = match &c["function"]["arguments"] {
                    Value::String(s) => s.clone(),
                    Value::Null => "{}".to_string(),
                    a => a.to_string(),
                };
                message.tool_calls.push(dp::ToolCall {
                    id: c["id"].as_str().unwrap_or_default().to_string(),
                    name: name.to_string(),
                    arguments,
                });
            }
            if role == "tool" {
                // OpenAI names the call; Ollama names the tool instead.
                message.tool_call_id = m["tool_call_id"]
                    .as_str()
                    .or(m["tool_name"].as_str())
                    .unwrap_or_default()
                    .to_string();
            }
            Ok(message)
        })
        .collect()
}

/// A number within `range`, `default` when absent.
pub fn float(v: &Value, field: &str, default: f32, range: (f32, f32)) -> Result<f32, ApiError> {
    match &v[field] {
        Value::Null => Ok(default),
        Value::Number(n) => {
            let x = n.as_f64().unwrap_or(f64::NAN) as f32;
            if x.is_finite() && x >= range.0 && x <= range.1 {
                Ok(x)
            } else {
                Err(ApiError::invalid(format!(
                    "`{field}` {x} must be between {} and {}",
                    range.0, range.1
                )))
            }
        }
        _ => Err(ApiError::invalid(format!("`{field}` must be a number"))),
    }
}

/// A boolean, `false` when absent.
pub fn flag(v: &Value, field: &str) -> Result<bool, ApiError> {
    match &v[field] {
        Value::Null => Ok(false),
        Value::Bool(b) => Ok(*b),
        _ => Err(ApiError::invalid(format!(
            "`{field}` must be true or false"
        ))),
    }
}

/// A whole number ≥ 0, when present.
pub fn uint(v: &Value, field: &str) -> Result<Option<u64>, ApiError> {
    match &v[field] {
        Value::Null => Ok(None),
        Value::Number(n) => n
            .as_u64()
            .map(Some)
            .ok_or_else(|| ApiError::invalid(format!("`{field}` must be a whole number ≥ 0"))),
        _ => Err(ApiError::invalid(format!(
            "`{field}` must be a whole number"
        ))),
    }
}

/// Stop strings: one string or an array of them.
pub fn stops(v: &Value, field: &str) -> Result<Vec<String>, ApiError> {
    match &v[field] {
        Value::Null => Ok(Vec::new()),
        Value::String(s) => Ok(vec![s.clone()]),
        Value::Array(a) => a
            .iter()
            .map(|s| {
                s.as_str()
                    .map(str::to_string)
                    .ok_or_else(|| ApiError::invalid(format!("`{field}` must hold strings")))
            })
            .collect(),
        _ => Err(ApiError::invalid(format!(
            "`{field}` must be a string or an array of strings"
        ))),
    }
}

/// The wire's token limit (0: as many as the context allows).
pub fn max_tokens(n: Option<u64>) -> Result<u32, ApiError> {
    match n {
        Some(0) => Err(ApiError::invalid("the token limit must be at least 1")),
        Some(n) => Ok(n.min(u32::MAX as u64) as u32),
        None => Ok(0),
    }
}

/// An output grammar for any JSON object.
pub fn json_object() -> dp::OutputGrammar {
    dp::OutputGrammar {
        kind: Some(dp::output_grammar::Kind::JsonObject(true)),
    }
}

/// An output grammar for JSON valid against `schema` (`field` names it in
/// errors). The schema must be an object (or `true`); whether it compiles is
/// the model's to say, since that needs its vocabulary.
pub fn json_schema(schema: &Value, field: &str) -> Result<dp::OutputGrammar, ApiError> {
    if !(schema.is_object() || *schema == Value::Bool(true)) {
        return Err(ApiError::invalid(format!(
            "`{field}` must be a JSON Schema object"
        )));
    }
    Ok(dp::OutputGrammar {
        kind: Some(dp::output_grammar::Kind::JsonSchema(schema.to_string())),
    })
}

/// The array `field` (absent or null: empty).
pub fn array<'a>(v: &'a Value, field: &str) -> Result<&'a [Value], ApiError> {
    match &v[field] {
        Value::Null => Ok(&[]),
        Value::Array(a) => Ok(a),
        _ => Err(ApiError::invalid(format!("`{field}` must be an array"))),
    }
}

/// One function tool: `name`, `description` and the JSON Schema of its
/// arguments in `schema_field` (OpenAI's `parameters`, Anthropic's
/// `input_schema`); `at` names the tool's object in errors.
pub fn function_tool(f: &Value, at: &str, schema_field: &str) -> Result<dp::Tool, ApiError> {
    let name = f["name"]
        .as_str()
        .filter(|n| !n.is_empty())
        .ok_or_else(|| ApiError::invalid(format!("`{at}.name` is required")))?;
    let parameters = match &f[schema_field] {
        Value::Null => String::new(),
        p if p.is_object() => p.to_string(),
        _ => {
            return Err(ApiError::invalid(format!(
                "`{at}.{schema_field}` must be a JSON Schema object"
            )));
        }
    };
    Ok(dp::Tool {
        name: name.to_string(),
        description: f["description"].as_str().unwrap_or_default().to_string(),
        parameters,
    })
}

/// The tool set from its parts, whatever the dialect: a named function must
/// be among the tools, and a call cannot be required of no tools. None when
/// there are no tools and the choice is auto.
pub fn tool_set(
    tools: Vec<dp::Tool>,
    choice: dp::ToolChoice,
    function: String,
    parallel: bool,
) -> Result<Option<dp::ToolSet>, ApiError> {
    if choice == dp::ToolChoice::Function && !tools.iter().any(|t| t.name == function) {
        return Err(ApiError::invalid(format!(
            "`tool_choice` names {function:?}, which is not among `tools`"
        )));
    }
    if tools.is_empty() {
        return match choice {
            dp::ToolChoice::Auto => Ok(None),
            _ => Err(ApiError::invalid(
                "`tool_choice` asks for a call but `tools` is empty",
            )),
        };
    }
    Ok(Some(dp::ToolSet {
        tools,
        choice: choice as i32,
        function,
        parallel,
    }))
}

/// The tool set of a chat request: `tools` (functions, OpenAI's shape, which
/// Ollama shares), `tool_choice` and `parallel_tool_calls` (OpenAI's; absent
/// in Ollama: auto, parallel). None when there are no tools or the choice
/// is `none` (the model then answers in text).
pub fn tools(v: &Value) -> Result<Option<dp::ToolSet>, ApiError> {
    if v["tools"].is_null() {
        return Ok(None);
    }
    let mut tools = Vec::new();
    for (i, t) in array(v, "tools")?.iter().enumerate() {
        known_only(t, &format!("tools[{i}]."), &["type", "function"])?;
        if t["type"] != "function" {
            return Err(ApiError::invalid(format!(
                "`tools[{i}].type` {} is not supported (supported: function)",
                t["type"]
            )));
        }
        let at = format!("tools[{i}].function");
        known_only(
            &t["function"],
            &format!("{at}."),
            &["name", "description", "parameters", "strict"],
        )?;
        tools.push(function_tool(&t["function"], &at, "parameters")?);
    }
    let (choice, function) = match &v["tool_choice"] {
        Value::Null => (dp::ToolChoice::Auto, String::new()),
        Value::String(s) if s == "auto" => (dp::ToolChoice::Auto, String::new()),
        Value::String(s) if s == "required" => (dp::ToolChoice::Required, String::new()),
        Value::String(s) if s == "none" => return Ok(None),
        c if c["type"] == "function" && c["function"]["name"].is_string() => {
            known_only(c, "tool_choice.", &["type", "function"])?;
            let name = c["function"]["name"].as_str().unwrap_or_default();
            (dp::ToolChoice::Function, name.to_string())
        }
        c => {
            return Err(ApiError::invalid(format!(
                "`tool_choice` {c} is not supported (supported: \"auto\", \"none\", \"required\", {{\"type\": \"function\", \"function\": {{\"name\": …}}}})"
            )));
        }
    };
    tool_set(
        tools,
        choice,
        function,
        v["parallel_tool_calls"].as_bool().unwrap_or(true),
    )
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    use super::*;

    #[test]
    fn fields_not_implemented_are_named_and_empty_ones_pass() {
        let v = json!({"model": "m", "tools": [{"type": "function"}], "logit_bias": {"1": 2}, "user": null, "seed": 1});
        let e = known_only(&v, "", &["model", "seed"]).unwrap_err();
        assert_eq!(e.status.as_u16(), 400);
        assert!(
            e.message.contains("`tools`") && e.message.contains("`logit_bias`"),
            "{}",
            e.message
        );
        let v = json!({"model": "m", "tools": [], "options": {}, "user": null});
        known_only(&v, "", &["model"]).unwrap();
        let e = known_only(&json!({"mirostat": 2}), "options.", &[]).unwrap_err();
        assert!(e.message.contains("`options.mirostat`"), "{}", e.message);
    }

    #[test]
    fn values_not_implemented_are_refused() {
        let v = json!({"response_format": {"type": "json_object"}, "logprobs": false});
        let text = |f: &Value| f["type"] == "text";
        let e = only_value(&v, "response_format", text, "type text").unwrap_err();
        assert!(e.message.contains("response_format"), "{}", e.message);
        only_value(&v, "logprobs", |l| l == &json!(false), "false").unwrap();
        only_value(&json!({}), "response_format", text, "type text").unwrap();
        let m = json!({"messages": [{"role": "user", "content": "x", "images": ["aGk="]}]});
        let e = message_fields(&m, "messages", &["role", "content"]).unwrap_err();
        assert!(e.message.contains("`messages[0].images`"), "{}", e.message);
    }
}
