//! A kubelet stand-in: the kubelet's HTTPS API as kube-apiserver uses it for
//! `kubectl logs`, `exec` and `port-forward` (SPDY/3.1 upgrades), bound inside a network namespace so that only the tunnel reaches it.
//! It requires a client certificate from the Kubernetes CA, as a kubelet does.

use std::net::SocketAddr;
use std::os::fd::AsRawFd;
use std::sync::{Arc, Mutex};

use rustls::server::WebPkiClientVerifier;
use rustls_pki_types::pem::PemObject;
use rustls_pki_types::{CertificateDer, PrivateKeyDer};
use std::process::Stdio;
use std::time::Duration;

use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};

use super::apiserver::KubePki;
use super::spdy;

/// What `kubectl logs` of the stand-in's pods prints.
pub const LOG_TEXT: &str = "hello from the kubelet stand-in behind the tunnel\n";

pub struct Kubelet {
    /// Request lines (method and path) in the order they came.
    pub requests: Arc<Mutex<Vec<String>>>,
    stop: Option<tokio::sync::oneshot::Sender<()>>,
    thread: Option<std::thread::JoinHandle<()>>,
}

/// Binds `addr` inside the network namespace `netns` (by name, /run/netns/<name>): a
/// thread of its own enters the namespace, binds and ends; the socket stays there.
fn bind_in_netns(netns: &str, addr: SocketAddr) -> std::net::TcpListener {
    let path = format!("/run/netns/{netns}");
    std::thread::spawn(move || {
        let ns = std::fs::File::open(&path).unwrap_or_else(|e| panic!("{path}: {e}"));
        // SAFETY: setns(2) on an fd we own; it changes only this (short-lived) thread.
        let rc = unsafe { libc::setns(ns.as_raw_fd(), libc::CLONE_NEWNET) };
        assert_eq!(rc, 0, "setns {path}: {}", std::io::Error::last_os_error());
        std::net::TcpListener::bind(addr).unwrap_or_else(|e| panic!("bind {addr}: {e}"))
    })
    .join()
    .expect("bind thread")
}

impl Kubelet {
    /// Serves on `addr` in `netns` with `<cert>.crt`/`.key` of `pki`.
    pub fn start(netns: &str, addr: SocketAddr, pki: &KubePki, cert: &str) -> Self {
        let listener = bind_in_netns(netns, addr);
        listener.set_nonblocking(true).expect("nonblocking");
        let provider = Arc::new(rustls::crypto::ring::default_provider());
        let mut roots = rustls::RootCertStore::empty();
        roots
            .add(CertificateDer::from_pem_file(pki.path("ca.crt")).expect("ca"))
            .expect("add ca");
        let verifier =
            WebPkiClientVerifier::builder_with_provider(Arc::new(roots), provider.clone())
                .build()
                .expect("client verifier");
        let chain =
            vec![CertificateDer::from_pem_file(pki.path(&format!("{cert}.crt"))).expect("cert")];
        let key = PrivateKeyDer::from_pem_file(pki.path(&format!("{cert}.key"))).expect("key");
        let config = rustls::ServerConfig::builder_with_provider(provider)
            .with_safe_default_protocol_versions()
            .expect("versions")
            .with_client_cert_verifier(verifier)
            .with_single_cert(chain, key)
            .expect("server config");
        let acceptor = tokio_rustls::TlsAcceptor::from(Arc::new(config));
        let requests = Arc::new(Mutex::new(Vec::new()));
        let (stop, mut stopped) = tokio::sync::oneshot::channel();
        let seen = requests.clone();
        let thread = std::thread::spawn(move || {
            let rt = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
                .expect("runtime");
            rt.block_on(async move {
                let listener = tokio::net::TcpListener::from_std(listener).expect("listener");
                loop {
                    tokio::select! {
                        _ = &mut stopped => return,
                        accepted = listener.accept() => {
                            let Ok((tcp, _)) = accepted else { continue };
                            let acceptor = acceptor.clone();
                            let seen = seen.clone();
                            tokio::spawn(async move {
                                if let Ok(tls) = acceptor.accept(tcp).await {
                                    let _ = serve(tls, seen).await;
                                }
                            });
                        }
                    }
                }
            });
        });
        Self {
            requests,
            stop: Some(stop),
            thread: Some(thread),
        }
    }

