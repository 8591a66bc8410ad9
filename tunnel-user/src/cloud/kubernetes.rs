//! What the cloud learns from the Kubernetes API, by watching (never per connection):
//! - every Node's InternalIP/ExternalIP addresses, and which Nodes are edges (by label
//!   selector, decided here), which become the node table the router and the eBPF edge
//!   map use (an address of a non-edge is no edge's: see `nodes::table::NodeTable`);
//! - the EndpointSlices of the replicas' headless Service, which become the peer list.
//!
//! The peer watch keeps a snapshot of the objects it has seen, replaced whole when the
//! watch restarts with a fresh list (so objects deleted while it was down go too), and
//! hands the derived state on after every change. The Node watch hands each change on
//! as it comes (a relist as the whole list), and they are applied to the node table in
//! batches, off the thread that serves edges ([`apply_node_changes`]).

use std::borrow::Cow;
use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::fmt::Debug;
use std::net::IpAddr;
use std::sync::Arc;

use futures::StreamExt;
use k8s_openapi::api::core::v1::{Node, NodeAddress};
use k8s_openapi::api::discovery::v1::EndpointSlice;
use k8s_openapi::api::networking::v1::ServiceCIDR;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;
use kube::core::{Selector, SelectorExt};
use kube::runtime::WatchStreamExt;
use kube::runtime::watcher::{self, Event};
use kube::{Api, Resource, ResourceExt};
use serde::Deserialize;
use serde::de::DeserializeOwned;
use tokio::sync::{mpsc, oneshot};
use tokio_util::sync::CancellationToken;
use tracing::{debug, info, warn};

use super::nodes::table::{ADDRESSES_PER_FAMILY, Claimed};
use super::nodes::{NodeChange, Nodes};
use super::peer::Peers;
use super::watch::Snapshot;
use crate::addr::Cidr;
use crate::config::{CloudConfig, edge_selector};

/// Nodes per page of the Node watch's (re)list: a fleet's 100,000 Nodes come in 200
/// answers of at most a few MiB each, not one of hundreds.
const NODE_LIST_PAGE: u32 = 500;

/// Label EndpointSlices carry to name their Service.
const SERVICE_NAME_LABEL: &str = "kubernetes.io/service-name";
/// Port of the peer Service that is the peer listener, when it has several.
const PEER_PORT_NAME: &str = "peers";

/// A Node as the Node watch reads it: its name and resource version (which the watch
/// resumes from), its labels (for the edge selector) and its addresses. Everything else
/// a kubelet writes (images, conditions, capacity, managed fields: 10 KiB and more a
/// Node) is skipped while the answer is parsed, so a page of a fleet's list, or a
/// heartbeat's status update, never holds it.
#[derive(Clone, Debug, Deserialize)]
pub(crate) struct NodeView {
    #[serde(deserialize_with = "names_and_labels")]
    metadata: ObjectMeta,
    spec: Option<NodeViewSpec>,
    status: Option<NodeViewStatus>,
}

#[derive(Clone, Debug, Default, Deserialize)]
struct NodeViewSpec {
    #[serde(rename = "podCIDR")]
    pod_cidr: Option<String>,
    #[serde(rename = "podCIDRs")]
    pod_cidrs: Option<Vec<String>>,
}

#[derive(Clone, Debug, Default, Deserialize)]
struct NodeViewStatus {
    addresses: Option<Vec<NodeAddress>>,
}

/// The part of a Node's metadata the watch uses.
fn names_and_labels<'de, D: serde::Deserializer<'de>>(d: D) -> Result<ObjectMeta, D::Error> {
    #[derive(Deserialize)]
    #[serde(rename_all = "camelCase")]
    struct Used {
        name: Option<String>,
        resource_version: Option<String>,
        labels: Option<BTreeMap<String, String>>,
    }
    let used = Used::deserialize(d)?;
    Ok(ObjectMeta {
        name: used.name,
        resource_version: used.resource_version,
        labels: used.labels,
        ..ObjectMeta::default()
    })
}

impl Resource for NodeView {
    type DynamicType = ();
    type Scope = <Node as Resource>::Scope;

    fn kind(dt: &()) -> Cow<'_, str> {
        Node::kind(dt)
    }
    fn group(dt: &()) -> Cow<'_, str> {
        Node::group(dt)
    }
    fn version(dt: &()) -> Cow<'_, str> {
        Node::version(dt)
    }
    fn plural(dt: &()) -> Cow<'_, str> {
        Node::plural(dt)
    }
    fn meta(&self) -> &ObjectMeta {
        &self.metadata
    }
    fn meta_mut(&mut self) -> &mut ObjectMeta {
        &mut self.metadata
    }
}

