//! A kubelet stand-in: the kubelet's HTTPS API as kube-apiserver uses it for
//! `kubectl logs`, bound inside a network namespace so that only the tunnel reaches it.
//! It requires a client certificate from the Kubernetes CA, as a kubelet does.

use std::net::SocketAddr;
use std::os::fd::AsRawFd;
use std::sync::{Arc, Mutex};

use rustls::server::WebPkiClientVerifier;
use rustls_pki_types::pem::PemObject;
use rustls_pki_types::{CertificateDer, PrivateKeyDer};
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};

use super::apiserver::KubePki;

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

/// One request per connection, as kube-apiserver's proxy sends them.
async fn serve<S: AsyncRead + AsyncWrite + Unpin>(
    mut s: S,
    seen: Arc<Mutex<Vec<String>>>,
) -> std::io::Result<()> {
    let head = read_head(&mut s).await?;
    let line = head.lines().next().unwrap_or_default().to_string();
    let mut parts = line.split(' ');
    let method = parts.next().unwrap_or_default();
    let target = parts.next().unwrap_or_default();
    seen.lock()
        .unwrap_or_else(|p| p.into_inner())
        .push(format!("{method} {target}"));
    let path = target.split('?').next().unwrap_or_default();
    let (status, body) = if method == "GET" && path.starts_with("/containerLogs/") {
        ("200 OK", LOG_TEXT)
    } else {
        ("404 Not Found", "not served by the stand-in\n")
    };
    let response = format!(
        "HTTP/1.1 {status}\r\nContent-Type: text/plain\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
        body.len()
    );
    s.write_all(response.as_bytes()).await?;
    s.shutdown().await
}
