//! Whether a stopping tunnel-cloud takes its pinned eBPF redirect with it: only when its
//! own DaemonSet is being deleted (`kubectl delete -k deploy/`), not in a rolling update
//! or a restart, where the next pod adopts the pins (`intercept::pin`).

use std::path::Path;

use k8s_openapi::api::apps::v1::DaemonSet;
use kube::Api;

/// After the drain: asks the API server about `daemonset` (in the pod's namespace); gone
/// or carrying a deletionTimestamp, the redirect is uninstalled. So is it when our own
/// credentials are refused (401/403): `kubectl delete -k` removes the ServiceAccount and
/// the Role with the DaemonSet, possibly before this pod asks, while a rolling update
/// never does. Any other doubt (the API unreachable) keeps the pins: with no cloud they
/// only refuse redirected connects, and the next pod adopts them.
pub async fn uninstall_if_deleted(
    client: kube::Client,
    daemonset: &str,
    pin_dir: &Path,
    cgroup: Option<&Path>,
) {
    let namespace = std::env::var("POD_NAMESPACE")
        .ok()
        .filter(|n| !n.is_empty())
        .unwrap_or_else(|| client.default_namespace().to_string());
    let api: Api<DaemonSet> = Api::namespaced(client, &namespace);
    let deleting = match api.get_opt(daemonset).await {
        Ok(None) => true,
        Ok(Some(ds)) => ds.metadata.deletion_timestamp.is_some(),
        Err(kube::Error::Api(status)) if status.code == 401 || status.code == 403 => {
            tracing::info!(%namespace, daemonset, code = status.code, "our credentials are refused: the deployment is being removed");
            true
        }
        Err(e) => {
            tracing::warn!(%namespace, daemonset, error = %e, "cannot tell whether the DaemonSet is being deleted; keeping the pinned redirect");
            return;
        }
    };
    if !deleting {
        tracing::info!(%namespace, daemonset, "DaemonSet stays: the pinned redirect is kept for the next pod");
        return;
    }
    match crate::intercept::uninstall(pin_dir, cgroup) {
        Ok(removed) => tracing::info!(
            %namespace,
            daemonset,
            pins = removed.len(),
            "DaemonSet deleted: eBPF redirect uninstalled"
        ),
        Err(e) => {
            tracing::error!(error = %e, "DaemonSet deleted, but uninstalling the eBPF redirect failed")
        }
    }
}
