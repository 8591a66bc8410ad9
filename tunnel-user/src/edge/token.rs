//! The token the edge's Hello and its `Reauth` messages carry: `cloud.token`, or the
//! current content of `cloud.token_file`. The kubelet rotates a projected service account
//! token in that file, so it is read again for every registration (`connect`) and every
//! reauth interval of a session (`session`).

use anyhow::Context;

use crate::config::CloudClientConfig;

/// `cloud.token`, or the current content of `cloud.token_file`, or none.
pub(crate) fn load(cloud: &CloudClientConfig) -> anyhow::Result<String> {
    match (&cloud.token, &cloud.token_file) {
        (Some(t), _) => Ok(t.clone()),
        (None, Some(path)) => Ok(std::fs::read_to_string(path)
            .with_context(|| format!("cannot read cloud.token_file {}", path.display()))?
            .trim()
            .to_string()),
        (None, None) => Ok(String::new()),
    }
}
