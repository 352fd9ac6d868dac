"""Trains a small SentencePiece BPE model (as Llama 2, Mistral and Gemma
tokenizers are) and writes it as GGUF tokenizer metadata the way llama.cpp's
converter does, with SentencePiece's own encodings of many texts as the
reference.

    python tiny_tokenizer.py OUT_DIR

For each of two variants, OUT_DIR/<variant>.gguf and OUT_DIR/<variant>.json:
    llama   a space put before the text (add_dummy_prefix), as Llama 2 and
            Mistral do
    gemma   no space prefix, as Gemma does
The JSON lists {"text", "ids", "decoded"}: SentencePiece's ids for the text
(without BOS) and its decoding of them; cases with a control token in the
text are the control token's id followed by the rest encoded on its own,
which is how llama.cpp splits special tokens out first.
"""

import io
import json
import random
import sys
from pathlib import Path

import gguf
import sentencepiece as spm

CORPUS = """\
The quick brown fox jumps over the lazy dog. A journey of a thousand miles begins with a single step.
Rayleigh scattering makes the sky blue: shorter wavelengths scatter more than longer ones.
def fibonacci(n):
    if n < 2:
        return n
    return fibonacci(n - 1) + fibonacci(n - 2)
Numbers like 12345, 3.14159 and 2026-11-25 appear in text; so do prices ($19.99) and ratios (4:3).
Das Mädchen trägt einen Übermantel. Le café est très chaud. ¿Dónde está la biblioteca?
Tokenizers split text into pieces; pieces merge into longer pieces by their scores.
    Indented lines, double  spaces, tabs\tand trailing spaces   matter too.
Kubernetes controllers reconcile the desired state with the observed state of the cluster.
The model runs on several machines: each stage holds a range of layers and passes hidden states on.
"""


def corpus_lines(corpus=CORPUS):
    lines = corpus.splitlines()
    rng = random.Random(7)
    words = corpus.split()
    # More text of the same words, so merges have counts to learn from.
    for _ in range(400):
        lines.append(" ".join(rng.choice(words) for _ in range(rng.randint(3, 12))))
    return lines


def train(dummy_prefix):
    model = io.BytesIO()
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(corpus_lines()),
        model_writer=model,
        model_type="bpe",
        vocab_size=900,
        character_coverage=0.995,
        byte_fallback=True,
        normalization_rule_name="identity",
        remove_extra_whitespaces=False,
        add_dummy_prefix=dummy_prefix,
        split_digits=True,
        control_symbols=["<start_of_turn>", "<end_of_turn>"],
        allow_whitespace_only_pieces=True,
        minloglevel=2,
    )
    return spm.SentencePieceProcessor(model_proto=model.getvalue())


def token_type(sp, i):
    # llama.cpp's converter: gguf.TokenType values.
    if sp.IsUnknown(i):
        return gguf.TokenType.UNKNOWN
    if sp.IsControl(i):
        return gguf.TokenType.CONTROL
    if sp.IsUnused(i):
        return gguf.TokenType.UNUSED
    if sp.IsByte(i):
        return gguf.TokenType.BYTE
    return gguf.TokenType.NORMAL


def write_gguf(sp, dummy_prefix, path):
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_tokenizer_model("llama")
    n = sp.GetPieceSize()
    w.add_token_list([sp.IdToPiece(i).encode("utf-8") for i in range(n)])
    w.add_token_scores([sp.GetScore(i) for i in range(n)])
    w.add_token_types([token_type(sp, i) for i in range(n)])
    w.add_bos_token_id(sp.bos_id())
    w.add_eos_token_id(sp.eos_id())
    w.add_unk_token_id(sp.unk_id())
    w.add_add_bos_token(True)
    w.add_add_space_prefix(dummy_prefix)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.close()


TEXTS = [
    "Hello world",
    " leading space",
    "two  spaces and   three",
    "tabs\tand\nnewlines\n\nand a blank line",
    "numbers 12345 and 3.14159",
    "Übermädchen trägt café",
    "日本語のテキスト",
    "emoji 🦀🚀 and ✓",
    "a",
    "aaaaaaaaaaaaaaa",
    "the the the the",
    "    indented",
    "trailing   ",
    "fibonacci(n - 1) + fibonacci(n - 2)",
]


def sample_texts(texts, corpus, count):
    """The texts, then `count` slices of the corpus at random boundaries,
    mid-word included."""
    rng = random.Random(11)
    texts = list(texts)
    for _ in range(count):
        start = rng.randrange(len(corpus))
        texts.append(corpus[start : start + rng.randint(1, 80)])
    return texts


def cases(sp):
    texts = sample_texts(TEXTS, CORPUS, 200)
    out = [{"text": t, "ids": sp.encode(t), "decoded": sp.decode(sp.encode(t))} for t in texts]
    for special, rest in [
        ("<start_of_turn>", "user\nWhy is the sky blue?"),
        ("<start_of_turn>", " model says hi"),
        ("<end_of_turn>", "Hello"),
        ("<s>", " is a control token when written"),
    ]:
        ids = [sp.PieceToId(special)] + sp.encode(rest)
        out.append({"text": special + rest, "ids": ids, "decoded": None})
    return out


def main():
    out = Path(sys.argv[1])
    out.mkdir(parents=True, exist_ok=True)
    for variant, dummy_prefix in [("llama", True), ("gemma", False)]:
        sp = train(dummy_prefix)
        write_gguf(sp, dummy_prefix, out / f"{variant}.gguf")
        (out / f"{variant}.json").write_text(json.dumps(cases(sp), ensure_ascii=False))


if __name__ == "__main__":
    main()
