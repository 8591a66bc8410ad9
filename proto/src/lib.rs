//! Wire protocol between tunnel-edge and tunnel-cloud, and between cloud replicas: the
//! prost messages and tonic services generated from `tunnel.proto`, the codec of the
//! byte streams (`Chunk`), and the names and mappings both sides must agree on.

use bytes::{Buf, BufMut, Bytes};
use prost::Message;
use prost::encoding::{decode_key, encode_varint, skip_field};
use tonic::codec::{BufferSettings, Codec};
use tonic::metadata::{BinaryMetadataValue, MetadataMap};
use tonic::{Code, Status};

#[expect(
    clippy::allow_attributes,
    clippy::allow_attributes_without_reason,
    reason = "prost's and tonic's generated code silences its own lints with #[allow]"
)]
mod generated {
    include!(concat!(env!("OUT_DIR"), "/tunnel.v1.rs"));
    include!(concat!(env!("OUT_DIR"), "/tunnel.v1.Edge.rs"));
    include!(concat!(env!("OUT_DIR"), "/tunnel.v1.Peer.rs"));
}
pub use generated::*;

pub mod chunk_call;

/// The protocol version this build speaks (see `Hello.protocol_version`).
pub const PROTOCOL_VERSION: u32 = 2;
/// ALPN protocol id on the edge's TLS connection: gRPC with the roles reversed.
pub const ALPN: &[u8] = b"tunnel/2";
/// What edges of protocol 1 (a length-prefixed Hello, then raw HTTP/2) offer; the cloud
/// accepts it only to tell them to upgrade, in their own framing.
pub const LEGACY_ALPN: &[u8] = b"tunnel/1";
/// Binary metadata carrying a serialized `DialRequest` (Edge.Dial, Edge.Reverse, Peer.Dial).
pub const DIAL_REQUEST_METADATA: &str = "tunnel-dial-bin";
/// Binary metadata carrying the cloud's own `DialResult` on Edge.Reverse.
pub const DIAL_RESULT_METADATA: &str = "tunnel-dial-result-bin";
/// Binary metadata carrying a serialized `PeerHello` (Peer.Routes answers, Peer.Dial calls).
pub const PEER_HELLO_METADATA: &str = "tunnel-peer-bin";
/// Largest message other than a `Chunk` either side accepts. Real ones are a few hundred
/// bytes; the bound keeps a hostile peer from making us allocate.
pub const MAX_MESSAGE_LEN: usize = 64 * 1024;
/// Largest `Chunk` payload: what a receiver accepts, and a bound on `transport.chunk_size`.
pub const MAX_CHUNK: usize = 1 << 20;
/// Largest encoded message on a call that carries chunks: a chunk and its field header.
pub const MAX_CHUNK_MESSAGE: usize = MAX_CHUNK + 16;

/// One message of a byte stream (`message Chunk { bytes data = 1; }` on the wire).
/// `Abort` is never sent: a caller's stream that yields it cancels the call (tonic
/// resets the HTTP/2 stream), a callee's ends the call with ABORTED.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Chunk {
    Data(Bytes),
    Abort(String),
}

/// prost for the control-plane calls (`Edge.Control`, `Peer.Routes`) with no buffer held
/// ahead of need. Such a call lives as long as its edge or replica is connected, and its
/// messages are tens of bytes, while tonic's default buffers take 8 KiB each way for the
/// call's whole life: that is memory per connected edge (docs/benchmarks.md).
pub struct ControlCodec<T, U>(std::marker::PhantomData<fn() -> (T, U)>);

impl<T, U> Default for ControlCodec<T, U> {
    fn default() -> Self {
        Self(std::marker::PhantomData)
    }
}

impl<T, U> Codec for ControlCodec<T, U>
where
    T: Message + Send + 'static,
    U: Message + Default + Send + 'static,
{
    type Encode = T;
    type Decode = U;
    type Encoder = tonic_prost::ProstEncoder<T>;
    type Decoder = tonic_prost::ProstDecoder<U>;

    fn encoder(&mut self) -> Self::Encoder {
        tonic_prost::ProstEncoder::new(BufferSettings::new(0, 32 * 1024))
    }

    fn decoder(&mut self) -> Self::Decoder {
        tonic_prost::ProstDecoder::new(BufferSettings::new(0, 32 * 1024))
    }
}

/// `data` as an encoded `Chunk` message.
pub fn encode_chunk(data: &[u8], dst: &mut impl BufMut) {
    encode_chunk_key(data.len(), dst);
    dst.put_slice(data);
}

/// What an encoded `Chunk` holds before a payload of `len` bytes: the `data` field's key
/// and length, or nothing for an empty payload (protobuf leaves out an empty field).
pub fn encode_chunk_key(len: usize, dst: &mut impl BufMut) {
    if len > 0 {
        dst.put_u8(0x0a); // field 1, length-delimited
        encode_varint(len as u64, dst);
    }
}

/// The length of what `encode_chunk_key` writes.
pub fn chunk_key_len(len: usize) -> usize {
    if len == 0 {
        0
    } else {
        1 + prost::encoding::encoded_len_varint(len as u64)
    }
}

