//! The cloud's own checks: peers and Kubernetes, TokenReview, the reverse allowlist,
//! the redirect and its ports, the HTTPS entry's client CA, and CSR signing and serving
//! certificates.

use super::*;

/// The uid of user nobody, which any local user's process may run as.
const NOBODY: u32 = 65534;

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
        "[::1]:250".parse::<std::net::SocketAddr>().unwrap()
    );
}

/// `redirect.pod_port`, the form one config for every node takes (deploy/'s): pods land
/// on this node's address from `NODE_IPS` (the downward API's status.hostIP), read at
/// start. An address missing, not this node's, or one a pod cannot reach is refused,
/// naming the key; so are the key beside explicit pod addresses, and a pod address a
/// pod cannot reach.
#[test]
fn pod_port_listens_on_this_node_s_address_from_node_ips() {
    let tmp = tempfile::tempdir().expect("tempdir");
    let config = CloudConfig::load(&write(
        tmp.path(),
        "cloud.toml",
        &with(
            CLOUD,
            toml::toml! {
                [redirect]
                enabled = true
                pin_dir = "/sys/fs/bpf/tunnel"
                pod_port = 250
            },
        ),
    ))
    .expect("pod_port alone is valid");
    let own: Vec<std::net::IpAddr> = ["127.0.0.1", "10.0.0.5", "::1", "fd00::5"]
        .iter()
        .map(|a| a.parse().expect("ip"))
        .collect();
    // Dual stack (status.hostIPs): each family's listener; one family: that one only.
    for (node_ips, v4, v6) in [
        (
            "10.0.0.5,fd00::5",
            Some("10.0.0.5:250"),
            Some("[fd00::5]:250"),
        ),
        (" 10.0.0.5 ", Some("10.0.0.5:250"), None),
        ("fd00::5", None, Some("[fd00::5]:250")),
    ] {
        let mut r = config.redirect.clone();
        r.resolve_pod_port(Some(node_ips), &own)
            .unwrap_or_else(|e| panic!("NODE_IPS={node_ips}: {e}"));
        let parse = |a: Option<&str>| a.map(|a| a.parse::<std::net::SocketAddr>().expect("addr"));
        assert_eq!(
            (r.pod_listen, r.pod_listen6),
            (parse(v4), parse(v6)),
            "{node_ips}"
        );
    }
    for (node_ips, problem) in [
        (None, "from NODE_IPS, which is not in the environment"),
        (Some(" "), "from NODE_IPS, which is not in the environment"),
        (Some("worker-1"), "`worker-1` is not an IP address"),
        (
            Some("10.0.0.9"),
            "NODE_IPS names 10.0.0.9, which is not an address of this node",
        ),
        (
            Some("10.0.0.5,fd00::9"),
            "NODE_IPS names fd00::9, which is not an address",
        ),
        (
            Some("127.0.0.1"),
            "NODE_IPS names 127.0.0.1 (loopback), which a pod cannot reach",
        ),
        (
            Some("::1"),
            "NODE_IPS names ::1 (loopback), which a pod cannot reach",
        ),
    ] {
        let mut r = config.redirect.clone();
        let e = r
            .resolve_pod_port(node_ips, &own)
            .expect_err("a pod address that cannot be");
        assert_mentions(&e, &["redirect.pod_port: ", problem]);
        assert_eq!((r.pod_listen, r.pod_listen6), (None, None));
    }
    // Without pod_port, NODE_IPS changes nothing.
    let mut r = tunnel_user::config::RedirectConfig::default();
    r.resolve_pod_port(None, &own).expect("nothing to resolve");
    assert_eq!((r.pod_listen, r.pod_listen6), (None, None));

    for (change, key, problem) in [
        (
            toml::toml! { pod_port = 250
            pod_listen = "10.0.0.5:250" },
            "`redirect.pod_port`",
            "not with redirect.pod_listen or pod_listen6",
        ),
        (
            toml::toml! { pod_port = 1024
            pin_dir = "/sys/fs/bpf/tunnel" },
            "`redirect.pod_port`",
            "port 1024 is one any local user can listen on",
        ),
        (
            toml::toml! { pod_listen = "127.1.0.1:250" },
            "`redirect.pod_listen`",
            "127.1.0.1:250 (loopback) is one a pod cannot reach",
        ),
        (
            toml::toml! { pod_listen6 = "[::]:250" },
            "`redirect.pod_listen6`",
            "[::]:250 (unspecified) is one a pod cannot reach",
        ),
    ] {
        let mut redirect = toml::toml! { enabled = true };
        redirect.extend(change);
        let e = cloud_error(
            "redirect-pods.toml",
            &with(
                CLOUD,
                Table::from_iter([("redirect".to_string(), redirect.into())]),
            ),
        );
        assert_mentions(&e, &[key, problem]);
    }
}

