//! docs/metrics.md lists exactly the metrics the components register, with
//! their types and labels, and every name follows Prometheus conventions.

use shardplane_admin::Described;

fn registered() -> Vec<(&'static str, Described)> {
    let mut all = Vec::new();
    for d in shardplane_operator::metrics::Metrics::new().described {
        all.push(("operator", d));
    }
    for d in shardplane_agent::metrics::Metrics::new().described {
        all.push(("agent", d));
    }
    for d in shardplane_gateway::metrics::Metrics::new().described {
        all.push(("gateway", d));
    }
    all
}

fn table(all: &[(&str, Described)]) -> String {
    let mut out =
        String::from("| metric | component | type | labels | meaning |\n|---|---|---|---|---|\n");
    for (component, d) in all {
        let labels = if d.labels.is_empty() {
            "—".to_string()
        } else {
            d.labels
                .iter()
                .map(|l| format!("`{l}`"))
                .collect::<Vec<_>>()
                .join(", ")
        };
        out.push_str(&format!(
            "| `{}` | {component} | {} | {labels} | {} |\n",
            d.name, d.kind, d.help
        ));
    }
    out
}

#[test]
fn the_metrics_document_lists_what_the_components_register() {
    let all = registered();
    let doc = std::fs::read_to_string(shardplane_testkit::repo_root().join("docs/metrics.md"))
        .expect("docs/metrics.md");
    let expected = table(&all);
    assert!(
        doc.contains(&expected),
        "docs/metrics.md is out of date; its table should read:\n\n{expected}"
    );
}

#[test]
fn metric_names_follow_prometheus_conventions() {
    // Label names that stay bounded: no request ids, users or free text.
    let bounded = [
        "phase",
        "kind",
        "shard",
        // Another Shard's name (a pipeline's later stage): as bounded as `shard`.
        "later_shard",
        "controller",
        "outcome",
        "source",
        "model",
        "api",
        "status",
        "direction",
        "result",
        "error",
        "peer",
        // A deployment's name (one of the model's fallbacks) or `external`.
        "fallback",
    ];
    for (component, d) in registered() {
        let n = &d.name;
        assert!(
            n.starts_with(&format!("shardplane_{component}_")),
            "{n}: prefix"
        );
        match d.kind.as_str() {
            "counter" => assert!(n.ends_with("_total"), "{n}: counters end in _total"),
            _ => assert!(!n.ends_with("_total"), "{n}: only counters end in _total"),
        }
        if d.kind == "histogram" {
            assert!(
                n.ends_with("_seconds"),
                "{n}: histograms here time things, in seconds"
            );
        }
        if n.contains("bytes") {
            assert!(
                n.ends_with("_bytes") || n.ends_with("_bytes_total"),
                "{n}: base unit last"
            );
        }
        assert!(
            !n.contains("millis") && !n.contains("_ms"),
            "{n}: base units only"
        );
        for l in &d.labels {
            assert!(
                bounded.contains(&l.as_str()),
                "{n}: label {l} is not a bounded one"
            );
        }
        assert!(!d.help.is_empty(), "{n}: help");
    }
}
