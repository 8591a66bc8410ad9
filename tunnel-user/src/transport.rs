//! What both ends of the tunnel connection agree on beyond the messages themselves:
//! HTTP/2 settings and how a dial request and its result ride in stream headers.

use base64::Engine;
use base64::engine::general_purpose::STANDARD;
use bytes::Bytes;
use prost::Message;

use crate::config::TransportConfig;

/// The connection window is set to the protocol maximum so that only the per-stream
/// windows limit a sender: with a smaller one, a few stalled streams would hold the
/// whole connection's window and stall every other stream of the edge. Memory stays
/// bounded by stream window × streams per edge.
const CONNECTION_WINDOW: u32 = (1 << 31) - 1;

/// The cloud's side: it opens the streams.
pub fn client_builder(t: &TransportConfig) -> h2::client::Builder {
    let mut b = h2::client::Builder::new();
    b.initial_window_size(t.stream_window)
        .initial_connection_window_size(CONNECTION_WINDOW)
        .max_frame_size(t.max_frame_size)
        .max_concurrent_reset_streams(1024);
    b
}

/// The edge's side: it accepts the streams and bounds how many may be open.
pub fn server_builder(t: &TransportConfig) -> h2::server::Builder {
    let mut b = h2::server::Builder::new();
    b.initial_window_size(t.stream_window)
        .initial_connection_window_size(CONNECTION_WINDOW)
        .max_frame_size(t.max_frame_size)
        .max_concurrent_streams(t.max_streams_per_edge)
        .max_concurrent_reset_streams(1024);
    b
}

/// The response that answers a dial stream: its `DialResult` rides in a header.
pub fn dial_response(result: &proto::DialResult) -> http::Response<()> {
    let mut resp = http::Response::new(());
    resp.headers_mut()
        .insert(proto::DIAL_RESULT_HEADER, encode_header(result));
    resp
}

pub fn encode_header<M: Message>(msg: &M) -> http::HeaderValue {
    http::HeaderValue::from_str(&STANDARD.encode(msg.encode_to_vec()))
        .expect("base64 is a valid header value")
}

pub fn decode_header<M: Message + Default>(value: Option<&http::HeaderValue>) -> Result<M, String> {
    let value = value.ok_or("header missing")?;
    let bytes = STANDARD
        .decode(value.as_bytes())
        .map_err(|e| format!("not base64: {e}"))?;
    M::decode(Bytes::from(bytes)).map_err(|e| format!("malformed: {e}"))
}
