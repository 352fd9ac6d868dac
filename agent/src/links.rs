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

/// The address peers and gateways reach a data plane bound to `bound` at.
///
/// A specified bound address is itself. An unspecified one (`0.0.0.0`) is
/// the machine's address on the route toward the control plane (`toward`,
/// the source address the kernel picks for the API server), because every
/// component of the cluster reaches the control plane's network: a gateway
/// off a Thunderbolt bridge must not be handed the bridge address. Peers
/// that share a faster link find it themselves ([`route`]). Without such a
/// route (an API server on this machine's loopback), the address of the
/// default route, then the first general-purpose address (Ethernet, Wi-Fi,
/// other, and only then a point-to-point Thunderbolt bridge), then loopback.
pub fn advertised(
    bound: SocketAddr,
    addresses: &[NodeAddress],
    toward: Option<IpAddr>,
    default_route: Option<IpAddr>,
) -> String {
    if !bound.ip().is_unspecified() {
        return bound.to_string();
    }
    let family = |ip: &IpAddr| ip.is_ipv4() == bound.is_ipv4();
    let mine = |ip: &IpAddr| {
        !ip.is_loopback()
            && family(ip)
            && addresses
                .iter()
                .any(|a| a.address.parse::<IpAddr>().is_ok_and(|a| a == *ip))
    };
    let general = |kind: LinkKind| match kind {
        LinkKind::Ethernet => 4,
        LinkKind::Wifi => 3,
        LinkKind::Other => 2,
        LinkKind::Thunderbolt => 1,
        LinkKind::Loopback => 0,
    };
    let ip = toward
        .filter(mine)
        .or(default_route.filter(mine))
        .or_else(|| {
            addresses
                .iter()
                .filter(|a| a.kind != LinkKind::Loopback)
                .filter_map(|a| Some((general(a.kind), a.address.parse::<IpAddr>().ok()?)))
                .filter(|(_, ip)| family(ip))
                // The first of the best kind, in the order the system lists them.
                .fold(None, |best: Option<(u8, IpAddr)>, (rank, ip)| match best {
                    Some((b, _)) if b >= rank => best,
                    _ => Some((rank, ip)),
                })
                .map(|(_, ip)| ip)
        })
        .unwrap_or(if bound.is_ipv4() {
            std::net::Ipv4Addr::LOCALHOST.into()
        } else {
            std::net::Ipv6Addr::LOCALHOST.into()
        });
    SocketAddr::new(ip, bound.port()).to_string()
}

/// The source address this machine's routing table picks to reach
/// `target`, or None when it has no route there. Nothing is sent: a UDP
/// socket's `connect` only looks the route up.
pub fn source_toward(target: SocketAddr) -> Option<IpAddr> {
    let any: SocketAddr = if target.is_ipv4() {
        (std::net::Ipv4Addr::UNSPECIFIED, 0).into()
    } else {
        (std::net::Ipv6Addr::UNSPECIFIED, 0).into()
    };
    let socket = std::net::UdpSocket::bind(any).ok()?;
    socket.connect(target).ok()?;
    Some(socket.local_addr().ok()?.ip()).filter(|ip| !ip.is_unspecified())
}

/// The source address of this machine's default route (looked up toward a
/// documentation address, TEST-NET-1 or 2001:db8::, which no network
/// routes specially), or None without a default route.
pub fn default_route_source(ipv4: bool) -> Option<IpAddr> {
    let target: SocketAddr = if ipv4 {
        (std::net::Ipv4Addr::new(192, 0, 2, 1), 9).into()
    } else {
        (
            "2001:db8::1"
                .parse::<std::net::Ipv6Addr>()
                .expect("an address"),
            9,
        )
            .into()
    };
    source_toward(target)
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

/// Measures the links to every other reachable node with a data plane (not
/// draining, not marked not Ready: a dead node's port may be another
/// program's by now), once every `every`, and writes them to `node`'s status.
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
            if name == node || !status.reachable() {
                continue;
            }
            let Some(r) = route(&mine, status) else {
                continue;
            };
            let Ok(c) = peers.client(&name, &r.endpoint) else {
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
    fn the_advertised_address_is_on_the_route_to_the_control_plane() {
        let mine = vec![
            addr("127.0.0.1", LinkKind::Loopback),
            addr("169.254.7.1", LinkKind::Thunderbolt),
            addr("192.168.1.10", LinkKind::Wifi),
            addr("10.0.5.1", LinkKind::Ethernet),
            addr("10.0.6.1", LinkKind::Ethernet),
        ];
        let any: SocketAddr = "0.0.0.0:7070".parse().unwrap();
        let ip = |s: &str| Some(s.parse::<IpAddr>().unwrap());
        // The route toward the API server decides, even over a faster link.
        assert_eq!(
            advertised(any, &mine, ip("192.168.1.10"), ip("10.0.5.1")),
            "192.168.1.10:7070"
        );
        // An API server on loopback: the default route's address.
        assert_eq!(
            advertised(any, &mine, ip("127.0.0.1"), ip("10.0.6.1")),
            "10.0.6.1:7070"
        );
        // An address that is not this machine's (a NAT'd route) is ignored.
        assert_eq!(
            advertised(any, &mine, ip("172.16.0.9"), None),
            "10.0.5.1:7070"
        );
        // No route at all: Ethernet first, the Thunderbolt bridge last.
        let bridge_and_wifi = &mine[..3];
        assert_eq!(
            advertised(any, bridge_and_wifi, None, None),
            "192.168.1.10:7070"
        );
        assert_eq!(advertised(any, &mine[..2], None, None), "169.254.7.1:7070");
        assert_eq!(advertised(any, &mine[..1], None, None), "127.0.0.1:7070");
        // A specified address is kept; another family's addresses are not used.
        let bound: SocketAddr = "10.0.6.1:9000".parse().unwrap();
        assert_eq!(
            advertised(bound, &mine, ip("10.0.5.1"), None),
            "10.0.6.1:9000"
        );
        let v6: SocketAddr = "[::]:7070".parse().unwrap();
        assert_eq!(advertised(v6, &mine, ip("10.0.5.1"), None), "[::1]:7070");
    }

    #[test]
    fn the_kernel_names_the_source_toward_loopback() {
        let lo = source_toward("127.0.0.1:6443".parse().unwrap());
        assert_eq!(lo, Some(IpAddr::from([127, 0, 0, 1])));
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
