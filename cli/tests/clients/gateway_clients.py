"""The gateway through the official openai, anthropic and ollama clients.

Run by cli/tests/gateway.rs against a running system; the environment names the
gateway, the key and the model names. Exits non-zero on the first failure.
"""
import concurrent.futures
import json
import math
import os
import sys

import anthropic
import httpx
import jsonschema
import ollama
import openai

BASE = os.environ["GATEWAY"]
KEY = os.environ["API_KEY"]
DAILY, PIPE, EMPTY, BURST, NONE = (os.environ[k] for k in ("DAILY", "PIPE", "EMPTY", "BURST", "NONE"))
PROMPT = "Name three colours of the rainbow."

oa = openai.OpenAI(base_url=f"{BASE}/v1", api_key=KEY, max_retries=0)
an = anthropic.Anthropic(base_url=BASE, api_key=KEY, max_retries=0)
ol = ollama.Client(host=BASE, headers={"Authorization": f"Bearer {KEY}"})


def check(cond, what):
    if not cond:
        print(f"FAILED: {what}", file=sys.stderr)
        sys.exit(1)
    print(f"ok: {what}")


def expect(exc_type, fn, what, status=None):
    try:
        fn()
    except exc_type as e:
        code = getattr(e, "status_code", None)
        check(status is None or code == status, f"{what} ({exc_type.__name__}, {code})")
        return e
    check(False, f"{what}: no {exc_type.__name__} raised")


def chat(model, stream=False, **kw):
    args = dict(model=model, messages=[{"role": "user", "content": PROMPT}], max_tokens=20, temperature=0)
    args.update(kw)
    if not stream:
        return oa.chat.completions.create(**args)
    text, usage, finish = "", None, None
    for chunk in oa.chat.completions.create(stream=True, stream_options={"include_usage": True}, **args):
        if chunk.usage:
            usage = chunk.usage
        for c in chunk.choices:
            text += c.delta.content or ""
            finish = c.finish_reason or finish
    return text, usage, finish


# OpenAI: chat, streamed and not, the same greedy text; completions; models.
r = chat(DAILY)
reference = r.choices[0].message.content
check(len(reference) > 10 and r.choices[0].finish_reason in ("length", "stop"), f"openai chat: {reference!r}")
check(r.usage.completion_tokens <= 20 and r.usage.prompt_tokens > 5, f"openai usage {r.usage}")
text, usage, finish = chat(DAILY, stream=True)
check(text == reference, "openai streamed chat equals the non-streamed one")
check(usage is not None and usage.completion_tokens == r.usage.completion_tokens, "openai streamed usage")
check(finish == r.choices[0].finish_reason, "openai streamed finish reason")
check(chat(PIPE).choices[0].message.content == reference, "the 2-stage pipeline answers exactly as one node does")
c = oa.completions.create(model=DAILY, prompt="The capital of France is", max_tokens=5, temperature=0)
check(c.choices[0].text and c.usage.completion_tokens <= 5, f"openai completions: {c.choices[0].text!r}")
seeded = [chat(DAILY, temperature=0.9, top_p=0.95, seed=11).choices[0].message.content for _ in range(2)]
check(seeded[0] == seeded[1], "a seed repeats a sampled answer")
stopped = chat(DAILY, stop=[reference.split()[2]]).choices[0].message.content
check(reference.split()[2] not in stopped and len(stopped) < len(reference), f"a stop string ends the answer: {stopped!r}")
ids = {m.id for m in oa.models.list()}
check({DAILY, PIPE, EMPTY, BURST, NONE} <= ids, f"/v1/models lists the deployments ({len(ids)} names)")

