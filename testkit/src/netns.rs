//! Hosts in network namespaces, joined by a bridge, for tests of what crosses
//! a network: each host has its own address (`10.<a>.<b>.<10+i>`), links can
//! be slowed with `tc netem` and cut by taking a host's veth down. The API
//! server, on the machine's loopback, is reachable from every host through a
//! relay on the bridge address. Everything is removed on drop, and leftovers
//! of test processes that died are removed by the next run (their
//! components die with them). Needs root and
//! iproute2 (`ip`, `tc`).

use std::net::{Ipv4Addr, SocketAddr, TcpListener, TcpStream};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};

use crate::component_log;
use crate::{ChildGuard, control_plane, token_file};

/// One host: a network namespace with one veth on the bridge.
#[derive(Debug, Clone)]
pub struct Host {
    /// The namespace's name.
    pub netns: String,
    /// The host's address on the bridge.
    pub ip: Ipv4Addr,
    /// The bridge side of its veth (down: the host is cut off).
    veth: String,
}

/// A bridge and its hosts.
#[derive(Debug)]
pub struct Network {
    bridge: String,
    gateway_ip: Ipv4Addr,
    /// The hosts, in order.
    pub hosts: Vec<Host>,
    kubeconfig: PathBuf,
    dir: tempfile::TempDir,
}

fn run(program: &str, args: &[&str]) -> Result<String, String> {
    let out = Command::new(program)
        .args(args)
        .output()
        .map_err(|e| format!("cannot run {program}: {e} (install iproute2)"))?;
    if !out.status.success() {
        return Err(format!(
            "{program} {} failed: {}",
            args.join(" "),
            String::from_utf8_lossy(&out.stderr).trim()
        ));
    }
    Ok(String::from_utf8_lossy(&out.stdout).into_owned())
}

fn ip(args: &[&str]) {
    run("ip", args).unwrap_or_else(|e| panic!("{e}"));
}

/// Names carry the owning test process's id (`sp<pid>…`), so a later run can
/// tell leftovers of a dead process from a running one's.
fn owner_alive(name: &str, prefix: &str) -> bool {
    let digits: String = name
        .strip_prefix(prefix)
        .unwrap_or("")
        .chars()
        .take_while(char::is_ascii_digit)
        .collect();
    digits
        .parse::<u32>()
        .is_ok_and(|pid| Path::new(&format!("/proc/{pid}")).exists())
}

fn remove_leftovers() {
    if let Ok(list) = run("ip", &["netns", "list"]) {
        for name in list.lines().filter_map(|l| l.split_whitespace().next()) {
            if name.starts_with("spn") && !owner_alive(name, "spn") {
                let _ = run("ip", &["netns", "del", name]);
            }
        }
    }
    if let Ok(list) = run("ip", &["-o", "link", "show"]) {
        for line in list.lines() {
            let Some(name) = line.split(": ").nth(1) else {
                continue;
            };
            let name = name.split('@').next().unwrap_or(name);
            if (name.starts_with("spb") && !owner_alive(name, "spb"))
                || (name.starts_with("spv") && !owner_alive(name, "spv"))
            {
                let _ = run("ip", &["link", "del", name]);
            }
        }
    }
}

impl Network {
    /// `count` hosts on subnet `10.<net>.0.0/24`; `tag` (one letter) keeps
    /// the networks of one test process apart.
    pub fn new(tag: char, net: u8, count: usize) -> Network {
        assert!(
            run("id", &["-u"]).is_ok_and(|u| u.trim() == "0"),
            "network-namespace tests need root (ip netns, tc)"
        );
        remove_leftovers();
        let pid = std::process::id();
        let bridge = format!("spb{pid}{tag}");
        let gateway_ip = Ipv4Addr::new(10, net, 0, 1);
        let _ = run("ip", &["link", "del", &bridge]);
        ip(&["link", "add", &bridge, "type", "bridge"]);
        // A fixed address: by default a bridge takes the lowest of its ports'
        // addresses, so taking a port down or up would change the machine's
        // MAC on the bridge and strand every host's ARP entry for it.
        let mac = format!(
            "02:5b:{:02x}:{:02x}:{:02x}:01",
            net,
            (pid >> 8) & 0xff,
            pid & 0xff
        );
        ip(&["link", "set", &bridge, "address", &mac]);
        ip(&["addr", "add", &format!("{gateway_ip}/24"), "dev", &bridge]);
        ip(&["link", "set", &bridge, "up"]);
        let mut network = Network {
            bridge,
            gateway_ip,
            hosts: Vec::new(),
            kubeconfig: PathBuf::new(),
            dir: tempfile::tempdir().expect("a scratch directory"),
        };
        for i in 0..count {
            let netns = format!("spn{pid}{tag}{i}");
            let veth = format!("spv{pid}{tag}{i}");
            let ip_addr = Ipv4Addr::new(10, net, 0, 10 + i as u8);
            ip(&["netns", "add", &netns]);
            // Pushed before the namespace is set up, so drop removes it on a
            // failure half way.
            network.hosts.push(Host {
                netns: netns.clone(),
                ip: ip_addr,
                veth: veth.clone(),
            });
            ip(&[
                "link", "add", &veth, "type", "veth", "peer", "name", "eth0", "netns", &netns,
            ]);
            ip(&["link", "set", &veth, "master", &network.bridge]);
            ip(&["link", "set", &veth, "up"]);
            let inside = |args: &[&str]| {
                let mut all = vec!["netns", "exec", &netns, "ip"];
                all.extend(args);
                ip(&all);
            };
            inside(&["addr", "add", &format!("{ip_addr}/24"), "dev", "eth0"]);
            inside(&["link", "set", "eth0", "up"]);
            inside(&["link", "set", "lo", "up"]);
            inside(&["route", "add", "default", "via", &gateway_ip.to_string()]);
        }
        network.kubeconfig = network.relay_api_server();
        network
    }

