//! Where each weight lives in the two layouts the engines read: GGUF
//! (`blk.3.attn_q`) and the MLX-community safetensors layout, which uses the
//! Hugging Face names (`model.layers.3.self_attn.q_proj`). One Hugging Face
//! name differs by family: `post_attention_layernorm` is the norm before the
//! feed-forward block in Llama and Qwen, but the norm of the attention output
//! in Gemma, whose feed-forward norm is `pre_feedforward_layernorm`.

use crate::config::Architecture;

/// A weight of the model, by role.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Weight {
    /// Token embedding.
    Embedding,
    /// Output head (absent when tied to the embedding).
    Head,
    /// Norm before the head.
    FinalNorm,
    /// A weight of layer `n`.
    Layer(usize, Part),
}

/// The weights of one transformer layer.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Part {
    /// Norm before attention.
    AttnNorm,
    /// Query projection.
    Q,
    /// Key projection.
    K,
    /// Value projection.
    V,
    /// Attention output projection.
    O,
    /// Per-head query norm (Qwen3).
    QNorm,
    /// Per-head key norm (Qwen3).
    KNorm,
    /// Norm before the feed-forward block.
    FfnNorm,
    /// Norm of the attention output (Gemma).
    PostAttnNorm,
    /// Norm of the feed-forward output (Gemma).
    PostFfnNorm,
    /// Feed-forward gate.
    Gate,
    /// Feed-forward up projection.
    Up,
    /// Feed-forward down projection.
    Down,
    /// Router of a mixture of experts: hidden → expert logits.
    Router,
    /// Every expert's gate, stacked `[experts, width, hidden]`.
    ExpertGate,
    /// Every expert's up projection, stacked like the gates.
    ExpertUp,
    /// Every expert's down projection, `[experts, hidden, width]`.
    ExpertDown,
    /// The shared expert's gate: hidden → 1, through a sigmoid (Qwen2-MoE).
    SharedGateInp,
    /// The shared expert's gate projection.
    SharedGate,
    /// The shared expert's up projection.
    SharedUp,
    /// The shared expert's down projection.
    SharedDown,
    /// One learned logit per attention head that joins every softmax
    /// (gpt-oss); Hugging Face names it without a `.weight` suffix.
    Sinks,
    /// Latent attention (DeepSeek V3): the query's down projection.
    QA,
    /// Its norm.
    QANorm,
    /// The query's up projection to every head (`[nope │ rope]` each).
    QB,
    /// hidden → `[latent │ k_rope]`.
    KvA,
    /// The latent's norm.
    KvANorm,
    /// latent → every head's `[k_nope │ v]` (older checkpoints; split into
    /// the two below when loaded).
    KvB,
    /// Per head, `[latent, nope]`: a query's non-rotated part into latent
    /// space (mlx-lm's `embed_q`, llama.cpp's `attn_k_b`).
    EmbedQ,
    /// Per head, `[value, latent]`: the attended latent out to the head's
    /// value (mlx-lm's `unembed_out`, llama.cpp's `attn_v_b`).
    UnembedOut,
    /// A bias per expert added to its score for the choice only (DeepSeek
    /// V3's `e_score_correction_bias`).
    ExpertBias,
}

/// Every part of a layer, in file order.
pub const PARTS: [Part; 31] = [
    Part::AttnNorm,
    Part::Q,
    Part::K,
    Part::V,
    Part::O,
    Part::QNorm,
    Part::KNorm,
    Part::PostAttnNorm,
    Part::FfnNorm,
    Part::PostFfnNorm,
    Part::Gate,
    Part::Up,
    Part::Down,
    Part::Router,
    Part::ExpertGate,
    Part::ExpertUp,
    Part::ExpertDown,
    Part::SharedGateInp,
    Part::SharedGate,
    Part::SharedUp,
    Part::SharedDown,
    Part::Sinks,
    Part::QA,
    Part::QANorm,
    Part::QB,
    Part::KvA,
    Part::KvANorm,
    Part::KvB,
    Part::EmbedQ,
    Part::UnembedOut,
    Part::ExpertBias,
];

