//! `tunnel cloud` configuration.

use std::collections::{BTreeMap, HashSet};
use std::net::{IpAddr, SocketAddr};
use std::path::{Path, PathBuf};
use std::time::Duration;

use serde::Deserialize;

use super::{ConfigError, RuntimeConfig, TransportConfig, Validator};
use crate::addr::{NODE_IPS, Target, check_node_name};

#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct CloudConfig {
    /// A replica (edges connect to it) or a relay (the redirect on a node that is
    /// neither a master nor an edge, carrying connections to the replicas).
    #[serde(default)]
    pub role: Role,
    /// What only a relay has: its node, and its client certificate by CSR.
    #[serde(default)]
    pub relay: RelayConfig,
    /// Where edges connect.
    pub tunnel: TunnelServerConfig,
    #[serde(default)]
    pub admin: AdminConfig,
    /// The node table: which node names exist and their addresses.
    #[serde(default, rename = "node")]
    pub(crate) nodes: Vec<NodeConfig>,
    /// Fixed TCP forwards: a cloud listener that always goes to one node's target.
    #[serde(default, rename = "forward")]
    pub forwards: Vec<ForwardConfig>,
    /// HTTP CONNECT proxy (curl -x, kube-apiserver's EgressSelectorConfiguration).
    #[serde(default)]
    pub connect: ConnectConfig,
    /// eBPF transparent redirect of connections to edge node addresses.
    #[serde(default)]
    pub redirect: RedirectConfig,
    /// SuperEdge's HTTPS module: TLS terminated on the cloud, routed by node name.
    #[serde(default, rename = "https")]
    pub https: Vec<HttpsEntryConfig>,
    /// Other replicas: connections for nodes held elsewhere are forwarded to them.
    #[serde(default)]
    pub peers: PeersConfig,
    /// Listener handover to the next process on this host (a rolling update).
    #[serde(default)]
    pub handover: HandoverConfig,
    /// Node discovery and replica discovery through the Kubernetes API.
    #[serde(default)]
    pub kubernetes: KubernetesConfig,
    /// Edge-to-cloud connections: which cloud-side targets each edge may reach.
    #[serde(default)]
    pub reverse: ReverseConfig,
    /// Approving and signing the edges' CertificateSigningRequests.
    #[serde(default)]
    pub csr: CsrSignerConfig,
    #[serde(default)]
    pub(crate) transport: TransportConfig,
    #[serde(default)]
    pub runtime: RuntimeConfig,
}

#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TunnelServerConfig {
    /// Where edges connect: required on a replica, absent on a relay.
    #[serde(default)]
    pub listen: Option<SocketAddr>,
    /// The cloud's TLS certificate chain and key (PEM); left out when the replica issues
    /// its own (`csr.serving`).
    #[serde(default)]
    pub cert: Option<PathBuf>,
    #[serde(default)]
    pub key: Option<PathBuf>,
    /// `node:token` lines; `default:token` matches any node without its own line.
    pub token_file: Option<PathBuf>,
    /// CA for edge client certificates. With it, an edge presenting a certificate is
    /// identified by it (the node name must match); without a token file it is required.
    pub client_ca: Option<PathBuf>,
    /// Name of this replica in logs and the edge's view; defaults to the host name.
    #[serde(default)]
    pub(crate) cloud_id: Option<String>,
    /// On SIGTERM: how long proxied connections may take to finish after the edges were
    /// told to move to another replica.
    #[serde(default = "default_drain_timeout", with = "humantime_serde")]
    pub drain_timeout: std::time::Duration,
    /// How often a session's service account token is reviewed again while it lives
    /// (a client certificate is checked against its expiry, a token-file token on every
    /// reload of the file and whenever the edge sends a fresh one).
    #[serde(default = "default_reauth_interval", with = "humantime_serde")]
    pub(crate) reauth_interval: std::time::Duration,
    /// Edges this replica holds at most; past it new edges are refused with
    /// REPLICA_FULL and go to another replica. Unset: derived from the memory the
    /// replica may use (`cloud::edges::capacity`).
    #[serde(default)]
    pub(crate) max_edges: Option<usize>,
    /// Edge connections in their TLS handshake and Hello at once; more wait in the
    /// kernel's accept queue, so that under a storm handshakes finish instead of all
    /// sharing the CPU until every one times out.
    #[serde(default = "default_max_handshakes")]
    pub(crate) max_handshakes: usize,
}

pub(crate) fn default_max_handshakes() -> usize {
    1024
}

pub(crate) fn default_reauth_interval() -> std::time::Duration {
    std::time::Duration::from_secs(300)
}

pub(crate) fn default_drain_timeout() -> std::time::Duration {
    std::time::Duration::from_secs(30)
}

/// What a `tunnel cloud` process is (docs/design.md, "Relays").
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Role {
    /// Holds edge sessions and serves the entries, links with the other replicas.
    #[default]
    Replica,
    /// Holds no edge session: the node's redirected connections go to the replica that
    /// holds the edge, over one link to each replica (`peers.static` or
    /// `kubernetes.peer_service`), with `tunnel.cert`/`key` as its client certificate.
    Relay,
}

/// A relay's own settings (`role = "relay"`).
#[derive(Debug, Clone, Default, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct RelayConfig {
    /// The node this relay runs on, which its certificate names; `NODE_NAME` from the
    /// environment when absent. Needed with `csr` only.
    pub node_name: Option<String>,
    /// The relay's client certificate from the cluster, by CertificateSigningRequest
    /// (CN `system:tunnel-relay:<node>`), instead of `tunnel.cert`/`key`: the keys of the
    /// edge's `[csr]`.
    pub csr: super::ClientCsrConfig,
    /// Wait for the replicas' CA (`peers.ca`, else `tunnel.client_ca`) to appear instead
    /// of failing the start, as the edge's `cloud.wait_for_ca`: in a cluster it is the
    /// ConfigMap the cloud fills on its first start (`csr.ca_config_map`).
    pub wait_for_ca: bool,
}

impl CloudConfig {
    /// Where `[relay.csr]` keeps the key and certificate: `relay.csr.dir`, else this.
    pub const RELAY_CSR_DIR: &str = "/var/lib/tunnel-relay";

