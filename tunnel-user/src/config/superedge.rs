//! SuperEdge `tunnel_cloud.toml` / `tunnel_edge.toml` compatibility.
//!
//! The files are walked by hand rather than deserialized into structs so that every
//! message can name the full dotted key (`mode.cloud.stream.server.grpcport`), and so
//! that SuperEdge keys that mean nothing here can be told apart from keys SuperEdge
//! never had: the first are warnings (a SuperEdge config must load unchanged), the
//! second are errors (a typo must not silently drop a setting).

use std::net::SocketAddr;
use std::path::{Path, PathBuf};

use super::{
    AdminConfig, AllowConfig, CloudClientConfig, CloudConfig, ConfigError, ConnectConfig,
    EdgeConfig, EdgeHttpsConfig, EdgeReverseConfig, ForwardConfig, HooksConfig, HttpsEntryConfig,
    Identity, KubernetesConfig, PeersConfig, RedirectConfig, ReverseConfig, RuntimeConfig,
    TransportConfig, TunnelServerConfig, cloud::HTTPS_CLIENT_CA,
};
use crate::addr::Target;

/// A SuperEdge key that is accepted but has no effect here, and why.
#[derive(Debug, PartialEq)]
struct Ignored {
    key: String,
    why: &'static str,
}

const WHY_DNS: &str =
    "routing here uses the eBPF redirect, not SuperEdge's coredns hosts hijacking";
const WHY_CHANNELZ: &str = "gRPC channelz is not served";
const WHY_METRICS: &str = "no separate metrics listener";
const WHY_OTHER_SIDE: &str = "this section configures the other end of the tunnel";

pub(crate) fn cloud_from_superedge(file: &Path, text: &str) -> Result<CloudConfig, ConfigError> {
    let root: toml::Table = super::parse_toml(file, text)?;
    let mut ignored = Vec::new();
    let config = cloud(&Section::root(file, &root), &mut ignored)?;
    warn_ignored(file, &ignored);
    Ok(config)
}

pub(crate) fn edge_from_superedge(file: &Path, text: &str) -> Result<EdgeConfig, ConfigError> {
    let root: toml::Table = super::parse_toml(file, text)?;
    let mut ignored = Vec::new();
    let config = edge(&Section::root(file, &root), &mut ignored)?;
    warn_ignored(file, &ignored);
    Ok(config)
}

fn warn_ignored(file: &Path, ignored: &[Ignored]) {
    for i in ignored {
        tracing::warn!(file = %file.display(), key = %i.key, "SuperEdge setting ignored: {}", i.why);
    }
}

/// `[mode]`, checked for the side being loaded; returns the side's own table.
fn mode<'a>(
    root: &Section<'a>,
    side: &str,
    ignored: &mut Vec<Ignored>,
) -> Result<Section<'a>, ConfigError> {
    root.check_keys(&["mode"], &[], ignored)?;
    let mode = root.require_table("mode")?;
    let other = if side == "cloud" { "edge" } else { "cloud" };
    // SuperEdge reads one struct holding both sides, so a file with both is valid there.
    mode.check_keys(&[side], &[(other, WHY_OTHER_SIDE)], ignored)?;
    mode.table(side)?.ok_or_else(|| {
        let hint = if mode.table.contains_key(other) {
            format!(" (this is a tunnel-{other} config)")
        } else {
            String::new()
        };
        mode.invalid(
            side,
            format!("missing: tunnel {side} needs a [mode.{side}] table{hint}"),
        )
    })
}

fn cloud(root: &Section<'_>, ignored: &mut Vec<Ignored>) -> Result<CloudConfig, ConfigError> {
    let cloud = mode(root, "cloud", ignored)?;
    cloud.check_keys(&["stream", "tcp", "https"], &[], ignored)?;
    let (tunnel, admin) = cloud_stream(&cloud, ignored)?;
    let forwards = cloud_tcp(&cloud)?;
    let https = cloud_https(&cloud, ignored)?;
    Ok(CloudConfig {
        role: super::Role::Replica,
        relay: super::RelayConfig::default(),
        tunnel,
        admin,
        nodes: Vec::new(),
        forwards,
        connect: ConnectConfig::default(),
        redirect: RedirectConfig::default(),
        https,
        peers: PeersConfig::default(),
        handover: Default::default(),
        kubernetes: KubernetesConfig::default(),
        transport: TransportConfig::default(),
        runtime: RuntimeConfig::default(),
        reverse: ReverseConfig::default(),
        csr: Default::default(),
    })
}

