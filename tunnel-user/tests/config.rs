//! Config files as an operator meets them: every shipped example loads, and each kind
//! of mistake is reported with the file, the key and the problem.

mod common;

use std::io;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};

use toml::Table;
use tunnel_user::config::{CloudConfig, EdgeConfig};

/// Writes `text` to `dir/name`; returns the path.
fn write(dir: &Path, name: &str, text: &str) -> PathBuf {
    let path = dir.join(name);
    std::fs::write(&path, text).expect("write config");
    path
}

/// `base` (a config's text) with `change` merged in, table by table: each key lands in
/// the table it names.
fn with(base: &str, change: Table) -> String {
    let mut config: Table = toml::from_str(base).expect("the base config parses");
    common::config::merge(&mut config, change);
    toml::to_string(&config).expect("a config serialises")
}

fn examples() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../examples")
}

#[test]
fn every_shipped_example_loads() {
    let mut loaded = Vec::new();
    for entry in std::fs::read_dir(examples()).expect("examples/") {
        let path = entry.expect("entry").path();
        if path.extension().is_none_or(|e| e != "toml") {
            continue;
        }
        let name = path
            .file_name()
            .expect("name")
            .to_string_lossy()
            .into_owned();
        if name.contains("cloud") {
            CloudConfig::load(&path).unwrap_or_else(|e| panic!("{e}"));
        } else if name.contains("edge") {
            EdgeConfig::load(&path, Some("edge-1".into())).unwrap_or_else(|e| panic!("{e}"));
        } else {
            panic!("{name}: neither a cloud nor an edge example; name it so this test loads it");
        }
        loaded.push(name);
    }
    loaded.sort();
    assert_eq!(
        loaded,
        [
            "cloud.toml",
            "edge.toml",
            "superedge-cloud.toml",
            "superedge-edge.toml"
        ]
    );
}

#[test]
fn examples_mean_what_they_say() {
    let cloud = CloudConfig::load(&examples().join("cloud.toml")).expect("cloud.toml");
    assert_eq!(
        cloud.tunnel.cert,
        Some(examples().join("certs/cloud.crt")),
        "paths are relative to the file"
    );
    assert_eq!(cloud.forwards[0].node.as_deref(), Some("edge-1"));

    let edge =
        EdgeConfig::load(&examples().join("edge.toml"), Some("edge-1".into())).expect("edge.toml");
    assert_eq!(edge.node(), "edge-1", "NODE_NAME fills a missing node_name");
    assert!(
        !edge.allow.any,
        "the native edge only dials allowed targets"
    );

    let se =
        CloudConfig::load(&examples().join("superedge-cloud.toml")).expect("superedge-cloud.toml");
    assert_eq!(se.tunnel.listen.port(), 9000);
    assert_eq!(
        se.forwards[0].node, None,
        "SuperEdge forwards go to the first edge connected"
    );
    assert_eq!(se.https[0].listen.port(), 10250);

    let se = EdgeConfig::load(
        &examples().join("superedge-edge.toml"),
        Some("edge-1".into()),
    )
    .expect("superedge-edge.toml");
    assert!(se.allow.any, "a SuperEdge edge dials what the cloud names");
    assert_eq!(se.cloud.address, "localhost:9000");
}

const CLOUD: &str = r#"
[tunnel]
listen = "0.0.0.0:9000"
cert = "certs/cloud.crt"
key = "certs/cloud.key"
token_file = "certs/tokens"

[[node]]
name = "edge-1"
addresses = ["127.1.0.5"]

[[forward]]
listen = "127.0.0.1:16443"
node = "edge-1"
target = "127.0.0.1:6443"
"#;

const EDGE: &str = r#"
[cloud]
address = "127.0.0.1:9000"
server_name = "tunnel-cloud"
ca = "certs/ca.crt"
token = "secret"
"#;

/// Loads `text` as a cloud config named `name`; the error, checked to name the file.
fn cloud_error(name: &str, text: &str) -> String {
    let tmp = tempfile::tempdir().expect("tempdir");
    let path = write(tmp.path(), name, text);
    let e = CloudConfig::load(&path)
        .expect_err("the config is broken")
        .to_string();
    assert!(
        e.contains(&path.display().to_string()),
        "names the file: {e}"
    );
    e
}