    /// `relay.csr.dir`, or its default.
    pub fn relay_csr_dir(&self) -> PathBuf {
        let dir = self.relay.csr.dir.clone();
        dir.unwrap_or_else(|| Self::RELAY_CSR_DIR.into())
    }
}

#[derive(Debug, Clone, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct AdminConfig {
    /// `/healthz`, `/readyz`, `/debug/flags/v`; off when absent.
    pub listen: Option<SocketAddr>,
}

/// A new tunnel-cloud started on the same host while this one still runs (a DaemonSet
/// rolling update with `maxSurge`) takes this one's listening sockets over `socket`
/// instead of binding its own: both then share each accept queue, and no connect is
/// refused while one process stops and the other starts (`cloud::lifecycle::handover`).
#[derive(Debug, Clone, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct HandoverConfig {
    /// Unix socket path the running process serves; off when absent.
    pub socket: Option<PathBuf>,
}

#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub(crate) struct NodeConfig {
    pub(crate) name: String,
    #[serde(default)]
    pub(crate) addresses: Vec<IpAddr>,
}

#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ForwardConfig {
    pub(crate) listen: SocketAddr,
    /// The node to reach. `None` only comes from SuperEdge configs: the first edge
    /// connected, as SuperEdge's tcp module does.
    pub node: Option<String>,
    /// host:port the edge dials.
    pub(crate) target: String,
}

#[derive(Debug, Clone, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ConnectConfig {
    pub listen: Option<SocketAddr>,
    pub unix: Option<PathBuf>,
    /// When to answer 200 before the edge has connected to the target.
    #[serde(default)]
    pub optimistic_ok: OptimisticOk,
}

/// When HTTP CONNECT answers 200 as soon as the dial is routed, with the dial request
/// and the client's first bytes sent together after it, instead of after the edge has
/// connected. That is one round trip to the edge less per connection, but a dial the
/// edge then refuses (not allowed, refused, timed out) reaches the client as a reset
/// instead of 403/502/504. Routing failures known on the cloud (no such node, node not
/// connected) are always answered with their status.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Deserialize)]
#[serde(try_from = "OptimisticOkValue")]
pub enum OptimisticOk {
    /// `"never"` (or `false`): every client waits for the edge's answer.
    Never,
    /// `"recent"`, the default: early when this cloud saw the node's edge connect to the
    /// same target within [`OptimisticOk::RECENT`] and no dial there fail since. The
    /// targets a cluster reaches again and again (kubelets) save the round trip; a new
    /// or failing target gets its status, and after one reset the next client does.
    #[default]
    Recent,
    /// `"always"` (or `true`).
    Always,
}

impl OptimisticOk {
    /// How long a connected dial vouches for its target.
    pub(crate) const RECENT: Duration = Duration::from_secs(60);
}

/// `optimistic_ok` as written: a word, or the boolean of earlier versions.
#[derive(Deserialize)]
#[serde(untagged)]
enum OptimisticOkValue {
    Bool(bool),
    Word(String),
}

impl TryFrom<OptimisticOkValue> for OptimisticOk {
    type Error = String;

    fn try_from(v: OptimisticOkValue) -> Result<Self, String> {
        match v {
            OptimisticOkValue::Bool(false) => Ok(OptimisticOk::Never),
            OptimisticOkValue::Bool(true) => Ok(OptimisticOk::Always),
            OptimisticOkValue::Word(w) => match w.as_str() {
                "never" => Ok(OptimisticOk::Never),
                "recent" => Ok(OptimisticOk::Recent),
                "always" => Ok(OptimisticOk::Always),
                _ => Err(format!(
                    "optimistic_ok = {w:?}: expected \"never\", \"recent\" or \"always\""
                )),
            },
        }
    }
}

#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct RedirectConfig {
    pub(crate) enabled: bool,
    /// Where redirected host-network clients land.
    pub listen: SocketAddr,
    /// Where redirected clients in other network namespaces (pods) land: an address
    /// they can reach, the node IP in production.
    pub pod_listen: Option<SocketAddr>,
    /// Where redirected host-network clients of IPv6 edge addresses land; absent:
    /// [`RedirectConfig::default_listen6`], skipped on a host without IPv6.
    pub listen6: Option<SocketAddr>,
    /// As `pod_listen`, for IPv6 edge addresses: an IPv6 address pods can reach.
    pub pod_listen6: Option<SocketAddr>,
    /// Where pods land when one config serves every node (a DaemonSet's): this node's
    /// own address from `NODE_IPS` on this port, its IPv4 one as `pod_listen` and its
    /// IPv6 one as `pod_listen6` ([`RedirectConfig::resolve_pod_port`], at start).
    pub pod_port: Option<u16>,
    /// cgroup v2 directory to attach to, or the host's `/sys/fs/cgroup` mounted at a path
    /// of its own (its `unified` is used on hybrid hosts); detected when absent.
    pub cgroup: Option<PathBuf>,
    /// Destination ports intercepted on edge node addresses.
    pub(crate) ports: Vec<u16>,
    /// Capacity of each eBPF edge map (one for IPv4, one for IPv6), in address × port
    /// entries; absent: [`RedirectConfig::EDGE_MAP_ADDRESSES`] addresses per port in
    /// `ports`. The kernel holds the whole map from the start (the memlock `bpftool map
    /// show` prints: 80 bytes an IPv4 entry, 96 an IPv6 one, 22 MiB for the two at the
    /// default, measured); a node table with more addresses keeps
    /// the lowest, says so, and counts the others in
    /// `tunnel_node_addresses_dropped{reason="edge_map_full"}`.
    pub(crate) edge_map_entries: Option<u32>,
    /// bpffs directory (e.g. /sys/fs/bpf/tunnel) where the cgroup links and shared maps
    /// are pinned, so the programs stay attached across restarts and upgrades and the
    /// next process adopts them; `tunnel cloud --uninstall-redirect` removes them.
    /// Absent: the programs are detached when the process exits.
    pub pin_dir: Option<PathBuf>,
    /// Name of tunnel-cloud's own DaemonSet (in the pod's namespace): when it is being
    /// deleted at shutdown, the pinned redirect is uninstalled too; in a rolling update
    /// (the DaemonSet stays) the pins are kept for the next pod. Needs `pin_dir` and
    /// `[kubernetes] enabled`.
    pub uninstall_with_daemonset: Option<String>,
    /// How long the attached programs keep redirecting once no tunnel-cloud runs them
    /// (crashed, killed, or removed without uninstalling): within it a redirected connect
    /// is refused at once while nothing listens, so clients fail fast across a restart;
    /// past it connects go to the address they dialled, as if the redirect were gone.
    #[serde(with = "humantime_serde")]
    pub(crate) fail_open_after: std::time::Duration,
}

