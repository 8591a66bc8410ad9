//! `tunnel edge` configuration.

use std::net::{IpAddr, SocketAddr};
use std::path::{Path, PathBuf};
use std::time::Duration;

use serde::Deserialize;

use super::{AdminConfig, ClientCsrConfig, ConfigError, RuntimeConfig, TransportConfig, Validator};
use crate::addr::Target;

#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct EdgeConfig {
    /// This node's name; `NODE_NAME` from the environment is used when absent.
    pub(crate) node_name: Option<String>,
    /// What this edge registers as: one node, or a whole managed cluster.
    #[serde(default)]
    pub(crate) identity: Identity,
    /// The cluster's name when `identity = "cluster"` (never taken from NODE_NAME: a
    /// cluster agent runs on some node of the cluster, whose name is not the cluster's).
    pub(crate) cluster_name: Option<String>,
    pub cloud: CloudClientConfig,
    /// This node's client certificate from the cluster, by CertificateSigningRequest.
    #[serde(default)]
    pub csr: ClientCsrConfig,
    /// Edge-to-cloud connections: listeners and their bounds.
    #[serde(default)]
    pub(crate) reverse: EdgeReverseConfig,
    /// `[[forward]]`, the name edge-to-cloud listeners had before they moved under
    /// `[reverse]` (a cloud's `[[forward]]` goes the other way); read only to say so.
    #[serde(default, rename = "forward")]
    pub(super) moved_forward: Option<toml::Value>,
    /// An HTTP CONNECT proxy for add-ons on this node (`HTTPS_PROXY`); absent = none.
    pub(crate) proxy: Option<EdgeProxyConfig>,
    #[serde(default)]
    pub(crate) hooks: HooksConfig,
    #[serde(default)]
    pub admin: AdminConfig,
    #[serde(default)]
    pub allow: AllowConfig,
    /// Client certificate for SuperEdge's HTTPS module targets.
    #[serde(default)]
    pub https: Option<EdgeHttpsConfig>,
    #[serde(default)]
    pub(crate) transport: TransportConfig,
    #[serde(default)]
    pub runtime: RuntimeConfig,
}

#[derive(Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct CloudClientConfig {
    /// host:port of tunnel-cloud.
    pub address: String,
    /// More tunnel-cloud replicas (host:port), tried in turn after `address` when a
    /// connection fails; without them the edge retries `address` only.
    #[serde(default)]
    pub(crate) addresses: Vec<String>,
    /// Name the cloud's certificate must carry.
    pub server_name: String,
    /// CA that signed the cloud's certificate.
    pub ca: PathBuf,
    /// Wait for `ca` to appear instead of failing the start: in a cluster it is a
    /// ConfigMap the cloud fills on its first start (`csr.ca_config_map`), which the
    /// kubelet brings into the mounted volume after this pod started.
    #[serde(default)]
    pub wait_for_ca: bool,
    pub(crate) token: Option<String>,
    pub token_file: Option<PathBuf>,
    /// How often the edge re-reads `token_file` and sends the token to the cloud to be
    /// checked again (the kubelet rotates projected tokens well before they expire).
    #[serde(default = "default_reauth_interval", with = "humantime_serde")]
    pub(crate) reauth_interval: Duration,
    /// Client certificate naming this node (mTLS).
    pub cert: Option<PathBuf>,
    pub key: Option<PathBuf>,
}

// Written by hand so the token never reaches a log line.
impl std::fmt::Debug for CloudClientConfig {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CloudClientConfig")
            .field("address", &self.address)
            .field("addresses", &self.addresses)
            .field("server_name", &self.server_name)
            .field("ca", &self.ca)
            .field("wait_for_ca", &self.wait_for_ca)
            .field("token", &self.token.as_ref().map(|_| "<redacted>"))
            .field("token_file", &self.token_file)
            .field("reauth_interval", &self.reauth_interval)
            .field("cert", &self.cert)
            .field("key", &self.key)
            .finish()
    }
}

