//! Loading a config file: which format it is in (native, or SuperEdge's), then
//! relative paths and validation. The format dispatch lives here so that the native
//! config types and the SuperEdge translator do not depend on each other: `superedge`
//! builds the native types, and nothing but this module calls it.

use std::path::Path;

use super::{CloudConfig, ConfigError, EdgeConfig, Identity, parse_toml, read, superedge};

/// Which format a file is in: SuperEdge's files all start with a `[mode]` table.
pub(crate) fn is_superedge(text: &str) -> bool {
    matches!(toml::from_str::<toml::Table>(text), Ok(t) if t.contains_key("mode"))
}

impl CloudConfig {
    /// Reads, parses (native or SuperEdge format) and validates a cloud config file.
    pub fn load(file: &Path) -> Result<Self, ConfigError> {
        Self::parse(file, &read(file)?)
    }

    /// Parses (native or SuperEdge format) and validates `text`, the contents of `file`:
    /// messages name `file` and relative paths are resolved against its directory.
    pub fn parse(file: &Path, text: &str) -> Result<Self, ConfigError> {
        let mut config = if is_superedge(text) {
            superedge::cloud_from_superedge(file, text)?
        } else {
            parse_toml::<CloudConfig>(file, text)?
        };
        config.resolve_paths(file);
        config.validate(file)?;
        Ok(config)
    }
}

impl EdgeConfig {
    /// Reads, parses (native or SuperEdge format) and validates an edge config file.
    /// `env_node_name` is `NODE_NAME` from the environment.
    pub fn load(file: &Path, env_node_name: Option<String>) -> Result<Self, ConfigError> {
        Self::parse(file, &read(file)?, env_node_name)
    }

    /// Parses (native or SuperEdge format) and validates `text`, the contents of `file`:
    /// messages name `file` and relative paths are resolved against its directory.
    pub fn parse(
        file: &Path,
        text: &str,
        env_node_name: Option<String>,
    ) -> Result<Self, ConfigError> {
        let mut config = if is_superedge(text) {
            superedge::edge_from_superedge(file, text)?
        } else {
            parse_toml::<EdgeConfig>(file, text)?
        };
        if config.node_name.is_none() && config.identity == Identity::Node {
            config.node_name = env_node_name.filter(|n| !n.is_empty());
        }
        config.resolve_paths(file);
        config.validate(file)?;
        Ok(config)
    }
}
