//! A [`Snapshot`] as a person reads it on one screen: a table of nodes
//! (memory as a bar), one of links, and each deployment with its instances'
//! stages (download progress while one downloads). Colours only on a
//! terminal.
//!
//! ```text
//!  NODES      name │ ready │ accel │ engines │ memory [####------] used/allocatable │ cached
//!  LINKS      from │ to │ kind │ latency │ bandwidth
//!  ns/name  model  2/2 ready  (problems…)
//!    traffic 1.5 requests/s, 42.0 tokens/s, TTFT p50 180 ms, 1 in flight
//!    instance 0: node-a[0-15] Ready → node-b[15-30] Downloading 45% (1.2/2.6 GiB)
//! ```

use comfy_table::presets::NOTHING;
use comfy_table::{Cell, Color, Table};

use shardplane_view::snapshot::{Deployment, Snapshot, Stage};
use shardplane_view::traffic::Traffic;

/// Bytes as a person reads them (binary units, one decimal).
pub fn bytes(n: u64) -> String {
    const UNITS: [&str; 5] = ["B", "KiB", "MiB", "GiB", "TiB"];
    let mut value = n as f64;
    let mut unit = 0;
    while value >= 1024.0 && unit + 1 < UNITS.len() {
        value /= 1024.0;
        unit += 1;
    }
    if unit == 0 {
        format!("{n} B")
    } else {
        format!("{value:.1} {}", UNITS[unit])
    }
}

/// `used` out of `of` as a bar of `width` cells.
fn bar(used: u64, of: u64, width: usize) -> String {
    let filled = if of == 0 {
        0
    } else {
        ((used as f64 / of as f64) * width as f64)
            .round()
            .min(width as f64) as usize
    };
    format!("[{}{}]", "#".repeat(filled), "-".repeat(width - filled))
}

fn table(header: &[&str]) -> Table {
    let mut t = Table::new();
    t.load_preset(NOTHING).set_header(header.iter().copied());
    t
}

fn coloured(text: String, colour: Color, on: bool) -> Cell {
    let cell = Cell::new(text);
    if on { cell.fg(colour) } else { cell }
}

fn phase_colour(phase: &str) -> Color {
    match phase {
        "Ready" => Color::Green,
        "Failed" => Color::Red,
        _ => Color::Yellow,
    }
}

/// A stage in a line: where, which layers, its phase, and its download's
/// progress or its failure.
fn stage_line(s: &Stage) -> String {
    let mut line = format!("{}[{}] {}", s.node, s.layers, s.phase);
    if s.phase == "Downloading"
        && let (Some(done), Some(total)) = (s.downloaded_bytes, s.total_bytes)
        && total > 0
    {
        line.push_str(&format!(
            " {}% ({}/{}",
            done * 100 / total,
            bytes(done),
            bytes(total)
        ));
        if let Some(rate) = s.download_rate.filter(|r| *r > 0.0) {
            let left = (total.saturating_sub(done) as f64 / rate).round() as u64;
            line.push_str(&format!(
                ", {}/s, {}m{:02}s left",
                bytes(rate as u64),
                left / 60,
                left % 60
            ));
        }
        line.push(')');
    }
    if s.phase == "Failed"
        && let Some(m) = &s.message
    {
        line.push_str(&format!(" ({}: {m})", s.reason.as_deref().unwrap_or("")));
    }
    if s.restarts > 0 {
        line.push_str(&format!(" restarts {}", s.restarts));
    }
    line
}

/// Rates when there are two readings, else totals; TTFT either way.
fn traffic(t: &Traffic) -> String {
    let mut parts = Vec::new();
    match (t.requests_per_second, t.tokens_per_second) {
        (Some(r), Some(tokens)) => {
            parts.push(format!("{r:.2} requests/s"));
            parts.push(format!("{tokens:.1} tokens/s"));
        }
        _ => parts.push(format!("{} requests, {} tokens", t.requests, t.tokens_out)),
    }
    if let Some(e) = t.errors_per_second.filter(|e| *e > 0.0) {
        parts.push(format!("{e:.2} errors/s"));
    }
    if let Some(p50) = t.ttft_p50_seconds {
        parts.push(format!("TTFT p50 {:.0} ms", p50 * 1000.0));
    }
    parts.push(format!("{} in flight", t.in_flight));
    parts.join(", ")
}