/// What the cloud keeps of a Node: whether its labels match the edge selector; its
/// InternalIP and ExternalIP addresses, in the order it lists them (of an edge, the
/// first [`ADDRESSES_PER_FAMILY`] of each family: what it listed past them is not kept,
/// so a patch that changes only those changes nothing here, and costs no table change);
/// its pod CIDRs (`spec.podCIDRs`, or `spec.podCIDR` from before dual stack).
pub(crate) fn claim_of(node: &NodeView, edges: &Selector) -> Claimed {
    let edge = edges.matches(node.labels());
    let mut addresses = node_addresses(node);
    let listed = addresses.len();
    if edge {
        let (mut v4, mut v6) = (0, 0);
        addresses.retain(|ip| {
            let n = if ip.to_canonical().is_ipv4() {
                &mut v4
            } else {
                &mut v6
            };
            *n += 1;
            *n <= ADDRESSES_PER_FAMILY
        });
    }
    Claimed {
        edge,
        over_cap: addresses.len() < listed,
        addresses,
        pod_cidrs: pod_cidrs(node),
    }
}

/// A node's pod CIDRs; one the API server let through that does not parse is skipped.
fn pod_cidrs(node: &NodeView) -> Vec<Cidr> {
    let Some(spec) = &node.spec else {
        return Vec::new();
    };
    let listed = match (&spec.pod_cidrs, &spec.pod_cidr) {
        (Some(all), _) if !all.is_empty() => all.clone(),
        (_, Some(one)) => vec![one.clone()],
        _ => Vec::new(),
    };
    listed.iter().filter_map(|c| c.parse().ok()).collect()
}

/// A node's InternalIP and ExternalIP addresses, in the order the node lists them.
pub(crate) fn node_addresses(node: &NodeView) -> Vec<IpAddr> {
    let addresses = node.status.as_ref().and_then(|s| s.addresses.as_ref());
    addresses
        .into_iter()
        .flatten()
        .filter(|a| a.type_ == "InternalIP" || a.type_ == "ExternalIP")
        .filter_map(|a| a.address.parse().ok())
        .collect()
}

/// The peer listeners an EndpointSlice lists: ready endpoints on the port named
/// `peers` (or the only port).
pub(crate) fn slice_addresses(slice: &EndpointSlice) -> Vec<String> {
    let ports = slice.ports.as_deref().unwrap_or_default();
    let port = match ports {
        [only] => only.port,
        _ => ports
            .iter()
            .find(|p| p.name.as_deref() == Some(PEER_PORT_NAME))
            .and_then(|p| p.port),
    };
    let Some(port) = port.and_then(|p| u16::try_from(p).ok()).filter(|p| *p != 0) else {
        return Vec::new();
    };
    let mut addrs: Vec<String> = slice
        .endpoints
        .iter()
        // An endpoint without conditions counts as ready (the API's own rule).
        .filter(|e| e.conditions.as_ref().and_then(|c| c.ready) != Some(false))
        .flat_map(|e| e.addresses.iter())
        .filter_map(|a| a.parse::<IpAddr>().ok())
        .map(|ip| std::net::SocketAddr::new(ip, port).to_string())
        .collect();
    addrs.sort();
    addrs
}

/// How long the list of ServiceCIDRs at start may take before the node watch starts
/// without it.
const SERVICE_CIDR_LIST_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(5);

/// The Service CIDRs: `configured` and those the ServiceCIDR API lists (Kubernetes
/// 1.33+; an older server has none, and the config says them). Read once, at start: a
/// cluster's Service range changes seldom, and only by its operator.
async fn service_cidrs(client: kube::Client, configured: Vec<Cidr>) -> Vec<Cidr> {
    let api: Api<ServiceCIDR> = Api::all(client);
    let mut all = configured;
    let listed = tokio::time::timeout(
        SERVICE_CIDR_LIST_TIMEOUT,
        api.list(&kube::api::ListParams::default()),
    )
    .await;
    match listed {
        Ok(Ok(list)) => {
            let ranges = list
                .items
                .iter()
                .filter_map(|s| s.spec.as_ref()?.cidrs.as_ref());
            all.extend(ranges.flatten().filter_map(|c| c.parse::<Cidr>().ok()));
        }
        Ok(Err(kube::Error::Api(status))) if status.code == 404 => info!(
            "the API server has no ServiceCIDR API (Kubernetes before 1.33): kubernetes.service_cidrs names the Service addresses"
        ),
        Ok(Err(e)) => warn!(
            error = %e,
            "cannot list the ServiceCIDRs (list on servicecidrs.networking.k8s.io); kubernetes.service_cidrs names the Service addresses"
        ),
        Err(_) => warn!(
            timeout = ?SERVICE_CIDR_LIST_TIMEOUT,
            "the API server did not list the ServiceCIDRs in time; kubernetes.service_cidrs names the Service addresses"
        ),
    }
    all.sort();
    all.dedup();
    let text: Vec<String> = all.iter().map(Cidr::to_string).collect();
    info!(service_cidrs = %text.join(", "), "addresses in these Service CIDRs are never an edge's");
    all
}