/// `mode.cloud.stream`: the edges' listener, its TLS and token file, and the admin port.
fn cloud_stream(
    cloud: &Section<'_>,
    ignored: &mut Vec<Ignored>,
) -> Result<(TunnelServerConfig, AdminConfig), ConfigError> {
    let stream = cloud.require_table("stream")?;
    stream.check_keys(&["server"], &[("dns", WHY_DNS)], ignored)?;
    if let Some(dns) = stream.table("dns")? {
        // The whole component is ignored (one warning, for the table), but a key
        // SuperEdge never had there is still a typo worth failing on.
        let keys = ["configmap", "hosts", "service", "debug"].map(|k| (k, WHY_DNS));
        dns.check_keys(&[], &keys, &mut Vec::new())?;
    }
    let server = stream.require_table("server")?;
    server.check_keys(
        &["grpcport", "logport", "key", "cert", "tokenfile"],
        &[("channelzaddr", WHY_CHANNELZ), ("metricsport", WHY_METRICS)],
        ignored,
    )?;
    let tunnel = TunnelServerConfig {
        listen: Some(any_addr(server.require_port("grpcport")?)),
        cert: Some(server.require_path("cert")?),
        key: Some(server.require_path("key")?),
        token_file: server.path("tokenfile")?,
        client_ca: None,
        cloud_id: None,
        drain_timeout: super::cloud::default_drain_timeout(),
        reauth_interval: super::cloud::default_reauth_interval(),
        max_edges: None,
        max_handshakes: super::cloud::default_max_handshakes(),
    };
    let admin = AdminConfig {
        listen: server.port("logport")?.map(any_addr),
    };
    Ok((tunnel, admin))
}

/// `mode.cloud.tcp`: the TCP forwards, listen address to target.
fn cloud_tcp(cloud: &Section<'_>) -> Result<Vec<ForwardConfig>, ConfigError> {
    let mut forwards = Vec::new();
    if let Some(tcp) = cloud.table("tcp")? {
        for (listen, target) in tcp.table {
            // Go's listener also takes ":port" for all interfaces.
            let parsed = match listen.strip_prefix(':') {
                Some(port) => port.parse::<u16>().ok().filter(|p| *p != 0).map(any_addr),
                None => listen.parse::<SocketAddr>().ok(),
            };
            let listen_addr = parsed.ok_or_else(|| {
                tcp.invalid(
                    listen,
                    "the key must be the ip:port tunnel-cloud listens on",
                )
            })?;
            // SuperEdge's tcp module has no node name: it uses the first edge connected.
            forwards.push(ForwardConfig {
                listen: listen_addr,
                node: None,
                target: tcp.target(listen, target)?,
            });
        }
    }
    Ok(forwards)
}

/// `mode.cloud.https`: the HTTPS entries, port to target, all with one certificate and
/// one `client_ca`. That key is this project's, not SuperEdge's: SuperEdge lets in any
/// client, and the edge then presents its kubelet client certificate for it. A SuperEdge
/// file with HTTPS listeners needs that one line added, and says so when it is missing.
fn cloud_https(
    cloud: &Section<'_>,
    ignored: &mut Vec<Ignored>,
) -> Result<Vec<HttpsEntryConfig>, ConfigError> {
    let mut https = Vec::new();
    if let Some(section) = cloud.table("https")? {
        section.check_keys(&["cert", "key", "addr", "client_ca"], &[], ignored)?;
        // Read before `addr` so a broken value is reported even where, as in
        // SuperEdge, cert and key without addr open no listener.
        let cert = section.path("cert")?;
        let key = section.path("key")?;
        let client_ca = section.path("client_ca")?;
        if let Some(addr) = section.table("addr")? {
            for (port, target) in addr.table {
                let listen = port
                    .parse::<u16>()
                    .ok()
                    .filter(|p| *p != 0)
                    .ok_or_else(|| {
                        addr.invalid(
                            port,
                            "the key must be the port tunnel-cloud listens on (1-65535)",
                        )
                    })?;
                let target = addr.target(port, target)?;
                let (Some(cert), Some(key)) = (&cert, &key) else {
                    let missing = if cert.is_none() { "cert" } else { "key" };
                    return Err(
                        section.invalid(missing, "missing (needed by mode.cloud.https.addr)")
                    );
                };
                if client_ca.is_none() {
                    return Err(section.invalid(
                        "client_ca",
                        format!("missing (needed by mode.cloud.https.addr; a key of this project, not SuperEdge's): {HTTPS_CLIENT_CA}"),
                    ));
                }
                https.push(HttpsEntryConfig {
                    listen: any_addr(listen),
                    cert: cert.clone(),
                    key: key.clone(),
                    target,
                    client_ca: client_ca.clone(),
                });
            }
        }
    }
    Ok(https)
}

