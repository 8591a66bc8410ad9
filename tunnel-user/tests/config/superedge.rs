//! SuperEdge's files: a misspelled key is an error, a key without meaning here a
//! warning, an HTTPS module without a client CA an error that names it.

use super::*;

const SUPEREDGE_EDGE: &str = r#"
[mode]
  [mode.edge]
    [mode.edge.stream]
        [mode.edge.stream.client]
            token = "6ff2a1ea0f1611eb9896362096106d9d"
            cert = "/etc/superedge/tunnel/certs/tunnel-ca.crt"
            dns = "tunnel.cloud.io"
            servername = "10.0.0.1:9000"
            logport = 51000
"#;

#[test]
fn superedge_misspelled_key_is_an_error() {
    let e = edge_error(
        "se-typo.toml",
        &SUPEREDGE_EDGE.replace("servername", "server_name"),
        Some("edge-1"),
    );
    assert_mentions(
        &e,
        &["`mode.edge.stream.client.server_name`", "unknown key"],
    );

    let text = SUPEREDGE_EDGE.replace("logport = 51000", "logport = \"51000\"");
    let e = edge_error("se-type.toml", &text, Some("edge-1"));
    assert_mentions(
        &e,
        &[
            "`mode.edge.stream.client.logport`",
            "expected a port number, found string",
        ],
    );
}

#[test]
fn superedge_https_module_without_client_ca_is_refused_naming_the_missing_ca() {
    // SuperEdge's own file, as it ships: its HTTPS module lets any client in.
    let shipped = std::fs::read_to_string(examples().join("superedge-cloud.toml"))
        .expect("superedge-cloud.toml");
    let as_superedge_ships_it: String = shipped
        .lines()
        .filter(|l| !l.trim_start().starts_with("client_ca"))
        .map(|l| format!("{l}\n"))
        .collect();
    assert_ne!(
        as_superedge_ships_it, shipped,
        "the example has the client_ca line"
    );
    let e = cloud_error("tunnel_cloud.toml", &as_superedge_ships_it);
    assert_mentions(
        &e,
        &[
            "`mode.cloud.https.client_ca`: missing",
            "kube-apiserver's kubelet client certificate",
            "exec in every pod of every edge",
        ],
    );
}

/// Collects what a tracing subscriber writes.
#[derive(Clone, Default)]
struct Captured(Arc<Mutex<Vec<u8>>>);

impl io::Write for Captured {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        self.0
            .lock()
            .map_err(|_| io::Error::other("poisoned"))?
            .extend_from_slice(buf);
        Ok(buf.len())
    }

    fn flush(&mut self) -> io::Result<()> {
        Ok(())
    }
}

#[test]
fn superedge_channelzaddr_is_a_warning() {
    let tmp = tempfile::tempdir().expect("tempdir");
    let path = write(
        tmp.path(),
        "tunnel_edge.toml",
        &SUPEREDGE_EDGE.replace(
            "logport = 51000",
            "logport = 51000\nchannelzaddr = \"0.0.0.0:5000\"",
        ),
    );
    let captured = Captured::default();
    let writer = captured.clone();
    let subscriber = tracing_subscriber::fmt()
        .with_ansi(false)
        .with_writer(move || writer.clone())
        .finish();
    let config = tracing::subscriber::with_default(subscriber, || {
        EdgeConfig::load(&path, Some("edge-1".into()))
    })
    .expect("channelzaddr is accepted");
    assert_eq!(config.cloud.server_name, "tunnel.cloud.io");

    let log = String::from_utf8(captured.0.lock().expect("log").clone()).expect("utf-8");
    assert_mentions(
        &log,
        &[
            "WARN",
            &path.display().to_string(),
            "mode.edge.stream.client.channelzaddr",
            "ignored",
        ],
    );
}
