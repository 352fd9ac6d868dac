//! Links to the other nodes: which of a peer's addresses to use (the fastest
//! link both machines are on), and periodic, bounded measurements of latency
//! and throughput written to the InferenceNode's `status.links`, where the
//! planner reads them.
//!
//! ```text
//!  every --probe-links-every: for each peer with a data plane
//!    route: peer address on the best link kind we share ─► its data-plane port
//!    latency: 9 empty Pings, median round trip
//!    throughput: Pings answered with 64 KiB, then 1 MiB, then PROBE_BYTES,
//!                stopping at the first that takes long enough to time well
//!                (a slow link gets a small probe, so probing never clogs it)
//!    ─► InferenceNode status.links (field manager shardplane-agent-links)
//! ```

use std::net::{IpAddr, SocketAddr};
use std::time::{Duration, Instant};

use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;
use k8s_openapi::jiff::Timestamp;
use kube::runtime::reflector::Store;
use kube::{Api, Client};
use serde_json::json;
use shardplane_crds::{InferenceNode, InferenceNodeStatus, LinkKind, LinkStatus, NodeAddress};
use shardplane_dataplane as dp;

use crate::dataplane::Peers;
use crate::machine::{Machine, link_rank};

/// The field manager of `status.links` (separate from the agent's other
/// status fields, which are applied whole on every report).
pub const LINKS_MANAGER: &str = "shardplane-agent-links";

/// Bytes of the largest throughput probe: enough to fill a fast link's pipe
/// for a moment, small enough to be harmless every half minute.
pub const PROBE_BYTES: u32 = 8 << 20;

/// The throughput probes, smallest first: each is sent only when the one
/// before finished in under [`WELL_TIMED`].
const PROBE_SIZES: [u32; 3] = [64 << 10, 1 << 20, PROBE_BYTES];

/// A probe that takes this long is timed well enough to give the rate.
const WELL_TIMED: Duration = Duration::from_millis(200);

/// Round trips in a latency measurement.
const LATENCY_SAMPLES: usize = 9;

/// A peer's reachable data plane: the endpoint and the link it is on.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Route {
    /// `host:port` to dial.
    pub endpoint: String,
    /// The kind of link the address is on.
    pub kind: LinkKind,
}

fn same_subnet(a: &str, b: &str) -> bool {
    match (a.parse::<IpAddr>(), b.parse::<IpAddr>()) {
        (Ok(IpAddr::V4(a)), Ok(IpAddr::V4(b))) => a.octets()[..3] == b.octets()[..3],
        (Ok(IpAddr::V6(a)), Ok(IpAddr::V6(b))) => a.segments()[..4] == b.segments()[..4],
        _ => false,
    }
}

/// The best way from a machine with addresses `mine` to a peer: the peer's
/// address on the fastest link kind this machine also has, preferring one on
/// a subnet this machine is on; the peer's advertised endpoint otherwise.
/// A peer advertising a loopback endpoint is on this machine.
pub fn route(mine: &[NodeAddress], peer: &InferenceNodeStatus) -> Option<Route> {
    let advertised = peer.data_plane_endpoint.as_deref()?;
    let (host, port) = advertised.rsplit_once(':')?;
    let port = port.parse::<u16>().ok()?;
    let host = host.trim_start_matches('[').trim_end_matches(']');
    if host.parse::<IpAddr>().is_ok_and(|ip| ip.is_loopback()) {
        return Some(Route {
            endpoint: advertised.to_string(),
            kind: LinkKind::Loopback,
        });
    }
    let best = peer
        .addresses
        .iter()
        .filter(|p| p.kind != LinkKind::Loopback)
        .filter_map(|p| {
            // Only kinds this machine has; among them, a shared subnet first.
            let near = mine
                .iter()
                .filter(|m| m.kind == p.kind)
                .map(|m| same_subnet(&m.address, &p.address))
                .max()?;
            Some(((link_rank(p.kind), near), p))
        })
        .max_by_key(|(s, _)| *s)
        .map(|(_, p)| p);
    match best {
        Some(p) => {
            let ip: IpAddr = p.address.parse().ok()?;
            Some(Route {
                endpoint: SocketAddr::new(ip, port).to_string(),
                kind: p.kind,
            })
        }
        None => Some(Route {
            endpoint: advertised.to_string(),
            kind: LinkKind::Other,
        }),
    }
}

/// One link measurement.
#[derive(Debug, Clone, Copy)]
pub struct Measurement {
    /// Median round trip of an empty Ping.
    pub latency: Duration,
    /// Throughput of the largest probe answer sent, in megabits per second.
    /// An answer slower than `BANDWIDTH_TIMEOUT` is cut short and recorded at
    /// the rate that would have taken that long, an upper bound (a link that
    /// slow still gets its latency recorded).
    pub bandwidth_mbps: u32,
}

/// How long the latency Pings may take together.
const LATENCY_TIMEOUT: Duration = Duration::from_secs(5);
/// How long one throughput probe's answer may take.
const BANDWIDTH_TIMEOUT: Duration = Duration::from_secs(8);

