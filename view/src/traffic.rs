//! The gateway's traffic, read from its `/metrics`: requests, generated
//! tokens and time to first token per served name, as rates between two
//! readings.
//!
//! ```text
//!  GET each gateway's /metrics ─► parse (our own metrics only) ─► Sample (summed)
//!  Sample then, Sample now ─► per deployment: requests/s, tokens/s, TTFT p50
//! ```
//!
//! A URL written `dns+http://name:port/metrics` is read at every address the
//! name resolves to (a headless Service: one address per gateway replica),
//! so several replicas add up; a plain URL is read once.

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use serde::Serialize;

use crate::Error;

const REQUESTS: &str = "shardplane_gateway_requests_total";
const TOKENS: &str = "shardplane_gateway_tokens_total";
const IN_FLIGHT: &str = "shardplane_gateway_in_flight_requests";
const TTFT: &str = "shardplane_gateway_time_to_first_token_seconds";

/// How long one gateway may take to answer.
const SCRAPE_TIMEOUT: Duration = Duration::from_secs(3);

/// One served name's counters as the gateways last showed them.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Counters {
    /// Requests.
    pub requests: f64,
    /// Requests answered with a status other than 200.
    pub errors: f64,
    /// Generated tokens.
    pub tokens_out: f64,
    /// Requests being answered.
    pub in_flight: f64,
    /// First tokens timed.
    pub ttft_count: f64,
    /// Seconds to first token, summed.
    pub ttft_sum: f64,
    /// Cumulative histogram buckets: upper bound, count (`+Inf` last).
    pub ttft_buckets: Vec<(f64, f64)>,
}

impl Counters {
    fn add(&mut self, other: &Counters) {
        self.requests += other.requests;
        self.errors += other.errors;
        self.tokens_out += other.tokens_out;
        self.in_flight += other.in_flight;
        self.ttft_count += other.ttft_count;
        self.ttft_sum += other.ttft_sum;
        for &(le, n) in &other.ttft_buckets {
            match self.ttft_buckets.iter_mut().find(|(l, _)| *l == le) {
                Some((_, count)) => *count += n,
                None => self.ttft_buckets.push((le, n)),
            }
        }
        self.ttft_buckets.sort_by(|a, b| a.0.total_cmp(&b.0));
    }

    /// What happened between `earlier` and `self`; a counter that went
    /// down (a gateway restarted) counts from zero.
    fn since(&self, earlier: &Counters) -> Counters {
        let d = |now: f64, then: f64| if now >= then { now - then } else { now };
        Counters {
            requests: d(self.requests, earlier.requests),
            errors: d(self.errors, earlier.errors),
            tokens_out: d(self.tokens_out, earlier.tokens_out),
            in_flight: self.in_flight,
            ttft_count: d(self.ttft_count, earlier.ttft_count),
            ttft_sum: d(self.ttft_sum, earlier.ttft_sum),
            ttft_buckets: self
                .ttft_buckets
                .iter()
                .map(|&(le, n)| {
                    let then = earlier
                        .ttft_buckets
                        .iter()
                        .find(|(l, _)| *l == le)
                        .map_or(0.0, |b| b.1);
                    (le, d(n, then))
                })
                .collect(),
        }
    }

    /// The `q` quantile of the time to first token, interpolated within
    /// its bucket as Prometheus's `histogram_quantile` does.
    fn ttft_quantile(&self, q: f64) -> Option<f64> {
        let total = self.ttft_buckets.last()?.1;
        if total <= 0.0 {
            return None;
        }
        let rank = q * total;
        let mut below = (0.0, 0.0);
        for &(le, count) in &self.ttft_buckets {
            if count >= rank {
                if le.is_infinite() {
                    return Some(below.0);
                }
                let within = count - below.1;
                let share = if within > 0.0 {
                    (rank - below.1) / within
                } else {
                    1.0
                };
                return Some(below.0 + (le - below.0) * share);
            }
            below = (le, count);
        }
        None
    }
}

/// The gateways' counters at one moment, by served name.
#[derive(Debug, Clone)]
pub struct Sample {
    /// When it was read.
    pub at: Instant,
    /// Counters by served name.
    pub models: BTreeMap<String, Counters>,
}