impl Default for RedirectConfig {
    fn default() -> Self {
        Self {
            enabled: false,
            listen: SocketAddr::from(([127, 0, 0, 1], Self::DEFAULT_PORT)),
            pod_listen: None,
            listen6: None,
            pod_listen6: None,
            pod_port: None,
            cgroup: None,
            ports: vec![10250],
            edge_map_entries: None,
            pin_dir: None,
            uninstall_with_daemonset: None,
            fail_open_after: std::time::Duration::from_secs(60),
        }
    }
}

impl RedirectConfig {
    /// The port of the default `listen` (and so of `listen6`). Below 1024, so only root
    /// (`CAP_NET_BIND_SERVICE`) can listen there: while no cloud listens (a crash, an OOM
    /// kill) the pinned programs keep redirecting for up to `fail_open_after`, and a user
    /// who bound the port first would receive kube-apiserver's connections to kubelets.
    /// Below 512 too, out of the range (512 to 1023) rresvport, glibc's bindresvport and
    /// the kernel's NFS client take source ports from. 250, after 10250.
    pub(crate) const DEFAULT_PORT: u16 = 250;

    /// Addresses per family the edge maps hold when `edge_map_entries` is absent: a
    /// fleet of 100,000 edge nodes, and room for nodes coming while others go.
    pub(crate) const EDGE_MAP_ADDRESSES: u32 = 128 * 1024;

    /// The most entries `edge_map_entries` may ask for (about 1.6 GiB of kernel memory
    /// for the two maps): past it a typo, not a fleet.
    pub(crate) const EDGE_MAP_ENTRIES_MAX: u32 = 8 * 1024 * 1024;

    /// The entries of each eBPF edge map: `edge_map_entries`, else
    /// [`RedirectConfig::EDGE_MAP_ADDRESSES`] times the ports.
    pub fn edge_map_entries(&self) -> u32 {
        self.edge_map_entries.unwrap_or_else(|| {
            let ports = u32::try_from(self.ports.len().max(1)).unwrap_or(u32::MAX);
            Self::EDGE_MAP_ADDRESSES
                .saturating_mul(ports)
                .min(Self::EDGE_MAP_ENTRIES_MAX)
        })
    }

    /// `listen6` when absent: the IPv6 loopback on the port of `listen`.
    pub fn default_listen6(&self) -> SocketAddr {
        SocketAddr::from((std::net::Ipv6Addr::LOCALHOST, self.listen.port()))
    }

    /// With `pod_port`, sets `pod_listen` and `pod_listen6` to this node's first IPv4
    /// and IPv6 address in `node_ips` (the value of `NODE_IPS`) on that port; `own` is
    /// every address of this node's interfaces. Read at start, not at load: the address
    /// is the node's, the config every node's. An address missing, not this node's, or
    /// one a pod cannot reach is refused, naming the key: pods would otherwise land
    /// nowhere, or on their own loopback.
    pub fn resolve_pod_port(
        &mut self,
        node_ips: Option<&str>,
        own: &[IpAddr],
    ) -> Result<(), String> {
        let Some(port) = self.pod_port else {
            return Ok(());
        };
        let problem = |p: String| format!("redirect.pod_port: {p}");
        let value = node_ips
            .map(str::trim)
            .filter(|v| !v.is_empty())
            .ok_or_else(|| {
                problem(format!(
                    "pods land on this node's address, from {NODE_IPS}, which is not in \
                     the environment (deploy/ sets it from the downward API's status.hostIP)"
                ))
            })?;
        let ips = crate::addr::parse_node_ips(value).map_err(|e| problem(e.to_string()))?;
        for ip in &ips {
            if let Some(why) = unreachable_from_pods(*ip) {
                return Err(problem(format!(
                    "{NODE_IPS} names {ip} ({why}), which a pod cannot reach: it must be \
                     this node's own address (status.hostIP)"
                )));
            }
            if !own.contains(ip) {
                return Err(problem(format!(
                    "{NODE_IPS} names {ip}, which is not an address of this node's \
                     interfaces: it must be this node's own (status.hostIP)"
                )));
            }
        }
        let first = |v6: bool| {
            ips.iter()
                .find(|ip| ip.is_ipv6() == v6)
                .map(|ip| SocketAddr::new(*ip, port))
        };
        self.pod_listen = first(false);
        self.pod_listen6 = first(true);
        Ok(())
    }
}

/// Why a pod, in a network namespace of its own, cannot reach `ip` on its node, if it
/// cannot: the pod has loopback of its own (all of 127.0.0.0/8 and ::1), and the rest
/// of [`reserved_address`] names no one host.
fn unreachable_from_pods(ip: IpAddr) -> Option<&'static str> {
    match ip.to_canonical().is_loopback() {
        true => Some("loopback"),
        false => reserved_address(ip),
    }
}

/// The cloud-to-cloud channel between replicas: mTLS where both sides present the
/// cloud certificate (it must allow serverAuth and clientAuth), HTTP/2 on top.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct PeersConfig {
    /// Where other replicas connect. Off when absent (a single replica).
    pub listen: Option<SocketAddr>,
    /// host:port of the replicas' `peers.listen`. The same list can be given to every
    /// replica: a replica recognises itself and skips its own entry.
    #[serde(rename = "static")]
    pub(crate) static_peers: Vec<String>,
    /// DNS name every replica's certificate carries; a client certificate without it
    /// (an edge's, say) cannot join. Default: "tunnel-cloud".
    pub server_name: String,
    /// CA that signed the replicas' certificates. Default: `tunnel.client_ca`.
    pub ca: Option<PathBuf>,
}

