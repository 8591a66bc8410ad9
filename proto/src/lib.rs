//! Wire protocol between tunnel-edge and tunnel-cloud: the prost messages generated from
//! `tunnel.proto`, the names both sides must agree on, and the bounded length-prefixed
//! framing used for the handshake and the control stream.

use bytes::{Buf, BufMut, Bytes, BytesMut};
use prost::Message;
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};

mod generated {
    include!(concat!(env!("OUT_DIR"), "/tunnel.v1.rs"));
}
pub use generated::*;

/// The protocol version this build speaks (see `Hello.protocol_version`).
pub const PROTOCOL_VERSION: u32 = 1;
/// ALPN protocol id on the edge's TLS connection.
pub const ALPN: &[u8] = b"tunnel/1";
/// Path of the per-session control stream.
pub const CONTROL_PATH: &str = "/tunnel.v1/control";
/// Path of a per-connection data stream.
pub const DIAL_PATH: &str = "/tunnel.v1/dial";
/// Path of an edge-to-cloud connection's stream, opened by the cloud on request.
pub const REVERSE_PATH: &str = "/tunnel.v1/reverse";
/// Request header carrying a base64 `DialRequest`.
pub const DIAL_REQUEST_HEADER: &str = "tunnel-dial-bin";
/// Header carrying a base64 `DialResult` (response of a dial, request of a reverse stream).
pub const DIAL_RESULT_HEADER: &str = "tunnel-dial-result-bin";
/// ALPN protocol id on the cloud-to-cloud (replica) connection.
pub const PEER_ALPN: &[u8] = b"tunnel-peer/1";
/// Path of a forwarded connection's stream.
pub const PEER_DIAL_PATH: &str = "/tunnel.v1/peer/dial";
/// Request and response header carrying a base64 `PeerHello`.
pub const PEER_HELLO_HEADER: &str = "tunnel-peer-bin";
/// Largest handshake or control message either side accepts. Real messages are a few
/// hundred bytes; the bound keeps a hostile peer from making us allocate.
pub const MAX_MESSAGE_LEN: usize = 64 * 1024;

#[derive(Debug, thiserror::Error)]
pub enum FrameError {
    #[error("message of {len} bytes exceeds the limit of {MAX_MESSAGE_LEN} bytes")]
    TooLarge { len: usize },
    #[error("malformed message: {0}")]
    Decode(#[from] prost::DecodeError),
    #[error("connection closed")]
    Closed,
    #[error(transparent)]
    Io(#[from] std::io::Error),
}

/// Encodes `msg` as a 4-byte big-endian length followed by the message.
pub fn encode_frame<M: Message>(msg: &M) -> Bytes {
    let len = msg.encoded_len();
    let mut buf = BytesMut::with_capacity(4 + len);
    buf.put_u32(len as u32);
    msg.encode(&mut buf).expect("BytesMut grows as needed");
    buf.freeze()
}

/// Incremental decoder for frames arriving in arbitrary chunks (HTTP/2 DATA frames).
#[derive(Default)]
pub struct FrameDecoder {
    buf: BytesMut,
}

impl FrameDecoder {
    pub fn push(&mut self, chunk: &[u8]) {
        self.buf.extend_from_slice(chunk);
    }

    /// The next complete message, if one has arrived.
    pub fn next_message<M: Message + Default>(&mut self) -> Result<Option<M>, FrameError> {
        if self.buf.len() < 4 {
            return Ok(None);
        }
        let len = u32::from_be_bytes([self.buf[0], self.buf[1], self.buf[2], self.buf[3]]) as usize;
        if len > MAX_MESSAGE_LEN {
            return Err(FrameError::TooLarge { len });
        }
        if self.buf.len() < 4 + len {
            return Ok(None);
        }
        self.buf.advance(4);
        let body = self.buf.split_to(len);
        Ok(Some(M::decode(body)?))
    }
}

/// Reads one frame from a byte stream (the handshake, before HTTP/2 starts).
pub async fn read_frame<M, R>(reader: &mut R) -> Result<M, FrameError>
where
    M: Message + Default,
    R: AsyncRead + Unpin,
{
    let mut len = [0u8; 4];
    match reader.read_exact(&mut len).await {
        Ok(_) => {}
        Err(e) if e.kind() == std::io::ErrorKind::UnexpectedEof => return Err(FrameError::Closed),
        Err(e) => return Err(e.into()),
    }
    let len = u32::from_be_bytes(len) as usize;
    if len > MAX_MESSAGE_LEN {
        return Err(FrameError::TooLarge { len });
    }
    let mut body = vec![0u8; len];
    reader.read_exact(&mut body).await?;
    Ok(M::decode(body.as_slice())?)
}

/// Writes one frame and flushes it.
pub async fn write_frame<M, W>(writer: &mut W, msg: &M) -> Result<(), FrameError>
where
    M: Message,
    W: AsyncWrite + Unpin,
{
    writer.write_all(&encode_frame(msg)).await?;
    writer.flush().await?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn decoder_reassembles_split_frames() {
        let ping = Control {
            msg: Some(control::Msg::Ping(Ping {
                sequence: 7,
                last_rtt_us: 90,
            })),
        };
        let frame = encode_frame(&ping);
        let mut dec = FrameDecoder::default();
        dec.push(&frame[..3]);
        assert!(dec.next_message::<Control>().unwrap().is_none());
        dec.push(&frame[3..]);
        dec.push(&frame);
        assert_eq!(dec.next_message::<Control>().unwrap(), Some(ping.clone()));
        assert_eq!(dec.next_message::<Control>().unwrap(), Some(ping));
        assert!(dec.next_message::<Control>().unwrap().is_none());
    }

    #[test]
    fn decoder_rejects_oversized_length_before_buffering_body() {
        let mut dec = FrameDecoder::default();
        dec.push(&((MAX_MESSAGE_LEN as u32) + 1).to_be_bytes());
        assert!(matches!(
            dec.next_message::<Control>(),
            Err(FrameError::TooLarge { .. })
        ));
    }

    #[test]
    fn decoder_rejects_garbage() {
        let mut dec = FrameDecoder::default();
        dec.push(&[0, 0, 0, 3, 0xff, 0xff, 0xff]);
        assert!(matches!(
            dec.next_message::<Control>(),
            Err(FrameError::Decode(_))
        ));
    }

    #[tokio::test]
    async fn read_frame_round_trips_and_bounds() {
        let hello = Hello {
            protocol_version: PROTOCOL_VERSION,
            node_name: "edge-1".into(),
            ..Default::default()
        };
        let mut bytes = encode_frame(&hello).to_vec();
        let got: Hello = read_frame(&mut bytes.as_slice()).await.unwrap();
        assert_eq!(got, hello);
        bytes.truncate(2);
        assert!(matches!(
            read_frame::<Hello, _>(&mut bytes.as_slice()).await,
            Err(FrameError::Closed)
        ));
        let huge = (10u32 << 20).to_be_bytes();
        assert!(matches!(
            read_frame::<Hello, _>(&mut huge.as_slice()).await,
            Err(FrameError::TooLarge { .. })
        ));
    }
}
