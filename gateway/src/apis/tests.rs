//! The API dialects' request parsing and answers, in process.

use serde_json::{Value, json};

use super::*;

/// A call of `get_weather` for Paris.
pub(super) fn call() -> shardplane_dataplane::ToolCall {
    shardplane_dataplane::ToolCall {
        id: "call_1".into(),
        name: "get_weather".into(),
        arguments: r#"{"city": "Paris"}"#.into(),
    }
}

/// The data of each chunk `api` streams for `events`.
pub(super) fn streamed<D: Dialect>(api: &D, req: &Request, events: Vec<Event>) -> Vec<Value> {
    let events: Events = Box::pin(futures::stream::iter(events.into_iter().map(Ok)));
    let chunks: Vec<String> = futures::executor::block_on(api.stream(req, 0, events).collect());
    // (OpenAI's last line, `data: [DONE]`, is not JSON)
    chunks
        .iter()
        .filter(|c| !c.contains("[DONE]"))
        .map(|c| serde_json::from_str(c.split("data: ").nth(1).unwrap().trim()).unwrap())
        .collect()
}

fn refused<D: Dialect>(api: D, v: &Value, field: &str) {
    let e = api.parse(v).expect_err("refused");
    assert_eq!(e.status.as_u16(), 400);
    assert!(e.message.contains(field), "{field}: {}", e.message);
}

fn with(v: &Value, field: &str, value: Value) -> Value {
    let mut v = v.clone();
    v[field] = value;
    v
}

#[test]
fn openai_refuses_what_it_does_not_implement_and_takes_the_rest() {
    let chat = json!({"model": "m", "messages": [{"role": "user", "content": "hi", "name": "ann"}],
        "max_tokens": 5, "temperature": 0, "user": "u-1", "response_format": {"type": "text"},
        "stream_options": {"include_usage": true}, "tools": [], "logprobs": false, "tool_choice": "none"});
    OpenAi::Chat.parse(&chat).unwrap();
    for (field, value) in [
        ("tools", json!([{"type": "retrieval"}])),
        (
            "tools",
            json!([{"type": "function", "function": {"name": "f", "cache": true}}]),
        ),
        ("logit_bias", json!({"1": 1})),
        ("top_logprobs", json!(3)),
        ("response_format", json!({"type": "grammar"})),
        ("tool_choice", json!("required")),
        ("reasoning_effort", json!("extreme")),
        ("chat_template_kwargs", json!("enable_thinking=false")),
    ] {
        refused(OpenAi::Chat, &with(&chat, field, value), field);
    }
    refused(
        OpenAi::Chat,
        &with(
            &chat,
            "stream_options",
            json!({"include_obfuscation": true}),
        ),
        "stream_options.include_obfuscation",
    );
    refused(
        OpenAi::Chat,
        &with(
            &chat,
            "messages",
            json!([{"role": "assistant", "content": "", "tool_calls": [{"id": "1"}]}]),
        ),
        "messages[0].tool_calls",
    );
    let text = json!({"model": "m", "prompt": "x", "echo": false, "best_of": 1, "suffix": null});
    OpenAi::Text.parse(&text).unwrap();
    refused(OpenAi::Text, &with(&text, "echo", json!(true)), "echo");
    // vLLM's and llama.cpp's `ignore_eos` reaches the sampling; it cannot go
    // with a grammar, and it is a boolean.
    let eos = OpenAi::Text
        .parse(&with(&text, "ignore_eos", json!(true)))
        .unwrap();
    assert!(eos.prompt.sampling.ignore_eos);
    assert!(
        !OpenAi::Text
            .parse(&text)
            .unwrap()
            .prompt
            .sampling
            .ignore_eos
    );
    refused(
        OpenAi::Text,
        &with(&text, "ignore_eos", json!(1)),
        "ignore_eos",
    );
    refused(
        OpenAi::Chat,
        &with(
            &with(&chat, "ignore_eos", json!(true)),
            "response_format",
            json!({"type": "json_object"}),
        ),
        "ignore_eos",
    );
    refused(OpenAi::Text, &with(&text, "logprobs", json!(6)), "logprobs");
    refused(
        OpenAi::Chat,
        &with(
            &with(&chat, "logprobs", json!(true)),
            "top_logprobs",
            json!(21),
        ),
        "top_logprobs",
    );
}

