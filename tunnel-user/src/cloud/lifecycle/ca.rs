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
//! It also ships empty, for the same reason.

use std::collections::BTreeMap;
use std::path::Path;

use anyhow::Context as _;
use k8s_openapi::ByteString;
use k8s_openapi::api::core::v1::{ConfigMap, Secret};
use kube::Api;
use kube::api::PostParams;
use tracing::info;

use crate::config::CloudConfig;

/// The keys of the CA in the Secret, as `tunnel certs` names its files.
const CERT_KEY: &str = "ca.crt";
const KEY_KEY: &str = "ca.key";

/// Writes lost to another replica, at most: each loss means the other replica's write
/// is there to read, so a second attempt normally settles it.
const ATTEMPTS: usize = 5;

/// The CA from the Secret (made there if empty) written to the config's files, and its
/// certificate published in the ConfigMap, as the config asks. Before anything loads
/// the CA files.
pub(crate) async fn bootstrap(config: &CloudConfig, client: &kube::Client) -> anyhow::Result<()> {
    let c = &config.csr;
    let namespace = config.kubernetes.own_namespace(client.default_namespace());
    let ca_cert = config.tunnel.client_ca.as_deref();
    if let Some(name) = &c.ca_secret {
        let (cert_path, key_path) = ca_cert
            .zip(c.ca_key.as_deref())
            .context("csr.ca_secret needs tunnel.client_ca and csr.ca_key")?;
        let secrets: Api<Secret> = Api::namespaced(client.clone(), &namespace);
        let (cert, key) = from_secret(&secrets, &namespace, name).await?;
        write(cert_path, cert.as_bytes(), false)?;
        write(key_path, key.as_bytes(), true)?;
    }
    if let Some(name) = &c.ca_config_map {
        let path = ca_cert.context("csr.ca_config_map needs tunnel.client_ca")?;
        let cert = std::fs::read_to_string(path)
            .with_context(|| format!("{}: cannot read the CA to publish", path.display()))?;
        let maps: Api<ConfigMap> = Api::namespaced(client.clone(), &namespace);
        publish(&maps, &namespace, name, &cert).await?;
    }
    Ok(())
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
        match maps.replace(name, &PostParams::default(), &map).await {
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
}
