//! A cloud and its edges in the test's own runtime, the way mini-redis tests its server:
//! `cloud::run` and `edge::run` on their configs, every listener on port 0, both stopped
//! by a cancellation token. The cloud runs as the binary runs it, so forwards, the HTTPS
//! entry and the CONNECT unix socket serve too, and their addresses are read from its
//! ready file.
//!
//! A test that waits out a timeout or a heartbeat runs under
//! `#[tokio::test(start_paused = true)]`, where it takes no wall time: with nothing else
//! to do, the runtime moves its clock to the next timer. So it drives its blocking
//! clients ([`blocking`]) on the blocking pool, where the clock waits for them, and waits
//! for log lines ([`InProcess::wait_log`]) by notification, never by polling. A client in
//! the runtime (timed on its clock) talks to targets in the runtime too
//! ([`echo_server`]): while a target on a thread of its own (`servers::sink`) works on
//! an answer, the clock may move on to the next timer. So may it, on a loaded machine,
//! while the kernel still carries bytes between two sockets of the runtime; a test that
//! waits out no timer runs on the real clock (`#[tokio::test]`).
//!
//! Logs: one subscriber for the test's thread (the runtime is single-threaded, so every
//! task logs there), its lines told apart by target (`tunnel_user::cloud` or `::edge`).

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Condvar, Mutex};
use std::time::{Duration, Instant};

use tokio::net::TcpListener;
use tokio::sync::Notify;
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;
use toml::Table;
use tunnel_user::cloud::{Capabilities, run};
use tunnel_user::config::{CloudConfig, EdgeConfig};

use super::{EdgeOpts, Ready, Setup};

/// Whose log lines: the cloud's, the edges', or any (code both run, as `io`'s
/// listeners).
#[derive(Clone, Copy, Debug)]
pub enum Side {
    Cloud,
    Edge,
    Any,
}

impl Side {
    fn target(self) -> &'static str {
        match self {
            Side::Cloud => "tunnel_user::cloud",
            Side::Edge => "tunnel_user::edge",
            Side::Any => "",
        }
    }
}

/// Every line logged in the test, and a wake-up for whoever waits for one.
#[derive(Clone, Default)]
pub struct Logs(Arc<LogsInner>);

#[derive(Default)]
struct LogsInner {
    text: Mutex<String>,
    grew: Notify,
    /// The same wake-up for a waiter outside any runtime ([`Threaded`]'s).
    grew_blocking: Condvar,
}

impl Logs {
    pub fn text(&self) -> String {
        self.0.text.lock().unwrap().clone()
    }

    /// The lines logged by `side`'s code.
    pub fn lines(&self, side: Side) -> Vec<String> {
        self.text()
            .lines()
            .filter(|l| l.contains(side.target()))
            .map(str::to_owned)
            .collect()
    }

    /// Waits, at most `bound` (in the runtime's time), for a line of `side` with every
    /// one of `needles`; returns it.
    pub async fn wait(&self, side: Side, needles: &[&str], bound: Duration) -> String {
        let found = || {
            self.lines(side)
                .into_iter()
                .find(|l| needles.iter().all(|n| l.contains(n)))
        };
        let what = format!("a {side:?} line with {needles:?}");
        self.until(found, bound, &what).await
    }

    /// Waits, at most `bound`, until `side` has logged `times` lines with every one of
    /// `needles`.
    pub async fn wait_count(&self, side: Side, needles: &[&str], times: usize, bound: Duration) {
        let found = || (self.count(side, needles) >= times).then_some(());
        let what = format!("{times} {side:?} lines with {needles:?}");
        self.until(found, bound, &what).await
    }

    /// How many lines `side` has logged so far with every one of `needles`.
    pub fn count(&self, side: Side, needles: &[&str]) -> usize {
        let has_all = |l: &&String| needles.iter().all(|n| l.contains(n));
        self.lines(side).iter().filter(has_all).count()
    }

