//! What this machine is: its name, chip, cores, memory, accelerator,
//! addresses, and the engine it runs best.
//!
//! ```text
//!  uname nodename ──► node_name_from_host ──► "johns-macbook-pro"
//!  /proc (Linux), sysctl (macOS) ──► Machine { chip, cores, memory, usable memory, addresses }
//! ```
//!
//! Linux reads `/proc`; macOS asks `sysctl`. The macOS paths are written to
//! the same interfaces and their parsing is unit-tested here, but they have
//! not run on a Mac in this repository's tests (these machines are Linux).

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
    /// The most the engines may use in bytes: on macOS the GPU's wired-memory
    /// limit (`iogpu.wired_limit_mb`, or the system's default share of RAM),
    /// elsewhere all of it.
    pub memory_usable: u64,
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
            memory_usable: usable_memory(memory_total),
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

#[cfg(target_os = "macos")]
fn usable_memory(total: u64) -> u64 {
    let limit_mb = sysctl("iogpu.wired_limit_mb").and_then(|s| s.parse().ok());
    gpu_wired_limit(total, limit_mb)
}

#[cfg(not(target_os = "macos"))]
fn usable_memory(total: u64) -> u64 {
    total
}

/// Bytes of memory available now (Linux: `MemAvailable`; macOS: free and
/// inactive pages).
pub fn available_memory() -> u64 {
    memory().1
}

/// What Metal may wire of `total` bytes of unified memory: the
/// `iogpu.wired_limit_mb` setting when one is set (not 0), else macOS's
/// default, about two thirds of RAM up to 36 GiB and three quarters above
/// (what `recommendedMaxWorkingSetSize` reports). Never more than `total`.
pub fn gpu_wired_limit(total: u64, limit_mb: Option<u64>) -> u64 {
    const GIB: u64 = 1 << 30;
    match limit_mb {
        Some(mb) if mb > 0 => (mb << 20).min(total),
        _ if total > 36 * GIB => total / 4 * 3,
        _ => total / 3 * 2,
    }
}

/// This machine's host name as the operating system reports it (`uname`;
/// macOS has no `/etc/hostname`).
pub fn host_name() -> String {
    rustix::system::uname()
        .nodename()
        .to_string_lossy()
        .into_owned()
}

/// The node name a host name gives: its first label, lowercased, with every
/// run of characters a DNS-1123 label does not allow turned into one `-`
/// ("Johns-MacBook-Pro.local" → "johns-macbook-pro", "John's Mac" →
/// "john-s-mac"), at most 63 characters.
pub fn node_name_from_host(host: &str) -> crate::Result<String> {
    let first = host.trim().split('.').next().unwrap_or_default();
    let mut name = String::new();
    for c in first.chars().flat_map(char::to_lowercase) {
        if c.is_ascii_lowercase() || c.is_ascii_digit() {
            name.push(c);
        } else if !name.is_empty() && !name.ends_with('-') {
            name.push('-');
        }
    }
    name.truncate(63);
    let name = name.trim_end_matches('-').to_string();
    if name.is_empty() {
        return Err(crate::Error::NoNodeName {
            host: host.to_string(),
        });
    }
    Ok(name)
}

/// Checks a node name given by hand: a DNS-1123 subdomain (lowercase letters,
/// digits, `-` and `.`, each label starting and ending with a letter or digit,
/// at most 253 characters), as an InferenceNode's and a Lease's name must be.
pub fn check_node_name(name: &str) -> crate::Result<()> {
    let bad = |why: &'static str| {
        Err(crate::Error::InvalidNodeName {
            name: name.to_string(),
            why,
        })
    };
    if name.is_empty() || name.len() > 253 {
        return bad("it must have 1 to 253 characters");
    }
    for label in name.split('.') {
        let alnum =
            |c: Option<char>| c.is_some_and(|c| c.is_ascii_lowercase() || c.is_ascii_digit());
        if label.len() > 63 {
            return bad("each part between dots has at most 63 characters");
        }
        if !label
            .chars()
            .all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == '-')
        {
            return bad("only lowercase letters, digits, '-' and '.' are allowed");
        }
        if !alnum(label.chars().next()) || !alnum(label.chars().last()) {
            return bad("each part between dots starts and ends with a letter or digit");
        }
    }
    Ok(())
}

