//! Copies one proxied connection between two HTTP/2 streams: on the replica in the
//! middle of a forwarded connection, the stream from the forwarding replica and the
//! stream to the edge. The semantics are `splice`'s: END_STREAM passes on as END_STREAM
//! (half-close), a reset of either stream resets the other (abort), and received bytes
//! are released only once the other stream's window took them, so a slow end holds
//! back its own connection and nothing else.

use std::future::poll_fn;
use std::sync::atomic::{AtomicU64, Ordering};

use bytes::Bytes;
use h2::{Reason, RecvStream, SendStream};

/// One HTTP/2 stream: what we send on it and what we receive from it.
pub struct Stream {
    pub send: SendStream<Bytes>,
    pub recv: RecvStream,
}

#[derive(Debug, Clone)]
pub struct RelayReport {
    /// Bytes received on `a` and sent on `b`.
    pub a_to_b: u64,
    /// Bytes received on `b` and sent on `a`.
    pub b_to_a: u64,
    /// `None` when both directions ended with END_STREAM; why it was aborted otherwise.
    pub aborted: Option<String>,
}

/// Relays `a` and `b` until both directions have finished or either side aborts.
pub async fn relay(mut a: Stream, mut b: Stream) -> RelayReport {
    let a_to_b = AtomicU64::new(0);
    let b_to_a = AtomicU64::new(0);
    let aborted = {
        let forward = pump(&mut a.recv, &mut b.send, &a_to_b);
        let backward = pump(&mut b.recv, &mut a.send, &b_to_a);
        crate::splice::both_directions(forward, backward).await
    };
    if aborted.is_some() {
        // Resetting a stream that is already reset does nothing, so both get one: the
        // end that did not fail learns of the abort, whichever end it was.
        a.send.send_reset(Reason::CANCEL);
        b.send.send_reset(Reason::CANCEL);
    }
    RelayReport { a_to_b: a_to_b.into_inner(), b_to_a: b_to_a.into_inner(), aborted }
}

/// One direction: `recv` into `send` until END_STREAM (passed on) or a failure.
async fn pump(recv: &mut RecvStream, send: &mut SendStream<Bytes>, count: &AtomicU64) -> Result<(), String> {
    loop {
        let data = tokio::select! {
            d = recv.data() => d,
            r = poll_fn(|cx| send.poll_reset(cx)) => return Err(match r {
                Ok(reason) => format!("stream reset by peer ({reason:?})"),
                Err(e) => e.to_string(),
            }),
        };
        match data {
            None => return send.send_data(Bytes::new(), true).map_err(|e| e.to_string()),
            Some(Err(e)) => return Err(e.to_string()),
            Some(Ok(data)) => {
                let n = data.len();
                crate::splice::send_all(send, data).await?;
                count.fetch_add(n as u64, Ordering::Relaxed);
                let _ = recv.flow_control().release_capacity(n);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    use tokio::io::duplex;

    /// A client and server connection over an in-memory pipe; returns the client's
    /// sender and the server's accept side, with the connection driven in the background.
    async fn pair() -> (h2::client::SendRequest<Bytes>, h2::server::Connection<tokio::io::DuplexStream, Bytes>) {
        let (c, s) = duplex(1 << 20);
        let server = tokio::spawn(h2::server::handshake(s));
        let (sender, conn) = h2::client::handshake(c).await.expect("client handshake");
        tokio::spawn(async move {
            let _ = conn.await;
        });
        (sender, server.await.expect("join").expect("server handshake"))
    }

    /// Opens a stream from `sender` to `server`; returns both ends.
    async fn open(
        sender: &mut h2::client::SendRequest<Bytes>,
        server: &mut h2::server::Connection<tokio::io::DuplexStream, Bytes>,
    ) -> (Stream, Stream) {
        let req = http::Request::post("http://x/").body(()).expect("in-memory h2");
        let (response, client_send) = sender.clone().ready().await.expect("in-memory h2").send_request(req, false).expect("in-memory h2");
        let (req, mut respond) = server.accept().await.expect("in-memory h2").expect("in-memory h2");
        let server_send = respond.send_response(http::Response::new(()), false).expect("in-memory h2");
        // The answer only leaves while the server connection is polled.
        let client_recv = tokio::select! {
            r = response => r.expect("in-memory h2").into_body(),
            _ = std::future::poll_fn(|cx| server.poll_closed(cx)) => panic!("server connection closed"),
        };
        (Stream { send: client_send, recv: client_recv }, Stream { send: server_send, recv: req.into_body() })
    }

    /// Drives a server connection's accept loop once its streams are open.
    fn drive(mut server: h2::server::Connection<tokio::io::DuplexStream, Bytes>) {
        tokio::spawn(async move { while server.accept().await.is_some() {} });
    }

    async fn read_all(recv: &mut RecvStream) -> Result<Vec<u8>, h2::Error> {
        let mut out = Vec::new();
        while let Some(d) = recv.data().await {
            let d = d?;
            let _ = recv.flow_control().release_capacity(d.len());
            out.extend_from_slice(&d);
        }
        Ok(out)
    }

    /// outer client -> [middle server | middle client] -> inner server, relayed in the middle.
    async fn chain() -> (Stream, Stream, tokio::task::JoinHandle<RelayReport>) {
        let (mut s1, mut c1) = pair().await;
        let (outer, middle_in) = open(&mut s1, &mut c1).await;
        drive(c1);
        let (mut s2, mut c2) = pair().await;
        let (middle_out, inner) = open(&mut s2, &mut c2).await;
        drive(c2);
        let relay = tokio::spawn(relay(middle_in, middle_out));
        (outer, inner, relay)
    }

    #[tokio::test]
    async fn data_and_half_close_pass_both_ways() {
        let (mut outer, mut inner, relay) = chain().await;
        let big = Bytes::from(vec![7u8; 3 << 20]);
        let sender = tokio::spawn(async move {
            crate::splice::send_all(&mut outer.send, big).await.expect("in-memory h2");
            outer.send.send_data(Bytes::new(), true).expect("in-memory h2");
            outer
        });
        // The inner end reads everything and sees END_STREAM, then answers after it.
        let got = read_all(&mut inner.recv).await.expect("in-memory h2");
        assert_eq!(got.len(), 3 << 20);
        inner.send.send_data(Bytes::from_static(b"answer after FIN"), true).expect("in-memory h2");
        let mut outer = sender.await.expect("in-memory h2");
        assert_eq!(read_all(&mut outer.recv).await.expect("in-memory h2"), b"answer after FIN");
        let report = relay.await.expect("in-memory h2");
        assert_eq!((report.a_to_b, report.b_to_a, report.aborted), (3 << 20, 16, None));
    }

    #[tokio::test]
    async fn a_reset_on_one_end_resets_the_other() {
        let (outer, mut inner, relay) = chain().await;
        let mut outer = outer;
        outer.send.send_data(Bytes::from_static(b"partial"), false).expect("in-memory h2");
        let mut first = inner.recv.data().await.expect("in-memory h2").expect("in-memory h2");
        assert_eq!(&first.split_to(7)[..], b"partial");
        outer.send.send_reset(Reason::CANCEL);
        let err = read_all(&mut inner.recv).await.expect_err("the inner end must see a reset, not END_STREAM");
        assert_eq!(err.reason(), Some(Reason::CANCEL));
        assert!(relay.await.expect("in-memory h2").aborted.is_some());
    }
}
