//! The generated part of the committed corpus: valid inputs made by our own encoders
//! (and the shipped example configs), so the fuzzers start from what real peers send.
//! They are the files `fuzz/corpus/<target>/gen-<name>`; `tests/corpus.rs` fails when
//! they drift from this code, and `FUZZ_WRITE_SEEDS=1 cargo test -p fuzz-checks`
//! rewrites them. Hand-written edge cases and crash regressions sit beside them under
//! other names.

use std::collections::HashMap;
use std::path::Path;

use prost::Message;
use proto::{
    Control, DialRequest, DialResult, DialStatus, Drain, Error, Hello, HelloReply, OpenReverse,
    PeerHello, Ping, Pong, Reject, RejectReason, RouteUpdate, Welcome, control, hello_reply,
};

/// (target, name, bytes)
pub type Seed = (&'static str, String, Vec<u8>);

use crate::frames::frames;

/// `[kind]` then the stream, as `frames::check` reads it (the second argument is
/// where older seeds cut the stream; the gRPC framing is cut by tonic, not by us).
fn frame_seed(kind: u8, _split: u8, stream: Vec<u8>) -> Vec<u8> {
    let mut v = vec![kind];
    v.extend(stream);
    v
}

fn control(msg: control::Msg) -> Control {
    Control { msg: Some(msg) }
}

pub fn seeds(workspace_root: &Path) -> Vec<Seed> {
    let mut out: Vec<Seed> = Vec::new();
    let mut add = |target: &'static str, name: &str, bytes: Vec<u8>| {
        out.push((target, name.to_string(), bytes))
    };

    // frames: kind 0 Hello, 1 HelloReply, 2 Control, 3 RouteUpdate.
    let hello = Hello {
        protocol_version: proto::PROTOCOL_VERSION,
        node_name: "edge-1".into(),
        token: "secret-token".into(),
        identity_kind: "node".into(),
        agent_version: "0.1.0".into(),
    };
    add(
        "frames",
        "hello",
        frame_seed(0, 128, frames(std::slice::from_ref(&hello))),
    );
    let cluster = Hello {
        identity_kind: "cluster".into(),
        node_name: "cluster-a".into(),
        token: String::new(),
        ..hello
    };
    add(
        "frames",
        "hello-cluster",
        frame_seed(0, 3, frames(&[cluster])),
    );
    let welcome = HelloReply {
        result: Some(hello_reply::Result::Welcome(Welcome {
            protocol_version: 1,
            cloud_id: "master-1".into(),
            heartbeat_interval_ms: 5000,
        })),
    };
    let reject = HelloReply {
        result: Some(hello_reply::Result::Reject(Reject {
            reason: RejectReason::BadCredentials as i32,
            message: "bad token".into(),
        })),
    };
    add("frames", "welcome", frame_seed(1, 200, frames(&[welcome])));
    add("frames", "reject", frame_seed(1, 10, frames(&[reject])));
    let controls = [
        control(control::Msg::Ping(Ping {
            sequence: 7,
            last_rtt_us: 90,
        })),
        control(control::Msg::Pong(Pong { sequence: 7 })),
        control(control::Msg::Drain(Drain {
            reason: "shutting down".into(),
        })),
        control(control::Msg::Error(Error {
            message: "something broke".into(),
        })),
        control(control::Msg::OpenReverse(OpenReverse {
            id: 42,
            target: "10.0.0.1:443".into(),
            client: "127.0.0.1:5555".into(),
        })),
        Control::default(),
    ];
    add(
        "frames",
        "control-all",
        frame_seed(2, 100, frames(&controls)),
    );
    let mut truncated = frames(&controls[..2]);
    truncated.truncate(truncated.len() - 1);
    add("frames", "control-truncated", frame_seed(2, 250, truncated));
    let mut oversized = frames(&controls[..1]);
    oversized.push(0);
    oversized.extend(((proto::MAX_CHUNK_MESSAGE as u32) + 1).to_be_bytes());
    add("frames", "control-oversized", frame_seed(2, 50, oversized));
    let mut garbage = frames(&controls[..1]);
    garbage.extend([0, 0, 0, 0, 3, 0xff, 0xff, 0xff]);
    add("frames", "control-malformed", frame_seed(2, 80, garbage));
    let routes = tunnel_user::cloud::peer::route_updates(
        &HashMap::from([("edge-gone".to_string(), 1)]),
        &HashMap::from([
            ("edge-1".to_string(), 1_700_000_000_000),
            ("edge-2".to_string(), 1_700_000_000_500),
        ]),
        false,
    );
    add(
        "frames",
        "route-updates",
        frame_seed(3, 60, frames(&routes)),
    );
    let chunks = [
        crate::frames::ProstChunk {
            data: bytes::Bytes::from_static(b"\x16\x03\x01 a TLS ClientHello's first bytes"),
        },
        crate::frames::ProstChunk::default(),
    ];
    add("frames", "chunks", frame_seed(4, 0, frames(&chunks)));

    // headers (binary metadata): kind 0 DialRequest, 1 DialResult, 2 PeerHello.
    let header = |kind: u8, value: Vec<u8>| [&[kind][..], &value[..]].concat();
    let dial = DialRequest {
        target: "127.0.0.1:10250".into(),
        connection_id: 9,
        client: "10.0.0.1:40000".into(),
        node: String::new(),
        tls: false,
    };
    add(
        "headers",
        "dial-request",
        header(0, Message::encode_to_vec(&dial)),
    );
    let forwarded = DialRequest {
        target: "kubelet.local:10255".into(),
        node: "edge-1".into(),
        tls: true,
        ..dial.clone()
    };
    add(
        "headers",
        "dial-request-forwarded",
        header(0, Message::encode_to_vec(&forwarded)),
    );
    let node_addr = DialRequest {
        target: "127.1.0.5:10250".into(),
        ..dial
    };
    add(
        "headers",
        "dial-request-node-address",
        header(0, Message::encode_to_vec(&node_addr)),
    );
    let result = DialResult {
        status: DialStatus::Forbidden as i32,
        message: "not allowed".into(),
    };
    add(
        "headers",
        "dial-result",
        header(1, Message::encode_to_vec(&result)),
    );
    let peer = PeerHello {
        replica_id: "master-2".into(),
        instance: 0x1234_5678_9abc_def0,
    };
    add(
        "headers",
        "peer-hello",
        header(2, Message::encode_to_vec(&peer)),
    );

    // connect_head: raw heads (the check also builds its own from the same bytes).
    add("connect_head", "curl", b"CONNECT edge-1:10250 HTTP/1.1\r\nHost: edge-1:10250\r\nUser-Agent: curl/8.0\r\nProxy-Connection: Keep-Alive\r\n\r\n".to_vec());
    add("connect_head", "apiserver-egress", b"CONNECT 127.1.0.5:10250 HTTP/1.1\r\nHost: 127.1.0.5:10250\r\n\r\n\x16\x03\x01\x00\x05hello".to_vec());
    add(
        "connect_head",
        "ipv6",
        b"CONNECT [fd00::6]:443 HTTP/1.1\r\n\r\n".to_vec(),
    );
    add(
        "connect_head",
        "partial",
        b"CONNECT edge-b.:10250 HTTP/1.1\r\nHo".to_vec(),
    );
    add(
        "connect_head",
        "get",
        b"GET http://edge-1:10250/ HTTP/1.1\r\nHost: edge-1\r\n\r\n".to_vec(),
    );

    // https_host.
    add("https_host", "logs", b"GET /containerLogs/default/pod/c?follow=true HTTP/1.1\r\nHost: edge-1:10250\r\nAccept: */*\r\n\r\n".to_vec());
    add(
        "https_host",
        "no-port",
        b"POST /exec/ns/pod/c HTTP/1.1\r\nUser-Agent: kube\r\nhost: Edge-2.\r\n\r\nbody".to_vec(),
    );
    add(
        "https_host",
        "no-host",
        b"GET / HTTP/1.1\r\nAccept: */*\r\n\r\n".to_vec(),
    );
    add(
        "https_host",
        "ipv6",
        b"GET / HTTP/1.1\r\nHost: [fd00::5]:10250\r\n\r\n".to_vec(),
    );

    // config: the shipped examples.
    for name in [
        "cloud.toml",
        "edge.toml",
        "superedge-cloud.toml",
        "superedge-edge.toml",
    ] {
        let path = workspace_root.join("examples").join(name);
        let text = std::fs::read(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
        add("config", name, text);
    }

    // token_file.
    add("token_file", "tokens", b"# tokens for the edge fleet\nedge-a:token-for-a\n\n  edge-b : token-for-b  \ndefault:the-default-token\n".to_vec());
    add(
        "token_file",
        "duplicate",
        b"edge-a:one\nedge-a:two\n".to_vec(),
    );
    add("token_file", "reversed", b"s3cr3t-token:edge-a\n".to_vec());

    // peer_routes: a full resync, then a change.
    let before = HashMap::from([
        ("edge-1".to_string(), 1),
        ("edge-2".to_string(), 2),
        ("edge-3".to_string(), 3),
    ]);
    let after = HashMap::from([
        ("edge-1".to_string(), 1),
        ("edge-2".to_string(), 5),
        ("edge-4".to_string(), 4),
    ]);
    let mut stream = frames(&tunnel_user::cloud::peer::route_updates(
        &HashMap::new(),
        &before,
        true,
    ));
    stream.extend(frames(&tunnel_user::cloud::peer::route_updates(
        &before, &after, false,
    )));
    stream.extend(frames(&[RouteUpdate::default()]));
    add("peer_routes", "resync-then-change", stream);
    let hostile = RouteUpdate {
        reset: false,
        held: vec![
            proto::NodeClaim {
                node: "Bad_Name".into(),
                connected_at_ms: 1,
            },
            proto::NodeClaim {
                node: "edge-1".into(),
                connected_at_ms: u64::MAX,
            },
            proto::NodeClaim {
                node: String::new(),
                connected_at_ms: 0,
            },
        ],
        released: vec!["edge-1".into(), "never-claimed".into()],
    };
    let mut stream = frames(&[
        hostile,
        RouteUpdate {
            reset: true,
            ..Default::default()
        },
    ]);
    stream.extend(((proto::MAX_MESSAGE_LEN as u32) + 1).to_be_bytes());
    add("peer_routes", "invalid-claims-then-oversized", stream);

    // admin_filter.
    add("admin_filter", "glog", b"8\n".to_vec());
    add(
        "admin_filter",
        "directives",
        b"info,tunnel_user::cloud=debug".to_vec(),
    );
    add(
        "admin_filter",
        "span-field",
        b"warn,[conn{node=edge-1}]=trace".to_vec(),
    );

    out
}
