"""Writes a tiny model of one family with random weights, in the
MLX-community layout and as GGUF, with mlx-lm's logits as the reference.

    python tiny_model.py OUT_DIR FAMILY [SEED]

OUT_DIR/mlx/         config.json + model.safetensors (f32, Hugging Face names)
OUT_DIR/model.gguf   the same weights as llama.cpp's converter writes them
OUT_DIR/reference.json
    prompt   token ids
    tokens   16 greedy tokens after the prompt
    logits   the logits that chose each of them (17 rows: after the prompt,
             then after each greedy token)
    margins  top-1 minus top-2 logit of each row (how far from a tie)

The reference is mlx-lm's model class run on the whole sequence at every
step (no KV cache), so it is the family's definition, not an optimisation of
it. Runs on the mlx CPU wheel in a few seconds.
"""

import json
import sys
from pathlib import Path

import gguf
import mlx.core as mx
import numpy as np
from mlx.utils import tree_flatten

FAMILIES = {
    # Seven layers: five sliding, one global (every sixth, as llama.cpp fixes
    # it for Gemma 3), one sliding again; a window shorter than the prompt; a
    # hidden size whose square root is exact in bfloat16 (mlx-lm rounds the
    # embedding scale to it, llama.cpp does not).
    "gemma3_text": {
        "model_type": "gemma3_text",
        "architectures": ["Gemma3ForCausalLM"],
        "hidden_size": 64,
        "num_hidden_layers": 7,
        "intermediate_size": 160,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 16,
        "rms_norm_eps": 1e-6,
        "vocab_size": 256,
        "rope_theta": 1_000_000.0,
        "rope_local_base_freq": 10_000.0,
        "query_pre_attn_scalar": 16,
        "sliding_window": 4,
        "sliding_window_pattern": 6,
        "max_position_embeddings": 128,
        "rope_scaling": {"rope_type": "linear", "factor": 8.0},
        "hidden_activation": "gelu_pytorch_tanh",
        "tie_word_embeddings": True,
    },
}

PROMPT = [2, 17, 201, 5, 99, 64, 130, 7, 250, 33, 12]
STEPS = 16


def build(family, seed):
    from mlx_lm.utils import _get_classes

    config = FAMILIES[family]
    model_class, args_class = _get_classes(config)
    model = model_class(args_class.from_dict(config))
    mx.random.seed(seed)
    params = {}
    for name, p in tree_flatten(model.parameters()):
        if name.endswith("norm.weight"):
            # Norm offsets around zero (the model computes x * (1 + w)).
            params[name] = 0.3 * mx.random.normal(p.shape)
        elif name.endswith("embed_tokens.weight"):
            params[name] = mx.random.normal(p.shape) * 0.1
        else:
            scale = 1.0 / np.sqrt(p.shape[-1])
            params[name] = mx.random.normal(p.shape) * scale
    model.load_weights(list(params.items()), strict=False)
    model.sanitize({})  # ties the head to the embedding
    mx.eval(model.parameters())
    return config, model


def reference(model):
    tokens = list(PROMPT)
    rows, margins, out = [], [], []
    for _ in range(STEPS + 1):
        logits = model(mx.array([tokens]))[0, -1].astype(mx.float32)
        row = np.array(logits).tolist()
        top = sorted(row, reverse=True)
        rows.append(row)
        margins.append(top[0] - top[1])
        nxt = int(np.argmax(row))
        out.append(nxt)
        tokens.append(nxt)
    return {"prompt": PROMPT, "tokens": out[:STEPS], "logits": rows, "margins": margins}


def write_mlx(config, model, out):
    out.mkdir(parents=True, exist_ok=True)
    weights = dict(tree_flatten(model.parameters()))
    mx.save_safetensors(str(out / "model.safetensors"), weights)
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    return {k: np.array(v, dtype=np.float32) for k, v in weights.items()}


GEMMA3_LAYER = {
    "input_layernorm": "attn_norm",
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "self_attn.q_norm": "attn_q_norm",
    "self_attn.k_norm": "attn_k_norm",
    "post_attention_layernorm": "post_attention_norm",
    "pre_feedforward_layernorm": "ffn_norm",
    "post_feedforward_layernorm": "post_ffw_norm",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
}


def gguf_name(name):
    if name == "model.embed_tokens.weight":
        return "token_embd.weight"
    if name == "model.norm.weight":
        return "output_norm.weight"
    parts = name.split(".")
    layer, role = parts[2], ".".join(parts[3:-1])
    return f"blk.{layer}.{GEMMA3_LAYER[role]}.weight"


def write_gguf(config, weights, path):
    c = config
    w = gguf.GGUFWriter(str(path), "gemma3")
    w.add_block_count(c["num_hidden_layers"])
    w.add_context_length(c["max_position_embeddings"])
    w.add_embedding_length(c["hidden_size"])
    w.add_feed_forward_length(c["intermediate_size"])
    w.add_head_count(c["num_attention_heads"])
    w.add_head_count_kv(c["num_key_value_heads"])
    w.add_key_length(c["head_dim"])
    w.add_value_length(c["head_dim"])
    w.add_layer_norm_rms_eps(c["rms_norm_eps"])
    w.add_rope_freq_base(c["rope_theta"])
    w.add_sliding_window(c["sliding_window"])
    w.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
    w.add_rope_scaling_factor(c["rope_scaling"]["factor"])
    w.add_file_type(gguf.LlamaFileType.ALL_F32)
    for name, a in weights.items():
        if name.endswith("norm.weight"):
            # llama.cpp's converter stores Gemma's norms as 1 + w.
            a = a + 1.0
        w.add_tensor(gguf_name(name), a)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def main():
    out = Path(sys.argv[1])
    family = sys.argv[2]
    seed = int(sys.argv[3]) if len(sys.argv) > 3 else 0
    config, model = build(family, seed)
    weights = write_mlx(config, model, out / "mlx")
    write_gguf(config, weights, out / "model.gguf")
    (out / "reference.json").write_text(json.dumps(reference(model)))


if __name__ == "__main__":
    main()