    /// Waits until the cloud or an edge has written `file`, its ready file (it says so
    /// once every listener serves), and reads it.
    pub async fn ready(&self, file: &Path) -> Ready {
        let name = file.display().to_string();
        let reported = || {
            let text = self.text();
            let line = text
                .lines()
                .find(|l| l.contains(READY_REPORTED) && l.contains(&name));
            line.map(|_| Ready::parse(&std::fs::read_to_string(file).expect("a ready file")))
        };
        let what = format!("{name} written");
        self.until(reported, Duration::from_secs(10), &what).await
    }

    /// A subscriber that writes here, filtered as a `Proc`'s log is.
    fn subscriber(&self) -> impl tracing::Subscriber + Send + Sync + use<> {
        tracing_subscriber::fmt()
            .with_env_filter(tracing_subscriber::EnvFilter::new(LOG_FILTER))
            .with_ansi(false)
            .with_writer(self.clone())
            .finish()
    }

    /// [`Self::wait`] for a caller outside any runtime: blocks its thread.
    pub fn wait_blocking(&self, side: Side, needles: &[&str], bound: Duration) -> String {
        let found = |text: &str| {
            text.lines()
                .filter(|l| l.contains(side.target()))
                .find(|l| needles.iter().all(|n| l.contains(n)))
                .map(str::to_owned)
        };
        let what = format!("a {side:?} line with {needles:?}");
        self.until_blocking(found, bound, &what)
    }

    /// [`Self::wait_count`] for a caller outside any runtime.
    pub fn wait_count_blocking(&self, side: Side, needles: &[&str], times: usize, bound: Duration) {
        let found = |text: &str| {
            let has_all =
                |l: &&str| l.contains(side.target()) && needles.iter().all(|n| l.contains(n));
            (text.lines().filter(has_all).count() >= times).then_some(())
        };
        let what = format!("{times} {side:?} lines with {needles:?}");
        self.until_blocking(found, bound, &what)
    }

    /// [`Self::until`] on the condition variable, for a thread outside any runtime.
    fn until_blocking<T>(
        &self,
        found: impl Fn(&str) -> Option<T>,
        bound: Duration,
        what: &str,
    ) -> T {
        let deadline = Instant::now() + bound;
        let mut text = self.0.text.lock().unwrap();
        loop {
            if let Some(it) = found(&text) {
                return it;
            }
            let Some(left) = deadline.checked_duration_since(Instant::now()) else {
                // Not while holding the lock: a poisoned log could not be printed again.
                let log = text.clone();
                drop(text);
                panic!("no {what} within {bound:?}; log:\n{log}");
            };
            text = self.0.grew_blocking.wait_timeout(text, left).unwrap().0;
        }
    }

    /// Looks with `found` at each new line until it finds something; panics with `what`
    /// and the log after `bound`.
    async fn until<T>(&self, found: impl Fn() -> Option<T>, bound: Duration, what: &str) -> T {
        let wait = async {
            loop {
                let grew = self.0.grew.notified();
                tokio::pin!(grew);
                // Registered before the look, so a line logged in between wakes it.
                grew.as_mut().enable();
                if let Some(it) = found() {
                    return it;
                }
                grew.await;
            }
        };
        match tokio::time::timeout(bound, wait).await {
            Ok(it) => it,
            Err(_) => panic!("no {what} within {bound:?}; log:\n{}", self.text()),
        }
    }
}

impl std::io::Write for Logs {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        self.0
            .text
            .lock()
            .unwrap()
            .push_str(&String::from_utf8_lossy(buf));
        self.0.grew.notify_waiters();
        self.0.grew_blocking.notify_all();
        Ok(buf.len())
    }

    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

impl<'a> tracing_subscriber::fmt::MakeWriter<'a> for Logs {
    type Writer = Logs;

    fn make_writer(&'a self) -> Self::Writer {
        self.clone()
    }
}