    pub fn requests(&self) -> Vec<String> {
        self.requests
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .clone()
    }
}

impl Drop for Kubelet {
    fn drop(&mut self) {
        if let Some(stop) = self.stop.take() {
            let _ = stop.send(());
        }
        if let Some(thread) = self.thread.take() {
            let _ = thread.join();
        }
    }
}

/// Reads a request head (up to the blank line, byte by byte so that nothing after it
/// is consumed: an upgraded stream's first frames follow directly).
async fn read_head<S: AsyncRead + Unpin>(s: &mut S) -> std::io::Result<String> {
    let mut head = Vec::new();
    let mut byte = [0u8; 1];
    while !head.ends_with(b"\r\n\r\n") {
        if s.read(&mut byte).await? == 0 || head.len() > 16 * 1024 {
            return Err(std::io::ErrorKind::UnexpectedEof.into());
        }
        head.push(byte[0]);
    }
    Ok(String::from_utf8_lossy(&head).into_owned())
}

/// Percent-decoding of a query component (`+` is a space, as Go's url.Values writes).
fn unescape(s: &str) -> String {
    let bytes = s.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        match bytes[i] {
            b'+' => out.push(b' '),
            b'%' if i + 2 < bytes.len() => {
                let hex = std::str::from_utf8(&bytes[i + 1..i + 3]).unwrap_or("");
                match u8::from_str_radix(hex, 16) {
                    Ok(b) => {
                        out.push(b);
                        i += 2;
                    }
                    Err(_) => out.push(b'%'),
                }
            }
            b => out.push(b),
        }
        i += 1;
    }
    String::from_utf8_lossy(&out).into_owned()
}

/// The values of `key` in a query string, in order.
fn query_values(query: &str, key: &str) -> Vec<String> {
    query
        .split('&')
        .filter_map(|pair| pair.split_once('='))
        .filter(|(k, _)| *k == key)
        .map(|(_, v)| unescape(v))
        .collect()
}

/// One request per connection, as kube-apiserver's proxy sends them.
async fn serve<S: AsyncRead + AsyncWrite + Send + Unpin + 'static>(
    mut s: S,
    seen: Arc<Mutex<Vec<String>>>,
) -> std::io::Result<()> {
    let head = read_head(&mut s).await?;
    let mut lines = head.lines();
    let line = lines.next().unwrap_or_default().to_string();
    let headers: Vec<(String, String)> = lines
        .filter_map(|l| l.split_once(':'))
        .map(|(n, v)| (n.trim().to_ascii_lowercase(), v.trim().to_string()))
        .collect();
    let values = |name: &str| -> Vec<String> {
        headers
            .iter()
            .filter(|(n, _)| n == name)
            .flat_map(|(_, v)| v.split(',').map(|v| v.trim().to_string()))
            .collect()
    };
    let upgrade = values("upgrade").join(",").to_ascii_lowercase();
    let mut parts = line.split(' ');
    let method = parts.next().unwrap_or_default();
    let target = parts.next().unwrap_or_default();
    seen.lock()
        .unwrap_or_else(|p| p.into_inner())
        .push(format!("{method} {target} upgrade={upgrade}"));
    let (path, query) = target.split_once('?').unwrap_or((target, ""));
    let protocols = values("x-stream-protocol-version");
    if path.starts_with("/exec/") || path.starts_with("/portForward/") {
        let (wanted, handler) = if path.starts_with("/exec/") {
            (EXEC_PROTOCOL, Handler::Exec)
        } else {
            (PORT_FORWARD_PROTOCOL, Handler::PortForward)
        };
        if upgrade != "spdy/3.1" || !protocols.iter().any(|p| p == wanted) {
            // A real kubelet of 1.28 would also take websocket; the stand-in serves SPDY
            // only, so a websocket client must fall back (kubectl 1.32 does).
            return respond(
                &mut s,
                "400 Bad Request",
                &format!("the stand-in serves {wanted} over SPDY/3.1 only (got upgrade {upgrade:?}, protocols {protocols:?})\n"),
            )
            .await;
        }
        let response = format!(
            "HTTP/1.1 101 Switching Protocols\r\nConnection: Upgrade\r\nUpgrade: SPDY/3.1\r\nX-Stream-Protocol-Version: {wanted}\r\n\r\n"
        );
        s.write_all(response.as_bytes()).await?;
        s.flush().await?;
        return match handler {
            Handler::Exec => exec(s, query).await,
            Handler::PortForward => port_forward(s).await,
        };
    }
    if method == "GET" && path.starts_with("/containerLogs/") {
        respond(&mut s, "200 OK", LOG_TEXT).await
    } else {
        respond(&mut s, "404 Not Found", "not served by the stand-in\n").await
    }
}