/// A deployment's traffic as shown: totals since the gateways started and,
/// given an earlier reading, rates over the time between.
#[derive(Debug, Clone, Serialize, PartialEq)]
#[serde(rename_all = "camelCase")]
pub struct Traffic {
    /// Requests since the gateways started.
    pub requests: u64,
    /// Generated tokens since the gateways started.
    pub tokens_out: u64,
    /// Requests being answered now.
    pub in_flight: u64,
    /// Seconds the rates are over; none without an earlier reading.
    pub window_seconds: Option<f64>,
    /// Requests per second in the window.
    pub requests_per_second: Option<f64>,
    /// Requests answered with an error, per second.
    pub errors_per_second: Option<f64>,
    /// Generated tokens per second in the window.
    pub tokens_per_second: Option<f64>,
    /// Median time to first token of the requests in the window, or of all
    /// requests when none came in it (or there is no window).
    pub ttft_p50_seconds: Option<f64>,
    /// Mean time to first token, of the same requests.
    pub ttft_mean_seconds: Option<f64>,
}

/// The traffic of the names in `names` (summed) between `earlier` and
/// `later`; none when the gateways never saw any of them.
pub fn traffic(earlier: Option<&Sample>, later: &Sample, names: &[String]) -> Option<Traffic> {
    let sum = |s: &Sample| {
        let mut all: Option<Counters> = None;
        for c in names.iter().filter_map(|n| s.models.get(n)) {
            all.get_or_insert_with(Counters::default).add(c);
        }
        all
    };
    let now = sum(later)?;
    let window = earlier.and_then(|e| {
        let seconds = later.at.checked_duration_since(e.at)?.as_secs_f64();
        (seconds > 0.0).then(|| (seconds, now.since(&sum(e).unwrap_or_default())))
    });
    let rate = |f: fn(&Counters) -> f64| window.as_ref().map(|(s, c)| f(c) / s);
    // The window's requests when there were any, else every request.
    let timed = match &window {
        Some((_, c)) if c.ttft_count > 0.0 => c,
        _ => &now,
    };
    Some(Traffic {
        requests: now.requests as u64,
        tokens_out: now.tokens_out as u64,
        in_flight: now.in_flight.max(0.0) as u64,
        window_seconds: window.as_ref().map(|(s, _)| *s),
        requests_per_second: rate(|c| c.requests),
        errors_per_second: rate(|c| c.errors),
        tokens_per_second: rate(|c| c.tokens_out),
        ttft_p50_seconds: timed.ttft_quantile(0.5),
        ttft_mean_seconds: (timed.ttft_count > 0.0).then(|| timed.ttft_sum / timed.ttft_count),
    })
}

/// Our metrics in one gateway's exposition text, by the `model` label.
/// Other lines are skipped.
pub fn parse(text: &str) -> BTreeMap<String, Counters> {
    let mut models: BTreeMap<String, Counters> = BTreeMap::new();
    for line in text.lines() {
        let Some((name, labels, value)) = sample_line(line) else {
            continue;
        };
        let label = |key: &str| {
            labels
                .iter()
                .find(|(k, _)| k == key)
                .map(|(_, v)| v.as_str())
        };
        let Some(model) = label("model").filter(|m| !m.is_empty()) else {
            continue;
        };
        let c = models.entry(model.to_string()).or_default();
        match name {
            REQUESTS => {
                c.requests += value;
                if label("status") != Some("200") {
                    c.errors += value;
                }
            }
            TOKENS if label("direction") == Some("out") => c.tokens_out += value,
            IN_FLIGHT => c.in_flight += value,
            _ if name == format!("{TTFT}_count") => c.ttft_count += value,
            _ if name == format!("{TTFT}_sum") => c.ttft_sum += value,
            _ if name == format!("{TTFT}_bucket") => {
                if let Some(le) = label("le").and_then(|l| match l {
                    "+Inf" => Some(f64::INFINITY),
                    l => l.parse().ok(),
                }) {
                    c.add(&Counters {
                        ttft_buckets: vec![(le, value)],
                        ..Counters::default()
                    });
                }
            }
            _ => {}
        }
    }
    models
}

/// A sample's labels: key, value.
type Labels = Vec<(String, String)>;