# Log-probabilities (the model's own distribution): the greedy answer's
# tokens spell the text, each is the most likely of its alternatives, the
# stream gives the same, the pipeline nearly the same; legacy completions too.
lp = chat(DAILY, logprobs=True, top_logprobs=3).choices[0].logprobs.content
check("".join(t.token for t in lp) == reference and len(lp) == r.usage.completion_tokens, "openai logprobs: the tokens spell the answer")
check(all(t.logprob <= 0 and len(t.top_logprobs) == 3 and t.top_logprobs[0].token == t.token and t.top_logprobs[0].logprob == t.logprob
          and t.top_logprobs[0].logprob >= t.top_logprobs[1].logprob >= t.top_logprobs[2].logprob
          and sum(math.exp(a.logprob) for a in t.top_logprobs) <= 1.0001 and bytes(t.bytes).decode() == t.token for t in lp),
      f"openai logprobs: greedy picks the top token, alternatives sorted, probabilities within 1: {lp[0]}")
streamed_lp = [t for chunk in oa.chat.completions.create(model=DAILY, messages=[{"role": "user", "content": PROMPT}], max_tokens=20, temperature=0,
                                                         logprobs=True, top_logprobs=3, stream=True)
               for c in chunk.choices if c.logprobs for t in c.logprobs.content or []]
check([(t.token, t.logprob) for t in streamed_lp] == [(t.token, t.logprob) for t in lp], "openai logprobs: streamed equal whole")
piped = chat(PIPE, logprobs=True, top_logprobs=3).choices[0].logprobs.content
check([t.token for t in piped] == [t.token for t in lp] and all(abs(a.logprob - b.logprob) < 0.05 for a, b in zip(piped, lp)),
      f"openai logprobs: the pipeline's agree: {max(abs(a.logprob - b.logprob) for a, b in zip(piped, lp)):.4f} nats apart at most")
c = oa.completions.create(model=DAILY, prompt="The capital of France is", max_tokens=5, temperature=0, logprobs=2)
l = c.choices[0].logprobs
check("".join(l.tokens) == c.choices[0].text and all(len(t) <= 2 for t in l.top_logprobs) and l.text_offset[0] == 0,
      f"openai completions logprobs: {l.tokens} {l.token_logprobs}")
# Ollama and the Responses API give the same log-probabilities.
ol_lp = ol.chat(model=DAILY, messages=[{"role": "user", "content": PROMPT}], logprobs=True, top_logprobs=3,
                options={"temperature": 0, "num_predict": 20}).logprobs
check([(t.token, t.logprob) for t in ol_lp] == [(t.token, t.logprob) for t in lp] and len(ol_lp[0].top_logprobs) == 3,
      "ollama logprobs equal openai's")
ol_streamed = [t for part in ol.chat(model=DAILY, messages=[{"role": "user", "content": PROMPT}], logprobs=True, stream=True,
                                     options={"temperature": 0, "num_predict": 20}) for t in (part.logprobs or [])]
check([t.token for t in ol_streamed] == [t.token for t in lp], "ollama streamed logprobs equal whole")
rl = oa.responses.create(model=DAILY, input=PROMPT, max_output_tokens=20, temperature=0, top_logprobs=3,
                         include=["message.output_text.logprobs"])
r_lp = rl.output[0].content[0].logprobs
check([(t.token, t.logprob) for t in r_lp] == [(t.token, t.logprob) for t in lp] and len(r_lp[0].top_logprobs) == 3,
      "responses logprobs equal openai chat's")

# Anthropic: messages, streamed and not (this SDK no longer takes sampling
# parameters as arguments; they go in the body as the API defines them).
m = an.messages.create(model=DAILY, max_tokens=20, extra_body={"temperature": 0}, messages=[{"role": "user", "content": PROMPT}])
check(m.content[0].text == reference, "anthropic message equals the openai answer")
check(m.stop_reason in ("max_tokens", "end_turn") and m.usage.output_tokens <= 20, f"anthropic stop/usage {m.stop_reason} {m.usage}")
with an.messages.stream(model=DAILY, max_tokens=20, extra_body={"temperature": 0}, messages=[{"role": "user", "content": PROMPT}]) as s:
    streamed = "".join(s.text_stream)
    final = s.get_final_message()
check(streamed == reference and final.usage.output_tokens == m.usage.output_tokens, "anthropic stream")
m = an.messages.create(model=DAILY, max_tokens=20, extra_body={"temperature": 0}, system="Answer in French.",
                       messages=[{"role": "user", "content": [{"type": "text", "text": PROMPT}]}])
