//! The cluster's network: the masters and the worker on one LAN (a bridge in a network
//! namespace of its own, which the host joins too), each node in a network namespace of
//! its own (two clouds bind the same host-network ports), and in front of the masters
//! the one address the edges dial, as users put a load balancer or a VIP there: a small
//! TCP load balancer of the test's on the host's LAN address, which the edges, each in
//! its own namespace behind NAT, reach over their uplink.

use std::io::{Read, Write};
use std::net::{Ipv4Addr, Shutdown, SocketAddr, TcpListener, TcpStream};
use std::os::fd::AsRawFd;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use crate::common::netns::{EdgeNetns, ip};

/// A LAN: a bridge in a namespace of its own, which nodes join with a veth each. The
/// host joins it as `.1`, the address the load balancer listens on.
pub struct Lan {
    netns: String,
    /// 198.19.<third>.0/24: the benchmarking range, never routed, and an address the API
    /// server accepts in an EndpointSlice (it refuses loopback and link-local ones).
    third: u8,
    host_if: String,
    nodes: Mutex<Vec<String>>,
}

/// A node's network namespace on the [`Lan`].
pub struct LanNode {
    pub netns: String,
    pub ip: Ipv4Addr,
}

impl Lan {
    pub fn new() -> Result<Self, String> {
        let pid = std::process::id();
        let netns = format!("tunnel-lan-{pid}");
        let lan = Self {
            netns: netns.clone(),
            third: 20 + (pid % 60) as u8,
            host_if: format!("tl{pid}h"),
            nodes: Mutex::new(Vec::new()),
        };
        ip(&["netns", "add", &netns])?;
        ip(&["-n", &netns, "link", "add", "br0", "type", "bridge"])?;
        ip(&["-n", &netns, "link", "set", "br0", "up"])?;
        lan.plug(&lan.host_if, None, lan.address(1))?;
        Ok(lan)
    }

    fn address(&self, host: u8) -> Ipv4Addr {
        Ipv4Addr::new(198, 19, self.third, host)
    }

    /// The host's address on the LAN: the load balancer's, the one address of the
    /// masters that the edges dial.
    pub fn host_ip(&self) -> Ipv4Addr {
        self.address(1)
    }

    /// A veth from `netns` (the host's when `None`) to the bridge, named `name` on that
    /// side, with `addr`/24.
    fn plug(&self, name: &str, netns: Option<&str>, addr: Ipv4Addr) -> Result<(), String> {
        let peer = format!("{name}b");
        ip(&["link", "add", name, "type", "veth", "peer", "name", &peer])?;
        ip(&["link", "set", &peer, "netns", &self.netns])?;
        ip(&[
            "-n",
            &self.netns,
            "link",
            "set",
            &peer,
            "master",
            "br0",
            "up",
        ])?;
        let mut on_node: Vec<&str> = Vec::new();
        if let Some(ns) = netns {
            ip(&["link", "set", name, "netns", ns])?;
            on_node = vec!["-n", ns];
        }
        let cidr = format!("{addr}/24");
        for args in [
            &["addr", "add", &cidr, "dev", name][..],
            &["link", "set", name, "up"],
            &["link", "set", "lo", "up"],
        ] {
            if netns.is_none() && args[2] == "lo" {
                continue;
            }
            ip(&[&on_node[..], args].concat())?;
        }
        Ok(())
    }

    /// A node `n` (2..) on the LAN: a network namespace of its own with its address.
    pub fn node(&self, n: u8) -> Result<LanNode, String> {
        let pid = std::process::id();
        let netns = format!("tunnel-node-{pid}-{n}");
        ip(&["netns", "add", &netns])?;
        self.nodes.lock().expect("nodes").push(netns.clone());
        let addr = self.address(n);
        self.plug(&format!("tl{pid}n{n}"), Some(&netns), addr)?;
        Ok(LanNode { netns, ip: addr })
    }

    /// Routes an edge's namespace to the host's LAN address over its uplink: the edge
    /// reaches the load balancer, and nothing else of the LAN.
    pub fn route_edge(&self, edge: &EdgeNetns) -> Result<(), String> {
        ip(&[
            "-n",
            &edge.name,
            "route",
            "add",
            &format!("{}/32", self.host_ip()),
            "via",
            &edge.host_ip.to_string(),
        ])
    }
}

impl Drop for Lan {
    fn drop(&mut self) {
        // Each namespace takes its end of the veth, and the other end, along.
        for ns in self.nodes.lock().expect("nodes").iter() {
            let _ = ip(&["netns", "del", ns]);
        }
        let _ = ip(&["link", "del", &self.host_if]);
        let _ = ip(&["netns", "del", &self.netns]);
    }
}