impl Default for PeersConfig {
    fn default() -> Self {
        Self {
            listen: None,
            static_peers: Vec::new(),
            server_name: "tunnel-cloud".into(),
            ca: None,
        }
    }
}

impl PeersConfig {
    /// The CA replicas' certificates are checked against.
    pub fn ca<'a>(&'a self, tunnel: &'a TunnelServerConfig) -> Option<&'a Path> {
        self.ca.as_deref().or(tunnel.client_ca.as_deref())
    }
}

#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct KubernetesConfig {
    /// Watch Nodes (and the peer Service's EndpointSlices) with the in-cluster
    /// credentials, or KUBECONFIG outside a cluster.
    pub enabled: bool,
    /// Label selector of the edge nodes (as `kubectl -l` takes it), matched by the cloud
    /// on every watched Node; their InternalIP and ExternalIP addresses make the node
    /// table (in addition to the `[[node]]` entries), less those another node lists too.
    pub edge_selector: String,
    /// Headless Service whose EndpointSlices list the replicas' peer listeners.
    /// Default: none (only `peers.static`).
    pub peer_service: Option<String>,
    /// Namespace of `peer_service`. Default: this pod's namespace.
    pub(crate) namespace: Option<String>,
    /// Edges may authenticate with a node-bound service account token, checked with a
    /// TokenReview (cached and rate-limited).
    pub token_review: bool,
    /// Audience the edges' projected tokens are issued for.
    pub(crate) token_audience: String,
    /// `namespace:name` of the edges' service account.
    pub edge_service_account: String,
    /// `namespace:name` of the relays' service account: its pods may have a relay's
    /// certificate (`system:tunnel-relay:<node>`) for the node they run on, by CSR.
    pub relay_service_account: String,
    /// TokenReviews per second at most (bursts of twice that); more registrations are
    /// refused as rate-limited and retried by the edges.
    pub(crate) token_review_rate: f64,
    /// How long an accepted token is remembered.
    #[serde(with = "humantime_serde")]
    pub token_review_cache: Duration,
    /// The cluster's Service CIDRs (kube-apiserver's `--service-cluster-ip-range`),
    /// whose addresses are never an edge's; added to those the ServiceCIDR API lists
    /// (Kubernetes 1.33+), which the cloud reads at start. Default: none beyond those.
    pub service_cidrs: Vec<crate::addr::Cidr>,
}

impl KubernetesConfig {
    /// The namespace of the cloud's own objects (the peer Service, the CA's Secret and
    /// ConfigMap): `namespace`, else this pod's (`POD_NAMESPACE`), else `fallback` (the
    /// client's default).
    pub(crate) fn own_namespace(&self, fallback: &str) -> String {
        self.namespace
            .clone()
            .or_else(|| {
                std::env::var("POD_NAMESPACE")
                    .ok()
                    .filter(|n| !n.is_empty())
            })
            .unwrap_or_else(|| fallback.to_string())
    }
}

impl Default for KubernetesConfig {
    fn default() -> Self {
        Self {
            enabled: false,
            edge_selector: "node-role.kubernetes.io/edge".into(),
            peer_service: None,
            namespace: None,
            token_review: false,
            token_audience: "tunnel-cloud".into(),
            edge_service_account: "tunnel-system:tunnel-edge".into(),
            relay_service_account: "tunnel-system:tunnel-relay".into(),
            token_review_rate: 20.0,
            token_review_cache: Duration::from_secs(300),
            service_cidrs: Vec::new(),
        }
    }
}

/// The signer of the edges' client certificates (`cloud::edges::csr`): CertificateSigningRequests
/// for `signer_name` are approved when the requester may speak for the node they name,
/// denied with the reason otherwise, and signed with the CA of `tunnel.client_ca` and
/// `ca_key`.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct CsrSignerConfig {
    pub enabled: bool,
    /// The signer name the edges ask for; only CSRs for it are looked at.
    pub signer_name: String,
    /// Private key of the CA in `tunnel.client_ca` (PEM).
    pub ca_key: Option<PathBuf>,
    /// Longest lifetime a certificate gets, whatever the CSR asks (expirationSeconds).
    #[serde(with = "humantime_serde")]
    pub max_lifetime: Duration,
    /// CSRs reviewed per second across all requesters (bursts of twice that); more wait.
    pub(crate) rate: f64,
    /// This replica makes its serving key in memory and signs its own serving
    /// certificate with `ca_key` (`cloud::lifecycle::serving`), instead of `tunnel.cert`/`key`.
    pub serving: bool,
    /// Names and addresses the serving certificate holds besides `tunnel-cloud`: what
    /// edges dial, the master's addresses.
    pub(crate) serving_names: Vec<String>,
    /// How long a self-issued serving certificate lives; renewed at two thirds of it.
    #[serde(with = "humantime_serde")]
    pub serving_lifetime: Duration,
    /// A Secret in the cloud's namespace that holds the CA (`ca.crt`, `ca.key`): read at
    /// start, and filled with a new CA when it is empty (`cloud::lifecycle::ca`), then
    /// written to `tunnel.client_ca` and `ca_key` for the rest of the cloud to load.
    pub ca_secret: Option<String>,
    /// A ConfigMap in the cloud's namespace where the cloud publishes the certificate of
    /// `tunnel.client_ca` (key `ca.crt`) for the edges to trust, as `kube-root-ca.crt`
    /// is published.
    pub ca_config_map: Option<String>,
}

/// Bounds of `csr.serving_lifetime`. The minimum only keeps renewals from spinning; a
/// seconds-scale lifetime is for tests, production wants hours or days.
pub(crate) const SERVING_MIN_LIFETIME: Duration = Duration::from_secs(10);
pub(crate) const SERVING_MAX_LIFETIME: Duration = Duration::from_secs(90 * 24 * 3600);

/// Kubernetes' CSR cleaner (kube-controller-manager) deletes an issued CSR an hour after
/// its approval; a certificate outliving its CSR would be revoked (`cloud::edges::csr`).
pub(crate) const CSR_MAX_LIFETIME: Duration = Duration::from_secs(3600);

