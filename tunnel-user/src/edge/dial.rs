//! The edge's side of a proxied connection: is the target allowed, then connect to it,
//! in TLS when the cloud asks, counted. A compromised cloud must not get an open proxy
//! into the edge network.

use std::collections::HashSet;
use std::net::{IpAddr, SocketAddr};
use std::time::{Duration, Instant};

use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::histogram::Histogram;
use proto::DialStatus;
use tokio::net::TcpStream;
use tokio_rustls::TlsConnector;
use tokio_rustls::client::TlsStream;
use tracing::{info, warn};

use crate::addr::{NODE_IPS, Target, interface_addresses};
use crate::call::copy::Totals;
use crate::call::outcome::{DialFailure, says};
use crate::call::request::{Request, RequestError};
use crate::call::serve::{Callee, Connected};
use crate::config::AllowConfig;
use crate::io::net::{ConnectError, connect};
use crate::ops::metrics::{EdgeMetrics, ReasonLabel};

/// Targets this edge agrees to dial.
#[derive(Debug, Clone)]
pub struct Allowlist {
    /// Exact targets that are addresses.
    addresses: HashSet<SocketAddr>,
    /// Exact targets that are host names and ports, lower-cased.
    names: HashSet<String>,
    node_addresses: HashSet<IpAddr>,
    ports: HashSet<u16>,
    any: bool,
}

impl Allowlist {
    /// `default_node_addresses` are this node's addresses when the config lists none
    /// ([`default_node_addresses`]).
    pub fn new(config: &AllowConfig, default_node_addresses: impl FnOnce() -> Vec<IpAddr>) -> Self {
        let node_addresses = if config.node_addresses.is_empty() {
            default_node_addresses()
        } else {
            config.node_addresses.clone()
        };
        let (mut addresses, mut names) = (HashSet::new(), HashSet::new());
        for target in &config.targets {
            match target.parse::<SocketAddr>() {
                Ok(addr) => addresses.insert(addr),
                Err(_) => names.insert(target.to_ascii_lowercase()),
            };
        }
        Self {
            addresses,
            names,
            node_addresses: node_addresses.into_iter().collect(),
            ports: config.ports.iter().copied().collect(),
            any: config.any,
        }
    }

    pub(crate) fn allows_any(&self) -> bool {
        self.any
    }

    pub(crate) fn describe(&self) -> String {
        if self.any {
            return "any target (SuperEdge mode)".into();
        }
        let mut targets: Vec<_> = self
            .addresses
            .iter()
            .map(|a| a.to_string())
            .chain(self.names.iter().cloned())
            .collect();
        targets.sort();
        let mut addrs: Vec<_> = self.node_addresses.iter().map(|a| a.to_string()).collect();
        addrs.sort();
        let mut ports: Vec<_> = self.ports.iter().copied().collect();
        ports.sort();
        format!("targets {targets:?}; node addresses {addrs:?} on ports {ports:?}")
    }

    /// Whether `target` may be dialled (an address matches in any spelling, parsed,
    /// not formatted for the comparison).
    pub fn check(&self, target: &Target) -> Result<(), DialError> {
        let allowed = self.any
            || match target.socket_addr() {
                Some(addr) => {
                    self.addresses.contains(&addr)
                        || (self.node_addresses.contains(&addr.ip())
                            && self.ports.contains(&addr.port()))
                }
                None => self.names.contains(&target.as_str().to_ascii_lowercase()),
            };
        if allowed {
            Ok(())
        } else {
            Err(DialError::NotAllowed(target.clone()))
        }
    }
}

/// This node's addresses when `allow.node_addresses` lists none: `node_ips` (from
/// `NODE_IPS`), the addresses that name the node, else every address of its interfaces,
/// which on a Kubernetes node are more than the node's own (cni0's and docker0's
/// gateways, kube-ipvs0's Service addresses), so that fallback is logged as a warning.
pub(crate) fn default_node_addresses(node_ips: Option<Vec<IpAddr>>) -> Vec<IpAddr> {
    if let Some(addresses) = node_ips {
        return addresses;
    }
    let found = interface_addresses();
    warn!(addresses = ?found, "neither allow.node_addresses nor {NODE_IPS} names this node's addresses: allowing every address of its interfaces on allow.ports, bridges' and kube-ipvs0's Service addresses included");
    found
}

