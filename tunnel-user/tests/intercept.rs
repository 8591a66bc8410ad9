//! Privileged tests of the eBPF redirect (`tunnel::intercept`). Each test attaches to a
//! child cgroup of its own, puts only the client processes it starts in it, and
//! removes it afterwards; edge addresses are in 127.0.0.0/8, and the only other
//! traffic is over a veth pair into a network namespace the test creates.
//!
//! Not root, or a kernel without the features: fails when CI is set, skips loudly
//! otherwise.

mod common;

use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr, SocketAddrV4};
use std::path::PathBuf;
use std::process::Command;
use std::time::Duration;

use common::netns::{EdgeNetns, ip};
use common::privileged::{TestCgroup, cannot_run, is_root};
use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};
use tokio::net::TcpListener;
use tunnel_user::intercept::{
    InterceptConfig, InterceptError, Interceptor, PROGRAM_NAMES, detect_cgroup_root,
};

const EDGE: Ipv4Addr = Ipv4Addr::new(127, 1, 0, 5);
const EDGE_PORT: u16 = 10250;
/// An IPv6 edge address (ULA) that answers nowhere: no interface has it, and the test
/// that dials it from the host first makes its /64 unreachable ([`Unreachable6`]), so a
/// connect that is not redirected fails at once instead of leaving by a default route.
const EDGE6: Ipv6Addr = Ipv6Addr::new(0xfd00, 0x7e57, 0, 1, 0, 0, 0, 5);
const EDGE6_NET: &str = "fd00:7e57:0:1::/64";
const LIMIT: Duration = Duration::from_secs(10);

/// Connects to argv[1]:argv[2] (an AF_INET6 socket if argv[1] has a colon), prints
/// `getpeername()`, then the line the server sends.
const CLIENT_PY: &str = r#"
import socket, sys
family = socket.AF_INET6 if ":" in sys.argv[1] else socket.AF_INET
s = socket.socket(family, socket.SOCK_STREAM)
s.settimeout(5)
s.connect((sys.argv[1], int(sys.argv[2])))
ip, port = s.getpeername()[:2]
print(f"peer {ip}:{port}")
data = b""
while not data.endswith(b"\n"):
    chunk = s.recv(100)
    if not chunk:
        break
    data += chunk
print("server " + data.decode().strip())
"#;

/// What a listener learnt about one accepted connection, echoed to the client.
async fn serve_one(listener: &TcpListener, interceptor: Option<&Interceptor>) -> String {
    let accepted = tokio::time::timeout(LIMIT, listener.accept()).await;
    let Ok(Ok((mut sock, peer))) = accepted else {
        panic!("no connection reached {:?}", listener.local_addr());
    };
    let answer = match interceptor {
        Some(i) => match i.take_original_dst(peer) {
            Some(orig) => format!("orig {orig}"),
            None => "orig none".to_string(),
        },
        None => "direct".to_string(),
    };
    // The client may already be gone in a failing test; the answer is returned anyway.
    let _ = sock.write_all(format!("{answer}\n").as_bytes()).await;
    answer
}

/// The cgroup v2 root to create test cgroups under, or `None` if this machine cannot
/// run the test (after failing in CI / printing why).
fn privileged_cgroup_root() -> Option<PathBuf> {
    if !is_root() {
        cannot_run("the eBPF intercept tests need root (CAP_BPF, CAP_NET_ADMIN, CAP_SYS_ADMIN)");
        return None;
    }
    match detect_cgroup_root() {
        Ok(r) => Some(r),
        Err(e) => {
            cannot_run(&e.to_string());
            None
        }
    }
}

/// Attaches, or `None` (after failing in CI / printing why) if the kernel cannot.
fn attach(cfg: &InterceptConfig) -> Option<Interceptor> {
    let root = detect_cgroup_root().expect("cgroup root");
    assert_ne!(
        cfg.cgroup.as_deref(),
        Some(root.as_path()),
        "never attach to the root cgroup"
    );
    assert!(
        cfg.cgroup.is_some(),
        "never attach to the (default) root cgroup"
    );
    match Interceptor::attach(cfg) {
        Ok(i) => Some(i),
        Err(
            e @ (InterceptError::NotPrivileged { .. }
            | InterceptError::KernelFeature { .. }
            | InterceptError::KernelTooOld { .. }),
        ) => {
            cannot_run(&e.to_string());
            None
        }
        Err(e) => panic!("attach: {e}"),
    }
}