impl Default for CsrSignerConfig {
    fn default() -> Self {
        Self {
            enabled: false,
            signer_name: DEFAULT_SIGNER_NAME.into(),
            ca_key: None,
            max_lifetime: CSR_MAX_LIFETIME,
            rate: 10.0,
            serving: false,
            serving_names: Vec::new(),
            serving_lifetime: Duration::from_secs(24 * 3600),
            ca_secret: None,
            ca_config_map: None,
        }
    }
}

/// The signer name of the edges' client certificates, by default.
pub(crate) const DEFAULT_SIGNER_NAME: &str = "tunnel.io/edge-client";

/// A signer name is `domain/path` (Kubernetes' rule), and never one of Kubernetes' own.
pub(crate) fn check_signer_name(name: &str) -> Result<(), String> {
    match name.split_once('/') {
        Some((domain, path))
            if !path.is_empty()
                && check_node_name(domain).is_ok()
                && domain.contains('.')
                && !domain.ends_with("kubernetes.io") =>
        {
            Ok(())
        }
        _ => Err(format!(
            "`{name}` is not a signer name of this project (domain/path, the domain not kubernetes.io)"
        )),
    }
}

impl CsrSignerConfig {
    /// `csr.serving` replaces `tunnel.cert`/`key`: both set is an error rather than one
    /// silently ignored, and neither set is one too.
    fn validate_serving(&self, config: &CloudConfig, v: &mut Validator<'_>) {
        let t = &config.tunnel;
        let files = t.cert.is_some() || t.key.is_some();
        if !self.serving {
            // A relay's certificate is checked with the relay's keys (`validate_relay`).
            if config.role == Role::Replica && (t.cert.is_none() || t.key.is_none()) {
                v.problem(
                    "tunnel.cert",
                    "tunnel.cert and tunnel.key are required (or csr.serving = true)",
                );
            }
            return;
        }
        if files {
            v.problem("csr.serving", "the replica issues its own serving certificate: leave out tunnel.cert and tunnel.key");
        }
        if self.ca_key.is_none() {
            v.problem(
                "csr.ca_key",
                "required by csr.serving: the key of the CA in tunnel.client_ca",
            );
        }
        if t.client_ca.is_none() {
            v.problem("csr.serving", "needs tunnel.client_ca: the CA the serving certificate is signed by, which edges check the cloud against");
        }
        if self.serving_lifetime < SERVING_MIN_LIFETIME
            || self.serving_lifetime > SERVING_MAX_LIFETIME
        {
            v.problem(
                "csr.serving_lifetime",
                "must be between 10s and 90d (it renews at two thirds of it)",
            );
        }
        for (i, name) in self.serving_names.iter().enumerate() {
            if name.parse::<std::net::IpAddr>().is_err() && check_node_name(name).is_err() {
                v.problem(
                    format!("csr.serving_names[{i}]"),
                    format!("`{name}` is neither an IP address nor a DNS name"),
                );
            }
        }
    }

    /// The CA kept in the cluster: it needs the API, and files to write it to and load
    /// it from.
    fn validate_ca_in_cluster(&self, config: &CloudConfig, v: &mut Validator<'_>) {
        for (key, name) in [
            ("csr.ca_secret", &self.ca_secret),
            ("csr.ca_config_map", &self.ca_config_map),
        ] {
            let Some(name) = name else { continue };
            if check_node_name(name).is_err() {
                v.problem(
                    key,
                    format!("`{name}` is not an object name (a DNS subdomain)"),
                );
            }
            if !config.kubernetes.enabled {
                v.problem(key, "needs kubernetes.enabled = true");
            }
            if config.tunnel.client_ca.is_none() {
                v.problem(
                    key,
                    "needs tunnel.client_ca: where the CA certificate is written and read",
                );
            }
        }
        if self.ca_secret.is_some() && self.ca_key.is_none() {
            v.problem(
                "csr.ca_key",
                "required by csr.ca_secret: where the CA's key is written and read",
            );
        }
    }

    fn validate(&self, config: &CloudConfig, v: &mut Validator<'_>) {
        self.validate_serving(config, v);
        self.validate_ca_in_cluster(config, v);
        if !self.enabled {
            return;
        }
        if let Err(p) = check_signer_name(&self.signer_name) {
            v.problem("csr.signer_name", p);
        }
        if self.ca_key.is_none() {
            v.problem(
                "csr.ca_key",
                "required: the key of the CA in tunnel.client_ca",
            );
        }
        if config.tunnel.client_ca.is_none() {
            v.problem("csr.enabled", "needs tunnel.client_ca: the CA the cloud signs with and checks edge certificates against");
        }
        if !config.kubernetes.enabled {
            v.problem("csr.enabled", "needs kubernetes.enabled = true");
        }
        let k = &config.kubernetes;
        for (key, account) in [
            ("kubernetes.edge_service_account", &k.edge_service_account),
            ("kubernetes.relay_service_account", &k.relay_service_account),
        ] {
            if !account
                .split_once(':')
                .is_some_and(|(ns, name)| !ns.is_empty() && !name.is_empty())
            {
                v.problem(key, "must be namespace:name");
            }
        }
        if k.edge_service_account == k.relay_service_account {
            v.problem(
                "kubernetes.relay_service_account",
                "must differ from kubernetes.edge_service_account: an edge's pod may not have a relay's certificate",
            );
        }
        if self.max_lifetime < Duration::from_secs(60) || self.max_lifetime > CSR_MAX_LIFETIME {
            v.problem(
                "csr.max_lifetime",
                "must be between 1m and 1h: kube-controller-manager deletes an issued CSR an hour after its approval, and a certificate whose CSR is gone counts as revoked",
            );
        }
        if !(self.rate > 0.0 && self.rate.is_finite()) {
            v.problem("csr.rate", "must be a positive number of CSRs per second");
        }
    }
}

/// Edge-to-cloud connections. Nothing is reachable unless listed: an edge (a node, or a
/// cluster) must not get an open proxy into the cloud network.
#[derive(Debug, Clone, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ReverseConfig {
    /// Node or cluster name -> exact host:port targets its edge may reach.
    #[serde(default)]
    pub(crate) allow: BTreeMap<String, Vec<String>>,
}

