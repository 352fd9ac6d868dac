//! What this machine is: chip, cores, memory, accelerator, addresses.
//!
//! Linux reads `/proc`; macOS asks `sysctl` (written to the same interface,
//! untested here: these machines are Linux).

use shardplane_crds::{Accelerator, LinkKind, NodeAddress};

/// Facts about the machine, read fresh each time.
#[derive(Debug, Clone, PartialEq)]
pub struct Machine {
    /// Chip or CPU model.
    pub chip: String,
    /// CPU cores.
    pub cores: u32,
    /// Physical memory in bytes.
    pub memory_total: u64,
    /// Memory free right now in bytes.
    pub memory_available: u64,
    /// The accelerator the engines use.
    pub accelerator: Accelerator,
    /// Network addresses, classified.
    pub addresses: Vec<NodeAddress>,
}

impl Machine {
    /// Reads the machine's facts.
    pub fn read() -> Machine {
        let (memory_total, memory_available) = memory();
        Machine {
            chip: chip(),
            cores: std::thread::available_parallelism().map_or(1, |n| n.get() as u32),
            memory_total,
            memory_available,
            accelerator: if cfg!(target_os = "macos") {
                Accelerator::Metal
            } else {
                Accelerator::None
            },
            addresses: addresses(),
        }
    }
}

#[cfg(target_os = "linux")]
fn chip() -> String {
    std::fs::read_to_string("/proc/cpuinfo")
        .ok()
        .and_then(|s| {
            s.lines()
                .find(|l| l.starts_with("model name"))
                .and_then(|l| l.split_once(':'))
                .map(|(_, v)| v.trim().to_string())
        })
        .unwrap_or_else(|| std::env::consts::ARCH.to_string())
}

#[cfg(target_os = "macos")]
fn chip() -> String {
    sysctl("machdep.cpu.brand_string").unwrap_or_else(|| std::env::consts::ARCH.to_string())
}

#[cfg(not(any(target_os = "linux", target_os = "macos")))]
fn chip() -> String {
    std::env::consts::ARCH.to_string()
}

#[cfg(target_os = "macos")]
fn sysctl(name: &str) -> Option<String> {
    let out = std::process::Command::new("sysctl")
        .args(["-n", name])
        .output()
        .ok()?;
    out.status
        .success()
        .then(|| String::from_utf8_lossy(&out.stdout).trim().to_string())
}

/// (total, available) bytes.
#[cfg(target_os = "linux")]
fn memory() -> (u64, u64) {
    let info = std::fs::read_to_string("/proc/meminfo").unwrap_or_default();
    let field = |name: &str| {
        info.lines()
            .find(|l| l.starts_with(name))
            .and_then(|l| l.split_whitespace().nth(1))
            .and_then(|kib| kib.parse::<u64>().ok())
            .map_or(0, |kib| kib * 1024)
    };
    (field("MemTotal:"), field("MemAvailable:"))
}

/// (total, available) bytes. Unified memory: what is not wired or active is
/// counted available, as the Activity Monitor does.
#[cfg(target_os = "macos")]
fn memory() -> (u64, u64) {
    let total = sysctl("hw.memsize")
        .and_then(|s| s.parse().ok())
        .unwrap_or(0);
    let page = sysctl("hw.pagesize")
        .and_then(|s| s.parse::<u64>().ok())
        .unwrap_or(16384);
    let free = sysctl("vm.page_free_count")
        .and_then(|s| s.parse::<u64>().ok())
        .unwrap_or(0);
    let inactive = sysctl("vm.page_inactive_count")
        .and_then(|s| s.parse::<u64>().ok())
        .unwrap_or(0);
    (total, (free + inactive) * page)
}

#[cfg(not(any(target_os = "linux", target_os = "macos")))]
fn memory() -> (u64, u64) {
    (0, 0)
}

/// The kind of link an interface is on, from its name (the operating system's
/// naming conventions: Linux `eth*`/`en*`, `wl*`, `thunderbolt*`; macOS
/// `bridge0` is the Thunderbolt Bridge service, `en0` Wi-Fi or Ethernet).
pub fn link_kind(interface: &str, loopback: bool) -> LinkKind {
    let name = interface.to_ascii_lowercase();
    if loopback || name == "lo" || name.starts_with("lo0") {
        LinkKind::Loopback
    } else if name.starts_with("thunderbolt")
        || (cfg!(target_os = "macos") && name.starts_with("bridge"))
    {
        LinkKind::Thunderbolt
    } else if name.starts_with("wl") || name.starts_with("wifi") {
        LinkKind::Wifi
    } else if name.starts_with("eth") || name.starts_with("en") || name.starts_with("eno") {
        LinkKind::Ethernet
    } else {
        LinkKind::Other
    }
}

/// How fast a kind of link usually is, higher first: Thunderbolt (40–80
/// Gb/s), then Ethernet, then other wired or virtual links, then Wi-Fi.
/// Loopback ranks lowest because it only reaches this machine.
pub fn link_rank(kind: LinkKind) -> u8 {
    match kind {
        LinkKind::Thunderbolt => 4,
        LinkKind::Ethernet => 3,
        LinkKind::Other => 2,
        LinkKind::Wifi => 1,
        LinkKind::Loopback => 0,
    }
}

fn addresses() -> Vec<NodeAddress> {
    let mut out: Vec<NodeAddress> = if_addrs::get_if_addrs()
        .unwrap_or_default()
        .into_iter()
        .filter(
            |i| !matches!(i.ip(), std::net::IpAddr::V6(v6) if v6.segments()[0] & 0xffc0 == 0xfe80),
        )
        .map(|i| NodeAddress {
            address: i.ip().to_string(),
            kind: link_kind(&i.name, i.is_loopback()),
            interface: i.name,
        })
        .collect();
    out.sort_by(|a, b| a.kind.cmp(&b.kind).then_with(|| a.address.cmp(&b.address)));
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn interfaces_are_classified_by_name() {
        assert_eq!(link_kind("lo", true), LinkKind::Loopback);
        assert_eq!(link_kind("eth0", false), LinkKind::Ethernet);
        assert_eq!(link_kind("enp3s0", false), LinkKind::Ethernet);
        assert_eq!(link_kind("wlan0", false), LinkKind::Wifi);
        assert_eq!(link_kind("thunderbolt0", false), LinkKind::Thunderbolt);
        assert_eq!(link_kind("veth12ab", false), LinkKind::Other);
    }

    #[test]
    fn this_machine_is_read() {
        let m = Machine::read();
        assert!(
            m.memory_total > 0 && m.memory_available > 0 && m.memory_available <= m.memory_total
        );
        assert!(m.cores >= 1 && !m.chip.is_empty());
        assert!(m.addresses.iter().any(|a| a.kind == LinkKind::Loopback));
    }
}