impl Part {
    fn gguf(self) -> &'static str {
        match self {
            Part::AttnNorm => "attn_norm",
            Part::Q => "attn_q",
            Part::K => "attn_k",
            Part::V => "attn_v",
            Part::O => "attn_output",
            Part::QNorm => "attn_q_norm",
            Part::KNorm => "attn_k_norm",
            Part::FfnNorm => "ffn_norm",
            Part::PostAttnNorm => "post_attention_norm",
            Part::PostFfnNorm => "post_ffw_norm",
            Part::Gate => "ffn_gate",
            Part::Up => "ffn_up",
            Part::Down => "ffn_down",
            Part::Router => "ffn_gate_inp",
            Part::ExpertGate => "ffn_gate_exps",
            Part::ExpertUp => "ffn_up_exps",
            Part::ExpertDown => "ffn_down_exps",
            Part::SharedGateInp => "ffn_gate_inp_shexp",
            Part::SharedGate => "ffn_gate_shexp",
            Part::SharedUp => "ffn_up_shexp",
            Part::SharedDown => "ffn_down_shexp",
            Part::Sinks => "attn_sinks",
            Part::QA => "attn_q_a",
            Part::QANorm => "attn_q_a_norm",
            Part::QB => "attn_q_b",
            Part::KvA => "attn_kv_a_mqa",
            Part::KvANorm => "attn_kv_a_norm",
            Part::KvB => "attn_kv_b",
            Part::EmbedQ => "attn_k_b",
            Part::UnembedOut => "attn_v_b",
            Part::ExpertBias => "exp_probs_b",
        }
    }

    fn hf(self, arch: Architecture) -> &'static str {
        let sandwich = arch.post_norms();
        // MLX-community checkpoints hold the experts stacked (`switch_mlp`).
        let mixtral = arch == Architecture::Mixtral;
        let gpt_oss = arch == Architecture::GptOss;
        let deepseek = arch == Architecture::DeepSeekV3;
        match self {
            Part::QA => "self_attn.q_a_proj",
            Part::QANorm => "self_attn.q_a_layernorm",
            Part::QB => "self_attn.q_b_proj",
            Part::KvA => "self_attn.kv_a_proj_with_mqa",
            Part::KvANorm => "self_attn.kv_a_layernorm",
            Part::KvB => "self_attn.kv_b_proj",
            Part::EmbedQ => "self_attn.embed_q",
            Part::UnembedOut => "self_attn.unembed_out",
            Part::ExpertBias => "mlp.gate",
            Part::SharedGate if deepseek => "mlp.shared_experts.gate_proj",
            Part::SharedUp if deepseek => "mlp.shared_experts.up_proj",
            Part::SharedDown if deepseek => "mlp.shared_experts.down_proj",
            Part::Router if gpt_oss => "mlp.router",
            Part::ExpertGate if gpt_oss => "mlp.experts.gate_proj",
            Part::ExpertUp if gpt_oss => "mlp.experts.up_proj",
            Part::ExpertDown if gpt_oss => "mlp.experts.down_proj",
            Part::Sinks => "self_attn.sinks",
            Part::Router if mixtral => "block_sparse_moe.gate",
            Part::ExpertGate if mixtral => "block_sparse_moe.switch_mlp.gate_proj",
            Part::ExpertUp if mixtral => "block_sparse_moe.switch_mlp.up_proj",
            Part::ExpertDown if mixtral => "block_sparse_moe.switch_mlp.down_proj",
            Part::Router => "mlp.gate",
            Part::ExpertGate => "mlp.switch_mlp.gate_proj",
            Part::ExpertUp => "mlp.switch_mlp.up_proj",
            Part::ExpertDown => "mlp.switch_mlp.down_proj",
            Part::SharedGateInp => "mlp.shared_expert_gate",
            Part::SharedGate => "mlp.shared_expert.gate_proj",
            Part::SharedUp => "mlp.shared_expert.up_proj",
            Part::SharedDown => "mlp.shared_expert.down_proj",
            Part::FfnNorm if sandwich => "pre_feedforward_layernorm",
            Part::PostAttnNorm => "post_attention_layernorm",
            Part::PostFfnNorm => "post_feedforward_layernorm",
            Part::AttnNorm => "input_layernorm",
            Part::Q => "self_attn.q_proj",
            Part::K => "self_attn.k_proj",
            Part::V => "self_attn.v_proj",
            Part::O => "self_attn.o_proj",
            Part::QNorm => "self_attn.q_norm",
            Part::KNorm => "self_attn.k_norm",
            Part::FfnNorm => "post_attention_layernorm",
            Part::Gate => "mlp.gate_proj",
            Part::Up => "mlp.up_proj",
            Part::Down => "mlp.down_proj",
        }
    }
}

/// A model file's layout.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Layout {
    /// GGUF, as llama.cpp names tensors.
    Gguf,
    /// MLX-community safetensors (Hugging Face names).
    Mlx,
}

impl Weight {
    /// Whether the weight is an RMS norm's.
    pub fn is_norm(self) -> bool {
        matches!(
            self,
            Weight::FinalNorm
                | Weight::Layer(
                    _,
                    Part::AttnNorm
                        | Part::QNorm
                        | Part::KNorm
                        | Part::FfnNorm
                        | Part::PostAttnNorm
                        | Part::PostFfnNorm
                        | Part::QANorm
                        | Part::KvANorm
                )
        )
    }

    /// The tensor-name prefix of the weight in `layout` for a model of
    /// `arch` (suffixes `.weight`, `.bias`, and `.scales` / `.biases` for
    /// quantized weights).
    pub fn prefix(self, layout: Layout, arch: Architecture) -> String {
        match (layout, self) {
            (Layout::Gguf, Weight::Embedding) => "token_embd".into(),
            (Layout::Gguf, Weight::Head) => "output".into(),
            (Layout::Gguf, Weight::FinalNorm) => "output_norm".into(),
            // llama.cpp names gpt-oss's norm before the experts as it names
            // the attention's post-norm.
            (Layout::Gguf, Weight::Layer(n, Part::FfnNorm)) if arch == Architecture::GptOss => {
                format!("blk.{n}.post_attention_norm")
            }
            (Layout::Gguf, Weight::Layer(n, p)) => format!("blk.{n}.{}", p.gguf()),
            (Layout::Mlx, Weight::Embedding) => "model.embed_tokens".into(),
            (Layout::Mlx, Weight::Head) => "lm_head".into(),
            (Layout::Mlx, Weight::FinalNorm) => "model.norm".into(),
            (Layout::Mlx, Weight::Layer(n, p)) => format!("model.layers.{n}.{}", p.hf(arch)),
        }
    }