/// Measures the link to `client`'s data plane: latency (failing when the
/// peer does not answer in time), then throughput (an upper bound when slow).
pub async fn measure(client: &dp::Client) -> Result<Measurement, tonic::Status> {
    let latency = tokio::time::timeout(LATENCY_TIMEOUT, async {
        let mut rtts = Vec::with_capacity(LATENCY_SAMPLES);
        // The first call also connects; it is not counted.
        client.clone().ping(dp::PingRequest::default()).await?;
        for _ in 0..LATENCY_SAMPLES {
            let t = Instant::now();
            client.clone().ping(dp::PingRequest::default()).await?;
            rtts.push(t.elapsed());
        }
        rtts.sort();
        Ok::<_, tonic::Status>(rtts[rtts.len() / 2])
    })
    .await
    .map_err(|_| tonic::Status::deadline_exceeded("the latency Pings timed out"))??;
    let mut bandwidth_mbps = 0;
    for size in PROBE_SIZES {
        let t = Instant::now();
        let probe = dp::PingRequest {
            payload: Vec::new(),
            reply_bytes: size,
        };
        let took = match tokio::time::timeout(BANDWIDTH_TIMEOUT, client.clone().ping(probe)).await {
            Ok(answer) => {
                answer?;
                t.elapsed()
            }
            // Cut short: the link is no faster than a rate that takes that long.
            Err(_) => BANDWIDTH_TIMEOUT,
        };
        let secs = took.saturating_sub(latency).as_secs_f64().max(1e-6);
        bandwidth_mbps = (size as f64 * 8.0 / secs / 1e6).min(u32::MAX as f64) as u32;
        if took >= WELL_TIMED {
            break;
        }
    }
    Ok(Measurement {
        latency,
        bandwidth_mbps,
    })
}

/// Measures the links to every other node with a data plane, once every
/// `every`, and writes them to `node`'s status.
pub async fn run(
    client: Client,
    node: String,
    nodes: Store<InferenceNode>,
    peers: Peers,
    every: Duration,
    metrics: crate::metrics::Metrics,
) {
    let api: Api<InferenceNode> = Api::all(client);
    loop {
        let mine = Machine::read().addresses;
        let mut links = Vec::new();
        for peer in nodes.state() {
            let name = peer.metadata.name.clone().unwrap_or_default();
            let Some(status) = &peer.status else { continue };
            if name == node || status.draining {
                continue;
            }
            let Some(r) = route(&mine, status) else {
                continue;
            };
            let Ok(c) = peers.client(&r.endpoint) else {
                continue;
            };
            match measure(&c).await {
                Ok(m) => {
                    metrics
                        .link_latency_seconds
                        .with_label_values(&[&name])
                        .set(m.latency.as_secs_f64());
                    metrics
                        .link_bandwidth_bytes
                        .with_label_values(&[&name])
                        .set(m.bandwidth_mbps as f64 * 1e6 / 8.0);
                    links.push(LinkStatus {
                        node: name,
                        address: r.endpoint,
                        kind: r.kind,
                        latency_micros: m.latency.as_micros().clamp(1, u32::MAX as u128) as u32,
                        bandwidth_mbps: Some(m.bandwidth_mbps),
                        rdma: false,
                        measured_at: Time(Timestamp::now()),
                    })
                }
                Err(e) => tracing::debug!(peer = %name, error = %e, "link probe failed"),
            }
        }
        links.sort_by(|a, b| a.node.cmp(&b.node));
        let status = json!({"links": links});
        if let Err(e) = shardplane_cluster::apply_status(&api, &node, LINKS_MANAGER, &status).await
        {
            tracing::warn!(error = %e, "cannot write the measured links");
        }
        tokio::time::sleep(every).await;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn addr(address: &str, kind: LinkKind) -> NodeAddress {
        NodeAddress {
            address: address.into(),
            interface: "x".into(),
            kind,
        }
    }

    #[test]
    fn the_fastest_shared_link_wins() {
        let mine = vec![
            addr("127.0.0.1", LinkKind::Loopback),
            addr("192.168.1.10", LinkKind::Wifi),
            addr("10.0.5.1", LinkKind::Ethernet),
            addr("169.254.7.1", LinkKind::Thunderbolt),
        ];
        let peer = InferenceNodeStatus {
            data_plane_endpoint: Some("192.168.1.20:7070".into()),
            addresses: vec![
                addr("127.0.0.1", LinkKind::Loopback),
                addr("192.168.1.20", LinkKind::Wifi),
                addr("10.0.5.2", LinkKind::Ethernet),
                addr("169.254.9.9", LinkKind::Thunderbolt),
            ],
            ..Default::default()
        };
        assert_eq!(
            route(&mine, &peer),
            Some(Route {
                endpoint: "169.254.9.9:7070".into(),
                kind: LinkKind::Thunderbolt
            })
        );
        // Without Thunderbolt here, Ethernet; a shared subnet beats another.
        let mine = vec![
            addr("10.9.0.1", LinkKind::Ethernet),
            addr("10.0.5.1", LinkKind::Ethernet),
        ];
        let mut peer = peer;
        peer.addresses.push(addr("10.7.0.2", LinkKind::Ethernet));
        assert_eq!(route(&mine, &peer).unwrap().endpoint, "10.0.5.2:7070");
        // Nothing shared: the advertised endpoint.
        assert_eq!(
            route(&[addr("172.16.0.1", LinkKind::Other)], &peer)
                .unwrap()
                .endpoint,
            "192.168.1.20:7070"
        );
        // A loopback endpoint: same machine.
        let local = InferenceNodeStatus {
            data_plane_endpoint: Some("127.0.0.1:4000".into()),
            ..Default::default()
        };
        assert_eq!(route(&mine, &local).unwrap().kind, LinkKind::Loopback);
        assert_eq!(route(&mine, &InferenceNodeStatus::default()), None);
    }
}
