//! HTTP/1 request heads read before the node is known: the CONNECT proxy's
//! `tunnel_user::io::http_connect::parse_head` (then `route::route_connect` of the
//! authority), and the HTTPS entry's `https::host_from_head`.
//!
//! Both are called again and again on a growing buffer while bytes arrive, so besides
//! not panicking they must:
//! - answer "need more" (never an error) for every proper prefix of a valid head, so a
//!   head cut anywhere by TCP still works, and answer "too large" only at the bound;
//! - return what a valid head says: the CONNECT authority with the bytes after the head
//!   untouched (they are the client's first bytes for the target), or the first Host
//!   header's name without its port;
//! - (CONNECT) route only to an address of the named node, or of the node owning the
//!   address, on the port the client asked for.

use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr};

use tunnel_user::addr::Target;
use tunnel_user::cloud::conn::entry::https;
use tunnel_user::cloud::conn::route::route_connect;
use tunnel_user::cloud::nodes::table::{Claim, NodeTable};
use tunnel_user::io::http_connect::{self as connect, ConnectRequest, HeadError};
use tunnel_user::io::http_head::MAX_HEAD;

use crate::Choices;

const TOKEN_CHARS: &[u8] =
    b"abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789!#$%&'*+-.^_`|~";
const VALUE_CHARS: &[u8] = b"abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789 !\"#$%&'()*+,-./:;<=>?@[\\]^_`{|}~\t";

/// Input: used twice, as raw bytes and as the choices that build a valid head.
pub fn check_connect(data: &[u8]) {
    connect_raw(data);
    connect_built(data);
}

pub fn check_https_host(data: &[u8]) {
    https_raw(data);
    https_built(data);
}

fn connect_raw(data: &[u8]) {
    match connect::parse_head(data) {
        Ok(Some(req)) => {
            assert!(
                data.ends_with(&req.rest),
                "the bytes after the head must be passed on unchanged"
            );
            let head_len = data.len() - req.rest.len();
            let head = &data[..head_len];
            assert_eq!(
                connect::parse_head(head)
                    .as_ref()
                    .map(|r| r.as_ref().map(|r| r.authority.as_str())),
                Ok(Some(req.authority.as_str()))
            );
            for k in [0, head_len / 2, head_len.saturating_sub(1)] {
                assert_eq!(
                    connect::parse_head(&head[..k]),
                    Ok(None),
                    "a prefix ({k} of {head_len} bytes) of a valid head must ask for more"
                );
            }
            check_route(&req.authority);
        }
        Ok(None) => assert!(
            data.len() < MAX_HEAD,
            "{} bytes without a complete head must be too large",
            data.len()
        ),
        Err(HeadError::TooLarge) => assert!(data.len() >= MAX_HEAD),
        Err(HeadError::Method(m)) => assert!(!m.eq_ignore_ascii_case("CONNECT")),
        Err(HeadError::Malformed(_) | HeadError::Incomplete) => {}
    }
}

/// A valid head built from the input, and what parsing it must give.
struct Built {
    bytes: Vec<u8>,
    head_len: usize,
    /// The CONNECT authority, or the Host header's name.
    expected: String,
}

fn host(c: &mut Choices<'_>) -> String {
    match c.byte() % 5 {
        0 => "edge-a".into(),
        1 => crate::node_name(c),
        2 => Ipv4Addr::from([c.byte(), c.byte(), c.byte(), c.byte()]).to_string(),
        3 => format!(
            "[{}]",
            Ipv6Addr::from(std::array::from_fn::<u8, 16, _>(|_| c.byte()))
        ),
        _ => "Edge-B.".into(),
    }
}

/// Request line, `extra` headers (with the Host header at a chosen place when `host` is
/// given), the empty line, then the rest of the input.
fn build(c: &mut Choices<'_>, method: &str, target: &str, host: Option<&str>) -> (Vec<u8>, usize) {
    let version = ["HTTP/1.1", "HTTP/1.0"][c.byte() as usize % 2];
    let mut head = format!("{method} {target} {version}\r\n");
    let count = c.byte() % 6;
    let host_at = c.byte() % (count + 1);
    for i in 0..=count {
        if i == host_at
            && let Some(host) = host
        {
            let name = ["Host", "host", "HOST"][c.byte() as usize % 3];
            head.push_str(&format!("{name}: {host}\r\n"));
        }
        if i < count {
            // Values never start or end with white space, which the parser trims.
            let name = c.string_from(TOKEN_CHARS, 16);
            let value = c.string_from(VALUE_CHARS, 40);
            head.push_str(&format!("x-{name}: v{value}v\r\n"));
        }
    }
    head.push_str("\r\n");
    let head_len = head.len();
    let mut bytes = head.into_bytes();
    bytes.extend_from_slice(c.rest());
    (bytes, head_len)
}