/// `name{k="v",…} value` → its parts; comments and malformed lines → none.
fn sample_line(line: &str) -> Option<(&str, Labels, f64)> {
    let line = line.trim();
    if line.is_empty() || line.starts_with('#') {
        return None;
    }
    let Some(open) = line.find('{') else {
        let (name, value) = line.split_once(' ')?;
        return Some((
            name,
            Vec::new(),
            value.split_whitespace().next()?.parse().ok()?,
        ));
    };
    let name = &line[..open];
    let bytes = line.as_bytes();
    let mut i = open + 1;
    let mut labels = Vec::new();
    loop {
        while matches!(bytes.get(i)?, b',' | b' ') {
            i += 1;
        }
        if bytes[i] == b'}' {
            i += 1;
            break;
        }
        let eq = i + line[i..].find('=')?;
        let key = line[i..eq].trim().to_string();
        i = eq + 1;
        if *bytes.get(i)? != b'"' {
            return None;
        }
        i += 1;
        let mut value = String::new();
        loop {
            let ch = line[i..].chars().next()?;
            i += ch.len_utf8();
            match ch {
                '\\' => {
                    let escaped = line[i..].chars().next()?;
                    i += escaped.len_utf8();
                    value.push(if escaped == 'n' { '\n' } else { escaped });
                }
                '"' => break,
                c => value.push(c),
            }
        }
        labels.push((key, value));
    }
    let value = line[i..].split_whitespace().next()?.parse().ok()?;
    Some((name, labels, value))
}

/// Reads every gateway's metrics and sums them by served name.
pub async fn scrape(http: &reqwest::Client, urls: &[String]) -> Result<Sample, Error> {
    let mut targets = Vec::new();
    for url in urls {
        targets.extend(expand(url).await?);
    }
    let mut models: BTreeMap<String, Counters> = BTreeMap::new();
    for url in targets {
        let failed = |source| Error::Scrape {
            url: url.to_string(),
            source,
        };
        let response = http
            .get(url.clone())
            .timeout(SCRAPE_TIMEOUT)
            .send()
            .await
            .map_err(failed)?;
        if !response.status().is_success() {
            return Err(Error::ScrapeStatus {
                url: url.to_string(),
                status: response.status().as_u16(),
            });
        }
        let text = response.text().await.map_err(failed)?;
        for (model, c) in parse(&text) {
            models.entry(model).or_default().add(&c);
        }
    }
    Ok(Sample {
        at: Instant::now(),
        models,
    })
}

/// The URLs one configured URL stands for: itself, or for `dns+…` one per
/// address its host resolves to.
async fn expand(url: &str) -> Result<Vec<reqwest::Url>, Error> {
    let bad = || Error::MetricsUrl(url.to_string());
    let (each_address, plain) = match url.strip_prefix("dns+") {
        Some(rest) => (true, rest),
        None => (false, url),
    };
    let parsed = reqwest::Url::parse(plain).map_err(|_| bad())?;
    if !matches!(parsed.scheme(), "http" | "https") {
        return Err(bad());
    }
    let host = parsed.host_str().ok_or_else(bad)?.to_string();
    if !each_address {
        return Ok(vec![parsed]);
    }
    let port = parsed.port_or_known_default().ok_or_else(bad)?;
    let mut addresses: Vec<std::net::IpAddr> = tokio::net::lookup_host((host.as_str(), port))
        .await
        .map_err(|source| Error::Resolve {
            host: host.clone(),
            source,
        })?
        .map(|a| a.ip())
        .collect();
    addresses.sort();
    addresses.dedup();
    addresses
        .into_iter()
        .map(|ip| {
            let mut u = parsed.clone();
            u.set_ip_host(ip).map_err(|_| bad())?;
            Ok(u)
        })
        .collect()
}

