//! Conditions as Kubernetes expects them: one per type, the transition time
//! kept while the status does not change.

use k8s_openapi::apimachinery::pkg::apis::meta::v1::{Condition, Time};

/// Sets condition `type_` in `conditions`, keeping its transition time when the
/// status is unchanged.
pub fn set(
    conditions: &mut Vec<Condition>,
    previous: &[Condition],
    type_: &str,
    status: bool,
    reason: &str,
    message: impl Into<String>,
    generation: Option<i64>,
) {
    let status = if status { "True" } else { "False" }.to_string();
    // Server-side apply on older API servers turns an empty message into null,
    // which the schema refuses; a message also reads better than nothing.
    let message = match message.into() {
        m if m.is_empty() => reason.to_string(),
        m => m,
    };
    let since = previous
        .iter()
        .find(|c| c.type_ == type_ && c.status == status)
        .map(|c| c.last_transition_time.clone())
        .unwrap_or_else(|| Time(k8s_openapi::jiff::Timestamp::now()));
    conditions.retain(|c| c.type_ != type_);
    conditions.push(Condition {
        type_: type_.to_string(),
        status,
        reason: reason.to_string(),
        message,
        last_transition_time: since,
        observed_generation: generation,
    });
}

/// Whether condition `type_` is `True`.
pub fn is_true(conditions: &[Condition], type_: &str) -> bool {
    conditions
        .iter()
        .any(|c| c.type_ == type_ && c.status == "True")
}