check(m.content[0].text and m.content[0].text != reference, "anthropic system prompt and content blocks")

# Ollama: chat and generate, streamed and not; tags.
o = ol.chat(model=DAILY, messages=[{"role": "user", "content": PROMPT}], options={"temperature": 0, "num_predict": 20})
check(o.message.content == reference and o.done and o.eval_count <= 20, "ollama chat")
parts = list(ol.chat(model=DAILY, messages=[{"role": "user", "content": PROMPT}], options={"temperature": 0, "num_predict": 20}, stream=True))
check("".join(p.message.content for p in parts) == reference and parts[-1].done, "ollama chat stream")
g = ol.generate(model=DAILY, prompt=PROMPT, options={"temperature": 0, "num_predict": 20})
check(g.response == reference, "ollama generate (chat template applied)")
gs = "".join(p.response for p in ol.generate(model=DAILY, prompt=PROMPT, options={"temperature": 0, "num_predict": 20}, stream=True))
check(gs == reference, "ollama generate stream")
check(DAILY in {x.model for x in ol.list().models}, "ollama tags")
sh = ol.show(DAILY)
check(any(k.endswith(".context_length") and v > 0 for k, v in (sh.modelinfo or {}).items()), f"ollama show: {sh.modelinfo}")
check(DAILY in {x.model for x in ol.ps().models}, "ollama ps lists the ready model")
o = ol.chat(model=DAILY + ":latest", messages=[{"role": "user", "content": PROMPT}], options={"temperature": 0, "num_predict": 20})
check(o.message.content == reference, "ollama: name:latest is name")
e = expect(ollama.ResponseError, lambda: ol.show("no-such-model"), "ollama show: an unknown model")
check(e.status_code == 404, "... is 404")

# Structured output: three JSON Schemas (nested objects, an array, enums;
# every valid instance fits the token limit) over 20 seeds, spread over both
# replicas and the pipeline; the output always parses and validates.
SCHEMAS = [
    {"type": "object", "additionalProperties": False, "required": ["name", "address"],
     "properties": {"name": {"type": "string", "minLength": 1, "maxLength": 16},
                    "address": {"type": "object", "additionalProperties": False, "required": ["city", "zip"],
                                "properties": {"city": {"type": "string", "maxLength": 16},
                                               "zip": {"type": "integer", "minimum": 0, "maximum": 99999}}}}},
    {"type": "object", "additionalProperties": False, "required": ["colours"],
     "properties": {"colours": {"type": "array", "minItems": 1, "maxItems": 3, "items": {"type": "string", "maxLength": 12}}}},
    {"type": "object", "additionalProperties": False, "required": ["answer", "confidence", "sure"],
     "properties": {"answer": {"enum": ["yes", "no", "maybe"]}, "confidence": {"type": "integer", "minimum": 0, "maximum": 100},
                    "sure": {"type": "boolean"}}},
]


def structured(job):
    i, seed = job
    model = PIPE if seed % 4 == 3 else DAILY
    r = oa.chat.completions.create(model=model, messages=[{"role": "user", "content": "Describe a person as JSON."}], max_tokens=120,
                                   temperature=1.0, seed=seed,
                                   response_format={"type": "json_schema", "json_schema": {"name": f"s{i}", "schema": SCHEMAS[i], "strict": True}})
    return i, seed, r.choices[0].message.content, r.choices[0].finish_reason


with concurrent.futures.ThreadPoolExecutor(4) as pool:
    results = list(pool.map(structured, [(seed % 3, seed) for seed in range(20)]))
bad = []
for i, seed, content, finish in results:
    try:
        jsonschema.validate(json.loads(content), SCHEMAS[i])
        if finish != "stop":
            bad.append(f"schema {i}, seed {seed}: finished by {finish}")
    except (ValueError, jsonschema.ValidationError) as e:
        bad.append(f"schema {i}, seed {seed}: {content!r}: {e}")
