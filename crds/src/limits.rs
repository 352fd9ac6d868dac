//! Upper bounds on every count a person writes in a spec. The API server
//! refuses an object past them at apply time (they are the schema's
//! `maximum`/`maxItems`), and `validate()` repeats them for objects stored
//! before a bound existed, so one odd object never makes a controller
//! allocate or loop without end.

/// Instances of one deployment.
pub const MAX_REPLICAS: i32 = 1024;
/// Nodes one instance may span (`minNodes`, `maxNodes`).
pub const MAX_NODES_PER_INSTANCE: u32 = 256;
/// The most ranks of one tensor-parallel group.
pub const MAX_TENSOR_RANKS: u32 = 64;
/// Tokens of context (`kvCache.contextLength`, a Model's `maxContextLength`).
pub const MAX_CONTEXT_LENGTH: u32 = 1 << 24;
/// Sequences one instance serves at once (`kvCache.concurrentSequences`).
pub const MAX_CONCURRENT_SEQUENCES: u32 = 4096;
/// Aliases of one deployment.
pub const MAX_ALIASES: usize = 64;
/// Steps of one deployment's fallback chain.
pub const MAX_FALLBACK: usize = 16;