/// A TCP load balancer: a connection to `listen` goes to the backend carrying the fewest
/// (least connections, as IPVS' `lc`; the first on a tie), or the next if that one does
/// not accept: the two edges' sessions land on the two masters, and move to the one
/// left when a master goes. Stopped when dropped, with every connection it carries shut
/// down.
pub struct LoadBalancer {
    pub listen: SocketAddr,
    stop: Arc<AtomicBool>,
    conns: Arc<Mutex<Vec<TcpStream>>>,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl LoadBalancer {
    pub fn start(listen: SocketAddr, backends: Vec<SocketAddr>) -> Result<Self, String> {
        Self::start_dialling_from(listen, backends, None)
    }

    /// As [`Self::start`], dialling the backends from network namespace `netns`
    /// (`/run/netns/<netns>`): the way in from the host to a pod that only its node
    /// routes to, as a NodePort is, without a route on the host.
    pub fn start_dialling_from(
        listen: SocketAddr,
        backends: Vec<SocketAddr>,
        netns: Option<&str>,
    ) -> Result<Self, String> {
        let netns = netns
            .map(|ns| {
                let path = format!("/run/netns/{ns}");
                std::fs::File::open(&path).map_err(|e| format!("{path}: {e}"))
            })
            .transpose()?;
        let listener = TcpListener::bind(listen).map_err(|e| format!("bind {listen}: {e}"))?;
        // The port the kernel chose when `listen` named none.
        let listen = listener
            .local_addr()
            .map_err(|e| format!("{listen}: {e}"))?;
        listener
            .set_nonblocking(true)
            .map_err(|e| format!("{listen}: {e}"))?;
        let stop = Arc::new(AtomicBool::new(false));
        let conns = Arc::new(Mutex::new(Vec::new()));
        let (stopped, carried) = (stop.clone(), conns.clone());
        // Per backend, the connections carried to it now.
        let open: Arc<Vec<AtomicUsize>> =
            Arc::new(backends.iter().map(|_| AtomicUsize::new(0)).collect());
        let thread = std::thread::spawn(move || {
            if let Some(ns) = netns {
                // SAFETY: setns(2) on an fd we own; it changes only this thread, whose
                // sockets (the backend connections) are then the namespace's.
                let rc = unsafe { libc::setns(ns.as_raw_fd(), libc::CLONE_NEWNET) };
                assert_eq!(rc, 0, "setns: {}", std::io::Error::last_os_error());
            }
            while !stopped.load(Ordering::Relaxed) {
                let client = match listener.accept() {
                    Ok((client, _)) => client,
                    Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {
                        std::thread::sleep(Duration::from_millis(20));
                        continue;
                    }
                    Err(_) => continue,
                };
                let mut order: Vec<usize> = (0..backends.len()).collect();
                order.sort_by_key(|&i| open[i].load(Ordering::Relaxed));
                let picked = order.into_iter().find_map(|i| {
                    let server = TcpStream::connect_timeout(&backends[i], Duration::from_secs(1));
                    server.ok().map(|s| (i, s))
                });
                let Some((backend, server)) = picked else {
                    continue;
                };
                open[backend].fetch_add(1, Ordering::Relaxed);
                let _ = client.set_nonblocking(false);
                let mut carried = carried.lock().expect("connections");
                for (n, (from, to)) in [(&client, &server), (&server, &client)]
                    .into_iter()
                    .enumerate()
                {
                    let (Ok(from), Ok(to)) = (from.try_clone(), to.try_clone()) else {
                        continue;
                    };
                    // The client's side ending ends the connection's count.
                    let counted = (n == 0).then(|| open.clone());
                    std::thread::spawn(move || {
                        copy(from, to);
                        if let Some(open) = counted {
                            open[backend].fetch_sub(1, Ordering::Relaxed);
                        }
                    });
                }
                carried.push(client);
                carried.push(server);
            }
        });
        Ok(Self {
            listen,
            stop,
            conns,
            thread: Some(thread),
        })
    }
}

/// Bytes from `from` to `to` until either ends; then the write side of `to` ends too.
fn copy(mut from: TcpStream, mut to: TcpStream) {
    let mut buf = [0u8; 16384];
    loop {
        match from.read(&mut buf) {
            Ok(0) | Err(_) => break,
            Ok(n) => {
                if to.write_all(&buf[..n]).is_err() {
                    break;
                }
            }
        }
    }
    let _ = to.shutdown(Shutdown::Write);
}

impl Drop for LoadBalancer {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        if let Some(thread) = self.thread.take() {
            let _ = thread.join();
        }
        for c in self.conns.lock().expect("connections").iter() {
            let _ = c.shutdown(Shutdown::Both);
        }
    }
}
