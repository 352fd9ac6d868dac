"""Thinking on, off and bounded, through the official clients.

Run by cli/tests/gateway.rs against a running system. THINK serves the test
model with a chat template whose generation prompt opens `<think>` (as
DeepSeek-R1's distills do): left alone, the answer is reasoning; each API's
switch turns it off (the opened block is closed, and the model answers);
Anthropic's budget closes it after that many tokens. Exits non-zero on the
first failure.
"""
import os
import sys

import anthropic
import httpx
import ollama
import openai

BASE = os.environ["GATEWAY"]
KEY = os.environ["API_KEY"]
THINK = os.environ["THINK"]
PROMPT = "Name three colours of the rainbow."
MESSAGES = [{"role": "user", "content": PROMPT}]
LIMIT = 16

oa = openai.OpenAI(base_url=f"{BASE}/v1", api_key=KEY, max_retries=0)
an = anthropic.Anthropic(base_url=BASE, api_key=KEY, max_retries=0)
ol = ollama.Client(host=BASE, headers={"Authorization": f"Bearer {KEY}"})


def check(cond, what):
    if not cond:
        print(f"FAILED: {what}", file=sys.stderr)
        sys.exit(1)
    print(f"ok: {what}")


def chat(**kw):
    return oa.chat.completions.create(model=THINK, messages=MESSAGES, max_tokens=LIMIT, temperature=0, **kw)


def reasoning_of(message):
    return (message.model_extra or {}).get("reasoning_content")


# OpenAI chat. Left alone, the template opens reasoning: every token is
# reasoning, none is content.
on = chat()
thoughts = reasoning_of(on.choices[0].message)
check(thoughts and not on.choices[0].message.content, f"openai: thinking by default: {thoughts!r}")
check(on.choices[0].finish_reason == "length", "openai: the reasoning ran to the limit")

# reasoning_effort "none" and chat_template_kwargs turn it off alike.
off = chat(reasoning_effort="none")
answer = off.choices[0].message.content
check(answer and not reasoning_of(off.choices[0].message), f"openai reasoning_effort none: {answer!r}")
kwargs = chat(extra_body={"chat_template_kwargs": {"enable_thinking": False}})
check(kwargs.choices[0].message.content == answer, "openai chat_template_kwargs enable_thinking false answers the same")
check(on.usage.prompt_tokens < off.usage.prompt_tokens, "thinking off closes the opened block in the prompt")
low = chat(reasoning_effort="low")
check(reasoning_of(low.choices[0].message) == thoughts, "openai reasoning_effort low thinks")

# Streamed: the same split, delta by delta.
reasoning, content = "", ""
for chunk in oa.chat.completions.create(model=THINK, messages=MESSAGES, max_tokens=LIMIT, temperature=0, stream=True):
    for c in chunk.choices:
        reasoning += (c.delta.model_extra or {}).get("reasoning_content") or ""
        content += c.delta.content or ""
check(reasoning == thoughts and content == "", "openai streamed reasoning equals the whole answer's")
content = ""
for chunk in oa.chat.completions.create(
    model=THINK, messages=MESSAGES, max_tokens=LIMIT, temperature=0, stream=True, reasoning_effort="none"
):
    for c in chunk.choices:
        check(not (c.delta.model_extra or {}).get("reasoning_content"), "openai streamed, thinking off: no reasoning delta")
        content += c.delta.content or ""
check(content == answer, "openai streamed answer with thinking off equals the whole one")

# A contradiction, or a name the gateway sets, is a 400 in OpenAI's shape.
e = None
try:
    chat(reasoning_effort="none", extra_body={"chat_template_kwargs": {"enable_thinking": True}})
except openai.BadRequestError as err:
    e = err
check(e is not None and "contradicts" in str(e), f"openai: contradicting switches are a 400: {e}")
e = None
try:
    chat(extra_body={"chat_template_kwargs": {"messages": []}})
except openai.BadRequestError as err:
    e = err
check(e is not None and "messages" in str(e), f"openai: a standard template name is a 400: {e}")

# The Responses API: reasoning.effort none leaves no reasoning item.
r = oa.responses.create(model=THINK, input=PROMPT, max_output_tokens=LIMIT, temperature=0)
check(r.output[0].type == "reasoning", "responses: a reasoning item by default")
r = oa.responses.create(model=THINK, input=PROMPT, max_output_tokens=LIMIT, temperature=0, reasoning={"effort": "none"})
check([o.type for o in r.output] == ["message"] and r.output_text == answer, f"responses effort none: {r.output_text!r}")

# Anthropic (its client takes no temperature: greedy goes in the body):
# thinking disabled answers the same; a budget closes the
# thinking after that many tokens and the answer follows.
m = an.messages.create(model=THINK, max_tokens=LIMIT, extra_body={"temperature": 0}, messages=MESSAGES)
check(m.content[0].type == "thinking" and not "".join(b.text for b in m.content if b.type == "text"),
      "anthropic: a thinking block (and no text) by default")
m = an.messages.create(model=THINK, max_tokens=LIMIT, extra_body={"temperature": 0}, messages=MESSAGES, thinking={"type": "disabled"})
check([b.type for b in m.content] == ["text"] and m.content[0].text == answer, "anthropic thinking disabled answers the same")
m = an.messages.create(
    model=THINK, max_tokens=48, extra_body={"temperature": 0}, messages=MESSAGES, thinking={"type": "enabled", "budget_tokens": 4}
)
kinds = [b.type for b in m.content]
check(kinds == ["thinking", "text"], f"anthropic budget: thinking, then text ({kinds})")
check(thoughts.strip().startswith(m.content[0].thinking.strip()) and len(m.content[0].thinking) < len(thoughts),
      f"anthropic budget: the thinking is cut: {m.content[0].thinking!r}")
check(m.content[1].text.strip(), f"anthropic budget: then an answer: {m.content[1].text!r}")
with an.messages.stream(
    model=THINK, max_tokens=48, extra_body={"temperature": 0}, messages=MESSAGES, thinking={"type": "enabled", "budget_tokens": 4}
) as s:
    streamed = s.get_final_message()
check([b.type for b in streamed.content] == kinds and streamed.content[1].text == m.content[1].text,
      "anthropic budget, streamed: the same blocks")
e = None
try:
    an.messages.create(model=THINK, max_tokens=8, messages=MESSAGES, thinking={"type": "enabled", "budget_tokens": 8})
except anthropic.BadRequestError as err:
    e = err
check(e is not None and "budget_tokens" in str(e), f"anthropic: a budget of max_tokens is a 400: {e}")

# Ollama: think false and true.
o = ol.chat(model=THINK, messages=MESSAGES, think=False, options={"temperature": 0, "num_predict": LIMIT})
check(o.message.content == answer and not o.message.thinking, "ollama think false answers the same")
o = ol.chat(model=THINK, messages=MESSAGES, think=True, options={"temperature": 0, "num_predict": LIMIT})
check(o.message.thinking and not o.message.content, "ollama think true: thinking")
g = ol.generate(model=THINK, prompt=PROMPT, think=False, options={"temperature": 0, "num_predict": LIMIT})
check(g.response == answer and not g.thinking, "ollama generate think false answers the same")
status = httpx.post(f"{BASE}/api/chat", headers={"Authorization": f"Bearer {KEY}"},
                    json={"model": THINK, "messages": MESSAGES, "think": "max", "stream": False}).status_code
check(status == 400, "ollama: an unknown think level is a 400")