/// The engine an agent runs when none is named: MLX where it is built in and
/// the machine has Metal (Apple Silicon), else candle.
pub fn default_engine(mlx_built_in: bool, metal: bool) -> &'static str {
    if mlx_built_in && metal {
        "mlx"
    } else {
        "candle"
    }
}

/// Whether this machine has Metal: every Apple Silicon Mac does.
pub fn has_metal() -> bool {
    cfg!(all(target_os = "macos", target_arch = "aarch64"))
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
    fn host_names_become_node_names() {
        let ok = |h: &str| node_name_from_host(h).unwrap();
        assert_eq!(ok("Johns-MacBook-Pro.local"), "johns-macbook-pro");
        assert_eq!(ok("mac-studio"), "mac-studio");
        assert_eq!(ok("John's MacBook Pro"), "john-s-macbook-pro");
        assert_eq!(ok("  Büro_Mac--2 \n"), "b-ro-mac-2");
        assert_eq!(ok("-edge-"), "edge");
        assert_eq!(ok("GPU01.lab.example.com"), "gpu01");
        let long = "a".repeat(70) + "-b";
        assert_eq!(ok(&long), "a".repeat(63));
        let e = node_name_from_host("....").unwrap_err().to_string();
        assert!(e.contains("--node-name"), "{e}");
        assert!(node_name_from_host("日本").is_err());
        for h in ["Johns-MacBook-Pro.local", "John's MacBook Pro", "x_y"] {
            check_node_name(&ok(h)).unwrap();
        }
    }

    #[test]
    fn node_names_given_by_hand_are_checked() {
        for good in ["mac-1", "gpu01.lab", "a", "0"] {
            check_node_name(good).unwrap();
        }
        for (bad, why) in [
            ("Mac-1", "lowercase"),
            ("mac_1", "lowercase"),
            ("-mac", "starts and ends"),
            ("mac.", "starts and ends"),
            ("", "1 to 253"),
        ] {
            let e = check_node_name(bad).unwrap_err().to_string();
            assert!(e.contains(why) && e.contains("--node-name"), "{bad}: {e}");
        }
        assert!(check_node_name(&"a".repeat(64)).is_err());
    }

    #[test]
    fn metal_may_wire_its_limit_or_the_default_share() {
        const GIB: u64 = 1 << 30;
        assert_eq!(gpu_wired_limit(64 * GIB, None), 48 * GIB);
        assert_eq!(gpu_wired_limit(64 * GIB, Some(0)), 48 * GIB);
        assert_eq!(gpu_wired_limit(24 * GIB, None), 16 * GIB);
        assert_eq!(gpu_wired_limit(64 * GIB, Some(57344)), 56 * GIB);
        assert_eq!(gpu_wired_limit(16 * GIB, Some(65536)), 16 * GIB);
    }

    #[test]
    fn mlx_is_the_default_engine_only_with_metal() {
        assert_eq!(default_engine(true, true), "mlx");
        assert_eq!(default_engine(true, false), "candle");
        assert_eq!(default_engine(false, true), "candle");
        assert_eq!(default_engine(false, false), "candle");
    }

    #[test]
    fn this_machine_is_read() {
        let m = Machine::read();
        assert!(
            m.memory_total > 0 && m.memory_available > 0 && m.memory_available <= m.memory_total
        );
        assert!(m.cores >= 1 && !m.chip.is_empty());
        assert!(m.memory_usable > 0 && m.memory_usable <= m.memory_total);
        assert!(node_name_from_host(&host_name()).is_ok());
        assert!(m.addresses.iter().any(|a| a.kind == LinkKind::Loopback));
    }
}
