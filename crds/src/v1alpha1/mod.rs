//! Version `v1alpha1` of the `shardplane.dev` API.

mod common;
mod inference_node;
mod model;
mod model_deployment;
mod node_pool;
mod shard;
mod sharding_strategy;

pub use common::*;
pub use inference_node::*;
pub use model::*;
pub use model_deployment::*;
pub use node_pool::*;
pub use shard::*;
pub use sharding_strategy::*;
