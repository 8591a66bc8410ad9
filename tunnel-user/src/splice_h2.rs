//! Copies one proxied connection between two HTTP/2 streams: on the replica in the
//! middle of a forwarded connection, the stream from the forwarding replica and the
//! stream to the edge. The semantics are `splice`'s: END_STREAM passes on as END_STREAM
//! (half-close), a reset of either stream resets the other (abort), and received bytes
//! are released only once the other stream's window took them, so a slow end holds
//! back its own connection and nothing else. As there, a stream may be relayed before
//! its far end has answered the dial (`relay_dialing`).

use std::convert::Infallible;
use std::future::poll_fn;
use std::sync::atomic::{AtomicU64, Ordering};

use bytes::Bytes;
use h2::{Reason, RecvStream, SendStream};

use crate::splice::Answered;

/// One HTTP/2 stream: what we send on it and what we receive from it.
pub struct Stream {
    pub send: SendStream<Bytes>,
    pub recv: RecvStream,
}

#[derive(Debug, Clone)]
pub struct RelayReport<E = Infallible> {
    /// Bytes received on `a` and sent on `b`.
    pub a_to_b: u64,
    /// Bytes received on `b` and sent on `a`.
    pub b_to_a: u64,
    /// `None` when both directions ended with END_STREAM; why it was aborted otherwise.
    pub aborted: Option<String>,
    /// Why `b`'s far end refused the dial (`relay_dialing`); `aborted` says so too.
    pub refused: Option<E>,
}

/// Relays `a` and `b` until both directions have finished or either side aborts.
pub async fn relay(a: Stream, b: Stream) -> RelayReport {
    relay_dialing(a.recv, b.send, std::future::ready(Ok((b.recv, a.send)))).await
}

/// `relay` for a stream `b` whose far end has not answered its dial yet: what arrives
/// on `a` flows into `b` at once, and `answer` waits for b's answer, answers `a` in
/// turn, and gives b's receiving half and a's sending half, or why b's far end refused.
pub async fn relay_dialing<E>(
    mut a_recv: RecvStream,
    mut b_send: SendStream<Bytes>,
    answer: impl Future<Output = Result<(RecvStream, SendStream<Bytes>), E>>,
) -> RelayReport<E> {
    let a_to_b = AtomicU64::new(0);
    let b_to_a = AtomicU64::new(0);
    let answered = Answered::not_yet();
    let mut a_send = None;
    let mut refused = None;
    let aborted = {
        let forward = async {
            match pump(&mut a_recv, &mut b_send, &a_to_b).await {
                Err(Failed::Send(why)) => answered.send_failed(why),
                Err(Failed::Recv(why)) => Err(why),
                Ok(()) => Ok(()),
            }
        };
        let backward = async {
            let (mut b_recv, send) = answer.await.map_err(|e| {
                refused = Some(e);
                "the far end refused the dial".to_string()
            })?;
            answered.set();
            pump(&mut b_recv, a_send.insert(send), &b_to_a)
                .await
                .map_err(Failed::why)
        };
        crate::splice::both_directions(forward, backward).await
    };
    if aborted.is_some() {
        // Resetting a stream that is already reset does nothing, so both get one: the
        // end that did not fail learns of the abort, whichever end it was. Before the
        // answer `a` has no sending half yet; dropping its unanswered response resets it.
        if let Some(a_send) = a_send.as_mut() {
            a_send.send_reset(Reason::CANCEL);
        }
        b_send.send_reset(Reason::CANCEL);
    }
    RelayReport {
        a_to_b: a_to_b.into_inner(),
        b_to_a: b_to_a.into_inner(),
        aborted,
        refused,
    }
}

/// Which side of a pump failed.
enum Failed {
    Recv(String),
    Send(String),
}

impl Failed {
    fn why(self) -> String {
        match self {
            Failed::Recv(why) | Failed::Send(why) => why,
        }
    }
}