/// Watches `api` until `shutdown`, keeping a snapshot of `extract`ed objects and
/// calling `changed` with it after every change; `listed` fires once the first list
/// is applied.
pub(crate) async fn watch<K, T>(
    api: Api<K>,
    config: watcher::Config,
    what: &'static str,
    extract: impl Fn(&K) -> T,
    mut changed: impl FnMut(&HashMap<String, T>),
    listed: oneshot::Sender<()>,
    shutdown: CancellationToken,
) where
    K: Resource + Clone + DeserializeOwned + Debug + Send + 'static,
    T: PartialEq + Clone,
{
    let mut snapshot = Snapshot::new();
    let mut first_list = Some(listed);
    let on_event = |event: Event<K>| {
        let listed = matches!(event, Event::InitDone);
        if snapshot.apply(event, &extract) || listed {
            changed(snapshot.current());
        }
        if listed && let Some(first) = first_list.take() {
            let _ = first.send(());
        }
    };
    watch_events(api, config, what, on_event, shutdown).await;
}

/// Watches `api` until `shutdown`, handing every event to `on_event`. Errors are logged
/// and the watch retried with backoff; a restarted watch relists.
async fn watch_events<K>(
    api: Api<K>,
    config: watcher::Config,
    what: &'static str,
    mut on_event: impl FnMut(Event<K>),
    shutdown: CancellationToken,
) where
    K: Resource + Clone + DeserializeOwned + Debug + Send + 'static,
{
    let stream = watcher::watcher(api, config).default_backoff();
    futures::pin_mut!(stream);
    let mut failing = false;
    let mut listing = 0usize;
    loop {
        let event = tokio::select! {
            e = stream.next() => e,
            () = shutdown.cancelled() => return,
        };
        match event {
            None => return,
            Some(Ok(event)) => {
                match &event {
                    Event::Init => listing = 0,
                    Event::InitApply(_) => listing += 1,
                    _ => {}
                }
                let listed = matches!(event, Event::InitDone);
                on_event(event);
                if listed {
                    info!(what, objects = listing, "watch (re)listed");
                }
                failing = false;
            }
            // The first failure of a run is a warning; the retries that follow are not
            // worth one line each.
            Some(Err(e)) if !failing => {
                warn!(what, error = %e, "watch failed; retrying with backoff");
                failing = true;
            }
            Some(Err(e)) => tracing::debug!(what, error = %e, "watch still failing"),
        }
    }
}

/// The Node watch's events as node table changes: a relist is gathered whole, so that
/// it replaces what the table holds at once.
fn node_changes(edges: Selector) -> impl FnMut(Event<NodeView>) -> Option<NodeChange> {
    let mut relisting: Option<HashMap<String, Claimed>> = None;
    move |event| match event {
        Event::Init => {
            relisting = Some(HashMap::new());
            None
        }
        Event::InitApply(node) => {
            let claim = claim_of(&node, &edges);
            relisting
                .get_or_insert_default()
                .insert(node.name_any(), claim);
            None
        }
        Event::InitDone => Some(NodeChange::Listed(relisting.take().unwrap_or_default())),
        Event::Apply(node) => Some(NodeChange::Set(node.name_any(), claim_of(&node, &edges))),
        Event::Delete(node) => Some(NodeChange::Gone(node.name_any())),
    }
}

/// Applies the Node watch's changes to `nodes` until the watch ends, in batches: what
/// queued while one batch was applied is the next. Each batch runs on the blocking pool,
/// so neither a relist of a fleet nor a burst of changes holds the runtime's thread,
/// which accepts and serves the edges (`[runtime] worker_threads = 1`). `listed` fires
/// once a list is in the table.
pub(crate) async fn apply_node_changes(
    nodes: Arc<Nodes>,
    mut changes: mpsc::UnboundedReceiver<NodeChange>,
    listed: oneshot::Sender<()>,
) {
    let mut listed = Some(listed);
    let mut batch = Vec::new();
    while changes.recv_many(&mut batch, usize::MAX).await > 0 {
        let lists = batch.iter().any(|c| matches!(c, NodeChange::Listed(_)));
        let (to, count) = (nodes.clone(), batch.len());
        let batch_now = std::mem::take(&mut batch);
        let applied = tokio::task::spawn_blocking(move || {
            let started = std::time::Instant::now();
            let changed = to.change(batch_now);
            (changed, to.watched(), started.elapsed())
        });
        let Ok((changed, (edge_nodes, all), took)) = applied.await else {
            return;
        };
        debug!(changes = count, changed, ?took, "node changes applied");
        // Before the first list (the Service CIDRs alone) there is nothing to report.
        if changed && (lists || listed.is_none()) {
            info!(
                changes = count,
                edge_nodes,
                nodes = all,
                "node table updated from the API"
            );
        }
        if lists && let Some(first) = listed.take() {
            let _ = first.send(());
        }
    }
}