/// A fresh child cgroup with the programs attached.
fn setup(cfg: impl FnOnce(&TestCgroup) -> InterceptConfig) -> Option<(TestCgroup, Interceptor)> {
    let cgroup = TestCgroup::new(&privileged_cgroup_root()?).expect("create test cgroup");
    let interceptor = attach(&cfg(&cgroup))?;
    Some((cgroup, interceptor))
}

fn config(cgroup: &TestCgroup, redirect_to: SocketAddr, ports: Vec<u16>) -> InterceptConfig {
    let SocketAddr::V4(redirect_to) = redirect_to else {
        panic!("v4 listener")
    };
    InterceptConfig {
        cgroup: Some(cgroup.path.clone()),
        ports,
        ..InterceptConfig::new(redirect_to)
    }
}

async fn python_client(cgroup: &TestCgroup, ip: &str, port: u16) -> String {
    python_client_result(cgroup, ip, port)
        .await
        .expect("python client")
}

async fn python_client_result(cgroup: &TestCgroup, ip: &str, port: u16) -> std::io::Result<String> {
    let port = port.to_string();
    cgroup
        .run(&["python3", "-c", CLIENT_PY, ip, &port], LIMIT)
        .await
}

#[tokio::test]
async fn edge_connect_in_cgroup_is_redirected_and_original_recovered() {
    let redirect = TcpListener::bind("127.0.0.1:0").await.expect("bind");
    let redirect_addr = redirect.local_addr().expect("addr");
    let Some((cgroup, interceptor)) = setup(|cg| config(cg, redirect_addr, vec![EDGE_PORT])) else {
        return;
    };
    interceptor.set_edges(&[EDGE]).expect("set edges");
    let before = interceptor.counters();

    let (client, server) = tokio::join!(
        python_client(&cgroup, "127.1.0.5", EDGE_PORT),
        serve_one(&redirect, Some(&interceptor)),
    );

    assert_eq!(
        server, "orig 127.1.0.5:10250",
        "listener recovers the dialled address"
    );
    assert!(
        client.contains("peer 127.1.0.5:10250"),
        "getpeername shows the dialled address: {client}"
    );
    assert!(
        client.contains("server orig 127.1.0.5:10250"),
        "client reached the listener: {client}"
    );
    let after = interceptor.counters();
    assert_eq!(
        after.redirected,
        before.redirected + 1,
        "{before:?} -> {after:?}"
    );
    assert_eq!(after.errors, before.errors, "{before:?} -> {after:?}");
    // Handed out once.
    assert_eq!(
        interceptor.take_original_dst(SocketAddrV4::new(EDGE, EDGE_PORT)),
        None
    );
}

/// The IPv6 listener, or `None` (after failing in CI / printing why) on a host without
/// IPv6 loopback.
async fn bind_v6_loopback() -> Option<TcpListener> {
    match TcpListener::bind("[::1]:0").await {
        Ok(l) => Some(l),
        Err(e) => {
            cannot_run(&format!("no IPv6 loopback to listen on: {e}"));
            None
        }
    }
}

