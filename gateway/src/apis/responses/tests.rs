//! The Responses API: items in and out, whole and streamed, in process.

use super::super::tests::{call, streamed};
use super::*;
use crate::protocol::Event;

fn weather() -> Value {
    json!({"type": "function", "name": "get_weather", "strict": true,
           "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}})
}

fn chat_of(r: &Request) -> &[dp::ChatMessage] {
    match &r.prompt.input {
        Input::Chat(c) => &c.messages,
        Input::Text(_) => panic!("a chat"),
    }
}

fn collected(text: &str, calls: Vec<dp::ToolCall>) -> Collected {
    Collected {
        finish: if calls.is_empty() {
            Finish::Stop
        } else {
            Finish::ToolCalls
        },
        text: text.into(),
        reasoning: String::new(),
        tool_calls: calls,
        logprobs: Vec::new(),
        prompt_tokens: 7,
        completion_tokens: 5,
        cached_tokens: 0,
    }
}

#[test]
fn items_become_messages_and_conversations_continue_from_the_store() {
    let api = Responses::default();
    let first = api
        .parse(
            &json!({"model": "m", "instructions": "Be brief.", "input": "Weather in Paris?",
                       "tools": [weather()], "tool_choice": "required", "metadata": {"k": "v"}}),
        )
        .unwrap();
    assert_eq!(chat_of(&first).len(), 2);
    let set = first.prompt.tools.clone().unwrap();
    assert_eq!(
        (set.choice, set.tools[0].name.as_str()),
        (dp::ToolChoice::Required as i32, "get_weather")
    );
    let answer = api.answer(&first, &collected("", vec![call()]));
    assert_eq!(answer["status"], "completed");
    assert_eq!(answer["metadata"], json!({"k": "v"}));
    assert_eq!(answer["output"].as_array().unwrap().len(), 1);
    let fc = &answer["output"][0];
    assert_eq!(
        (fc["type"].as_str(), fc["call_id"].as_str()),
        (Some("function_call"), Some("call_1"))
    );
    // The next turn: the store's conversation (without the old
    // instructions), then the call's output.
    let next = api
        .parse(
            &json!({"model": "m", "previous_response_id": answer["id"], "input": [
            {"type": "function_call_output", "call_id": "call_1", "output": "sunny"},
            {"role": "user", "content": [{"type": "input_text", "text": "Thanks."}]}]}),
        )
        .unwrap();
    let roles: Vec<(&str, usize)> = chat_of(&next)
        .iter()
        .map(|m| (m.role.as_str(), m.tool_calls.len()))
        .collect();
    assert_eq!(
        roles,
        [("user", 0), ("assistant", 1), ("tool", 0), ("user", 0)]
    );
    assert_eq!(chat_of(&next)[2].tool_call_id, "call_1");
    // Calls given as items join the assistant message before them.
    let given = api
        .parse(&json!({"model": "m", "input": [
            {"role": "user", "content": "Weather?"},
            {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "Looking.", "annotations": []}]},
            {"type": "function_call", "call_id": "a", "name": "get_weather", "arguments": "{}"},
            {"type": "function_call", "call_id": "b", "name": "get_weather", "arguments": "{}"}]}))
        .unwrap();
    assert_eq!(chat_of(&given).len(), 2);
    assert_eq!(chat_of(&given)[1].tool_calls.len(), 2);
    // Not stored: not found later.
    let unstored = api
        .parse(&json!({"model": "m", "input": "x", "store": false}))
        .unwrap();
    let a = api.answer(&unstored, &collected("hi", vec![]));
    let e = api
        .parse(&json!({"model": "m", "input": "x", "previous_response_id": a["id"]}))
        .unwrap_err();
    assert!(e.message.contains("previous_response_id"), "{}", e.message);
    assert_eq!(
        api.retrieve(a["id"].as_str().unwrap()).unwrap_err().status,
        404
    );
}

#[test]
fn kept_responses_are_retrieved_and_deleted() {
    let api = Responses::default();
    let req = api.parse(&json!({"model": "m", "input": "x"})).unwrap();
    let a = api.answer(&req, &collected("hi", vec![]));
    let id = a["id"].as_str().unwrap();
    assert_eq!(api.retrieve(id).unwrap(), a);
    assert_eq!(api.delete(id).unwrap()["deleted"], true);
    assert_eq!(api.retrieve(id).unwrap_err().status, 404);
    assert_eq!(api.delete(id).unwrap_err().status, 404);
    // A streamed response is kept as its last event gave it.
    let req = api
        .parse(&json!({"model": "m", "input": "x", "stream": true}))
        .unwrap();
    let data = streamed(
        &api,
        &req,
        vec![
            Event::Text("hi".into()),
            Event::Done {
                finish: Finish::Stop,
                prompt_tokens: 1,
                completion_tokens: 1,
                cached_tokens: 0,
            },
        ],
    );
    let whole = &data.last().unwrap()["response"];
    assert_eq!(&api.retrieve(whole["id"].as_str().unwrap()).unwrap(), whole);
}