    /// Relays the bridge address to the API server on loopback, and writes
    /// a kubeconfig that goes through it.
    fn relay_api_server(&self) -> PathBuf {
        let admin = control_plane().kubeconfig();
        let text = std::fs::read_to_string(admin).expect("the test kubeconfig");
        let server = text
            .lines()
            .find_map(|l| l.trim().strip_prefix("server: https://"))
            .expect("a server in the test kubeconfig")
            .to_string();
        let target: SocketAddr = server.parse().expect("host:port");
        let listener = TcpListener::bind((self.gateway_ip, 0)).expect("a relay port");
        let relay = listener.local_addr().expect("relay address");
        std::thread::spawn(move || {
            for inbound in listener.incoming().map_while(Result::ok) {
                std::thread::spawn(move || {
                    let Ok(outbound) = TcpStream::connect(target) else {
                        return;
                    };
                    let (mut a, mut b) = (inbound, outbound);
                    let (Ok(mut a2), Ok(mut b2)) = (a.try_clone(), b.try_clone()) else {
                        return;
                    };
                    let up = std::thread::spawn(move || {
                        let _ = std::io::copy(&mut a2, &mut b2);
                        let _ = b2.shutdown(std::net::Shutdown::Write);
                    });
                    let _ = std::io::copy(&mut b, &mut a);
                    let _ = a.shutdown(std::net::Shutdown::Write);
                    let _ = up.join();
                });
            }
        });
        let path = self.dir.path().join("kubeconfig");
        std::fs::write(&path, text.replace(&server, &relay.to_string()))
            .expect("a relayed kubeconfig");
        path
    }

    /// Starts the `shardplane` binary at `bin` with `args` inside host `i`
    /// (API server through the relay, the test data-plane token).
    pub fn spawn(&self, i: usize, bin: &str, args: &[&str]) -> ChildGuard {
        let child = Command::new("ip")
            .args(["netns", "exec", &self.hosts[i].netns, "setpriv"])
            .args(crate::PARENT_DEATH)
            .arg(bin)
            .args(args)
            .arg("--kubeconfig")
            .arg(&self.kubeconfig)
            .env("RUST_LOG", component_log())
            // Several components share the machine's cores: one compute thread each.
            .env("RAYON_NUM_THREADS", "1")
            .env("SHARDPLANE_DATA_PLANE_TOKEN_FILE", token_file())
            // Admin credentials get no data-plane certificate (see `spawn_component_with`).
            .env("SHARDPLANE_DATA_PLANE_TLS", "off")
            .stdout(Stdio::null())
            .spawn()
            .unwrap_or_else(|e| panic!("cannot start {bin} in {}: {e}", self.hosts[i].netns));
        ChildGuard(child)
    }

