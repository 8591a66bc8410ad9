//! The cloud's other ways in: fixed forwards, the SuperEdge https module and who it lets
//! in, the CONNECT unix socket and who may open it, and a client's first bytes sent
//! behind the dial request.

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};

use super::*;

#[tokio::test]
async fn fixed_forward_reaches_its_node_target() {
    let sink = servers::sink("127.0.0.1:0");
    let mut t = InProcess::start(TOKENS, common::config::forwards("edge-1", &[sink])).await;
    let listen = t.ready.addr("forward[0].listen");
    let _edge = t
        .start_ready_edge(edge_opts("edge-1", "token-one", &[sink]))
        .await;
    let answer = inproc::blocking(move || {
        let mut conn = TcpStream::connect(listen).unwrap();
        conn.write_all(b"abc").unwrap();
        conn.shutdown(Shutdown::Write).unwrap();
        let mut answer = String::new();
        conn.read_to_string(&mut answer).unwrap();
        answer
    })
    .await;
    assert!(answer.starts_with("3 "), "{answer}");
}

#[tokio::test]
async fn superedge_https_module_routes_by_node_name_and_presents_the_edge_client_cert() {
    use rcgen::ExtendedKeyUsagePurpose::{ClientAuth, ServerAuth};
    let s = Setup::new(TOKENS);
    s.pki
        .issue("kubelet", &["127.0.0.1"], "kubelet", ServerAuth);
    s.pki.issue(
        "kubelet-client",
        &["apiserver-kubelet-client"],
        "apiserver-kubelet-client",
        ClientAuth,
    );
    s.pki.issue("front", &["edge-1"], "edge-1", ServerAuth);
    issue_apiserver_client(&s);
    // The "kubelet" only talks to clients with a certificate from our CA. It says
    // `ACCEPT <address>` once it listens.
    let (_kubelet, kubelet) =
        common::spawn_announcing(Command::new("openssl").current_dir(s.path()).args([
            "s_server",
            "-www",
            "-Verify",
            "1",
            "-CAfile",
            "ca.crt",
            "-cert",
            "kubelet.crt",
            "-key",
            "kubelet.key",
            "-accept",
            "127.0.0.1:0",
        ]));
    let kubelet_port = kubelet.port();
    let kubelet_addr = format!("127.0.0.1:{kubelet_port}");
    let config = s.cloud_config(common::config::https_front(&kubelet_addr));
    let mut t = InProcess::start_with(s, config).await;
    let front = t.ready.addr("https[0].listen");
    let _edge = t
        .start_ready_edge(EdgeOpts {
            extra: toml::toml! {
                [allow]
                targets = [(kubelet_addr.clone())]

                [https]
                cert = "kubelet-client.crt"
                key = "kubelet-client.key"
            },
            ..EdgeOpts::new("edge-1", "token-one")
        })
        .await;
    let dir = t.path().to_owned();
    inproc::blocking(move || routed_by_node_name(&dir, front)).await;
}

/// The clients of [`superedge_https_module_routes_by_node_name_and_presents_the_edge_client_cert`]:
/// curl as kube-apiserver ([`apiserver_curl`] in `dir`) at the HTTPS entry `front`.
fn routed_by_node_name(dir: &std::path::Path, front: SocketAddr) {
    // By node name (TLS SNI), as SuperEdge's DNS mode makes clients do.
    let by_name = apiserver_curl(dir)
        .args(["--cacert", "ca.crt"])
        .args(["--resolve", &format!("edge-1:{}:127.0.0.1", front.port())])
        .arg(format!("https://edge-1:{}/", front.port()))
        .output()
        .unwrap();
    assert!(
        String::from_utf8_lossy(&by_name.stdout).contains("s_server"),
        "{}",
        String::from_utf8_lossy(&by_name.stderr)
    );
    // No SNI (an IP address): the Host header names the node.
    let by_host = apiserver_curl(dir)
        .args(["-k", "-H", "Host: edge-1"])
        .arg(format!("https://{front}/"))
        .output()
        .unwrap();
    assert!(
        String::from_utf8_lossy(&by_host.stdout).contains("s_server"),
        "{}",
        String::from_utf8_lossy(&by_host.stderr)
    );
    // An unknown node gets an HTTP error, not a hang.
    let unknown = apiserver_curl(dir)
        .args([
            "-k",
            "-o",
            "/dev/null",
            "-w",
            "%{http_code}",
            "-H",
            "Host: nobody",
        ])
        .arg(format!("https://{front}/"))
        .output()
        .unwrap();
    assert_eq!(String::from_utf8_lossy(&unknown.stdout), "404");
}