const EXEC_PROTOCOL: &str = "v4.channel.k8s.io";
const PORT_FORWARD_PROTOCOL: &str = "portforward.k8s.io";
/// The port the stand-in's pod "listens" on for port-forward: it echoes what it gets.
pub const ECHO_PORT: u16 = 8080;

enum Handler {
    Exec,
    PortForward,
}

async fn respond<S: AsyncWrite + Unpin>(
    s: &mut S,
    status: &str,
    body: &str,
) -> std::io::Result<()> {
    let response = format!(
        "HTTP/1.1 {status}\r\nContent-Type: text/plain\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
        body.len()
    );
    s.write_all(response.as_bytes()).await?;
    s.shutdown().await
}

fn stream_type(stream: &spdy::Stream) -> &str {
    spdy::header(&stream.headers, "streamtype").unwrap_or_default()
}

/// Exec, remotecommand v4: the command runs for real (as a child of the test), its
/// stdio on the SPDY streams, its exit status as a metav1.Status on the error stream.
async fn exec<S: AsyncRead + AsyncWrite + Send + 'static>(
    conn: S,
    query: &str,
) -> std::io::Result<()> {
    let command = query_values(query, "command");
    let flag = |key: &str| {
        query_values(query, key)
            .iter()
            .any(|v| v == "1" || v == "true")
    };
    let (stdin, stdout, stderr) = (flag("input"), flag("output"), flag("error"));
    let (tx, mut streams) = spdy::session(conn);
    let has =
        |s: &[spdy::Stream], kind: &str, on: bool| !on || s.iter().any(|s| stream_type(s) == kind);
    let got = spdy::collect_streams(
        &mut streams,
        |s| {
            has(s, "error", true)
                && has(s, "stdin", stdin)
                && has(s, "stdout", stdout)
                && has(s, "stderr", stderr)
        },
        Duration::from_secs(10),
    )
    .await?;
    let mut by_type: std::collections::HashMap<String, spdy::Stream> = got
        .into_iter()
        .map(|s| (stream_type(&s).to_string(), s))
        .collect();
    let error = by_type.remove("error").expect("error stream");
    let Some((program, args)) = command.split_first() else {
        tx.data(
            error.id,
            br#"{"metadata":{},"status":"Failure","message":"no command"}"#.to_vec(),
        );
        tx.fin(error.id);
        return Ok(());
    };
    let piped = |on: bool| if on { Stdio::piped() } else { Stdio::null() };
    let mut child = tokio::process::Command::new(program)
        .args(args)
        .stdin(piped(stdin))
        .stdout(piped(stdout))
        .stderr(piped(stderr))
        .kill_on_drop(true)
        .spawn()?;
    if let (Some(mut pipe), Some(mut remote)) = (child.stdin.take(), by_type.remove("stdin")) {
        tokio::spawn(async move {
            while let Some(chunk) = remote.incoming.recv().await {
                if pipe.write_all(&chunk).await.is_err() {
                    return;
                }
            }
            // The client's FIN on stdin: the command sees end of input.
            drop(pipe);
        });
    }
    let pump = |pipe: Option<Box<dyn AsyncRead + Send + Unpin>>, stream: Option<spdy::Stream>| {
        let tx = tx.clone();
        tokio::spawn(async move {
            let (Some(mut pipe), Some(stream)) = (pipe, stream) else {
                return;
            };
            let mut buf = vec![0u8; 16 * 1024];
            while let Ok(n @ 1..) = pipe.read(&mut buf).await {
                tx.data(stream.id, buf[..n].to_vec());
            }
            tx.fin(stream.id);
        })
    };
    let out = pump(
        child
            .stdout
            .take()
            .map(|p| Box::new(p) as Box<dyn AsyncRead + Send + Unpin>),
        by_type.remove("stdout"),
    );
    let err = pump(
        child
            .stderr
            .take()
            .map(|p| Box::new(p) as Box<dyn AsyncRead + Send + Unpin>),
        by_type.remove("stderr"),
    );
    let status = tokio::time::timeout(Duration::from_secs(20), child.wait())
        .await
        .map_err(|_| std::io::Error::other("command ran over 20 s"))??;
    let _ = out.await;
    let _ = err.await;
    let code = status.code().unwrap_or(128);
    let status = if code == 0 {
        r#"{"metadata":{},"status":"Success"}"#.to_string()
    } else {
        format!(
            r#"{{"metadata":{{}},"status":"Failure","message":"command terminated with non-zero exit code: exit status {code}","reason":"NonZeroExitCode","details":{{"causes":[{{"reason":"ExitCode","message":"{code}"}}]}}}}"#
        )
    };
    tx.data(error.id, status.into_bytes());
    tx.fin(error.id);
    // Dropping the last sender ends the writer once everything queued is written.
    drop(tx);
    // Let the client close first (bounded), as it does once it has read the status.
    let _ = tokio::time::timeout(Duration::from_secs(5), async {
        while streams.recv().await.is_some() {}
    })
    .await;
    Ok(())
}

