//! The agent's Prometheus metrics.

use std::sync::Arc;

use prometheus::{
    HistogramOpts, HistogramVec, IntCounter, IntCounterVec, IntGauge, IntGaugeVec, Opts, Registry,
};

/// What a pipeline's head did after a later stage refused the prefix it
/// took: asked again with fewer tokens, or ran the prompt whole (the
/// `outcome` of `shardplane_agent_prefix_cache_downstream_misses_total`).
pub const RETAKE_OUTCOMES: [&str; 2] = ["fewer", "whole"];

/// Every metric the agent exposes.
#[derive(Clone)]
pub struct Metrics {
    /// The registry served on `/metrics`.
    pub registry: Registry,
    /// Every metric registered, for documentation and its test.
    pub described: Vec<shardplane_admin::Described>,
    /// Shards on this node by phase.
    pub shards: IntGaugeVec,
    /// Lease renewals that succeeded.
    pub lease_renewals: IntCounter,
    /// Lease renewals that failed.
    pub lease_failures: IntCounter,
    /// When the data-plane certificate expires (Unix seconds; 0 without TLS).
    pub certificate_expiry: IntGauge,
    /// Data-plane connections dropped in the TLS handshake, by reason.
    pub handshake_failures: IntCounterVec,
    /// Bytes of weights loaded.
    pub weight_bytes: IntGauge,
    /// Machine memory by kind (`total`, `available`, `allocatable`).
    pub memory_bytes: IntGaugeVec,
    /// Forward passes by shard: seconds per pass.
    pub forward_seconds: HistogramVec,
    /// Tokens (rows) run through each shard.
    pub forward_tokens: IntCounterVec,
    /// Generations on head stages by outcome (`ok`, `cancelled`, `error`, or
    /// `refused` at admission because the stage was too busy).
    pub generations: IntCounterVec,
    /// Tokens generated on head stages.
    pub generated_tokens: IntCounter,
    /// Generations preempted for KV room on head stages (resumed later by recompute), by shard.
    pub preemptions: IntCounterVec,
    /// Pipeline opens a later stage refused because it lacked some of the prefix the head took, by shard and what the head did next.
    pub prefix_misses_downstream: IntCounterVec,
    /// Bytes of hidden states sent to next stages.
    pub hidden_bytes_sent: IntCounter,
    /// Round trip of one decode step from this stage through the rest of the pipeline.
    pub downstream_step_seconds: HistogramVec,
    /// Bytes of model files served to peers.
    pub blob_bytes_served: IntCounter,
    /// Bytes of model files fetched, by source (`url`, `peer`).
    pub download_bytes: IntCounterVec,
    /// Bytes in the weights cache.
    pub cache_bytes: IntGauge,
    /// Sequences with a KV cache, by shard.
    pub sequences: IntGaugeVec,
    /// Prompt tokens of the sequences each shard started after a look in
    /// its prefix cache (once per sequence).
    pub prefix_lookup_tokens: IntCounterVec,
    /// Of those, the tokens whose KV came from the prefix cache.
    pub prefix_hit_tokens: IntCounterVec,
    /// Blocks the prefix cache evicted.
    pub prefix_evicted_blocks: IntCounterVec,
    /// Sequences in each step, summed (over the step count: the mean batch).
    pub step_sequences: IntCounterVec,
    /// Prompts waiting for or part-way through their prefill.
    pub waiting_prompts: IntGaugeVec,
    /// How long prompts waited at a stage before their first slice ran.
    pub queue_wait_seconds: HistogramVec,
    /// KV tokens reserved by admitted generations, and the budget.
    pub kv_tokens: IntGaugeVec,
    /// A pipeline head's accounts of its later stages' KV.
    pub kv_later_tokens: IntGaugeVec,
    /// Bytes the prefix cache holds.
    pub prefix_bytes: IntGaugeVec,
    /// Bytes the prefix cache may hold.
    pub prefix_budget_bytes: IntGaugeVec,
    /// Measured round trip to each peer's data plane.
    pub link_latency_seconds: prometheus::GaugeVec,
    /// Measured throughput to each peer's data plane.
    pub link_bandwidth_bytes: prometheus::GaugeVec,
}

