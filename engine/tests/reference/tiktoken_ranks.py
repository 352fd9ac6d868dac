"""Writes a small tokenizer kept as tiktoken ranks, the way Kimi K2's
repositories keep theirs (`tiktoken.model`, and `tokenizer_config.json`
naming its code and its special tokens), with `tiktoken`'s encodings of
many texts as the reference.

    python tiktoken_ranks.py OUT_DIR

OUT_DIR/kimi/ holds the tokenizer's files; OUT_DIR/kimi.json lists
{"text", "ids", "decoded"}.

The ranks come from a byte-level BPE trained with Kimi K2's splits (the
`tokenizers` package): the 256 bytes first, then each merge's token in the
order learned, so every token is two earlier ones joined, as tiktoken
needs. tiktoken then encodes with those ranks and the same splits.
"""

import base64
import json
import sys
from pathlib import Path

import tiktoken
from bpe_pretokenizers import CORPUS, KIMI_K2, TEXTS, build
from tiny_tokenizer import sample_texts

# Named special tokens after the ranks, as Kimi K2's config names its
# first ones; the rest of the 256 are reserved.
NAMED = ["[BOS]", "[EOS]", "<|im_end|>", "<|im_user|>", "<|im_assistant|>"]
RESERVED = 256


def byte_decoder():
    """GPT-2's visible characters back to bytes."""
    visible = list(range(0x21, 0x7F)) + list(range(0xA1, 0xAD)) + list(range(0xAE, 0x100))
    chars, n = {}, 0
    for b in range(256):
        if b in visible:
            chars[chr(b)] = b
        else:
            chars[chr(256 + n)] = b
            n += 1
    return chars


def ranks_of(tok):
    decode = byte_decoder()
    state = json.loads(tok.to_str())
    merges = [m.split(" ") if isinstance(m, str) else m for m in state["model"]["merges"]]
    ranks = {bytes([b]): b for b in range(256)}
    for left, right in merges:
        token = bytes(decode[c] for c in left + right)
        if token not in ranks:
            ranks[token] = len(ranks)
    return ranks


def main():
    out = Path(sys.argv[1])
    model = out / "kimi"
    model.mkdir(parents=True, exist_ok=True)
    ranks = ranks_of(build([KIMI_K2], False))
    with open(model / "tiktoken.model", "w") as f:
        for token, rank in sorted(ranks.items(), key=lambda kv: kv[1]):
            f.write(f"{base64.b64encode(token).decode()} {rank}\n")
    n = len(ranks)
    specials = {f"<|reserved_token_{i}|>": i for i in range(n, n + RESERVED)}
    for i, name in enumerate(NAMED):
        del specials[f"<|reserved_token_{n + i}|>"]
        specials[name] = n + i
    config = {
        "auto_map": {"AutoTokenizer": ["tokenization_kimi.TikTokenTokenizer", None]},
        "tokenizer_class": "TikTokenTokenizer",
        "added_tokens_decoder": {
            str(n + i): {"content": name, "special": True} for i, name in enumerate(NAMED)
        },
        "bos_token": "[BOS]",
        "eos_token": "[EOS]",
        "chat_template": "{% for m in messages %}<|im_{{ m.role }}|>{{ m.content }}<|im_end|>{% endfor %}"
        "{% if add_generation_prompt %}<|im_assistant|>{% endif %}",
    }
    (model / "tokenizer_config.json").write_text(json.dumps(config))
    (model / "config.json").write_text(
        json.dumps({"model_type": "kimi_k2", "bos_token_id": n, "eos_token_id": n + 1})
    )
    enc = tiktoken.Encoding(
        name="kimi-tiny", pat_str=KIMI_K2, mergeable_ranks=ranks, special_tokens=specials
    )
    cases = []
    for t in sample_texts(TEXTS, CORPUS, 300):
        ids = enc.encode(t, allowed_special="all")
        cases.append({"text": t, "ids": ids, "decoded": enc.decode(ids)})
    for text in [
        "<|im_user|> Why is the sky blue?<|im_end|>",
        f"[BOS]深度求索<|reserved_token_{n + 200}|>x",
    ]:
        cases.append({"text": text, "ids": enc.encode(text, allowed_special="all"), "decoded": None})
    (out / "kimi.json").write_text(json.dumps(cases, ensure_ascii=False))


if __name__ == "__main__":
    main()
