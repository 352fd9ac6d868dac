//! Reading a request body's fields, with the same messages in every dialect:
//! a field of the wrong type or out of range is a 400 that names it.

use serde_json::Value;

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

/// `(role, content)` pairs of the message list `field`.
pub fn messages(v: &Value, field: &str) -> Result<Vec<(String, String)>, ApiError> {
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
            Ok((
                role.to_string(),
                content_text(&m["content"], &format!("{field}[{i}].content"))?,
            ))
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
