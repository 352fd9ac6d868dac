"""Writes a tiny model of one family with random weights, in the
MLX-community layout and as GGUF, with mlx-lm's logits as the reference.

    python tiny_model.py OUT_DIR FAMILY [SEED] [BITS] [--forced N]

OUT_DIR/mlx/         config.json + model.safetensors (f32, Hugging Face names),
                     tokenizer.json + tokenizer_config.json (a byte-level BPE;
                     gpt_oss's has the harmony markup, its template and stops)
OUT_DIR/model.gguf   the same weights as llama.cpp's converter writes them

With BITS 4 or 8 (or mxfp4), the model is quantized first as mlx-lm's converter
quantizes it (groups of 32, the family's own exceptions, such as Qwen3-MoE's
8-bit router), the reference is the quantized model's, and only the MLX
layout is written. With BITS q8_0 or q4_0, the GGUF's matrices (not the
norms, nor the router, as llama.cpp's quantizer leaves them) are written in
that block type, and the model (so the reference and the MLX layout) holds
the values those blocks decode to. With BITS gguf_mxfp4 (gpt_oss), likewise
for GGUF's MXFP4 blocks, on the experts only, as llama.cpp's converter
writes gpt-oss.
OUT_DIR/reference.json
    prompt   token ids
    tokens   16 greedy tokens after the prompt
    logits   the logits that chose each of them (17 rows: after the prompt,
             then after each greedy token)
    margins  top-1 minus top-2 logit of each row (how far from a tie)

With --forced N, the model's context is at least N
and reference.json also has
    forced         N token ids drawn at random (seeded)
    forced_logits  the logits after each of them (N rows), from one pass over
                   the whole sequence: what a long sequence must give, step
                   by step, however its KV cache is kept.

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
    # Four layers, the second dense (mlp_only_layers), the others routed:
    # eight experts, two per token, renormalised; an untied head.
    "qwen3_moe": {
        "model_type": "qwen3_moe",
        "architectures": ["Qwen3MoeForCausalLM"],
        "hidden_size": 64,
        "num_hidden_layers": 4,
        "intermediate_size": 96,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 16,
        "num_experts": 8,
        "num_experts_per_tok": 2,
        "moe_intermediate_size": 32,
        "decoder_sparse_step": 1,
        "mlp_only_layers": [1],
        "norm_topk_prob": True,
        "rms_norm_eps": 1e-6,
        "vocab_size": 256,
        "rope_theta": 1_000_000.0,
        "max_position_embeddings": 128,
        "tie_word_embeddings": False,
    },
    # Three layers of four experts, two per token (a softmax over the two
    # chosen logits); GGUF names it llama and permutes Q/K.
    "mixtral": {
        "model_type": "mixtral",
        "architectures": ["MixtralForCausalLM"],
        "hidden_size": 64,
        "num_hidden_layers": 3,
        "intermediate_size": 48,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "num_local_experts": 4,
        "num_experts_per_tok": 2,
        "rms_norm_eps": 1e-5,
        "vocab_size": 256,
        "rope_theta": 1_000_000.0,
        "max_position_embeddings": 128,
        "tie_word_embeddings": False,
    },
    # Qwen2-MoE: Qwen2's attention (Q/K/V biases), every layer routed (8
    # experts, 2 per token, not renormalised) beside a shared expert behind
    # a sigmoid gate.
    "qwen2_moe": {
        "model_type": "qwen2_moe",
        "architectures": ["Qwen2MoeForCausalLM"],
        "hidden_size": 64,
        "num_hidden_layers": 3,
        "intermediate_size": 96,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "num_experts": 8,
        "num_experts_per_tok": 2,
        "moe_intermediate_size": 32,
        "shared_expert_intermediate_size": 64,
        "norm_topk_prob": False,
        "rms_norm_eps": 1e-6,
        "vocab_size": 256,
        "rope_theta": 1_000_000.0,
        "max_position_embeddings": 128,
        "tie_word_embeddings": False,
    },
    # gpt-oss: four layers, sliding (window 4, shorter than the prompt) and
    # global in turn; YaRN RoPE as the released models have it; Q/K/V/O
    # biases and a sink per head; four experts with biases, two per token.
    "gpt_oss": {
        "model_type": "gpt_oss",
        "architectures": ["GptOssForCausalLM"],
        "hidden_size": 64,
        "num_hidden_layers": 4,
        "intermediate_size": 32,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 16,
        "num_local_experts": 4,
        "num_experts_per_tok": 2,
        "sliding_window": 4,
        "layer_types": ["sliding_attention", "full_attention"] * 2,
        "rms_norm_eps": 1e-5,
        "vocab_size": 256,
        "rope_theta": 150_000.0,
        "rope_scaling": {
            "rope_type": "yarn",
            "factor": 32.0,
            "original_max_position_embeddings": 4096,
            "beta_fast": 32.0,
            "beta_slow": 1.0,
        },
        "max_position_embeddings": 128,
        "tie_word_embeddings": False,
    },
}

# Llama 3.1-3.3's RoPE scaling (rope_type llama3) on a dense Llama. The
# original context is shrunk to 64 so that, at the prompt's positions, the
# three kinds of frequency differ visibly: kept (wavelength under 16),
# blended (16 to 64) and divided by the factor (over 64).
FAMILIES["llama3"] = {
    "model_type": "llama",
    "architectures": ["LlamaForCausalLM"],
    "hidden_size": 64,
    "num_hidden_layers": 3,
    "intermediate_size": 160,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "rms_norm_eps": 1e-5,
    "vocab_size": 256,
    "rope_theta": 10_000.0,
    "rope_scaling": {
        "rope_type": "llama3",
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 64,
    },
    "max_position_embeddings": 1024,
    "tie_word_embeddings": False,
}

# YaRN on a dense Qwen2 (as Qwen 2.5 is run for long contexts): an original
# context of 1024 puts the ramp across the middle of the 8 frequencies, and
# the attention factor (0.1 ln 4 + 1) scales the scores.
FAMILIES["qwen2_yarn"] = {
    "model_type": "qwen2",
    "architectures": ["Qwen2ForCausalLM"],
    "hidden_size": 64,
    "num_hidden_layers": 3,
    "intermediate_size": 160,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "rms_norm_eps": 1e-6,
    "vocab_size": 256,
    "rope_theta": 10_000.0,
    "rope_scaling": {"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 1024},
    "max_position_embeddings": 4096,
    "tie_word_embeddings": False,
}

# DeepSeek V3 (and Kimi K2, the same classes): latent attention with a
# low-rank query, interleaved RoPE on part of each head with YaRN (whose
# mscale_all_dim scales the scores), one dense layer, then experts chosen by
# sigmoid scores within the best two of four groups (a random choice bias
# per expert), a shared expert, the routed sum scaled by 2.5. Widths of 32
# so that mlx-lm quantizes every matrix (its per-head maps included).
FAMILIES["deepseek_v3"] = {
    "model_type": "deepseek_v3",
    "architectures": ["DeepseekV3ForCausalLM"],
    "hidden_size": 64,
    "num_hidden_layers": 4,
    "intermediate_size": 96,
    "num_attention_heads": 4,
    "num_key_value_heads": 4,
    "q_lora_rank": 32,
    "kv_lora_rank": 64,
    "qk_nope_head_dim": 32,
    "qk_rope_head_dim": 16,
    "v_head_dim": 32,
    "n_routed_experts": 8,
    "n_shared_experts": 1,
    "num_experts_per_tok": 2,
    "moe_intermediate_size": 32,
    "first_k_dense_replace": 1,
    "moe_layer_freq": 1,
    "n_group": 4,
    "topk_group": 2,
    "routed_scaling_factor": 2.5,
    "norm_topk_prob": True,
    "topk_method": "noaux_tc",
    "scoring_func": "sigmoid",
    "rms_norm_eps": 1e-6,
    "vocab_size": 256,
    "rope_theta": 10_000.0,
    "rope_scaling": {
        "type": "yarn",
        "factor": 4.0,
        "original_max_position_embeddings": 64,
        "beta_fast": 32,
        "beta_slow": 1,
        "mscale": 1.0,
        "mscale_all_dim": 1.0,
    },
    "max_position_embeddings": 256,
    "tie_word_embeddings": False,
}

# The same model as checkpoints converted before mlx-lm split the latent
# maps write it: one kv_b_proj per layer instead of embed_q and unembed_out.
FAMILIES["deepseek_v3_kv_b"] = FAMILIES["deepseek_v3"]

# DeepSeek V2 as its Lite model is: the query straight from q_proj (no
# low rank), one kv_b_proj per layer, experts chosen greedily by softmax
# scores (not renormalised), the routed sum scaled by 1.5.
FAMILIES["deepseek_v2"] = dict(
    FAMILIES["deepseek_v3"],
    model_type="deepseek_v2",
    architectures=["DeepseekV2ForCausalLM"],
    q_lora_rank=None,
    topk_method="greedy",
    scoring_func="softmax",
    n_group=1,
    topk_group=1,
    norm_topk_prob=False,
    routed_scaling_factor=1.5,
)

# The same with 26 layers: llama.cpp reads a deepseek2 file without a
# low-rank query only at the layer counts of the Lite models (26 or 27;
# with 27, seed 0's greedy path meets the end token, where llama.cpp stops).
FAMILIES["deepseek_v2_lite"] = dict(FAMILIES["deepseek_v2"], num_hidden_layers=26)

# DeepSeek V2 (236B)'s routing: each token's experts from its best group
# of four, a group scored by its best expert (one group, so that the limit
# changes the choice: two groups would always hold the best two experts).
FAMILIES["deepseek_v2_groups"] = dict(
    FAMILIES["deepseek_v2"], topk_method="group_limited_greedy", n_group=4, topk_group=1
)

# Qwen3-MoE as released models are (and llama.cpp requires): every layer routed.
FAMILIES["qwen3_moe_routed"] = dict(FAMILIES["qwen3_moe"], mlp_only_layers=[])

PROMPT = [2, 17, 201, 5, 99, 64, 130, 7, 250, 33, 12]
STEPS = 16
# Tokens of the forced sequence (--forced), 0: none.
FORCED = 0


def build(family, seed):
    from mlx_lm.utils import _get_classes

    config = dict(FAMILIES[family])
    if FORCED > config["max_position_embeddings"]:
        config["max_position_embeddings"] = FORCED
    model_class, args_class = _get_classes(config)
    model = model_class(args_class.from_dict(config))
    mx.random.seed(seed)
    params = {}
    for name, p in tree_flatten(model.parameters()):
        if name.endswith("norm.weight"):
            # Gemma computes x * (1 + w): offsets around zero; the others
            # x * w, around one.
            offset = 0.0 if family.startswith("gemma") else 1.0
            params[name] = offset + 0.3 * mx.random.normal(p.shape)
        elif name.endswith("embed_tokens.weight"):
            params[name] = mx.random.normal(p.shape) * 0.1
        elif name.endswith("sinks"):
            # Large enough to take a visible share of each softmax.
            params[name] = mx.random.normal(p.shape) * 2.0
        elif family == "gpt_oss" and name.endswith(("experts.gate_proj.weight", "experts.up_proj.weight")):
            # Large enough that the activation's clamps at ±7 bite.
            params[name] = mx.random.normal(p.shape) * (5.0 / np.sqrt(p.shape[-1]))
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


def joined_kv_b(weights):
    """embed_q [heads, latent, nope] and unembed_out [heads, v, latent] as
    the one kv_b_proj [heads × (nope + v), latent] they were split from."""
    for name in [n for n in weights if n.endswith("self_attn.embed_q.weight")]:
        prefix = name[: -len("embed_q.weight")]
        k = weights.pop(name).swapaxes(1, 2)
        v = weights.pop(prefix + "unembed_out.weight")
        kv_b = mx.concatenate([k, v], axis=1)
        weights[prefix + "kv_b_proj.weight"] = kv_b.reshape(-1, kv_b.shape[-1])
    return weights


def split_kv_b(weights, c):
    """kv_b_proj [heads × (nope + v), latent] as llama.cpp's converter
    splits it: embed_q [heads, latent, nope] (its attn_k_b) and unembed_out
    [heads, v, latent] (its attn_v_b)."""
    heads, nope = c["num_attention_heads"], c["qk_nope_head_dim"]
    for name in [n for n in weights if n.endswith("self_attn.kv_b_proj.weight")]:
        prefix = name[: -len("kv_b_proj.weight")]
        kv_b = weights.pop(name)
        kv_b = kv_b.reshape(heads, -1, kv_b.shape[-1])
        weights[prefix + "embed_q.weight"] = np.ascontiguousarray(kv_b[:, :nope, :].swapaxes(1, 2))
        weights[prefix + "unembed_out.weight"] = np.ascontiguousarray(kv_b[:, nope:, :])
    return weights


def write_mlx(config, model, out, family=None):
    out.mkdir(parents=True, exist_ok=True)
    weights = dict(tree_flatten(model.parameters()))
    if family == "deepseek_v3_kv_b":
        weights = joined_kv_b(weights)
    mx.save_safetensors(str(out / "model.safetensors"), weights)
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    return weights


# Hugging Face layer names → GGUF, as llama.cpp's converter maps them.
COMMON_LAYER = {
    "input_layernorm": "attn_norm",
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "self_attn.q_norm": "attn_q_norm",
    "self_attn.k_norm": "attn_k_norm",
    "post_attention_layernorm": "ffn_norm",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
    "mlp.gate": "ffn_gate_inp",
    "mlp.switch_mlp.gate_proj": "ffn_gate_exps",
    "mlp.switch_mlp.up_proj": "ffn_up_exps",
    "mlp.switch_mlp.down_proj": "ffn_down_exps",
    "mlp.shared_expert_gate": "ffn_gate_inp_shexp",
    "mlp.shared_expert.gate_proj": "ffn_gate_shexp",
    "mlp.shared_expert.up_proj": "ffn_up_shexp",
    "mlp.shared_expert.down_proj": "ffn_down_shexp",
    "block_sparse_moe.gate": "ffn_gate_inp",
    "block_sparse_moe.switch_mlp.gate_proj": "ffn_gate_exps",
    "block_sparse_moe.switch_mlp.up_proj": "ffn_up_exps",
    "block_sparse_moe.switch_mlp.down_proj": "ffn_down_exps",
}

# Gemma's sandwich norms: post_attention_layernorm is the attention output's.
GEMMA3_LAYER = dict(
    COMMON_LAYER,
    **{
        "post_attention_layernorm": "post_attention_norm",
        "pre_feedforward_layernorm": "ffn_norm",
        "post_feedforward_layernorm": "post_ffw_norm",
    },
)

# DeepSeek V3's names in llama.cpp's converter (`deepseek2`): the per-head
# latent maps are its attn_k_b and attn_v_b, the choice bias exp_probs_b.
DEEPSEEK_LAYER = dict(
    COMMON_LAYER,
    **{
        "self_attn.q_a_proj": "attn_q_a",
        "self_attn.q_a_layernorm": "attn_q_a_norm",
        "self_attn.q_b_proj": "attn_q_b",
        "self_attn.kv_a_proj_with_mqa": "attn_kv_a_mqa",
        "self_attn.kv_a_layernorm": "attn_kv_a_norm",
        "self_attn.embed_q": "attn_k_b",
        "self_attn.unembed_out": "attn_v_b",
        "mlp.shared_experts.gate_proj": "ffn_gate_shexp",
        "mlp.shared_experts.up_proj": "ffn_up_shexp",
        "mlp.shared_experts.down_proj": "ffn_down_shexp",
    },
)

GGUF_ARCH = {
    "gemma3_text": "gemma3",
    "qwen3_moe": "qwen3moe",
    "qwen3_moe_routed": "qwen3moe",
    "qwen2_moe": "qwen2moe",
    "mixtral": "llama",
    "llama3": "llama",
    "qwen2_yarn": "qwen2",
    "gpt_oss": "gpt-oss",
    "deepseek_v3": "deepseek2",
    "deepseek_v2": "deepseek2",
    "deepseek_v2_lite": "deepseek2",
    "deepseek_v2_groups": "deepseek2",
}

# gpt-oss's names in llama.cpp's converter (the norm before the experts is
# its `post_attention_norm`; the sinks have no suffix in Hugging Face's).
GPT_OSS_LAYER = {
    "post_attention_layernorm": "post_attention_norm",
    "mlp.router": "ffn_gate_inp",
    "mlp.experts.gate_proj": "ffn_gate_exps",
    "mlp.experts.up_proj": "ffn_up_exps",
    "mlp.experts.down_proj": "ffn_down_exps",
}


def llama3_rope_factors(c):
    """What llama.cpp's converter stores as `rope_freqs.weight` for a
    `llama3` rope_scaling: each frequency's divisor."""
    s = c["rope_scaling"]
    dims = c["head_dim"]
    factor, low, high = s["factor"], s["low_freq_factor"], s["high_freq_factor"]
    old = s["original_max_position_embeddings"]
    out = []
    for i in range(0, dims, 2):
        wavelen = 2 * np.pi * c["rope_theta"] ** (i / dims)
        if wavelen < old / high:
            out.append(1.0)
        elif wavelen > old / low:
            out.append(factor)
        else:
            smooth = (old / wavelen - low) / (high - low)
            out.append(1 / ((1 - smooth) / factor + smooth))
    return np.array(out, dtype=np.float32)