#[tokio::test]
async fn ipv6_edge_connect_goes_to_the_ipv6_listener_and_original_recovered() {
    let redirect = TcpListener::bind("127.0.0.1:0").await.expect("bind");
    let redirect_addr = redirect.local_addr().expect("addr");
    let Some(redirect6) = bind_v6_loopback().await else {
        return;
    };
    let Some(_unreachable) = Unreachable6::add(EDGE6_NET) else {
        return;
    };
    let SocketAddr::V6(redirect6_addr) = redirect6.local_addr().expect("addr") else {
        panic!("v6 listener")
    };
    let Some((cgroup, interceptor)) = setup(|cg| InterceptConfig {
        redirect6_to: Some(redirect6_addr),
        ..config(cg, redirect_addr, vec![EDGE_PORT])
    }) else {
        return;
    };
    interceptor
        .set_edges(&[IpAddr::V4(EDGE), IpAddr::V6(EDGE6)])
        .expect("set edges");
    let before = interceptor.counters();

    let edge6 = EDGE6.to_string();
    let (client, server) = tokio::join!(
        python_client(&cgroup, &edge6, EDGE_PORT),
        serve_one(&redirect6, Some(&interceptor)),
    );
    assert_eq!(
        server, "orig [fd00:7e57:0:1::5]:10250",
        "the IPv6 listener recovers the dialled address: {client}"
    );
    assert!(
        client.contains("peer fd00:7e57:0:1::5:10250"),
        "getpeername shows the dialled address: {client}"
    );
    assert!(
        client.contains("server orig [fd00:7e57:0:1::5]:10250"),
        "{client}"
    );
    // The IPv4 edge, in the same maps' IPv4 half, still goes to the IPv4 listener.
    let (client, server) = tokio::join!(
        python_client(&cgroup, "127.1.0.5", EDGE_PORT),
        serve_one(&redirect, Some(&interceptor)),
    );
    assert_eq!(server, "orig 127.1.0.5:10250", "{client}");
    let after = interceptor.counters();
    assert_eq!(
        after.redirected,
        before.redirected + 2,
        "{before:?} -> {after:?}"
    );
    assert_eq!(after.errors, before.errors, "{before:?} -> {after:?}");
    assert_eq!(
        interceptor.take_original_dst(SocketAddr::from((EDGE6, EDGE_PORT))),
        None,
        "handed out once"
    );

    // set_edges replaces both halves: without the IPv6 edge the connect goes ahead
    // unchanged, into the unreachable route.
    interceptor.set_edges(&[EDGE]).expect("set edges");
    let failed = python_client_result(&cgroup, &edge6, EDGE_PORT).await;
    assert!(
        failed.is_err(),
        "nothing should answer at [{EDGE6}]: {failed:?}"
    );
    assert_eq!(interceptor.counters().redirected, after.redirected);
}

