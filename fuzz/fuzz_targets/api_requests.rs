//! Request bodies of every API the gateway speaks, fed arbitrary JSON: the
//! first byte picks the API (OpenAI chat and completions, the Responses API,
//! Anthropic messages, Ollama chat and generate), the rest is the body. A
//! request either parses into one the data plane can carry, or is refused
//! with a 4xx whose body renders in that API's own error shape; never a
//! panic, whatever the nesting, types, sizes or strings.
#![no_main]

use std::sync::Arc;

use libfuzzer_sys::fuzz_target;
use serde_json::Value;
use shardplane_gateway::apis::{Anthropic, Dialect, Ollama, OpenAi, Responses};
use shardplane_gateway::conversations::Store;

fn check<D: Dialect>(api: D, v: &Value) {
    match api.parse(v) {
        Ok(req) => {
            let s = &req.prompt.sampling;
            assert!(s.temperature.is_finite() && s.temperature >= 0.0, "{s:?}");
            assert!(s.top_p.is_finite(), "{s:?}");
        }
        Err(e) => {
            assert!(e.status.is_client_error(), "{} for {v}: {}", e.status, e.message);
            let body = api.error_body(&e);
            assert!(body.is_object(), "{body}");
        }
    }
}

fuzz_target!(|data: &[u8]| {
    let Some((&which, body)) = data.split_first() else {
        return;
    };
    let Ok(v) = serde_json::from_slice::<Value>(body) else {
        return;
    };
    match which % 6 {
        0 => check(OpenAi::Chat, &v),
        1 => check(OpenAi::Text, &v),
        2 => check(Responses::new(Arc::new(Store::new(16, 1 << 20))), &v),
        3 => check(Anthropic, &v),
        4 => check(Ollama::Chat, &v),
        _ => check(Ollama::Generate, &v),
    }
});
