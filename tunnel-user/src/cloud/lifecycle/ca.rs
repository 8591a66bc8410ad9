//! The tunnel CA kept in the cluster, so an install needs no hand-made certificates.
//!
//! `csr.ca_secret`: the CA (`ca.crt`, `ca.key`) lives in a Secret of the cloud's
//! namespace. deploy/ ships it empty, because RBAC can narrow `get` and `update` to one
//! object by name but not `create`. The first replica to start fills it with a new CA;
//! replicas starting at once agree through the Secret's resourceVersion: each writes
//! with the version it read, the API server takes one write, and the others get a
//! conflict, read again and use what won. A Secret the operator filled (bring your own
//! CA) is used as it is and never written. Either way the CA is written to
//! `tunnel.client_ca` and `csr.ca_key` (an in-memory volume in deploy/), where the rest
//! of the cloud loads it as from any files.
//!
//! `csr.ca_config_map`: the certificate of `tunnel.client_ca` is published in a
//! ConfigMap (key `ca.crt`), as `kube-root-ca.crt` is, which the edges mount and trust.
//! It also ships empty, for the same reason. Whoever may update ConfigMaps in the
//! namespace could add a CA of their own there, and the edges would trust it at their
//! next renewal: the cloud watches the ConfigMap and puts the CA back (as
//! kube-controller-manager does for `kube-root-ca.crt`), saying what it found.

use std::collections::BTreeMap;
use std::path::Path;

use anyhow::Context as _;
use futures::StreamExt as _;
use k8s_openapi::ByteString;
use k8s_openapi::api::core::v1::{ConfigMap, Secret};
use kube::Api;
use kube::api::PostParams;
use kube::runtime::WatchStreamExt as _;
use kube::runtime::watcher::{self, Event};
use tokio_util::sync::CancellationToken;
use tracing::{info, warn};

use crate::config::CloudConfig;

/// The keys of the CA in the Secret, as `tunnel certs` names its files.
const CERT_KEY: &str = "ca.crt";
const KEY_KEY: &str = "ca.key";

/// Writes lost to another replica, at most: each loss means the other replica's write
/// is there to read, so a second attempt normally settles it.
const ATTEMPTS: usize = 5;

/// The CA from the Secret (made there if empty) written to the config's files, and its
/// certificate published in the ConfigMap, as the config asks. Before anything loads
/// the CA files. Returns the [`Guard`] that keeps the ConfigMap so, when there is one.
pub(crate) async fn bootstrap(
    config: &CloudConfig,
    client: &kube::Client,
) -> anyhow::Result<Option<Guard>> {
    let c = &config.csr;
    let namespace = config.kubernetes.own_namespace(client.default_namespace());
    let ca_cert = config.tunnel.client_ca.as_deref();
    let secrets: Api<Secret> = Api::namespaced(client.clone(), &namespace);
    if let Some(name) = &c.ca_secret {
        let (cert_path, key_path) = ca_cert
            .zip(c.ca_key.as_deref())
            .context("csr.ca_secret needs tunnel.client_ca and csr.ca_key")?;
        let (cert, key) = from_secret(&secrets, &namespace, name).await?;
        write(cert_path, cert.as_bytes(), false)?;
        write(key_path, key.as_bytes(), true)?;
    }
    let Some(name) = &c.ca_config_map else {
        return Ok(None);
    };
    let path = ca_cert.context("csr.ca_config_map needs tunnel.client_ca")?;
    let source = match &c.ca_secret {
        Some(secret) => Source::Secret(secret.clone()),
        None => Source::File(path.to_path_buf()),
    };
    let cert = std::fs::read_to_string(path)
        .with_context(|| format!("{}: cannot read the CA to publish", path.display()))?;
    let maps: Api<ConfigMap> = Api::namespaced(client.clone(), &namespace);
    publish(&maps, &namespace, name, &cert).await?;
    Ok(Some(Guard {
        maps,
        secrets,
        name: name.clone(),
        namespace,
        source,
    }))
}

