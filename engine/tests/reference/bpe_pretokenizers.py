"""Trains a small byte-level BPE tokenizer for each of several GGUF
pre-tokenizer types (`tokenizer.ggml.pre`), with the pre-tokenizer the
model family's own tokenizer defines, and writes it as GGUF tokenizer
metadata the way llama.cpp's converter does, with the `tokenizers`
package's encodings of many texts as the reference.

    python bpe_pretokenizers.py OUT_DIR

For each type, OUT_DIR/<type>.gguf and OUT_DIR/<type>.json; the JSON lists
{"text", "ids", "decoded"} (ids without BOS).
"""

import json
import sys
from pathlib import Path

import gguf
from tiny_tokenizer import TEXTS as SENTENCEPIECE_TEXTS
from tiny_tokenizer import corpus_lines, sample_texts
from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers

# The families' splits, each applied to the pieces of the one before and
# kept as pieces of their own ("isolated"), then bytes mapped as GPT-2 does.
LLAMA3 = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
QWEN35 = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
QWEN2 = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
# Letters as DeepSeek LLM's tokenizer lists them (escaped: several are
# compatibility characters that editors normalise).
DEEPSEEK_LETTERS = "A-Za-z\xb5\xc0-\xd6\xd8-\xf6\xf8-\u01ba\u01bc-\u01bf\u01c4-\u0293\u0295-\u02af\u0370-\u0373\u0376\u0377\u037b-\u037d\u037f\u0386\u0388-\u038a\u038c\u038e-\u03a1\u03a3-\u03f5\u03f7-\u0481\u048a-\u052f\u0531-\u0556\u10a0-\u10c5\u13a0-\u13f5\u13f8-\u13fd\u1c90-\u1cba\u1cbd-\u1cbf\u1d00-\u1d2b\u1d6b-\u1d77\u1d79-\u1d9a\u1e00-\u1f15\u1f18-\u1f1d\u1f20-\u1f45\u1f48-\u1f4d\u1f50-\u1f57\u1f59\u1f5b\u1f5d\u1f5f-\u1f7d\u1f80-\u1fb4\u1fb6-\u1fbc\u1fbe\u1fc2-\u1fc4\u1fc6-\u1fcc\u1fd0-\u1fd3\u1fd6-\u1fdb\u1fe0-\u1fec\u1ff2-\u1ff4\u1ff6-\u1ffc\u2102\u2107\u210a-\u2113\u2115\u2119-\u211d\u2124\u2126\u2128\u212a-\u212d\u212f-\u2134\u2139\u213c-\u213f\u2145-\u2149\u214e\u2183\u2184\u2c00-\u2c7b\u2c7e-\u2ce4\u2ceb-\u2cee\u2cf2\u2cf3\ua640-\ua66d\ua680-\ua69b\ua722-\ua76f\ua771-\ua787\ua78b-\ua78e\uab70-\uabbf\ufb00-\ufb06\ufb13-\ufb17\uff21-\uff3a\uff41-\uff5a\U00010400-\U0001044f\U000104b0-\U000104d3\U000104d8-\U000104fb\U00010c80-\U00010cb2\U00010cc0-\U00010cf2\U000118a0-\U000118df\U0001e900-\U0001e943"
CJK = "[\u4e00-\u9fa5\u0800-\u4e00\uac00-\ud7ff]+"
DEEPSEEK_LLM = [
    r"[\r\n]",
    r"\s?[" + DEEPSEEK_LETTERS + "]+",
    r"\s?[!-/:-~" + "\uff01-\uff0f\uff1a-\uff5e\u2018-\u201f\u3000-\u3002" + "]+",
    r"\s+$",
    CJK,
    r"\p{N}+",
]
DEEPSEEK_CODER = [r"[\r\n]", r"\s?\p{L}+", r"\s?\p{P}+", CJK, r"\p{N}"]
DEEPSEEK_V3 = [
    r"\p{N}{1,3}",
    "[\u4e00-\u9fa5\u3040-\u309f\u30a0-\u30ff]+",
    r"[!\"#$%&'()*+,\-./:;<=>?@\[\\\]^_`{|}~][A-Za-z]+|[^\r\n\p{L}\p{P}\p{S}]?[\p{L}\p{M}]+| ?[\p{P}\p{S}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+",
]
KIMI_K2 = r"[\p{Han}]+|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
GPT4O = r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
TEKKEN = r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"

