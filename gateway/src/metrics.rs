//! The gateway's Prometheus metrics.

use std::time::Instant;

use futures::StreamExt;
use prometheus::{
    HistogramOpts, HistogramVec, IntCounterVec, IntGauge, IntGaugeVec, Opts, Registry,
};

use crate::protocol::{Event, Events};

/// Every metric the gateway exposes.
#[derive(Clone)]
pub struct Metrics {
    /// The registry served on `/metrics`.
    pub registry: Registry,
    /// Every metric registered, for documentation and its test.
    pub described: Vec<shardplane_admin::Described>,
    /// Requests by model, API and HTTP status.
    pub requests: IntCounterVec,
    /// Seconds from the request to the first token, by model.
    pub time_to_first_token: HistogramVec,
    /// Seconds between tokens, by model.
    pub inter_token_latency: HistogramVec,
    /// Tokens by model and direction (`in`: prompt, `out`: generated).
    pub tokens: IntCounterVec,
    /// Requests being answered, by model.
    pub in_flight: IntGaugeVec,
    /// Upstream failures by model and kind (`instance`, `external`).
    pub upstream_errors: IntCounterVec,
    /// Answers resumed on another instance after theirs failed mid-answer.
    pub resumed_answers: IntCounterVec,
    /// Pauses of requests waiting because every instance was busy.
    pub busy_waits: IntCounterVec,
    /// Answers a fallback gave (the model's own deployment could not), by
    /// model and fallback (a deployment's name, or `external`).
    pub fallback_answers: IntCounterVec,
    /// Instances ejected (tried last for a while) after failing in a row.
    pub ejections: IntCounterVec,
    /// When the data-plane certificate expires (Unix seconds; 0 without TLS).
    pub certificate_expiry: IntGauge,
}

impl Metrics {
    /// Registers every metric in a new registry.
    pub fn new() -> Self {
        let registry = Registry::new();
        let requests = IntCounterVec::new(
            Opts::new(
                "shardplane_gateway_requests_total",
                "Requests by model, API and HTTP status.",
            ),
            &["model", "api", "status"],
        )
        .expect("valid metric");
        let time_to_first_token = HistogramVec::new(
            HistogramOpts::new(
                "shardplane_gateway_time_to_first_token_seconds",
                "Seconds from a request's arrival to its first token.",
            )
            .buckets(vec![
                0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0,
            ]),
            &["model"],
        )
        .expect("valid metric");
        let inter_token_latency = HistogramVec::new(
            HistogramOpts::new(
                "shardplane_gateway_inter_token_latency_seconds",
                "Seconds between consecutive tokens of an answer.",
            )
            .buckets(vec![
                0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0,
            ]),
            &["model"],
        )
        .expect("valid metric");
        let tokens = IntCounterVec::new(
            Opts::new(
                "shardplane_gateway_tokens_total",
                "Tokens by model and direction (in: prompt, out: generated).",
            ),
            &["model", "direction"],
        )
        .expect("valid metric");
        let in_flight = IntGaugeVec::new(
            Opts::new(
                "shardplane_gateway_in_flight_requests",
                "Requests being answered, by model.",
            ),
            &["model"],
        )
        .expect("valid metric");
        let upstream_errors = IntCounterVec::new(
            Opts::new(
                "shardplane_gateway_upstream_errors_total",
                "Upstream failures by model and kind (instance, external).",
            ),
            &["model", "kind"],
        )
        .expect("valid metric");
        let resumed_answers = IntCounterVec::new(
            Opts::new(
                "shardplane_gateway_resumed_answers_total",
                "Answers resumed on another instance after theirs failed mid-answer, by model.",
            ),
            &["model"],
        )
        .expect("valid metric");
        let fallback_answers = IntCounterVec::new(
            Opts::new(
                "shardplane_gateway_fallback_answers_total",
                "Answers a fallback gave because the model's own deployment could not, by model and fallback (a deployment, or external).",
            ),
            &["model", "fallback"],
        )
        .expect("valid metric");
        let busy_waits = IntCounterVec::new(
            Opts::new(
                "shardplane_gateway_busy_waits_total",
                "Pauses of requests that waited because every instance was busy, by model.",
            ),
            &["model"],
        )
        .expect("valid metric");
        let ejections = IntCounterVec::new(
            Opts::new(
                "shardplane_gateway_ejections_total",
                "Instances tried last for a while after failing before their first token several times in a row, by model.",
            ),
            &["model"],
        )
        .expect("valid metric");
        let certificate_expiry = IntGauge::new(
            "shardplane_gateway_data_plane_certificate_expiry_timestamp_seconds",
            "When the gateway's data-plane certificate expires (Unix seconds); 0 when the data plane runs without TLS.",
        )
        .expect("valid metric");
        let described = shardplane_admin::register(
            &registry,
            vec![
                Box::new(requests.clone()) as Box<dyn prometheus::core::Collector>,
                Box::new(time_to_first_token.clone()),
                Box::new(inter_token_latency.clone()),
                Box::new(tokens.clone()),
                Box::new(in_flight.clone()),
                Box::new(upstream_errors.clone()),
                Box::new(resumed_answers.clone()),
                Box::new(busy_waits.clone()),
                Box::new(fallback_answers.clone()),
                Box::new(ejections.clone()),
                Box::new(certificate_expiry.clone()),
            ],
        );
        Metrics {
            registry,
            described,
            requests,
            time_to_first_token,
            inter_token_latency,
            tokens,
            in_flight,
            upstream_errors,
            resumed_answers,
            busy_waits,
            fallback_answers,
            ejections,
            certificate_expiry,
        }
    }
}

impl Default for Metrics {
    fn default() -> Self {
        Self::new()
    }
}

/// Times a generation for the metrics as its events pass.
pub fn observed(events: Events, model: &str, metrics: &Metrics, start: Instant) -> Events {
    let ttft = metrics.time_to_first_token.with_label_values(&[model]);
    let itl = metrics.inter_token_latency.with_label_values(&[model]);
    let tokens_in = metrics.tokens.with_label_values(&[model, "in"]);
    let tokens_out = metrics.tokens.with_label_values(&[model, "out"]);
    let mut last: Option<Instant> = None;
    Box::pin(events.map(move |e| {
        match &e {
            Ok(Event::Text(_) | Event::Reasoning(_) | Event::ToolCall(_)) => {
                let now = Instant::now();
                match last {
                    None => ttft.observe((now - start).as_secs_f64()),
                    Some(prev) => itl.observe((now - prev).as_secs_f64()),
                }
                last = Some(now);
            }
            Ok(Event::Done {
                prompt_tokens,
                completion_tokens,
                ..
            }) => {
                tokens_in.inc_by(*prompt_tokens as u64);
                tokens_out.inc_by(*completion_tokens as u64);
            }
            Ok(Event::Logprobs(_) | Event::Waiting) | Err(_) => {}
        }
        e
    }))
}
