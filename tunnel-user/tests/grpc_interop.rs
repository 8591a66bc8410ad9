//! Interop with a third-party gRPC implementation: Python `grpcio` (installed by
//! scripts/setup.sh) talks to the replica listener of a cloud in this process
//! ([`InProcess`]) with stubs it generates from proto/tunnel.proto at test time
//! (grpc_interop.py does the calls).
//! Without python3 and grpcio the test fails: setup installs them, so missing ones are a
//! broken machine, never a pass.

mod common;

use std::path::Path;
use std::process::Command;
use std::time::Duration;

use common::EdgeOpts;
use common::inproc::{self, InProcess, Side};

/// On the real clock: the python client is a process of its own, timed by its clock.
#[tokio::test]
async fn grpcio_checks_health_and_routes_on_the_replica_listener() {
    let probe = Command::new("python3")
        .args(["-c", "import grpc, grpc_tools, grpc_health.v1"])
        .output();
    match probe {
        Ok(out) if out.status.success() => {}
        Ok(out) => panic!(
            "python3 lacks grpcio, grpcio-tools or grpcio-health-checking (scripts/setup.sh installs them): {}",
            String::from_utf8_lossy(&out.stderr)
        ),
        Err(e) => panic!("python3 not runnable (scripts/setup.sh installs it): {e}"),
    }

    // A short bound on the first request message.
    let mut t = InProcess::start(
        "edge-1:t1\n",
        toml::toml! {
            [transport]
            handshake_timeout = "2s"

            [peers]
            listen = "127.0.0.1:0"
        },
    )
    .await;
    let peer = t.ready.addr("peers.listen");
    let _edge = t.start_ready_edge(EdgeOpts::new("edge-1", "t1")).await;

    let dir = t.path().to_owned();
    let run = inproc::blocking(move || {
        let manifest = Path::new(env!("CARGO_MANIFEST_DIR"));
        let out = tempfile::tempdir().unwrap();
        Command::new("python3")
            .arg(manifest.join("tests/grpc_interop.py"))
            .arg(manifest.join("../proto"))
            .arg(out.path())
            .arg(peer.to_string())
            .arg(dir)
            .args(["test-cloud", "edge-1"])
            .output()
            .unwrap()
    })
    .await;
    let stdout = String::from_utf8_lossy(&run.stdout);
    let stderr = String::from_utf8_lossy(&run.stderr);
    println!("{stdout}");
    assert!(
        run.status.success() && stdout.contains("interop: all checks passed"),
        "grpc_interop.py failed ({}):\n{stdout}\n{stderr}",
        run.status
    );

    // One log line per refused request, naming the caller and what was wrong.
    t.wait_log(
        Side::Cloud,
        "replica connection refused",
        Duration::from_secs(5),
    )
    .await;
    let log = t.logs.text();
    let refusals: Vec<&str> = log
        .lines()
        .filter(|l| l.contains("request from a replica refused"))
        .collect();
    let expected = [
        ("/tunnel.v1.Peer/NoSuchMethod", "code=Unimplemented"),
        ("/no.such.Service/Call", "code=Unimplemented"),
        ("/tunnel.v1.Peer/Routes", "code=OutOfRange"),
        ("/tunnel.v1.Peer/Routes", "code=Internal"),
        ("/tunnel.v1.Peer/Routes", "code=InvalidArgument"),
        ("/tunnel.v1.Peer/Routes", "code=DeadlineExceeded"),
    ];
    assert_eq!(
        refusals.len(),
        expected.len(),
        "one line per refused request:\n{log}"
    );
    for (line, (path, code)) in refusals.iter().zip(expected) {
        assert!(
            line.contains(&format!("path=\"{path}\""))
                && line.contains(code)
                && line.contains("remote=Some(127.0.0.1:"),
            "`{line}` should name the caller, {path} and {code}"
        );
    }
    let no_cert: Vec<&str> = log
        .lines()
        .filter(|l| l.contains("replica connection refused"))
        .collect();
    assert_eq!(
        no_cert.len(),
        1,
        "one line for the client without a certificate:\n{log}"
    );
    assert!(
        no_cert[0].contains("peer_in{remote=127.0.0.1:") && no_cert[0].contains("certificate"),
        "{}",
        no_cert[0]
    );

    // The gRPC server and its health service do not hold up shutdown: the cloud's run
    // (what SIGTERM stops in the binary) ends, with Ok.
    let cloud = t.stop_cloud();
    let stopped = tokio::time::timeout(Duration::from_secs(15), cloud).await;
    let log = t.logs.text();
    let ended = stopped.unwrap_or_else(|_| panic!("the cloud did not stop:\n{log}"));
    ended
        .expect("the cloud's task")
        .expect("the cloud stops cleanly");
    t.wait_log(Side::Cloud, "tunnel cloud stopped", Duration::from_secs(1))
        .await;
}