#[test]
fn the_redirect_and_connect_ports_are_ones_only_root_can_listen_on() {
    let defaults = tunnel_user::config::RedirectConfig::default();
    let by_default = [
        ("redirect.listen", defaults.listen),
        ("redirect.listen6", defaults.default_listen6()),
    ];
    let deploy = Path::new(env!("CARGO_MANIFEST_DIR")).join("../deploy/config/cloud.toml");
    let deploy = CloudConfig::load(&deploy).expect("deploy/config/cloud.toml");
    let example = CloudConfig::load(&examples().join("cloud.toml")).expect("cloud.toml");
    let mut shipped = Vec::new();
    for (file, c) in [("deploy", &deploy), ("example", &example)] {
        let r = &c.redirect;
        shipped.push((file, "redirect.listen", r.listen));
        shipped.push((
            file,
            "redirect.listen6",
            r.listen6.unwrap_or(r.default_listen6()),
        ));
        shipped.push((
            file,
            "connect.listen",
            c.connect.listen.expect("connect.listen"),
        ));
    }
    for (key, addr) in by_default {
        assert!(
            addr.port() > 0 && addr.port() < 1024,
            "default {key} {addr}"
        );
    }
    for (file, key, addr) in shipped {
        assert!(addr.port() > 0 && addr.port() < 1024, "{file} {key} {addr}");
    }
    // The attack: while no cloud listens (after a crash the pinned programs still
    // redirect), another user of the master listens there first.
    if !common::privileged::is_root() {
        common::privileged::cannot_run("switching to user nobody needs root");
        return;
    }
    for (key, addr) in by_default {
        assert_eq!(
            common::privileged::listen_as(NOBODY, addr, false),
            libc::EACCES,
            "user nobody could listen on the default {key} {addr}"
        );
    }
}