check(not bad, f"openai json_schema: {len(results)} answers (3 schemas, 20 seeds) parse, validate and end: {bad[:3]}")
jo = chat(DAILY, response_format={"type": "json_object"}, max_tokens=60, messages=[{"role": "user", "content": "Give me a JSON object."}])
body = jo.choices[0].message.content
check(jo.choices[0].finish_reason == "length" or isinstance(json.loads(body), dict), f"openai json_object: {body!r}")
fmt = {"type": "json_schema", "json_schema": {"name": "answer", "schema": SCHEMAS[2]}}
plain = chat(DAILY, response_format=fmt, max_tokens=60)
streamed, _, _ = chat(DAILY, stream=True, response_format=fmt, max_tokens=60)
check(streamed == plain.choices[0].message.content, f"openai: a streamed structured answer equals the non-streamed one: {streamed!r}")
check(chat(PIPE, response_format=fmt, max_tokens=60).choices[0].message.content == streamed, "... and the pipeline's")
for fmt in ("json", SCHEMAS[1]):
    o = ol.chat(model=DAILY, messages=[{"role": "user", "content": "Name colours as JSON."}], format=fmt, options={"num_predict": 60, "seed": 3})
    v = json.loads(o.message.content) if o.done_reason == "stop" else {}
    if fmt != "json":
        jsonschema.validate(v, fmt)
    check(o.done_reason == "length" or isinstance(v, dict), f"ollama format={fmt if fmt == 'json' else 'schema'}: {o.message.content!r}")

# Tool calling (the test model's template has no tools: the generic prompt,
# calls under a grammar). A forced call (required, or a named function)
# always comes, once, with arguments that parse and validate, for 20 seeds
# over both replicas and the pipeline.
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The current weather in a city.",
    "parameters": {"type": "object", "additionalProperties": False, "required": ["city", "unit"],
                   "properties": {"city": {"type": "string", "minLength": 1, "maxLength": 20},
                                  "unit": {"enum": ["celsius", "fahrenheit"]}}}}}
TIME = {"type": "function", "function": {
    "name": "get_time", "description": "The time in a time zone.",
    "parameters": {"type": "object", "additionalProperties": False, "required": ["zone"],
                   "properties": {"zone": {"type": "string", "minLength": 1, "maxLength": 20}}}}}
PARAMETERS = {t["function"]["name"]: t["function"]["parameters"] for t in (WEATHER, TIME)}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]


def forced(seed):
    choice = "required" if seed % 2 else {"type": "function", "function": {"name": "get_time"}}
    r = oa.chat.completions.create(model=PIPE if seed % 4 == 3 else DAILY, messages=ASK, tools=[WEATHER, TIME],
                                   tool_choice=choice, parallel_tool_calls=False, max_tokens=80, temperature=1.0, seed=seed)
    return seed, choice, r.choices[0]


with concurrent.futures.ThreadPoolExecutor(4) as pool:
    results = list(pool.map(forced, range(20)))
bad = []
for seed, choice, c in results:
    calls = c.message.tool_calls or []
    if c.finish_reason != "tool_calls" or len(calls) != 1:
        bad.append(f"seed {seed}: {c.finish_reason}, {len(calls)} calls, {c.message.content!r}")
        continue
    f = calls[0].function
    if choice != "required" and f.name != "get_time":
        bad.append(f"seed {seed}: called {f.name}, not the named get_time")
    try:
        jsonschema.validate(json.loads(f.arguments), PARAMETERS[f.name])
    except (ValueError, KeyError, jsonschema.ValidationError) as e:
        bad.append(f"seed {seed}: {f.name}({f.arguments}): {e!r}")
check(not bad, f"openai forced tool calls: 20 seeds each call once with valid arguments: {bad[:3]}")
forced_call = dict(model=DAILY, messages=ASK, tools=[WEATHER], tool_choice="required", max_tokens=80, temperature=0)
plain = oa.chat.completions.create(**forced_call)
call = plain.choices[0].message.tool_calls[0]
parts = {}
for chunk in oa.chat.completions.create(stream=True, **forced_call):
    for c in chunk.choices:
        for d in c.delta.tool_calls or []:
            p = parts.setdefault(d.index, {"name": "", "arguments": ""})
            p["name"] += (d.function.name or "") if d.function else ""
            p["arguments"] += (d.function.arguments or "") if d.function else ""
