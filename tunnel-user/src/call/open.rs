//! The caller's side of a call: [`open`] opens one on an HTTP/2 channel, an edge
//! session's or a peer link's, with the request in its metadata, and counts it as open
//! there; the far end's [`Answer`] comes when it is first awaited. The cloud's path
//! (`cloud::conn::proxy`) and a replica relaying a forwarded call (`cloud::peer::serve`)
//! open theirs through it.

use std::pin::Pin;
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use futures::Stream;
use http_body::Body;
use proto::chunk_call::{EDGE_DIAL, EDGE_REVERSE, IncomingChunks, PEER_DIAL};
use proto::{Chunk, DialRequest, DialResult, DialStatus, OpenReverse};
use tonic::Status;
use tonic::client::GrpcService;
use tonic::metadata::BinaryMetadataValue;

use super::copy::{self, OutboundHandle};
use super::count::{OpenCount, OpenGuard};
use super::outcome::DialFailure;
use super::request::Request;

/// The method a call is made on, and what its metadata carries besides the request.
pub(crate) enum Method<'a> {
    /// `Edge.Dial`, on the node's own edge session.
    EdgeDial,
    /// `Peer.Dial`, to the replica that holds the node's session: the request names the
    /// node, and this replica's `PeerHello` goes along.
    PeerDial { hello: &'a BinaryMetadataValue },
}

/// The call of one proxied connection, whose request goes to the edge (directly, or
/// through the replica that holds the edge) once its answer is first awaited. Bytes sent
/// into it before the answer wait in the stream's window until the edge has connected
/// and reads them; an edge that refuses the dial never reads them, and they go with the
/// call. Counts as open on its session or link until `open` drops.
pub(crate) struct Call {
    pub(crate) answer: Answer,
    pub(crate) open: OpenGuard,
}

/// Opens a call of `method` on `channel` carrying `request`, with `messages` as its
/// outgoing messages (a socket's, through `copy::outbound`, or a forwarded call's),
/// counted as open in `count` until the call's guard drops. The request leaves when the
/// answer is first awaited, and the answer is waited for `answer_within` from now.
pub(crate) fn open<C, M>(
    mut channel: C,
    method: Method<'_>,
    request: &Request,
    messages: M,
    count: &Arc<OpenCount>,
    answer_within: Duration,
) -> Call
where
    C: GrpcService<tonic::body::Body> + Send + 'static,
    C::Future: Send,
    C::ResponseBody: Body<Data = Bytes> + Send + 'static,
    <C::ResponseBody as Body>::Error: Into<Box<dyn std::error::Error + Send + Sync>>,
    M: Stream<Item = Chunk> + Send + Unpin + 'static,
{
    let open = OpenGuard::count(count);
    let deadline = tokio::time::Instant::now() + answer_within;
    let mut call = tonic::Request::new(messages);
    let metadata = call.metadata_mut();
    let path = match method {
        Method::EdgeDial => {
            metadata.insert_bin(proto::DIAL_REQUEST_METADATA, request.to_metadata(false));
            EDGE_DIAL
        }
        Method::PeerDial { hello } => {
            metadata.insert_bin(proto::DIAL_REQUEST_METADATA, request.to_metadata(true));
            metadata.insert_bin(proto::PEER_HELLO_METADATA, hello.clone());
            PEER_DIAL
        }
    };
    let answer = async move {
        // The channel adds the origin.
        proto::chunk_call::call(&mut channel, http::Uri::from_static(path), call).await
    };
    Call {
        answer: Answer {
            call: Box::pin(answer),
            deadline,
        },
        open,
    }
}

/// An edge-to-cloud connection's open `Edge.Reverse` call: the handle of its outgoing
/// messages and its incoming ones. Counts as open until dropped.
pub(crate) struct ReverseStream {
    pub(crate) outbound: OutboundHandle,
    pub(crate) inbound: IncomingChunks,
    pub(crate) open: OpenGuard,
}

/// Opens the `Edge.Reverse` call an edge asked for with `asked`, carrying the cloud's
/// own dial `result`, on `channel`, counted in `count`. A failed result ends the call at
/// once (`Ok(None)`); otherwise returns the call once the edge has taken it, within
/// `answer_within`. On the wire the call's request is a `DialRequest` with the edge's
/// id for the connection and its target, as the edge sent them (a target the cloud
/// refused need not be `host:port`).
pub(crate) async fn open_reverse<C>(
    mut channel: C,
    asked: &OpenReverse,
    result: &DialResult,
    count: &Arc<OpenCount>,
    answer_within: Duration,
) -> Result<Option<ReverseStream>, DialFailure>
where
    C: GrpcService<tonic::body::Body> + Send + 'static,
    C::Future: Send,
    C::ResponseBody: Body<Data = Bytes> + Send + 'static,
    <C::ResponseBody as Body>::Error: Into<Box<dyn std::error::Error + Send + Sync>>,
{
    let request = DialRequest {
        target: asked.target.clone(),
        connection_id: asked.id,
        client: asked.client.clone(),
        node: String::new(),
        tls: false,
    };
    let metadata = |call: &mut tonic::metadata::MetadataMap| {
        call.insert_bin(proto::DIAL_REQUEST_METADATA, proto::to_metadata(&request));
        call.insert_bin(proto::DIAL_RESULT_METADATA, proto::to_metadata(result));
    };
    let uri = http::Uri::from_static(EDGE_REVERSE);
    if result.status() != DialStatus::Ok {
        let mut call = tonic::Request::new(futures::stream::empty::<Chunk>());
        metadata(call.metadata_mut());
        // The edge answers with the matching status; only that it heard counts.
        let reverse = proto::chunk_call::call(&mut channel, uri, call);
        let _ = tokio::time::timeout(answer_within, reverse).await;
        return Ok(None);
    }
    let open = OpenGuard::count(count);
    let (outbound, handle) = copy::outbound();
    let mut call = tonic::Request::new(outbound);
    metadata(call.metadata_mut());
    let reverse = proto::chunk_call::call(&mut channel, uri, call);
    let inbound = tokio::time::timeout(answer_within, reverse)
        .await
        .map_err(|_| DialFailure::new(DialStatus::Timeout, ""))?
        .map_err(|s| {
            DialFailure::new(
                DialStatus::TunnelFailed,
                format!("the edge refused the reverse call: {}", copy::describe(&s)),
            )
        })?;
    Ok(Some(ReverseStream {
        outbound: handle,
        inbound,
        open,
    }))
}

type CallFuture = Pin<Box<dyn Future<Output = Result<IncomingChunks, Status>> + Send + 'static>>;

/// The far end's answer to a call, still to come. The call's request leaves when the
/// answer is first awaited, which the copy does once it has handed the call the
/// client's socket, so the client's first bytes leave with the request.
pub(crate) struct Answer {
    /// Boxed even when the answer is in already, so that a connection's task carries a
    /// pointer, not an answer, while it waits (it holds this for the connection's
    /// whole life when the dial is still under way as its bytes start to flow).
    call: CallFuture,
    deadline: tokio::time::Instant,
}

impl Answer {
    /// The call's incoming messages once the far end has connected to the target, or
    /// why it did not (its own refusal, or no answer by the deadline).
    pub(crate) async fn wait(self) -> Result<IncomingChunks, DialFailure> {
        let answer = tokio::time::timeout_at(self.deadline, self.call)
            .await
            .map_err(|_| DialFailure::new(DialStatus::Timeout, ""))?;
        answer.map_err(|status| DialFailure::from_status(&status))
    }
}