def gguf_name(family, name):
    if name == "model.embed_tokens.weight":
        return "token_embd.weight"
    if name == "model.norm.weight":
        return "output_norm.weight"
    if name == "lm_head.weight":
        return "output.weight"
    parts = name.split(".")
    layer, role, kind = parts[2], ".".join(parts[3:-1]), parts[-1]
    if name.endswith("self_attn.sinks"):
        return f"blk.{layer}.attn_sinks.weight"
    if name.endswith("mlp.gate.e_score_correction_bias"):
        return f"blk.{layer}.exp_probs_b.bias"
    if family.startswith("deepseek"):
        return f"blk.{layer}.{DEEPSEEK_LAYER[role]}.weight"
    table = GEMMA3_LAYER if family.startswith("gemma") else COMMON_LAYER
    if family == "gpt_oss":
        table = {**COMMON_LAYER, **GPT_OSS_LAYER}
    return f"blk.{layer}.{table[role]}.{'bias' if kind == 'bias' else 'weight'}"


def permute(w, heads):
    """Q/K rows reordered for interleaved RoPE, as llama.cpp's converter
    does for the llama architecture."""
    return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def block_quantizable(name, a, qtype):
    router = name.endswith(("mlp.gate.weight", "block_sparse_moe.gate.weight"))
    if qtype == gguf.GGMLQuantizationType.MXFP4:
        # As llama.cpp's converter writes gpt-oss: the experts only.
        return ".experts." in name and name.endswith("_proj.weight")
    return a.ndim >= 2 and a.shape[-1] % 32 == 0 and not router