/// Where the CA the ConfigMap must publish comes from, read again at each check: the
/// Secret (`csr.ca_secret`), which every replica reads, so that replicas started before
/// and after the operator replaced the CA there agree on it instead of writing theirs
/// in turn; else the file `tunnel.client_ca`, which the cloud reloads too.
enum Source {
    /// The Secret's name.
    Secret(String),
    File(std::path::PathBuf),
}

/// Keeps the ConfigMap the edges trust holding the tunnel CA alone: a change is put
/// back, with a warning naming it.
pub(crate) struct Guard {
    maps: Api<ConfigMap>,
    secrets: Api<Secret>,
    /// The ConfigMap's.
    name: String,
    namespace: String,
    source: Source,
}

/// The shortest time between two repairs: should two writers disagree for good (an
/// operator's own controller, replicas given different CA files), the API server sees
/// one write a second from each replica and the log says so each time, not a tight loop.
const REPAIR_GAP: std::time::Duration = std::time::Duration::from_secs(1);

impl Guard {
    /// `namespace/name`, for the log.
    fn config_map(&self) -> String {
        format!("{}/{}", self.namespace, self.name)
    }

    /// The CA certificate the ConfigMap must hold, as its source says now.
    async fn cert(&self) -> anyhow::Result<String> {
        let namespace = &self.namespace;
        match &self.source {
            Source::Secret(name) => {
                let secret = self.secrets.get(name).await.with_context(|| {
                    format!("cannot read Secret {namespace}/{name} (csr.ca_secret)")
                })?;
                let (cert, _) = held(&secret, namespace, name)?.with_context(|| {
                    format!("Secret {namespace}/{name} (csr.ca_secret) holds no CA")
                })?;
                Ok(cert)
            }
            Source::File(path) => std::fs::read_to_string(path)
                .with_context(|| format!("{}: cannot read the CA", path.display())),
        }
    }

    /// Watches the ConfigMap (by name: deploy/'s RBAC grants no other) until `shutdown`.
    pub(crate) async fn run(self, shutdown: CancellationToken) {
        let config = watcher::Config::default().fields(&format!("metadata.name={}", self.name));
        let stream = watcher::watcher(self.maps.clone(), config).default_backoff();
        futures::pin_mut!(stream);
        let mut failing = false;
        loop {
            let event = tokio::select! {
                e = stream.next() => e,
                () = shutdown.cancelled() => return,
            };
            match event {
                None => return,
                Some(Ok(Event::Apply(map) | Event::InitApply(map))) => {
                    failing = false;
                    if self.check(&map).await {
                        tokio::select! {
                            () = tokio::time::sleep(REPAIR_GAP) => {}
                            () = shutdown.cancelled() => return,
                        }
                    }
                }
                Some(Ok(Event::Delete(_))) => warn!(
                    config_map = %self.config_map(),
                    "the ConfigMap of the CA the edges trust was deleted; the cloud may not create it (deploy/'s RBAC): apply deploy/ again and the cloud fills it"
                ),
                Some(Ok(Event::Init | Event::InitDone)) => failing = false,
                Some(Err(e)) if !failing => {
                    warn!(config_map = %self.config_map(), error = %e, "watch failed; retrying with backoff");
                    failing = true;
                }
                Some(Err(e)) => {
                    tracing::debug!(config_map = %self.config_map(), error = %e, "watch still failing")
                }
            }
        }
    }

