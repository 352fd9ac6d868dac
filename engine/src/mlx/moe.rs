//! The feed-forward block of a layer on MLX: dense, or a mixture of experts
//! whose routing and expert products stay in MLX's graph (no read-back),
//! but for DeepSeek's group routing, chosen on the host.
//!
//! ```text
//!  x [T, H] ──► router ──► route: ids [T, k], weights [T, k]
//!  x [T, 1, 1, H] ──► gather (q)mm with w[ids]: gate, up ──► act(gate) · up
//!                 ──► gather (q)mm: down [T, k, 1, H] ──► weights [T, 1, k] @ ──► [T, H]
//! ```

use super::array::Quant;
use super::array::{Array, Dtype, gather_matmul, gather_quantized_matmul, route};
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
    pub(super) router: Linear,
    pub(super) gate: Stacked,
    pub(super) up: Stacked,
    pub(super) down: Stacked,
    /// Experts each token uses.
    pub(super) per_token: usize,
    /// Whether the chosen experts' weights are renormalised to sum to one.
    pub(super) normalize: bool,
    /// How the router's logits choose.
    pub(super) routing: Routing,
    /// A bias per expert on the choice's scores (DeepSeek V3).
    pub(super) choice_bias: Option<Vec<f32>>,
    /// The expert every token also goes through (Qwen2-MoE).
    pub(super) shared: Option<SharedExpert>,
}

/// A shared expert behind a sigmoid gate of its own.
pub(super) struct SharedExpert {
    /// hidden → the gate's logit.
    pub(super) gate_inp: Option<Linear>,
    pub(super) gate: Linear,
    pub(super) up: Linear,
    pub(super) down: Linear,
}

/// Every expert's matrix of one projection: quantized as the file holds it
/// (`[experts, out, packed]`), or dense f32 `[experts, in, out]`; with
/// every expert's bias (`[experts, out]`) when the family has them.
pub(super) struct Stacked {
    pub(super) w: Array,
    pub(super) quant: Option<Quant>,
    pub(super) bias: Option<Array>,
}

impl Stacked {
    /// `x` (`[tokens, 1, 1, in]`) times each token's experts `ids`
    /// (`[tokens, k]`): `[tokens, k, 1, out]`.
    fn forward(&self, x: &Array, ids: &Array) -> Result<Array> {
        let y = self.product(x, ids)?;
        let Some(bias) = &self.bias else {
            return Ok(y);
        };
        // Each token's experts' biases: [tokens, k, out] → [tokens, k, 1, out].
        let shape = y.shape();
        let b = bias.take(ids, 0)?.reshape(&shape)?;
        y.add(&b)
    }

    fn product(&self, x: &Array, ids: &Array) -> Result<Array> {
        match &self.quant {
            Some(q) => gather_quantized_matmul(x, &self.w, q, ids),
            None => gather_matmul(x, &self.w, ids),
        }
    }

    pub(super) fn bytes(&self) -> usize {
        self.w.nbytes()
            + self.bias.as_ref().map_or(0, Array::nbytes)
            + self.quant.as_ref().map_or(0, Quant::bytes)
    }
}

/// The gated unit of the gate's and the up projection's outputs.
fn glu(gate: &Array, up: &Array, activation: Activation) -> Result<Array> {
    match activation {
        Activation::Silu => gate.silu()?.multiply(up),
        Activation::GeluTanh => gate.gelu_tanh()?.multiply(up),
        Activation::SwigluOai => {
            gate.swiglu_oai(up, Activation::SWIGLU_ALPHA, Activation::SWIGLU_LIMIT)
        }
    }
}

impl FeedForward {
    /// The block applied to rows `x` (`[tokens, hidden]`).
    pub(super) fn forward(&self, x: &Array, activation: Activation) -> Result<Array> {
        match self {
            FeedForward::Dense { gate, up, down } => {
                down.forward(&glu(&gate.forward(x)?, &up.forward(x)?, activation)?)
            }
            FeedForward::Experts(e) => e.forward(x, activation),
        }
    }
}

impl Experts {
    /// Experts per row of router logits.
    fn router_width(&self, logits: &Array) -> Result<usize> {
        logits
            .shape()
            .last()
            .copied()
            .filter(|&n| n > 0)
            .ok_or_else(|| crate::error::Error::Mlx("router logits without experts".into()))
    }

    fn forward(&self, x: &Array, activation: Activation) -> Result<Array> {
        let shape = x.shape();
        let (tokens, hidden, k) = (shape[0], shape[1], self.per_token);
        let logits = self.router.forward(x)?;
        let (ids, weights) = match self.routing {
            Routing::Softmax => route(&logits, k, self.normalize)?,
            // Chosen on the host (a few numbers per token).
            grouped => {
                let experts = self.router_width(&logits)?;
                let all = logits.astype(Dtype::F32)?.to_f32()?;
                let (mut ids, mut weights) = (Vec::new(), Vec::new());
                for row in all.chunks(experts) {
                    for (e, w) in crate::routing::route_groups(
                        row,
                        self.choice_bias.as_deref().unwrap_or(&[]),
                        grouped,
                        k,
                        self.normalize,
                    ) {
                        ids.push(e as u32);
                        weights.push(w);
                    }
                }
                (
                    Array::from_u32(&ids, &[tokens, k])?,
                    Array::from_f32(&weights, &[tokens, k])?,
                )
            }
        };
        let x = x.reshape(&[tokens, 1, 1, hidden])?;
        let h = glu(
            &self.gate.forward(&x, &ids)?,
            &self.up.forward(&x, &ids)?,
            activation,
        )?;
        let y = self.down.forward(&h, &ids)?.reshape(&[tokens, k, hidden])?;
        // Σ over the chosen experts: [T, 1, k] @ [T, k, H].
        let routed = weights
            .reshape(&[tokens, 1, k])?
            .matmul(&y)?
            .reshape(&[tokens, hidden])?;
        let Some(s) = &self.shared else {
            return Ok(routed);
        };
        let x = x.reshape(&[tokens, hidden])?;
        let shared = s
            .down
            .forward(&glu(&s.gate.forward(&x)?, &s.up.forward(&x)?, activation)?)?;
        match &s.gate_inp {
            Some(gate_inp) => {
                let gate = gate_inp.forward(&x)?.sigmoid()?;
                routed.add(&shared.multiply(&gate)?)
            }
            None => routed.add(&shared),
        }
    }
}