impl ReverseConfig {
    /// Whether the edge registered as `name` may reach `target` on the cloud side.
    pub fn allows(&self, name: &str, target: &str) -> bool {
        self.allow
            .get(name)
            .is_some_and(|targets| targets.iter().any(|t| t == target))
    }

    fn validate(&self, v: &mut Validator<'_>) {
        for (name, targets) in &self.allow {
            if let Err(problem) = check_node_name(name) {
                v.problem(format!("reverse.allow.{name}"), problem);
            }
            for (i, t) in targets.iter().enumerate() {
                if let Err(problem) = Target::parse(t) {
                    v.problem(format!("reverse.allow.{name}[{i}]"), problem.to_string());
                }
            }
        }
    }
}

/// What an `[[https]]` entry's `client_ca` (or SuperEdge's `[mode.cloud.https]
/// client_ca`) is, and why it is required.
pub(crate) const HTTPS_CLIENT_CA: &str = "the CA that signed kube-apiserver's kubelet client certificate (its --kubelet-client-certificate; /etc/kubernetes/pki/ca.crt on kubeadm): the edge presents its own kubelet client certificate to the target, so without it anyone who reaches the listener could run exec in every pod of every edge";

#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct HttpsEntryConfig {
    pub listen: SocketAddr,
    /// Certificate presented to clients (SuperEdge: the kubelet server certificate).
    pub cert: PathBuf,
    pub key: PathBuf,
    /// host:port the edge dials with TLS, using its `[https]` client certificate.
    pub(crate) target: String,
    /// CA of the client certificates let in: the one that signed kube-apiserver's
    /// kubelet client certificate. Required (checked by `validate`, which says why):
    /// whoever gets through acts as kube-apiserver on every edge's kubelet.
    pub client_ca: Option<PathBuf>,
}

impl CloudConfig {
    pub(super) fn resolve_paths(&mut self, file: &Path) {
        let t = &mut self.tunnel;
        let peer_ca = self.peers.ca.as_mut();
        for p in [
            t.cert.as_mut(),
            t.key.as_mut(),
            t.token_file.as_mut(),
            t.client_ca.as_mut(),
            peer_ca,
            self.csr.ca_key.as_mut(),
            self.relay.csr.dir.as_mut(),
        ]
        .into_iter()
        .flatten()
        {
            *p = super::resolve_path(file, p);
        }
        for h in &mut self.https {
            h.cert = super::resolve_path(file, &h.cert);
            h.key = super::resolve_path(file, &h.key);
            if let Some(ca) = &mut h.client_ca {
                *ca = super::resolve_path(file, ca);
            }
        }
    }

    pub fn validate(&self, file: &Path) -> Result<(), ConfigError> {
        let mut v = Validator::new(file);
        match self.role {
            Role::Replica => {
                self.validate_authentication(&mut v);
                if self.relay.csr.enabled
                    || self.relay.node_name.is_some()
                    || self.relay.wait_for_ca
                {
                    v.problem("relay", "only with role = \"relay\"");
                }
            }
            Role::Relay => self.validate_relay(&mut v),
        }
        let names = self.validate_nodes(&mut v);
        let mut listens = Listens::default();
        match (self.role, self.tunnel.listen) {
            (Role::Replica, Some(a)) => listens.claim(&mut v, "tunnel.listen", a),
            (Role::Replica, None) => v.problem("tunnel.listen", "required: where edges connect"),
            (Role::Relay, _) => {}
        }
        if let Some(a) = self.admin.listen {
            listens.claim(&mut v, "admin.listen", a);
        }
        if let Some(a) = self.connect.listen {
            listens.claim(&mut v, "connect.listen", a);
        }
        self.validate_entries(&mut v, &mut listens, &names);
        if self.redirect.enabled {
            self.validate_redirect(&mut v, &mut listens);
        }
        if let Some(a) = self.peers.listen {
            listens.claim(&mut v, "peers.listen", a);
        }
        if let Some(socket) = &self.handover.socket
            && self.connect.unix.as_ref() == Some(socket)
        {
            v.problem(
                "handover.socket",
                "is connect.unix too: use a path of its own",
            );
        }
        self.validate_peers(&mut v);
        self.reverse.validate(&mut v);
        self.csr.validate(self, &mut v);
        self.transport.validate(&mut v);
        v.finish()
    }

    /// A relay carries only what the node's programs redirected, to the replicas: no
    /// edge listener, no other entry, no peer listener, nothing to sign.
    fn validate_relay(&self, v: &mut Validator<'_>) {
        let not_on_relay = [
            ("tunnel.listen", self.tunnel.listen.is_some()),
            ("tunnel.token_file", self.tunnel.token_file.is_some()),
            ("kubernetes.token_review", self.kubernetes.token_review),
            ("forward", !self.forwards.is_empty()),
            ("https", !self.https.is_empty()),
            ("connect.listen", self.connect.listen.is_some()),
            ("connect.unix", self.connect.unix.is_some()),
            ("peers.listen", self.peers.listen.is_some()),
            ("csr.enabled", self.csr.enabled),
            ("csr.serving", self.csr.serving),
            ("csr.ca_secret", self.csr.ca_secret.is_some()),
            ("csr.ca_config_map", self.csr.ca_config_map.is_some()),
        ];
        for (key, set) in not_on_relay {
            if set {
                v.problem(key, "not on a relay (role = \"relay\"): a relay holds no edge session and carries only the connections the node's programs redirected");
            }
        }
        if !self.redirect.enabled {
            v.problem(
                "redirect.enabled",
                "required on a relay: the redirect is what a relay serves",
            );
        }
        if self.peers.static_peers.is_empty() && self.kubernetes.peer_service.is_none() {
            v.problem(
                "peers.static",
                "a relay needs the replicas: set peers.static or kubernetes.peer_service",
            );
        }
        let files = self.tunnel.cert.is_some() || self.tunnel.key.is_some();
        match (self.relay.csr.enabled, files) {
            (true, true) => v.problem(
                "tunnel.cert",
                "not with [relay.csr] enabled: the relay's certificate comes from the cluster",
            ),
            (true, false) => self.relay.csr.validate("relay.csr", v),
            (false, _) if self.tunnel.cert.is_none() || self.tunnel.key.is_none() => {
                v.problem("tunnel.cert", "a relay needs its client certificate (CN system:tunnel-relay:<node>) for the replicas: tunnel.cert and tunnel.key, or [relay.csr] enabled");
            }
            (false, _) => {}
        }
        if let Some(node) = &self.relay.node_name
            && let Err(p) = check_node_name(node)
        {
            v.problem("relay.node_name", p);
        }
        if self.peers.ca(&self.tunnel).is_none() {
            v.problem(
                "peers.ca",
                "set peers.ca or tunnel.client_ca: the CA of the replicas' certificates",
            );
        }
    }

