//! Server side of SPDY/3.1 as the kubelet speaks it to kube-apiserver's upgrade proxy
//! for exec and port-forward (the client side being kubectl's, client-go's spdystream):
//! SYN_STREAM / SYN_REPLY / DATA / RST_STREAM / PING / GOAWAY / WINDOW_UPDATE frames,
//! header blocks compressed by zlib with the SPDY/3 dictionary, one compression context
//! per direction for the whole connection. Flow control is acknowledged (a
//! WINDOW_UPDATE for what arrives), not enforced: the tests send little.

use std::collections::HashMap;
use std::time::Duration;

use flate2::{Compress, Compression, Decompress, FlushCompress, FlushDecompress};
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};
use tokio::sync::mpsc;

const VERSION: u16 = 3;
const SYN_STREAM: u16 = 1;
const SYN_REPLY: u16 = 2;
const RST_STREAM: u16 = 3;
const PING: u16 = 6;
const GOAWAY: u16 = 7;
const WINDOW_UPDATE: u16 = 9;
const FLAG_FIN: u8 = 0x01;
/// Bigger frames end the session: nothing the tests send comes near it.
const MAX_FRAME: usize = 1 << 20;

/// The header names of the SPDY/3 compression dictionary (draft-mbelshe-spdy-3,
/// 2.6.10.1), each preceded by its 32-bit length in the dictionary.
const DICTIONARY_WORDS: &[&str] = &[
    "options",
    "head",
    "post",
    "put",
    "delete",
    "trace",
    "accept",
    "accept-charset",
    "accept-encoding",
    "accept-language",
    "accept-ranges",
    "age",
    "allow",
    "authorization",
    "cache-control",
    "connection",
    "content-base",
    "content-encoding",
    "content-language",
    "content-length",
    "content-location",
    "content-md5",
    "content-range",
    "content-type",
    "date",
    "etag",
    "expect",
    "expires",
    "from",
    "host",
    "if-match",
    "if-modified-since",
    "if-none-match",
    "if-range",
    "if-unmodified-since",
    "last-modified",
    "location",
    "max-forwards",
    "pragma",
    "proxy-authenticate",
    "proxy-authorization",
    "range",
    "referer",
    "retry-after",
    "server",
    "te",
    "trailer",
    "transfer-encoding",
    "upgrade",
    "user-agent",
    "vary",
    "via",
    "warning",
    "www-authenticate",
    "method",
    "get",
    "status",
    "200 OK",
    "version",
    "HTTP/1.1",
    "url",
    "public",
    "set-cookie",
    "keep-alive",
    "origin",
];
/// The rest of the dictionary, as is.
const DICTIONARY_TAIL: &str = concat!(
    "100101201202205206300302303304305306307402405406407408409410411412413414415416417",
    "502504505203 Non-Authoritative Information204 No Content301 Moved Permanently",
    "400 Bad Request401 Unauthorized403 Forbidden404 Not Found500 Internal Server Error",
    "501 Not Implemented503 Service UnavailableJan Feb Mar Apr May Jun Jul Aug Sept Oct ",
    "Nov Dec 00:00:00 Mon, Tue, Wed, Thu, Fri, Sat, Sun, GMTchunked,text/html,image/png,",
    "image/jpg,image/gif,application/xml,application/xhtml+xml,text/plain,text/javascript,",
    "publicprivatemax-age=gzip,deflate,sdchcharset=utf-8charset=iso-8859-1,utf-,*,enq=0.",
);

fn dictionary() -> Vec<u8> {
    let mut dict = Vec::with_capacity(1423);
    for word in DICTIONARY_WORDS {
        dict.extend_from_slice(&(word.len() as u32).to_be_bytes());
        dict.extend_from_slice(word.as_bytes());
    }
    dict.extend_from_slice(DICTIONARY_TAIL.as_bytes());
    dict
}

fn protocol_error(what: impl std::fmt::Display) -> std::io::Error {
    std::io::Error::new(std::io::ErrorKind::InvalidData, what.to_string())
}

/// Name/value pairs of a header block (names are lower case in SPDY/3).
pub type Headers = Vec<(String, String)>;

pub fn header<'a>(headers: &'a Headers, name: &str) -> Option<&'a str> {
    headers
        .iter()
        .find(|(n, _)| n == name)
        .map(|(_, v)| v.as_str())
}