fn edge_error(name: &str, text: &str, node: Option<&str>) -> String {
    let tmp = tempfile::tempdir().expect("tempdir");
    let path = write(tmp.path(), name, text);
    let e = EdgeConfig::load(&path, node.map(str::to_string))
        .expect_err("the config is broken")
        .to_string();
    assert!(
        e.contains(&path.display().to_string()),
        "names the file: {e}"
    );
    e
}

fn assert_mentions(e: &str, parts: &[&str]) {
    for part in parts {
        assert!(e.contains(part), "expected {part:?} in:\n{e}");
    }
}

#[test]
fn the_base_configs_are_valid() {
    let tmp = tempfile::tempdir().expect("tempdir");
    CloudConfig::load(&write(tmp.path(), "cloud.toml", CLOUD)).expect("cloud");
    EdgeConfig::load(&write(tmp.path(), "edge.toml", EDGE), Some("edge-1".into())).expect("edge");
}

#[test]
fn unknown_keys() {
    let e = cloud_error("top.toml", &with(CLOUD, toml::toml! { colour = "blue" }));
    assert_mentions(&e, &["unknown field `colour`"]);

    let e = cloud_error("nested.toml", &CLOUD.replace("token_file =", "tokenfile ="));
    assert_mentions(&e, &["unknown field `tokenfile`", "token_file"]);

    let e = edge_error(
        "nested-edge.toml",
        &with(EDGE, toml::toml! { [allow] port = [10250] }),
        Some("edge-1"),
    );
    assert_mentions(&e, &["unknown field `port`", "ports"]);
}

#[test]
fn connect_optimistic_ok_is_a_strict_opt_in() {
    let cloud = CloudConfig::load(&examples().join("cloud.toml")).expect("cloud.toml");
    assert!(!cloud.connect.optimistic_ok, "off unless asked for");
    let e = cloud_error(
        "optimistic.toml",
        &with(CLOUD, toml::toml! { [connect] optimistic_ok = "yes" }),
    );
    assert_mentions(&e, &["optimistic_ok", "invalid type: string"]);
    let e = cloud_error(
        "optimistic-typo.toml",
        &with(CLOUD, toml::toml! { [connect] optimistic = true }),
    );
    assert_mentions(&e, &["unknown field `optimistic`", "optimistic_ok"]);
}