/// Writes `apiserver.crt`/`.key`: kube-apiserver's kubelet client certificate, signed by
/// the setup's CA (the `client_ca` of [`common::config::https_front`]).
fn issue_apiserver_client(s: &Setup) {
    s.pki.issue(
        "apiserver",
        &["kube-apiserver"],
        "kube-apiserver-kubelet-client",
        rcgen::ExtendedKeyUsagePurpose::ClientAuth,
    );
}

/// curl in `dir`, presenting `apiserver.crt` there as kube-apiserver does.
fn apiserver_curl(dir: &std::path::Path) -> Command {
    let mut curl = Command::new("curl");
    curl.current_dir(dir).args([
        "-sS",
        "--max-time",
        "10",
        "--cert",
        "apiserver.crt",
        "--key",
        "apiserver.key",
    ]);
    curl
}

/// A target that counts the connections it accepted (and closes each): whether anything
/// reached it.
fn counting_target() -> (SocketAddr, Arc<AtomicUsize>) {
    let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = listener.local_addr().unwrap();
    let reached = Arc::new(AtomicUsize::new(0));
    let count = reached.clone();
    std::thread::spawn(move || {
        for conn in listener.incoming() {
            // Counted before the close, which is what the dialler sees.
            count.fetch_add(1, Ordering::SeqCst);
            drop(conn);
        }
    });
    (addr, reached)
}

#[tokio::test]
async fn the_https_entry_refuses_clients_without_a_certificate_of_its_client_ca() {
    use rcgen::ExtendedKeyUsagePurpose::{ClientAuth, ServerAuth};
    let s = Setup::new(TOKENS);
    s.pki.issue("front", &["edge-1"], "edge-1", ServerAuth);
    issue_apiserver_client(&s);
    // Anyone can make a CA (this one even has the real CA's name, with a key of its own)
    // and a certificate that says kube-apiserver.
    let elsewhere = tempfile::tempdir().unwrap();
    common::Pki::new(elsewhere.path()).issue(
        "intruder",
        &["kube-apiserver"],
        "kube-apiserver-kubelet-client",
        ClientAuth,
    );
    let (target, reached) = counting_target();
    let config = s.cloud_config(common::config::https_front(&target.to_string()));
    let mut t = InProcess::start_with(s, config).await;
    let front = t.ready.addr("https[0].listen");
    let _edge = t
        .start_ready_edge(edge_opts("edge-1", "token-one", &[target]))
        .await;
    let apiserver = t.path().join("apiserver");
    inproc::blocking(move || {
        let intruder = elsewhere.path().join("intruder");
        only_the_client_ca_gets_through(front, &intruder, &apiserver, &reached)
    })
    .await;
}