    /// How edges prove who they are, and how often that is checked again.
    fn validate_authentication(&self, v: &mut Validator<'_>) {
        if self.tunnel.token_file.is_none()
            && self.tunnel.client_ca.is_none()
            && !self.kubernetes.token_review
        {
            v.problem("tunnel", "set token_file, client_ca or kubernetes.token_review (or several): edges must authenticate");
        }
        if self.tunnel.reauth_interval < Duration::from_secs(1) {
            v.problem("tunnel.reauth_interval", "must be at least 1s");
        }
        if self.tunnel.max_edges == Some(0) {
            v.problem(
                "tunnel.max_edges",
                "must be at least 1 (leave it out to derive it from memory.max)",
            );
        }
        if self.tunnel.max_handshakes == 0 {
            v.problem("tunnel.max_handshakes", "must be at least 1");
        }
    }

    /// The `[[node]]` list: valid names, each once, no address in two nodes nor one that
    /// is never an edge's ([`reserved_address`]). Returns the names, which forwards may name.
    fn validate_nodes(&self, v: &mut Validator<'_>) -> HashSet<&str> {
        let mut names = HashSet::new();
        let mut addrs = HashSet::new();
        for (i, n) in self.nodes.iter().enumerate() {
            if let Err(problem) = check_node_name(&n.name) {
                v.problem(format!("node[{i}].name"), problem);
            }
            if !names.insert(n.name.as_str()) {
                v.problem(
                    format!("node[{i}].name"),
                    format!("node `{}` is listed twice", n.name),
                );
            }
            for a in &n.addresses {
                if let Some(why) = reserved_address(*a) {
                    v.problem(
                        format!("node[{i}].addresses"),
                        format!(
                            "node `{}`: {a} is a {why} address, which is never an edge's (connections to it are not for one edge)",
                            n.name
                        ),
                    );
                }
                if !addrs.insert(a.to_canonical()) {
                    v.problem(
                        format!("node[{i}].addresses"),
                        format!("address {a} belongs to two nodes"),
                    );
                }
            }
        }
        names
    }

    /// The `[[forward]]` and `[[https]]` entries: their listeners, targets, and the
    /// nodes (of `names`) they pin.
    fn validate_entries(
        &self,
        v: &mut Validator<'_>,
        listens: &mut Listens,
        names: &HashSet<&str>,
    ) {
        for (i, f) in self.forwards.iter().enumerate() {
            listens.claim(v, format!("forward[{i}].listen"), f.listen);
            if let Some(node) = &f.node
                && !names.contains(node.as_str())
            {
                v.problem(
                    format!("forward[{i}].node"),
                    format!("unknown node `{node}` (add it as a [[node]])"),
                );
            }
            if let Err(problem) = Target::parse(&f.target) {
                v.problem(format!("forward[{i}].target"), problem.to_string());
            }
        }
        for (i, h) in self.https.iter().enumerate() {
            listens.claim(v, format!("https[{i}].listen"), h.listen);
            if let Err(problem) = Target::parse(&h.target) {
                v.problem(format!("https[{i}].target"), problem.to_string());
            }
            if h.client_ca.is_none() {
                v.problem(
                    format!("https[{i}].client_ca"),
                    format!("required: {HTTPS_CLIENT_CA}"),
                );
            }
        }
    }

    /// With `redirect.pin_dir` the programs outlive the process: after a crash or an OOM
    /// kill they send connects to the redirect listeners for up to `fail_open_after`
    /// while no cloud listens, and whoever listens there first receives
    /// kube-apiserver's connections to kubelets. Below 1024 only root can; port 0 picks
    /// one above.
    fn validate_redirect_ports_with_pins(&self, v: &mut Validator<'_>) {
        let r = &self.redirect;
        if r.pin_dir.is_none() {
            return;
        }
        // An absent listen6 takes the port of listen, refused there already.
        for (key, addr) in [
            ("redirect.listen", Some(r.listen)),
            ("redirect.pod_listen", r.pod_listen),
            ("redirect.listen6", r.listen6),
            ("redirect.pod_listen6", r.pod_listen6),
            (
                "redirect.pod_port",
                r.pod_port.map(|p| SocketAddr::from(([0, 0, 0, 0], p))),
            ),
        ] {
            if let Some(a) = addr
                && !(1..1024).contains(&a.port())
            {
                v.problem(
                    key,
                    format!(
                        "port {} is one any local user can listen on: with redirect.pin_dir \
                         the programs keep redirecting to it after a crash, so whoever \
                         listens there first receives kube-apiserver's connections to \
                         kubelets; use a port from 1 to 1023 (default {})",
                        a.port(),
                        RedirectConfig::DEFAULT_PORT
                    ),
                );
            }
        }
    }