#[test]
fn wrong_type() {
    let e = cloud_error(
        "type.toml",
        &CLOUD.replace(r#"listen = "0.0.0.0:9000""#, "listen = 9000"),
    );
    assert_mentions(&e, &["listen = 9000", "invalid type: integer"]);

    let e = edge_error(
        "type-edge.toml",
        &with(EDGE, toml::toml! { [transport] heartbeat_interval = 5 }),
        Some("edge-1"),
    );
    assert_mentions(&e, &["heartbeat_interval = 5", "invalid type: integer"]);
}

#[test]
fn bad_socket_address() {
    let e = cloud_error(
        "addr.toml",
        &CLOUD.replace(r#"listen = "127.0.0.1:16443""#, r#"listen = "127.0.0.1""#),
    );
    assert_mentions(&e, &[r#"listen = "127.0.0.1""#, "invalid socket address"]);

    let e = cloud_error(
        "target.toml",
        &CLOUD.replace(r#"target = "127.0.0.1:6443""#, r#"target = "127.0.0.1""#),
    );
    assert_mentions(&e, &["`forward[0].target`", "`127.0.0.1` is not host:port"]);
}

#[test]
fn missing_required_key() {
    let e = cloud_error(
        "missing.toml",
        &CLOUD.replace("listen = \"0.0.0.0:9000\"\n", ""),
    );
    assert_mentions(&e, &["[tunnel]", "missing field `listen`"]);
}

#[test]
fn forward_to_unknown_node() {
    let e = cloud_error(
        "fwd.toml",
        &CLOUD.replace(r#"node = "edge-1""#, r#"node = "edge-9""#),
    );
    assert_mentions(&e, &["`forward[0].node`", "unknown node `edge-9`"]);
}

#[test]
fn duplicate_node() {
    let e = cloud_error("dup-node.toml", &{
        let mut config: Table = toml::from_str(CLOUD).expect("the base config parses");
        let nodes = config["node"].as_array_mut().expect("a node table");
        nodes.push(toml::toml! { name = "edge-1" }.into());
        toml::to_string(&config).expect("a config serialises")
    });
    assert_mentions(&e, &["`node[1].name`", "node `edge-1` is listed twice"]);
}

#[test]
fn duplicate_listen_address() {
    let e = cloud_error(
        "dup-listen.toml",
        &with(CLOUD, toml::toml! { [admin] listen = "0.0.0.0:9000" }),
    );
    assert_mentions(&e, &["`admin.listen`", "0.0.0.0:9000 is already used"]);
    // Port 0 is no claim: the kernel gives each listener a port of its own.
    let tmp = tempfile::tempdir().expect("tempdir");
    let text = with(
        EDGE,
        toml::toml! {
            [admin]
            listen = "127.0.0.1:0"

            [[reverse.forward]]
            listen = "127.0.0.1:0"
            target = "127.0.0.1:1"

            [[reverse.forward]]
            listen = "127.0.0.1:0"
            target = "127.0.0.1:1"
        },
    );
    EdgeConfig::load(
        &write(tmp.path(), "edge.toml", &text),
        Some("edge-1".into()),
    )
    .expect("several edge listeners on port 0");
}

#[test]
fn heartbeat_timeout_not_above_interval() {
    let text = with(
        CLOUD,
        toml::toml! {
            [transport]
            heartbeat_interval = "10s"
            heartbeat_timeout = "10s"
        },
    );
    let e = cloud_error("heartbeat.toml", &text);
    assert_mentions(
        &e,
        &[
            "`transport.heartbeat_timeout`",
            "must be longer than transport.heartbeat_interval",
        ],
    );
}

#[test]
fn edge_without_node_name() {
    let e = edge_error("no-node.toml", EDGE, None);
    assert_mentions(
        &e,
        &[
            "`node_name`",
            "not set, and NODE_NAME is not in the environment",
        ],
    );
    // An empty NODE_NAME is no name either.
    let e = edge_error("empty-node.toml", EDGE, Some(""));
    assert_mentions(&e, &["`node_name`", "not set"]);
}

#[test]
fn edge_without_credentials() {
    let e = edge_error(
        "no-creds.toml",
        &EDGE.replace("token = \"secret\"\n", ""),
        Some("edge-1"),
    );
    assert_mentions(&e, &["`cloud`", "set token, token_file, cert/key or [csr]"]);
}

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

#[test]
fn peers_and_kubernetes_keys_are_checked() {
    // The base cloud has no client_ca: peers need a CA from somewhere.
    let e = cloud_error(
        "peers-ca.toml",
        &with(CLOUD, toml::toml! { [peers] listen = "0.0.0.0:9002" }),
    );
    assert_mentions(&e, &["`peers.ca`", "tunnel.client_ca"]);

    let e = cloud_error(
        "peers-listen.toml",
        &with(
            CLOUD,
            toml::toml! {
                [peers]
                ca = "ca.crt"
                static = ["10.0.0.2:9002"]
            },
        ),
    );
    assert_mentions(&e, &["`peers.listen`", "required when replicas are listed"]);

    let bad = with(
        CLOUD,
        toml::toml! {
            [peers]
            listen = "0.0.0.0:9002"
            ca = "ca.crt"
            static = ["10.0.0.2"]
        },
    );
    assert_mentions(
        &cloud_error("peers-static.toml", &bad),
        &["`peers.static[0]`", "not host:port"],
    );

    let e = cloud_error(
        "peers-port.toml",
        &with(
            CLOUD,
            toml::toml! {
                [peers]
                listen = "0.0.0.0:9000"
                ca = "ca.crt"
            },
        ),
    );
    assert_mentions(&e, &["`peers.listen`", "already used"]);

    let e = cloud_error(
        "kube-svc.toml",
        &with(
            CLOUD,
            toml::toml! {
                [peers]
                listen = "0.0.0.0:9002"
                ca = "ca.crt"

                [kubernetes]
                peer_service = "tunnel-cloud-peers"
            },
        ),
    );
    assert_mentions(
        &e,
        &["`kubernetes.peer_service`", "kubernetes.enabled = true"],
    );

    let e = cloud_error(
        "kube-sel.toml",
        &with(
            CLOUD,
            toml::toml! {
                [kubernetes]
                enabled = true
                edge_selector = " "
            },
        ),
    );
    assert_mentions(&e, &["`kubernetes.edge_selector`"]);

    let tmp = tempfile::tempdir().expect("tempdir");
    let good = with(
        CLOUD,
        toml::toml! {
            [peers]
            listen = "0.0.0.0:9002"
            ca = "ca.crt"
            static = ["10.0.0.1:9002", "master-2:9002"]
        },
    );
    let cloud = CloudConfig::load(&write(tmp.path(), "cloud.toml", &good)).expect("valid peers");
    assert_eq!(
        cloud.peers.ca(&cloud.tunnel),
        Some(tmp.path().join("ca.crt").as_path()),
        "peers.ca is relative to the file"
    );
    assert_eq!(cloud.peers.server_name, "tunnel-cloud");
    assert_eq!(
        cloud.kubernetes.edge_selector,
        "node-role.kubernetes.io/edge"
    );
}

#[test]
fn edge_cloud_addresses_are_checked() {
    let e = edge_error(
        "addrs.toml",
        &with(EDGE, toml::toml! { [cloud] addresses = ["10.0.0.2"] }),
        Some("edge-1"),
    );
    assert_mentions(&e, &["`cloud.addresses[0]`", "not host:port"]);
    let tmp = tempfile::tempdir().expect("tempdir");
    let text = with(EDGE, toml::toml! { [cloud] addresses = ["10.0.0.2:9000"] });
    let edge = EdgeConfig::load(
        &write(tmp.path(), "edge.toml", &text),
        Some("edge-1".into()),
    )
    .expect("valid");
    assert_eq!(
        edge.cloud_addresses().collect::<Vec<_>>(),
        ["127.0.0.1:9000", "10.0.0.2:9000"]
    );
}

#[test]
fn token_review_keys_are_checked() {
    let no_file = CLOUD.replace("token_file = \"certs/tokens\"\n", "");
    let e = cloud_error("no-auth.toml", &no_file);
    assert_mentions(&e, &["`tunnel`", "kubernetes.token_review"]);
    let e = cloud_error(
        "tr-off.toml",
        &with(&no_file, toml::toml! { [kubernetes] token_review = true }),
    );
    assert_mentions(
        &e,
        &["`kubernetes.token_review`", "kubernetes.enabled = true"],
    );
    let on = with(
        &no_file,
        toml::toml! {
            [kubernetes]
            enabled = true
            token_review = true
        },
    );
    let e = cloud_error(
        "tr-rate.toml",
        &with(&on, toml::toml! { [kubernetes] token_review_rate = 0.0 }),
    );
    assert_mentions(&e, &["`kubernetes.token_review_rate`"]);
    let e = cloud_error(
        "tr-sa.toml",
        &with(
            &on,
            toml::toml! { [kubernetes] edge_service_account = "tunnel-edge" },
        ),
    );
    assert_mentions(&e, &["`kubernetes.edge_service_account`", "namespace:name"]);
    let tmp = tempfile::tempdir().expect("tempdir");
    let cloud = CloudConfig::load(&write(
        tmp.path(),
        "cloud.toml",
        &with(&on, toml::toml! { [kubernetes] token_review_cache = "90s" }),
    ))
    .expect("TokenReview alone is enough");
    assert_eq!(
        cloud.kubernetes.token_review_cache,
        std::time::Duration::from_secs(90)
    );
    assert_eq!(
        cloud.kubernetes.edge_service_account,
        "tunnel-system:tunnel-edge"
    );
}

#[test]
fn reverse_allowlist_is_validated_and_exact() {
    let e = cloud_error(
        "reverse.toml",
        &with(
            CLOUD,
            toml::toml! { [reverse.allow] "edge-1" = ["127.0.0.1"] },
        ),
    );
    assert_mentions(
        &e,
        &["`reverse.allow.edge-1[0]`", "`127.0.0.1` is not host:port"],
    );
    let e = cloud_error(
        "reverse-name.toml",
        &with(
            CLOUD,
            toml::toml! { [reverse.allow] "Bad_Name" = ["127.0.0.1:80"] },
        ),
    );
    assert_mentions(&e, &["`reverse.allow.Bad_Name`"]);

    let tmp = tempfile::tempdir().expect("tempdir");
    let text = with(
        CLOUD,
        toml::toml! { [reverse.allow] "edge-1" = ["127.0.0.1:8428"] },
    );
    let cloud = CloudConfig::load(&write(tmp.path(), "cloud.toml", &text)).expect("cloud");
    assert!(cloud.reverse.allows("edge-1", "127.0.0.1:8428"));
    assert!(
        !cloud.reverse.allows("edge-1", "127.0.0.1:8429"),
        "another port"
    );
    assert!(
        !cloud.reverse.allows("edge-2", "127.0.0.1:8428"),
        "another node"
    );
}

#[test]
fn cluster_identity_takes_its_name_from_cluster_name_only() {
    let tmp = tempfile::tempdir().expect("tempdir");
    let text = with(
        EDGE,
        toml::toml! {
            identity = "cluster"
            cluster_name = "prod-eu"
        },
    );
    let edge = EdgeConfig::load(
        &write(tmp.path(), "edge.toml", &text),
        Some("node-7".into()),
    )
    .expect("cluster edge");
    assert_eq!(
        edge.node(),
        "prod-eu",
        "NODE_NAME is not the cluster's name"
    );

    let e = edge_error(
        "cluster-missing.toml",
        &with(EDGE, toml::toml! { identity = "cluster" }),
        Some("node-7"),
    );
    assert_mentions(
        &e,
        &["`cluster_name`", "required with identity = \"cluster\""],
    );
    let e = edge_error(
        "cluster-both.toml",
        &with(
            EDGE,
            toml::toml! {
                identity = "cluster"
                node_name = "x"
                cluster_name = "c"
            },
        ),
        None,
    );
    assert_mentions(&e, &["`node_name`", "set cluster_name"]);
    let e = edge_error(
        "cluster-kind.toml",
        &with(EDGE, toml::toml! { identity = "pod" }),
        Some("edge-1"),
    );
    assert_mentions(&e, &["unknown variant `pod`"]);
}

#[test]
fn edge_forwards_reverse_bounds_and_hooks_are_validated() {
    let text = with(
        EDGE,
        toml::toml! {
            [[reverse.forward]]
            listen = "127.0.0.1:7000"
            target = "hub"
        },
    );
    assert_mentions(
        &edge_error("fwd-target.toml", &text, Some("edge-1")),
        &["`reverse.forward[0].target`", "is not host:port"],
    );
    // The name the edge's listeners had before: told where they went.
    let text = with(
        EDGE,
        toml::toml! {
            [[forward]]
            listen = "127.0.0.1:7000"
            target = "hub:1"
        },
    );
    assert_mentions(
        &edge_error("fwd-moved.toml", &text, Some("edge-1")),
        &["`forward`", "`[[reverse.forward]]` in an edge config"],
    );
    let text = with(EDGE, toml::toml! { [reverse] max_pending = 0 });
    assert_mentions(
        &edge_error("pending.toml", &text, Some("edge-1")),
        &["`reverse.max_pending`", "at least 1"],
    );
    let text = with(EDGE, toml::toml! { [hooks] pre_start = [""] });
    assert_mentions(
        &edge_error("hook-empty.toml", &text, Some("edge-1")),
        &["`hooks.pre_start`", "must not be empty"],
    );
    let text = with(EDGE, toml::toml! { [hooks] failure = "ignore" });
    assert_mentions(
        &edge_error("hook-failure.toml", &text, Some("edge-1")),
        &["unknown variant `ignore`"],
    );
    let text = with(EDGE, toml::toml! { [proxy] listen = "localhost" });
    assert_mentions(
        &edge_error("proxy-listen.toml", &text, Some("edge-1")),
        &["listen = \"localhost\"", "invalid socket address"],
    );
    let text = with(EDGE, toml::toml! { [proxy] port = 3128 });
    assert_mentions(
        &edge_error("proxy-key.toml", &text, Some("edge-1")),
        &["unknown field `port`"],
    );
    let text = with(EDGE, toml::toml! { [cloud] reauth_interval = "0s" });
    assert_mentions(
        &edge_error("edge-reauth.toml", &text, Some("edge-1")),
        &["`cloud.reauth_interval`", "at least 1s"],
    );
    let text = with(CLOUD, toml::toml! { [tunnel] reauth_interval = "500ms" });
    assert_mentions(
        &cloud_error("cloud-reauth.toml", &text),
        &["`tunnel.reauth_interval`", "at least 1s"],
    );
}

#[test]
fn the_redirect_fails_open_after_at_least_a_second() {
    let e = cloud_error(
        "redirect-fail-open.toml",
        &with(
            CLOUD,
            toml::toml! {
                [redirect]
                enabled = true
                fail_open_after = "0s"
            },
        ),
    );
    assert_mentions(&e, &["`redirect.fail_open_after`", "at least 1s"]);
}

#[test]
fn redirect_listeners_must_be_of_their_family() {
    for key in ["listen6", "pod_listen6"] {
        let e = cloud_error(
            "redirect-families.toml",
            &with(CLOUD, {
                let mut redirect = toml::toml! { enabled = true };
                redirect.insert(key.into(), "127.0.0.1:10261".into());
                Table::from_iter([("redirect".to_string(), redirect.into())])
            }),
        );
        assert_mentions(
            &e,
            &[&format!("`redirect.{key}`"), "must be an IPv6 address"],
        );
    }
    let tmp = tempfile::tempdir().expect("tempdir");
    let config = CloudConfig::load(&write(
        tmp.path(),
        "cloud.toml",
        &with(
            CLOUD,
            toml::toml! {
                [redirect]
                enabled = true
                listen6 = "[::1]:10261"
            },
        ),
    ))
    .expect("an IPv6 listen6 is valid");
    assert_eq!(
        config.redirect.listen6,
        Some("[::1]:10261".parse().unwrap())
    );
    // Absent: the IPv6 loopback on the port of `listen`.
    assert_eq!(
        tunnel_user::config::RedirectConfig::default().default_listen6(),
        "[::1]:10260".parse::<std::net::SocketAddr>().unwrap()
    );
}

#[test]
fn csr_signer_and_edge_configs_are_checked() {
    let csr_cloud = with(
        CLOUD,
        toml::toml! {
            [tunnel]
            client_ca = "certs/ca.crt"

            [kubernetes]
            enabled = true

            [csr]
            enabled = true
            ca_key = "certs/ca.key"
        },
    );
    let tmp = tempfile::tempdir().expect("tempdir");
    let cloud =
        CloudConfig::load(&write(tmp.path(), "cloud.toml", &csr_cloud)).expect("a signing cloud");
    assert_eq!(cloud.csr.signer_name, "tunnel.io/edge-client");
    assert_eq!(cloud.csr.max_lifetime, std::time::Duration::from_secs(3600));
    assert!(
        cloud.csr.ca_key.as_ref().is_some_and(|k| k.is_absolute()),
        "resolved"
    );

    let e = cloud_error(
        "csr-long.toml",
        &with(&csr_cloud, toml::toml! { [csr] max_lifetime = "2h" }),
    );
    assert_mentions(&e, &["`csr.max_lifetime`", "an hour after its approval"]);
    let e = cloud_error(
        "csr-signer.toml",
        &with(
            &csr_cloud,
            toml::toml! { [csr] signer_name = "kubernetes.io/kube-apiserver-client" },
        ),
    );
    assert_mentions(&e, &["`csr.signer_name`", "not kubernetes.io"]);
    let e = cloud_error(
        "csr-nokey.toml",
        &csr_cloud.replace("ca_key = \"certs/ca.key\"\n", ""),
    );
    assert_mentions(&e, &["`csr.ca_key`", "required"]);
    let e = cloud_error(
        "csr-nokube.toml",
        &with(
            CLOUD,
            toml::toml! {
                [csr]
                enabled = true
                ca_key = "k"
            },
        ),
    );
    assert_mentions(&e, &["`csr.enabled`", "needs tunnel.client_ca"]);

    let csr_edge = "[cloud]\naddress = \"127.0.0.1:9000\"\nserver_name = \"tunnel-cloud\"\nca = \"certs/ca.crt\"\n\n[csr]\nenabled = true\ndir = \"state\"\n";
    let edge = EdgeConfig::load(
        &write(tmp.path(), "edge.toml", csr_edge),
        Some("edge-1".into()),
    )
    .expect("an edge with [csr] needs no other credential");
    assert!(
        edge.csr.dir.is_absolute(),
        "resolved: {}",
        edge.csr.dir.display()
    );
    let e = edge_error(
        "csr-edge.toml",
        &with(csr_edge, toml::toml! { [csr] lifetime = "5m" }),
        Some("edge-1"),
    );
    assert_mentions(&e, &["`csr.lifetime`", "at least 10m"]);
    let e = edge_error(
        "csr-cert.toml",
        &with(
            csr_edge,
            toml::toml! {
                [cloud]
                cert = "a.crt"
                key = "a.key"
            },
        ),
        Some("edge-1"),
    );
    assert_mentions(&e, &["`cloud.cert`", "comes from the cluster"]);
}

/// `csr.serving`: the replica's own serving certificate replaces `tunnel.cert`/`key`,
/// needs the CA and its key, and its lifetime is bounded.
#[test]
fn csr_serving_config_is_checked() {
    let files = "cert = \"certs/cloud.crt\"\nkey = \"certs/cloud.key\"\n";
    let serving_cloud = with(
        &CLOUD.replace(files, ""),
        toml::toml! {
            [tunnel]
            client_ca = "certs/ca.crt"

            [csr]
            serving = true
            ca_key = "certs/ca.key"
            serving_names = ["tunnel.example.com", "10.0.0.10"]
        },
    );
    let tmp = tempfile::tempdir().expect("tempdir");
    let cloud = CloudConfig::load(&write(tmp.path(), "cloud.toml", &serving_cloud))
        .expect("a cloud that issues its own serving certificate");
    assert!(cloud.csr.serving && !cloud.csr.enabled);
    assert_eq!(cloud.tunnel.cert, None);
    assert_eq!(
        cloud.csr.serving_lifetime,
        std::time::Duration::from_secs(24 * 3600)
    );

    let e = cloud_error(
        "serving-both.toml",
        &with(
            &serving_cloud,
            toml::toml! {
                [tunnel]
                cert = "certs/cloud.crt"
                key = "certs/cloud.key"
            },
        ),
    );
    assert_mentions(
        &e,
        &["`csr.serving`", "leave out tunnel.cert and tunnel.key"],
    );
    let e = cloud_error(
        "serving-nokey.toml",
        &serving_cloud.replace("ca_key = \"certs/ca.key\"\n", ""),
    );
    assert_mentions(&e, &["`csr.ca_key`", "required by csr.serving"]);
    let e = cloud_error(
        "serving-noca.toml",
        &serving_cloud.replace("client_ca = \"certs/ca.crt\"\n", ""),
    );
    assert_mentions(&e, &["`csr.serving`", "needs tunnel.client_ca"]);
    for lifetime in ["5s", "100d"] {
        let e = cloud_error(
            "serving-lifetime.toml",
            &with(
                &serving_cloud,
                toml::toml! { [csr] serving_lifetime = lifetime },
            ),
        );
        assert_mentions(&e, &["`csr.serving_lifetime`", "between 10s and 90d"]);
    }
    let e = cloud_error(
        "serving-name.toml",
        &serving_cloud.replace("\"tunnel.example.com\"", "\"not a name\""),
    );
    assert_mentions(&e, &["`csr.serving_names[0]`", "neither an IP address"]);
    // Without csr.serving the files stay required.
    let e = cloud_error("no-cert.toml", &CLOUD.replace(files, ""));
    assert_mentions(&e, &["`tunnel.cert`", "required"]);
}