/// One direction: `recv` into `send` until END_STREAM (passed on) or a failure.
async fn pump(
    recv: &mut RecvStream,
    send: &mut SendStream<Bytes>,
    count: &AtomicU64,
) -> Result<(), Failed> {
    loop {
        let data = tokio::select! {
            d = recv.data() => d,
            r = poll_fn(|cx| send.poll_reset(cx)) => return Err(Failed::Send(match r {
                Ok(reason) => format!("stream reset by peer ({reason:?})"),
                Err(e) => e.to_string(),
            })),
        };
        match data {
            None => {
                return send
                    .send_data(Bytes::new(), true)
                    .map_err(|e| Failed::Send(e.to_string()));
            }
            Some(Err(e)) => return Err(Failed::Recv(e.to_string())),
            Some(Ok(data)) => {
                let n = data.len();
                crate::splice::send_all(send, data)
                    .await
                    .map_err(Failed::Send)?;
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
    async fn pair() -> (
        h2::client::SendRequest<Bytes>,
        h2::server::Connection<tokio::io::DuplexStream, Bytes>,
    ) {
        let (c, s) = duplex(1 << 20);
        let server = tokio::spawn(h2::server::handshake(s));
        let (sender, conn) = h2::client::handshake(c).await.expect("client handshake");
        tokio::spawn(async move {
            let _ = conn.await;
        });
        (
            sender,
            server.await.expect("join").expect("server handshake"),
        )
    }

    /// Opens a stream from `sender` to `server`; returns both ends.
    async fn open(
        sender: &mut h2::client::SendRequest<Bytes>,
        server: &mut h2::server::Connection<tokio::io::DuplexStream, Bytes>,
    ) -> (Stream, Stream) {
        let req = http::Request::post("http://x/")
            .body(())
            .expect("in-memory h2");
        let (response, client_send) = sender
            .clone()
            .ready()
            .await
            .expect("in-memory h2")
            .send_request(req, false)
            .expect("in-memory h2");
        let (req, mut respond) = server
            .accept()
            .await
            .expect("in-memory h2")
            .expect("in-memory h2");
        let server_send = respond
            .send_response(http::Response::new(()), false)
            .expect("in-memory h2");
        // The answer only leaves while the server connection is polled.
        let client_recv = tokio::select! {
            r = response => r.expect("in-memory h2").into_body(),
            _ = std::future::poll_fn(|cx| server.poll_closed(cx)) => panic!("server connection closed"),
        };
        (
            Stream {
                send: client_send,
                recv: client_recv,
            },
            Stream {
                send: server_send,
                recv: req.into_body(),
            },
        )
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
            crate::splice::send_all(&mut outer.send, big)
                .await
                .expect("in-memory h2");
            outer
                .send
                .send_data(Bytes::new(), true)
                .expect("in-memory h2");
            outer
        });
        // The inner end reads everything and sees END_STREAM, then answers after it.
        let got = read_all(&mut inner.recv).await.expect("in-memory h2");
        assert_eq!(got.len(), 3 << 20);
        inner
            .send
            .send_data(Bytes::from_static(b"answer after FIN"), true)
            .expect("in-memory h2");
        let mut outer = sender.await.expect("in-memory h2");
        assert_eq!(
            read_all(&mut outer.recv).await.expect("in-memory h2"),
            b"answer after FIN"
        );
        let report = relay.await.expect("in-memory h2");
        assert_eq!(
            (report.a_to_b, report.b_to_a, report.aborted),
            (3 << 20, 16, None)
        );
    }

    #[tokio::test]
    async fn a_reset_on_one_end_resets_the_other() {
        let (outer, mut inner, relay) = chain().await;
        let mut outer = outer;
        outer
            .send
            .send_data(Bytes::from_static(b"partial"), false)
            .expect("in-memory h2");
        let mut first = inner
            .recv
            .data()
            .await
            .expect("in-memory h2")
            .expect("in-memory h2");
        assert_eq!(&first.split_to(7)[..], b"partial");
        outer.send.send_reset(Reason::CANCEL);
        let err = read_all(&mut inner.recv)
            .await
            .expect_err("the inner end must see a reset, not END_STREAM");
        assert_eq!(err.reason(), Some(Reason::CANCEL));
        assert!(relay.await.expect("in-memory h2").aborted.is_some());
    }

    /// What `dialing_chain` returns: the outer end's sending half and response, the
    /// inner end's request and responder, and the relay in the middle.
    struct Dialing {
        outer_send: SendStream<Bytes>,
        outer_response: h2::client::ResponseFuture,
        inner_request: http::Request<RecvStream>,
        inner_respond: h2::server::SendResponse<Bytes>,
        relay: tokio::task::JoinHandle<RelayReport<String>>,
    }

    /// `chain`, with the middle relaying before the inner end has answered: it passes
    /// the inner end's status on to the outer end once it comes, and `late` after that.
    async fn dialing_chain(late: std::time::Duration) -> Dialing {
        let post = || {
            http::Request::post("http://x/")
                .body(())
                .expect("in-memory h2")
        };
        let (s1, mut c1) = pair().await;
        let (outer_response, outer_send) = s1
            .ready()
            .await
            .expect("in-memory h2")
            .send_request(post(), false)
            .expect("in-memory h2");
        let (middle_request, mut middle_respond) = c1
            .accept()
            .await
            .expect("in-memory h2")
            .expect("in-memory h2");
        drive(c1);
        let (s2, mut c2) = pair().await;
        let (inner_response, middle_send) = s2
            .ready()
            .await
            .expect("in-memory h2")
            .send_request(post(), false)
            .expect("in-memory h2");
        let (inner_request, inner_respond) = c2
            .accept()
            .await
            .expect("in-memory h2")
            .expect("in-memory h2");
        drive(c2);
        let answer = async move {
            let response = inner_response.await.map_err(|e| e.to_string())?;
            tokio::time::sleep(late).await;
            if response.status() != http::StatusCode::OK {
                let mut refusal = http::Response::new(());
                *refusal.status_mut() = response.status();
                let _ = middle_respond.send_response(refusal, true);
                return Err(format!("refused with {}", response.status()));
            }
            let send = middle_respond
                .send_response(http::Response::new(()), false)
                .map_err(|e| e.to_string())?;
            Ok((response.into_body(), send))
        };
        let relay = tokio::spawn(relay_dialing(
            middle_request.into_body(),
            middle_send,
            answer,
        ));
        Dialing {
            outer_send,
            outer_response,
            inner_request,
            inner_respond,
            relay,
        }
    }

    #[tokio::test]
    async fn bytes_sent_before_the_answer_reach_the_far_end_and_the_answer_comes_back() {
        let Dialing {
            mut outer_send,
            outer_response,
            inner_request,
            mut inner_respond,
            relay,
        } = dialing_chain(std::time::Duration::ZERO).await;
        outer_send
            .send_data(Bytes::from_static(b"sent before any answer"), true)
            .expect("in-memory h2");
        // The inner end reads them before it answers (an edge would not): the middle
        // passed them on without waiting.
        let mut inner_recv = inner_request.into_body();
        assert_eq!(
            read_all(&mut inner_recv).await.expect("in-memory h2"),
            b"sent before any answer"
        );
        let mut inner_send = inner_respond
            .send_response(http::Response::new(()), false)
            .expect("in-memory h2");
        inner_send
            .send_data(Bytes::from_static(b"answer"), true)
            .expect("in-memory h2");
        let response = outer_response.await.expect("in-memory h2");
        assert_eq!(response.status(), http::StatusCode::OK);
        assert_eq!(
            read_all(&mut response.into_body())
                .await
                .expect("in-memory h2"),
            b"answer"
        );
        let report = relay.await.expect("in-memory h2");
        assert_eq!(
            (report.a_to_b, report.b_to_a, report.aborted, report.refused),
            (22, 6, None, None)
        );
    }

    #[tokio::test]
    async fn a_refusal_after_early_bytes_reaches_the_outer_end_as_the_answer() {
        let Dialing {
            mut outer_send,
            outer_response,
            inner_request,
            mut inner_respond,
            relay,
        } = dialing_chain(std::time::Duration::from_millis(50)).await;
        outer_send
            .send_data(Bytes::from_static(b"early"), false)
            .expect("in-memory h2");
        // Refuse without reading: h2 then resets the stream with NO_ERROR (RFC 9113
        // section 8.1), which must not end the relay before the answer is passed on.
        // The middle takes the answer late, so the reset reaches it first.
        let mut refusal = http::Response::new(());
        *refusal.status_mut() = http::StatusCode::FORBIDDEN;
        inner_respond
            .send_response(refusal, true)
            .expect("in-memory h2");
        drop((inner_request, inner_respond));
        let response = outer_response
            .await
            .expect("the outer end must get the refusal, not a reset");
        assert_eq!(response.status(), http::StatusCode::FORBIDDEN);
        let report = relay.await.expect("in-memory h2");
        assert_eq!(
            report.refused.as_deref(),
            Some("refused with 403 Forbidden")
        );
        assert!(report.aborted.is_some());
        assert_eq!(report.b_to_a, 0);
    }
}