fn built_connect(data: &[u8]) -> Built {
    let mut c = Choices::new(data);
    let case = c.byte();
    let method: String = "CONNECT"
        .chars()
        .enumerate()
        .map(|(i, ch)| {
            if case >> i & 1 == 1 {
                ch.to_ascii_lowercase()
            } else {
                ch
            }
        })
        .collect();
    let authority = format!("{}:{}", host(&mut c), c.u16().max(1));
    let (bytes, head_len) = build(&mut c, &method, &authority, None);
    Built {
        bytes,
        head_len,
        expected: authority,
    }
}

fn connect_built(data: &[u8]) {
    let Built {
        bytes,
        head_len,
        expected,
    } = built_connect(data);
    let want = ConnectRequest {
        authority: expected.clone(),
        rest: bytes::Bytes::copy_from_slice(&bytes[head_len..]),
    };
    assert_eq!(
        connect::parse_head(&bytes),
        Ok(Some(want)),
        "valid head {:?}",
        String::from_utf8_lossy(&bytes[..head_len])
    );
    for k in 0..head_len {
        assert_eq!(
            connect::parse_head(&bytes[..k]),
            Ok(None),
            "prefix of {k} bytes of a valid head"
        );
    }
    check_route(&expected);
}

/// The node table the routing checks use; `edge-z` has a session but no addresses.
fn table() -> NodeTable {
    let a = [IpAddr::from([127, 1, 0, 5]), IpAddr::from([192, 0, 2, 5])];
    let b = [
        IpAddr::from([127, 1, 0, 6]),
        "fd00::6".parse().expect("literal"),
    ];
    let edge = |name, addresses| Claim {
        name,
        addresses,
        edge: true,
        pod_cidrs: &[],
        over_cap: false,
    };
    NodeTable::new([edge("edge-a", &a[..]), edge("edge-b", &b[..])], &[])
}

fn check_route(authority: &str) {
    let table = table();
    let Ok(route) = route_connect(&table, authority, |n| n == "edge-z") else {
        return;
    };
    let node = route.node.as_deref().expect("CONNECT always names a node");
    assert!(!route.tls);
    let target: SocketAddr = route
        .target
        .socket_addr()
        .unwrap_or_else(|| panic!("route target {:?} is not an address", route.target));
    let port = authority
        .rsplit_once(':')
        .and_then(|(_, p)| p.parse::<u16>().ok());
    assert_eq!(
        Some(target.port()),
        port,
        "{authority:?} routed to another port: {route:?}"
    );
    let allowed = table
        .addresses(node)
        .map(<[IpAddr]>::to_vec)
        .unwrap_or_else(|| {
            assert_eq!(
                node, "edge-z",
                "{authority:?} routed to a node neither in the table nor connected"
            );
            vec![IpAddr::from([127, 0, 0, 1])]
        });
    assert!(
        allowed.contains(&target.ip()),
        "{authority:?} routed to {target}, not an address of {node}"
    );
    assert_eq!(
        Target::parse(&route.target.to_string()).as_ref(),
        Ok(&route.target),
        "the route's target reads back as itself"
    );
}

fn https_raw(data: &[u8]) {
    let got = https::host_from_head(data);
    let mut headers = [httparse::EMPTY_HEADER; 64];
    let complete = match httparse::Request::new(&mut headers).parse(data) {
        Ok(httparse::Status::Complete(n)) => Some(n),
        _ => None,
    };
    match &got {
        Ok(Some(_)) => {
            let head_len = complete.expect("a host came from a complete head");
            assert_eq!(
                https::host_from_head(&data[..head_len]),
                got,
                "bytes after the head changed the host"
            );
            for k in [0, head_len / 2, head_len.saturating_sub(1)] {
                assert_eq!(
                    https::host_from_head(&data[..k]),
                    Ok(None),
                    "a prefix ({k} of {head_len} bytes) of a valid head must ask for more"
                );
            }
        }
        Ok(None) => assert!(
            data.len() < MAX_HEAD,
            "{} bytes without a complete head must be too large",
            data.len()
        ),
        Err(_) => {}
    }
}

fn https_built(data: &[u8]) {
    let mut c = Choices::new(data);
    let method =
        ["GET", "POST", "PUT", "DELETE", "HEAD", "OPTIONS", "PATCH"][c.byte() as usize % 7];
    let path = format!(
        "/{}",
        c.string_from(b"abcdefghijklmnopqrstuvwxyz0123456789/-_.?=&%", 40)
    );
    let name = host(&mut c);
    let host = match c.byte() % 2 {
        0 => name.clone(),
        _ => format!("{name}:{}", c.u16()),
    };
    let (bytes, head_len) = build(&mut c, method, &path, Some(&host));
    assert_eq!(
        https::host_from_head(&bytes),
        Ok(Some(name)),
        "valid head {:?}",
        String::from_utf8_lossy(&bytes[..head_len])
    );
    for k in 0..head_len {
        assert_eq!(
            https::host_from_head(&bytes[..k]),
            Ok(None),
            "prefix of {k} bytes of a valid head"
        );
    }
}