#[test]
fn what_is_not_implemented_is_named() {
    let api = Responses::default();
    for (extra, named) in [
        (
            json!({"reasoning": {"effort": "high", "summary": "auto"}}),
            "reasoning.summary",
        ),
        (json!({"reasoning": "high"}), "reasoning"),
        (json!({"reasoning": {"effort": "max"}}), "reasoning.effort"),
        (json!({"include": ["file_search_call.results"]}), "include"),
        (json!({"tools": [{"type": "web_search"}]}), "tools[0].type"),
        (json!({"truncation": "auto"}), "truncation"),
        (json!({"background": true}), "background"),
        (
            json!({"text": {"format": {"type": "json_schema", "schema": {}}}}),
            "text.format.name",
        ),
        (
            json!({"input": [{"type": "reasoning", "summary": []}]}),
            "input[0].type",
        ),
        (
            json!({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]}),
            "input[0].content[0].type",
        ),
    ] {
        let mut v = json!({"model": "m", "input": "hi"});
        for (k, x) in extra.as_object().unwrap() {
            v[k] = x.clone();
        }
        let e = api.parse(&v).unwrap_err();
        assert!(e.message.contains(named), "{named}: {}", e.message);
    }
    let r = api
        .parse(&json!({"model": "m", "input": "hi", "text": {"format": {"type": "json_schema", "name": "a",
                      "schema": {"type": "object"}, "strict": true}}, "truncation": "disabled", "include": []}))
        .unwrap();
    assert!(r.prompt.grammar.is_some());
    // An effort of none turns thinking off, and is echoed back.
    let r = api
        .parse(&json!({"model": "m", "input": "hi", "reasoning": {"effort": "none"}}))
        .unwrap();
    let Input::Chat(c) = &r.prompt.input else {
        panic!("a chat")
    };
    assert_eq!(c.thinking, Some(false));
    assert_eq!(
        api.answer(&r, &collected("hi", vec![]))["reasoning"]["effort"],
        "none"
    );
}

#[test]
fn log_probabilities_are_included_when_asked_for() {
    let api = Responses::default();
    let lp = |token: &str| dp::TokenLogprobs {
        chosen: Some(dp::TokenLogprob {
            token: token.into(),
            logprob: -0.5,
        }),
        top: Vec::new(),
    };
    let req = api
        .parse(&json!({"model": "m", "input": "hi", "top_logprobs": 2,
                       "include": ["message.output_text.logprobs"]}))
        .unwrap();
    assert_eq!(req.prompt.sampling.logprobs, Some(2));
    for (v, named) in [
        (json!({"top_logprobs": 2}), "include"),
        (
            json!({"include": ["message.output_text.logprobs"], "top_logprobs": 21}),
            "top_logprobs",
        ),
    ] {
        let mut v = v;
        v["model"] = json!("m");
        v["input"] = json!("hi");
        let e = api.parse(&v).unwrap_err();
        assert!(e.message.contains(named), "{named}: {}", e.message);
    }
    let data = streamed(
        &api,
        &req,
        vec![
            Event::Logprobs(vec![lp(" a")]),
            Event::Text(" a".into()),
            Event::Logprobs(vec![lp(" b"), lp(" c")]),
            Event::Text(" b c".into()),
            Event::Done {
                finish: Finish::Stop,
                prompt_tokens: 1,
                completion_tokens: 3,
                cached_tokens: 0,
            },
        ],
    );
    let deltas: Vec<usize> = data
        .iter()
        .filter(|d| d["type"] == "response.output_text.delta")
        .map(|d| d["logprobs"].as_array().unwrap().len())
        .collect();
    assert_eq!(deltas, [1, 2]);
    let whole = &data.last().unwrap()["response"]["output"][0]["content"][0]["logprobs"];
    assert_eq!(whole.as_array().unwrap().len(), 3);
    let mut c = collected(" a b c", vec![]);
    c.logprobs = vec![lp(" a"), lp(" b"), lp(" c")];
    let answer = api.answer(&req, &c);
    assert_eq!(
        answer["output"][0]["content"][0]["logprobs"][2]["token"],
        " c"
    );
}

#[test]
fn streams_name_every_event_in_order_and_end_with_the_whole_response() {
    let api = Responses::default();
    let req = api
        .parse(&json!({"model": "m", "input": "hi", "tools": [weather()]}))
        .unwrap();
    let data = streamed(
        &api,
        &req,
        vec![
            Event::Text("Sure".into()),
            Event::Text(".".into()),
            Event::ToolCall(call()),
            Event::Done {
                finish: Finish::ToolCalls,
                prompt_tokens: 7,
                completion_tokens: 5,
                cached_tokens: 0,
            },
        ],
    );
    let kinds: Vec<&str> = data.iter().map(|d| d["type"].as_str().unwrap()).collect();
    assert_eq!(
        kinds,
        [
            "response.created",
            "response.in_progress",
            "response.output_item.added",
            "response.content_part.added",
            "response.output_text.delta",
            "response.output_text.delta",
            "response.output_text.done",
            "response.content_part.done",
            "response.output_item.done",
            "response.output_item.added",
            "response.function_call_arguments.delta",
            "response.function_call_arguments.done",
            "response.output_item.done",
            "response.completed",
        ]
    );
    let numbers: Vec<u64> = data
        .iter()
        .map(|d| d["sequence_number"].as_u64().unwrap())
        .collect();
    assert_eq!(numbers, (0..14).collect::<Vec<_>>());
    let whole = &data[13]["response"];
    assert_eq!(whole["output"][0]["content"][0]["text"], "Sure.");
    assert_eq!(whole["output"][1]["arguments"], r#"{"city": "Paris"}"#);
    assert_eq!(whole["usage"]["total_tokens"], 12);
    // The streamed response is kept like a whole one.
    let id = whole["id"].as_str().unwrap();
    let stored = api.store.get(id).unwrap();
    assert_eq!(
        (stored[1].content.as_str(), stored[1].tool_calls.len()),
        ("Sure.", 1)
    );
}