/// An `unreachable` route for a test prefix in the host's table, removed on drop: a
/// connect there fails at once rather than leaving through a default route. Added with
/// `replace`, so one left by a killed run is taken over instead of failing the test.
struct Unreachable6(&'static str);

impl Unreachable6 {
    fn add(prefix: &'static str) -> Option<Self> {
        match ip(&["-6", "route", "replace", "unreachable", prefix]) {
            Ok(()) => Some(Self(prefix)),
            Err(e) => {
                cannot_run(&format!("cannot make {prefix} unreachable: {e}"));
                None
            }
        }
    }
}

impl Drop for Unreachable6 {
    fn drop(&mut self) {
        let _ = ip(&["-6", "route", "del", "unreachable", self.0]);
    }
}

#[tokio::test]
async fn dual_stack_socket_dialling_v4_mapped_edge_is_redirected() {
    let redirect = TcpListener::bind("127.0.0.1:0").await.expect("bind");
    let redirect_addr = redirect.local_addr().expect("addr");
    let Some((cgroup, interceptor)) = setup(|cg| config(cg, redirect_addr, vec![EDGE_PORT])) else {
        return;
    };
    interceptor.set_edges(&[EDGE]).expect("set edges");

    let (client, server) = tokio::join!(
        python_client(&cgroup, "::ffff:127.1.0.5", EDGE_PORT),
        serve_one(&redirect, Some(&interceptor)),
    );
    assert_eq!(server, "orig 127.1.0.5:10250", "{client}");
    assert!(client.contains("peer ::ffff:127.1.0.5:10250"), "{client}");
    assert_eq!(interceptor.counters().redirected, 1);
}

#[tokio::test]
async fn outside_the_cgroup_and_other_ports_pass_untouched() {
    let redirect = TcpListener::bind("127.0.0.1:0").await.expect("bind");
    let redirect_addr = redirect.local_addr().expect("addr");
    // A real listener on an intercepted edge port: whoever is not redirected lands here.
    let edge_listener = TcpListener::bind((EDGE, 0)).await.expect("bind edge");
    let edge_port = edge_listener.local_addr().expect("addr").port();
    // And one on a port that is not intercepted.
    let other = TcpListener::bind((EDGE, 0)).await.expect("bind other");
    let other_port = other.local_addr().expect("addr").port();
    let Some((cgroup, interceptor)) =
        setup(|cg| config(cg, redirect_addr, vec![EDGE_PORT, edge_port]))
    else {
        return;
    };
    interceptor.set_edges(&[EDGE]).expect("set edges");
    let before = interceptor.counters();

    // This test process is outside the cgroup: it reaches the edge port directly.
    let (conn, server) = tokio::join!(
        tokio::net::TcpStream::connect((EDGE, edge_port)),
        serve_one(&edge_listener, None),
    );
    let mut conn = conn.expect("direct connect from outside the cgroup");
    let mut line = String::new();
    tokio::time::timeout(LIMIT, conn.read_to_string(&mut line))
        .await
        .ok();
    assert_eq!(server, "direct");
    assert_eq!(
        conn.peer_addr().expect("peer"),
        SocketAddr::from((EDGE, edge_port))
    );

    // In the cgroup, a port that is not intercepted goes straight to its listener.
    let (client, server) = tokio::join!(
        python_client(&cgroup, "127.1.0.5", other_port),
        serve_one(&other, None),
    );
    assert_eq!(server, "direct");
    assert!(
        client.contains(&format!("peer 127.1.0.5:{other_port}")),
        "{client}"
    );
    assert!(client.contains("server direct"), "{client}");

    let after = interceptor.counters();
    assert_eq!(
        after.redirected, before.redirected,
        "nothing redirected: {after:?}"
    );
    assert!(
        after.passed > before.passed,
        "the cgroup client's connect passed: {after:?}"
    );
    // The redirect listener saw nothing at all.
    assert!(
        tokio::time::timeout(Duration::from_millis(200), redirect.accept())
            .await
            .is_err(),
        "a connection reached the redirect listener"
    );
}

#[tokio::test]
async fn exempt_cgroup_is_not_redirected_and_stale_edges_go() {
    let redirect = TcpListener::bind("127.0.0.1:0").await.expect("bind");
    let redirect_addr = redirect.local_addr().expect("addr");
    let edge_listener = TcpListener::bind((EDGE, 0)).await.expect("bind edge");
    let edge_port = edge_listener.local_addr().expect("addr").port();
    // The exempt cgroup is a child of the attached one, so the programs do run for its
    // processes (cgroup programs are inherited) and must choose to leave them alone.
    let Some(root) = privileged_cgroup_root() else {
        return;
    };
    let cgroup = TestCgroup::new(&root).expect("test cgroup");
    // Declared after its parent, so it is removed first.
    let exempt = TestCgroup::new(&cgroup.path).expect("exempt cgroup");
    let Some(interceptor) = attach(&InterceptConfig {
        exempt_cgroup: Some(exempt.path.clone()),
        ..config(&cgroup, redirect_addr, vec![edge_port])
    }) else {
        return;
    };
    interceptor.set_edges(&[EDGE]).expect("set edges");

    let (client, server) = tokio::join!(
        python_client(&exempt, "127.1.0.5", edge_port),
        serve_one(&edge_listener, None),
    );
    assert_eq!(server, "direct", "{client}");

    // set_edges replaces the whole set: once the edge is gone, the (non-exempt)
    // cgroup's client goes direct too.
    interceptor
        .set_edges(&[Ipv4Addr::new(127, 1, 0, 6)])
        .expect("replace edges");
    let (client, server) = tokio::join!(
        python_client(&cgroup, "127.1.0.5", edge_port),
        serve_one(&edge_listener, None),
    );
    assert_eq!(server, "direct", "{client}");
    assert_eq!(interceptor.counters().redirected, 0);
}

/// Programs whose owner stopped vouching for them (no `keep_alive` for
/// `fail_open_after`) let connects go where they were dialled; a `keep_alive` brings the
/// redirect back.
#[tokio::test]
async fn the_redirect_fails_open_once_its_owner_stops_keeping_it_alive() {
    const FAIL_OPEN_AFTER: Duration = Duration::from_secs(1);
    let redirect = TcpListener::bind("127.0.0.1:0").await.expect("bind");
    let redirect_addr = redirect.local_addr().expect("addr");
    let edge_listener = TcpListener::bind((EDGE, 0)).await.expect("bind edge");
    let edge_port = edge_listener.local_addr().expect("addr").port();
    let Some((cgroup, interceptor)) = setup(|cg| InterceptConfig {
        fail_open_after: Some(FAIL_OPEN_AFTER),
        ..config(cg, redirect_addr, vec![edge_port])
    }) else {
        return;
    };
    interceptor.set_edges(&[EDGE]).expect("set edges");
    let attached = std::time::Instant::now();
    let (client, server) = tokio::join!(
        python_client(&cgroup, "127.1.0.5", edge_port),
        serve_one(&redirect, Some(&interceptor)),
    );
    assert!(
        attached.elapsed() < FAIL_OPEN_AFTER,
        "the first connect took too long to tell anything"
    );
    assert_eq!(server, format!("orig 127.1.0.5:{edge_port}"), "{client}");

    tokio::time::sleep(FAIL_OPEN_AFTER).await;
    let (client, server) = tokio::join!(
        python_client(&cgroup, "127.1.0.5", edge_port),
        serve_one(&edge_listener, None),
    );
    assert_eq!(server, "direct", "past fail_open_after: {client}");

    interceptor.keep_alive().expect("keep alive");
    let (client, server) = tokio::join!(
        python_client(&cgroup, "127.1.0.5", edge_port),
        serve_one(&redirect, Some(&interceptor)),
    );
    assert_eq!(server, format!("orig 127.1.0.5:{edge_port}"), "{client}");
    assert_eq!(interceptor.counters().redirected, 2);
}

/// A network namespace for the test, or None after saying why there cannot be one.
fn test_netns() -> Option<EdgeNetns> {
    if !is_root() {
        cannot_run("creating a network namespace needs root");
        return None;
    }
    match EdgeNetns::new() {
        Ok(n) => Some(n),
        Err(e) => {
            cannot_run(&format!("cannot create a test network namespace: {e}"));
            None
        }
    }
}

#[tokio::test]
async fn client_in_another_netns_goes_to_pod_redirect() {
    let redirect = TcpListener::bind("127.0.0.1:0").await.expect("bind");
    let redirect_addr = redirect.local_addr().expect("addr");
    let Some(netns) = test_netns() else { return };
    let pod_listener = TcpListener::bind((netns.host_ip, 0))
        .await
        .expect("bind pod listener");
    let SocketAddr::V4(pod_addr) = pod_listener.local_addr().expect("addr") else {
        panic!("v4")
    };
    let Some((cgroup, interceptor)) = setup(|cg| InterceptConfig {
        pod_redirect_to: Some(pod_addr),
        ..config(cg, redirect_addr, vec![EDGE_PORT])
    }) else {
        return;
    };
    interceptor.set_edges(&[EDGE]).expect("set edges");

    // The client joins the cgroup first, then the netns (`ip netns exec` remounts /sys,
    // so cgroup.procs is out of reach from inside).
    let port = EDGE_PORT.to_string();
    let argv = [
        "ip",
        "netns",
        "exec",
        &netns.name,
        "python3",
        "-c",
        CLIENT_PY,
        "127.1.0.5",
        &port,
    ];
    let (client, server) = tokio::join!(
        cgroup.run(&argv, LIMIT),
        serve_one(&pod_listener, Some(&interceptor)),
    );
    let client = client.expect("pod client");
    assert_eq!(server, "orig 127.1.0.5:10250", "{client}");
    assert!(client.contains("peer 127.1.0.5:10250"), "{client}");
    assert!(
        tokio::time::timeout(Duration::from_millis(200), redirect.accept())
            .await
            .is_err(),
        "a pod client must not be sent to the host loopback listener"
    );
    assert_eq!(interceptor.counters().redirected, 1);
}

#[tokio::test]
async fn pod_without_pod_redirect_fails_open_and_counts_an_error() {
    let redirect = TcpListener::bind("127.0.0.1:0").await.expect("bind");
    let redirect_addr = redirect.local_addr().expect("addr");
    let Some(netns) = test_netns() else { return };
    let Some((cgroup, interceptor)) = setup(|cg| config(cg, redirect_addr, vec![EDGE_PORT])) else {
        return;
    };
    interceptor.set_edges(&[EDGE]).expect("set edges");
    // Unchanged, the connect goes to the namespace's own loopback, where nothing listens.
    let probe = r#"
import socket
try:
    socket.create_connection(("127.1.0.5", 10250), timeout=5)
    print("connected")
except ConnectionRefusedError:
    print("refused")
"#;
    let out = cgroup
        .run(
            &["ip", "netns", "exec", &netns.name, "python3", "-c", probe],
            LIMIT,
        )
        .await
        .expect("probe");
    assert_eq!(out.trim(), "refused");
    let c = interceptor.counters();
    assert_eq!((c.redirected, c.errors), (0, 1), "{c:?}");
}

#[tokio::test]
async fn ipv6_edge_without_an_ipv6_redirect_fails_open_and_counts_an_error() {
    let redirect = TcpListener::bind("127.0.0.1:0").await.expect("bind");
    let redirect_addr = redirect.local_addr().expect("addr");
    // The client dials from the test's namespace, whose only IPv6 route is its loopback:
    // the connect that goes ahead unchanged fails there and goes nowhere else.
    let Some(netns) = test_netns() else { return };
    let Some((cgroup, interceptor)) = setup(|cg| config(cg, redirect_addr, vec![EDGE_PORT])) else {
        return;
    };
    interceptor.set_edges(&[EDGE6]).expect("set edges");
    let probe = format!(
        r#"
import socket
try:
    socket.create_connection(("{EDGE6}", {EDGE_PORT}), timeout=5)
    print("connected")
except OSError as e:
    print("failed", e.errno)
"#
    );
    let out = cgroup
        .run(
            &["ip", "netns", "exec", &netns.name, "python3", "-c", &probe],
            LIMIT,
        )
        .await
        .expect("probe");
    assert!(out.starts_with("failed"), "{out}");
    let c = interceptor.counters();
    assert_eq!((c.redirected, c.errors), (0, 1), "{c:?}");
    assert!(
        tokio::time::timeout(Duration::from_millis(200), redirect.accept())
            .await
            .is_err(),
        "an IPv6 connect reached the IPv4 listener"
    );
}

/// Program names attached to a cgroup, as the kernel reports them (bpftool prints at
/// most 15 characters of a name, the kernel's limit).
fn attached_programs(cgroup: &std::path::Path) -> Result<String, String> {
    let out = Command::new("bpftool")
        .args(["cgroup", "show"])
        .arg(cgroup)
        .output()
        .map_err(|e| format!("bpftool (installed by scripts/setup.sh): {e}"))?;
    if !out.status.success() {
        return Err(format!(
            "bpftool cgroup show: {}",
            String::from_utf8_lossy(&out.stderr)
        ));
    }
    Ok(String::from_utf8_lossy(&out.stdout).into_owned())
}

#[tokio::test]
async fn drop_detaches_every_program() {
    let Some((cgroup, interceptor)) =
        setup(|cg| config(cg, SocketAddr::from(([127, 0, 0, 1], 1)), vec![EDGE_PORT]))
    else {
        return;
    };
    let attached = match attached_programs(&cgroup.path) {
        Ok(a) => a,
        Err(e) => {
            cannot_run(&e);
            return;
        }
    };
    for name in PROGRAM_NAMES {
        assert!(attached.contains(name), "{name} attached: {attached}");
    }
    drop(interceptor);
    let attached = attached_programs(&cgroup.path).expect("bpftool");
    for name in PROGRAM_NAMES {
        assert!(
            !attached.contains(name),
            "{name} still attached after drop: {attached}"
        );
    }
}

/// A neighbour's `connect4` program, as Cilium's socket load balancer attaches one at the
/// same cgroup (`BPF_F_ALLOW_MULTI`, no bpf link): it rewrites connects to one address
/// (a "ClusterIP") to another (a "backend"). Hand-assembled so that nothing of ours is
/// in it; detached when dropped.
struct NeighbourConnect4 {
    prog: std::os::fd::OwnedFd,
    cgroup: std::fs::File,
}

const BPF_PROG_LOAD: libc::c_long = 5;
const BPF_PROG_ATTACH: libc::c_long = 8;
const BPF_PROG_DETACH: libc::c_long = 9;
const BPF_PROG_TYPE_CGROUP_SOCK_ADDR: u32 = 18;
const BPF_CGROUP_INET4_CONNECT: u32 = 10;
const BPF_F_ALLOW_MULTI: u32 = 2;

/// `union bpf_attr`, as bytes: each command fills the fields it uses.
#[repr(C, align(8))]
struct BpfAttr([u8; 128]);

impl BpfAttr {
    fn put_u32(&mut self, at: usize, v: u32) {
        self.0[at..at + 4].copy_from_slice(&v.to_ne_bytes());
    }
    fn put_u64(&mut self, at: usize, v: u64) {
        self.0[at..at + 8].copy_from_slice(&v.to_ne_bytes());
    }
}

fn bpf(cmd: libc::c_long, attr: &mut BpfAttr) -> std::io::Result<i32> {
    // SAFETY: attr is a zero-padded bpf_attr of the size we pass; pointers in it point
    // to buffers alive for the call.
    let rc = unsafe {
        libc::syscall(
            libc::SYS_bpf,
            cmd,
            attr.0.as_mut_ptr(),
            std::mem::size_of::<BpfAttr>(),
        )
    };
    if rc < 0 {
        Err(std::io::Error::last_os_error())
    } else {
        Ok(rc as i32)
    }
}

/// One BPF instruction: opcode, dst/src registers, offset, immediate.
fn insn(code: u8, dst: u8, src: u8, off: i16, imm: i32) -> u64 {
    let regs = (src << 4) | dst;
    u64::from(code)
        | (u64::from(regs) << 8)
        | (u64::from(off as u16) << 16)
        | (u64::from(imm as u32) << 32)
}

impl NeighbourConnect4 {
    fn attach(cgroup: &std::path::Path, from: Ipv4Addr, to: SocketAddrV4) -> std::io::Result<Self> {
        // struct bpf_sock_addr: user_ip4 at 4, user_port at 24, both network order.
        let ip = |a: Ipv4Addr| u32::from_ne_bytes(a.octets()) as i32;
        let port = u32::from(to.port().to_be()) as i32;
        let code: [u64; 8] = [
            insn(0x61, 2, 1, 4, 0),            // w2 = ctx->user_ip4
            insn(0x55, 2, 0, 4, ip(from)),     // if r2 != from goto allow
            insn(0xb4, 3, 0, 0, ip(*to.ip())), // w3 = to.ip
            insn(0x63, 1, 3, 4, 0),            // ctx->user_ip4 = w3
            insn(0xb4, 3, 0, 0, port),         // w3 = to.port
            insn(0x63, 1, 3, 24, 0),           // ctx->user_port = w3
            insn(0xb7, 0, 0, 0, 1),            // allow: r0 = 1
            insn(0x95, 0, 0, 0, 0),            // exit
        ];
        let license = c"GPL";
        let mut attr = BpfAttr([0; 128]);
        attr.put_u32(0, BPF_PROG_TYPE_CGROUP_SOCK_ADDR);
        attr.put_u32(4, code.len() as u32);
        attr.put_u64(8, code.as_ptr() as u64);
        attr.put_u64(16, license.as_ptr() as u64);
        attr.put_u32(68, BPF_CGROUP_INET4_CONNECT); // expected_attach_type
        let fd = bpf(BPF_PROG_LOAD, &mut attr)?;
        // SAFETY: a new fd the kernel just returned, owned from here on.
        let prog = unsafe { <std::os::fd::OwnedFd as std::os::fd::FromRawFd>::from_raw_fd(fd) };
        let cgroup = std::fs::File::open(cgroup)?;
        let mut attr = Self::attach_attr(&cgroup, &prog, BPF_F_ALLOW_MULTI);
        bpf(BPF_PROG_ATTACH, &mut attr)?;
        Ok(Self { prog, cgroup })
    }

    fn attach_attr(cgroup: &std::fs::File, prog: &std::os::fd::OwnedFd, flags: u32) -> BpfAttr {
        use std::os::fd::AsRawFd as _;
        let mut attr = BpfAttr([0; 128]);
        attr.put_u32(0, cgroup.as_raw_fd() as u32);
        attr.put_u32(4, prog.as_raw_fd() as u32);
        attr.put_u32(8, BPF_CGROUP_INET4_CONNECT);
        attr.put_u32(12, flags);
        attr
    }
}

impl Drop for NeighbourConnect4 {
    fn drop(&mut self) {
        let mut attr = Self::attach_attr(&self.cgroup, &self.prog, 0);
        if let Err(e) = bpf(BPF_PROG_DETACH, &mut attr) {
            eprintln!("detaching the neighbour connect4 program: {e}");
        }
    }
}

/// Another `connect4` program multi-attached at the same cgroup (as Cilium's socket load
/// balancer is) keeps working for its own destination, and ours for edge destinations,
/// whichever attached first.
#[tokio::test]
async fn a_neighbour_connect4_program_and_ours_both_work_side_by_side() {
    const CLUSTER_IP: Ipv4Addr = Ipv4Addr::new(127, 2, 0, 9);
    let redirect = TcpListener::bind("127.0.0.1:0").await.expect("bind");
    let backend = TcpListener::bind("127.0.0.1:0").await.expect("bind");
    let SocketAddr::V4(backend_addr) = backend.local_addr().expect("addr") else {
        panic!("v4 backend")
    };
    let redirect_addr = redirect.local_addr().expect("addr");
    let Some(root) = privileged_cgroup_root() else {
        return;
    };
    let cgroup = TestCgroup::new(&root).expect("create test cgroup");
    // The neighbour first (as on a node where Cilium runs before us), then ours.
    let neighbour = match NeighbourConnect4::attach(&cgroup.path, CLUSTER_IP, backend_addr) {
        Ok(n) => n,
        Err(e) => panic!("loading/attaching the neighbour connect4 program: {e}"),
    };
    let Some(interceptor) = attach(&config(&cgroup, redirect_addr, vec![EDGE_PORT])) else {
        return;
    };
    interceptor.set_edges(&[EDGE]).expect("set edges");
    let attached = attached_programs(&cgroup.path).expect("bpftool");
    assert_eq!(
        attached
            .lines()
            .filter(|l| l.contains("inet4_connect"))
            .count(),
        2,
        "both connect4 programs attached: {attached}"
    );

    let (client, server) = tokio::join!(
        python_client(&cgroup, "127.1.0.5", EDGE_PORT),
        serve_one(&redirect, Some(&interceptor)),
    );
    assert_eq!(
        server, "orig 127.1.0.5:10250",
        "ours redirects edge connects"
    );
    assert!(client.contains("peer 127.1.0.5:10250"), "{client}");
    assert!(client.contains("server orig 127.1.0.5:10250"), "{client}");

    let (client, server) = tokio::join!(
        python_client(&cgroup, "127.2.0.9", 80),
        serve_one(&backend, None),
    );
    assert_eq!(server, "direct", "the neighbour's backend is reached");
    assert!(client.contains("server direct"), "{client}");
    assert_eq!(interceptor.counters().errors, 0);

    // Ours leaving does not take the neighbour's program with it.
    drop(interceptor);
    let attached = attached_programs(&cgroup.path).expect("bpftool");
    assert_eq!(
        attached
            .lines()
            .filter(|l| l.contains("inet4_connect"))
            .count(),
        1,
        "{attached}"
    );
    let (client, _) = tokio::join!(
        python_client(&cgroup, "127.2.0.9", 80),
        serve_one(&backend, None),
    );
    assert!(client.contains("server direct"), "{client}");
    drop(neighbour);
}