    /// Puts the CA back in `map` when it holds anything else; says whether it wrote.
    async fn check(&self, map: &ConfigMap) -> bool {
        let cert = match self.cert().await {
            Ok(cert) => cert,
            Err(e) => {
                warn!(config_map = %self.config_map(), error = %format!("{e:#}"), "cannot read the CA to check the ConfigMap against");
                return false;
            }
        };
        let Some(change) = change(map, &cert) else {
            return false;
        };
        let by = writers(map).join(", ");
        warn!(config_map = %self.config_map(), %change, by, "the CA certificate the edges trust was changed behind the cloud: putting the tunnel CA back");
        let mut fixed = map.clone();
        fixed.data = Some(BTreeMap::from([(CERT_KEY.to_string(), cert)]));
        fixed.binary_data = None;
        // With the resourceVersion read: a newer change is refused (409) and comes as
        // the next event, to be checked in turn.
        match self.maps.replace(&self.name, &ours(), &fixed).await {
            Ok(_) => info!(config_map = %self.config_map(), "put the tunnel CA back"),
            Err(e) => {
                warn!(config_map = %self.config_map(), error = %e, "cannot put the tunnel CA back")
            }
        }
        true
    }
}

/// The name the cloud's writes to the ConfigMap go under (`metadata.managedFields`), so
/// that other writers can be told apart.
const FIELD_MANAGER: &str = "tunnel-cloud";

fn ours() -> PostParams {
    PostParams {
        field_manager: Some(FIELD_MANAGER.into()),
        ..PostParams::default()
    }
}

/// The clients other than the cloud that own data of `map`, as the API server records
/// them (the field manager: `kubectl-edit`, `kubectl-replace`, a controller's name;
/// the user who ran it is in the audit log).
fn writers(map: &ConfigMap) -> Vec<String> {
    map.metadata
        .managed_fields
        .iter()
        .flatten()
        .filter(|f| f.manager.as_deref() != Some(FIELD_MANAGER))
        .filter(|f| {
            f.fields_v1.as_ref().is_some_and(|fields| {
                fields.0.get("f:data").is_some() || fields.0.get("f:binaryData").is_some()
            })
        })
        .filter_map(|f| f.manager.clone())
        .collect()
}

/// What `map` holds beyond (or instead of) `cert` alone under `ca.crt`, or None when it
/// holds just that.
fn change(map: &ConfigMap, cert: &str) -> Option<String> {
    let mut changes = Vec::new();
    let data = map.data.clone().unwrap_or_default();
    match data.get(CERT_KEY) {
        None => changes.push(format!("{CERT_KEY} removed")),
        Some(found) if found != cert => {
            let certificates = found.matches("-----BEGIN CERTIFICATE-----").count();
            let ours = match found.contains(cert.trim()) {
                true => "the tunnel CA among them",
                false => "the tunnel CA not among them",
            };
            changes.push(format!(
                "{CERT_KEY} holds {certificates} certificate(s), {ours}"
            ));
        }
        Some(_) => {}
    }
    let others: Vec<&str> = data
        .keys()
        .filter(|k| *k != CERT_KEY)
        .chain(map.binary_data.iter().flat_map(|b| b.keys()))
        .map(String::as_str)
        .collect();
    if !others.is_empty() {
        changes.push(format!("keys added: {}", others.join(", ")));
    }
    (!changes.is_empty()).then(|| changes.join("; "))
}

