//! Faults between and inside the processes: the cloud killed and restarted, a
//! partition between cloud and edge (a black-holing TCP proxy), an edge that flaps.
//! Every transfer is checksummed.

mod common;

use std::io::Read;
use std::net::{SocketAddr, TcpStream};
use std::time::{Duration, Instant};

use common::probe::{self, FaultProxy, round_trip};
use common::{EdgeOpts, Setup, connect_via, servers};

const TOKENS: &str = "edge-1:token-one\n";

fn allow(target: SocketAddr) -> String {
    format!("[allow]\ntargets = [\"{target}\"]\n")
}

fn metric(admin: SocketAddr, series: &str) -> f64 {
    let out = std::process::Command::new("curl").args(["-s", "--max-time", "2"]).arg(format!("http://{admin}/metrics")).output();
    let text = out.map(|o| String::from_utf8_lossy(&o.stdout).to_string()).unwrap_or_default();
    text.lines().find_map(|l| l.strip_prefix(series).and_then(|v| v.trim().parse().ok())).unwrap_or(-1.0)
}

/// Whether `s` is ended by the far side within `bound`.
fn ends_within(s: &mut TcpStream, bound: Duration) -> bool {
    let started = Instant::now();
    s.set_read_timeout(Some(Duration::from_millis(200))).unwrap();
    let mut buf = [0u8; 4096];
    while started.elapsed() < bound {
        match s.read(&mut buf) {
            Ok(0) => return true,
            Ok(_) => {}
            Err(e) if matches!(e.kind(), std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut) => {}
            Err(_) => return true,
        }
    }
    false
}

#[test]
fn a_killed_cloud_restarted_on_the_same_ports_serves_again_within_3s() {
    let s = Setup::new(TOKENS);
    let sink = servers::sink("127.0.0.1:0");
    let authority = format!("edge-1:{}", sink.port());
    let mut cloud = s.start_cloud("");
    let _edge = s.start_ready_edge(EdgeOpts { extra: allow(sink), ..EdgeOpts::new("edge-1", "token-one") });
    round_trip(s.connect, &authority, 1, 1 << 20).expect("before the kill");
    let mut open = connect_via(s.connect, &authority).expect("open connection");
    cloud.kill9();
    assert!(ends_within(&mut open, Duration::from_secs(2)), "a client connection outlived the cloud");
    // Let the edge go through a backoff step or two before the cloud comes back.
    std::thread::sleep(Duration::from_secs(2));
    let _cloud = s.start_cloud("");
    let restarted = Instant::now();
    let ok = probe::eventually(Duration::from_secs(3), || round_trip(s.connect, &authority, 2, 1 << 20).is_ok());
    let took = restarted.elapsed();
    println!("cloud kill -9 + restart: first checksummed connection {took:?} after the restart");
    assert!(ok, "no working connection within 3 s of the cloud's restart");
}

#[test]
fn a_partition_is_detected_by_heartbeat_ends_connections_and_heals() {
    let mut s = Setup::new(TOKENS);
    let sink = servers::sink("127.0.0.1:0");
    let authority = format!("edge-1:{}", sink.port());
    let cloud = s.start_cloud("");
    let proxy = FaultProxy::start(s.tunnel);
    s.tunnel = proxy.addr; // the edge dials the cloud through the proxy
    let (_edge, edge_admin) = s.start_edge(EdgeOpts { extra: allow(sink), ..EdgeOpts::new("edge-1", "token-one") });
    assert!(common::wait_http_ok(&format!("http://{edge_admin}/readyz"), Duration::from_secs(10)));
    round_trip(s.connect, &authority, 1, 1 << 20).expect("before the partition");
    let mut open: Vec<TcpStream> = (0..3).map(|_| connect_via(s.connect, &authority).expect("open")).collect();

    proxy.partition(true);
    let started = Instant::now();
    // heartbeat_interval 1 s, heartbeat_timeout 3 s (Setup): detected within ~4 s.
    assert!(
        // Logged whichever way the session ends (heartbeat or connection failure).
        probe::eventually(Duration::from_secs(12), || cloud.log_text().contains("edge disconnected")),
        "the cloud never noticed the partition"
    );
    let detected = started.elapsed();
    for (i, c) in open.iter_mut().enumerate() {
        assert!(ends_within(c, Duration::from_secs(5)), "client connection {i} outlived the partition");
    }
    let ended = started.elapsed();
    assert!(detected < Duration::from_secs(10), "detection took {detected:?} (bound: 3 s timeout + 1 s interval, with slack for a loaded box)");

    proxy.partition(false);
    let healed = Instant::now();
    let ok = probe::eventually(Duration::from_secs(20), || round_trip(s.connect, &authority, 3, 1 << 20).is_ok());
    println!(
        "partition: detected after {detected:?}, all client connections ended after {ended:?}, service back {:?} after healing",
        healed.elapsed()
    );
    assert!(ok, "service did not recover after the partition healed");
}

#[test]
fn an_edge_flapping_through_many_reconnects_leaks_nothing_in_the_cloud() {
    let cycles: usize = if std::env::var_os("TUNNEL_SOAK").is_some() { 1000 } else { 100 };
    let mut s = Setup::new(TOKENS);
    let sink = servers::sink("127.0.0.1:0");
    let authority = format!("edge-1:{}", sink.port());
    let cloud = s.start_cloud("");
    let proxy = FaultProxy::start(s.tunnel);
    s.tunnel = proxy.addr;
    let (_edge, edge_admin) = s.start_edge(EdgeOpts { extra: allow(sink), ..EdgeOpts::new("edge-1", "token-one") });
    assert!(common::wait_http_ok(&format!("http://{edge_admin}/readyz"), Duration::from_secs(10)));
    round_trip(s.connect, &authority, 1, 64 * 1024).unwrap();
    let pid = cloud.pid();
    let (fd0, rss0) = (probe::fds(pid), probe::rss_kib(pid));
    let started = Instant::now();
    for i in 0..cycles {
        let before = proxy.accepted.load(std::sync::atomic::Ordering::Relaxed);
        proxy.cut_all();
        assert!(
            probe::eventually(Duration::from_secs(30), || proxy.accepted.load(std::sync::atomic::Ordering::Relaxed) > before
                && common::wait_http_ok(&format!("http://{edge_admin}/readyz"), Duration::from_millis(100))),
            "edge did not come back after cut {i}"
        );
    }
    let secs = started.elapsed().as_secs_f64();
    assert!(probe::eventually(Duration::from_secs(10), || round_trip(s.connect, &authority, 2, 1 << 20).is_ok()));
    assert!(probe::eventually(Duration::from_secs(10), || metric(s.cloud_admin, "tunnel_edges_connected ") == 1.0));
    let settled = probe::eventually(Duration::from_secs(10), || probe::fds(pid) <= fd0 + 2);
    let (fd1, rss1) = (probe::fds(pid), probe::rss_kib(pid));
    println!("flapping edge: {cycles} reconnects in {secs:.1}s; cloud fds {fd0} -> {fd1}, RSS {rss0} -> {rss1} KiB");
    assert!(settled, "cloud fds {fd0} -> {fd1} after {cycles} reconnects");
    assert!(rss1 <= rss0 + rss0 / 10 + 8192, "cloud RSS {rss0} -> {rss1} KiB after {cycles} reconnects");
}