/// Starts the watches `[kubernetes]` asks for; they run until `shutdown`. The node table
/// is the configured nodes and the watched ones; the peer list the static peers and the
/// watched replicas. The future it returns is ready once both have had their first list
/// from the API (never, while the API cannot be reached). Fails on an edge selector
/// that does not parse (config validation refuses it first).
pub(crate) fn start(
    client: kube::Client,
    config: &CloudConfig,
    table: Arc<Nodes>,
    peers: Arc<Peers>,
    tasks: &mut tokio::task::JoinSet<()>,
    shutdown: &CancellationToken,
) -> anyhow::Result<impl Future<Output = ()> + Send + use<>> {
    let static_peers = config.peers.static_peers.clone();
    let config = &config.kubernetes;
    let nodes: Api<NodeView> = Api::all(client.clone());
    // Every Node, not only the edges: another node's address is no edge's, and only a
    // full view tells which addresses those are.
    let edges = edge_selector(&config.edge_selector)
        .map_err(|e| anyhow::anyhow!("kubernetes.edge_selector: {e}"))?;
    let (nodes_listed, nodes_first) = oneshot::channel();
    let (services_api, configured_services) = (client.clone(), config.service_cidrs.clone());
    let stop = shutdown.clone();
    tasks.spawn(async move {
        let services = service_cidrs(services_api, configured_services).await;
        let (send, changes) = mpsc::unbounded_channel();
        let _ = send.send(NodeChange::Services(services));
        let mut change = node_changes(edges);
        let on_event = move |event| {
            if let Some(c) = change(event) {
                let _ = send.send(c);
            }
        };
        let config = watcher::Config::default().page_size(NODE_LIST_PAGE);
        // The watch ends (at shutdown) by dropping `send`, which ends the applier.
        tokio::join!(
            watch_events(nodes, config, "nodes", on_event, stop),
            apply_node_changes(table, changes, nodes_listed),
        );
    });

    let mut peers_first = None;
    if let Some(service) = &config.peer_service {
        let namespace = config.own_namespace(client.default_namespace());
        let slices: Api<EndpointSlice> = Api::namespaced(client, &namespace);
        let selector =
            watcher::Config::default().labels(&format!("{SERVICE_NAME_LABEL}={service}"));
        let (peers_listed, first) = oneshot::channel();
        peers_first = Some(first);
        let on_slices = move |watched: &HashMap<String, Vec<String>>| {
            let addrs: BTreeSet<String> = static_peers
                .iter()
                .cloned()
                .chain(watched.values().flatten().cloned())
                .collect();
            info!(peers = addrs.len(), "peer list updated from the API");
            peers.set_addresses(&addrs);
        };
        tasks.spawn(watch(
            slices,
            selector,
            "peer endpointslices",
            slice_addresses,
            on_slices,
            peers_listed,
            shutdown.clone(),
        ));
    }
    Ok(async move {
        let _ = nodes_first.await;
        if let Some(first) = peers_first {
            let _ = first.await;
        }
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    use std::net::SocketAddr;

    use http::{Request, Response};
    use kube::client::Body;
    use serde_json::json;
    use tokio::sync::mpsc;

    use crate::cloud::conn::route::route_address;
    use crate::cloud::nodes::table::{Claim, NodeTable};
    use crate::config::NodeConfig;

    type Handle = tower_test::mock::Handle<Request<Body>, Response<Body>>;

    fn node(name: &str, rv: &str, ips: &[&str]) -> serde_json::Value {
        labelled(name, rv, ips, json!({"node-role.kubernetes.io/edge": ""}))
    }

    /// A node without the edge label.
    fn master(name: &str, rv: &str, ips: &[&str]) -> serde_json::Value {
        labelled(
            name,
            rv,
            ips,
            json!({"node-role.kubernetes.io/control-plane": ""}),
        )
    }

    fn labelled(
        name: &str,
        rv: &str,
        ips: &[&str],
        labels: serde_json::Value,
    ) -> serde_json::Value {
        let mut addresses: Vec<serde_json::Value> =
            ips.iter().enumerate().map(|(i, ip)| json!({"type": if i == 0 { "InternalIP" } else { "ExternalIP" }, "address": ip})).collect();
        addresses.push(json!({"type": "Hostname", "address": name}));
        json!({
            "apiVersion": "v1", "kind": "Node",
            "metadata": {"name": name, "resourceVersion": rv, "labels": labels},
            "status": {"addresses": addresses},
        })
    }

    /// The node table: the `[[node]]` entries of the config (edges all), then every watched
    /// node the config does not name, edge or not: an address two of them list, that a
    /// non-edge lists or that is in a non-edge's pod CIDR or in one of `services` (the
    /// Service CIDRs) is no edge's.
    fn node_table(
        configured: &[NodeConfig],
        watched: &HashMap<String, Claimed>,
        services: &[Cidr],
    ) -> NodeTable {
        let configured_claims = configured.iter().map(|n| Claim {
            name: &n.name,
            addresses: &n.addresses,
            edge: true,
            pod_cidrs: &[],
            over_cap: false,
        });
        let watched_claims = watched
            .iter()
            .filter(|(name, _)| !configured.iter().any(|n| &n.name == *name))
            .map(|(name, node)| Claim {
                name,
                addresses: &node.addresses,
                edge: node.edge,
                pod_cidrs: &node.pod_cidrs,
                over_cap: node.over_cap,
            });
        NodeTable::new(configured_claims.chain(watched_claims), services)
    }

    fn edges() -> Selector {
        edge_selector("node-role.kubernetes.io/edge").expect("selector")
    }

    fn watched(n: serde_json::Value) -> Claimed {
        claim_of(&serde_json::from_value(n).expect("node"), &edges())
    }

    fn node_list(rv: &str, items: Vec<serde_json::Value>) -> Vec<u8> {
        serde_json::to_vec(&json!({"apiVersion": "v1", "kind": "NodeList", "metadata": {"resourceVersion": rv}, "items": items}))
            .expect("json")
    }

    fn watch_events(events: &[(&str, serde_json::Value)]) -> Vec<u8> {
        let mut body = Vec::new();
        for (kind, object) in events {
            body.extend(
                serde_json::to_vec(&json!({"type": kind, "object": object})).expect("json"),
            );
            body.push(b'\n');
        }
        body
    }

    /// Answers the next request, after checking it is the list or watch expected.
    async fn answer(handle: &mut Handle, watch: bool, body: Vec<u8>) -> String {
        let (req, send) =
            tokio::time::timeout(std::time::Duration::from_secs(10), handle.next_request())
                .await
                .expect("the watcher made no request in time")
                .expect("service dropped");
        let uri = req.uri().to_string();
        assert!(uri.starts_with("/api/v1/nodes?"), "{uri}");
        assert!(
            !uri.contains("labelSelector"),
            "every node is watched, not only the edges: {uri}"
        );
        assert_eq!(uri.contains("watch=true"), watch, "{uri}");
        send.send_response(
            Response::builder()
                .body(Body::from(body))
                .expect("response"),
        );
        uri
    }

    async fn next_state(
        rx: &mut mpsc::UnboundedReceiver<HashMap<String, Claimed>>,
    ) -> HashMap<String, Claimed> {
        tokio::time::timeout(std::time::Duration::from_secs(10), rx.recv())
            .await
            .expect("no node table update in time")
            .expect("watch ended")
    }

    /// Edge nodes and their addresses.
    fn state(entries: &[(&str, &[&str])]) -> HashMap<String, Claimed> {
        entries
            .iter()
            .map(|(n, ips)| {
                let addresses = ips.iter().map(|ip| ip.parse().expect("ip")).collect();
                (
                    n.to_string(),
                    Claimed {
                        edge: true,
                        addresses,
                        ..Claimed::default()
                    },
                )
            })
            .collect()
    }

    fn dst(s: &str) -> SocketAddr {
        s.parse().expect("addr")
    }

    #[test]
    fn dual_stack_and_ipv6_only_nodes_route_and_reach_the_edge_maps_by_both_families() {
        let dual: NodeView =
            serde_json::from_value(node("edge-d", "1", &["10.0.0.7", "fd00:7e57::7"]))
                .expect("node");
        let v6_only: NodeView =
            serde_json::from_value(node("edge-6", "1", &["fd00:7e57::6"])).expect("node");
        let addrs = |n: &NodeView| node_addresses(n);
        assert_eq!(
            addrs(&dual),
            vec![
                "10.0.0.7".parse::<IpAddr>().expect("ip"),
                "fd00:7e57::7".parse().expect("ip")
            ]
        );
        let seen = HashMap::from([
            ("edge-d".to_string(), claim_of(&dual, &edges())),
            ("edge-6".to_string(), claim_of(&v6_only, &edges())),
        ]);
        let table = node_table(&[], &seen, &[]);
        for (to, node) in [
            ("[fd00:7e57::7]:10250", "edge-d"),
            ("10.0.0.7:10250", "edge-d"),
            ("[fd00:7e57::6]:10250", "edge-6"),
        ] {
            let route = route_address(&table, dst(to)).expect("routes");
            assert_eq!(route.node.as_deref(), Some(node), "{to}");
            assert_eq!(
                route.target.to_string(),
                to,
                "the edge dials the address as dialled"
            );
        }
        // Both families reach the eBPF edge maps.
        assert_eq!(
            table.all_addresses().len(),
            3,
            "{:?}",
            table.all_addresses()
        );
    }

    #[tokio::test]
    async fn node_watch_scenarios_against_a_mock_apiserver() {
        let (service, mut handle) = tower_test::mock::pair::<Request<Body>, Response<Body>>();
        let client = kube::Client::new(service, "default");
        let (tx, mut rx) = mpsc::unbounded_channel();
        let shutdown = CancellationToken::new();
        let on_change = move |s: &HashMap<String, Claimed>| {
            let _ = tx.send(s.clone());
        };
        let selector = edges();
        let task = tokio::spawn(watch(
            Api::<NodeView>::all(client),
            watcher::Config::default(),
            "nodes",
            move |n: &NodeView| claim_of(n, &selector),
            on_change,
            oneshot::channel().0,
            shutdown.clone(),
        ));
        // A node in the config keeps its configured addresses whatever the API says.
        let configured = vec![NodeConfig {
            name: "edge-static".into(),
            addresses: vec!["127.1.0.99".parse().expect("ip")],
        }];

        // Initial list: one edge node.
        answer(
            &mut handle,
            false,
            node_list("1", vec![node("edge-1", "1", &["127.1.0.1"])]),
        )
        .await;
        assert_eq!(
            next_state(&mut rx).await,
            state(&[("edge-1", &["127.1.0.1"])])
        );

        // Node added, IP changed, node deleted: each is one update.
        let events = watch_events(&[
            ("ADDED", node("edge-2", "2", &["127.1.0.2", "127.1.0.22"])),
            ("MODIFIED", node("edge-1", "3", &["127.1.0.11"])),
            ("DELETED", node("edge-2", "4", &["127.1.0.2", "127.1.0.22"])),
        ]);
        let uri = answer(&mut handle, true, events).await;
        assert!(
            uri.contains("resourceVersion=1"),
            "the watch must start where the list ended: {uri}"
        );
        let added = next_state(&mut rx).await;
        assert_eq!(
            added,
            state(&[
                ("edge-1", &["127.1.0.1"]),
                ("edge-2", &["127.1.0.2", "127.1.0.22"])
            ])
        );
        let table = node_table(&configured, &added, &[]);
        assert_eq!(
            route_address(&table, dst("127.1.0.22:10250"))
                .expect("external ip routes")
                .node
                .as_deref(),
            Some("edge-2")
        );

        let moved = next_state(&mut rx).await;
        assert_eq!(
            moved,
            state(&[
                ("edge-1", &["127.1.0.11"]),
                ("edge-2", &["127.1.0.2", "127.1.0.22"])
            ])
        );
        let table = node_table(&configured, &moved, &[]);
        assert_eq!(
            route_address(&table, dst("127.1.0.11:10250"))
                .expect("new ip routes")
                .node
                .as_deref(),
            Some("edge-1")
        );
        assert!(
            route_address(&table, dst("127.1.0.1:10250")).is_err(),
            "the old address must no longer route"
        );

        let deleted = next_state(&mut rx).await;
        assert_eq!(deleted, state(&[("edge-1", &["127.1.0.11"])]));
        let table = node_table(&configured, &deleted, &[]);
        assert!(route_address(&table, dst("127.1.0.2:10250")).is_err());
        assert_eq!(
            route_address(&table, dst("127.1.0.99:10250"))
                .expect("configured node")
                .node
                .as_deref(),
            Some("edge-static")
        );

        // The watch restarts with 410 Gone (history compacted while it was away): the
        // watcher relists, and a node deleted meanwhile disappears with the relist.
        let gone = json!({"apiVersion": "v1", "kind": "Status", "metadata": {}, "status": "Failure",
            "message": "too old resource version", "reason": "Expired", "code": 410});
        let uri = answer(&mut handle, true, watch_events(&[("ERROR", gone)])).await;
        assert!(uri.contains("resourceVersion=4"), "{uri}");
        answer(
            &mut handle,
            false,
            node_list("10", vec![node("edge-3", "9", &["127.1.0.3"])]),
        )
        .await;
        assert_eq!(
            next_state(&mut rx).await,
            state(&[("edge-3", &["127.1.0.3"])])
        );

        shutdown.cancel();
        tokio::time::timeout(std::time::Duration::from_secs(5), task)
            .await
            .expect("watch stops on shutdown")
            .expect("join");
    }

    #[test]
    fn snapshot_replaces_its_state_only_when_a_relist_completes() {
        let n = |name: &str, ip: &str| {
            serde_json::from_value::<NodeView>(node(name, "1", &[ip])).expect("node")
        };
        let mut s = Snapshot::new();
        assert!(s.apply(Event::Apply(n("a", "127.1.0.1")), node_addresses));
        assert!(
            !s.apply(Event::Apply(n("a", "127.1.0.1")), node_addresses),
            "an unchanged object changes nothing"
        );
        assert!(!s.apply(Event::Init, node_addresses));
        assert!(!s.apply(Event::InitApply(n("b", "127.1.0.2")), node_addresses));
        assert_eq!(
            s.current().len(),
            1,
            "a relist in progress leaves the current state alone"
        );
        assert!(s.apply(Event::<NodeView>::InitDone, node_addresses));
        assert_eq!(s.current().keys().collect::<Vec<_>>(), ["b"]);
        assert!(s.apply(Event::Delete(n("b", "127.1.0.2")), node_addresses));
        assert!(!s.apply(Event::Delete(n("b", "127.1.0.2")), node_addresses));
    }

    #[test]
    fn slices_give_ready_endpoints_on_the_peer_port() {
        let slice = |ports: serde_json::Value| -> EndpointSlice {
            serde_json::from_value(json!({
                "apiVersion": "discovery.k8s.io/v1", "kind": "EndpointSlice", "addressType": "IPv4",
                "metadata": {"name": "tunnel-cloud-peers-abc"},
                "ports": ports,
                "endpoints": [
                    {"addresses": ["127.0.0.2"], "conditions": {"ready": true}},
                    {"addresses": ["127.0.0.3"], "conditions": {"ready": false}},
                    {"addresses": ["127.0.0.1"]},
                ],
            }))
            .expect("slice")
        };
        let one = slice(json!([{"port": 9002}]));
        assert_eq!(slice_addresses(&one), ["127.0.0.1:9002", "127.0.0.2:9002"]);
        let named =
            slice(json!([{"name": "metrics", "port": 9100}, {"name": "peers", "port": 9002}]));
        assert_eq!(
            slice_addresses(&named),
            ["127.0.0.1:9002", "127.0.0.2:9002"]
        );
        let unnamed = slice(json!([{"name": "a", "port": 1}, {"name": "b", "port": 2}]));
        assert!(
            slice_addresses(&unnamed).is_empty(),
            "no port named peers among several: nothing to dial"
        );
    }

    #[test]
    fn an_address_a_non_edge_or_a_configured_node_lists_is_no_watched_edges() {
        let configured = vec![NodeConfig {
            name: "edge-static".into(),
            addresses: vec!["192.0.2.99".parse().expect("ip")],
        }];
        let seen = HashMap::from([
            (
                "master-1".to_string(),
                watched(master("master-1", "1", &["192.0.2.1"])),
            ),
            (
                "edge-honest".to_string(),
                watched(node("edge-honest", "1", &["192.0.2.10"])),
            ),
            (
                "edge-evil".to_string(),
                watched(node(
                    "edge-evil",
                    "1",
                    &["192.0.2.1", "192.0.2.99", "127.0.0.1", "192.0.2.20"],
                )),
            ),
        ]);
        assert!(!seen["master-1"].edge && seen["edge-evil"].edge);
        let table = node_table(&configured, &seen, &[]);
        let owner = |ip: &str| {
            route_address(&table, dst(&format!("{ip}:10250")))
                .ok()
                .and_then(|r| r.node)
                .map(|n| n.to_string())
        };
        assert_eq!(owner("192.0.2.1"), None, "the master's address");
        assert_eq!(owner("192.0.2.99"), None, "the configured node's address");
        assert_eq!(owner("127.0.0.1"), None, "the master's loopback");
        assert_eq!(owner("192.0.2.10").as_deref(), Some("edge-honest"));
        assert_eq!(owner("192.0.2.20").as_deref(), Some("edge-evil"));
        assert!(table.addresses("master-1").is_none(), "a master is no edge");
        assert_eq!(
            table
                .dropped()
                .iter()
                .map(|d| d.reason())
                .collect::<Vec<_>>(),
            ["conflict", "conflict", "reserved"]
        );
        assert_eq!(
            table.all_addresses(),
            [
                "192.0.2.10".parse::<IpAddr>().expect("ip"),
                "192.0.2.20".parse().expect("ip")
            ],
            "only the edges' own addresses reach the eBPF edge map"
        );
    }

    /// A compromised kubelet lists thousands of addresses: its Node keeps the first of
    /// each family, and a patch that changes only the rest changes nothing the table is
    /// made from. A master (trusted) keeps all it lists.
    #[test]
    fn an_edge_listing_thousands_of_addresses_keeps_the_first_of_each_family() {
        let junk = |n: usize, first: u8| -> Vec<String> {
            let mut ips: Vec<String> = (0..n)
                .map(|i| format!("198.18.{}.{}", i / 250, i % 250 + 1))
                .collect();
            ips[0] = format!("192.0.2.{first}");
            ips.push("fd00::1".into());
            ips
        };
        let view = |name: &str, ips: &[String], edge: bool| {
            let ips: Vec<&str> = ips.iter().map(String::as_str).collect();
            let node = if edge {
                node(name, "1", &ips)
            } else {
                master(name, "1", &ips)
            };
            let view: NodeView = serde_json::from_value(node).expect("node");
            claim_of(&view, &edges())
        };
        let evil = view("edge-evil", &junk(3000, 20), true);
        assert!(evil.over_cap);
        assert_eq!(
            evil.addresses.len(),
            ADDRESSES_PER_FAMILY + 1,
            "and the IPv6 one"
        );
        assert_eq!(
            evil.addresses[0],
            "192.0.2.20".parse::<IpAddr>().expect("ip")
        );
        assert_eq!(evil, view("edge-evil", &junk(3001, 20), true));
        assert_ne!(evil, view("edge-evil", &junk(3000, 21), true));
        let master = view("master-1", &junk(20, 1), false);
        assert_eq!((master.addresses.len(), master.over_cap), (21, false));

        let seen = HashMap::from([("edge-evil".to_string(), evil)]);
        let table = node_table(&[], &seen, &[]);
        assert_eq!(table.all_addresses().len(), ADDRESSES_PER_FAMILY + 1);
        let reasons: Vec<&str> = table.dropped().iter().map(|d| d.reason()).collect();
        assert_eq!(
            reasons,
            ["too_many"],
            "one entry for the node, none per address"
        );
    }

    /// An edge that lists a master's pod address or a Service's ClusterIP gets neither;
    /// an address in an edge's own pod CIDR, which its kubelet may have set, bars nobody.
    #[test]
    fn pod_and_service_addresses_are_never_an_edges() {
        let mut master = watched(master("master-1", "1", &["192.0.2.1"]));
        master.pod_cidrs = vec!["10.244.0.0/24".parse().expect("cidr")];
        let mut evil = watched(node(
            "edge-evil",
            "1",
            &["10.244.0.5", "10.96.0.10", "192.0.2.20"],
        ));
        evil.pod_cidrs = vec!["0.0.0.0/0".parse().expect("cidr")];
        let honest = watched(node("edge-honest", "1", &["192.0.2.30"]));
        let seen = HashMap::from([
            ("master-1".to_string(), master),
            ("edge-evil".to_string(), evil),
            ("edge-honest".to_string(), honest),
        ]);
        let services = ["10.96.0.0/12".parse().expect("cidr")];
        let table = node_table(&[], &seen, &services);
        let ip = |text: &str| text.parse::<IpAddr>().expect("ip");
        assert_eq!(table.node_for_ip(ip("10.244.0.5")), None);
        assert_eq!(table.node_for_ip(ip("10.96.0.10")), None);
        assert_eq!(
            table.node_for_ip(ip("192.0.2.20")).map(|n| n.to_string()),
            Some("edge-evil".into())
        );
        assert_eq!(
            table.node_for_ip(ip("192.0.2.30")).map(|n| n.to_string()),
            Some("edge-honest".into())
        );
        let reasons: Vec<&str> = table.dropped().iter().map(|d| d.reason()).collect();
        assert_eq!(reasons, ["reserved", "reserved"]);
    }

    /// A Node as a kubelet writes it: the watch keeps its name, resource version, labels
    /// and addresses, and nothing else of it.
    #[test]
    fn the_node_watch_reads_only_names_labels_and_addresses() {
        let kubelet_node = serde_json::json!({
            "apiVersion": "v1", "kind": "Node",
            "metadata": {
                "name": "edge-1", "resourceVersion": "42", "uid": "0b7e-uid",
                "labels": {"node-role.kubernetes.io/edge": "", "kubernetes.io/os": "linux"},
                "annotations": {"node.alpha.kubernetes.io/ttl": "0", "volumes.kubernetes.io/controller-managed-attach-detach": "true"},
                "managedFields": [{"manager": "kubelet", "operation": "Update", "fieldsType": "FieldsV1",
                    "fieldsV1": {"f:status": {"f:images": {}, "f:conditions": {}}}}],
                "creationTimestamp": "2026-11-27T10:00:00Z"
            },
            "spec": {"podCIDR": "10.244.1.0/24", "taints": [{"key": "edge", "effect": "NoSchedule"}]},
            "status": {
                "addresses": [{"type": "InternalIP", "address": "10.0.0.7"},
                              {"type": "Hostname", "address": "edge-1"}],
                "capacity": {"cpu": "4", "memory": "8Gi"},
                "conditions": [{"type": "Ready", "status": "True", "reason": "KubeletReady"}],
                "images": [{"names": ["registry.k8s.io/pause:3.10"], "sizeBytes": 320000}],
                "nodeInfo": {"kubeletVersion": "v1.36.0", "osImage": "Debian"}
            }
        });
        let view: NodeView = serde_json::from_value(kubelet_node).expect("a kubelet's Node");
        assert_eq!(
            view.metadata,
            ObjectMeta {
                name: Some("edge-1".into()),
                resource_version: Some("42".into()),
                labels: Some(
                    [
                        ("node-role.kubernetes.io/edge", ""),
                        ("kubernetes.io/os", "linux")
                    ]
                    .into_iter()
                    .map(|(k, v)| (k.to_string(), v.to_string()))
                    .collect()
                ),
                ..ObjectMeta::default()
            },
            "no uid, annotations, managed fields or timestamps"
        );
        let kept = format!("{:?}", view.status);
        for dropped in [
            "capacity",
            "conditions",
            "images",
            "pause",
            "nodeInfo",
            "v1.36.0",
        ] {
            assert!(!kept.contains(dropped), "{dropped} kept: {kept}");
        }
        assert_eq!(
            claim_of(&view, &edges()),
            Claimed {
                edge: true,
                addresses: vec!["10.0.0.7".parse().expect("ip")],
                over_cap: false,
                pod_cidrs: vec!["10.244.1.0/24".parse().expect("cidr")],
            }
        );
        // A Node without a status (just created) has no addresses, and is no error.
        let bare: NodeView =
            serde_json::from_value(serde_json::json!({"metadata": {"name": "n"}, "status": null}))
                .expect("a Node without status");
        assert!(node_addresses(&bare).is_empty());
    }
}