/// Runs `f` on the blocking pool: a client of the blocking helpers (`connect_via`,
/// `round_trip`, `metric`) must not block the runtime that serves it, and while it runs
/// the paused clock stays where it is.
pub async fn blocking<T: Send + 'static>(f: impl FnOnce() -> T + Send + 'static) -> T {
    tokio::task::spawn_blocking(f).await.expect("blocking task")
}

/// The log filter of the cloud and edges in process, and of a `Proc`: a line reads the
/// same either way.
pub(super) const LOG_FILTER: &str = "info,tunnel_user=debug";

/// What `ops::ready` logs once the ready file is written: every listener serves.
const READY_REPORTED: &str = "listeners reported in the ready file";

/// What a [`Threaded`] run that returned an error logs, before the error.
const RUN_FAILED: &str = "the run failed";

/// A cloud serving in this runtime, with a [`Setup`]'s config, PKI and token file; its
/// addresses (`s.tunnel`, `s.connect`, `s.cloud_admin`) are where it listens.
pub struct InProcess {
    pub s: Setup,
    /// What the cloud reported in its ready file: every listener's address.
    pub ready: Ready,
    pub logs: Logs,
    stop: CancellationToken,
    cloud: Option<JoinHandle<anyhow::Result<()>>>,
    edges: usize,
    _log_guard: tracing::subscriber::DefaultGuard,
}

impl InProcess {
    /// A cloud with `tokens` as its token file and `extra` merged into its config
    /// ([`Setup::cloud_config`]).
    pub async fn start(tokens: &str, extra: Table) -> Self {
        let s = Setup::new(tokens);
        let config = s.cloud_config(extra);
        Self::start_with(s, config).await
    }

    /// A cloud of `s` with `config` as its whole config, run as the binary runs it
    /// (`cloud::run`): every listener it names is bound, on the port it names (port 0
    /// for a [`Setup`]'s), and reported in its ready file, read into [`Self::ready`] and
    /// `s`'s addresses once the cloud says it wrote it.
    pub async fn start_with(mut s: Setup, config: Table) -> Self {
        let logs = Logs::default();
        let log_guard = tracing::subscriber::set_default(logs.subscriber());
        let path = s.path().join("cloud.toml");
        let config =
            CloudConfig::parse(&path, &toml::to_string(&config).unwrap()).expect("cloud config");
        let ready_file = s.path().join("cloud.ready");
        let stop = CancellationToken::new();
        // The test process's capabilities are the test's (a privileged test may follow).
        let keep = Capabilities::Keep;
        let cloud = tokio::spawn(run(config, Some(ready_file.clone()), stop.clone(), keep));
        let ready = logs.ready(&ready_file).await;
        s.tunnel = ready.addr("tunnel.listen");
        s.connect = ready.addr("connect.listen");
        s.cloud_admin = ready.addr("admin.listen");
        Self {
            s,
            ready,
            logs,
            stop,
            cloud: Some(cloud),
            edges: 0,
            _log_guard: log_guard,
        }
    }

    pub fn path(&self) -> &Path {
        self.s.path()
    }

    /// Starts an edge in this runtime, configured as [`Setup::edge_config`] does.
    pub fn start_edge(&mut self, opts: EdgeOpts<'_>) -> Edge {
        let config = self.s.edge_config(&opts);
        self.start_edge_with(opts.node, config)
    }

    /// Starts an edge of `node` (a node's or a cluster's name) in this runtime with
    /// `config` as its whole config.
    pub fn start_edge_with(&mut self, node: &str, config: Table) -> Edge {
        self.edges += 1;
        let name = format!("edge-{node}-{}", self.edges);
        let path = self.path().join(format!("{name}.toml"));
        let text = toml::to_string(&config).unwrap();
        let config = EdgeConfig::parse(&path, &text, None).expect("edge config");
        let ready_file = self.path().join(format!("{name}.ready"));
        let stop = CancellationToken::new();
        let run = tunnel_user::edge::run(config, Some(ready_file.clone()), None, stop.clone());
        Edge {
            node: node.to_owned(),
            logs: self.logs.clone(),
            stop,
            task: Some(tokio::spawn(run)),
            ready_file,
        }
    }

