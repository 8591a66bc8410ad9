//! What a call asks of its far end, typed: the connection's id, the node, the target,
//! the client and whether to dial in TLS. The wire carries it as a `proto::DialRequest`
//! in the call's `tunnel-dial-bin` metadata; this is the one place it is converted, both
//! ways, so the target is a [`Target`] from the entry to the edge's dial and parsed once,
//! where it comes off the wire.

use std::fmt;
use std::net::SocketAddr;

use proto::DialRequest;
use tonic::metadata::{BinaryMetadataValue, MetadataMap};

use crate::addr::{ClientAddr, NodeName, Target, TargetError};

/// One proxied connection's request, as the cloud makes it and its far end reads it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Request {
    /// The cloud's id of the connection, in both sides' logs.
    pub(crate) id: u64,
    /// The node whose edge dials. On the wire in a forwarded call only, for the replica
    /// that holds the node; an edge knows who it is.
    pub(crate) node: Option<NodeName>,
    /// What the edge dials.
    pub(crate) target: Target,
    /// Who connected on the cloud side, for logs; `None` when the caller did not say.
    pub(crate) client: Option<ClientAddr>,
    /// The edge wraps its connection to the target in TLS (the HTTPS entry).
    pub(crate) tls: bool,
}

/// Why a call's metadata holds no request; the far end refuses the call with this text.
#[derive(Debug, thiserror::Error)]
pub(crate) enum RequestError {
    /// No `tunnel-dial-bin`, or not a `DialRequest`.
    #[error("{0}")]
    Metadata(String),
    #[error(transparent)]
    Target(#[from] TargetError),
    #[error("DialRequest.node: {0}")]
    Node(String),
    #[error("DialRequest.client: `{0}` is neither an address nor `unix`")]
    Client(String),
}

impl Request {
    /// The request as the wire carries it, in the call's metadata. The node goes only
    /// on a call `forwarded` to the replica that holds it.
    pub(crate) fn to_metadata(&self, forwarded: bool) -> BinaryMetadataValue {
        let node = match (&self.node, forwarded) {
            (Some(node), true) => node.to_string(),
            _ => String::new(),
        };
        proto::to_metadata(&DialRequest {
            target: self.target.to_string(),
            connection_id: self.id,
            client: self.client.map(|c| c.to_string()).unwrap_or_default(),
            node,
            tls: self.tls,
        })
    }

    /// The request in a call's metadata, checked: a target that is `host:port`, a valid
    /// node name when there is one, a client that is an address or `unix`.
    pub(crate) fn from_metadata(metadata: &MetadataMap) -> Result<Self, RequestError> {
        let wire: DialRequest = proto::from_metadata(metadata, proto::DIAL_REQUEST_METADATA)
            .map_err(RequestError::Metadata)?;
        Self::from_wire(wire)
    }

    fn from_wire(wire: DialRequest) -> Result<Self, RequestError> {
        let node = match wire.node.is_empty() {
            true => None,
            false => Some(NodeName::new(wire.node).map_err(RequestError::Node)?),
        };
        let client = match wire.client.as_str() {
            "" => None,
            "unix" => Some(ClientAddr::Unix),
            text => Some(ClientAddr::Tcp(
                text.parse::<SocketAddr>()
                    .map_err(|_| RequestError::Client(wire.client.clone()))?,
            )),
        };
        Ok(Self {
            id: wire.connection_id,
            node,
            target: Target::parse(&wire.target)?,
            client,
            tls: wire.tls,
        })
    }

    /// The client for logs.
    pub(crate) fn client(&self) -> Client {
        Client(self.client)
    }
}

/// A request's client as logs show it: its address, `unix`, or `-` when the caller did
/// not say.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Client(pub(crate) Option<ClientAddr>);

impl fmt::Display for Client {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self.0 {
            Some(client) => client.fmt(f),
            None => f.write_str("-"),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn request() -> Request {
        Request {
            id: 7,
            node: Some(NodeName::new("edge-1".into()).expect("valid")),
            target: Target::parse("[::1]:10250").expect("valid"),
            client: Some(ClientAddr::Tcp("10.0.0.1:40000".parse().expect("addr"))),
            tls: true,
        }
    }

    fn through_the_wire(request: &Request, forwarded: bool) -> Result<Request, RequestError> {
        let mut metadata = MetadataMap::new();
        metadata.insert_bin(proto::DIAL_REQUEST_METADATA, request.to_metadata(forwarded));
        Request::from_metadata(&metadata)
    }

    /// A request crosses the wire and comes out the same; the node only on a forwarded
    /// call, and a unix client as `unix`.
    #[test]
    fn a_request_survives_the_wire() {
        let sent = request();
        assert_eq!(through_the_wire(&sent, true).expect("parses"), sent);
        let to_edge = through_the_wire(&sent, false).expect("parses");
        assert_eq!(to_edge, Request { node: None, ..sent });
        let unix = Request {
            client: Some(ClientAddr::Unix),
            ..request()
        };
        assert_eq!(through_the_wire(&unix, true).expect("parses"), unix);
    }

    /// What the wire may hold that is no request is refused with its problem named.
    #[test]
    fn a_bad_request_names_its_problem() {
        let bad = |wire: DialRequest| Request::from_wire(wire).expect_err("bad").to_string();
        let good = DialRequest {
            target: "127.0.0.1:10250".into(),
            ..DialRequest::default()
        };
        assert_eq!(
            bad(DialRequest {
                target: "edge-1".into(),
                ..good.clone()
            }),
            "`edge-1` is not host:port: it has no port"
        );
        assert!(
            bad(DialRequest {
                node: "Edge_1".into(),
                ..good.clone()
            })
            .starts_with("DialRequest.node: `Edge_1` is not a valid node name"),
        );
        assert_eq!(
            bad(DialRequest {
                client: "somewhere".into(),
                ..good.clone()
            }),
            "DialRequest.client: `somewhere` is neither an address nor `unix`"
        );
        let missing = Request::from_metadata(&MetadataMap::new()).expect_err("no metadata");
        assert_eq!(missing.to_string(), "tunnel-dial-bin missing");
        let unsaid = Request::from_wire(good).expect("no client is fine");
        assert_eq!(unsaid.client().to_string(), "-");
    }
}