fn edge(root: &Section<'_>, ignored: &mut Vec<Ignored>) -> Result<EdgeConfig, ConfigError> {
    let edge = mode(root, "edge", ignored)?;
    edge.check_keys(&["stream", "https"], &[], ignored)?;

    let stream = edge.require_table("stream")?;
    stream.check_keys(&["client"], &[], ignored)?;
    let client = stream.require_table("client")?;
    client.check_keys(
        &["token", "cert", "dns", "servername", "logport"],
        &[("channelzaddr", WHY_CHANNELZ)],
        ignored,
    )?;
    let address = client.require_string("servername")?;
    if let Err(problem) = Target::parse(address) {
        return Err(client.invalid("servername", problem.to_string()));
    }
    let cloud = CloudClientConfig {
        address: address.to_string(),
        addresses: Vec::new(),
        server_name: client.require_string("dns")?.to_string(),
        ca: client.require_path("cert")?,
        wait_for_ca: false,
        token: client.string("token")?.map(str::to_string),
        token_file: None,
        reauth_interval: super::edge::default_reauth_interval(),
        cert: None,
        key: None,
    };
    let admin = AdminConfig {
        listen: client.port("logport")?.map(any_addr),
    };

    let https = match edge.table("https")? {
        None => None,
        Some(section) => {
            section.check_keys(&["cert", "key"], &[], ignored)?;
            match (section.path("cert")?, section.path("key")?) {
                (None, None) => None,
                (Some(cert), Some(key)) => Some(EdgeHttpsConfig { cert, key }),
                (Some(_), None) => {
                    return Err(section.invalid("key", "missing: cert and key go together"));
                }
                (None, Some(_)) => {
                    return Err(section.invalid("cert", "missing: cert and key go together"));
                }
            }
        }
    };

    Ok(EdgeConfig {
        // SuperEdge takes the node name from NODE_NAME only.
        node_name: None,
        cloud,
        admin,
        // SuperEdge's edge dials whatever the cloud names; keeping that is what makes
        // an unchanged SuperEdge config work. The caller warns about it at start.
        allow: AllowConfig {
            any: true,
            ..AllowConfig::default()
        },
        https,
        proxy: None,
        transport: TransportConfig::default(),
        runtime: RuntimeConfig::default(),
        identity: Identity::Node,
        cluster_name: None,
        reverse: EdgeReverseConfig::default(),
        moved_forward: None,
        hooks: HooksConfig::default(),
        csr: Default::default(),
    })
}

/// SuperEdge listens on all interfaces for every port it is given.
fn any_addr(port: u16) -> SocketAddr {
    SocketAddr::from(([0, 0, 0, 0], port))
}

/// One table of a SuperEdge file, with its dotted path for messages.
struct Section<'a> {
    file: &'a Path,
    path: String,
    table: &'a toml::Table,
}

impl<'a> Section<'a> {
    fn root(file: &'a Path, table: &'a toml::Table) -> Self {
        Self {
            file,
            path: String::new(),
            table,
        }
    }

    /// The dotted path of `key` in this table, quoted the way TOML would need it.
    fn key(&self, key: &str) -> String {
        let bare = !key.is_empty()
            && key
                .bytes()
                .all(|b| b.is_ascii_alphanumeric() || b == b'_' || b == b'-');
        let key = if bare {
            key.to_string()
        } else {
            format!("{key:?}")
        };
        if self.path.is_empty() {
            key
        } else {
            format!("{}.{key}", self.path)
        }
    }

    fn invalid(&self, key: &str, problem: impl Into<String>) -> ConfigError {
        ConfigError::Invalid {
            file: self.file.to_path_buf(),
            key: self.key(key),
            problem: problem.into(),
        }
    }