#[test]
fn json_output_becomes_the_output_grammar() {
    use shardplane_dataplane::output_grammar::Kind;
    let grammar = |api: &dyn Fn(&Value) -> Result<Request, ApiError>, v: Value| {
        api(&v).unwrap().prompt.grammar.and_then(|g| g.kind)
    };
    let chat = |v: &Value| OpenAi::Chat.parse(v);
    let base = json!({"model": "m", "messages": [{"role": "user", "content": "hi"}]});
    assert_eq!(grammar(&chat, base.clone()), None);
    assert_eq!(
        grammar(
            &chat,
            with(&base, "response_format", json!({"type": "json_object"}))
        ),
        Some(Kind::JsonObject(true))
    );
    let schema = json!({"type": "object", "properties": {"a": {"type": "integer"}}});
    let Some(Kind::JsonSchema(text)) = grammar(
        &chat,
        with(
            &base,
            "response_format",
            json!({"type": "json_schema", "json_schema": {"name": "a", "strict": true, "schema": schema}}),
        ),
    ) else {
        panic!("a JSON Schema grammar");
    };
    assert_eq!(serde_json::from_str::<Value>(&text).unwrap(), schema);
    for (format, field) in [
        (
            json!({"type": "json_schema"}),
            "response_format.json_schema",
        ),
        (
            json!({"type": "json_schema", "json_schema": {"schema": {}}}),
            "response_format.json_schema.name",
        ),
        (
            json!({"type": "json_schema", "json_schema": {"name": "a", "schema": [1]}}),
            "response_format.json_schema.schema",
        ),
        (
            json!({"type": "json_object", "schema": {"type": "object"}}),
            "response_format.schema",
        ),
    ] {
        refused(OpenAi::Chat, &with(&base, "response_format", format), field);
    }
    let ollama = |v: &Value| Ollama::Chat.parse(v);
    assert_eq!(
        grammar(&ollama, with(&base, "format", json!("json"))),
        Some(Kind::JsonObject(true))
    );
    assert!(matches!(
        grammar(&ollama, with(&base, "format", schema)),
        Some(Kind::JsonSchema(_))
    ));
    assert_eq!(grammar(&ollama, with(&base, "format", json!(""))), None);
}

