//! The operator's Prometheus metrics, in one registry served on `/metrics`.

use prometheus::{HistogramOpts, HistogramVec, IntCounterVec, Opts, Registry};

/// Every metric the operator exposes.
#[derive(Clone)]
pub struct Metrics {
    /// The registry to serve.
    pub registry: Registry,
    /// Every metric registered, for documentation and its test.
    pub described: Vec<shardplane_admin::Described>,
    /// Reconciles by controller and result (`ok`, `error`).
    pub reconciles: IntCounterVec,
    /// Reconcile duration by controller.
    pub reconcile_duration: HistogramVec,
    /// Reconcile errors by controller and error kind.
    pub reconcile_errors: IntCounterVec,
    /// Placement outcomes (`placed`, `partial`, `unplaceable`, `invalid`).
    pub placements: IntCounterVec,
    /// Instances of all deployments by phase (`ready`, `starting`, `unplaced`).
    pub instances: prometheus::IntGaugeVec,
    /// 1 while this replica holds the leader lease.
    pub leader: prometheus::IntGauge,
    /// Admission reviews answered, by kind reviewed and outcome.
    pub admission_reviews: IntCounterVec,
    /// Time the webhook takes to answer a review, by kind reviewed.
    pub admission_review_duration: HistogramVec,
    /// Data-plane certificate requests answered, by outcome.
    pub certificates: IntCounterVec,
}

impl Metrics {
    /// Registers every metric in a new registry.
    pub fn new() -> Self {
        let registry = Registry::new();
        let reconciles = IntCounterVec::new(
            Opts::new(
                "shardplane_operator_reconciles_total",
                "Reconciles by controller and result.",
            ),
            &["controller", "result"],
        )
        .expect("valid metric");
        let reconcile_duration = HistogramVec::new(
            HistogramOpts::new(
                "shardplane_operator_reconcile_duration_seconds",
                "Time one reconcile takes.",
            )
            .buckets(vec![0.001, 0.005, 0.01, 0.05, 0.1, 0.5, 1.0, 5.0]),
            &["controller"],
        )
        .expect("valid metric");
        let reconcile_errors = IntCounterVec::new(
            Opts::new(
                "shardplane_operator_reconcile_errors_total",
                "Reconcile errors by controller and kind.",
            ),
            &["controller", "error"],
        )
        .expect("valid metric");
        let placements = IntCounterVec::new(
            Opts::new(
                "shardplane_operator_placements_total",
                "Placement decisions by outcome.",
            ),
            &["outcome"],
        )
        .expect("valid metric");
        let instances = prometheus::IntGaugeVec::new(
            Opts::new(
                "shardplane_operator_instances",
                "Instances of all deployments by phase.",
            ),
            &["phase"],
        )
        .expect("valid metric");
        let leader =
            prometheus::IntGauge::new("shardplane_operator_leader", "1 while this replica leads.")
                .expect("valid metric");
        let admission_reviews = IntCounterVec::new(
            Opts::new(
                "shardplane_operator_admission_reviews_total",
                "Admission reviews the webhook answered, by what was reviewed (kind: leases or the shardplane resource) and outcome (allowed, forbidden, invalid, conflict).",
            ),
            &["kind", "outcome"],
        )
        .expect("valid metric");
        let admission_review_duration = HistogramVec::new(
            HistogramOpts::new(
                "shardplane_operator_admission_review_duration_seconds",
                "Time the admission webhook takes to answer a review, from its body read to its answer (a served name's check reads the API server), by what was reviewed.",
            )
            .buckets(vec![0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.5, 1.0]),
            &["kind"],
        )
        .expect("valid metric");
        let certificates = IntCounterVec::new(
            Opts::new(
                "shardplane_operator_data_plane_certificates_total",
                "Data-plane certificate requests (CertificateSigningRequests for shardplane.dev/data-plane) answered, by outcome (issued, denied, failed).",
            ),
            &["outcome"],
        )
        .expect("valid metric");
        let described = shardplane_admin::register(
            &registry,
            vec![
                Box::new(reconciles.clone()) as Box<dyn prometheus::core::Collector>,
                Box::new(reconcile_duration.clone()),
                Box::new(reconcile_errors.clone()),
                Box::new(placements.clone()),
                Box::new(instances.clone()),
                Box::new(leader.clone()),
                Box::new(admission_reviews.clone()),
                Box::new(admission_review_duration.clone()),
                Box::new(certificates.clone()),
            ],
        );
        Metrics {
            registry,
            described,
            reconciles,
            reconcile_duration,
            reconcile_errors,
            placements,
            instances,
            leader,
            admission_reviews,
            admission_review_duration,
            certificates,
        }
    }
}

impl Default for Metrics {
    fn default() -> Self {
        Self::new()
    }
}