/// Port-forward: each forwarded connection is an error stream and a data stream with
/// the same requestid; a data stream for ECHO_PORT gets back what it sends, any other
/// port an error, as a kubelet reports a port nothing listens on.
async fn port_forward<S: AsyncRead + AsyncWrite + Send + 'static>(conn: S) -> std::io::Result<()> {
    let (tx, mut streams) = spdy::session(conn);
    let mut error_streams: std::collections::HashMap<String, u32> = Default::default();
    while let Some(mut stream) = streams.recv().await {
        let request = spdy::header(&stream.headers, "requestid")
            .unwrap_or_default()
            .to_string();
        let port = spdy::header(&stream.headers, "port")
            .unwrap_or_default()
            .to_string();
        match stream_type(&stream) {
            "error" => {
                error_streams.insert(request, stream.id);
            }
            "data" => {
                let error = error_streams.remove(&request);
                let tx = tx.clone();
                tokio::spawn(async move {
                    if port == ECHO_PORT.to_string() {
                        while let Some(chunk) = stream.incoming.recv().await {
                            tx.data(stream.id, chunk);
                        }
                    } else if let Some(error) = error {
                        tx.data(error, format!("no listener on port {port}").into_bytes());
                    }
                    tx.fin(stream.id);
                    if let Some(error) = error {
                        tx.fin(error);
                    }
                });
            }
            _ => {}
        }
    }
    Ok(())
}