#[test]
fn openai_tools_become_the_tool_set() {
    use shardplane_dataplane as dp;
    let weather = json!({"type": "function", "function": {"name": "get_weather", "strict": true,
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}});
    let base = json!({"model": "m", "messages": [
        {"role": "user", "content": "weather?"},
        {"role": "assistant", "content": null, "tool_calls": [{"id": "call_1", "type": "function",
            "function": {"name": "get_weather", "arguments": "{\"city\": \"Paris\"}"}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny"}],
        "tools": [weather]});
    let parsed = OpenAi::Chat.parse(&base).unwrap().prompt;
    let set = parsed.tools.unwrap();
    assert_eq!(
        (set.tools.len(), set.choice, set.parallel),
        (1, dp::ToolChoice::Auto as i32, true)
    );
    assert_eq!(
        serde_json::from_str::<Value>(&set.tools[0].parameters).unwrap()["properties"]["city"]["type"],
        "string"
    );
    let crate::protocol::Input::Chat(dp::Conversation { messages, .. }) = parsed.input else {
        panic!("a chat");
    };
    assert_eq!(messages[1].tool_calls[0].name, "get_weather");
    assert_eq!(messages[1].tool_calls[0].arguments, r#"{"city": "Paris"}"#);
    assert_eq!(messages[2].tool_call_id, "call_1");
    let choice = |c: Value| {
        OpenAi::Chat
            .parse(&with(&base, "tool_choice", c))
            .map(|r| r.prompt.tools.map(|t| (t.choice, t.function)))
    };
    assert_eq!(
        choice(json!("required")).unwrap(),
        Some((dp::ToolChoice::Required as i32, String::new()))
    );
    assert_eq!(
        choice(json!({"type": "function", "function": {"name": "get_weather"}})).unwrap(),
        Some((dp::ToolChoice::Function as i32, "get_weather".into()))
    );
    assert_eq!(choice(json!("none")).unwrap(), None);
    assert!(choice(json!({"type": "function", "function": {"name": "nope"}})).is_err());
    refused(
        OpenAi::Chat,
        &with(&base, "response_format", json!({"type": "json_object"})),
        "response_format",
    );
}

#[test]
fn openai_gives_log_probabilities_with_the_text_they_belong_to() {
    use shardplane_dataplane as dp;
    let entry = |token: &str, logprob: f32| dp::TokenLogprob {
        token: token.into(),
        logprob,
    };
    let lp = |token: &str, logprob: f32| dp::TokenLogprobs {
        chosen: Some(entry(token, logprob)),
        top: vec![entry(token, logprob), entry(" x", -3.0)],
    };
    let base = json!({"model": "m", "messages": [{"role": "user", "content": "hi"}],
                      "logprobs": true, "top_logprobs": 2});
    let req = OpenAi::Chat.parse(&base).unwrap();
    assert_eq!(req.prompt.sampling.logprobs, Some(2));
    // The first token's text is held back until the second's comes.
    let data = tests::streamed(
        &OpenAi::Chat,
        &req,
        vec![
            Event::Logprobs(vec![lp("\u{fffd}", -0.5)]),
            Event::Text(String::new()),
            Event::Logprobs(vec![lp("\u{fffd}", -0.25)]),
            Event::Text("é".into()),
            Event::Logprobs(vec![lp(" ok", -0.1)]),
            Event::Text(" ok".into()),
            Event::Done {
                finish: Finish::Stop,
                prompt_tokens: 1,
                completion_tokens: 3,
                cached_tokens: 0,
            },
        ],
    );
    let with_text: Vec<(String, usize)> = data
        .iter()
        .filter_map(|d| {
            let c = &d["choices"][0];
            let n = c["logprobs"]["content"].as_array().map_or(0, Vec::len);
            c["delta"]["content"].as_str().map(|t| (t.to_string(), n))
        })
        .collect();
    assert_eq!(
        with_text,
        [("".into(), 0), ("é".into(), 2), (" ok".into(), 1)]
    );
    let whole = OpenAi::Chat.answer(
        &req,
        &Collected {
            text: "é ok".into(),
            reasoning: String::new(),
            tool_calls: Vec::new(),
            logprobs: vec![lp(" ok", -0.1)],
            finish: Finish::Stop,
            prompt_tokens: 40,
            completion_tokens: 1,
            cached_tokens: 32,
        },
    );
    assert_eq!(
        whole["usage"],
        json!({"prompt_tokens": 40, "completion_tokens": 1, "total_tokens": 41,
               "prompt_tokens_details": {"cached_tokens": 32}})
    );
    let l = &whole["choices"][0]["logprobs"]["content"][0];
    assert_eq!(l["token"], " ok");
    assert_eq!(l["bytes"], json!([32, 111, 107]));
    assert_eq!(l["top_logprobs"][1]["logprob"], json!(-3.0));
    let text = json!({"model": "m", "prompt": "x", "logprobs": 1});
    let req = OpenAi::Text.parse(&text).unwrap();
    let whole = OpenAi::Text.answer(
        &req,
        &Collected {
            text: " ok ok".into(),
            reasoning: String::new(),
            tool_calls: Vec::new(),
            logprobs: vec![lp(" ok", -0.1), lp(" ok", -0.2)],
            finish: Finish::Stop,
            prompt_tokens: 1,
            completion_tokens: 2,
            cached_tokens: 0,
        },
    );
    let l = &whole["choices"][0]["logprobs"];
    assert_eq!(l["text_offset"], json!([0, 3]));
    assert_eq!(l["tokens"], json!([" ok", " ok"]));
    assert_eq!(l["top_logprobs"][0][" x"], json!(-3.0));
}

#[test]
fn reasoning_comes_out_as_each_api_gives_it() {
    let collected = Collected {
        text: "Hello!".into(),
        reasoning: "The user greets.".into(),
        tool_calls: Vec::new(),
        logprobs: Vec::new(),
        finish: Finish::Stop,
        prompt_tokens: 1,
        completion_tokens: 9,
        cached_tokens: 0,
    };
    let events = || {
        vec![
            Event::Reasoning("The user".into()),
            Event::Reasoning(" greets.".into()),
            Event::Text("Hello!".into()),
            Event::Done {
                finish: Finish::Stop,
                prompt_tokens: 1,
                completion_tokens: 9,
                cached_tokens: 0,
            },
        ]
    };
    let chat =
        json!({"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 9});
    // OpenAI chat: reasoning_content, whole and in deltas.
    let req = OpenAi::Chat.parse(&chat).unwrap();
    let m = &OpenAi::Chat.answer(&req, &collected)["choices"][0]["message"];
    assert_eq!(
        (m["reasoning_content"].as_str(), m["content"].as_str()),
        (Some("The user greets."), Some("Hello!"))
    );
    let deltas: String = streamed(&OpenAi::Chat, &req, events())
        .iter()
        .filter_map(|d| {
            d["choices"][0]["delta"]["reasoning_content"]
                .as_str()
                .map(String::from)
        })
        .collect();
    assert_eq!(deltas, "The user greets.");
    // Anthropic: a thinking block before the text.
    let req = Anthropic.parse(&chat).unwrap();
    let content = &Anthropic.answer(&req, &collected)["content"];
    assert_eq!(
        (
            content[0]["type"].as_str(),
            content[0]["thinking"].as_str(),
            content[1]["text"].as_str()
        ),
        (Some("thinking"), Some("The user greets."), Some("Hello!"))
    );
    let starts: Vec<String> = streamed(&Anthropic, &req, events())
        .iter()
        .filter(|d| d["type"] == "content_block_start")
        .map(|d| format!("{} {}", d["index"], d["content_block"]["type"]))
        .collect();
    assert_eq!(starts, ["0 \"thinking\"", "1 \"text\""]);
    // Ollama: message.thinking.
    let req = Ollama::Chat
        .parse(&json!({"model": "m", "messages": [{"role": "user", "content": "hi"}]}))
        .unwrap();
    assert_eq!(
        Ollama::Chat.answer(&req, &collected)["message"]["thinking"],
        "The user greets."
    );
    // Responses: a reasoning item before the message.
    let api = Responses::default();
    let req = api.parse(&json!({"model": "m", "input": "hi"})).unwrap();
    let output = &api.answer(&req, &collected)["output"];
    assert_eq!(
        (
            output[0]["type"].as_str(),
            output[0]["content"][0]["text"].as_str(),
            output[1]["type"].as_str()
        ),
        (Some("reasoning"), Some("The user greets."), Some("message"))
    );
    let data = streamed(&api, &req, events());
    let kinds: Vec<&str> = data.iter().map(|d| d["type"].as_str().unwrap()).collect();
    assert_eq!(
        kinds[2..7],
        [
            "response.output_item.added",
            "response.reasoning_text.delta",
            "response.reasoning_text.delta",
            "response.reasoning_text.done",
            "response.output_item.done",
        ]
    );
    let whole = &data.last().unwrap()["response"]["output"];
    assert_eq!(
        (
            whole[0]["type"].as_str(),
            whole[1]["content"][0]["text"].as_str()
        ),
        (Some("reasoning"), Some("Hello!"))
    );
}

/// An answer silent for a while (waiting to heal, say) keeps each stream alive in
/// the dialect's own way, and the text around the wait is unchanged.
#[test]
fn a_waiting_answer_keeps_each_stream_alive_in_its_dialect() {
    let events = || -> Events {
        let events = vec![
            Event::Text("Hi".into()),
            Event::Waiting,
            Event::Waiting,
            Event::Text(" there".into()),
            Event::Done {
                finish: Finish::Stop,
                prompt_tokens: 1,
                completion_tokens: 2,
                cached_tokens: 0,
            },
        ];
        Box::pin(futures::stream::iter(events.into_iter().map(Ok)))
    };
    let raw = |chunks: BoxStream<'static, String>| -> Vec<String> {
        futures::executor::block_on(chunks.collect())
    };
    let chat =
        json!({"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 9});
    // OpenAI chat and Responses: SSE comments, which clients skip.
    let req = OpenAi::Chat.parse(&chat).unwrap();
    let chunks = raw(OpenAi::Chat.stream(&req, 0, events()));
    let comments = chunks.iter().filter(|c| c.starts_with(": ")).count();
    assert_eq!(comments, 2, "{chunks:?}");
    assert!(
        chunks
            .iter()
            .filter(|c| c.starts_with(": "))
            .all(|c| c == SSE_WAITING)
    );
    let text: String = chunks
        .iter()
        .filter_map(|c| c.strip_prefix("data: "))
        .filter(|d| !d.contains("[DONE]"))
        .map(|d| serde_json::from_str::<Value>(d.trim()).unwrap())
        .filter_map(|d| {
            d["choices"][0]["delta"]["content"]
                .as_str()
                .map(String::from)
        })
        .collect();
    assert_eq!(text, "Hi there");
    let api = Responses::default();
    let req = api.parse(&json!({"model": "m", "input": "hi"})).unwrap();
    let chunks = raw(api.stream(&req, 0, events()));
    assert_eq!(chunks.iter().filter(|c| *c == SSE_WAITING).count(), 2);
    // Anthropic: its own ping event (one opens every stream).
    let req = Anthropic.parse(&chat).unwrap();
    let chunks = raw(Anthropic.stream(&req, 0, events()));
    let pings = chunks
        .iter()
        .filter(|c| c.starts_with("event: ping\n"))
        .count();
    assert_eq!(pings, 3, "{chunks:?}");
    // Ollama: a line with no text, not done.
    let req = Ollama::Chat
        .parse(&json!({"model": "m", "messages": [{"role": "user", "content": "hi"}]}))
        .unwrap();
    let lines: Vec<Value> = raw(Ollama::Chat.stream(&req, 0, events()))
        .iter()
        .map(|l| serde_json::from_str(l.trim()).unwrap())
        .collect();
    let contents: Vec<(&str, bool)> = lines
        .iter()
        .map(|l| {
            (
                l["message"]["content"].as_str().unwrap(),
                l["done"].as_bool().unwrap(),
            )
        })
        .collect();
    assert_eq!(
        contents,
        [
            ("Hi", false),
            ("", false),
            ("", false),
            (" there", false),
            ("", true)
        ]
    );
}

#[test]
fn anthropic_refuses_what_it_does_not_implement_and_takes_the_rest() {
    let m = json!({"model": "m", "max_tokens": 5, "messages": [{"role": "user", "content": "hi"}],
        "metadata": {"user_id": "u-1"}, "thinking": {"type": "disabled"}, "tool_choice": {"type": "auto"}});
    Anthropic.parse(&m).unwrap();
    refused(
        Anthropic,
        &with(
            &m,
            "tools",
            json!([{"type": "bash_20250124", "name": "bash"}]),
        ),
        "tools[0].type",
    );
    for (thinking, named) in [
        (
            json!({"type": "enabled", "budget_tokens": 1024}),
            "thinking.budget_tokens",
        ),
        (json!({"type": "enabled"}), "thinking.budget_tokens"),
        (json!({"type": "adaptive"}), "thinking.type"),
        (
            json!({"type": "disabled", "display": "summarized"}),
            "thinking.display",
        ),
        (json!(true), "thinking"),
    ] {
        refused(Anthropic, &with(&m, "thinking", thinking), named);
    }
    refused(
        Anthropic,
        &with(&m, "tool_choice", json!({"type": "any"})),
        "tool_choice",
    );
    refused(
        Anthropic,
        &with(&m, "service_tier", json!("auto")),
        "service_tier",
    );
}

#[test]
fn ollama_refuses_what_it_does_not_implement_and_takes_the_rest() {
    let c = json!({"model": "m", "messages": [{"role": "user", "content": "hi"}], "tools": [],
        "keep_alive": "5m", "think": false, "options": {"temperature": 0, "num_ctx": 4096, "num_thread": 8}});
    Ollama::Chat.parse(&c).unwrap();
    refused(Ollama::Chat, &with(&c, "format", json!("yaml")), "format");
    refused(
        Ollama::Chat,
        &with(&c, "tools", json!([{"type": "function"}])),
        "tools",
    );
    refused(Ollama::Chat, &with(&c, "think", json!("max")), "think");
    let raw = json!({"model": "m", "prompt": "hi", "raw": true, "think": false});
    refused(Ollama::Generate, &raw, "think");
    refused(
        Ollama::Chat,
        &with(&c, "options", json!({"mirostat": 2})),
        "options.mirostat",
    );
    refused(
        Ollama::Chat,
        &with(
            &c,
            "messages",
            json!([{"role": "user", "content": "x", "images": ["aGk="]}]),
        ),
        "messages[0].images",
    );
    let g = json!({"model": "m", "prompt": "x", "system": "s", "raw": false});
    Ollama::Generate.parse(&g).unwrap();
    refused(
        Ollama::Generate,
        &with(&g, "template", json!("{{ .Prompt }}")),
        "template",
    );
    refused(
        Ollama::Generate,
        &with(&g, "images", json!(["aGk="])),
        "images",
    );
}