    /// [`Self::start_edge`], then waits until the cloud has registered it: one more
    /// registration of its node than before it started.
    pub async fn start_ready_edge(&mut self, opts: EdgeOpts<'_>) -> Edge {
        let node = format!("node={}", opts.node);
        let registered = ["edge registered", node.as_str()];
        let before = self.logs.count(Side::Cloud, &registered);
        let edge = self.start_edge(opts);
        self.logs
            .wait_count(
                Side::Cloud,
                &registered,
                before + 1,
                Duration::from_secs(10),
            )
            .await;
        edge
    }

    pub async fn wait_log(&self, side: Side, needle: &str, bound: Duration) -> String {
        self.logs.wait(side, &[needle], bound).await
    }

    /// Stops the cloud: its task, which ends once it has drained.
    pub fn stop_cloud(&mut self) -> JoinHandle<anyhow::Result<()>> {
        self.stop.cancel();
        self.cloud.take().expect("the cloud is running")
    }
}

impl Drop for InProcess {
    fn drop(&mut self) {
        self.stop.cancel();
    }
}

/// An edge running in the test's runtime.
pub struct Edge {
    pub node: String,
    logs: Logs,
    stop: CancellationToken,
    task: Option<JoinHandle<anyhow::Result<()>>>,
    ready_file: PathBuf,
}

impl Edge {
    /// Where its admin listener is, once it serves (registered or not).
    pub async fn admin(&self) -> SocketAddr {
        self.ready().await.addr("admin.listen")
    }

    /// What it reported in its ready file, once every listener serves.
    pub async fn ready(&self) -> Ready {
        self.logs.ready(&self.ready_file).await
    }

    /// Stops it and waits for its run to end.
    pub async fn stop(mut self) -> anyhow::Result<()> {
        self.stop.cancel();
        let task = self.task.take().expect("running");
        tokio::time::timeout(Duration::from_secs(15), task)
            .await
            .expect("the edge stops")
            .expect("the edge's task")
    }
}

impl Drop for Edge {
    fn drop(&mut self) {
        self.stop.cancel();
    }
}

/// A cloud or an edge on a thread of its own, in a runtime and with a log of its own,
/// driven as a [`super::Proc`] is (`ready`, `wait_log`, `log_text`), from a test on the
/// real clock: for a test that runs several clouds (replicas linked to each other),
/// whose lines must be told apart, and that one stops and starts again. Each runtime
/// has one thread, so every task it spawns logs to its own [`Logs`].
pub struct Threaded {
    pub name: String,
    pub logs: Logs,
    ready_file: PathBuf,
    stop: CancellationToken,
    ended: std::sync::mpsc::Receiver<anyhow::Result<()>>,
}

impl Threaded {
    /// `cloud::run` on `config`, as the binary runs it; returns once it serves.
    pub fn cloud(dir: &Path, name: &str, config: Table) -> Self {
        let cloud = Self::cloud_starting(dir, name, config);
        cloud.ready();
        cloud
    }

    /// `cloud::run` on `config`, returning at once: for a cloud that waits for
    /// something before it serves ([`Threaded::ready`] waits for it to serve).
    pub fn cloud_starting(dir: &Path, name: &str, config: Table) -> Self {
        let path = dir.join(format!("{name}.toml"));
        let config =
            CloudConfig::parse(&path, &toml::to_string(&config).unwrap()).expect("cloud config");
        // The test process's capabilities are the test's, as in [`InProcess`].
        Self::spawn(dir, name, move |ready, stop| {
            run(config, Some(ready), stop, Capabilities::Keep)
        })
    }