fn deployment(d: &Deployment, colour: bool, out: &mut String) {
    let state = format!("{}/{} ready", d.ready_replicas, d.replicas);
    let state = if colour {
        let c = if d.ready_replicas >= d.replicas && d.replicas > 0 {
            "\x1b[32m"
        } else {
            "\x1b[33m"
        };
        format!("{c}{state}\x1b[0m")
    } else {
        state
    };
    out.push_str(&format!(
        "{}/{}  model {}  {}\n",
        d.namespace, d.name, d.model, state
    ));
    if let Some(e) = &d.endpoint {
        out.push_str(&format!("  endpoint {e}\n"));
    }
    if let Some(t) = &d.traffic {
        out.push_str(&format!("  traffic {}\n", traffic(t)));
    }
    for p in &d.problems {
        out.push_str(&format!("  ! {p}\n"));
    }
    if d.instances.is_empty() {
        out.push_str("  no instances\n");
    }
    for i in &d.instances {
        let stages: Vec<String> = i.stages.iter().map(stage_line).collect();
        out.push_str(&format!(
            "  instance {}: {}\n",
            i.index,
            stages.join(" -> ")
        ));
    }
}

/// The snapshot as text; with `colour`, phases and readiness are coloured.
pub fn render(s: &Snapshot, colour: bool) -> String {
    let mut out = String::new();
    let mut nodes = table(&["NODE", "READY", "ACCEL", "ENGINES", "MEMORY", "CACHED"]);
    for n in &s.nodes {
        let memory = match n.allocatable_bytes {
            Some(a) => format!(
                "{} {}/{}",
                bar(n.used_bytes, a, 10),
                bytes(n.used_bytes),
                bytes(a)
            ),
            None => bytes(n.used_bytes),
        };
        let ready = if n.unschedulable {
            format!("{}, unschedulable", n.ready)
        } else {
            n.ready.clone()
        };
        let ready_colour = if n.ready == "Ready" {
            Color::Green
        } else {
            Color::Red
        };
        let cached: Vec<String> = n
            .cached_models
            .iter()
            .map(|(k, b)| format!("{k} ({})", bytes(*b)))
            .collect();
        nodes.add_row(vec![
            Cell::new(&n.name),
            coloured(ready, ready_colour, colour),
            Cell::new(n.accelerator.as_deref().unwrap_or("-")),
            Cell::new(n.engines.join(",")),
            Cell::new(memory),
            Cell::new(if cached.is_empty() {
                "-".to_string()
            } else {
                cached.join(", ")
            }),
        ]);
    }
    if s.nodes.is_empty() {
        out.push_str("No nodes have registered.\n");
    } else {
        out.push_str(&format!("{nodes}\n"));
    }
    let mut links = table(&["FROM", "TO", "KIND", "LATENCY", "BANDWIDTH"]);
    let mut any = false;
    for n in &s.nodes {
        for l in &n.links {
            any = true;
            links.add_row(vec![
                n.name.clone(),
                l.to.clone(),
                l.kind.clone(),
                format!("{:.2} ms", l.latency_micros as f64 / 1000.0),
                l.bandwidth_mbps
                    .map_or("-".to_string(), |b| format!("{b} Mbit/s")),
            ]);
        }
    }
    if any {
        out.push_str(&format!("\n{links}\n"));
    }
    out.push('\n');
    if s.deployments.is_empty() {
        out.push_str("No deployments.\n");
    }
    for d in &s.deployments {
        let mut text = String::new();
        deployment(d, colour, &mut text);
        if colour {
            for phase in ["Ready", "Failed", "Downloading", "Loading", "Pending"] {
                let code = match phase_colour(phase) {
                    Color::Green => "32",
                    Color::Red => "31",
                    _ => "33",
                };
                text = text.replace(
                    &format!("] {phase}"),
                    &format!("] \x1b[{code}m{phase}\x1b[0m"),
                );
            }
        }
        out.push_str(&text);
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use shardplane_view::snapshot::{Instance, Link, Node};

    fn sample() -> Snapshot {
        let stage = |node: &str, layers: &str, phase: &str| Stage {
            shard: format!("chat-0-{node}"),
            node: node.into(),
            layers: layers.into(),
            phase: phase.into(),
            reason: None,
            message: None,
            downloaded_bytes: None,
            total_bytes: None,
            download_rate: None,
            restarts: 0,
        };
        let mut downloading = stage("mac-b", "15-30", "Downloading");
        downloading.downloaded_bytes = Some(1 << 30);
        downloading.total_bytes = Some(4 << 30);
        Snapshot {
            nodes: vec![
                Node {
                    name: "mac-a".into(),
                    ready: "Ready".into(),
                    unschedulable: false,
                    chip: Some("Apple M2 Ultra".into()),
                    accelerator: Some("Metal".into()),
                    engines: vec!["Mlx".into(), "Candle".into()],
                    used_bytes: 3 << 30,
                    allocatable_bytes: Some(12 << 30),
                    total_bytes: Some(16 << 30),
                    cached_models: vec![("llama-8b".into(), 4 << 30)],
                    links: vec![Link {
                        to: "mac-b".into(),
                        kind: "Thunderbolt".into(),
                        latency_micros: 180,
                        bandwidth_mbps: Some(32_000),
                    }],
                },
                Node {
                    name: "mac-b".into(),
                    ready: "NotReady (LeaseExpired)".into(),
                    unschedulable: false,
                    chip: None,
                    accelerator: None,
                    engines: vec![],
                    used_bytes: 0,
                    allocatable_bytes: None,
                    total_bytes: None,
                    cached_models: vec![],
                    links: vec![],
                },
            ],
            deployments: vec![Deployment {
                namespace: "default".into(),
                name: "chat".into(),
                model: "llama-8b".into(),
                replicas: 1,
                ready_replicas: 0,
                problems: vec!["Ready: Progressing: 1 of 2 stages ready".into()],
                conditions: vec![],
                endpoint: None,
                served_as: vec!["llama-8b".into()],
                instances: vec![Instance {
                    index: 0,
                    stages: vec![stage("mac-a", "0-15", "Ready"), downloading],
                }],
                traffic: Some(Traffic {
                    requests: 12,
                    tokens_out: 900,
                    in_flight: 1,
                    window_seconds: Some(10.0),
                    requests_per_second: Some(1.5),
                    errors_per_second: Some(0.0),
                    tokens_per_second: Some(42.0),
                    ttft_p50_seconds: Some(0.18),
                    ttft_mean_seconds: Some(0.2),
                }),
            }],
        }
    }

    #[test]
    fn a_snapshot_reads_on_one_screen() {
        let text = render(&sample(), false);
        for expected in [
            "mac-a",
            "[###-------] 3.0 GiB/12.0 GiB",
            "llama-8b (4.0 GiB)",
            "NotReady (LeaseExpired)",
            "Thunderbolt",
            "0.18 ms",
            "32000 Mbit/s",
            "default/chat  model llama-8b  0/1 ready",
            "! Ready: Progressing: 1 of 2 stages ready",
            "instance 0: mac-a[0-15] Ready -> mac-b[15-30] Downloading 25% (1.0 GiB/4.0 GiB)",
        ] {
            assert!(text.contains(expected), "{expected:?} not in\n{text}");
        }
        assert!(!text.contains('\x1b'), "no colour off a terminal");
        assert!(
            text.contains("  traffic 1.50 requests/s, 42.0 tokens/s, TTFT p50 180 ms, 1 in flight"),
            "{text}"
        );
        // Two refreshes two seconds apart: the rate and the time left.
        let (mut later, earlier) = (sample(), sample());
        later.deployments[0].instances[0].stages[1].downloaded_bytes = Some(2 << 30);
        later.rates_since(&earlier, 2.0);
        let text = render(&later, false);
        assert!(
            text.contains("Downloading 50% (2.0 GiB/4.0 GiB, 512.0 MiB/s, 0m04s left)"),
            "{text}"
        );
        let coloured = render(&sample(), true);
        assert!(coloured.contains("\x1b[32mReady\x1b[0m"), "{coloured}");
    }

    #[test]
    fn sizes_and_bars_round_sensibly() {
        assert_eq!(bytes(512), "512 B");
        assert_eq!(bytes(1536), "1.5 KiB");
        assert_eq!(bar(0, 10, 4), "[----]");
        assert_eq!(bar(10, 10, 4), "[####]");
        assert_eq!(bar(20, 10, 4), "[####]");
        assert_eq!(bar(1, 0, 4), "[----]");
    }
}
