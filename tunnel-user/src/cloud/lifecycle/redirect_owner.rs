//! Whether a stopping tunnel-cloud takes its pinned eBPF redirect with it: only when its
//! own DaemonSet is being deleted (`kubectl delete -k deploy/`), not in a rolling update
//! or a restart, where the next pod adopts the pins (`intercept::pin`).

use std::path::Path;
use std::time::Duration;

use k8s_openapi::api::apps::v1::DaemonSet;
use kube::Api;

/// How long the question may take: the answer must come well within the pod's
/// termination grace period, whatever else shutting down takes.
const ASK_TIMEOUT: Duration = Duration::from_secs(5);

/// At shutdown, before the drain: asks the API server about `daemonset` (in the pod's
/// namespace); gone or carrying a deletionTimestamp, the redirect is uninstalled. So is
/// it when our own credentials are refused (401/403): `kubectl delete -k` removes the
/// ServiceAccount and the Role with the DaemonSet, possibly before this pod asks, while a
/// rolling update never does. Any other doubt (the API unreachable) keeps the pins: the
/// next pod adopts them, and if none comes the programs fail open once
/// `redirect.fail_open_after` has passed.
pub(crate) async fn uninstall_if_deleted(
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
    let answer = tokio::time::timeout(ASK_TIMEOUT, api.get_opt(daemonset)).await;
    let deleting = match answer {
        Ok(Ok(None)) => true,
        Ok(Ok(Some(ds))) => ds.metadata.deletion_timestamp.is_some(),
        Ok(Err(kube::Error::Api(status))) if status.code == 401 || status.code == 403 => {
            tracing::info!(%namespace, daemonset, code = status.code, "our credentials are refused: the deployment is being removed");
            true
        }
        Ok(Err(e)) => {
            tracing::warn!(%namespace, daemonset, error = %e, "cannot tell whether the DaemonSet is being deleted; keeping the pinned redirect");
            return;
        }
        Err(_) => {
            tracing::warn!(%namespace, daemonset, timeout = ?ASK_TIMEOUT, "the API server did not say whether the DaemonSet is being deleted; keeping the pinned redirect");
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