/// A redirect port any user can listen on, with pins: after a crash the programs keep
/// sending kube-apiserver's connects there, and user nobody, who listens on it first,
/// receives them. Refused at load, naming the key and the port.
#[test]
fn a_pinned_redirect_on_a_port_any_user_can_listen_on_is_refused() {
    let port = common::ClosedPort::new();
    let addr = port.addr;
    drop(port);
    for (key, value) in [
        ("listen", addr.to_string()),
        ("listen", "127.0.0.1:0".to_string()),
        ("listen6", format!("[::1]:{}", addr.port())),
        ("pod_listen", format!("10.0.0.10:{}", addr.port())),
    ] {
        let e = cloud_error(
            "redirect-unprivileged.toml",
            &with(CLOUD, {
                let mut redirect = toml::toml! {
                    enabled = true
                    pin_dir = "/sys/fs/bpf/tunnel"
                };
                redirect.insert(key.into(), value.clone().into());
                Table::from_iter([("redirect".to_string(), redirect.into())])
            }),
        );
        assert_mentions(
            &e,
            &[
                &format!("`redirect.{key}`"),
                "any local user can listen on",
                "use a port from 1 to 1023",
            ],
        );
    }
    // Without pins the programs go with the process: nothing redirects to a dead port.
    let tmp = tempfile::tempdir().expect("tempdir");
    CloudConfig::load(&write(
        tmp.path(),
        "cloud.toml",
        &with(
            CLOUD,
            toml::toml! {
                [redirect]
                enabled = true
                listen = (addr.to_string())
            },
        ),
    ))
    .expect("an unpinned redirect may listen anywhere");
    // Why: user nobody may listen there.
    if !common::privileged::is_root() {
        common::privileged::cannot_run("switching to user nobody needs root");
        return;
    }
    assert_eq!(
        common::privileged::listen_as(NOBODY, addr, false),
        0,
        "user nobody listens on {addr}"
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
    assert_eq!(
        cloud.kubernetes.relay_service_account,
        "tunnel-system:tunnel-relay"
    );
    let e = cloud_error(
        "csr-one-account.toml",
        &with(
            &csr_cloud,
            toml::toml! { [kubernetes] relay_service_account = "tunnel-system:tunnel-edge" },
        ),
    );
    assert_mentions(
        &e,
        &["`kubernetes.relay_service_account`: must differ from kubernetes.edge_service_account"],
    );
    let e = cloud_error(
        "csr-bad-account.toml",
        &with(
            &csr_cloud,
            toml::toml! { [kubernetes] relay_service_account = "tunnel-relay" },
        ),
    );
    assert_mentions(
        &e,
        &["`kubernetes.relay_service_account`: must be namespace:name"],
    );
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

    // The CA kept in the cluster: it needs the API, files to write it to, and names
    // that can be objects' names.
    let in_cluster = with(
        &csr_cloud,
        toml::toml! {
            [csr]
            ca_secret = "tunnel-cloud-tls"
            ca_config_map = "tunnel-ca.crt"
        },
    );
    let cloud = CloudConfig::load(&write(tmp.path(), "cloud-ca.toml", &in_cluster))
        .expect("a cloud keeping its CA in the cluster");
    assert_eq!(cloud.csr.ca_secret.as_deref(), Some("tunnel-cloud-tls"));
    assert_eq!(cloud.csr.ca_config_map.as_deref(), Some("tunnel-ca.crt"));
    let e = cloud_error(
        "ca-nokube.toml",
        &with(&in_cluster, toml::toml! { [kubernetes] enabled = false }),
    );
    assert_mentions(&e, &["`csr.ca_secret`", "needs kubernetes.enabled"]);
    let e = cloud_error(
        "ca-name.toml",
        &with(&in_cluster, toml::toml! { [csr] ca_secret = "Tunnel_CA" }),
    );
    assert_mentions(
        &e,
        &["`csr.ca_secret`", "`Tunnel_CA` is not an object name"],
    );
    let e = cloud_error(
        "ca-nokey.toml",
        &in_cluster.replace("ca_key = \"certs/ca.key\"\n", ""),
    );
    assert_mentions(&e, &["`csr.ca_key`"]);

    let csr_edge = "[cloud]\naddress = \"127.0.0.1:9000\"\nserver_name = \"tunnel-cloud\"\nca = \"certs/ca.crt\"\n\n[csr]\nenabled = true\ndir = \"state\"\n";
    let edge = EdgeConfig::load(
        &write(tmp.path(), "edge.toml", csr_edge),
        Some("edge-1".into()),
    )
    .expect("an edge with [csr] needs no other credential");
    assert!(
        edge.csr_dir().is_absolute(),
        "resolved: {}",
        edge.csr_dir().display()
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

#[test]
fn an_https_entry_needs_the_ca_of_kube_apiservers_kubelet_client_certificate() {
    let entry = |client_ca: Option<&str>| {
        let mut https = toml::toml! {
            listen = "127.0.0.1:11250"
            cert = "certs/kubelet.crt"
            key = "certs/kubelet.key"
            target = "127.0.0.1:10250"
        };
        if let Some(ca) = client_ca {
            https.insert("client_ca".into(), ca.into());
        }
        with(CLOUD, toml::toml! { https = [https] })
    };
    let e = cloud_error("https.toml", &entry(None));
    assert_mentions(
        &e,
        &[
            "`https[0].client_ca`: required",
            "kube-apiserver's kubelet client certificate",
            "exec in every pod of every edge",
        ],
    );

    let tmp = tempfile::tempdir().expect("tempdir");
    let path = write(tmp.path(), "cloud.toml", &entry(Some("certs/ca.crt")));
    let config = CloudConfig::load(&path).expect("with client_ca");
    assert_eq!(
        config.https[0].client_ca,
        Some(tmp.path().join("certs/ca.crt")),
        "resolved against the file's directory"
    );
}

#[test]
fn a_relay_serves_the_redirect_only() {
    let relay = r#"
role = "relay"
[tunnel]
cert = "certs/relay-worker-1.crt"
key = "certs/relay-worker-1.key"
client_ca = "certs/ca.crt"
[peers]
static = ["10.0.0.1:9443"]
[redirect]
enabled = true
"#;
    let tmp = tempfile::tempdir().expect("tempdir");
    CloudConfig::load(&write(tmp.path(), "relay.toml", relay)).expect("a valid relay");
    let serving = [
        (
            "`tunnel.listen`",
            toml::toml! { [tunnel] listen = "0.0.0.0:9000" },
        ),
        (
            "`tunnel.token_file`",
            toml::toml! { [tunnel] token_file = "tokens" },
        ),
        (
            "`forward`",
            toml::toml! { [[forward]] listen = "127.0.0.1:16443" target = "127.0.0.1:6443" },
        ),
        (
            "`connect.listen`",
            toml::toml! { [connect] listen = "127.0.0.1:8080" },
        ),
        (
            "`peers.listen`",
            toml::toml! { [peers] listen = "0.0.0.0:9002" },
        ),
        (
            "`csr.enabled`",
            toml::toml! { [csr] enabled = true ca_key = "ca.key" },
        ),
        (
            "`csr.ca_config_map`",
            toml::toml! { [csr] ca_config_map = "tunnel-ca.crt" },
        ),
    ];
    for (key, change) in serving {
        let e = cloud_error("relay-serving.toml", &with(relay, change));
        assert_mentions(&e, &[key, "not on a relay"]);
    }
    let e = cloud_error(
        "relay-no-redirect.toml",
        &with(relay, toml::toml! { [redirect] enabled = false }),
    );
    assert_mentions(&e, &["`redirect.enabled`: required on a relay"]);
    let e = cloud_error(
        "relay-no-replicas.toml",
        &relay.replace("static = [\"10.0.0.1:9443\"]", ""),
    );
    assert_mentions(&e, &["`peers.static`: a relay needs the replicas"]);
    let e = cloud_error(
        "relay-no-cert.toml",
        &relay.replace("cert = \"certs/relay-worker-1.crt\"\n", ""),
    );
    assert_mentions(&e, &["`tunnel.cert`", "system:tunnel-relay:<node>"]);

    // Or its certificate by CSR: then no files, and the [relay.csr] keys are checked.
    let by_csr = relay
        .replace("cert = \"certs/relay-worker-1.crt\"\n", "")
        .replace("key = \"certs/relay-worker-1.key\"\n", "");
    let by_csr = with(&by_csr, toml::toml! { [relay.csr] enabled = true });
    let loaded = CloudConfig::load(&write(tmp.path(), "relay-csr.toml", &by_csr)).expect("by CSR");
    assert_eq!(
        loaded.relay_csr_dir(),
        std::path::PathBuf::from(CloudConfig::RELAY_CSR_DIR)
    );
    let e = cloud_error(
        "relay-csr-and-files.toml",
        &with(relay, toml::toml! { [relay.csr] enabled = true }),
    );
    assert_mentions(&e, &["`tunnel.cert`: not with [relay.csr] enabled"]);
    for (key, change) in [
        (
            "`relay.node_name`",
            toml::toml! { [relay] node_name = "Worker_1" },
        ),
        (
            "`relay.csr.lifetime`: must be at least 10m",
            toml::toml! { [relay.csr] lifetime = "1m" },
        ),
        (
            "`relay.csr.signer_name`",
            toml::toml! { [relay.csr] signer_name = "kubernetes.io/x" },
        ),
    ] {
        let e = cloud_error("relay-csr-keys.toml", &with(&by_csr, change));
        assert_mentions(&e, &[key]);
    }
    let e = cloud_error(
        "replica-with-relay.toml",
        &with(CLOUD, toml::toml! { [relay.csr] enabled = true }),
    );
    assert_mentions(&e, &["`relay`: only with role = \"relay\""]);

    let e = cloud_error("role.toml", &with(CLOUD, toml::toml! { role = "worker" }));
    assert_mentions(
        &e,
        &["unknown variant `worker`, expected `replica` or `relay`"],
    );
}
