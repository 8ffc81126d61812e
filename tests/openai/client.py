#!/usr/bin/env python3
"""The real `openai` client against a running kdtree-engine server (tests/server.rs starts one).

Usage: client.py BASE_URL   (e.g. http://127.0.0.1:8000/v1)
Checks completion, chat, streaming (text equal to the whole answer, usage last), logprobs and stop
strings; prints one line per check and "openai client: all checks passed" at the end.
"""
import sys

import openai

client = openai.OpenAI(base_url=sys.argv[1], api_key="unused", max_retries=0, timeout=120)
PROMPT = "It is a truth universally acknowledged, that"


def check(name, ok, detail=""):
    print(f"{'ok ' if ok else 'FAIL'} {name} {detail}")
    if not ok:
        sys.exit(1)


print("openai", openai.__version__)
models = client.models.list()
check("models", [m.id for m in models.data] == ["tiny-k2"], str([m.id for m in models.data]))

whole = client.completions.create(model="tiny-k2", prompt=PROMPT, max_tokens=24, temperature=0)
text = whole.choices[0].text
check("completion", len(text) > 0 and whole.usage.completion_tokens == 24, repr(text))

parts, usage = [], None
for chunk in client.completions.create(model="tiny-k2", prompt=PROMPT, max_tokens=24, temperature=0,
                                       stream=True, stream_options={"include_usage": True}):
    if chunk.choices:
        parts.append(chunk.choices[0].text)
    if chunk.usage:
        usage = chunk.usage
check("completion stream", "".join(parts) == text and usage is not None and usage.completion_tokens == 24)

chat = client.chat.completions.create(model="tiny-k2", messages=[{"role": "user", "content": "Tell me of Emma."}],
                                      max_tokens=20, temperature=0)
reply = chat.choices[0].message.content
check("chat", chat.choices[0].message.role == "assistant" and len(reply) > 0, repr(reply))

parts = []
for chunk in client.chat.completions.create(model="tiny-k2", messages=[{"role": "user", "content": "Tell me of Emma."}],
                                            max_tokens=20, temperature=0, stream=True):
    if chunk.choices and chunk.choices[0].delta.content:
        parts.append(chunk.choices[0].delta.content)
check("chat stream", "".join(parts) == reply)

lp = client.completions.create(model="tiny-k2", prompt=PROMPT, max_tokens=8, temperature=0, logprobs=2)
logprobs = lp.choices[0].logprobs
check("completion logprobs", len(logprobs.tokens) == 8 and "".join(logprobs.tokens) == lp.choices[0].text
      and all(len(t) == 2 for t in logprobs.top_logprobs) and all(x <= 0 for x in logprobs.token_logprobs))

clp = client.chat.completions.create(model="tiny-k2", messages=[{"role": "user", "content": "Hello"}], max_tokens=6,
                                     temperature=0, logprobs=True, top_logprobs=3)
content = clp.choices[0].logprobs.content
check("chat logprobs", len(content) == 6 and all(len(c.top_logprobs) == 3 for c in content)
      and all(c.logprob == max(t.logprob for t in c.top_logprobs) for c in content))

words = [w for w in text.split(" ") if len(w) >= 3]
stop = words[len(words) // 2]
cut = client.completions.create(model="tiny-k2", prompt=PROMPT, max_tokens=24, temperature=0, stop=[stop])
check("stop string", cut.choices[0].text == text[:text.find(stop)] and cut.choices[0].finish_reason == "stop",
      f"stop {stop!r}: {cut.choices[0].text!r}")

sampled = [client.completions.create(model="tiny-k2", prompt=PROMPT, max_tokens=16, temperature=0.8, top_p=0.9,
                                     seed=7).choices[0].text for _ in range(2)]
check("seeded sampling repeats", sampled[0] == sampled[1], repr(sampled[0]))

try:
    client.completions.create(model="tiny-k2", prompt=PROMPT, max_tokens=4, temperature=5)
    check("bad temperature", False)
except openai.BadRequestError as e:
    check("bad temperature is a 400", e.status_code == 400 and "temperature" in str(e))
print("openai client: all checks passed")