whole = [{"name": t.function.name, "arguments": t.function.arguments} for t in plain.choices[0].message.tool_calls]
check(list(parts.values()) == whole, f"openai: streamed tool-call deltas assemble to the non-streamed calls: {whole}")
history = ASK + [plain.choices[0].message.model_dump(exclude_none=True),
                 {"role": "tool", "tool_call_id": call.id, "content": "22 degrees and sunny"}]
final = oa.chat.completions.create(model=DAILY, messages=history, tools=[WEATHER], tool_choice="none", max_tokens=30, temperature=0)
check(final.choices[0].message.content and not final.choices[0].message.tool_calls,
      f"openai: after the tool's result, the answer: {final.choices[0].message.content!r}")
# Ollama: tools (always auto there): the answer is text or calls whose
# arguments validate; streamed calls equal the whole answer's; a tool result
# in the history is taken.
oc = dict(model=DAILY, messages=ASK, tools=[WEATHER], options={"temperature": 0, "num_predict": 80})
whole = ol.chat(**oc)
calls = [(c.function.name, dict(c.function.arguments)) for c in whole.message.tool_calls or []]
for name, arguments in calls:
    jsonschema.validate(arguments, PARAMETERS[name])
check(bool(calls) or bool(whole.message.content), f"ollama tools: text or valid calls: {whole.message.content!r} {calls}")
streamed = [(c.function.name, dict(c.function.arguments)) for p in ol.chat(stream=True, **oc) for c in p.message.tool_calls or []]
check(streamed == calls, f"ollama: streamed tool calls equal the whole answer's: {streamed}")
o = ol.chat(model=DAILY, tools=[WEATHER], options={"temperature": 0, "num_predict": 20}, messages=ASK + [
    {"role": "assistant", "content": "", "tool_calls": [{"function": {"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}}]},
    {"role": "tool", "tool_name": "get_weather", "content": "22 degrees and sunny"}])
check(o.done and "<tool_call>" not in o.message.content and (o.message.content or o.message.tool_calls or o.done_reason == "length"),
      f"ollama: a tool result in the history: {o.message.content!r} {o.message.tool_calls} {o.done_reason}")
again = oa.chat.completions.create(model=DAILY, messages=history, tools=[WEATHER], max_tokens=60, temperature=0)
m = again.choices[0].message
finish = again.choices[0].finish_reason
check("<tool_call>" not in (m.content or "") and all(json.loads(t.function.arguments) for t in m.tool_calls or []) and
      ((m.content and finish in ("stop", "length")) or (m.tool_calls and not m.content and finish in ("tool_calls", "length")) or finish == "length"),
      f"openai: tool_choice auto answers in text or in valid calls, never call syntax as text: {m.content!r} {m.tool_calls} {finish}")

# Anthropic: tools as custom tools; a forced call (any, or a named tool)
# always comes as one tool_use block with an input that validates, over 20
# samples (this API has no seed) on both replicas and the pipeline; the
# streamed input_json_delta assembles to the whole answer's input; a
# tool_result in the history is answered.
AN_TOOLS = [{"name": t["function"]["name"], "description": t["function"]["description"],
             "input_schema": t["function"]["parameters"]} for t in (WEATHER, TIME)]


def an_forced(i):
    choice = {"type": "any"} if i % 2 else {"type": "tool", "name": "get_time"}
    choice["disable_parallel_tool_use"] = True
    m = an.messages.create(model=PIPE if i % 4 == 3 else DAILY, max_tokens=80, messages=ASK, tools=AN_TOOLS,
                           tool_choice=choice, extra_body={"temperature": 1.0})
    return i, choice, m


with concurrent.futures.ThreadPoolExecutor(4) as pool:
    results = list(pool.map(an_forced, range(20)))
bad = []
for i, choice, m in results:
    uses = [b for b in m.content if b.type == "tool_use"]
    if m.stop_reason != "tool_use" or len(uses) != 1:
        bad.append(f"sample {i}: {m.stop_reason}, {m.content}")
        continue
    if choice["type"] == "tool" and uses[0].name != "get_time":
        bad.append(f"sample {i}: called {uses[0].name}, not the named get_time")
    try:
        jsonschema.validate(uses[0].input, PARAMETERS[uses[0].name])
    except (KeyError, jsonschema.ValidationError) as e:
        bad.append(f"sample {i}: {uses[0].name}({uses[0].input}): {e!r}")
check(not bad, f"anthropic forced tool use: 20 samples each call once with valid input: {bad[:3]}")
an_call = dict(model=DAILY, max_tokens=80, messages=ASK, tools=AN_TOOLS[:1], tool_choice={"type": "any", "disable_parallel_tool_use": True},
               extra_body={"temperature": 0})
plain = an.messages.create(**an_call)
deltas = 0
with an.messages.stream(**an_call) as s:
    for ev in s:
        deltas += ev.type == "content_block_delta" and ev.delta.type == "input_json_delta"
    final = s.get_final_message()
whole = [(b.name, b.input) for b in plain.content if b.type == "tool_use"]
check(deltas >= 1 and [(b.name, b.input) for b in final.content if b.type == "tool_use"] == whole and final.stop_reason == plain.stop_reason == "tool_use",
      f"anthropic: streamed input_json_delta assembles to the whole answer's tool_use: {whole}, {plain.stop_reason}; streamed {final.content}, {final.stop_reason}")
use = next(b for b in plain.content if b.type == "tool_use")
history = ASK + [{"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in plain.content]},
                 {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id, "content": "22 degrees and sunny"}]}]
final = an.messages.create(model=DAILY, max_tokens=30, messages=history, tools=AN_TOOLS[:1], tool_choice={"type": "none"},
                           extra_body={"temperature": 0})
check(final.content[0].type == "text" and final.content[0].text and final.stop_reason != "tool_use",
      f"anthropic: after the tool_result, the answer: {final.content[0].text!r}")

# The Responses API: text in, the same greedy answer as chat; streamed
# events assemble to the whole response; instructions; a function tool
# forced, its output sent back with previous_response_id; a conversation
# continued from the store; what is not implemented is a 400 naming it.
r = oa.responses.create(model=DAILY, input=PROMPT, max_output_tokens=20, temperature=0)
check(r.output_text == reference and r.usage.output_tokens <= 20, f"openai responses: {r.output_text!r}")
check((r.status == "incomplete") == (r.incomplete_details is not None), f"responses status {r.status} {r.incomplete_details}")
kept = oa.responses.retrieve(r.id)
check(kept.id == r.id and kept.output_text == r.output_text and kept.usage == r.usage, "openai responses: retrieved as answered")
check(oa.responses.delete(r.id) is None, "openai responses: deleted")
expect(openai.NotFoundError, lambda: oa.responses.retrieve(r.id), "openai responses: a deleted response is 404", 404)
# (cut by the limit, a stream ends in response.incomplete, as OpenAI's do)
deltas, streamed = "", None
with oa.responses.stream(model=DAILY, input=PROMPT, max_output_tokens=20, temperature=0) as s:
    for e in s:
        deltas += e.delta if e.type == "response.output_text.delta" else ""
        streamed = e.response if e.type in ("response.completed", "response.incomplete") else streamed
check(deltas == reference and streamed.output_text == reference and streamed.usage.output_tokens == r.usage.output_tokens
      and streamed.status == r.status, "openai responses: streamed deltas and the final response equal the whole answer")
with oa.responses.stream(model=DAILY, input="Say hi.", max_output_tokens=200, temperature=0) as s:
    done = s.get_final_response()
check(done.status == "completed" and done.output_text, f"openai responses: a stream that completes: {done.output_text!r}")
check(oa.responses.create(model=PIPE, input=PROMPT, max_output_tokens=20, temperature=0).output_text == reference, "... and the pipeline's")
fr = oa.responses.create(model=DAILY, input=PROMPT, instructions="Answer in French.", max_output_tokens=20, temperature=0)
check(fr.output_text and fr.output_text != reference and fr.instructions == "Answer in French.", "openai responses: instructions")
RTOOL = {"type": "function", "name": "get_weather", "description": WEATHER["function"]["description"],
         "parameters": WEATHER["function"]["parameters"], "strict": True}
rc = oa.responses.create(model=DAILY, input="What is the weather in Paris?", tools=[RTOOL], tool_choice="required", parallel_tool_calls=False,
                         max_output_tokens=80, temperature=0)
fc = [o for o in rc.output if o.type == "function_call"]
check(len(fc) == 1 and fc[0].name == "get_weather", f"openai responses: a forced function call: {rc.output}")
jsonschema.validate(json.loads(fc[0].arguments), PARAMETERS["get_weather"])
args = "".join(e.delta for e in oa.responses.create(model=DAILY, input="What is the weather in Paris?", tools=[RTOOL], tool_choice="required", parallel_tool_calls=False,
                                                    max_output_tokens=80, temperature=0, stream=True)
               if e.type == "response.function_call_arguments.delta")
check(args == fc[0].arguments, f"openai responses: streamed argument deltas equal the whole call's: {args}")
after = oa.responses.create(model=DAILY, previous_response_id=rc.id, tools=[RTOOL], tool_choice="none", max_output_tokens=30, temperature=0,
                            input=[{"type": "function_call_output", "call_id": fc[0].call_id, "output": "22 degrees and sunny"}])
check(after.output_text and after.previous_response_id == rc.id,
      f"openai responses: the function's output, chained by previous_response_id: {after.output_text!r}")
first = oa.responses.create(model=DAILY, input="My name is Ann.", max_output_tokens=10, temperature=0)
second = oa.responses.create(model=DAILY, input="What is my name?", previous_response_id=first.id, max_output_tokens=10, temperature=0)
alone = oa.responses.create(model=DAILY, input="What is my name?", max_output_tokens=10, temperature=0)
check(second.usage.input_tokens > alone.usage.input_tokens + 5, "openai responses: previous_response_id carries the conversation")
e = expect(openai.BadRequestError, lambda: oa.responses.create(model=DAILY, input="x", previous_response_id="resp_nope"),
           "openai responses: an unknown previous_response_id is 400", 400)
check("previous_response_id" in str(e), "... naming it")
e = expect(openai.BadRequestError, lambda: oa.responses.create(model=DAILY, input="x", reasoning={"effort": "high", "summary": "detailed"}),
           "openai responses: a reasoning summary is refused, not ignored", 400)
check("reasoning.summary" in str(e), "... naming it")

# Errors, each in its API's shape.
expect(openai.NotFoundError, lambda: chat("no-such-model"), "openai: unknown model is 404", 404)
expect(anthropic.NotFoundError, lambda: an.messages.create(model="no-such-model", max_tokens=5, messages=[{"role": "user", "content": "x"}]), "anthropic: unknown model is 404", 404)
e = expect(ollama.ResponseError, lambda: ol.chat(model="no-such-model", messages=[{"role": "user", "content": "x"}]), "ollama: unknown model")
check(e.status_code == 404, "ollama: 404")
e = expect(openai.BadRequestError, lambda: oa.chat.completions.create(model=DAILY, messages=[{"role": "user", "content": "word " * 5000}], max_tokens=5), "openai: a prompt over the context is 400", 400)
check("context" in str(e), "the 400 says why")
expect(openai.BadRequestError, lambda: chat(DAILY, temperature=5), "openai: temperature out of range is 400", 400)
expect(anthropic.BadRequestError, lambda: an.messages.create(model=DAILY, max_tokens=5, messages=[]), "anthropic: no messages is 400", 400)
# What the gateway does not implement is refused, naming the field, never ignored.
e = expect(openai.BadRequestError, lambda: chat(DAILY, tools=[{"type": "retrieval"}]), "openai: a tool type not implemented is refused, not ignored", 400)
check("tools[0].type" in str(e), "... the 400 names `tools[0].type`")
e = expect(openai.BadRequestError, lambda: chat(DAILY, response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "object"}, "pattern_hint": 1}}),
           "openai: an unknown field inside response_format is refused", 400)
