//! Mistakes any config can make: unknown keys, wrong types, bad addresses, missing or
//! duplicate entries, inconsistent values.

use super::*;

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
fn connect_optimistic_ok_words_and_booleans() {
    let cloud = CloudConfig::load(&examples().join("cloud.toml")).expect("cloud.toml");
    assert_eq!(
        cloud.connect.optimistic_ok,
        OptimisticOk::Recent,
        "the default"
    );
    for (value, meant) in [
        (toml::Value::from("never"), OptimisticOk::Never),
        (toml::Value::from("recent"), OptimisticOk::Recent),
        (toml::Value::from("always"), OptimisticOk::Always),
        (toml::Value::from(false), OptimisticOk::Never),
        (toml::Value::from(true), OptimisticOk::Always),
    ] {
        let mut connect = Table::new();
        connect.insert("optimistic_ok".into(), value.clone());
        let text = with(
            CLOUD,
            Table::from_iter([("connect".into(), connect.into())]),
        );
        let tmp = tempfile::tempdir().expect("tempdir");
        let cloud = CloudConfig::load(&write(tmp.path(), "cloud.toml", &text)).expect("valid");
        assert_eq!(
            cloud.connect.optimistic_ok, meant,
            "optimistic_ok = {value}"
        );
    }
    let e = cloud_error(
        "optimistic.toml",
        &with(CLOUD, toml::toml! { [connect] optimistic_ok = "yes" }),
    );
    assert_mentions(
        &e,
        &[
            "optimistic_ok",
            "\"yes\"",
            "\"never\", \"recent\" or \"always\"",
        ],
    );
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
    assert_mentions(&e, &["`tunnel.listen`: required: where edges connect"]);
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
fn node_address_that_is_never_an_edges() {
    for (address, why) in [
        ("127.0.0.1", "loopback"),
        ("::ffff:127.0.0.1", "loopback"),
        ("::1", "loopback"),
        ("0.0.0.0", "unspecified"),
        ("169.254.169.254", "link-local"),
        ("fe80::1", "link-local"),
        ("224.0.0.251", "multicast"),
    ] {
        let e = cloud_error(
            "reserved.toml",
            &CLOUD.replace("\"127.1.0.5\"", &format!("\"127.1.0.5\", \"{address}\"")),
        );
        assert_mentions(
            &e,
            &[
                "`node[0].addresses`",
                &format!("node `edge-1`: {address} is a {why} address"),
            ],
        );
    }
    // Two nodes, one address written two ways.
    let e = cloud_error("mapped-twice.toml", &{
        let mut config: Table = toml::from_str(CLOUD).expect("the base config parses");
        let nodes = config["node"].as_array_mut().expect("a node table");
        nodes.push(toml::toml! { name = "edge-2" addresses = ["::ffff:127.1.0.5"] }.into());
        toml::to_string(&config).expect("a config serialises")
    });
    assert_mentions(&e, &["`node[1].addresses`", "belongs to two nodes"]);
}

#[test]
fn edge_selector_that_does_not_parse() {
    let e = cloud_error(
        "selector.toml",
        &with(
            CLOUD,
            toml::toml! { [kubernetes] enabled = true edge_selector = "zone in (a" },
        ),
    );
    assert_mentions(&e, &["`kubernetes.edge_selector`", "unbalanced `(`"]);
}

#[test]
fn duplicate_listen_address() {
    let e = cloud_error(
        "dup-listen.toml",
        &with(CLOUD, toml::toml! { [admin] listen = "0.0.0.0:9000" }),
    );
    assert_mentions(&e, &["`admin.listen`", "0.0.0.0:9000 is already used"]);
    // The edge's CONNECT proxy is one of its listeners too.
    let text = with(
        EDGE,
        toml::toml! {
            [admin]
            listen = "127.0.0.1:3128"

            [proxy]
            listen = "127.0.0.1:3128"
        },
    );
    assert_mentions(
        &edge_error("dup-proxy.toml", &text, Some("edge-1")),
        &["`proxy.listen`", "127.0.0.1:3128 is already used"],
    );
    let text = with(
        EDGE,
        toml::toml! {
            [proxy]
            listen = "127.0.0.1:3128"

            [[reverse.forward]]
            listen = "127.0.0.1:3128"
            target = "127.0.0.1:1"
        },
    );
    assert_mentions(
        &edge_error("dup-proxy-forward.toml", &text, Some("edge-1")),
        &[
            "`reverse.forward[0].listen`",
            "127.0.0.1:3128 is already used",
        ],
    );
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
fn a_listener_takes_at_least_one_connection() {
    let transport = toml::toml! { [transport] max_connections_per_listener = 0 };
    let parts = [
        "`transport.max_connections_per_listener`",
        "must be at least 1",
    ];
    let e = cloud_error("max-connections.toml", &with(CLOUD, transport.clone()));
    assert_mentions(&e, &parts);
    let edge = with(EDGE, transport);
    let e = edge_error("max-connections-edge.toml", &edge, Some("edge-1"));
    assert_mentions(&e, &parts);
}
