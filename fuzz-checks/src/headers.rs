//! gRPC binary metadata from a peer: the `DialRequest` (`tunnel-dial-bin`), `DialResult`
//! (`tunnel-dial-result-bin`) and `PeerHello` (`tunnel-peer-bin`) that ride on calls, as
//! `proto::from_metadata` reads them, and the `DialResult` a refusal's status carries
//! (`DialResult::from_status`).
//!
//! Properties:
//! - `from_metadata` agrees with decoding the bytes directly: the same message, or an
//!   error; it never panics;
//! - what `to_metadata` writes, `from_metadata` reads back;
//! - a status built from any bytes as details gives a failed `DialResult`;
//! - the edge's `Allowlist::check` of a decoded `DialRequest`'s target (parsed as the
//!   edge parses it) lets through exactly the listed targets and node addresses on
//!   allowed ports (no open proxy).

use std::fmt::Debug;
use std::net::{IpAddr, SocketAddr};

use bytes::Bytes;
use prost::Message;
use proto::{DialRequest, DialResult, DialStatus, PeerHello};
use tonic::metadata::{BinaryMetadataValue, MetadataMap};
use tunnel_user::addr::Target;
use tunnel_user::config::AllowConfig;
use tunnel_user::edge::dial::Allowlist;

const KEY: &str = "tunnel-fuzz-bin";

/// Input: one byte picks the message type, the rest is the metadata value's bytes.
pub fn check(data: &[u8]) {
    let [kind, value @ ..] = data else {
        return;
    };
    match kind % 3 {
        0 => {
            if let Some(request) = check_as::<DialRequest>(value) {
                check_allowlist(&request.target);
            }
        }
        1 => drop(check_as::<DialResult>(value)),
        _ => drop(check_as::<PeerHello>(value)),
    }
    let status = tonic::Status::with_details(
        tonic::Code::Unavailable,
        "fuzz",
        Bytes::copy_from_slice(value),
    );
    let result = DialResult::from_status(&status);
    assert!(!matches!(
        result.status(),
        DialStatus::Ok | DialStatus::Unspecified
    ));
}

fn check_as<M: Message + Default + PartialEq + Debug>(value: &[u8]) -> Option<M> {
    let mut metadata = MetadataMap::new();
    metadata.insert_bin(KEY, BinaryMetadataValue::from_bytes(value));
    let read = proto::from_metadata::<M>(&metadata, KEY);
    match (&read, M::decode(value)) {
        (Ok(m), Ok(direct)) => assert_eq!(m, &direct),
        (Err(_), Err(_)) => {}
        (read, direct) => panic!("from_metadata {read:?} but decode {direct:?}"),
    }
    let m = read.ok()?;
    let mut again = MetadataMap::new();
    again.insert_bin(KEY, proto::to_metadata(&m));
    assert_eq!(
        proto::from_metadata::<M>(&again, KEY).expect("round trip"),
        m
    );
    Some(m)
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
    let allowed = Target::parse(target).is_ok_and(|t| allow.check(&t).is_ok());
    assert_eq!(allowed, should, "allowlist decision for {target:?}");
}