    /// Makes the link between hosts `a` and `b` slow, both ways: `tc netem`
    /// delays every packet by 25 ms; on a kernel without netem (some VMs),
    /// `tc htb` shapes the link to 1 Mbit/s instead, which raises its
    /// measured round trip about as much and its bandwidth to 1 Mbit/s.
    /// Returns which one it used.
    pub fn slow_link(&self, a: usize, b: usize) -> &'static str {
        let netem = self.shape(a, b, true).is_ok();
        if !netem {
            self.shape(a, b, false).unwrap_or_else(|e| panic!("{e}"));
        }
        self.shape(b, a, netem).unwrap_or_else(|e| panic!("{e}"));
        if netem {
            "netem delay 25ms"
        } else {
            "htb rate 1mbit"
        }
    }

    /// Traffic from `from` to `to` goes through a netem or htb class.
    fn shape(&self, from: usize, to: usize, netem: bool) -> Result<(), String> {
        let ns = &self.hosts[from].netns;
        let tc = |args: &[&str]| {
            let mut all = vec!["netns", "exec", ns, "tc"];
            all.extend(args);
            run("ip", &all).map(|_| ())
        };
        let _ = tc(&["qdisc", "del", "dev", "eth0", "root"]);
        let dev = ["dev", "eth0"];
        tc(&[
            &["qdisc", "add"],
            &dev[..],
            &["root", "handle", "1:", "htb", "default", "10"],
        ]
        .concat())?;
        tc(&[
            &["class", "add"],
            &dev[..],
            &["parent", "1:", "classid", "1:10", "htb", "rate", "10gbit"],
        ]
        .concat())?;
        if netem {
            tc(&[
                &["class", "add"],
                &dev[..],
                &["parent", "1:", "classid", "1:20", "htb", "rate", "10gbit"],
            ]
            .concat())?;
            tc(&[
                &["qdisc", "add"],
                &dev[..],
                &["parent", "1:20", "handle", "20:", "netem", "delay", "25ms"],
            ]
            .concat())?;
        } else {
            tc(&[
                &["class", "add"],
                &dev[..],
                &[
                    "parent", "1:", "classid", "1:20", "htb", "rate", "1mbit", "ceil", "1mbit",
                ],
            ]
            .concat())?;
        }
        let dst = format!("{}/32", self.hosts[to].ip);
        tc(&[
            &["filter", "add"],
            &dev[..],
            &[
                "protocol", "ip", "parent", "1:0", "prio", "1", "u32", "match", "ip", "dst", &dst,
                "flowid", "1:20",
            ],
        ]
        .concat())
    }

    /// A second, private network between hosts `a` and `b` only: a veth
    /// pair named `interface` on both sides (a name such as `thunderbolt0`
    /// sets the kind of link agents see), subnet `10.<net>.0.0/24`, each
    /// host at `10.<net>.0.<10+i>`. Neither the machine nor any other host
    /// can reach it. Removed with the hosts' namespaces.
    pub fn private_link(&self, a: usize, b: usize, net: u8, interface: &str) -> [Ipv4Addr; 2] {
        let pid = std::process::id();
        let (ends, addrs) = (
            [format!("spp{pid}{a}{b}a"), format!("spp{pid}{a}{b}b")],
            [
                Ipv4Addr::new(10, net, 0, 10 + a as u8),
                Ipv4Addr::new(10, net, 0, 10 + b as u8),
            ],
        );
        let namespaces = [&self.hosts[a].netns, &self.hosts[b].netns];
        ip(&[
            "link",
            "add",
            &ends[0],
            "netns",
            namespaces[0],
            "type",
            "veth",
            "peer",
            "name",
            &ends[1],
            "netns",
            namespaces[1],
        ]);
        for i in 0..2 {
            let inside = |args: &[&str]| {
                let mut all = vec!["-n", namespaces[i].as_str()];
                all.extend(args);
                ip(&all);
            };
            inside(&["link", "set", &ends[i], "name", interface]);
            inside(&["addr", "add", &format!("{}/24", addrs[i]), "dev", interface]);
            inside(&["link", "set", interface, "up"]);
        }
        addrs
    }

    /// Runs `ss -Htn state established` in host `i`: its TCP connections,
    /// one per line (local address, then peer address).
    pub fn connections(&self, i: usize) -> String {
        run(
            "ip",
            &[
                "netns",
                "exec",
                &self.hosts[i].netns,
                "ss",
                "-Htn",
                "state",
                "established",
            ],
        )
        .unwrap_or_else(|e| panic!("{e} (install iproute2 for ss)"))
    }

    /// Cuts host `i` off (its veth goes down) or reconnects it.
    pub fn set_connected(&self, i: usize, connected: bool) {
        let state = if connected { "up" } else { "down" };
        ip(&["link", "set", &self.hosts[i].veth, state]);
    }
}

impl Drop for Network {
    fn drop(&mut self) {
        for h in &self.hosts {
            let _ = run("ip", &["netns", "del", &h.netns]);
            let _ = run("ip", &["link", "del", &h.veth]);
        }
        let _ = run("ip", &["link", "del", &self.bridge]);
    }
}