    /// `edge::run` on `config`; returns once its listeners serve (registered or not).
    pub fn edge(dir: &Path, name: &str, config: Table) -> Self {
        let path = dir.join(format!("{name}.toml"));
        let text = toml::to_string(&config).unwrap();
        let config = EdgeConfig::parse(&path, &text, None).expect("edge config");
        let edge = Self::spawn(dir, name, move |ready, stop| {
            tunnel_user::edge::run(config, Some(ready), None, stop)
        });
        edge.ready();
        edge
    }

    fn spawn<F, Fut>(dir: &Path, name: &str, serve: F) -> Self
    where
        F: FnOnce(PathBuf, CancellationToken) -> Fut + Send + 'static,
        Fut: Future<Output = anyhow::Result<()>>,
    {
        let logs = Logs::default();
        let ready_file = dir.join(format!("{name}.ready"));
        let stop = CancellationToken::new();
        let (done, ended) = std::sync::mpsc::channel();
        let (subscriber, file, token) = (logs.subscriber(), ready_file.clone(), stop.clone());
        std::thread::Builder::new()
            .name(name.to_owned())
            .spawn(move || {
                let _log = tracing::subscriber::set_default(subscriber);
                let runtime = tokio::runtime::Builder::new_current_thread()
                    .enable_all()
                    .build()
                    .expect("runtime");
                let ended = runtime.block_on(serve(file, token));
                // Into its log, which a wait that fails prints: a run that ends before it
                // serves (a port taken) says why, and at once.
                if let Err(e) = &ended {
                    tracing::error!("{RUN_FAILED}: {e:#}");
                }
                let _ = done.send(ended);
            })
            .expect("a thread");
        Self {
            name: name.to_owned(),
            logs,
            ready_file,
            stop,
            ended,
        }
    }

    /// What it reported in its ready file: every listener's address.
    pub fn ready(&self) -> Ready {
        let name = self.ready_file.display().to_string();
        let reported = |text: &str| {
            text.lines()
                .find(|l| {
                    (l.contains(READY_REPORTED) && l.contains(&name)) || l.contains(RUN_FAILED)
                })
                .map(str::to_owned)
        };
        let what = format!("{name} written");
        let line = self
            .logs
            .until_blocking(reported, Duration::from_secs(10), &what);
        assert!(
            !line.contains(RUN_FAILED),
            "{} ended before it served; log:\n{}",
            self.name,
            self.log_text()
        );
        Ready::parse(&std::fs::read_to_string(&self.ready_file).expect("a ready file"))
    }

    pub fn log_text(&self) -> String {
        self.logs.text()
    }

    /// Waits until it has logged a line with every one of `needles`; returns the line.
    pub fn wait_line(&self, needles: &[&str], bound: Duration) -> String {
        self.logs.wait_blocking(Side::Any, needles, bound)
    }

    pub fn wait_log(&self, needle: &str, bound: Duration) {
        self.wait_line(&[needle], bound);
    }

    pub fn wait_log_count(&self, needle: &str, times: usize, bound: Duration) {
        self.logs
            .wait_count_blocking(Side::Any, &[needle], times, bound);
    }

    /// Stops it (a cloud drains) and waits, at most 30 s, for its run to end.
    pub fn stop(self) -> anyhow::Result<()> {
        self.stop.cancel();
        self.ended
            .recv_timeout(Duration::from_secs(30))
            .unwrap_or_else(|e| {
                panic!("{} did not stop: {e}; log:\n{}", self.name, self.log_text())
            })
    }
}

impl Drop for Threaded {
    fn drop(&mut self) {
        self.stop.cancel();
        if std::thread::panicking() {
            eprintln!("----- {} log -----\n{}", self.name, self.log_text());
        }
    }
}

/// A target in this runtime that echoes every connection's bytes back.
pub async fn echo_server() -> SocketAddr {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move {
        while let Ok((mut conn, _)) = listener.accept().await {
            tokio::spawn(async move {
                let (mut r, mut w) = conn.split();
                let _ = tokio::io::copy(&mut r, &mut w).await;
            });
        }
    });
    addr
}