GGUF_TYPES = {
    "q8_0": gguf.GGMLQuantizationType.Q8_0,
    "q4_0": gguf.GGMLQuantizationType.Q4_0,
    "gguf_mxfp4": gguf.GGMLQuantizationType.MXFP4,
}


def round_trip_blocks(model, qtype):
    """The model's matrices replaced by what `qtype` blocks decode them to."""
    params = {}
    for name, v in tree_flatten(model.parameters()):
        a = np.array(v, dtype=np.float32)
        if block_quantizable(name, a, qtype):
            a = gguf.quants.dequantize(gguf.quants.quantize(a, qtype), qtype).reshape(a.shape)
        params[name] = mx.array(a)
    model.load_weights(list(params.items()))
    mx.eval(model.parameters())


def byte_tokens():
    """A byte-level BPE's tokens: token i is byte i (GPT-2's printable
    spelling), except token 0, which is the one merge " t" (a merge list
    cannot be empty); and the spelling of the space."""
    printable = [*range(33, 127), *range(161, 173), *range(174, 256)]
    spelled, extra = {}, 0
    for b in range(256):
        if b in printable:
            spelled[b] = chr(b)
        else:
            spelled[b] = chr(256 + extra)
            extra += 1
    tokens = [spelled[b] for b in range(256)]
    tokens[0] = spelled[32] + "t"
    return tokens, spelled[32]


