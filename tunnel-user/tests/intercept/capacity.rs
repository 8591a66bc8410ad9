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
    // 1,000 nodes go and 1,000 others come.
    let churned: Vec<Ipv4Addr> = fleet_addresses(101_000)[1_000..].to_vec();
    let started = Instant::now();
    assert_eq!(interceptor.set_edges(&churned).expect("set edges"), 0);
    let churn = started.elapsed();
    println!(
        "edge map of {entries} entries: 100,000 addresses set in {full:?}; 1,000 replaced in {churn:?}"
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