impl Metrics {
    /// Registers every metric in a new registry.
    pub fn new() -> Self {
        let registry = Registry::new();
        let shards = IntGaugeVec::new(
            Opts::new("shardplane_agent_shards", "Shards on this node by phase."),
            &["phase"],
        )
        .expect("valid metric");
        let lease_renewals = IntCounter::new(
            "shardplane_agent_lease_renewals_total",
            "Lease renewals that succeeded.",
        )
        .expect("valid metric");
        let lease_failures = IntCounter::new(
            "shardplane_agent_lease_failures_total",
            "Lease renewals that failed.",
        )
        .expect("valid metric");
        let certificate_expiry = IntGauge::new(
            "shardplane_agent_data_plane_certificate_expiry_timestamp_seconds",
            "When the data-plane certificate expires (Unix seconds); 0 when the data plane runs without TLS.",
        )
        .expect("valid metric");
        let handshake_failures = IntCounterVec::new(
            Opts::new(
                "shardplane_agent_data_plane_handshake_failures_total",
                "Data-plane connections dropped in the TLS handshake, by error (refused: not TLS, no client certificate, an unknown CA, a bad certificate; timeout).",
            ),
            &["error"],
        )
        .expect("valid metric");
        let weight_bytes =
            IntGauge::new("shardplane_agent_weight_bytes", "Bytes of weights loaded.")
                .expect("valid metric");
        let memory_bytes = IntGaugeVec::new(
            Opts::new("shardplane_agent_memory_bytes", "Machine memory by kind."),
            &["kind"],
        )
        .expect("valid metric");
        let latency_buckets = vec![
            0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0,
            2.5, 5.0, 10.0,
        ];
        let forward_seconds = HistogramVec::new(
            HistogramOpts::new(
                "shardplane_agent_forward_seconds",
                "Seconds per forward pass of a shard (one prefill chunk or one batch of decode steps).",
            )
            .buckets(latency_buckets.clone()),
            &["shard"],
        )
        .expect("valid metric");
        let forward_tokens = IntCounterVec::new(
            Opts::new(
                "shardplane_agent_forward_tokens_total",
                "Tokens run through a shard.",
            ),
            &["shard"],
        )
        .expect("valid metric");
        let generations = IntCounterVec::new(
            Opts::new(
                "shardplane_agent_generations_total",
                "Generations asked of this node's head stages, by outcome (refused: the stage had more work queued than --max-queue-wait allows).",
            ),
            &["outcome"],
        )
        .expect("valid metric");
        let preemptions = IntCounterVec::new(
            Opts::new(
                "shardplane_agent_preemptions_total",
                "Generations on a head stage preempted because their KV could not grow within the \
                 budget: freed, then resumed by recompute when there was room; by shard.",
            ),
            &["shard"],
        )
        .expect("valid metric");
        let prefix_misses_downstream = IntCounterVec::new(
            Opts::new(
                "shardplane_agent_prefix_cache_downstream_misses_total",
                "Pipeline opens a later stage refused because it no longer held all of the prompt \
                 tokens the head stage took from its prefix cache, by shard and what the head did \
                 next: asked again with as many as that stage holds (fewer) or ran the prompt \
                 whole (whole).",
            ),
            &["shard", "outcome"],
        )
        .expect("valid metric");
        let generated_tokens = IntCounter::new(
            "shardplane_agent_generated_tokens_total",
            "Tokens generated by this node's head stages.",
        )
        .expect("valid metric");
        let hidden_bytes_sent = IntCounter::new(
            "shardplane_agent_hidden_state_sent_bytes_total",
            "Bytes of hidden states sent to next stages.",
        )
        .expect("valid metric");
        let downstream_step_seconds = HistogramVec::new(
            HistogramOpts::new(
                "shardplane_agent_downstream_step_seconds",
                "Seconds from sending a decode step to the next stage to receiving its token (the rest of the pipeline and its hops).",
            )
            .buckets(latency_buckets),
            &["shard"],
        )
        .expect("valid metric");
        let blob_bytes_served = IntCounter::new(
            "shardplane_agent_peer_served_bytes_total",
            "Bytes of model files served to peers.",
        )
        .expect("valid metric");
        let download_bytes = IntCounterVec::new(
            Opts::new(
                "shardplane_agent_download_bytes_total",
                "Bytes of model files fetched, by source.",
            ),
            &["source"],
        )
        .expect("valid metric");
        let cache_bytes = IntGauge::new(
            "shardplane_agent_cache_bytes",
            "Bytes of model files in the weights cache.",
        )
        .expect("valid metric");
        let sequences = IntGaugeVec::new(
            Opts::new(
                "shardplane_agent_sequences",
                "Sequences holding a KV cache, by shard.",
            ),
            &["shard"],
        )
        .expect("valid metric");
        let counter = |name: &str, help: &str| {
            IntCounterVec::new(Opts::new(name, help), &["shard"]).expect("valid metric")
        };
        let prefix_lookup_tokens = counter(
            "shardplane_agent_prefix_cache_lookup_tokens_total",
            "Prompt tokens of new sequences started after a look in the prefix cache (once per \
             sequence, however often a pipeline asked its later stages), by shard.",
        );
        let prefix_hit_tokens = counter(
            "shardplane_agent_prefix_cache_hit_tokens_total",
            "Of the prompt tokens counted in shardplane_agent_prefix_cache_lookup_tokens_total, \
             those whose KV came from the prefix cache (not computed), by shard.",
        );
        let prefix_evicted_blocks = counter(
            "shardplane_agent_prefix_cache_evicted_blocks_total",
            "Blocks the prefix cache evicted to stay within its budget, by shard.",
        );
        let gauge = |name: &str, help: &str| {
            IntGaugeVec::new(Opts::new(name, help), &["shard"]).expect("valid metric")
        };
        let step_sequences = counter(
            "shardplane_agent_step_sequences_total",
            "Sequences in each forward pass, summed, by shard (over the passes: the mean batch).",
        );
        let waiting_prompts = gauge(
            "shardplane_agent_waiting_prompts",
            "Prompts waiting for their first slice or part-way through their prefill, by shard.",
        );
        let queue_wait_seconds = HistogramVec::new(
            HistogramOpts::new(
                "shardplane_agent_queue_wait_seconds",
                "Seconds a prompt waited at a stage before its first slice ran, by shard.",
            )
            .buckets(vec![
                0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0,
            ]),
            &["shard"],
        )
        .expect("valid metric");
        let kv_tokens = IntGaugeVec::new(
            Opts::new(
                "shardplane_agent_kv_tokens",
                "KV tokens of a stage: reserved by the generations a head admitted (kind=reserved) \
                 and the budget it admits within, concurrent sequences x the cost of a context, or less \
                 when its machine's free memory holds less (kind=budget), by shard; a pipeline's head \
                 also admits within each later stage's own budget. On a model with \
                 sliding-window layers a long sequence counts as fewer tokens than its length \
                 (those layers hold only its last ones), by each stage's own layers.",
            ),
            &["shard", "kind"],
        )
        .expect("valid metric");
        let kv_later_tokens = IntGaugeVec::new(
            Opts::new(
                "shardplane_agent_kv_later_stage_tokens",
                "A pipeline head's account of a later stage's KV, in that stage's units: what \
                 the generations the head admitted hold there (kind=reserved) and the budget that \
                 stage reported at the head's last admission or growth (kind=budget), by the \
                 head's shard and the later stage's (later_shard).",
            ),
            &["shard", "later_shard", "kind"],
        )
        .expect("valid metric");
        let prefix_bytes = gauge(
            "shardplane_agent_prefix_cache_bytes",
            "Bytes of prompts' KV the prefix cache holds, by shard.",
        );
        let prefix_budget_bytes = gauge(
            "shardplane_agent_prefix_cache_budget_bytes",
            "Bytes of prompts' KV the prefix cache may hold, by shard (0: off).",
        );
        let link_latency_seconds = prometheus::GaugeVec::new(
            Opts::new(
                "shardplane_agent_link_latency_seconds",
                "Median round trip to a peer's data plane, as last measured.",
            ),
            &["peer"],
        )
        .expect("valid metric");
        let link_bandwidth_bytes = prometheus::GaugeVec::new(
            Opts::new(
                "shardplane_agent_link_bandwidth_bytes",
                "Bytes per second to a peer's data plane, as last measured.",
            ),
            &["peer"],
        )
        .expect("valid metric");
        // Known label values start at zero, so rates exist before the first event.
        for source in ["url", "peer"] {
            download_bytes.with_label_values(&[source]);
        }
        for outcome in ["ok", "cancelled", "error", "refused"] {
            generations.with_label_values(&[outcome]);
        }
        let described = shardplane_admin::register(
            &registry,
            vec![
                Box::new(forward_seconds.clone()) as Box<dyn prometheus::core::Collector>,
                Box::new(forward_tokens.clone()),
                Box::new(generations.clone()),
                Box::new(generated_tokens.clone()),
                Box::new(preemptions.clone()),
                Box::new(prefix_misses_downstream.clone()),
                Box::new(hidden_bytes_sent.clone()),
                Box::new(downstream_step_seconds.clone()),
                Box::new(blob_bytes_served.clone()),
                Box::new(download_bytes.clone()),
                Box::new(cache_bytes.clone()),
                Box::new(sequences.clone()),
                Box::new(prefix_lookup_tokens.clone()),
                Box::new(prefix_hit_tokens.clone()),
                Box::new(prefix_evicted_blocks.clone()),
                Box::new(step_sequences.clone()),
                Box::new(waiting_prompts.clone()),
                Box::new(queue_wait_seconds.clone()),
                Box::new(kv_tokens.clone()),
                Box::new(kv_later_tokens.clone()),
                Box::new(prefix_bytes.clone()),
                Box::new(prefix_budget_bytes.clone()),
                Box::new(link_latency_seconds.clone()),
                Box::new(link_bandwidth_bytes.clone()),
                Box::new(shards.clone()),
                Box::new(lease_renewals.clone()),
                Box::new(lease_failures.clone()),
                Box::new(certificate_expiry.clone()),
                Box::new(handshake_failures.clone()),
                Box::new(weight_bytes.clone()),
                Box::new(memory_bytes.clone()),
            ],
        );
        Metrics {
            registry,
            described,
            shards,
            lease_renewals,
            lease_failures,
            certificate_expiry,
            handshake_failures,
            weight_bytes,
            memory_bytes,
            forward_seconds,
            forward_tokens,
            generations,
            generated_tokens,
            preemptions,
            prefix_misses_downstream,
            hidden_bytes_sent,
            downstream_step_seconds,
            blob_bytes_served,
            download_bytes,
            cache_bytes,
            sequences,
            prefix_lookup_tokens,
            prefix_hit_tokens,
            prefix_evicted_blocks,
            step_sequences,
            waiting_prompts,
            queue_wait_seconds,
            kv_tokens,
            kv_later_tokens,
            prefix_bytes,
            prefix_budget_bytes,
            link_latency_seconds,
            link_bandwidth_bytes,
        }
    }

