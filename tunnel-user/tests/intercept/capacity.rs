//! The edge maps' size: a full map redirects what it holds and says how much it left
//! out, follows the table again once it fits, and a fleet's table fits the default.

use std::time::Instant;

use super::*;
use tunnel_user::config::RedirectConfig;

/// Addresses 127.2.0.0 and up, one per node of a fleet of `n`.
fn fleet_addresses(n: u32) -> Vec<Ipv4Addr> {
    (0..n)
        .map(|i| Ipv4Addr::from(u32::from(Ipv4Addr::new(127, 2, 0, 0)) + i))
        .collect()
}

#[tokio::test]
async fn a_full_edge_map_redirects_what_it_holds_says_what_it_left_out_and_follows_again() {
    let redirect = TcpListener::bind("127.0.0.1:0").await.expect("bind");
    let redirect_addr = redirect.local_addr().expect("addr");
    // The sixth address, past the map's four entries: its connects land here.
    let left_out = Ipv4Addr::new(127, 1, 0, 6);
    let direct = TcpListener::bind((left_out, 0)).await.expect("bind edge");
    let port = direct.local_addr().expect("addr").port();
    let Some((cgroup, interceptor)) = setup(|cg| InterceptConfig {
        edge_map_entries: 4,
        ..config(cg, redirect_addr, vec![port])
    }) else {
        return;
    };
    assert_eq!(interceptor.edge_map_capacity(), 4);
    let table: Vec<Ipv4Addr> = (1..=6).map(|i| Ipv4Addr::new(127, 1, 0, i)).collect();
    assert_eq!(
        interceptor
            .set_edges(&table)
            .expect("a full map is no error"),
        2,
        "two addresses left out of a map of four"
    );

    let (client, server) = tokio::join!(
        python_client(&cgroup, "127.1.0.4", port),
        serve_one(&redirect, Some(&interceptor)),
    );
    assert_eq!(server, format!("orig 127.1.0.4:{port}"), "{client}");
    let (client, server) = tokio::join!(
        python_client(&cgroup, "127.1.0.6", port),
        serve_one(&direct, None),
    );
    assert_eq!(
        server, "direct",
        "the address left out is not redirected: {client}"
    );

    // The table shrinks: the map takes the address it could not hold before.
    assert_eq!(interceptor.set_edges(&[left_out]).expect("set edges"), 0);
    let (client, server) = tokio::join!(
        python_client(&cgroup, "127.1.0.6", port),
        serve_one(&redirect, Some(&interceptor)),
    );
    assert_eq!(server, format!("orig 127.1.0.6:{port}"), "{client}");
}