/// The `data` of one encoded `Chunk` message, as protobuf reads it: the last `data`
/// field wins, other fields are skipped.
pub fn decode_chunk(src: &mut impl Buf) -> Result<Bytes, prost::DecodeError> {
    let mut data = Bytes::new();
    while src.has_remaining() {
        let (tag, wire_type) = decode_key(src)?;
        if tag == 1 {
            // Bytes out of the receive buffer without a copy; checks the wire type and
            // the length.
            prost::encoding::bytes::merge(wire_type, &mut data, src, Default::default())?;
        } else {
            skip_field(wire_type, tag, src, Default::default())?;
        }
    }
    Ok(data)
}

/// `msg` as binary metadata, marked never to be indexed by HPACK: each value is one
/// call's (a dial request names its connection), so indexing it only churned the
/// header tables, evicting the entries that do repeat.
pub fn to_metadata<M: Message>(msg: &M) -> BinaryMetadataValue {
    let mut value = BinaryMetadataValue::from_bytes(&msg.encode_to_vec());
    value.set_sensitive(true);
    value
}

/// The message in binary metadata `key`, or what is wrong with it.
pub fn from_metadata<M: Message + Default>(metadata: &MetadataMap, key: &str) -> Result<M, String> {
    let value = metadata
        .get_bin(key)
        .ok_or_else(|| format!("{key} missing"))?;
    let bytes = value
        .to_bytes()
        .map_err(|e| format!("{key} is not base64: {e}"))?;
    M::decode(bytes).map_err(|e| format!("{key} is malformed: {e}"))
}

/// How a dial ended, on both sides and in every direction, as the wire carries it (a
/// failed dial's gRPC code and `DialResult` details). What a proxy client, the metrics
/// and the logs say of each status is `tunnel_user::call::outcome`'s one table.
impl DialStatus {
    fn code(self) -> Code {
        match self {
            DialStatus::Ok => Code::Ok,
            DialStatus::Forbidden => Code::PermissionDenied,
            DialStatus::Refused => Code::Unavailable,
            DialStatus::Timeout => Code::DeadlineExceeded,
            DialStatus::BadRequest | DialStatus::Unspecified => Code::InvalidArgument,
            DialStatus::Overloaded => Code::ResourceExhausted,
            DialStatus::NotHeld => Code::NotFound,
            DialStatus::TunnelFailed => Code::Aborted,
        }
    }
}

impl DialResult {
    /// The status a dial refused with `status` and `message` is answered with.
    pub fn refusal(status: DialStatus, message: String) -> Status {
        DialResult {
            status: status as i32,
            message,
        }
        .into_status()
    }

    /// The status a failed dial is answered with: the matching code, the message, and
    /// the result itself in the details.
    pub fn into_status(self) -> Status {
        let code = self.status().code();
        let details = Bytes::from(self.encode_to_vec());
        Status::with_details(code, self.message, details)
    }

    /// The failed dial a status from the callee stands for: the result in its details
    /// when it carries one, else the nearest status for its code (a status from
    /// somewhere else than our dial, such as a reset stream or a too-large message).
    pub fn from_status(status: &Status) -> DialResult {
        if let Ok(result) = DialResult::decode(status.details())
            && result.status() != DialStatus::Ok
            && result.status() != DialStatus::Unspecified
        {
            return result;
        }
        let dial_status = match status.code() {
            Code::PermissionDenied => DialStatus::Forbidden,
            Code::DeadlineExceeded => DialStatus::Timeout,
            Code::ResourceExhausted => DialStatus::Overloaded,
            Code::InvalidArgument => DialStatus::BadRequest,
            Code::NotFound => DialStatus::NotHeld,
            _ => DialStatus::TunnelFailed,
        };
        DialResult {
            status: dial_status as i32,
            message: status.message().to_string(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The same message as prost would define it from tunnel.proto.
    #[derive(Clone, PartialEq, Message)]
    struct ProstChunk {
        #[prost(bytes = "bytes", tag = "1")]
        data: Bytes,
    }

    #[test]
    fn chunks_are_protobuf_chunk_messages() {
        for len in [0, 1, 127, 128, 70_000] {
            let data = Bytes::from(vec![7u8; len]);
            let mut wire = bytes::BytesMut::new();
            encode_chunk(&data, &mut wire);
            assert_eq!(wire, ProstChunk { data: data.clone() }.encode_to_vec());
            assert_eq!(decode_chunk(&mut wire.freeze()).unwrap(), data);
        }
    }

    #[test]
    fn decoding_follows_protobuf_rules() {
        // An unknown varint field, then two data fields: the last wins.
        let wire = [0x10, 0x05, 0x0a, 0x01, b'a', 0x0a, 0x02, b'b', b'c'];
        assert_eq!(decode_chunk(&mut &wire[..]).unwrap(), &b"bc"[..]);
        // A length past the end, a truncated varint: errors, not panics.
        assert!(decode_chunk(&mut &[0x0a, 0x05, b'a'][..]).is_err());
        assert!(decode_chunk(&mut &[0x0a, 0xff][..]).is_err());
    }

    #[test]
    fn dial_results_survive_the_status_they_travel_in() {
        for status in [
            DialStatus::Forbidden,
            DialStatus::Refused,
            DialStatus::Timeout,
            DialStatus::BadRequest,
            DialStatus::Overloaded,
            DialStatus::NotHeld,
            DialStatus::TunnelFailed,
        ] {
            let result = DialResult {
                status: status as i32,
                message: format!("{status:?} because"),
            };
            assert_eq!(
                DialResult::from_status(&result.clone().into_status()),
                result
            );
        }
        let reset = Status::cancelled("stream reset");
        assert_eq!(
            DialResult::from_status(&reset).status(),
            DialStatus::TunnelFailed
        );
    }
}