/// Refuses what is not an http(s) metrics URL (optionally `dns+`).
pub fn check_url(url: &str) -> Result<(), String> {
    let plain = url.strip_prefix("dns+").unwrap_or(url);
    match reqwest::Url::parse(plain) {
        Ok(u) if matches!(u.scheme(), "http" | "https") && u.host_str().is_some() => Ok(()),
        _ => Err(format!(
            "an http:// URL of a gateway's metrics is wanted (dns+http://… to read every \
             address its host resolves to): {url}"
        )),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const TEXT: &str = r#"# HELP shardplane_gateway_requests_total Requests by model, API and HTTP status.
# TYPE shardplane_gateway_requests_total counter
shardplane_gateway_requests_total{api="openai",model="smollm2",status="200"} 8
shardplane_gateway_requests_total{api="openai",model="smollm2",status="429"} 2
shardplane_gateway_requests_total{api="openai",model="",status="404"} 5
shardplane_gateway_tokens_total{direction="in",model="smollm2"} 400
shardplane_gateway_tokens_total{direction="out",model="smollm2"} 64
shardplane_gateway_in_flight_requests{model="smollm2"} 1
shardplane_gateway_time_to_first_token_seconds_bucket{model="smollm2",le="0.1"} 2
shardplane_gateway_time_to_first_token_seconds_bucket{model="smollm2",le="0.25"} 6
shardplane_gateway_time_to_first_token_seconds_bucket{model="smollm2",le="+Inf"} 8
shardplane_gateway_time_to_first_token_seconds_sum{model="smollm2"} 1.6
shardplane_gateway_time_to_first_token_seconds_count{model="smollm2"} 8
shardplane_gateway_requests_total{api="ollama",model="we\"ird, {name}",status="200"} 1
"#;

    #[test]
    fn our_metrics_are_read_by_model() {
        let m = parse(TEXT);
        let c = &m["smollm2"];
        assert_eq!(
            (c.requests, c.errors, c.tokens_out, c.in_flight),
            (10.0, 2.0, 64.0, 1.0)
        );
        assert_eq!(
            c.ttft_buckets,
            vec![(0.1, 2.0), (0.25, 6.0), (f64::INFINITY, 8.0)]
        );
        assert_eq!(m["we\"ird, {name}"].requests, 1.0);
        assert!(!m.contains_key(""), "unknown models are not a deployment's");
        // The median lies in the second bucket: 2 below, rank 4 of its 4.
        let p50 = c.ttft_quantile(0.5).unwrap();
        assert!((p50 - 0.175).abs() < 1e-9, "{p50}");
        assert_eq!(
            c.ttft_quantile(0.99),
            Some(0.25),
            "+Inf answers the bound below"
        );
    }

    #[test]
    fn rates_come_from_two_readings_and_survive_a_restart() {
        let names = vec!["smollm2".to_string(), "alias".to_string()];
        let at = Instant::now();
        let earlier = Sample {
            at,
            models: parse(TEXT),
        };
        let mut later_models = parse(
            &TEXT
                .replace("} 64", "} 164")
                .replace("\"200\"} 8", "\"200\"} 18"),
        );
        later_models.insert(
            "alias".into(),
            Counters {
                tokens_out: 36.0,
                ..Counters::default()
            },
        );
        let later = Sample {
            at: at + Duration::from_secs(4),
            models: later_models,
        };
        let t = traffic(Some(&earlier), &later, &names).unwrap();
        assert_eq!(t.window_seconds, Some(4.0));
        assert_eq!(
            t.tokens_per_second,
            Some((164.0 + 36.0 - 64.0) / 4.0),
            "both names add up"
        );
        assert_eq!(t.requests_per_second, Some(10.0 / 4.0));
        assert_eq!(t.errors_per_second, Some(0.0));
        assert_eq!((t.requests, t.tokens_out, t.in_flight), (20, 200, 1));
        // No new first tokens in the window: the median of all requests.
        assert!((t.ttft_p50_seconds.unwrap() - 0.175).abs() < 1e-9);
        assert_eq!(t.ttft_mean_seconds, Some(0.2));
        // A restarted gateway's counters start again from zero.
        let restarted = Sample {
            at: at + Duration::from_secs(8),
            models: parse(&TEXT.replace("} 64", "} 8")),
        };
        let t = traffic(Some(&later), &restarted, &names).unwrap();
        assert_eq!(t.tokens_per_second, Some(8.0 / 4.0));
        // One reading: totals, no rates; a name never seen: nothing.
        let once = traffic(None, &earlier, &names).unwrap();
        assert_eq!((once.requests_per_second, once.requests), (None, 10));
        assert_eq!(traffic(None, &earlier, &["other".to_string()]), None);
    }

    #[tokio::test]
    async fn urls_expand_to_every_address_only_when_asked() {
        let one = expand("http://localhost:9/metrics").await.unwrap();
        assert_eq!(one.len(), 1);
        let each = expand("dns+http://localhost:9/metrics").await.unwrap();
        assert!(
            each.iter().all(|u| u.host_str() != Some("localhost")),
            "{each:?}"
        );
        assert!(!each.is_empty());
        assert!(check_url("ftp://x/metrics").is_err());
        assert!(check_url("dns+http://gw-headless:9090/metrics").is_ok());
        assert!(matches!(
            expand("gopher://x").await,
            Err(Error::MetricsUrl(_))
        ));
    }
}