/// What the edge agrees to dial for the cloud. A compromised cloud must not get an
/// open proxy into the edge network.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct AllowConfig {
    /// Exact host:port targets.
    pub targets: Vec<String>,
    /// This node's own addresses; allowed on `ports`.
    pub node_addresses: Vec<IpAddr>,
    pub ports: Vec<u16>,
    /// Dial whatever the cloud names. Only SuperEdge configs set this (SuperEdge's
    /// behaviour); it is logged as a warning at start.
    pub any: bool,
}

impl Default for AllowConfig {
    fn default() -> Self {
        Self {
            targets: vec!["127.0.0.1:10250".into()],
            node_addresses: Vec::new(),
            ports: vec![10250],
            any: false,
        }
    }
}

#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "lowercase")]
pub(crate) enum Identity {
    #[default]
    Node,
    Cluster,
}

impl Identity {
    /// The `Hello.identity_kind` value, and the kind's name in logs, metrics and
    /// `/debug/sessions`.
    pub(crate) fn as_str(self) -> &'static str {
        match self {
            Identity::Node => "node",
            Identity::Cluster => "cluster",
        }
    }

    /// Reads `Hello.identity_kind`. Empty is a node: edges that predate cluster
    /// identities send nothing.
    pub(crate) fn from_hello(kind: &str) -> Option<Self> {
        match kind {
            "" | "node" => Some(Identity::Node),
            "cluster" => Some(Identity::Cluster),
            _ => None,
        }
    }
}

#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub(crate) struct EdgeForwardConfig {
    /// Local address on the edge side that clients connect to.
    pub(crate) listen: SocketAddr,
    /// host:port on the cloud side; the cloud's `reverse.allow` must list it.
    pub(crate) target: String,
}

pub(super) fn default_reauth_interval() -> Duration {
    Duration::from_secs(300)
}

/// `[proxy]`: each CONNECT request on `listen` becomes an edge-to-cloud connection to
/// the host:port it names, under the same `[reverse]` bounds and the cloud's
/// `[reverse] allow` list.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub(crate) struct EdgeProxyConfig {
    /// Where add-ons on this node connect; loopback unless they run elsewhere.
    #[serde(default = "default_proxy_listen")]
    pub(crate) listen: SocketAddr,
}

fn default_proxy_listen() -> SocketAddr {
    SocketAddr::from(([127, 0, 0, 1], 3128))
}

/// Edge-to-cloud connections: the listeners (`[[reverse.forward]]`), and bounds on
/// connections waiting for the cloud to open their stream.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub(crate) struct EdgeReverseConfig {
    /// Listeners on the edge side whose connections reach a cloud-side target.
    #[serde(rename = "forward")]
    pub(crate) forwards: Vec<EdgeForwardConfig>,
    /// Connections waiting at once; more are closed at once.
    pub(crate) max_pending: usize,
    /// How long a connection waits for the cloud's stream (which includes the cloud's
    /// dial of the target) before it is closed.
    #[serde(with = "humantime_serde")]
    pub(crate) open_timeout: Duration,
}

impl Default for EdgeReverseConfig {
    fn default() -> Self {
        Self {
            forwards: Vec::new(),
            max_pending: 64,
            open_timeout: Duration::from_secs(15),
        }
    }
}

#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "lowercase")]
pub(crate) enum HookFailure {
    /// A failing pre-start hook stops the edge (exit code 1).
    #[default]
    Abort,
    /// A failing pre-start hook is logged and the edge starts anyway.
    Warn,
}

/// Commands run around the edge's lifecycle (tke-anp-tunnel's PreStartTunnelAgent and
/// PostStartTunnelAgent). Each is argv: a program and its arguments, no shell.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub(crate) struct HooksConfig {
    /// Runs once, before the first connection attempt.
    pub(crate) pre_start: Vec<String>,
    /// Runs after every successful registration, beside the session.
    pub(crate) post_start: Vec<String>,
    /// What a failing pre-start hook does. A failing post-start hook is always logged
    /// only: the session is already serving.
    pub(crate) failure: HookFailure,
    /// Bound on each run; the hook is killed when it overruns (and counts as failed).
    #[serde(with = "humantime_serde")]
    pub(crate) timeout: Duration,
}