/// The CA certificate and key (PEM) the Secret holds, after filling it with a new CA
/// if it held none.
async fn from_secret(
    secrets: &Api<Secret>,
    namespace: &str,
    name: &str,
) -> anyhow::Result<(String, String)> {
    for _ in 0..ATTEMPTS {
        let mut secret = secrets.get(name).await.with_context(|| {
            format!("Secret {namespace}/{name} (csr.ca_secret): cannot read it; deploy/ ships it empty for the cloud to fill")
        })?;
        if let Some(ca) = held(&secret, namespace, name)? {
            info!(secret = %format!("{namespace}/{name}"), "using the tunnel CA the Secret holds");
            return Ok(ca);
        }
        let (cert, key) = crate::certs::new_ca_pem().context("cannot make a CA")?;
        let data = secret.data.get_or_insert_with(BTreeMap::new);
        data.insert(CERT_KEY.into(), ByteString(cert.clone().into_bytes()));
        data.insert(KEY_KEY.into(), ByteString(key.clone().into_bytes()));
        // The resourceVersion read above goes with the write: if another replica filled
        // the Secret meanwhile, the API server refuses this one (409).
        match secrets.replace(name, &PostParams::default(), &secret).await {
            Ok(_) => {
                info!(secret = %format!("{namespace}/{name}"), "the Secret was empty: made a new tunnel CA and stored it there");
                return Ok((cert, key));
            }
            Err(kube::Error::Api(e)) if e.code == 409 => {
                info!(secret = %format!("{namespace}/{name}"), "another replica stored a CA first; reading it");
            }
            Err(e) => {
                return Err(e).with_context(|| {
                    format!("Secret {namespace}/{name} (csr.ca_secret): cannot store the new CA")
                });
            }
        }
    }
    anyhow::bail!(
        "Secret {namespace}/{name} (csr.ca_secret): changed under every one of {ATTEMPTS} writes"
    )
}

/// The CA in the Secret: both keys, or neither (an empty Secret, to fill). One without
/// the other is the operator's mistake, and is not overwritten.
fn held(secret: &Secret, namespace: &str, name: &str) -> anyhow::Result<Option<(String, String)>> {
    let value = |key: &str| {
        let bytes = secret.data.as_ref()?.get(key)?;
        (!bytes.0.is_empty()).then_some(bytes)
    };
    let text = |key: &str, bytes: &ByteString| {
        String::from_utf8(bytes.0.clone())
            .map_err(|_| anyhow::anyhow!("Secret {namespace}/{name}: {key} is not PEM text"))
    };
    match (value(CERT_KEY), value(KEY_KEY)) {
        (None, None) => Ok(None),
        (Some(cert), Some(key)) => Ok(Some((text(CERT_KEY, cert)?, text(KEY_KEY, key)?))),
        (Some(_), None) => anyhow::bail!(
            "Secret {namespace}/{name} holds {CERT_KEY} without {KEY_KEY}: bring both (your own CA) or neither (the cloud makes one)"
        ),
        (None, Some(_)) => anyhow::bail!(
            "Secret {namespace}/{name} holds {KEY_KEY} without {CERT_KEY}: bring both (your own CA) or neither (the cloud makes one)"
        ),
    }
}

/// Puts `cert` in the ConfigMap under `ca.crt`, unless it is there already.
async fn publish(
    maps: &Api<ConfigMap>,
    namespace: &str,
    name: &str,
    cert: &str,
) -> anyhow::Result<()> {
    for _ in 0..ATTEMPTS {
        let mut map = maps.get(name).await.with_context(|| {
            format!("ConfigMap {namespace}/{name} (csr.ca_config_map): cannot read it; deploy/ ships it empty for the cloud to fill")
        })?;
        let data = map.data.get_or_insert_with(BTreeMap::new);
        if data.get(CERT_KEY).map(String::as_str) == Some(cert) {
            info!(config_map = %format!("{namespace}/{name}"), "the CA certificate the edges trust is published");
            return Ok(());
        }
        data.insert(CERT_KEY.into(), cert.to_string());
        match maps.replace(name, &ours(), &map).await {
            Ok(_) => {
                info!(config_map = %format!("{namespace}/{name}"), "published the CA certificate for the edges");
                return Ok(());
            }
            // Another replica published (the same CA, from the same Secret): read again.
            Err(kube::Error::Api(e)) if e.code == 409 => {}
            Err(e) => {
                return Err(e).with_context(|| {
                    format!("ConfigMap {namespace}/{name} (csr.ca_config_map): cannot publish the CA certificate")
                });
            }
        }
    }
    anyhow::bail!(
        "ConfigMap {namespace}/{name} (csr.ca_config_map): changed under every one of {ATTEMPTS} writes"
    )
}