fn decode_header_block(block: &[u8]) -> std::io::Result<Headers> {
    let mut at = 0;
    let take = |at: &mut usize, len: usize| -> std::io::Result<&[u8]> {
        let bytes = block
            .get(*at..*at + len)
            .ok_or_else(|| protocol_error("header block truncated"))?;
        *at += len;
        Ok(bytes)
    };
    let word = |at: &mut usize| -> std::io::Result<usize> {
        let bytes = take(at, 4)?;
        Ok(u32::from_be_bytes(bytes.try_into().expect("4 bytes")) as usize)
    };
    let count = word(&mut at)?;
    let mut headers = Vec::new();
    for _ in 0..count.min(256) {
        let len = word(&mut at)?;
        let name = String::from_utf8_lossy(take(&mut at, len)?).into_owned();
        let len = word(&mut at)?;
        let value = String::from_utf8_lossy(take(&mut at, len)?).into_owned();
        headers.push((name, value));
    }
    Ok(headers)
}

/// Inflates one header block; the context continues across blocks.
fn inflate(z: &mut Decompress, dict: &[u8], mut input: &[u8]) -> std::io::Result<Vec<u8>> {
    let mut out = Vec::with_capacity(1024);
    for _ in 0..1024 {
        if out.capacity() - out.len() < 512 {
            out.reserve(4096);
        }
        let before = z.total_in();
        let result = z.decompress_vec(input, &mut out, FlushDecompress::Sync);
        input = &input[(z.total_in() - before) as usize..];
        if let Err(e) = result {
            let Some(wanted) = e.needs_dictionary() else {
                return Err(protocol_error(e));
            };
            let ours = z.set_dictionary(dict).map_err(protocol_error)?;
            if ours != wanted {
                return Err(protocol_error(format!(
                    "header block wants dictionary {wanted:#x}, the SPDY/3 one is {ours:#x}"
                )));
            }
            continue;
        }
        if input.is_empty() && out.capacity() - out.len() >= 512 {
            return Ok(out);
        }
    }
    Err(protocol_error("header block does not end"))
}

/// Deflates one header block with a sync flush, so the peer can read it whole.
fn deflate(z: &mut Compress, mut input: &[u8]) -> Vec<u8> {
    let mut out = Vec::with_capacity(256);
    loop {
        if out.capacity() - out.len() < 128 {
            out.reserve(1024);
        }
        let before = z.total_in();
        z.compress_vec(input, &mut out, FlushCompress::Sync)
            .expect("deflate");
        input = &input[(z.total_in() - before) as usize..];
        if input.is_empty() && out.capacity() - out.len() >= 128 {
            return out;
        }
    }
}

fn frame_head(word: u32, flags: u8, len: usize) -> Vec<u8> {
    let mut frame = Vec::with_capacity(8 + len);
    frame.extend_from_slice(&word.to_be_bytes());
    frame.extend_from_slice(&((u32::from(flags) << 24) | len as u32).to_be_bytes());
    frame
}

fn control(kind: u16, payload: &[u8]) -> Vec<u8> {
    let word = (u32::from(0x8000 | VERSION) << 16) | u32::from(kind);
    let mut frame = frame_head(word, 0, payload.len());
    frame.extend_from_slice(payload);
    frame
}

/// What the session's writer sends.
enum Out {
    Reply(u32),
    Data {
        stream: u32,
        data: Vec<u8>,
        fin: bool,
    },
    Ping(u32),
    WindowUpdate {
        stream: u32,
        delta: u32,
    },
}

/// A stream the client opened: its headers and what it sends (the channel ends at its
/// FIN or RST_STREAM).
pub struct Stream {
    pub id: u32,
    pub headers: Headers,
    pub incoming: mpsc::UnboundedReceiver<Vec<u8>>,
}

/// Sends on the session; cheap to clone.
#[derive(Clone)]
pub struct Sender(mpsc::UnboundedSender<Out>);

impl Sender {
    pub fn data(&self, stream: u32, data: Vec<u8>) {
        let _ = self.0.send(Out::Data {
            stream,
            data,
            fin: false,
        });
    }

    /// Half-closes `stream` from our side.
    pub fn fin(&self, stream: u32) {
        let _ = self.0.send(Out::Data {
            stream,
            data: Vec::new(),
            fin: true,
        });
    }
}