    /// Records a shard's forward passes and its prefix cache.
    pub fn pass_observer(&self, shard: &str) -> crate::stage::PassObserver {
        let seconds = self.forward_seconds.with_label_values(&[shard]);
        let tokens = self.forward_tokens.with_label_values(&[shard]);
        let lookups = self.prefix_lookup_tokens.with_label_values(&[shard]);
        let hits = self.prefix_hit_tokens.with_label_values(&[shard]);
        let evicted = self.prefix_evicted_blocks.with_label_values(&[shard]);
        let batch = self.step_sequences.with_label_values(&[shard]);
        let waiting = self.waiting_prompts.with_label_values(&[shard]);
        let queue_wait = self.queue_wait_seconds.with_label_values(&[shard]);
        let kv_reserved = self.kv_tokens.with_label_values(&[shard, "reserved"]);
        let kv_budget = self.kv_tokens.with_label_values(&[shard, "budget"]);
        // Counted by the head's generations (`dataplane::head`); from zero.
        self.preemptions.with_label_values(&[shard]);
        for outcome in RETAKE_OUTCOMES {
            self.prefix_misses_downstream
                .with_label_values(&[shard, outcome]);
        }
        let used = self.prefix_bytes.with_label_values(&[shard]);
        let budget = self.prefix_budget_bytes.with_label_values(&[shard]);
        // The stage counts from its load; the counters follow its totals.
        let follow = |counter: &prometheus::IntCounter, total: u64| {
            counter.inc_by(total.saturating_sub(counter.get()));
        };
        Arc::new(move |pass| {
            if pass.rows > 0 {
                seconds.observe(pass.seconds);
                tokens.inc_by(pass.rows as u64);
                batch.inc_by(pass.sequences as u64);
            }
            waiting.set(pass.waiting as i64);
            kv_reserved.set(pass.kv_tokens.0 as i64);
            kv_budget.set(pass.kv_tokens.1 as i64);
            for &wait in &pass.queue_waits {
                queue_wait.observe(wait);
            }
            follow(&lookups, pass.looks.0);
            follow(&hits, pass.looks.1);
            follow(&evicted, pass.prefix.evicted_blocks);
            used.set(pass.prefix.bytes as i64);
            budget.set(pass.prefix.budget_bytes as i64);
        })
    }