check("response_format.json_schema.pattern_hint" in str(e), "... the 400 names it")
e = expect(openai.BadRequestError, lambda: chat(DAILY, response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "no-such-type"}}}),
           "openai: a schema the grammar compiler refuses is 400", 400)
check("no-such-type" in str(e), "... saying why")
check(chat(DAILY, response_format={"type": "text"}, user="u-1").choices[0].message.content == reference, "openai: fields asking for nothing more pass")
e = expect(anthropic.BadRequestError, lambda: an.messages.create(model=DAILY, max_tokens=5, messages=[{"role": "user", "content": "x"}],
                                                                   tools=[{"type": "web_search_20250305", "name": "web_search"}]), "anthropic: a server tool is refused", 400)
check("`tools[0].type`" in str(e), "... the 400 names `tools[0].type`")
# (the ollama client itself refuses such a format, so this one goes by hand)
resp = httpx.post(BASE + "/api/chat", json={"model": DAILY, "messages": [{"role": "user", "content": "x"}], "format": "yaml"},
                  headers={"Authorization": f"Bearer {KEY}"})
check(resp.status_code == 400 and "`format`" in resp.json()["error"], f"ollama: a format other than json or a schema is a 400 naming `format`: {resp.text}")
e = expect(ollama.ResponseError, lambda: ol.generate(model=DAILY, prompt="x", options={"mirostat": 2}), "ollama: an option not implemented is refused")
check(e.status_code == 400 and "options.mirostat" in str(e), "... 400 naming `options.mirostat`")
check(oa.models.retrieve(DAILY).id == DAILY, "openai: GET /v1/models/{id}")
expect(openai.NotFoundError, lambda: oa.models.retrieve("no-such-model"), "openai: GET /v1/models/{id} of an unknown model is 404", 404)
for path, shape in [("/v1/chat/completions", lambda b: b["error"]["type"] == "invalid_request_error"),
                    ("/v1/messages", lambda b: b["type"] == "error" and b["error"]["type"] == "invalid_request_error"),
                    ("/api/chat", lambda b: isinstance(b["error"], str))]:
    resp = httpx.post(BASE + path, content=b"{not json", headers={"Authorization": f"Bearer {KEY}"})
    check(resp.status_code == 400 and shape(resp.json()), f"malformed JSON on {path} is 400 in its API's shape")