impl Default for HooksConfig {
    fn default() -> Self {
        Self {
            pre_start: Vec::new(),
            post_start: Vec::new(),
            failure: HookFailure::Abort,
            timeout: Duration::from_secs(30),
        }
    }
}

#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct EdgeHttpsConfig {
    pub cert: PathBuf,
    pub key: PathBuf,
}

impl EdgeConfig {
    pub(super) fn resolve_paths(&mut self, file: &Path) {
        let c = &mut self.cloud;
        for p in [
            Some(&mut c.ca),
            c.token_file.as_mut(),
            c.cert.as_mut(),
            c.key.as_mut(),
            self.csr.dir.as_mut(),
        ]
        .into_iter()
        .flatten()
        {
            *p = super::resolve_path(file, p);
        }
        if let Some(h) = &mut self.https {
            h.cert = super::resolve_path(file, &h.cert);
            h.key = super::resolve_path(file, &h.key);
        }
    }

    /// Every cloud address, `address` first.
    pub fn cloud_addresses(&self) -> impl Iterator<Item = &str> {
        std::iter::once(self.cloud.address.as_str())
            .chain(self.cloud.addresses.iter().map(String::as_str))
    }

    /// The name this edge registers as: the node name, or the cluster name for a
    /// cluster identity; present after `load`.
    pub fn node(&self) -> &str {
        match self.identity {
            Identity::Node => self.node_name.as_deref().unwrap_or_default(),
            Identity::Cluster => self.cluster_name.as_deref().unwrap_or_default(),
        }
    }

    fn validate_csr(&self, v: &mut Validator<'_>) {
        let csr = &self.csr;
        if !csr.enabled {
            return;
        }
        if self.cloud.cert.is_some() {
            v.problem(
                "cloud.cert",
                "not with [csr] enabled: the certificate comes from the cluster",
            );
        }
        if self.identity != Identity::Node {
            v.problem(
                "csr.enabled",
                "only for identity = \"node\": the cloud approves a CSR for a node its requester runs on",
            );
        }
        csr.validate("csr", v);
    }

    /// Where `[csr]` keeps the key and certificate: `csr.dir`, else this.
    pub const CSR_DIR: &str = "/var/lib/tunnel-edge";

    /// `csr.dir`, or its default.
    pub fn csr_dir(&self) -> PathBuf {
        self.csr.dir.clone().unwrap_or_else(|| Self::CSR_DIR.into())
    }

    pub fn validate(&self, file: &Path) -> Result<(), ConfigError> {
        let mut v = Validator::new(file);
        self.validate_identity(&mut v);
        self.validate_reverse(&mut v);
        self.validate_hooks(&mut v);
        self.validate_cloud(&mut v);
        self.validate_csr(&mut v);
        self.validate_allow(&mut v);
        self.transport.validate(&mut v);
        v.finish()
    }

    /// Who the edge registers as: a node (`node_name`) or a cluster (`cluster_name`),
    /// with a valid name.
    fn validate_identity(&self, v: &mut Validator<'_>) {
        match (self.identity, &self.node_name, &self.cluster_name) {
            (Identity::Node, None, _) => v.problem(
                "node_name",
                "not set, and NODE_NAME is not in the environment",
            ),
            (Identity::Node, Some(_), Some(_)) => {
                v.problem("cluster_name", "only with identity = \"cluster\"")
            }
            (Identity::Cluster, _, None) => {
                v.problem("cluster_name", "required with identity = \"cluster\"")
            }
            (Identity::Cluster, Some(_), _) => v.problem(
                "node_name",
                "not with identity = \"cluster\": set cluster_name",
            ),
            (Identity::Node, Some(n), None) | (Identity::Cluster, None, Some(n)) => {
                let key = if self.identity == Identity::Node {
                    "node_name"
                } else {
                    "cluster_name"
                };
                if let Err(p) = crate::addr::check_node_name(n) {
                    v.problem(key, p);
                }
            }
        }
    }