    fn wrong_type(&self, key: &str, expected: &str, found: &toml::Value) -> ConfigError {
        self.invalid(
            key,
            format!("expected {expected}, found {}", found.type_str()),
        )
    }

    /// Fails on the first key that is neither `known` nor a documented SuperEdge key
    /// listed in `unused`; records the `unused` ones present.
    fn check_keys(
        &self,
        known: &[&str],
        unused: &[(&str, &'static str)],
        ignored: &mut Vec<Ignored>,
    ) -> Result<(), ConfigError> {
        for key in self.table.keys() {
            if known.contains(&key.as_str()) {
                continue;
            }
            match unused.iter().find(|(k, _)| k == key) {
                Some((_, why)) => ignored.push(Ignored {
                    key: self.key(key),
                    why,
                }),
                None => {
                    let mut expected: Vec<&str> = known
                        .iter()
                        .copied()
                        .chain(unused.iter().map(|(k, _)| *k))
                        .collect();
                    expected.sort_unstable();
                    let problem = if expected.is_empty() {
                        "unknown key: SuperEdge has no keys here".to_string()
                    } else {
                        format!("unknown key (SuperEdge knows {})", expected.join(", "))
                    };
                    return Err(self.invalid(key, problem));
                }
            }
        }
        Ok(())
    }

    fn table(&self, key: &str) -> Result<Option<Section<'a>>, ConfigError> {
        match self.table.get(key) {
            None => Ok(None),
            Some(toml::Value::Table(table)) => Ok(Some(Section {
                file: self.file,
                path: self.key(key),
                table,
            })),
            Some(other) => Err(self.wrong_type(key, "a table", other)),
        }
    }

    fn require_table(&self, key: &str) -> Result<Section<'a>, ConfigError> {
        self.table(key)?
            .ok_or_else(|| self.invalid(key, "missing table"))
    }