expect(openai.AuthenticationError, lambda: openai.OpenAI(base_url=f"{BASE}/v1", api_key="sk-wrong", max_retries=0).models.list(), "openai: a wrong key is 401", 401)
expect(anthropic.AuthenticationError, lambda: anthropic.Anthropic(base_url=BASE, api_key="sk-wrong", max_retries=0).messages.create(model=DAILY, max_tokens=5, messages=[{"role": "user", "content": "x"}]), "anthropic: a wrong key is 401", 401)
check(httpx.get(BASE + "/api/tags").status_code == 401, "ollama: no key is 401")

# Fallbacks: another deployment, an external endpoint; nothing left: 503 with Retry-After.
check(chat(EMPTY).choices[0].message.content == reference, "a deployment with nothing ready falls back to another deployment")
check(chat(BURST).choices[0].message.content == reference, "... or to an external OpenAI-compatible endpoint")
text, _, _ = chat(BURST, stream=True)
check(text == reference, "the external fallback streams too")
e = expect(openai.APIStatusError, lambda: chat(NONE), "nothing can serve: 503", 503)
check(e.response.headers.get("retry-after") == "5", "503 carries Retry-After")

# A client that goes away mid-stream (the caller then checks the agents freed it).
stream = oa.chat.completions.create(model=DAILY, messages=[{"role": "user", "content": "Tell me a long story."}],
                                    max_tokens=3000, temperature=0, stream=True)
got = 0
for chunk in stream:
    got += 1
    if got == 5:
        break
stream.close()
check(got == 5, "read 5 chunks, then went away")
print("all client checks passed")