    /// Edge-to-cloud connections: the `[[reverse.forward]]` and `[proxy]` listeners (no
    /// two on one address, nor on the admin one), the targets, and the bounds on
    /// connections waiting for their stream.
    fn validate_reverse(&self, v: &mut Validator<'_>) {
        let mut listens = std::collections::HashSet::new();
        if let Some(a) = self.admin.listen {
            listens.insert(a);
        }
        if let Some(proxy) = &self.proxy
            && proxy.listen.port() != 0
            && !listens.insert(proxy.listen)
        {
            v.problem(
                "proxy.listen",
                format!("{} is already used by another listener", proxy.listen),
            );
        }
        if self.moved_forward.is_some() {
            v.problem(
                "forward",
                "edge-to-cloud listeners are `[[reverse.forward]]` in an edge config \
                 (`[[forward]]` is the cloud's, for the other direction)",
            );
        }
        for (i, f) in self.reverse.forwards.iter().enumerate() {
            // Port 0: each gets a port of its own, as on the cloud.
            if f.listen.port() != 0 && !listens.insert(f.listen) {
                v.problem(
                    format!("reverse.forward[{i}].listen"),
                    format!("{} is already used by another listener", f.listen),
                );
            }
            if let Err(p) = Target::parse(&f.target) {
                v.problem(format!("reverse.forward[{i}].target"), p.to_string());
            }
        }
        if self.reverse.max_pending == 0 {
            v.problem("reverse.max_pending", "must be at least 1");
        }
        if self.reverse.open_timeout.is_zero() {
            v.problem("reverse.open_timeout", "must be greater than zero");
        }
    }

    fn validate_hooks(&self, v: &mut Validator<'_>) {
        for (key, argv) in [
            ("hooks.pre_start", &self.hooks.pre_start),
            ("hooks.post_start", &self.hooks.post_start),
        ] {
            if argv.first().is_some_and(|program| program.is_empty()) {
                v.problem(key, "the program (first element) must not be empty");
            }
        }
        if self.hooks.timeout.is_zero() {
            v.problem("hooks.timeout", "must be greater than zero");
        }
    }

    /// `[cloud]`: where the cloud is, and the credentials the edge registers with.
    fn validate_cloud(&self, v: &mut Validator<'_>) {
        if self.cloud.reauth_interval < Duration::from_secs(1) {
            v.problem("cloud.reauth_interval", "must be at least 1s");
        }
        if let Err(p) = Target::parse(&self.cloud.address) {
            v.problem("cloud.address", p.to_string());
        }
        for (i, a) in self.cloud.addresses.iter().enumerate() {
            if let Err(p) = Target::parse(a) {
                v.problem(format!("cloud.addresses[{i}]"), p.to_string());
            }
        }
        if self.cloud.server_name.is_empty() {
            v.problem("cloud.server_name", "must not be empty");
        }
        let has_token = self.cloud.token.as_deref().is_some_and(|t| !t.is_empty())
            || self.cloud.token_file.is_some();
        if self.cloud.token.is_some() && self.cloud.token_file.is_some() {
            v.problem("cloud.token_file", "set token or token_file, not both");
        }
        if self.cloud.cert.is_some() != self.cloud.key.is_some() {
            v.problem("cloud.cert", "cert and key go together");
        }
        if !has_token && self.cloud.cert.is_none() && !self.csr.enabled {
            v.problem(
                "cloud",
                "set token, token_file, cert/key or [csr]: the cloud requires credentials",
            );
        }
    }

    /// `[allow]`: the targets and ports the cloud may ask this edge to dial.
    fn validate_allow(&self, v: &mut Validator<'_>) {
        for (i, t) in self.allow.targets.iter().enumerate() {
            if let Err(p) = Target::parse(t) {
                v.problem(format!("allow.targets[{i}]"), p.to_string());
            }
        }
        if self.allow.ports.contains(&0) {
            v.problem("allow.ports", "port 0 is not a port");
        }
    }
}