    /// The name of the weight's tensor `suffix` (`weight`, `bias`, `scales`,
    /// `biases`) in `layout`: the prefix and the suffix, except for gpt-oss's
    /// sinks, which Hugging Face names by the prefix alone, and DeepSeek's
    /// expert bias, which it keeps beside the router's weight.
    pub fn tensor(self, layout: Layout, arch: Architecture, suffix: &str) -> String {
        let prefix = self.prefix(layout, arch);
        match (layout, self) {
            (Layout::Mlx, Weight::Layer(_, Part::Sinks)) if suffix == "weight" => prefix,
            (Layout::Mlx, Weight::Layer(_, Part::ExpertBias)) if suffix == "bias" => {
                format!("{prefix}.e_score_correction_bias")
            }
            _ => format!("{prefix}.{suffix}"),
        }
    }

    /// The weight a GGUF tensor-name prefix names.
    pub fn from_gguf_prefix(prefix: &str) -> Option<Weight> {
        match prefix {
            "token_embd" => return Some(Weight::Embedding),
            "output" => return Some(Weight::Head),
            "output_norm" => return Some(Weight::FinalNorm),
            _ => {}
        }
        let rest = prefix.strip_prefix("blk.")?;
        let (n, part) = rest.split_once('.')?;
        let n = n.parse().ok()?;
        PARTS
            .iter()
            .find(|p| p.gguf() == part)
            .map(|&p| Weight::Layer(n, p))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_round_trip_through_gguf() {
        for w in [Weight::Embedding, Weight::Head, Weight::FinalNorm]
            .into_iter()
            .chain(PARTS.iter().map(|&p| Weight::Layer(17, p)))
        {
            let name = w.prefix(Layout::Gguf, Architecture::Gemma3);
            assert_eq!(Weight::from_gguf_prefix(&name), Some(w));
        }
        let llama = Architecture::Llama;
        assert_eq!(
            Weight::Layer(3, Part::Down).prefix(Layout::Mlx, llama),
            "model.layers.3.mlp.down_proj"
        );
        // One Hugging Face name, two roles.
        let hf = |p, arch| Weight::Layer(0, p).prefix(Layout::Mlx, arch);
        assert_eq!(
            hf(Part::FfnNorm, llama),
            "model.layers.0.post_attention_layernorm"
        );
        let gemma = Architecture::Gemma3;
        assert_eq!(
            hf(Part::PostAttnNorm, gemma),
            "model.layers.0.post_attention_layernorm"
        );
        assert_eq!(
            hf(Part::FfnNorm, gemma),
            "model.layers.0.pre_feedforward_layernorm"
        );
        assert_eq!(
            Weight::from_gguf_prefix("blk.2.ffn_down_exps"),
            Some(Weight::Layer(2, Part::ExpertDown))
        );
        assert_eq!(
            hf(Part::ExpertUp, Architecture::Mixtral),
            "model.layers.0.block_sparse_moe.switch_mlp.up_proj"
        );
        assert_eq!(
            hf(Part::Router, Architecture::Qwen3Moe),
            "model.layers.0.mlp.gate"
        );
        let gpt_oss = Architecture::GptOss;
        assert_eq!(hf(Part::Router, gpt_oss), "model.layers.0.mlp.router");
        assert_eq!(
            Weight::Layer(5, Part::Sinks).tensor(Layout::Mlx, gpt_oss, "weight"),
            "model.layers.5.self_attn.sinks"
        );
        assert_eq!(
            Weight::Layer(5, Part::Sinks).tensor(Layout::Gguf, gpt_oss, "weight"),
            "blk.5.attn_sinks.weight"
        );
        let deepseek = Architecture::DeepSeekV3;
        assert_eq!(
            Weight::Layer(4, Part::ExpertBias).tensor(Layout::Mlx, deepseek, "bias"),
            "model.layers.4.mlp.gate.e_score_correction_bias"
        );
        assert_eq!(
            Weight::Layer(4, Part::ExpertBias).tensor(Layout::Gguf, deepseek, "bias"),
            "blk.4.exp_probs_b.bias"
        );
        assert_eq!(
            hf(Part::SharedUp, deepseek),
            "model.layers.0.mlp.shared_experts.up_proj"
        );
        assert_eq!(
            hf(Part::EmbedQ, deepseek),
            "model.layers.0.self_attn.embed_q"
        );
        assert_eq!(Weight::from_gguf_prefix("blk.x.attn_q"), None);
        assert_eq!(Weight::from_gguf_prefix("rope_freqs"), None);
    }
}