    /// Drops a shard's series when it is unloaded.
    pub fn forget_shard(&self, shard: &str) {
        let _ = self.forward_seconds.remove_label_values(&[shard]);
        let _ = self.forward_tokens.remove_label_values(&[shard]);
        let _ = self.downstream_step_seconds.remove_label_values(&[shard]);
        let _ = self.sequences.remove_label_values(&[shard]);
        let _ = self.prefix_lookup_tokens.remove_label_values(&[shard]);
        let _ = self.prefix_hit_tokens.remove_label_values(&[shard]);
        let _ = self.prefix_evicted_blocks.remove_label_values(&[shard]);
        let _ = self.step_sequences.remove_label_values(&[shard]);
        let _ = self.waiting_prompts.remove_label_values(&[shard]);
        let _ = self.queue_wait_seconds.remove_label_values(&[shard]);
        let _ = self.kv_tokens.remove_label_values(&[shard, "reserved"]);
        let _ = self.kv_tokens.remove_label_values(&[shard, "budget"]);
        let _ = self.preemptions.remove_label_values(&[shard]);
        for outcome in RETAKE_OUTCOMES {
            let _ = self
                .prefix_misses_downstream
                .remove_label_values(&[shard, outcome]);
        }
        let _ = self.prefix_bytes.remove_label_values(&[shard]);
        let _ = self.prefix_budget_bytes.remove_label_values(&[shard]);
    }
}

impl Default for Metrics {
    fn default() -> Self {
        Self::new()
    }
}
