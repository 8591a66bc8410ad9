//! Length-prefixed protocol messages: `proto::FrameDecoder` (the control stream and the
//! replicas' route stream, fed HTTP/2 DATA frames of any size) and `proto::read_frame`
//! (the Hello handshake, read straight from the TLS stream), for every message type that
//! arrives from a peer: `Hello` (edge -> cloud), `HelloReply` (cloud -> edge), `Control`
//! (both ways) and `RouteUpdate` (replica -> replica).
//!
//! Properties:
//! - the decoder agrees with a reference model of the framing (4-byte big-endian length,
//!   then the body): the same messages, then the same end (more bytes needed, a length
//!   over `MAX_MESSAGE_LEN` reported as `TooLarge` with that length, or a malformed body);
//!   so no message comes from a body longer than `MAX_MESSAGE_LEN`;
//! - the result does not depend on how the bytes are cut into chunks: one chunk, two
//!   chunks split at a point the input chooses, and one byte at a time all agree;
//! - `read_frame` agrees with the decoder on the first frame, and says `Closed` for
//!   fewer than 4 bytes;
//! - every decoded message re-encodes (`encode_frame`) into a frame that decodes to the
//!   same message.

use std::fmt::Debug;
use std::pin::pin;
use std::task::{Context, Poll, Waker};

use prost::Message;
use proto::{Control, FrameDecoder, FrameError, Hello, HelloReply, MAX_MESSAGE_LEN, RouteUpdate};

/// Input: one byte picks the message type, one byte the split point, the rest is the
/// byte stream.
pub fn check(data: &[u8]) {
    let [kind, split, stream @ ..] = data else {
        return;
    };
    let split = if stream.is_empty() {
        0
    } else {
        *split as usize * stream.len() / 255
    };
    match kind % 4 {
        0 => check_stream::<Hello>(stream, split),
        1 => check_stream::<HelloReply>(stream, split),
        2 => check_stream::<Control>(stream, split),
        _ => check_stream::<RouteUpdate>(stream, split),
    }
}

/// How a stream of frames ends.
#[derive(Debug, PartialEq)]
pub(crate) enum End {
    /// Every complete frame was a message; the rest (maybe nothing) is an incomplete frame.
    NeedMore,
    TooLarge(usize),
    Malformed,
}

/// The framing as specified, written independently of `FrameDecoder`.
pub(crate) fn reference<M: Message + Default>(stream: &[u8]) -> (Vec<M>, End) {
    let mut messages = Vec::new();
    let mut rest = stream;
    loop {
        let Some((len, after)) = rest.split_first_chunk::<4>() else {
            return (messages, End::NeedMore);
        };
        let len = u32::from_be_bytes(*len) as usize;
        if len > MAX_MESSAGE_LEN {
            return (messages, End::TooLarge(len));
        }
        if after.len() < len {
            return (messages, End::NeedMore);
        }
        let (body, next) = after.split_at(len);
        match M::decode(body) {
            Ok(m) => messages.push(m),
            Err(_) => return (messages, End::Malformed),
        }
        rest = next;
    }
}

/// What a caller of `FrameDecoder` sees: it pushes each chunk, takes messages until the
/// decoder wants more, and gives up at the first error.
pub(crate) fn decode_chunks<'a, M: Message + Default>(
    chunks: impl IntoIterator<Item = &'a [u8]>,
) -> (Vec<M>, End) {
    let mut decoder = FrameDecoder::default();
    let mut messages = Vec::new();
    for chunk in chunks {
        decoder.push(chunk);
        loop {
            match decoder.next_message::<M>() {
                Ok(Some(m)) => messages.push(m),
                Ok(None) => break,
                Err(FrameError::TooLarge { len }) => return (messages, End::TooLarge(len)),
                Err(FrameError::Decode(_)) => return (messages, End::Malformed),
                Err(e) => panic!("FrameDecoder returned an error only I/O can cause: {e}"),
            }
        }
    }
    (messages, End::NeedMore)
}

fn check_stream<M: Message + Default + PartialEq + Debug>(stream: &[u8], split: usize) {
    let expected = reference::<M>(stream);
    let whole = decode_chunks::<M>([stream]);
    assert_eq!(whole, expected, "FrameDecoder disagrees with the framing");
    let (a, b) = stream.split_at(split.min(stream.len()));
    assert_eq!(
        decode_chunks::<M>([a, b]),
        expected,
        "split at {split}: different result"
    );
    // One byte at a time is quadratic in nothing (the buffer only grows), but keep long
    // inputs fast.
    if stream.len() <= 4096 {
        assert_eq!(
            decode_chunks::<M>(stream.chunks(1)),
            expected,
            "one byte at a time: different result"
        );
    }

    check_read_frame::<M>(stream, &expected);

    for m in &expected.0 {
        let frame = proto::encode_frame(m);
        let (again, end) = decode_chunks::<M>([&frame[..]]);
        if frame.len() - 4 <= MAX_MESSAGE_LEN {
            assert_eq!(
                (again.as_slice(), end),
                (std::slice::from_ref(m), End::NeedMore),
                "re-encoded message decodes differently"
            );
        } else {
            // Possible only through fields that re-encode longer than they arrived (a
            // negative enum value sent as a 5-byte varint comes back as 10 bytes).
            assert_eq!(end, End::TooLarge(frame.len() - 4));
        }
    }
}

/// `read_frame` over the same bytes: an in-memory reader is always ready, so one poll
/// finishes it.
fn check_read_frame<M: Message + Default + PartialEq + Debug>(
    stream: &[u8],
    expected: &(Vec<M>, End),
) {
    let mut reader = stream;
    let mut fut = pin!(proto::read_frame::<M, _>(&mut reader));
    let Poll::Ready(got) = fut.as_mut().poll(&mut Context::from_waker(Waker::noop())) else {
        panic!("read_frame over a byte slice did not finish in one poll");
    };
    match (got, expected) {
        (Ok(m), (msgs, _)) if !msgs.is_empty() => assert_eq!(&m, &msgs[0]),
        (Err(FrameError::TooLarge { len }), (msgs, End::TooLarge(want))) if msgs.is_empty() => {
            assert_eq!(len, *want)
        }
        (Err(FrameError::Decode(_)), (msgs, End::Malformed)) if msgs.is_empty() => {}
        (Err(FrameError::Closed), (msgs, End::NeedMore)) if msgs.is_empty() && stream.len() < 4 => {
        }
        (Err(FrameError::Io(e)), (msgs, End::NeedMore))
            if msgs.is_empty()
                && stream.len() >= 4
                && e.kind() == std::io::ErrorKind::UnexpectedEof => {}
        (got, expected) => panic!("read_frame returned {got:?}, the decoder {expected:?}"),
    }
}
