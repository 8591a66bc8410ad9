//! The fleet's cluster: etcd and a real kube-apiserver on loopback, started as the
//! Kubernetes tests start them (`tunnel-user/tests/k8s/apiserver.rs`, included), with
//! an edge Node for every edge of the fleet, which the replicas watch.

use std::net::Ipv4Addr;
use std::path::{Path, PathBuf};
use std::time::Instant;

use anyhow::{Context, Result, bail};
use futures::StreamExt as _;
use k8s_openapi::api::core::v1::Node;
use kube::api::{Api, PostParams};

#[path = "../../../../tunnel-user/tests/k8s/apiserver.rs"]
#[expect(
    dead_code,
    reason = "the tests' harness: the bench starts the API server, nothing else of it"
)]
mod apiserver;

use super::super::simedge::node_name;

/// Where the Kubernetes binaries are: `KUBEBUILDER_ASSETS` (as the tests find them), else
/// `../shared/k8s-1.36` beside the checkout with Debian's etcd.
fn assets(root: &Path) -> Result<apiserver::Assets> {
    if std::env::var_os("KUBEBUILDER_ASSETS").is_some() {
        return apiserver::Assets::find().map_err(anyhow::Error::msg);
    }
    let dir = root.join("../shared/k8s-1.36");
    let assets = apiserver::Assets {
        apiserver: dir.join("kube-apiserver"),
        etcd: PathBuf::from("/usr/bin/etcd"),
        dir,
    };
    for bin in [&assets.apiserver, &assets.etcd] {
        if !bin.is_file() {
            bail!(
                "{} does not exist: set KUBEBUILDER_ASSETS to a directory with kube-apiserver (etcd: Debian's etcd-server)",
                bin.display()
            );
        }
    }
    Ok(assets)
}

/// The API server and the Nodes made so far.
pub struct Cluster {
    api: apiserver::ApiServer,
    pub version: String,
    /// Nodes of simulated edges made so far (`sim-00000` on).
    pub nodes: usize,
}

/// An edge Node named as its edge's certificate, with one InternalIP, which the
/// replicas' node tables and redirect maps hold.
fn edge_node(name: &str, ip: Ipv4Addr) -> Result<Node> {
    Ok(serde_json::from_value(serde_json::json!({
        "apiVersion": "v1", "kind": "Node",
        "metadata": {"name": name, "labels": {"node-role.kubernetes.io/edge": ""}},
        "status": {"addresses": [{"type": "InternalIP", "address": ip.to_string()}]}
    }))?)
}

impl Cluster {
    /// etcd and kube-apiserver in `dir`, and the Node of the real edge that moves
    /// (`real_edge`).
    pub fn start(root: &Path, dir: &Path, real_edge: &str) -> Result<Self> {
        let assets = assets(root)?;
        std::fs::create_dir_all(dir)?;
        let api = apiserver::ApiServer::start(&assets, dir, &apiserver::ApiServerOpts::default());
        let cluster = Self {
            version: assets.version(),
            api,
            nodes: 0,
        };
        cluster.create(&[(real_edge.to_string(), super::REAL_EDGE_ADDRESS)])?;
        Ok(cluster)
    }

    pub fn kubeconfig(&self) -> PathBuf {
        self.api.admin_kubeconfig.clone()
    }

    /// The Nodes of simulated edges up to `n` (those not made yet); the time it took.
    pub fn grow_to(&mut self, n: usize) -> Result<f64> {
        let started = Instant::now();
        // Simulated edge i at 10.0.0.1 + i.
        let first = u32::from(Ipv4Addr::new(10, 0, 0, 1));
        let nodes: Vec<(String, Ipv4Addr)> = (self.nodes..n)
            .map(|i| (node_name(i), Ipv4Addr::from(first + i as u32)))
            .collect();
        self.create(&nodes)?;
        self.nodes = self.nodes.max(n);
        Ok(started.elapsed().as_secs_f64())
    }

    fn create(&self, nodes: &[(String, Ipv4Addr)]) -> Result<()> {
        let kubeconfig = self.api.admin_kubeconfig.clone();
        tokio::runtime::Runtime::new()?.block_on(async {
            let kubeconfig = kube::config::Kubeconfig::read_from(&kubeconfig)?;
            let config =
                kube::Config::from_custom_kubeconfig(kubeconfig, &Default::default()).await?;
            let api: Api<Node> = Api::all(kube::Client::try_from(config)?);
            let failed: Vec<String> = futures::stream::iter(nodes)
                .map(|(name, ip)| {
                    let api = api.clone();
                    async move {
                        let node = edge_node(name, *ip)?;
                        api.create(&PostParams::default(), &node)
                            .await
                            .with_context(|| format!("create Node {name}"))
                    }
                })
                .buffer_unordered(64)
                .filter_map(|r| async move { r.err().map(|e| format!("{e:#}")) })
                .collect()
                .await;
            if let Some(first) = failed.first() {
                bail!(
                    "{} of {} Nodes not created, first: {first}",
                    failed.len(),
                    nodes.len()
                );
            }
            anyhow::Ok(())
        })
    }
}