/// The clients of [`the_https_entry_refuses_clients_without_a_certificate_of_its_client_ca`]
/// at the HTTPS entry `front`: none, one with `intruder`'s certificate, one with
/// `apiserver`'s; `reached` counts what reached the target.
fn only_the_client_ca_gets_through(
    front: SocketAddr,
    intruder: &std::path::Path,
    apiserver: &std::path::Path,
    reached: &AtomicUsize,
) {
    // The status curl got ("000": none) and what it said.
    let request = |cert: Option<&std::path::Path>| {
        let mut curl = Command::new("curl");
        curl.args(["-sS", "--max-time", "10", "-k", "-H", "Host: edge-1"])
            .args(["-o", "/dev/null", "-w", "%{http_code}"]);
        if let Some(cert) = cert {
            curl.arg("--cert")
                .arg(cert.with_extension("crt"))
                .arg("--key")
                .arg(cert.with_extension("key"));
        }
        let out = curl.arg(format!("https://{front}/")).output().unwrap();
        let status = String::from_utf8_lossy(&out.stdout).into_owned();
        (status, String::from_utf8_lossy(&out.stderr).into_owned())
    };

    let (status, said) = request(None);
    assert_eq!(status, "000", "no certificate: {said}");
    assert!(said.contains("alert certificate required"), "{said}");
    let (status, said) = request(Some(intruder));
    assert_eq!(status, "000", "another CA's certificate: {said}");
    // A TLS alert (rustls finds the issuer by name, and its signature fails: "decrypt
    // error"; an unknown name would be "unknown ca").
    assert!(said.contains(" alert "), "{said}");
    // curl is done, so a connection let in would have been dialled by now.
    assert_eq!(
        reached.load(Ordering::SeqCst),
        0,
        "a refused client reached the target"
    );

    // kube-apiserver's certificate gets through: the edge dials the target (which speaks
    // no TLS, so the answer is an error status, but a status).
    let (status, said) = request(Some(apiserver));
    assert_eq!(status, "502", "kube-apiserver's certificate: {said}");
    assert_eq!(reached.load(Ordering::SeqCst), 1);
}

