//! Privileged tests of the eBPF redirect (`tunnel::intercept`). Each test attaches to a
//! child cgroup of its own, puts only the client processes it starts in it, and
//! removes it afterwards; edge addresses are in 127.0.0.0/8, and the only other
//! traffic is over a veth pair into a network namespace the test creates.
//!
//! Not root, or a kernel without the features: fails when CI is set, skips loudly
//! otherwise.
//!
//! One test binary (one link) with a module per subject: what is redirected, what is
//! left alone or fails open, and the programs themselves (detached on drop, beside
//! another's).

#[path = "../common/mod.rs"]
mod common;

mod capacity;
mod programs;
mod redirected;
mod untouched;

use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr, SocketAddrV4};
use std::process::Command;
use std::time::Duration;

use common::netns::{EdgeNetns, ip};
use common::privileged::{TestCgroup, cannot_run, cgroup_root, is_root, test_cgroup};
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

/// Why these tests need root, for the loud skip.
const NEEDS: &str = "the eBPF intercept tests";

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
    let cgroup = test_cgroup(NEEDS)?;
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