/// Why the edge did not connect to a target. The cloud is answered with
/// [`DialError::status`] and this text (`DialResult`), and the `dials` metric counts
/// the status.
#[derive(Debug, thiserror::Error)]
pub enum DialError {
    /// The call carries no request the edge can read (`call::request::RequestError`'s
    /// text): no metadata, or a target that is not `host:port` (the cloud sends only ones
    /// it parsed).
    #[error("{0}")]
    BadRequest(String),
    #[error("target {0} is not in this edge's allowlist")]
    NotAllowed(Target),
    #[error(transparent)]
    Connect(#[from] ConnectError),
    /// `[https]`: the target's host is no TLS server name.
    #[error(transparent)]
    ServerName(crate::io::tls::TlsError),
    /// `[https]`: the TLS handshake with the target overran what was left of the bound.
    #[error("TLS handshake with {target} timed out (the dial's bound is {bound:?})")]
    TlsTimeout { target: Target, bound: Duration },
    #[error("TLS handshake with {target}: {error}")]
    Tls {
        target: Target,
        error: std::io::Error,
    },
}

impl DialError {
    /// What the cloud is told.
    pub(crate) fn status(&self) -> DialStatus {
        match self {
            DialError::NotAllowed(_) => DialStatus::Forbidden,
            DialError::BadRequest(_) => DialStatus::BadRequest,
            DialError::Connect(e) => e.status(),
            DialError::TlsTimeout { .. } => DialStatus::Timeout,
            DialError::ServerName(_) => DialStatus::BadRequest,
            DialError::Tls { .. } => DialStatus::Refused,
        }
    }
}

/// The edge's dials for the cloud's `Edge.Dial` calls, in one place: the allowlist, the
/// connection, TLS to the target when the cloud asks for it, and the dial metrics, all
/// within the dial timeout.
pub(crate) struct Dialer {
    allow: Allowlist,
    /// TLS toward targets the cloud asks to reach over TLS (SuperEdge's HTTPS module).
    target_tls: TlsConnector,
    /// `transport.dial_timeout`: one bound for TCP and TLS, so the cloud hears the
    /// edge's answer before its own bound on the dial.
    timeout: Duration,
    /// `tunnel_edge_dials` by outcome, and the time a successful one took.
    dials: Family<ReasonLabel, Counter>,
    dial_seconds: Histogram,
}

impl Dialer {
    pub(crate) fn new(
        allow: Allowlist,
        target_tls: TlsConnector,
        timeout: Duration,
        metrics: &EdgeMetrics,
    ) -> Self {
        Self {
            allow,
            target_tls,
            timeout,
            dials: metrics.dials.clone(),
            dial_seconds: metrics.dial_seconds.clone(),
        }
    }

    /// Dials the target of `request`, counts the outcome and times a success; a refusal
    /// is what the cloud gets. Takes the request so the caller does not keep it.
    pub(crate) async fn dial(
        &self,
        request: Result<Request, RequestError>,
    ) -> Result<Connected, DialFailure> {
        let started = Instant::now();
        let dialed = match request {
            Ok(request) => self.dial_uncounted(&request).await,
            Err(e) => Err(DialError::BadRequest(e.to_string())),
        };
        let outcome = match &dialed {
            Ok(_) => {
                self.dial_seconds.observe(started.elapsed().as_secs_f64());
                DialStatus::Ok
            }
            Err(e) => e.status(),
        };
        self.dials
            .get_or_create(&ReasonLabel {
                reason: says(outcome).edge_dials,
            })
            .inc();
        dialed.map_err(|e| {
            let message = e.to_string();
            match e {
                DialError::NotAllowed(_) => {
                    warn!(%message, "refused a target outside the allowlist")
                }
                DialError::BadRequest(_) => warn!(%message, "bad dial request from the cloud"),
                _ => info!(%message, "dial failed"),
            }
            DialFailure::new(e.status(), message)
        })
    }

    /// The target a dial call asks for: allowed, connected, and wrapped in TLS when
    /// asked, all within the dial timeout.
    async fn dial_uncounted(&self, request: &Request) -> Result<Connected, DialError> {
        let started = Instant::now();
        let target = &request.target;
        self.allow.check(target)?;
        let tcp = connect(target, self.timeout).await?;
        if !request.tls {
            return Ok(Connected::Tcp(tcp));
        }
        let budget = self.timeout.saturating_sub(started.elapsed());
        let tls = self.tls_to_target(tcp, target, budget).await?;
        Ok(Connected::Tls(Box::new(tls)))
    }

    /// Originates TLS to the target with the `[https]` client certificate, within what
    /// is left of the dial timeout.
    async fn tls_to_target(
        &self,
        tcp: TcpStream,
        target: &Target,
        budget: Duration,
    ) -> Result<TlsStream<TcpStream>, DialError> {
        let name = crate::io::tls::server_name(target.host()).map_err(DialError::ServerName)?;
        tokio::time::timeout(budget, self.target_tls.connect(name, tcp))
            .await
            .map_err(|_| DialError::TlsTimeout {
                target: target.clone(),
                bound: self.timeout,
            })?
            .map_err(|error| DialError::Tls {
                target: target.clone(),
                error,
            })
    }
}

/// The edge serves the cloud's `Edge.Dial` calls (`call::serve`) with its `Dialer`, and
/// its `Edge.Reverse` calls with `reverse`.
impl Callee for super::Edge {
    fn dial(
        &self,
        request: Result<Request, RequestError>,
    ) -> impl Future<Output = Result<Connected, DialFailure>> + Send {
        self.dialer.dial(request)
    }