/// `CONNECT authority` through the proxy at `proxy`, from this runtime: the status line
/// of the answer, and the stream after its head.
pub async fn connect(
    proxy: SocketAddr,
    authority: &str,
) -> (String, tokio::io::BufReader<tokio::net::TcpStream>) {
    connect_from(proxy.ip(), proxy, authority).await
}

/// [`connect`] from the address `source` (another loopback address is another client).
pub async fn connect_from(
    source: std::net::IpAddr,
    proxy: SocketAddr,
    authority: &str,
) -> (String, tokio::io::BufReader<tokio::net::TcpStream>) {
    use tokio::io::{AsyncBufReadExt as _, AsyncWriteExt as _};
    let socket = match source {
        std::net::IpAddr::V4(_) => tokio::net::TcpSocket::new_v4(),
        std::net::IpAddr::V6(_) => tokio::net::TcpSocket::new_v6(),
    }
    .unwrap();
    socket.bind(SocketAddr::new(source, 0)).unwrap();
    let mut tcp = socket.connect(proxy).await.unwrap();
    tcp.write_all(format!("CONNECT {authority} HTTP/1.1\r\nHost: {authority}\r\n\r\n").as_bytes())
        .await
        .unwrap();
    let mut tcp = tokio::io::BufReader::new(tcp);
    let mut status = String::new();
    tcp.read_line(&mut status).await.unwrap();
    loop {
        let mut line = String::new();
        if tcp.read_line(&mut line).await.unwrap() == 0 || line == "\r\n" {
            break;
        }
    }
    (status, tcp)
}

/// Writes `bytes` on `conn` and reads, expecting a reset, as `common::assert_reset` does
/// from a blocking client. The reset may come before the write or after it.
pub async fn expect_reset(
    conn: &mut (impl tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin),
    bytes: &[u8],
) {
    use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};
    let mut buf = [0u8; 16];
    let outcome = match conn.write_all(bytes).await {
        Ok(()) => conn
            .read(&mut buf)
            .await
            .map(|n| eprintln!("read {n} bytes")),
        Err(e) => Err(e),
    };
    let err =
        outcome.expect_err("a refused dial must reset the client, not end the stream cleanly");
    assert_eq!(err.kind(), std::io::ErrorKind::ConnectionReset, "{err}");
}

/// Sends `bytes` on `conn` and expects them back (through an [`echo_server`]).
pub async fn echoes(conn: &mut tokio::io::BufReader<tokio::net::TcpStream>, bytes: &[u8]) {
    use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};
    conn.get_mut().write_all(bytes).await.unwrap();
    let mut back = vec![0u8; bytes.len()];
    conn.read_exact(&mut back).await.unwrap();
    assert_eq!(back, bytes);
}

/// A TCP proxy in this runtime between edge and cloud that can black-hole traffic (a
/// partition: bytes vanish, nothing is closed), as `probe::FaultProxy` does from its
/// threads; in the runtime, a paused clock moves only when the bytes have moved.
pub struct FaultProxy {
    pub addr: SocketAddr,
    partitioned: Arc<std::sync::atomic::AtomicBool>,
    task: JoinHandle<()>,
}

impl FaultProxy {
    pub async fn start(upstream: SocketAddr) -> Self {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let partitioned = Arc::new(std::sync::atomic::AtomicBool::new(false));
        let cut = partitioned.clone();
        let task = tokio::spawn(async move {
            while let Ok((client, _)) = listener.accept().await {
                let Ok(server) = tokio::net::TcpStream::connect(upstream).await else {
                    continue;
                };
                let (client_r, client_w) = client.into_split();
                let (server_r, server_w) = server.into_split();
                tokio::spawn(pump(client_r, server_w, cut.clone()));
                tokio::spawn(pump(server_r, client_w, cut.clone()));
            }
        });
        Self {
            addr,
            partitioned,
            task,
        }
    }