    fn string(&self, key: &str) -> Result<Option<&'a str>, ConfigError> {
        match self.table.get(key) {
            None => Ok(None),
            Some(toml::Value::String(s)) if s.is_empty() => {
                Err(self.invalid(key, "must not be empty"))
            }
            Some(toml::Value::String(s)) => Ok(Some(s)),
            Some(other) => Err(self.wrong_type(key, "a string", other)),
        }
    }

    fn require_string(&self, key: &str) -> Result<&'a str, ConfigError> {
        self.string(key)?
            .ok_or_else(|| self.invalid(key, "missing"))
    }

    fn path(&self, key: &str) -> Result<Option<PathBuf>, ConfigError> {
        Ok(self.string(key)?.map(PathBuf::from))
    }

    fn require_path(&self, key: &str) -> Result<PathBuf, ConfigError> {
        self.require_string(key).map(PathBuf::from)
    }

    fn port(&self, key: &str) -> Result<Option<u16>, ConfigError> {
        match self.table.get(key) {
            None => Ok(None),
            Some(toml::Value::Integer(n)) => match u16::try_from(*n) {
                Ok(p) if p != 0 => Ok(Some(p)),
                _ => Err(self.invalid(key, format!("{n} is not a port (1-65535)"))),
            },
            Some(other) => Err(self.wrong_type(key, "a port number", other)),
        }
    }

    fn require_port(&self, key: &str) -> Result<u16, ConfigError> {
        self.port(key)?.ok_or_else(|| self.invalid(key, "missing"))
    }

    /// A `host:port` the edge dials, given as the value of `key`.
    fn target(&self, key: &str, value: &toml::Value) -> Result<String, ConfigError> {
        let toml::Value::String(target) = value else {
            return Err(self.wrong_type(key, "a \"host:port\" string", value));
        };
        Target::parse(target).map_err(|problem| self.invalid(key, problem.to_string()))?;
        Ok(target.clone())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cloud_text(text: &str) -> Result<(CloudConfig, Vec<Ignored>), ConfigError> {
        let root: toml::Table = crate::config::parse_toml(Path::new("se.toml"), text)?;
        let mut ignored = Vec::new();
        cloud(&Section::root(Path::new("se.toml"), &root), &mut ignored).map(|c| (c, ignored))
    }

    fn edge_text(text: &str) -> Result<(EdgeConfig, Vec<Ignored>), ConfigError> {
        let root: toml::Table = crate::config::parse_toml(Path::new("se.toml"), text)?;
        let mut ignored = Vec::new();
        edge(&Section::root(Path::new("se.toml"), &root), &mut ignored).map(|c| (c, ignored))
    }

    fn ignored_keys(ignored: &[Ignored]) -> Vec<&str> {
        ignored.iter().map(|i| i.key.as_str()).collect()
    }

    /// The error's message, checked to name the file.
    fn message(e: ConfigError) -> String {
        let s = e.to_string();
        assert!(s.starts_with("se.toml: "), "{s}");
        s
    }

    // The first cloud example of SuperEdge's tunnel docs: every module, with comments,
    // and the one line this project adds (client_ca).
    const CLOUD_FULL: &str = r#"
    [mode]
      [mode.cloud]
        [mode.cloud.stream]                             # stream module
          [mode.cloud.stream.server]                    # gRPC server component
            grpcport = 9000                             # listening port of gRPC server
            logport = 8000                              # log and health check
            channelzaddr = "0.0.0.0:6000"               # gRPC channelz
            key = "../../conf/certs/cloud.key"
            cert = "../../conf/certs/cloud.crt"
            tokenfile = "../../conf/token"
          [mode.cloud.stream.dns]                       # DNS component
            configmap= "proxy-nodes"
            hosts = "/etc/superedge/proxy/nodes/hosts"
            service = "proxy-cloud-public"
            debug = true
          [mode.cloud.tcp]                              # TCP module
            "0.0.0.0:6443" = "127.0.0.1:6443"
          [mode.cloud.https]                            # HTTPS module
            cert ="../../conf/certs/kubelet.crt"
            key = "../../conf/certs/kubelet.key"
            client_ca = "../../conf/certs/ca.crt"
            [mode.cloud.https.addr]
              "10250" = "101.206.162.213:10250"
    "#;

    // The TCP forwarding example: odd indentation and an empty [mode.cloud.https].
    const CLOUD_TCP: &str = r#"
    [mode]
      [mode.cloud]
        [mode.cloud.stream]
            [mode.cloud.stream.server]
                grpcport = 9000
                key = "/etc/superedge/tunnel/certs/tunnel-cloud-server.key"
                cert = "/etc/superedge/tunnel/certs/tunnel-cloud-server.crt"
                tokenfile = "/etc/superedge/tunnel/token/token"
                logport = 51000
            [mode.cloud.stream.dns]
                debug = true
        [mode.cloud.tcp]
            "0.0.0.0:6443" = "127.0.0.1:6443"
        [mode.cloud.https]
    "#;

    // SuperEdge's HTTPS example, and the one line this project adds (client_ca).
    const CLOUD_HTTPS: &str = r#"
    [mode]
      [mode.cloud]
        [mode.cloud.stream]
            [mode.cloud.stream.server]
                grpcport = 9000
                logport = 51010
                key = "/etc/superedge/tunnel/certs/tunnel-cloud-server.key"
                cert = "/etc/superedge/tunnel/certs/tunnel-cloud-server.crt"
                tokenfile = "/etc/superedge/tunnel/token/token"
            [mode.cloud.stream.dns]
                configmap = "tunnel-nodes"
                hosts = "/etc/superedge/tunnel/nodes/hosts"
                service = "tunnel-cloud"
            [mode.cloud.https]
                cert = "/etc/superedge/tunnel/certs/apiserver-kubelet-server.crt"
                key = "/etc/superedge/tunnel/certs/apiserver-kubelet-server.key"
                client_ca = "/etc/kubernetes/pki/ca.crt"
                [mode.cloud.https.addr]
                    "10250" = "127.0.0.1:10250"
    "#;

    const EDGE_FULL: &str = r#"
    [mode]
      [mode.edge]
        [mode.edge.stream]                              # stream module
          [mode.edge.stream.client]                     # gRPC client component
            token = "6ff2a1ea0f1611eb9896362096106d9d"  # Authentication token
            cert = "../../conf/certs/ca.crt"            # CA of the cloud's certificate
            dns = "localhost"                           # name in the cloud's certificate
            servername = "localhost:9000"               # address of the cloud
            logport = 7000
            channelzaddr = "0.0.0.0:5000"
        [mode.edge.https]
          cert= "../../conf/certs/kubelet-client.crt"
          key= "../../conf/certs/kubelet-client.key"
    "#;

    // The deployment template of the TCP example, placeholders left in.
    const EDGE_TEMPLATE: &str = r#"
    [mode]
      [mode.edge]
        [mode.edge.stream]
            [mode.edge.stream.client]
                token = "{{.TunnelCloudEdgeToken}}"
                cert = "/etc/superedge/tunnel/certs/tunnel-ca.crt"
                dns = "{{ServerName}}"
                servername = "{{.MasterIP}}:9000"
                logport = 51000
    "#;

    #[test]
    fn cloud_full_example_translates() {
        let (c, ignored) = cloud_text(CLOUD_FULL).expect("parses");
        assert_eq!(c.tunnel.listen, Some("0.0.0.0:9000".parse().expect("addr")));
        assert_eq!(
            c.tunnel.cert,
            Some(PathBuf::from("../../conf/certs/cloud.crt"))
        );
        assert_eq!(
            c.tunnel.key,
            Some(PathBuf::from("../../conf/certs/cloud.key"))
        );
        assert_eq!(c.tunnel.token_file, Some(PathBuf::from("../../conf/token")));
        assert_eq!(c.admin.listen, Some("0.0.0.0:8000".parse().expect("addr")));
        assert_eq!(c.forwards.len(), 1);
        assert_eq!(c.forwards[0].listen, "0.0.0.0:6443".parse().expect("addr"));
        assert_eq!(c.forwards[0].node, None);
        assert_eq!(c.forwards[0].target, "127.0.0.1:6443");
        assert_eq!(c.https.len(), 1);
        assert_eq!(c.https[0].listen, "0.0.0.0:10250".parse().expect("addr"));
        assert_eq!(c.https[0].target, "101.206.162.213:10250");
        assert_eq!(
            c.https[0].cert,
            PathBuf::from("../../conf/certs/kubelet.crt")
        );
        assert_eq!(
            c.https[0].key,
            PathBuf::from("../../conf/certs/kubelet.key")
        );
        assert_eq!(
            c.https[0].client_ca,
            Some(PathBuf::from("../../conf/certs/ca.crt"))
        );
        assert!(!c.redirect.enabled && c.nodes.is_empty());
        assert_eq!(
            ignored_keys(&ignored),
            [
                "mode.cloud.stream.dns",
                "mode.cloud.stream.server.channelzaddr"
            ]
        );
        c.validate(Path::new("se.toml")).expect("valid");
    }

    #[test]
    fn cloud_tcp_example_with_empty_https_translates() {
        let (c, _) = cloud_text(CLOUD_TCP).expect("parses");
        assert_eq!(c.admin.listen, Some("0.0.0.0:51000".parse().expect("addr")));
        assert_eq!(c.forwards.len(), 1);
        assert!(c.https.is_empty());
        c.validate(Path::new("se.toml")).expect("valid");
    }

    #[test]
    fn tcp_listen_without_ip_means_all_interfaces() {
        let (c, _) =
            cloud_text(&CLOUD_TCP.replace("\"0.0.0.0:6443\" =", "\":6443\" =")).expect("parses");
        assert_eq!(c.forwards[0].listen, "0.0.0.0:6443".parse().expect("addr"));
        let s = message(
            cloud_text(&CLOUD_TCP.replace("\"0.0.0.0:6443\" =", "\":0\" =")).expect_err("port 0"),
        );
        assert!(
            s.contains("`mode.cloud.tcp.\":0\"`: the key must be the ip:port"),
            "{s}"
        );
    }

    #[test]
    fn cloud_https_example_translates() {
        let (c, _) = cloud_text(CLOUD_HTTPS).expect("parses");
        assert!(c.forwards.is_empty());
        assert_eq!(c.https.len(), 1);
        assert_eq!(c.https[0].target, "127.0.0.1:10250");
        c.validate(Path::new("se.toml")).expect("valid");
    }

    #[test]
    fn https_module_without_client_ca_is_refused_naming_the_line_to_add() {
        let text = CLOUD_HTTPS.replace("client_ca = \"/etc/kubernetes/pki/ca.crt\"", "");
        let s = message(cloud_text(&text).expect_err("no client CA"));
        assert!(
            s.contains("`mode.cloud.https.client_ca`: missing")
                && s.contains("kube-apiserver's kubelet client certificate")
                && s.contains("exec in every pod"),
            "{s}"
        );
        // Without listeners nothing is opened, so nothing is needed (SuperEdge's TCP
        // example has an empty [mode.cloud.https]).
        let text = CLOUD_HTTPS.replace("\"10250\" = \"127.0.0.1:10250\"", "");
        let (c, _) = cloud_text(&text).expect("no listeners, no CA needed");
        assert!(c.https.is_empty());
    }

    #[test]
    fn several_https_ports_share_cert() {
        let text = CLOUD_HTTPS.replace(
            r#""10250" = "127.0.0.1:10250""#,
            "\"10250\" = \"127.0.0.1:10250\"\n\"9100\" = \"127.0.0.1:9100\"",
        );
        let (c, _) = cloud_text(&text).expect("parses");
        let ports: Vec<u16> = c.https.iter().map(|h| h.listen.port()).collect();
        assert_eq!(ports, [10250, 9100]);
        assert!(
            c.https
                .iter()
                .all(|h| h.cert == c.https[0].cert && h.client_ca == c.https[0].client_ca)
        );
    }

    #[test]
    fn edge_full_example_translates() {
        let (e, ignored) = edge_text(EDGE_FULL).expect("parses");
        assert_eq!(e.cloud.address, "localhost:9000");
        assert_eq!(e.cloud.server_name, "localhost");
        assert_eq!(e.cloud.ca, PathBuf::from("../../conf/certs/ca.crt"));
        assert_eq!(
            e.cloud.token.as_deref(),
            Some("6ff2a1ea0f1611eb9896362096106d9d")
        );
        assert_eq!(e.admin.listen, Some("0.0.0.0:7000".parse().expect("addr")));
        let https = e.https.as_ref().expect("https");
        assert_eq!(
            https.cert,
            PathBuf::from("../../conf/certs/kubelet-client.crt")
        );
        assert_eq!(
            https.key,
            PathBuf::from("../../conf/certs/kubelet-client.key")
        );
        assert!(e.allow.any, "a SuperEdge edge dials what the cloud names");
        assert_eq!(e.node_name, None);
        assert_eq!(
            ignored_keys(&ignored),
            ["mode.edge.stream.client.channelzaddr"]
        );
    }

    #[test]
    fn edge_template_translates() {
        let (e, ignored) = edge_text(EDGE_TEMPLATE).expect("parses");
        assert_eq!(e.cloud.address, "{{.MasterIP}}:9000");
        assert!(e.https.is_none());
        assert!(ignored.is_empty());
    }

    #[test]
    fn misspelled_key_is_an_error_naming_the_key() {
        let text = CLOUD_TCP.replace("grpcport", "grpc_port");
        let s = message(cloud_text(&text).expect_err("typo"));
        assert!(
            s.contains("`mode.cloud.stream.server.grpc_port`: unknown key"),
            "{s}"
        );
        assert!(s.contains("grpcport"), "lists the known keys: {s}");

        let s = message(edge_text(&EDGE_FULL.replace("servername", "server")).expect_err("typo"));
        assert!(
            s.contains("`mode.edge.stream.client.server`: unknown key"),
            "{s}"
        );

        let s = message(
            cloud_text(&format!("{CLOUD_TCP}\n[mode.cloud.udp]\n")).expect_err("unknown table"),
        );
        assert!(s.contains("`mode.cloud.udp`: unknown key"), "{s}");

        let s = message(cloud_text(&format!("other = 1\n{CLOUD_TCP}")).expect_err("top level"));
        assert!(s.contains("`other`: unknown key"), "{s}");

        let s = message(
            cloud_text(&CLOUD_FULL.replace("configmap=", "configmaps=")).expect_err("dns typo"),
        );
        assert!(s.contains("`mode.cloud.stream.dns.configmaps`"), "{s}");
    }

    #[test]
    fn metricsport_and_other_side_are_ignored() {
        let text = CLOUD_TCP.replace("logport = 51000", "logport = 51000\nmetricsport = 6001");
        let text = format!("{text}\n[mode.edge.https]\ncert = \"a\"\nkey = \"b\"\n");
        let (_, ignored) = cloud_text(&text).expect("parses");
        assert!(ignored_keys(&ignored).contains(&"mode.cloud.stream.server.metricsport"));
        assert!(ignored_keys(&ignored).contains(&"mode.edge"));
    }

    #[test]
    fn wrong_types_name_the_key() {
        let s = message(
            cloud_text(&CLOUD_TCP.replace("grpcport = 9000", "grpcport = \"9000\""))
                .expect_err("type"),
        );
        assert!(
            s.contains("`mode.cloud.stream.server.grpcport`: expected a port number, found string"),
            "{s}"
        );

        let s = message(
            cloud_text(&CLOUD_TCP.replace("logport = 51000", "logport = 70000"))
                .expect_err("range"),
        );
        assert!(
            s.contains("`mode.cloud.stream.server.logport`: 70000 is not a port"),
            "{s}"
        );

        let s = message(
            edge_text(
                &EDGE_FULL.replace("token = \"6ff2a1ea0f1611eb9896362096106d9d\"", "token = 42"),
            )
            .expect_err("type"),
        );
        assert!(
            s.contains("`mode.edge.stream.client.token`: expected a string, found integer"),
            "{s}"
        );

        let s = message(
            cloud_text(&CLOUD_TCP.replace("\"127.0.0.1:6443\"", "6443")).expect_err("type"),
        );
        assert!(
            s.contains(
                "`mode.cloud.tcp.\"0.0.0.0:6443\"`: expected a \"host:port\" string, found integer"
            ),
            "{s}"
        );

        let s = message(cloud_text("mode = 1").expect_err("type"));
        assert!(s.contains("`mode`: expected a table, found integer"), "{s}");
    }

    #[test]
    fn bad_addresses_name_the_key() {
        let s = message(
            cloud_text(&CLOUD_TCP.replace("\"0.0.0.0:6443\" =", "\"6443\" =")).expect_err("listen"),
        );
        assert!(
            s.contains("`mode.cloud.tcp.6443`: the key must be the ip:port"),
            "{s}"
        );

        let s = message(
            cloud_text(&CLOUD_TCP.replace("= \"127.0.0.1:6443\"", "= \"127.0.0.1\""))
                .expect_err("target"),
        );
        assert!(
            s.contains("`mode.cloud.tcp.\"0.0.0.0:6443\"`: `127.0.0.1` is not host:port"),
            "{s}"
        );

        let s = message(
            cloud_text(&CLOUD_HTTPS.replace("\"10250\" =", "\"kubelet\" =")).expect_err("port"),
        );
        assert!(
            s.contains("`mode.cloud.https.addr.kubelet`: the key must be the port"),
            "{s}"
        );

        let s = message(
            edge_text(&EDGE_FULL.replace("\"localhost:9000\"", "\"localhost\""))
                .expect_err("address"),
        );
        assert!(
            s.contains("`mode.edge.stream.client.servername`: `localhost` is not host:port"),
            "{s}"
        );
    }

    #[test]
    fn missing_keys_name_the_key() {
        let s =
            message(cloud_text(&CLOUD_TCP.replace("grpcport = 9000", "")).expect_err("missing"));
        assert!(
            s.contains("`mode.cloud.stream.server.grpcport`: missing"),
            "{s}"
        );

        let s = message(
            cloud_text(&CLOUD_HTTPS.replace(
                "cert = \"/etc/superedge/tunnel/certs/apiserver-kubelet-server.crt\"",
                "",
            ))
            .expect_err("missing"),
        );
        assert!(s.contains("`mode.cloud.https.cert`: missing"), "{s}");

        let s =
            message(edge_text(&EDGE_FULL.replace("dns = \"localhost\"", "")).expect_err("missing"));
        assert!(s.contains("`mode.edge.stream.client.dns`: missing"), "{s}");

        let s = message(
            edge_text(&EDGE_FULL.replace("key= \"../../conf/certs/kubelet-client.key\"", ""))
                .expect_err("missing"),
        );
        assert!(s.contains("`mode.edge.https.key`: missing"), "{s}");
    }

    #[test]
    fn wrong_side_is_named() {
        let s = message(cloud_text(EDGE_FULL).expect_err("edge file given to cloud"));
        assert!(
            s.contains("`mode.cloud`: missing") && s.contains("tunnel-edge config"),
            "{s}"
        );
        let s = message(edge_text(CLOUD_TCP).expect_err("cloud file given to edge"));
        assert!(
            s.contains("`mode.edge`: missing") && s.contains("tunnel-cloud config"),
            "{s}"
        );
    }

    #[test]
    fn empty_strings_are_rejected() {
        let s = message(
            edge_text(&EDGE_FULL.replace("dns = \"localhost\"", "dns = \"\"")).expect_err("empty"),
        );
        assert!(
            s.contains("`mode.edge.stream.client.dns`: must not be empty"),
            "{s}"
        );
    }
}