/// Runs the framing over `conn` (after the 101): every SYN_STREAM is answered with a
/// SYN_REPLY and handed over on the returned channel. The writer ends when every
/// [`Sender`] is gone and the reader with the connection.
pub fn session<S>(conn: S) -> (Sender, mpsc::UnboundedReceiver<Stream>)
where
    S: AsyncRead + AsyncWrite + Send + 'static,
{
    let (mut rd, mut wr) = tokio::io::split(conn);
    let (out_tx, mut out_rx) = mpsc::unbounded_channel::<Out>();
    let (streams_tx, streams_rx) = mpsc::unbounded_channel();
    let dict = dictionary();

    let writer_dict = dict.clone();
    tokio::spawn(async move {
        let mut z = Compress::new(Compression::default(), true);
        z.set_dictionary(&writer_dict).expect("deflate dictionary");
        while let Some(out) = out_rx.recv().await {
            let frame = match out {
                Out::Reply(id) => {
                    let mut payload = id.to_be_bytes().to_vec();
                    // An empty header block: zero name/value pairs.
                    payload.extend(deflate(&mut z, &0u32.to_be_bytes()));
                    control(SYN_REPLY, &payload)
                }
                Out::Data { stream, data, fin } => {
                    let mut frame = frame_head(stream, if fin { FLAG_FIN } else { 0 }, data.len());
                    frame.extend(data);
                    frame
                }
                Out::Ping(id) => control(PING, &id.to_be_bytes()),
                Out::WindowUpdate { stream, delta } => {
                    let mut payload = stream.to_be_bytes().to_vec();
                    payload.extend_from_slice(&delta.to_be_bytes());
                    control(WINDOW_UPDATE, &payload)
                }
            };
            if wr.write_all(&frame).await.is_err() {
                return;
            }
        }
        let _ = wr.shutdown().await;
    });

    let sender = Sender(out_tx);
    let out = sender.0.downgrade();
    tokio::spawn(async move {
        let mut z = Decompress::new(true);
        let mut open: HashMap<u32, mpsc::UnboundedSender<Vec<u8>>> = HashMap::new();
        let send = |o: Out| {
            if let Some(out) = out.upgrade() {
                let _ = out.send(o);
            }
        };
        loop {
            let mut head = [0u8; 8];
            if rd.read_exact(&mut head).await.is_err() {
                return;
            }
            let flags = head[4];
            let len = u32::from_be_bytes([0, head[5], head[6], head[7]]) as usize;
            if len > MAX_FRAME {
                return;
            }
            let mut payload = vec![0u8; len];
            if rd.read_exact(&mut payload).await.is_err() {
                return;
            }
            let word = |at: usize| {
                payload
                    .get(at..at + 4)
                    .map(|b| u32::from_be_bytes(b.try_into().expect("4 bytes")) & 0x7fff_ffff)
            };
            if head[0] & 0x80 == 0 {
                let id = u32::from_be_bytes(head[0..4].try_into().expect("4 bytes"));
                if !payload.is_empty() {
                    send(Out::WindowUpdate {
                        stream: id,
                        delta: payload.len() as u32,
                    });
                    if let Some(tx) = open.get(&id) {
                        let _ = tx.send(payload);
                    }
                }
                if flags & FLAG_FIN != 0 {
                    open.remove(&id);
                }
                continue;
            }
            match u16::from_be_bytes([head[2], head[3]]) {
                SYN_STREAM => {
                    // Stream id, associated stream id, priority and slot, header block.
                    let (Some(id), Some(block)) = (word(0), payload.get(10..)) else {
                        return;
                    };
                    let headers =
                        match inflate(&mut z, &dict, block).and_then(|b| decode_header_block(&b)) {
                            Ok(h) => h,
                            Err(e) => {
                                eprintln!("kubelet stand-in: SYN_STREAM {id}: {e}");
                                return;
                            }
                        };
                    let (tx, incoming) = mpsc::unbounded_channel();
                    if flags & FLAG_FIN == 0 {
                        open.insert(id, tx);
                    }
                    send(Out::Reply(id));
                    let _ = streams_tx.send(Stream {
                        id,
                        headers,
                        incoming,
                    });
                }
                RST_STREAM => {
                    if let Some(id) = word(0) {
                        open.remove(&id);
                    }
                }
                PING => {
                    if let Some(id) = word(0) {
                        send(Out::Ping(id));
                    }
                }
                GOAWAY => return,
                // SETTINGS, WINDOW_UPDATE, HEADERS: nothing to act on at the tests' sizes.
                _ => {}
            }
        }
    });
    (sender, streams_rx)
}

/// Waits (bounded) for streams until `complete` says the set is whole.
pub async fn collect_streams(
    streams: &mut mpsc::UnboundedReceiver<Stream>,
    complete: impl Fn(&[Stream]) -> bool,
    limit: Duration,
) -> std::io::Result<Vec<Stream>> {
    let mut got = Vec::new();
    let deadline = tokio::time::Instant::now() + limit;
    while !complete(&got) {
        match tokio::time::timeout_at(deadline, streams.recv()).await {
            Ok(Some(stream)) => got.push(stream),
            Ok(None) => return Err(protocol_error("connection ended before all streams")),
            Err(_) => return Err(protocol_error("streams did not arrive in time")),
        }
    }
    Ok(got)
}
