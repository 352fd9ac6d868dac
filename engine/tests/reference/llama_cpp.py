"""Records what llama.cpp makes of each family's tiny GGUF model, as
fixtures the family tests compare with (llama.cpp takes minutes to build, so
the tests do not run it; this script stays so anyone can check them again).

    python llama_cpp.py LLAMA_SERVER [FAMILY ...]

LLAMA_SERVER is a llama-server binary (llama.cpp, built as
shared/design/testing.md says). For each family, tiny_model.py writes the
model (seed 0) into a temporary directory, llama-server loads its GGUF, and
one greedy completion of the tiny prompt (16 tokens) and, for each step, the
5 most likely tokens' log-probabilities (a one-token completion of the prompt
and the tokens before it), with an f32 KV cache and without flash attention
(whose f16 arithmetic moves log-probabilities by 1e-3), are written to
engine/tests/fixtures/llama-cpp/FAMILY.json:

    tokens     the 16 greedy tokens
    top        per step, [[token, logprob], ...] for the 5 most likely, or
               null where the server withheld them (a token ending inside a
               UTF-8 character)
    reference  mlx-lm's 16 greedy tokens on the same weights (the test checks
               its own tiny model against them, so a fixture never meets
               other weights)
"""

import json
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

HERE = Path(__file__).resolve().parent
FIXTURES = HERE.parent / "fixtures" / "llama-cpp"
FAMILIES = ["gemma3_text", "qwen3_moe_routed", "qwen2_moe", "mixtral", "llama3", "qwen2_yarn"]


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def post(url, body):
    req = urllib.request.Request(
        url, json.dumps(body).encode(), {"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(req, timeout=60) as r:
        return json.load(r)


def record(server, family, work):
    out = work / family
    subprocess.run([sys.executable, str(HERE / "tiny_model.py"), str(out), family], check=True)
    reference = json.loads((out / "reference.json").read_text())
    port = free_port()
    proc = subprocess.Popen(
        [server, "-m", str(out / "model.gguf"), "--port", str(port), "-t", "1", "-c", "128",
         "--no-warmup", "-np", "1",
         # f32 KV cache: the engines keep f32 keys and values (llama.cpp's
         # default f16 moves log-probabilities by about 1e-3).
         "-ctk", "f32", "-ctv", "f32", "-fa", "off"],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        base = f"http://127.0.0.1:{port}"
        for _ in range(300):
            try:
                with urllib.request.urlopen(f"{base}/health", timeout=1) as r:
                    if r.status == 200:
                        break
            except Exception:
                time.sleep(0.1)
        steps = len(reference["tokens"])
        request = {
            "temperature": 0,
            "top_k": 1,
            "n_probs": 5,
            "post_sampling_probs": False,
            "return_tokens": True,
            "cache_prompt": False,
        }
        answer = post(
            f"{base}/completion",
            dict(request, prompt=reference["prompt"], n_predict=steps),
        )
        tokens = answer["tokens"]
        # Each step's top five from a one-token completion of the prompt and
        # the tokens before it: in one longer completion the server's
        # per-token probabilities fall out of step with its tokens once a
        # token ends inside a UTF-8 character.
        top = []
        for k in range(steps):
            one = post(
                f"{base}/completion",
                dict(request, prompt=reference["prompt"] + tokens[:k], n_predict=1),
            )
            # The server withholds the probabilities of a token that ends
            # inside a UTF-8 character (these byte tokens often do): none then.
            probs = one.get("completion_probabilities")
            top.append(probs and [[p["id"], p["logprob"]] for p in probs[0]["top_logprobs"]])
    finally:
        proc.terminate()
        proc.wait()
    fixture = {"tokens": tokens, "top": top, "reference": reference["tokens"]}
    FIXTURES.mkdir(parents=True, exist_ok=True)
    (FIXTURES / f"{family}.json").write_text(json.dumps(fixture) + "\n")
    same = fixture["tokens"] == reference["tokens"]
    print(f"{family}: llama.cpp's tokens {'equal' if same else 'DIFFER FROM'} mlx-lm's")


def main():
    server = sys.argv[1]
    families = sys.argv[2:] or FAMILIES
    with tempfile.TemporaryDirectory() as work:
        for family in families:
            record(server, family, Path(work))


if __name__ == "__main__":
    main()
