//! The placement planner: which nodes run which layers of which model.
//!
//! ```text
//!  Request (deployment, tier, replicas, footprint, strategy, current placement)
//!     + Cluster (nodes with free memory, weights held, dedication; measured links)
//!     ──plan()──► Plan (instances: stages of (node, layers)) + what could not be placed, in numbers
//! ```
//!
//! Pure: no Kubernetes types, no I/O. The operator turns its objects into a
//! [`Cluster`] and [`Request`]s and writes back what [`plan`] returns.
//!
//! Rules, in the order they apply:
//! - an instance whose stages all still stand (nodes schedulable, memory fits,
//!   the split still matches the model and strategy) is kept as it is;
//! - an instance that lost nodes gets only those stages moved, when a
//!   replacement fits; otherwise it is placed afresh;
//! - daily tier: the whole model on one node per replica, distinct nodes, each
//!   node dedicated to one deployment;
//! - pipeline: the fewest nodes that fit, preferring nodes that hold the
//!   weights and have the most room (the share of the model their free
//!   memory holds, as their engine holds it); stages ordered around the ring to
//!   minimise measured link latency; layers split by the strategy's policy so
//!   every stage fits its node's memory (weights of its layers, the first
//!   stage's embedding, the last stage's output head, its layers' KV cache for
//!   the budget, and overhead);
//! - tensor: groups of `tensorSize` ranks (or one group) on the fewest nodes
//!   that fit, each group's ranks sharing every layer of its stage in
//!   proportion to their weights, groups in pipeline order; every link
//!   within a group meets the strategy's requirements;
//! - unschedulable (cordoned, not ready) nodes get nothing.

mod cluster;
mod explain;
mod footprint;
mod order;
mod plan;
mod split;
mod tensor;

pub use cluster::{Cluster, Link, Node};
pub use explain::human_bytes;
pub use footprint::{Footprint, KvBudget};
pub use plan::{
    Instance, Parallelism, Plan, Policy, Request, Stage, Strategy, Tier, Unplaceable,
    UnplaceableReason, plan,
};
pub use tensor::TensorRank;