    pub fn partition(&self, on: bool) {
        self.partitioned
            .store(on, std::sync::atomic::Ordering::Relaxed);
    }
}

impl Drop for FaultProxy {
    fn drop(&mut self) {
        self.task.abort();
    }
}

/// Copies `from` to `to`, dropping the bytes while `partitioned` is on.
async fn pump(
    mut from: tokio::net::tcp::OwnedReadHalf,
    mut to: tokio::net::tcp::OwnedWriteHalf,
    partitioned: Arc<std::sync::atomic::AtomicBool>,
) {
    use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};
    let mut buf = vec![0u8; 64 * 1024];
    loop {
        let n = match from.read(&mut buf).await {
            Ok(0) | Err(_) => break,
            Ok(n) => n,
        };
        if partitioned.load(std::sync::atomic::Ordering::Relaxed) {
            continue;
        }
        if to.write_all(&buf[..n]).await.is_err() {
            break;
        }
    }
    let _ = to.shutdown().await;
}

/// Whether `conn` is ended by the far side within `bound`, reading what comes until then.
pub async fn ends_within(
    conn: &mut tokio::io::BufReader<tokio::net::TcpStream>,
    bound: Duration,
) -> bool {
    use tokio::io::AsyncReadExt as _;
    let mut buf = [0u8; 4096];
    let end = async { while conn.read(&mut buf).await.is_ok_and(|n| n > 0) {} };
    tokio::time::timeout(bound, end).await.is_ok()
}

/// A TCP proxy in this runtime that delays every chunk by `one_way` in each direction:
/// a WAN link between edge and cloud. In
/// paused time the delay is the runtime's clock, so a round trip measured on that clock
/// is the link's plus nothing a loaded machine adds.
pub struct DelayProxy {
    pub addr: SocketAddr,
    task: JoinHandle<()>,
}

impl DelayProxy {
    pub async fn start(upstream: SocketAddr, one_way: Duration) -> Self {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let task = tokio::spawn(async move {
            while let Ok((client, _)) = listener.accept().await {
                let Ok(server) = tokio::net::TcpStream::connect(upstream).await else {
                    continue;
                };
                let _ = (client.set_nodelay(true), server.set_nodelay(true));
                let (client_r, client_w) = client.into_split();
                let (server_r, server_w) = server.into_split();
                tokio::spawn(delayed_pump(client_r, server_w, one_way));
                tokio::spawn(delayed_pump(server_r, client_w, one_way));
            }
        });
        Self { addr, task }
    }
}

impl Drop for DelayProxy {
    fn drop(&mut self) {
        self.task.abort();
    }
}

/// Copies `from` to `to`, each chunk written `delay` after it was read, in order; the end
/// of stream too.
async fn delayed_pump(
    mut from: tokio::net::tcp::OwnedReadHalf,
    mut to: tokio::net::tcp::OwnedWriteHalf,
    delay: Duration,
) {
    use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};
    let (tx, mut rx) = tokio::sync::mpsc::unbounded_channel();
    tokio::spawn(async move {
        let mut buf = vec![0u8; 64 * 1024];
        loop {
            let chunk = match from.read(&mut buf).await {
                // An empty chunk carries the end of stream.
                Ok(0) | Err(_) => Vec::new(),
                Ok(n) => buf[..n].to_vec(),
            };
            let end = chunk.is_empty();
            if tx
                .send((tokio::time::Instant::now() + delay, chunk))
                .is_err()
                || end
            {
                return;
            }
        }
    });
    while let Some((due, chunk)) = rx.recv().await {
        tokio::time::sleep_until(due).await;
        if chunk.is_empty() || to.write_all(&chunk).await.is_err() {
            break;
        }
    }
    let _ = to.shutdown().await;
}
