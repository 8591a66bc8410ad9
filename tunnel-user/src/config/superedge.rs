//! SuperEdge `tunnel_cloud.toml` / `tunnel_edge.toml` compatibility.

use std::path::Path;

use super::{CloudConfig, ConfigError, EdgeConfig};

pub(crate) fn cloud_from_superedge(file: &Path, _text: &str) -> Result<CloudConfig, ConfigError> {
    Err(ConfigError::Parse { file: file.to_path_buf(), message: "SuperEdge format: not yet supported".into() })
}

pub(crate) fn edge_from_superedge(file: &Path, _text: &str) -> Result<EdgeConfig, ConfigError> {
    Err(ConfigError::Parse { file: file.to_path_buf(), message: "SuperEdge format: not yet supported".into() })
}