/// The node table's changes applied as differences: a burst of them leaves the maps
/// holding exactly the addresses wanted (each with every port), read back from the
/// kernel; a change that would overflow them writes nothing and says so (a full map is
/// set whole, in the table's order, nodes without a tunnel last), and once full they
/// take no difference either. A connect to an address that came is redirected.
#[tokio::test]
async fn differences_keep_the_edge_map_in_line_and_a_full_one_is_set_whole() {
    let redirect = TcpListener::bind("127.0.0.1:0").await.expect("bind");
    let redirect_addr = redirect.local_addr().expect("addr");
    let ports = vec![EDGE_PORT, EDGE_PORT + 1];
    // Eight entries, two ports: four addresses of each family.
    let Some((cgroup, interceptor)) = setup(|cg| InterceptConfig {
        edge_map_entries: 8,
        ..config(cg, redirect_addr, ports.clone())
    }) else {
        return;
    };
    let pool: Vec<IpAddr> = (1..=6)
        .map(|i| IpAddr::from(Ipv4Addr::new(127, 1, 1, i)))
        .chain((1..=6).map(|i| format!("fd00:7e57::{i}").parse().expect("ip")))
        .collect();
    let targets = |wanted: &std::collections::BTreeSet<IpAddr>| {
        let all = wanted
            .iter()
            .flat_map(|ip| ports.iter().map(|p| SocketAddr::new(*ip, *p)));
        all.collect::<std::collections::BTreeSet<SocketAddr>>()
    };
    let mut wanted = std::collections::BTreeSet::from([pool[0], pool[6]]);
    assert_eq!(
        interceptor
            .set_edges(&wanted.iter().copied().collect::<Vec<_>>())
            .expect("set"),
        0
    );

    // A burst: each step takes one or two out and puts one or two in, never past four a
    // family. A simple generator (no dependency): the same sequence every run.
    let mut seed: u64 = 0x5eed;
    let mut next = |n: usize| {
        seed = seed
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        (seed >> 33) as usize % n
    };
    for step in 0..300 {
        let gone: Vec<IpAddr> = (0..next(3))
            .map(|_| pool[next(pool.len())])
            .filter(|ip| wanted.contains(ip))
            .collect();
        let mut after = wanted.clone();
        for ip in &gone {
            after.remove(ip);
        }
        let mut came = Vec::new();
        for _ in 0..next(3) {
            let ip = pool[next(pool.len())];
            let family = after.iter().filter(|a| a.is_ipv4() == ip.is_ipv4()).count();
            if !after.contains(&ip) && family < 4 {
                after.insert(ip);
                came.push(ip);
            }
        }
        assert!(
            interceptor.change_edges(&gone, &came).expect("change"),
            "step {step}"
        );
        wanted = after;
        assert_eq!(
            interceptor.edge_targets().expect("read back"),
            targets(&wanted),
            "step {step}"
        );
    }

    // Fill the IPv4 map, then one more: refused, nothing written.
    let v4: Vec<IpAddr> = pool[..4].to_vec();
    let gone: Vec<IpAddr> = wanted.iter().filter(|ip| ip.is_ipv4()).copied().collect();
    assert!(interceptor.change_edges(&gone, &v4).expect("change"));
    wanted.retain(|ip| !ip.is_ipv4());
    wanted.extend(v4.iter().copied());
    let held = interceptor.edge_targets().expect("read back");
    assert_eq!(held, targets(&wanted));
    assert!(
        !interceptor.change_edges(&[], &[pool[4]]).expect("change"),
        "a fifth IPv4 address does not fit: the map is set whole instead"
    );
    assert_eq!(
        interceptor.edge_targets().expect("read back"),
        held,
        "nothing written"
    );

    // Set whole with pool[0]'s node without a tunnel: it is the one left out, and a full
    // map takes no difference.
    interceptor.set_no_tunnel(&[pool[0]]).expect("marks");
    let mut all: Vec<IpAddr> = wanted.iter().copied().collect();
    all.push(pool[4]);
    assert_eq!(interceptor.set_edges(&all).expect("set"), 1);
    let held = interceptor.edge_targets().expect("read back");
    assert!(
        !held.contains(&SocketAddr::new(pool[0], EDGE_PORT)),
        "{held:?}"
    );
    assert!(
        held.contains(&SocketAddr::new(pool[4], EDGE_PORT)),
        "{held:?}"
    );
    assert!(!interceptor.change_edges(&[pool[1]], &[]).expect("change"));

    // The kernel uses what the differences wrote.
    interceptor.set_no_tunnel::<IpAddr>(&[]).expect("marks");
    assert_eq!(interceptor.set_edges(&[pool[0]]).expect("set"), 0);
    assert!(
        interceptor
            .change_edges(&[pool[0]], &[pool[5]])
            .expect("change")
    );
    let to = pool[5].to_string();
    let (client, server) = tokio::join!(
        python_client(&cgroup, &to, EDGE_PORT),
        serve_one(&redirect, Some(&interceptor)),
    );
    assert_eq!(server, format!("orig {to}:{EDGE_PORT}"), "{client}");

    // Its outage mark as a difference: the connect fails in connect4 ("host is down"),
    // then is redirected again once the mark is taken off.
    interceptor.change_no_tunnel(&[pool[5]], &[]).expect("mark");
    let refused = format!("{:?}", python_client_result(&cgroup, &to, EDGE_PORT).await);
    assert!(refused.contains("Host is down"), "{refused}");
    interceptor
        .change_no_tunnel(&[], &[pool[5]])
        .expect("unmark");
    let (client, server) = tokio::join!(
        python_client(&cgroup, &to, EDGE_PORT),
        serve_one(&redirect, Some(&interceptor)),
    );
    assert_eq!(server, format!("orig {to}:{EDGE_PORT}"), "{client}");
}