    fn copying(&self) -> (usize, &Totals) {
        (self.transport.chunk_size, &self.bytes)
    }

    fn reverse(
        &self,
        request: http::Request<h2::RecvStream>,
        respond: h2::server::SendResponse<bytes::Bytes>,
    ) -> impl Future<Output = ()> + Send + 'static {
        super::reverse::serve_call(self.reverse.clone(), request, respond)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn target(t: &str) -> Target {
        Target::parse(t).expect("valid")
    }

    fn allow(config: AllowConfig) -> Allowlist {
        Allowlist::new(&config, || vec![IpAddr::from([192, 0, 2, 7])])
    }

    #[test]
    fn default_allows_kubelet_and_own_addresses_on_configured_ports() {
        let a = allow(AllowConfig::default());
        assert!(a.check(&target("127.0.0.1:10250")).is_ok());
        assert!(a.check(&target("192.0.2.7:10250")).is_ok());
        assert!(a.check(&target("192.0.2.7:22")).is_err());
        assert!(a.check(&target("127.0.0.1:22")).is_err());
        assert!(a.check(&target("192.0.2.8:10250")).is_err());
        assert!(a.check(&target("metadata.internal:80")).is_err());
    }

    #[test]
    fn configured_addresses_replace_detected_ones() {
        let a = allow(AllowConfig {
            node_addresses: vec![IpAddr::from([127, 1, 0, 5])],
            ..AllowConfig::default()
        });
        assert!(a.check(&target("127.1.0.5:10250")).is_ok());
        assert!(a.check(&target("192.0.2.7:10250")).is_err());
    }

    #[test]
    fn ipv6_node_addresses_are_allowed_on_the_node_ports() {
        let a = Allowlist::new(&AllowConfig::default(), || {
            vec![
                IpAddr::from([192, 0, 2, 7]),
                "fd00:7e57::5".parse().expect("ip"),
            ]
        });
        assert!(a.check(&target("[fd00:7e57::5]:10250")).is_ok());
        assert!(
            a.check(&target("[fd00:7e57:0:0::5]:10250")).is_ok(),
            "any spelling"
        );
        assert!(a.check(&target("[fd00:7e57::5]:22")).is_err());
        assert!(a.check(&target("[fd00:7e57::6]:10250")).is_err());
    }

    #[test]
    fn exact_targets_match_by_canonical_form() {
        let a = allow(AllowConfig {
            targets: vec!["[::1]:8080".into(), "Registry.Local:5000".into()],
            ..AllowConfig::default()
        });
        assert!(a.check(&target("[0:0:0:0:0:0:0:1]:8080")).is_ok());
        assert!(a.check(&target("registry.local:5000")).is_ok());
        assert!(a.check(&target("registry.local:5001")).is_err());
    }

    /// A dial call whose target is not host:port (a cloud sends only ones it parsed) is
    /// a bad request that names the problem, counted as one, and is not dialled, not
    /// even by an edge that allows any target.
    #[tokio::test]
    async fn a_dial_call_whose_target_is_not_host_port_is_a_bad_request() {
        let metrics = EdgeMetrics::new(&mut prometheus_client::registry::Registry::default());
        let tls = crate::io::tls::target_client_config(None).expect("TLS client config");
        let any = allow(AllowConfig {
            any: true,
            ..AllowConfig::default()
        });
        let dialer = Dialer::new(
            any,
            TlsConnector::from(tls),
            Duration::from_secs(5),
            &metrics,
        );
        let request = proto::DialRequest {
            target: "edge-1".into(),
            ..proto::DialRequest::default()
        };
        let mut metadata = tonic::metadata::MetadataMap::new();
        metadata.insert_bin(proto::DIAL_REQUEST_METADATA, proto::to_metadata(&request));
        let Err(refusal) = dialer.dial(Request::from_metadata(&metadata)).await else {
            panic!("dialled a target without a port");
        };
        assert_eq!(refusal.status, DialStatus::BadRequest, "{refusal:?}");
        assert_eq!(refusal.message, "`edge-1` is not host:port: it has no port");
        let counted = |reason| metrics.dials.get_or_create(&ReasonLabel { reason }).get();
        assert_eq!((counted("bad_request"), counted("refused")), (1, 0));
    }

    #[test]
    fn any_allows_everything() {
        let a = allow(AllowConfig {
            any: true,
            ..AllowConfig::default()
        });
        assert!(a.check(&target("10.1.2.3:22")).is_ok());
    }
}
