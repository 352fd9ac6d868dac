//! Tensor parallelism: every layer split across the ranks of a group, each
//! rank computing its share of every token.
//!
//! ```text
//!             x (replicated on every rank)
//!        ┌──────────┼───────────┐
//!   rank 0: heads of KV groups [0,2)    rank 1: KV group [2,3)
//!   q,k,v rows · attention · o columns  (its own share)
//!        └──── all-reduce (sum, rank order) ────┘   ← one per attention
//!   gate,up rows · act · down columns of intermediate [0,i0) | [i0,I)
//!        └──── all-reduce (sum, rank order) ────┘   ← one per MLP
//! ```
//!
//! - [`split`]: which KV-head groups and intermediate columns each rank
//!   takes, in shares proportional to each rank's weight (uneven splits and
//!   any number of ranks up to the KV heads);
//! - [`AllReduce`]: the collective a rank sums its partial results with;
//!   implemented over TCP by the data plane crate (this crate knows nothing
//!   of the network), or by anything that sums in rank order;
//! - [`group`]: a [`TensorGroup`] runs the ranks of one stage behind the
//!   ordinary [`Stage`](crate::Stage) contract, so a pipeline's stage may be
//!   a tensor group: rank 0 leads, the others follow on threads of this
//!   process or in processes of their own ([`follow`]), taking each
//!   [`command`] as bytes.
//!
//! A backend builds a rank from a [`RankShare`] and an [`AllReduce`]; the
//! candle backend does (`CandleStage::load_rank`).

pub mod command;
pub mod group;
pub mod split;

pub use command::{Command, Reply};
pub use group::{Followers, TensorGroup, follow};
pub use split::{RankShare, TensorSplit, parse_weights};

/// Sums a buffer across the ranks of a group, in place: on return every rank
/// holds the same sum, added in rank order (so results are reproducible).
pub trait AllReduce: Send {
    /// Replaces `values` with the element-wise sum of every rank's `values`.
    fn all_reduce(&mut self, values: &mut [f32]) -> Result<(), String>;
}

impl<F> AllReduce for F
where
    F: FnMut(&mut [f32]) -> Result<(), String> + Send,
{
    fn all_reduce(&mut self, values: &mut [f32]) -> Result<(), String> {
        self(values)
    }
}

/// One rank of a group as a backend needs it: its share of the weights and
/// the collective it sums with.
pub struct TensorRank {
    /// What this rank computes.
    pub share: RankShare,
    /// Sums partial results with the other ranks.
    pub collective: Box<dyn AllReduce>,
}

impl std::fmt::Debug for TensorRank {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TensorRank")
            .field("share", &self.share)
            .finish()
    }
}