/// The default size holds a fleet of 100,000 edge nodes; prints what one full update
/// and one of 1% churn cost, and the kernel memory the maps take.
#[tokio::test]
async fn the_default_edge_map_holds_a_fleet_of_100000_nodes() {
    let redirect = TcpListener::bind("127.0.0.1:0").await.expect("bind");
    let redirect_addr = redirect.local_addr().expect("addr");
    let entries = RedirectConfig::default().edge_map_entries();
    let Some((cgroup, interceptor)) = setup(|cg| InterceptConfig {
        edge_map_entries: entries,
        ..config(cg, redirect_addr, vec![EDGE_PORT])
    }) else {
        return;
    };
    let fleet = fleet_addresses(100_000);
    let started = Instant::now();
    assert_eq!(interceptor.set_edges(&fleet).expect("set edges"), 0);
    let full = started.elapsed();
    // 1,000 nodes go and 1,000 others come: set whole (as a relist does), then back and
    // again as a difference (as the Node watch's changes are).
    let churned: Vec<Ipv4Addr> = fleet_addresses(101_000)[1_000..].to_vec();
    let started = Instant::now();
    assert_eq!(interceptor.set_edges(&churned).expect("set edges"), 0);
    let churn = started.elapsed();
    let fleet: Vec<IpAddr> = fleet_addresses(101_000)
        .into_iter()
        .map(IpAddr::from)
        .collect();
    let (old, new) = (&fleet[..1_000], &fleet[100_000..]);
    assert!(interceptor.change_edges(new, old).expect("change back"));
    let started = Instant::now();
    assert!(interceptor.change_edges(old, new).expect("change"));
    let difference = started.elapsed();
    // The outage marks with every node of the fleet without a tunnel: set whole again
    // with nothing changed (what every marking cost before it followed differences),
    // then one node's mark as a difference.
    let fleet = &fleet[1_000..];
    interceptor.set_no_tunnel(fleet).expect("marks");
    let started = Instant::now();
    interceptor.set_no_tunnel(fleet).expect("marks");
    let marks_whole = started.elapsed();
    let started = Instant::now();
    interceptor
        .change_no_tunnel(&[], &fleet[..1])
        .expect("mark");
    let mark_one = started.elapsed();
    interceptor.set_no_tunnel::<IpAddr>(&[]).expect("marks");
    println!(
        "edge map of {entries} entries: 100,000 addresses set in {full:?}; 1,000 replaced in \
         {churn:?} set whole, in {difference:?} as a difference; the outage marks of 100,000 \
         set whole in {marks_whole:?}, one changed as a difference in {mark_one:?}"
    );

    let last = churned.last().expect("fleet").to_string();
    let (client, server) = tokio::join!(
        python_client(&cgroup, &last, EDGE_PORT),
        serve_one(&redirect, Some(&interceptor)),
    );
    assert_eq!(server, format!("orig {last}:{EDGE_PORT}"), "{client}");

    let shown = Command::new("bpftool").args(["map", "show"]).output();
    if let Ok(out) = shown {
        let text = String::from_utf8_lossy(&out.stdout);
        let lines: Vec<&str> = text.lines().collect();
        // `ID: hash  name EDGES  flags 0x0`, then `key 8B  value 4B  max_entries N  memlock MB`.
        for pair in lines.windows(2) {
            if pair[0].contains("name EDGES")
                && pair[1].contains(&format!("max_entries {entries} "))
            {
                println!("{}  {}", pair[0].trim(), pair[1].trim());
            }
        }
    }
}