# gpt-oss's harmony markup. In its tiny model these take the ids of bytes
# 0xF8-0xFF, which never occur in UTF-8 text.
HARMONY = ["<|start|>", "<|end|>", "<|message|>", "<|channel|>", "<|constrain|>",
           "<|return|>", "<|call|>", "<|endoftext|>"]


def write_tokenizer_files(out, vocab, harmony=False):
    """The byte-level BPE as tokenizer.json and a tokenizer_config.json
    (ChatML), so the MLX layout is a model directory tools can load
    (benchmarks, agents). With `harmony`, the harmony markup as special
    tokens, the tests' harmony template as chat_template.jinja, and its
    stop tokens in generation_config.json."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

    assert vocab == 256, "one token per byte"
    tokens, space = byte_tokens()
    if harmony:
        tokens[256 - len(HARMONY):] = HARMONY
    bpe = models.BPE(vocab={t: i for i, t in enumerate(tokens)}, merges=[(space, "t")])
    tok = Tokenizer(bpe)
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    if harmony:
        tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in HARMONY])
        assert [tok.token_to_id(t) for t in HARMONY] == list(range(248, 256))
    tok.save(str(out / "tokenizer.json"))
    if harmony:
        fixture = Path(__file__).parent.parent / "fixtures/chat_templates/harmony.jinja"
        (out / "chat_template.jinja").write_text(fixture.read_text())
        config = {"eos_token": "<|return|>", "add_bos_token": False}
        stops = [tok.token_to_id(t) for t in ("<|return|>", "<|endoftext|>", "<|call|>")]
        (out / "generation_config.json").write_text(json.dumps({"eos_token_id": stops}) + "\n")
    else:
        chatml = (
            "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
            "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
        )
        config = {"chat_template": chatml, "eos_token": tokens[1], "add_bos_token": False}
    (out / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")


def add_byte_tokenizer(w, vocab):
    """The byte-level BPE (`byte_tokens`) as GGUF metadata, so tools that
    need a tokenizer (benchmarks, llama.cpp) can load the file."""
    assert vocab == 256, "one token per byte"
    tokens, space = byte_tokens()
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("default")
    w.add_token_list(tokens)
    w.add_token_types([gguf.TokenType.NORMAL] * 256)
    w.add_token_merges([f"{space} t"])
    w.add_eos_token_id(1)
    w.add_add_bos_token(False)


def write_gguf(family, config, weights, path, qtype=None):
    c = config
    arch = GGUF_ARCH[family]
    head_dim = c.get("head_dim", c["hidden_size"] // c["num_attention_heads"])
    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(c["num_hidden_layers"])
    w.add_context_length(c["max_position_embeddings"])
    w.add_embedding_length(c["hidden_size"])
    w.add_feed_forward_length(c["intermediate_size"])
    w.add_head_count(c["num_attention_heads"])
    if family.startswith("deepseek"):
        # As llama.cpp's converter writes latent attention: one KV head of
        # the latent and the rotated part, and the per-head widths apart.
        rank, rope = c["kv_lora_rank"], c["qk_rope_head_dim"]
        w.add_head_count_kv(1)
        w.add_key_length(rank + rope)
        w.add_value_length(rank)
        w.add_key_length_mla(c["qk_nope_head_dim"] + rope)
        w.add_value_length_mla(c["v_head_dim"])
        if c["q_lora_rank"] is not None:
            w.add_q_lora_rank(c["q_lora_rank"])
        w.add_kv_lora_rank(rank)
        w.add_rope_dimension_count(rope)
        w.add_leading_dense_block_count(c["first_k_dense_replace"])
        w.add_expert_count(c["n_routed_experts"])
        w.add_expert_used_count(c["num_experts_per_tok"])
        w.add_expert_feed_forward_length(c["moe_intermediate_size"])
        w.add_expert_shared_count(c["n_shared_experts"])
        w.add_expert_weights_scale(c["routed_scaling_factor"])
        w.add_expert_weights_norm(c["norm_topk_prob"])
        w.add_expert_gating_func(
            gguf.ExpertGatingFuncType.SOFTMAX
            if c["scoring_func"] == "softmax"
            else gguf.ExpertGatingFuncType.SIGMOID
        )
        w.add_expert_group_count(c["n_group"])
        w.add_expert_group_used_count(c["topk_group"])
        w.add_rope_scaling_yarn_log_mul(0.1 * c["rope_scaling"]["mscale_all_dim"])
    else:
        w.add_head_count_kv(c["num_key_value_heads"])
        w.add_key_length(head_dim)
        w.add_value_length(head_dim)
    w.add_layer_norm_rms_eps(c["rms_norm_eps"])
    w.add_rope_freq_base(c["rope_theta"])
    if family == "gemma3_text":
        w.add_sliding_window(c["sliding_window"])
        w.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        w.add_rope_scaling_factor(c["rope_scaling"]["factor"])
    if family.startswith("qwen3_moe"):
        w.add_expert_count(c["num_experts"])
        w.add_expert_used_count(c["num_experts_per_tok"])
        w.add_expert_feed_forward_length(c["moe_intermediate_size"])
    if family == "qwen2_moe":
        w.add_expert_count(c["num_experts"])
        w.add_expert_used_count(c["num_experts_per_tok"])
        w.add_expert_feed_forward_length(c["moe_intermediate_size"])
        w.add_expert_shared_feed_forward_length(c["shared_expert_intermediate_size"])
    scaling = c.get("rope_scaling") or {}
    if scaling.get("rope_type", scaling.get("type")) == "yarn":
        w.add_rope_scaling_type(gguf.RopeScalingType.YARN)
        w.add_rope_scaling_factor(c["rope_scaling"]["factor"])
        w.add_rope_scaling_orig_ctx_len(c["rope_scaling"]["original_max_position_embeddings"])
    if family == "gpt_oss":
        w.add_expert_count(c["num_local_experts"])
        w.add_expert_used_count(c["num_experts_per_tok"])
        w.add_expert_feed_forward_length(c["intermediate_size"])
        w.add_sliding_window(c["sliding_window"])
    if family == "mixtral":
        w.add_expert_count(c["num_local_experts"])
        w.add_expert_used_count(c["num_experts_per_tok"])
    w.add_file_type(gguf.LlamaFileType.ALL_F32)
    add_byte_tokenizer(w, c["vocab_size"])
    if family.startswith("deepseek"):
        weights = split_kv_b(dict(weights), c)
    if (c.get("rope_scaling") or {}).get("rope_type") == "llama3":
        w.add_tensor("rope_freqs.weight", llama3_rope_factors(c))
    for name, a in weights.items():
        if family.startswith("gemma") and name.endswith("norm.weight"):
            # llama.cpp's converter stores Gemma's norms as 1 + w.
            a = a + 1.0
        if arch == "llama" and name.endswith("q_proj.weight"):
            a = permute(a, c["num_attention_heads"])
        if arch == "llama" and name.endswith("k_proj.weight"):
            a = permute(a, c["num_key_value_heads"])
        if name.endswith("shared_expert_gate.weight"):
            # llama.cpp reads the shared expert's gate as a vector.
            a = a.reshape(-1)
        a = np.ascontiguousarray(a)
        if qtype is not None and block_quantizable(name, a, qtype):
            w.add_tensor(gguf_name(family, name), gguf.quants.quantize(a, qtype), raw_dtype=qtype)
        else:
            w.add_tensor(gguf_name(family, name), a)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def main():
    global FORCED
    if "--forced" in sys.argv:
        at = sys.argv.index("--forced")
        FORCED = int(sys.argv[at + 1])
        del sys.argv[at : at + 2]
    out = Path(sys.argv[1])
    family = sys.argv[2]
    seed = int(sys.argv[3]) if len(sys.argv) > 3 else 0
    quant = sys.argv[4] if len(sys.argv) > 4 else None
    config, model = build(family, seed)
    qtype = GGUF_TYPES.get(quant)
    if quant is not None and qtype is None:
        from mlx_lm.utils import quantize_model

        if quant == "mxfp4":
            # The mode MLX-community's gpt-oss uses: 4-bit floats sharing a
            # power of two per 32 (the model's own exceptions, such as
            # gpt-oss's router, stay affine).
            model, config = quantize_model(model, config, group_size=32, bits=4, mode="mxfp4")
        else:
            model, config = quantize_model(model, config, group_size=32, bits=int(quant))
        mx.eval(model.parameters())
    dense = {k: np.array(v, dtype=np.float32) for k, v in tree_flatten(model.parameters())}
    if qtype is not None:
        round_trip_blocks(model, qtype)
    write_mlx(config, model, out / "mlx", family)
    write_tokenizer_files(out / "mlx", config["vocab_size"], harmony=family == "gpt_oss")
    if family in GGUF_ARCH and (quant is None or qtype is not None):
        write_gguf(family, config, dense, out / "model.gguf", qtype)
    result = reference(model)
    if FORCED:
        tokens = np.random.default_rng(seed).integers(0, config["vocab_size"], FORCED)
        logits = model(mx.array([tokens.tolist()]))[0].astype(mx.float32)
        result["forced"] = tokens.tolist()
        result["forced_logits"] = np.array(logits).tolist()
    (out / "reference.json").write_text(json.dumps(result))


if __name__ == "__main__":
    main()
