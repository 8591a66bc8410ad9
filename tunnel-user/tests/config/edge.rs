//! The edge's own checks: its name, credentials, cloud addresses, identity, forwards,
//! hooks and bounds.

use super::*;

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