    /// `[redirect]`, when enabled: its listeners of each address family, the ports it
    /// takes, and how it fails open and is uninstalled.
    fn validate_redirect(&self, v: &mut Validator<'_>, listens: &mut Listens) {
        listens.claim(v, "redirect.listen", self.redirect.listen);
        if !self.redirect.listen.is_ipv4() {
            v.problem("redirect.listen", "must be an IPv4 address");
        }
        if let Some(p) = self.redirect.pod_listen {
            listens.claim(v, "redirect.pod_listen", p);
            if !p.is_ipv4() {
                v.problem("redirect.pod_listen", "must be an IPv4 address");
            }
        }
        for (key, addr) in [
            ("redirect.listen6", self.redirect.listen6),
            ("redirect.pod_listen6", self.redirect.pod_listen6),
        ] {
            if let Some(a) = addr {
                listens.claim(v, key, a);
                if !a.is_ipv6() {
                    v.problem(key, "must be an IPv6 address");
                }
            }
        }
        for (key, addr) in [
            ("redirect.pod_listen", self.redirect.pod_listen),
            ("redirect.pod_listen6", self.redirect.pod_listen6),
        ] {
            if let Some(a) = addr
                && let Some(why) = unreachable_from_pods(a.ip())
            {
                v.problem(
                    key,
                    format!("{a} ({why}) is one a pod cannot reach: name the node's own address"),
                );
            }
        }
        if self.redirect.pod_port.is_some()
            && (self.redirect.pod_listen.is_some() || self.redirect.pod_listen6.is_some())
        {
            v.problem(
                "redirect.pod_port",
                "not with redirect.pod_listen or pod_listen6: this node's address on a port, \
                 or addresses of their own",
            );
        }
        self.validate_redirect_ports_with_pins(v);
        if self.redirect.ports.is_empty() || self.redirect.ports.contains(&0) {
            v.problem("redirect.ports", "list at least one port, none of them 0");
        }
        let entries = self.redirect.edge_map_entries();
        let ports = self.redirect.ports.len();
        if (entries as usize) < ports || entries > RedirectConfig::EDGE_MAP_ENTRIES_MAX {
            v.problem(
                "redirect.edge_map_entries",
                format!(
                    "{entries} cannot be: at least one address's entries ({ports}, one a \
                     redirected port) and at most {}",
                    RedirectConfig::EDGE_MAP_ENTRIES_MAX
                ),
            );
        }
        if self.redirect.fail_open_after < std::time::Duration::from_secs(1) {
            v.problem(
                "redirect.fail_open_after",
                "must be at least 1s (the running cloud renews it four times a period)",
            );
        }
        if self.redirect.uninstall_with_daemonset.is_some()
            && (self.redirect.pin_dir.is_none() || !self.kubernetes.enabled)
        {
            v.problem(
                "redirect.uninstall_with_daemonset",
                "needs redirect.pin_dir and [kubernetes] enabled = true",
            );
        }
    }

    fn validate_peers(&self, v: &mut Validator<'_>) {
        let p = &self.peers;
        for (i, addr) in p.static_peers.iter().enumerate() {
            if let Err(problem) = Target::parse(addr) {
                v.problem(format!("peers.static[{i}]"), problem.to_string());
            }
        }
        let discovers = !p.static_peers.is_empty() || self.kubernetes.peer_service.is_some();
        if discovers && p.listen.is_none() && self.role == Role::Replica {
            v.problem("peers.listen", "required when replicas are listed (peers.static or kubernetes.peer_service): the others must reach this one too");
        }
        if p.listen.is_some() && p.ca(&self.tunnel).is_none() {
            v.problem("peers.ca", "set peers.ca or tunnel.client_ca: replicas authenticate each other with certificates");
        }
        if p.server_name.is_empty() {
            v.problem("peers.server_name", "must not be empty");
        }
        let k = &self.kubernetes;
        if k.peer_service.is_some() && !k.enabled {
            v.problem("kubernetes.peer_service", "needs kubernetes.enabled = true");
        }
        if k.token_review {
            if !k.enabled {
                v.problem("kubernetes.token_review", "needs kubernetes.enabled = true");
            }
            if !(k.token_review_rate > 0.0 && k.token_review_rate.is_finite()) {
                v.problem(
                    "kubernetes.token_review_rate",
                    "must be a positive number of reviews per second",
                );
            }
            if k.token_audience.is_empty() {
                v.problem("kubernetes.token_audience", "must not be empty");
            }
            if !k
                .edge_service_account
                .split_once(':')
                .is_some_and(|(ns, name)| !ns.is_empty() && !name.is_empty())
            {
                v.problem("kubernetes.edge_service_account", "must be namespace:name");
            }
        }
        if k.enabled && k.edge_selector.trim().is_empty() {
            v.problem(
                "kubernetes.edge_selector",
                "must not be empty (the default is node-role.kubernetes.io/edge)",
            );
        } else if k.enabled
            && let Err(e) = super::edge_selector(&k.edge_selector)
        {
            v.problem("kubernetes.edge_selector", e);
        }
    }
}

/// The addresses the cloud's listeners claimed so far: no two may share one (port 0
/// aside: each gets a port of its own).
#[derive(Default)]
struct Listens(HashSet<SocketAddr>);

impl Listens {
    fn claim(&mut self, v: &mut Validator<'_>, key: impl Into<String>, addr: SocketAddr) {
        if addr.port() != 0 && !self.0.insert(addr) {
            v.problem(key, format!("{addr} is already used by another listener"));
        }
    }
}

/// Why `ip` can never be an edge's address, if it cannot: connections to it are the
/// master's own (loopback), or name no one host (unspecified, link-local, multicast,
/// broadcast). An IPv4-mapped IPv6 address is judged as the IPv4 address it is.
///
/// Loopback here is the part of it hosts use for themselves: 127.0.0.0/16 (localhost,
/// 127.0.0.53 of systemd-resolved, Debian's 127.0.1.1 for the host's own name) and ::1.
/// The rest of 127.0.0.0/8 stays usable as edge addresses for tests and demos on one
/// machine, where nothing else dials them.
pub(crate) fn reserved_address(ip: IpAddr) -> Option<&'static str> {
    match ip.to_canonical() {
        IpAddr::V4(v4) => {
            let [a, b, ..] = v4.octets();
            if a == 0 {
                Some("unspecified")
            } else if a == 127 && b == 0 {
                Some("loopback")
            } else if v4.is_link_local() {
                Some("link-local")
            } else if v4.is_multicast() {
                Some("multicast")
            } else if v4.is_broadcast() {
                Some("broadcast")
            } else {
                None
            }
        }
        IpAddr::V6(v6) => {
            if v6.is_unspecified() {
                Some("unspecified")
            } else if v6.is_loopback() {
                Some("loopback")
            } else if v6.is_unicast_link_local() {
                Some("link-local")
            } else if v6.is_multicast() {
                Some("multicast")
            } else {
                None
            }
        }
    }
}
