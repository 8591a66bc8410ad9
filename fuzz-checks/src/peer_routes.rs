//! A replica's route stream (`Peer.Routes`): `RouteUpdate` messages in gRPC frames,
//! applied with `tunnel_user::cloud::peer::apply_update`, and the sender's side,
//! `route_updates`.
//!
//! Properties:
//! - what a peer can make us store is bounded: only valid node names, at most
//!   `MAX_NODES_PER_PEER` of them;
//! - `apply_update` says "changed" whenever the claims changed;
//! - what we send is what the other side ends up with: `route_updates(sent, now)`
//!   applied to `sent` gives `now` (and with reset, from any state), in messages under
//!   the bound the replicas' calls set.

use std::collections::HashMap;

use prost::Message;
use proto::{MAX_MESSAGE_LEN, RouteUpdate};
use tunnel_user::addr::check_node_name;
use tunnel_user::cloud::peer::{MAX_NODES_PER_PEER, apply_update, route_updates};

/// Input: the byte stream of a route subscription.
pub fn check(data: &[u8]) {
    let (bodies, _) = crate::frames::split(data);
    let mut nodes: HashMap<String, u64> = HashMap::new();
    for update in bodies
        .into_iter()
        .map_while(|b| RouteUpdate::decode(b).ok())
    {
        let before = nodes.clone();
        let changed = apply_update(&mut nodes, update);
        if before != nodes {
            assert!(
                changed,
                "the claims changed but apply_update says they did not"
            );
        }
        assert!(nodes.len() <= MAX_NODES_PER_PEER);
        for node in nodes.keys() {
            assert!(
                check_node_name(node).is_ok(),
                "stored an invalid node name {node:?}"
            );
        }
    }

    // What this replica would send about the same claims, and a change of them.
    let mut now = nodes.clone();
    for (i, (node, since)) in nodes.iter().enumerate() {
        match i % 3 {
            0 => drop(now.remove(node)),
            1 => drop(now.insert(node.clone(), since.wrapping_add(1))),
            _ => {}
        }
    }
    now.insert("edge-new-0".into(), 7);
    sync(
        &HashMap::new(),
        &nodes,
        true,
        HashMap::from([("stale-0".to_string(), 1)]),
    );
    sync(&nodes, &now, false, nodes.clone());
    sync(&nodes, &now, true, HashMap::new());
}

/// Sends the updates from `sent` to `now` through frames and applies them to `receiver`.
fn sync(
    sent: &HashMap<String, u64>,
    now: &HashMap<String, u64>,
    reset: bool,
    mut receiver: HashMap<String, u64>,
) {
    for update in route_updates(sent, now, reset) {
        let body = update.encode_to_vec();
        assert!(
            body.len() <= MAX_MESSAGE_LEN,
            "route_updates made a {} byte message",
            body.len()
        );
        let update = RouteUpdate::decode(body.as_slice()).expect("our own updates decode");
        apply_update(&mut receiver, update);
    }
    assert_eq!(
        &receiver, now,
        "the peer did not end up with what was sent (reset: {reset})"
    );
}
