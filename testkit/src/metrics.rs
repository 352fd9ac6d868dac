//! A component's Prometheus metrics, as tests read them.

/// The text exposition served at `http://{admin}/metrics`; empty when the
/// component does not answer.
pub async fn scrape(admin: &str) -> String {
    let out = tokio::process::Command::new("curl")
        .args([
            "-sf",
            "--max-time",
            "10",
            &format!("http://{admin}/metrics"),
        ])
        .output()
        .await
        .expect("curl runs");
    String::from_utf8(out.stdout).expect("metrics are text")
}

/// The sum of the samples whose series starts with `series` (a metric name,
/// or a name and the start of its labels: `name{label="value"`); 0 when none.
pub fn sum(exposition: &str, series: &str) -> f64 {
    exposition
        .lines()
        .filter(|l| l.starts_with(series))
        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .sum()
}
