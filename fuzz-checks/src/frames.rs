//! gRPC messages as the tunnel's calls carry them: length-prefixed frames (a flag byte,
//! a 4-byte big-endian length, the message) of every message type that arrives from a
//! peer: `Hello`, `HelloReply` and `Control` (Edge.Control), `RouteUpdate`
//! (Peer.Routes), and `Chunk` (the byte streams), which `proto::chunk_call` decodes
//! itself instead of through prost.
//!
//! Properties:
//! - `proto::decode_chunk` agrees with prost on every input: the same bytes when prost
//!   accepts the message as a `Chunk`, an error when prost refuses it;
//! - every decoded message re-encodes into bytes that decode to the same message;
//! - no message is taken from a frame longer than the bound the calls set
//!   (`MAX_CHUNK_MESSAGE`).

use std::fmt::Debug;

use bytes::Bytes;
use prost::Message;
use proto::{Control, Hello, HelloReply, MAX_CHUNK_MESSAGE, RouteUpdate};

/// Input: one byte picks the message type, the rest is the stream of frames.
pub fn check(data: &[u8]) {
    let [kind, stream @ ..] = data else {
        return;
    };
    let (bodies, _end) = split(stream);
    for body in bodies {
        assert!(body.len() <= MAX_CHUNK_MESSAGE);
        match kind % 5 {
            0 => round_trip::<Hello>(body),
            1 => round_trip::<HelloReply>(body),
            2 => round_trip::<Control>(body),
            3 => round_trip::<RouteUpdate>(body),
            _ => check_chunk(body),
        }
    }
}

/// How a stream of frames ends.
#[derive(Debug, PartialEq)]
pub(crate) enum End {
    /// Every complete frame was taken; the rest (maybe nothing) is an incomplete frame.
    NeedMore,
    /// A frame longer than `MAX_CHUNK_MESSAGE` (tonic answers OUT_OF_RANGE).
    TooLarge(usize),
    /// A frame flagged compressed (the calls negotiate no compression).
    Compressed,
}

/// The gRPC framing as specified: the message bodies, and how the stream ends.
pub(crate) fn split(stream: &[u8]) -> (Vec<&[u8]>, End) {
    let mut bodies = Vec::new();
    let mut rest = stream;
    loop {
        let Some((head, after)) = rest.split_first_chunk::<5>() else {
            return (bodies, End::NeedMore);
        };
        if head[0] != 0 {
            return (bodies, End::Compressed);
        }
        let len = u32::from_be_bytes([head[1], head[2], head[3], head[4]]) as usize;
        if len > MAX_CHUNK_MESSAGE {
            return (bodies, End::TooLarge(len));
        }
        if after.len() < len {
            return (bodies, End::NeedMore);
        }
        let (body, next) = after.split_at(len);
        bodies.push(body);
        rest = next;
    }
}

/// `msgs` as a stream of gRPC frames.
pub(crate) fn frames<M: Message>(msgs: &[M]) -> Vec<u8> {
    msgs.iter()
        .flat_map(|m| {
            let body = m.encode_to_vec();
            let mut frame = vec![0];
            frame.extend_from_slice(&(body.len() as u32).to_be_bytes());
            frame.extend(body);
            frame
        })
        .collect()
}

fn round_trip<M: Message + Default + PartialEq + Debug>(body: &[u8]) {
    if let Ok(m) = M::decode(body) {
        let again = M::decode(m.encode_to_vec().as_slice()).expect("a re-encoded message decodes");
        assert_eq!(again, m, "re-encoding changed the message");
    }
}

/// `message Chunk { bytes data = 1; }` as prost would generate it from tunnel.proto.
#[derive(Clone, PartialEq, Message)]
pub(crate) struct ProstChunk {
    #[prost(bytes = "bytes", tag = "1")]
    pub data: Bytes,
}

fn check_chunk(body: &[u8]) {
    let ours = proto::decode_chunk(&mut Bytes::copy_from_slice(body));
    let prost = ProstChunk::decode(body);
    match (&ours, &prost) {
        (Ok(data), Ok(reference)) => assert_eq!(data, &reference.data),
        (Err(_), Err(_)) => {}
        _ => panic!("decode_chunk {ours:?} but prost {prost:?}"),
    }
    if let Ok(data) = ours {
        let mut encoded = Vec::new();
        proto::encode_chunk(&data, &mut encoded);
        assert_eq!(
            proto::decode_chunk(&mut Bytes::from(encoded)).expect("re-encoded chunk"),
            data
        );
    }
}