#[test]
fn the_connect_unix_socket_is_owner_only_whatever_the_umask() {
    use std::os::unix::fs::PermissionsExt as _;
    if !common::privileged::is_root() {
        common::privileged::cannot_run("the unix socket test switches to user nobody: needs root");
        return;
    }
    let mut s = Setup::new(TOKENS);
    // Anyone may pass through the directory, so the socket's own mode is all that decides.
    std::fs::set_permissions(s.path(), std::fs::Permissions::from_mode(0o755)).unwrap();
    let mut cloud = s.spawn_cloud(Table::new(), &["sh", "-c", "umask 0 && exec \"$@\"", "sh"]);
    s.cloud_ready(&mut cloud);
    let mode = std::fs::metadata(&s.connect_unix)
        .unwrap()
        .permissions()
        .mode()
        & 0o777;
    assert_eq!(mode, 0o600, "connect.unix created {mode:o} under umask 0");
    // Another user of the host cannot connect (curl: exit 7, "Couldn't connect").
    let out = Command::new("setpriv")
        .args(["--reuid=65534", "--regid=65534", "--clear-groups"])
        .args(["curl", "-sS", "--max-time", "5"])
        .arg("--unix-socket")
        .arg(&s.connect_unix)
        .arg("http://edge-1:10250/")
        .output()
        .unwrap();
    assert_eq!(
        out.status.code(),
        Some(7),
        "user nobody on connect.unix: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    // Its owner (root, as the cloud) can.
    std::os::unix::net::UnixStream::connect(&s.connect_unix).expect("root connects");
}

#[tokio::test]
async fn http_connect_over_the_unix_socket_like_the_apiserver_egress_selector() {
    let mut t = InProcess::start(TOKENS, Table::new()).await;
    let sink = servers::sink("127.0.0.1:0");
    let _edge = t
        .start_ready_edge(edge_opts("edge-1", "token-one", &[sink]))
        .await;
    let unix = t.s.connect_unix.clone();
    let response = inproc::blocking(move || unix_connect(&unix, sink)).await;
    let expected = format!("5 {}\n", servers::hex(&sha2_of(b"early")));
    assert!(
        response.starts_with("HTTP/1.1 200") && response.ends_with(&expected),
        "{response:?}"
    );
}

/// A CONNECT to edge-1's `sink` on the unix socket at `path` with early bytes right
/// behind the request head; returns everything that came back.
fn unix_connect(path: &std::path::Path, sink: SocketAddr) -> String {
    use std::os::unix::net::UnixStream;
    let mut conn = UnixStream::connect(path).expect("connect to the unix socket");
    conn.set_read_timeout(Some(Duration::from_secs(10)))
        .unwrap();
    // Early bytes right behind the request head must not be lost.
    write!(
        conn,
        "CONNECT edge-1:{} HTTP/1.1\r\nHost: edge-1:{}\r\n\r\nearly",
        sink.port(),
        sink.port()
    )
    .unwrap();
    conn.shutdown(Shutdown::Write).unwrap();
    let mut response = String::new();
    conn.read_to_string(&mut response).unwrap();
    response
}

#[tokio::test]
async fn a_forward_whose_target_refuses_resets_the_client() {
    // A failed dial must end in a reset, not a clean end of stream, and be logged once.
    let closed = common::ClosedPort::new();
    let (closed, _held) = (closed.addr, closed);
    let mut t = InProcess::start(TOKENS, common::config::forwards("edge-1", &[closed])).await;
    let listen = t.ready.addr("forward[0].listen");
    let _edge = t
        .start_ready_edge(edge_opts("edge-1", "token-one", &[closed]))
        .await;
    inproc::blocking(move || {
        let mut conn = TcpStream::connect(listen).unwrap();
        conn.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
        common::assert_reset(&mut conn, b"early bytes");
    })
    .await;
    let failed = "edge could not connect to target";
    t.wait_log(Side::Cloud, failed, Duration::from_secs(2))
        .await;
    let lines = t.logs.lines(Side::Cloud);
    assert_eq!(
        lines.iter().filter(|l| l.contains(failed)).count(),
        1,
        "logged once"
    );
}

/// Time on the runtime's clock from `started` (before the connection was opened) to the
/// first byte of the answer to one HTTP request on `conn`.
async fn first_response(
    mut conn: tokio::net::TcpStream,
    started: tokio::time::Instant,
) -> Duration {
    use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};
    conn.set_nodelay(true).unwrap();
    conn.write_all(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
        .await
        .unwrap();
    let mut byte = [0u8; 1];
    conn.read_exact(&mut byte)
        .await
        .expect("first byte of the response");
    started.elapsed()
}

/// [`first_response`] through the CONNECT proxy at `proxy`: when the 200 came, and when
/// the first byte of the answer.
async fn connect_first_response(proxy: SocketAddr, authority: &str) -> (Duration, Duration) {
    let started = tokio::time::Instant::now();
    let (status, conn) = inproc::connect(proxy, authority).await;
    assert!(status.starts_with("HTTP/1.1 200"), "{status}");
    let ok_at = started.elapsed();
    (ok_at, first_response(conn.into_inner(), started).await)
}

fn median(mut times: Vec<Duration>) -> Duration {
    times.sort();
    times[times.len() / 2]
}

/// 100 ms each way between edge and cloud, as on a WAN link ([`inproc::DelayProxy`]).
const ONE_WAY: Duration = Duration::from_millis(100);
const RTT: Duration = Duration::from_millis(200);

/// A cloud with `config` and edge-1 behind a [`inproc::DelayProxy`] of [`ONE_WAY`],
/// allowed `targets`.
async fn across_a_wan(
    config: Table,
    targets: &[SocketAddr],
) -> (InProcess, inproc::Edge, inproc::DelayProxy) {
    let mut t = InProcess::start(TOKENS, config).await;
    let link = inproc::DelayProxy::start(t.s.tunnel, ONE_WAY).await;
    t.s.tunnel = link.addr; // the edge's `cloud.address`
    let edge = t
        .start_ready_edge(edge_opts("edge-1", "token-one", targets))
        .await;
    (t, edge, link)
}

/// In paused time, so the link's round trips are measured on the runtime's clock.
#[tokio::test(start_paused = true)]
async fn a_forward_sends_the_clients_first_bytes_right_behind_the_dial_request() {
    // A forward's client waits for nothing, so its request rides right behind the dial
    // request: its first answer takes one link round trip plus the target's time. A
    // strict HTTP CONNECT's client must hear the dial's outcome before it sends: two
    // round trips. Both measured here, alternately.
    let server = inproc::echo_server().await;
    let mut config = common::config::forwards("edge-1", &[server]);
    config.insert(
        "connect".into(),
        toml::toml! { optimistic_ok = "never" }.into(),
    );
    let (t, _edge, _link) = across_a_wan(config, &[server]).await;
    let listen = t.ready.addr("forward[0].listen");
    let authority = format!("edge-1:{}", server.port());
    let (mut forward, mut connect) = (Vec::new(), Vec::new());
    for _ in 0..5 {
        let started = tokio::time::Instant::now();
        let conn = tokio::net::TcpStream::connect(listen).await.unwrap();
        forward.push(first_response(conn, started).await);
        connect.push(connect_first_response(t.s.connect, &authority).await.1);
    }
    eprintln!(
        "link RTT {RTT:?}; first response on a new connection: forward {forward:?}, HTTP CONNECT {connect:?}"
    );
    let (forward, connect) = (median(forward), median(connect));
    eprintln!(
        "medians: forward {forward:?} ({:.2} RTT), HTTP CONNECT {connect:?} ({:.2} RTT)",
        forward.as_secs_f64() / RTT.as_secs_f64(),
        connect.as_secs_f64() / RTT.as_secs_f64()
    );
    assert!(
        forward >= RTT && connect >= 2 * RTT,
        "faster than the link allows: is the delay in the path?"
    );
    assert!(
        forward < RTT * 3 / 2,
        "a forward's first response took {forward:?}: the client's bytes waited for the dial's answer (link RTT {RTT:?})"
    );
}

/// CONNECTs to `authority` through `proxy`, expecting its 200 before the edge refuses
/// the dial, and then a reset instead of an answer to a request.
async fn ok_then_reset(proxy: SocketAddr, authority: &str) {
    let (status, mut conn) = inproc::connect(proxy, authority).await;
    assert!(
        status.starts_with("HTTP/1.1 200"),
        "the 200 comes before the edge's refusal: {status}"
    );
    inproc::expect_reset(&mut conn, b"GET / HTTP/1.1\r\nHost: x\r\n\r\n").await;
}

/// In paused time, so the link's round trips are measured on the runtime's clock.
#[tokio::test(start_paused = true)]
async fn by_default_connect_answers_early_only_for_a_target_the_edge_just_reached() {
    // `optimistic_ok = "recent"`, the default: the first CONNECT to a target waits for
    // the edge's dial (two link round trips to the first response); once the edge has
    // connected there, the next ones get their 200 at once (one round trip). A failed
    // dial makes the target unknown again: the client it fails after an early 200 is
    // reset, and the next one waits and hears the status.
    let server = inproc::echo_server().await;
    // Accepts in the kernel's backlog; closed later so that dials there are refused.
    let going = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let going_addr = going.local_addr().unwrap();
    let config = toml::toml! {
        [[node]]
        name = "edge-1"
    };
    let (t, _edge, _link) = across_a_wan(config, &[server, going_addr]).await;
    let (mut ok_at, mut first) = (Vec::new(), Vec::new());
    for _ in 0..4 {
        let (ok, response) =
            connect_first_response(t.s.connect, &format!("edge-1:{}", server.port())).await;
        ok_at.push(ok);
        first.push(response);
    }
    eprintln!("link RTT {RTT:?}; 200 after {ok_at:?}, first response after {first:?}");
    assert!(
        ok_at[0] >= RTT && first[0] >= 2 * RTT,
        "the first CONNECT to a target did not wait for the edge's dial: 200 after {:?}, first response after {:?}",
        ok_at[0],
        first[0]
    );
    for (ok, response) in ok_at[1..].iter().zip(&first[1..]) {
        assert!(
            *ok < RTT / 2 && *response < RTT * 3 / 2,
            "a CONNECT to a target the edge just reached waited for the dial: 200 after {ok:?}, first response after {response:?} (link RTT {RTT:?})"
        );
    }

    // Reached once, then gone: the next client has its 200 and is reset, the one
    // after it waits and hears why. The first one's 200 came after the edge had
    // connected (the target was unknown), so the cloud knows it by then.
    let going_authority = format!("edge-1:{}", going_addr.port());
    let (status, _) = inproc::connect(t.s.connect, &going_authority).await;
    assert!(status.starts_with("HTTP/1.1 200"), "{status}");
    drop(going);
    ok_then_reset(t.s.connect, &going_authority).await;
    let (refused, _) = inproc::connect(t.s.connect, &going_authority).await;
    assert!(
        refused.starts_with("HTTP/1.1 502"),
        "after a failed dial the client waits for the edge's answer: {refused}"
    );
    // Both refusals are logged where the operator looks, the reset one included.
    t.logs
        .wait_count(
            Side::Cloud,
            &["connection refused"],
            2,
            Duration::from_secs(5),
        )
        .await;
    let logged = t.logs.text().matches("connection refused").count();
    assert_eq!(logged, 2, "{}", t.logs.text());
}

/// In paused time, so the link's round trips are measured on the runtime's clock.
#[tokio::test(start_paused = true)]
async fn optimistic_connect_answers_before_the_edge_and_resets_a_refused_dial() {
    // `connect.optimistic_ok = "always"`: the 200 comes before the edge's dial result,
    // even for a target never reached, the request
    // rides right behind the dial request (one link round trip to the first response,
    // as a forward), and a dial the edge refuses becomes a reset after the 200.
    let server = inproc::echo_server().await;
    // Outside the edge's allowlist: nothing may ever connect to it.
    let forbidden = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    forbidden.set_nonblocking(true).unwrap();
    let forbidden_addr = forbidden.local_addr().unwrap();
    let config = toml::toml! {
        [connect]
        optimistic_ok = "always"

        [[node]]
        name = "edge-1"
    };
    let (t, _edge, _link) = across_a_wan(config, &[server]).await;
    let (mut ok_at, mut first) = (Vec::new(), Vec::new());
    for _ in 0..3 {
        let (ok, response) =
            connect_first_response(t.s.connect, &format!("edge-1:{}", server.port())).await;
        ok_at.push(ok);
        first.push(response);
    }
    eprintln!("link RTT {RTT:?}; 200 after {ok_at:?}, first response after {first:?}");
    let (ok_at, first) = (median(ok_at), median(first));
    assert!(
        ok_at < RTT / 2,
        "the 200 took {ok_at:?}: it waited for the edge (link RTT {RTT:?})"
    );
    assert!(
        first >= RTT,
        "faster than the link allows: is the delay in the path?"
    );
    assert!(
        first < RTT * 3 / 2,
        "first response after {first:?}: the client's bytes waited for the dial's answer (link RTT {RTT:?})"
    );

    // A target the edge refuses: 200 first, then a reset instead of 403.
    ok_then_reset(t.s.connect, &format!("edge-1:{}", forbidden_addr.port())).await;
    t.wait_log(
        Side::Edge,
        "refused a target outside the allowlist",
        Duration::from_secs(5),
    )
    .await;
    assert!(
        matches!(forbidden.accept(), Err(e) if e.kind() == std::io::ErrorKind::WouldBlock),
        "the edge connected to a target outside its allowlist"
    );
    // A refusal known on the cloud still gets its status.
    let (unknown, _) = inproc::connect(t.s.connect, "no-such-node:80").await;
    assert!(!unknown.starts_with("HTTP/1.1 200"), "{unknown}");
}

#[tokio::test]
async fn a_forward_the_edge_refuses_resets_the_client_and_its_early_bytes_reach_nothing() {
    let sink = servers::sink("127.0.0.1:0");
    // Outside the edge's allowlist: nothing may ever connect to it.
    let forbidden = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    forbidden.set_nonblocking(true).unwrap();
    let forbidden_addr = forbidden.local_addr().unwrap();
    let hole = servers::NeverAccepting::start();
    let mut t = InProcess::start(
        TOKENS,
        common::config::forwards("edge-1", &[forbidden_addr, hole.addr, sink]),
    )
    .await;
    let (to_forbidden, to_hole, to_sink) = (
        t.ready.addr("forward[0].listen"),
        t.ready.addr("forward[1].listen"),
        t.ready.addr("forward[2].listen"),
    );
    let mut extra = allow(&[sink, hole.addr]);
    common::config::merge(&mut extra, toml::toml! { [transport] dial_timeout = "1s" });
    let edge = t
        .start_ready_edge(EdgeOpts {
            extra,
            ..EdgeOpts::new("edge-1", "token-one")
        })
        .await;
    let (edge_admin, cloud_admin) = (edge.admin().await, t.s.cloud_admin);

    // The client sends at once, as forwarded clients do; the edge refuses, or its dial
    // times out: either way the client sees a reset, not a clean end of stream.
    let reset_after = |listen: SocketAddr| async move {
        let started = tokio::time::Instant::now();
        let mut conn = tokio::net::TcpStream::connect(listen).await.unwrap();
        inproc::expect_reset(&mut conn, b"early secret bytes").await;
        started.elapsed()
    };
    let forbidden_took = reset_after(to_forbidden).await;
    let timeout_took = reset_after(to_hole).await;
    eprintln!(
        "client reset after {forbidden_took:?} (forbidden target), {timeout_took:?} (dial timeout 1 s)"
    );
    assert!(
        forbidden_took < Duration::from_secs(1),
        "reset for a forbidden target took {forbidden_took:?}"
    );
    assert!(
        timeout_took >= Duration::from_millis(900) && timeout_took < Duration::from_secs(5),
        "reset after {timeout_took:?}"
    );

    // The next connection on the same edge carries its own bytes and nothing else.
    let (answer, edge_scrape, cloud_scrape) = inproc::blocking(move || {
        let mut conn = TcpStream::connect(to_sink).unwrap();
        conn.write_all(b"abc").unwrap();
        conn.shutdown(Shutdown::Write).unwrap();
        let mut answer = String::new();
        conn.read_to_string(&mut answer).unwrap();
        (
            answer,
            common::scrape(edge_admin),
            common::scrape(cloud_admin),
        )
    })
    .await;
    assert_eq!(answer, format!("3 {}\n", servers::hex(&sha2_of(b"abc"))));

    // Nothing reached the forbidden target, and no target got the refused bytes.
    assert!(
        matches!(forbidden.accept(), Err(e) if e.kind() == std::io::ErrorKind::WouldBlock),
        "the edge connected to a target outside its allowlist"
    );
    assert_eq!(
        common::sample(&edge_scrape, "tunnel_bytes_total{direction=\"from_cloud\"}"),
        3.0,
        "{edge_scrape}"
    );
    for (reason, n) in [("ok", 1.0), ("forbidden", 1.0), ("timeout", 1.0)] {
        assert_eq!(
            common::sample(
                &edge_scrape,
                &format!("tunnel_edge_dials_total{{reason=\"{reason}\"}}")
            ),
            n,
            "{reason}: {edge_scrape}"
        );
    }
    // Counted and logged once each, with node and target.
    assert_eq!(
        common::sample(&cloud_scrape, "tunnel_connections_total{entry=\"forward\"}"),
        3.0,
        "{cloud_scrape}"
    );
    for reason in ["forbidden", "timeout"] {
        assert_eq!(
            common::sample(
                &cloud_scrape,
                &format!("tunnel_dial_failures_total{{reason=\"{reason}\"}}")
            ),
            1.0,
            "{reason}: {cloud_scrape}"
        );
    }
    let log = t.logs.lines(Side::Cloud).join("\n");
    let refusals: Vec<&str> = log
        .lines()
        .filter(|l| l.contains("connection refused"))
        .collect();
    assert_eq!(
        refusals.len(),
        2,
        "one line per refused connection: {refusals:#?}"
    );
    for (line, target, why) in [
        (refusals[0], forbidden_addr, "not in this edge's allowlist"),
        (refusals[1], hole.addr, "timed out"),
    ] {
        assert!(
            line.contains("edge-1") && line.contains(&target.to_string()) && line.contains(why),
            "{line}"
        );
    }
    assert!(
        !log.contains("connection aborted from the edge side"),
        "a refusal logged again as an abort:\n{log}"
    );
    let conns = inproc::blocking(move || {
        std::process::Command::new("curl")
            .args(["-sS", "--max-time", "5"])
            .arg(format!("http://{cloud_admin}/debug/connections"))
            .output()
            .unwrap()
    })
    .await;
    assert_eq!(
        String::from_utf8_lossy(&conns.stdout).trim(),
        "[]",
        "connections still listed"
    );
}