# GGUF type: (splits, whether a piece found whole in the vocabulary skips
# the merges, as the family's tokenizer.json says with `ignore_merges`).
TYPES = {
    "llama-bpe": ([LLAMA3], True),
    "qwen2": ([QWEN2], False),
    "qwen35": ([QWEN35], False),
    "deepseek-llm": (DEEPSEEK_LLM, False),
    "deepseek-coder": (DEEPSEEK_CODER, False),
    "deepseek-v3": (DEEPSEEK_V3, False),
    "kimi-k2": ([KIMI_K2], False),
    "gpt-4o": ([GPT4O], False),
    "tekken": ([TEKKEN], True),
    "glm4": ([LLAMA3], True),
}

SPECIALS = ["<|begin|>", "<|end|>", "<|user|>"]

CORPUS = """\
The quick brown fox jumps over the lazy dog. It's what they'll say; we'd've known, I'm sure.
Rayleigh scattering makes the sky blue: shorter wavelengths scatter more than longer ones.
def fibonacci(n):
    if n < 2:
        return n
    return fibonacci(n - 1) + fibonacci(n - 2)
Numbers like 12345, 3.14159, 1000000 and 2026-11-25 appear in text; so do prices ($19.99) and ratios (4:3).
Das Mädchen trägt einen Übermantel. Le café est très chaud. ¿Dónde está la biblioteca?
Ελληνικά γράμματα και Кириллица тоже встречаются в тексте.
深度求索的模型在中文上表现很好。我们今天讨论分布式推理。
日本語のテキストにはひらがなとカタカナと漢字が混ざっています。
한국어 문장도 토큰화됩니다.
CamelCaseIdentifiers and snake_case_names, HTTPServer, XMLHttpRequest, iPhone.
Full-width punctuation：（括号）、“引号”。 And em—dashes… and ellipses.
path/to/file.rs and https://example.com/a/b?c=d; emoji 🦀🚀 ✓ ★
    Indented lines, double  spaces, tabs\tand trailing spaces   matter too.\r\nWindows lines too.
"""


def build(splits, ignore_merges):
    tok = Tokenizer(models.BPE(ignore_merges=ignore_merges))
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Split(Regex(s), behavior="isolated") for s in splits]
        + [pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)]
    )
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=1200,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(corpus_lines(CORPUS), trainer)
    tok.add_special_tokens(SPECIALS)
    return tok


def write_gguf(tok, pre, path):
    vocab = tok.get_vocab(with_added_tokens=True)
    tokens = [None] * len(vocab)
    for piece, i in vocab.items():
        tokens[i] = piece
    state = json.loads(tok.to_str())
    merges = [m if isinstance(m, str) else " ".join(m) for m in state["model"]["merges"]]
    w = gguf.GGUFWriter(str(path), "llama")
    # What llama.cpp needs to read the vocabulary alone.
    w.add_context_length(64)
    w.add_embedding_length(8)
    w.add_block_count(1)
    w.add_feed_forward_length(16)
    w.add_head_count(1)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre(pre)
    w.add_token_list([t.encode("utf-8") for t in tokens])
    w.add_token_types(
        [gguf.TokenType.CONTROL if t in SPECIALS else gguf.TokenType.NORMAL for t in tokens]
    )
    w.add_token_merges(merges)
    w.add_bos_token_id(vocab["<|begin|>"])
    w.add_eos_token_id(vocab["<|end|>"])
    w.add_add_bos_token(False)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.close()


# The SentencePiece test's texts, and what byte-level splits treat apart.
TEXTS = SENTENCEPIECE_TEXTS + [
    "tabs\tand\r\nCRLF\r\n",
    "numbers 1234567 and 1000000",
    "combining marks: cafe\u0301 nai\u0308ve \u0928\u092e\u0938\u094d\u0924\u0947",
    "深度求索的模型",
    "한국어 문장",
    "It's THEY'LL we'd I'M",
    "CamelCase HTTPServer iPhone",
    "：（括号）“引号”。",
    "x=1;y=22;z=333;w=4444",
    "path/to/file.rs?a=b",
]


def cases(tok):
    out = []
    for t in sample_texts(TEXTS, CORPUS, 300):
        ids = tok.encode(t, add_special_tokens=False).ids
        out.append({"text": t, "ids": ids, "decoded": tok.decode(ids)})
    special = tok.token_to_id("<|user|>")
    rest = " Why is the sky blue?"
    ids = [special] + tok.encode(rest, add_special_tokens=False).ids
    out.append({"text": "<|user|>" + rest, "ids": ids, "decoded": None})
    return out


def main():
    out = Path(sys.argv[1])
    out.mkdir(parents=True, exist_ok=True)
    for pre, (splits, ignore_merges) in TYPES.items():
        tok = build(splits, ignore_merges)
        write_gguf(tok, pre, out / f"{pre}.gguf")
        (out / f"{pre}.json").write_text(json.dumps(cases(tok), ensure_ascii=False))


if __name__ == "__main__":
    main()
