//! The feed-forward block of a layer on candle: dense, or a mixture of
//! experts routed per token.
//!
//! ```text
//!  rows h ──► router ──► softmax ──► top k (+ renormalise) ──► per expert e:
//!                                                     rows routed to e
//!                                                     ──► down(act(gate h) · up h)
//!  out[row] += weight(row, e) · expert_e(h[row]) ◄────────────┘
//! ```
//!
//! The routing is read back to the host (it is a few numbers per token) and
//! each expert runs once over all the rows that chose it, so a batch reads
//! an expert's weights once however many of its tokens chose it.

use candle_core::quantized::QMatMul;
use candle_core::{DType, Tensor};

use super::weights::Linear;
use crate::config::{Activation, Routing};
use crate::error::Result;

/// A layer's feed-forward block.
pub(super) enum FeedForward {
    /// `down(act(gate x) · up x)`.
    Dense {
        gate: Linear,
        up: Linear,
        down: Linear,
    },
    /// Routed experts.
    Experts(Box<Experts>),
}

/// The routed experts of one layer.
pub(super) struct Experts {
    /// hidden → one logit per expert.
    pub router: Linear,
    /// Per expert: gate, up and down projections.
    pub gate: Vec<Linear>,
    pub up: Vec<Linear>,
    pub down: Vec<Linear>,
    /// Experts each token uses.
    pub per_token: usize,
    /// Whether the chosen experts' weights are renormalised to sum to one.
    pub normalize: bool,
    /// How the router's logits choose.
    pub routing: Routing,
    /// A bias per expert on the choice's scores (DeepSeek V3).
    pub choice_bias: Option<Vec<f32>>,
    /// The expert every token also goes through (Qwen2-MoE, DeepSeek V3).
    pub shared: Option<Shared>,
}

/// A shared expert, behind a sigmoid gate of its own in some families.
pub(super) struct Shared {
    /// `[hidden]`: the gate's logit is its dot product with the row.
    pub gate_inp: Option<Tensor>,
    pub gate: Linear,
    pub up: Linear,
    pub down: Linear,
}

impl FeedForward {
    /// The block applied to rows `x` (`[tokens, hidden]`).
    pub fn forward(&self, x: &Tensor, activation: Activation) -> Result<Tensor> {
        match self {
            FeedForward::Dense { gate, up, down } => glu(gate, up, down, x, activation),
            FeedForward::Experts(e) => e.forward(x, activation),
        }
    }
}

/// A gated feed-forward block.
fn glu(
    gate: &Linear,
    up: &Linear,
    down: &Linear,
    x: &Tensor,
    activation: Activation,
) -> Result<Tensor> {
    let (g, u) = (gate.forward(x)?, up.forward(x)?);
    let h = match activation {
        Activation::Silu => (candle_nn::ops::silu(&g)? * u)?,
        Activation::GeluTanh => (g.gelu()? * u)?,
        Activation::SwigluOai => {
            let limit = f64::from(Activation::SWIGLU_LIMIT);
            let g = g.minimum(limit)?;
            let u = u.clamp(-limit, limit)?;
            let sig = candle_nn::ops::sigmoid(&(&g * f64::from(Activation::SWIGLU_ALPHA))?)?;
            ((g * sig)? * (u + 1.0)?)?
        }
    };
    down.forward(&h)
}

impl Experts {
    fn forward(&self, x: &Tensor, activation: Activation) -> Result<Tensor> {
        let logits = self
            .router
            .forward_row_invariant(x)?
            .to_dtype(DType::F32)?
            .to_vec2::<f32>()?;
        let experts = self.gate.len();
        // Per expert: the rows that chose it and their weights.
        let mut rows: Vec<Vec<u32>> = vec![Vec::new(); experts];
        let mut weights: Vec<Vec<f32>> = vec![Vec::new(); experts];
        for (r, row) in logits.iter().enumerate() {
            let chosen = match self.routing {
                Routing::Softmax => route(row, self.per_token, self.normalize),
                grouped => crate::routing::route_groups(
                    row,
                    self.choice_bias.as_deref().unwrap_or(&[]),
                    grouped,
                    self.per_token,
                    self.normalize,
                ),
            };
            for (e, w) in chosen {
                rows[e].push(r as u32);
                weights[e].push(w);
            }
        }
        let mut out = x.zeros_like()?;
        for e in 0..experts {
            if rows[e].is_empty() {
                continue;
            }
            let n = rows[e].len();
            let index = Tensor::new(rows[e].as_slice(), x.device())?;
            let y = glu(
                &self.gate[e],
                &self.up[e],
                &self.down[e],
                &x.index_select(&index, 0)?,
                activation,
            )?;
            let w = Tensor::from_slice(&weights[e], (n, 1), x.device())?;
            out = out.index_add(&index, &y.broadcast_mul(&w)?, 0)?;
        }
        if let Some(s) = &self.shared {
            let y = glu(&s.gate, &s.up, &s.down, x, activation)?;
            out = match &s.gate_inp {
                Some(gate_inp) => {
                    let hidden = gate_inp.elem_count();
                    let gate =
                        super::dense::forward(&QMatMul::Tensor(gate_inp.reshape((1, hidden))?), x)?;
                    (out + y.broadcast_mul(&candle_nn::ops::sigmoid(&gate)?)?)?
                }
                None => (out + y)?,
            };
        }
        Ok(out)
    }
}

/// The `k` experts a row of router logits chooses, with their weights: the
/// softmax over all experts, the `k` largest (the lower index first on a
/// tie), renormalised to sum to one when asked (which is also a softmax over
/// the chosen logits alone, as Mixtral defines it).
pub(super) fn route(logits: &[f32], k: usize, normalize: bool) -> Vec<(usize, f32)> {
    let max = logits.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    let exp: Vec<f32> = logits.iter().map(|&l| (l - max).exp()).collect();
    let sum: f32 = exp.iter().sum();
    let mut order: Vec<usize> = (0..logits.len()).collect();
    order.sort_by(|&a, &b| exp[b].total_cmp(&exp[a]).then(a.cmp(&b)));
    order.truncate(k);
    let chosen: f32 = order.iter().map(|&e| exp[e]).sum();
    let total = if normalize { chosen } else { sum };
    order.into_iter().map(|e| (e, exp[e] / total)).collect()
}

#[cfg(test)]
mod tests {
    use super::route;

    #[test]
    fn routing_takes_the_top_k_and_renormalises_when_asked() {
        let logits = [0.0, 2.0, 1.0, 2.0f32.ln() + 2.0];
        let r = route(&logits, 2, true);
        assert_eq!(r.iter().map(|x| x.0).collect::<Vec<_>>(), vec![3, 1]);
        assert!((r[0].1 - 2.0 / 3.0).abs() < 1e-6 && (r[1].1 - 1.0 / 3.0).abs() < 1e-6);
        let r = route(&logits, 2, false);
        let sum: f32 = logits.iter().map(|l| l.exp()).sum();
        assert!((r[1].1 - 2f32.exp() / sum).abs() < 1e-6);
        // Ties go to the lower index; k = all experts keeps every one.
        let r = route(&[1.0, 1.0, 1.0], 2, true);
        assert_eq!(r, vec![(0, 0.5), (1, 0.5)]);
        assert_eq!(route(&[5.0, -5.0], 2, true).len(), 2);
    }
}