fn write(path: &Path, contents: &[u8], secret: bool) -> anyhow::Result<()> {
    crate::certs::write_file(path, contents, secret).with_context(|| {
        format!(
            "cannot write the CA from csr.ca_secret to {}",
            path.display()
        )
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn secret(keys: &[(&str, &str)]) -> Secret {
        Secret {
            data: Some(
                keys.iter()
                    .map(|(k, v)| (k.to_string(), ByteString(v.as_bytes().to_vec())))
                    .collect(),
            ),
            ..Default::default()
        }
    }

    #[test]
    fn a_secret_holds_both_keys_or_neither() {
        assert_eq!(held(&Secret::default(), "ns", "s").expect("empty"), None);
        assert_eq!(
            held(&secret(&[("ca.crt", ""), ("other", "x")]), "ns", "s").expect("blank"),
            None,
            "an empty value counts as absent"
        );
        assert_eq!(
            held(&secret(&[("ca.crt", "C"), ("ca.key", "K")]), "ns", "s").expect("both"),
            Some(("C".to_string(), "K".to_string()))
        );
        let e = held(&secret(&[("ca.crt", "C")]), "ns", "s").expect_err("half");
        assert!(
            e.to_string()
                .contains("Secret ns/s holds ca.crt without ca.key"),
            "{e}"
        );
        let e = held(&secret(&[("ca.key", "K")]), "ns", "s").expect_err("half");
        assert!(e.to_string().contains("ca.key without ca.crt"), "{e}");
    }

    #[test]
    fn a_config_map_holding_more_or_less_than_the_ca_is_a_change_named() {
        let ca = "-----BEGIN CERTIFICATE-----\nOURS\n-----END CERTIFICATE-----\n";
        let theirs = "-----BEGIN CERTIFICATE-----\nTHEIRS\n-----END CERTIFICATE-----\n";
        let map = |data: &[(&str, String)]| ConfigMap {
            data: Some(
                data.iter()
                    .map(|(k, v)| (k.to_string(), v.clone()))
                    .collect(),
            ),
            ..Default::default()
        };
        assert_eq!(change(&map(&[("ca.crt", ca.into())]), ca), None);
        assert_eq!(
            change(&map(&[("ca.crt", format!("{ca}{theirs}"))]), ca).as_deref(),
            Some("ca.crt holds 2 certificate(s), the tunnel CA among them")
        );
        assert_eq!(
            change(
                &map(&[("ca.crt", theirs.into()), ("extra", "x".into())]),
                ca
            )
            .as_deref(),
            Some("ca.crt holds 1 certificate(s), the tunnel CA not among them; keys added: extra")
        );
        assert_eq!(
            change(&ConfigMap::default(), ca).as_deref(),
            Some("ca.crt removed")
        );
        let binary = ConfigMap {
            binary_data: Some(BTreeMap::from([("blob".to_string(), ByteString(vec![1]))])),
            ..map(&[("ca.crt", ca.into())])
        };
        assert_eq!(change(&binary, ca).as_deref(), Some("keys added: blob"));
    }

    #[test]
    fn the_writers_named_are_the_other_clients_that_own_data() {
        let map: ConfigMap = serde_json::from_value(serde_json::json!({
            "metadata": {"managedFields": [
                {"manager": "kubectl-client-side-apply", "operation": "Update",
                 "fieldsType": "FieldsV1", "fieldsV1": {"f:metadata": {"f:annotations": {}}}},
                {"manager": FIELD_MANAGER, "operation": "Update",
                 "fieldsType": "FieldsV1", "fieldsV1": {"f:data": {"f:ca.crt": {}}}},
                {"manager": "kubectl-edit", "operation": "Update",
                 "fieldsType": "FieldsV1", "fieldsV1": {"f:data": {"f:extra": {}}}},
            ]}
        }))
        .expect("ConfigMap");
        assert_eq!(writers(&map), ["kubectl-edit"]);
    }
}
