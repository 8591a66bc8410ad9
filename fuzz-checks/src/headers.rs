//! Protocol messages in HTTP/2 headers: `tunnel_user::transport::decode_header` of a
//! `DialRequest` (`tunnel-dial-bin`, read by the edge and by a replica), a `DialResult`
//! (`tunnel-dial-result-bin`, read by the cloud and by the edge) and a `PeerHello`
//! (`tunnel-peer-bin`, read by both replicas), and what the edge does first with a
//! `DialRequest`: the allowlist check of its target.
//!
//! Properties:
//! - a value is accepted only if it is standard base64 (the alphabet and `=`), and an
//!   accepted message re-encodes (`encode_header`) into a value that decodes to it;
//! - a missing header is an error;
//! - the edge's allowlist lets through only what it lists: an exact target, or an
//!   address of the node on an allowed port. Anything else (another address, a name
//!   that resolves to anything) is refused, so a cloud cannot use the edge as an open
//!   proxy.

use std::fmt::Debug;
use std::net::{IpAddr, SocketAddr};

use prost::Message;
use proto::{DialRequest, DialResult, PeerHello};
use tunnel_user::config::AllowConfig;
use tunnel_user::edge::dial::Allowlist;
use tunnel_user::transport::{decode_header, encode_header};

/// Input: one byte picks the header, the rest is its value.
pub fn check(data: &[u8]) {
    let [kind, value @ ..] = data else { return };
    assert!(
        decode_header::<DialRequest>(None).is_err(),
        "a missing header must be an error"
    );
    // HTTP/2 hands on only valid header values; anything else never reaches us.
    let Ok(value) = http::HeaderValue::from_bytes(value) else {
        return;
    };
    match kind % 3 {
        0 => {
            if let Some(request) = round_trip::<DialRequest>(&value) {
                check_allowlist(&request.target);
            }
        }
        1 => drop(round_trip::<DialResult>(&value)),
        _ => drop(round_trip::<PeerHello>(&value)),
    }
}

fn round_trip<M: Message + Default + PartialEq + Debug>(value: &http::HeaderValue) -> Option<M> {
    let msg = decode_header::<M>(Some(value)).ok()?;
    assert!(
        value
            .as_bytes()
            .iter()
            .all(|b| b.is_ascii_alphanumeric() || b"+/=".contains(b)),
        "accepted a header value that is not base64: {value:?}"
    );
    let again = encode_header(&msg);
    assert_eq!(
        decode_header::<M>(Some(&again)).ok().as_ref(),
        Some(&msg),
        "re-encoded header decodes differently"
    );
    Some(msg)
}

/// The allowlist an edge gets from a config that lists two targets and its own
/// addresses on port 10250.
fn allowlist() -> (AllowConfig, Allowlist) {
    let config = AllowConfig {
        targets: vec![
            "127.0.0.1:10250".into(),
            "Kubelet.Local:10255".into(),
            "[::1]:6443".into(),
        ],
        node_addresses: vec![
            IpAddr::from([127, 1, 0, 5]),
            "fd00::5".parse().expect("literal"),
        ],
        ports: vec![10250],
        any: false,
    };
    let allow = Allowlist::new(&config, Vec::new);
    (config, allow)
}

/// Checks `Allowlist::check` against the rule written out: allowed iff the target is a
/// socket address that is listed or is a node address on an allowed port, or is
/// literally (ignoring case) a listed name target.
pub(crate) fn check_allowlist(target: &str) {
    let (config, allow) = allowlist();
    let listed_addr = |a: SocketAddr| {
        config
            .targets
            .iter()
            .any(|t| t.parse::<SocketAddr>() == Ok(a))
    };
    let should = match target.parse::<SocketAddr>() {
        Ok(a) => {
            listed_addr(a)
                || (config.node_addresses.contains(&a.ip()) && config.ports.contains(&a.port()))
        }
        Err(_) => config
            .targets
            .iter()
            .any(|t| t.parse::<SocketAddr>().is_err() && t.eq_ignore_ascii_case(target)),
    };
    assert_eq!(
        allow.check(target).is_ok(),
        should,
        "allowlist decision for {target:?}"
    );
}
