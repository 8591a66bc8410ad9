//! Configuration files: the native TOML formats of `tunnel cloud` and `tunnel edge`, and
//! SuperEdge's `tunnel_cloud.toml` / `tunnel_edge.toml`, both resolved into the same
//! validated structs. Parsing is strict: an unknown key is an error that names the file
//! and the key (SuperEdge keys that mean nothing here are warnings instead).

mod cloud;
mod edge;
mod load;
mod selector;
mod summary;
mod superedge;
pub mod token_file;

pub use cloud::*;
pub use edge::*;
pub(crate) use selector::edge_selector;

use std::path::{Path, PathBuf};
use std::time::Duration;

/// A config file of either kind.
#[derive(Debug)]
pub enum AnyConfig {
    Cloud(Box<CloudConfig>),
    Edge(Box<EdgeConfig>),
}

/// Loads a config file whose kind is not known in advance (`tunnel check`): a cloud
/// config has `[tunnel]` (SuperEdge: `[mode.cloud]`), an edge config `[cloud]`
/// (SuperEdge: `[mode.edge]`).
pub fn load_any(file: &Path, env_node_name: Option<String>) -> Result<AnyConfig, ConfigError> {
    parse_any(file, &read(file)?, env_node_name)
}

/// [`load_any`] of `text`, the contents of `file`.
pub fn parse_any(
    file: &Path,
    text: &str,
    env_node_name: Option<String>,
) -> Result<AnyConfig, ConfigError> {
    let table: toml::Table = parse_toml(file, text)?;
    let mode = table.get("mode").and_then(|m| m.as_table());
    let is_cloud = table.contains_key("tunnel") || mode.is_some_and(|m| m.contains_key("cloud"));
    let is_edge = table.contains_key("cloud") || mode.is_some_and(|m| m.contains_key("edge"));
    match (is_cloud, is_edge) {
        (true, false) => Ok(AnyConfig::Cloud(Box::new(CloudConfig::parse(file, text)?))),
        (false, true) => Ok(AnyConfig::Edge(Box::new(EdgeConfig::parse(file, text, env_node_name)?))),
        _ => Err(ConfigError::Parse {
            file: file.to_path_buf(),
            message: "cannot tell whether this is a cloud config ([tunnel] or [mode.cloud]) or an edge config ([cloud] or [mode.edge])".into(),
        }),
    }
}

/// A configuration problem, always naming the file and the key.
#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    #[error("{file}: cannot read: {source}")]
    Read {
        file: PathBuf,
        source: std::io::Error,
    },
    #[error("{file}: {message}")]
    Parse { file: PathBuf, message: String },
    #[error("{file}: `{key}`: {problem}")]
    Invalid {
        file: PathBuf,
        key: String,
        problem: String,
    },
}

/// Collects the problems of one file, so one run reports all of them.
pub(crate) struct Validator<'a> {
    file: &'a Path,
    problems: Vec<ConfigError>,
}

impl<'a> Validator<'a> {
    pub(crate) fn new(file: &'a Path) -> Self {
        Self {
            file,
            problems: Vec::new(),
        }
    }

    pub(crate) fn problem(&mut self, key: impl Into<String>, problem: impl Into<String>) {
        self.problems.push(ConfigError::Invalid {
            file: self.file.to_path_buf(),
            key: key.into(),
            problem: problem.into(),
        });
    }

    /// Fails with the first problem when there are any; the others are logged first so
    /// the operator sees them all in one run.
    pub(crate) fn finish(self) -> Result<(), ConfigError> {
        let mut problems = self.problems.into_iter();
        match problems.next() {
            None => Ok(()),
            Some(first) => {
                for other in problems {
                    tracing::error!("{other}");
                }
                Err(first)
            }
        }
    }
}

pub(crate) fn read(file: &Path) -> Result<String, ConfigError> {
    std::fs::read_to_string(file).map_err(|source| ConfigError::Read {
        file: file.to_path_buf(),
        source,
    })
}

pub(crate) fn parse_toml<T: serde::de::DeserializeOwned>(
    file: &Path,
    text: &str,
) -> Result<T, ConfigError> {
    toml::from_str(text).map_err(|e| ConfigError::Parse {
        file: file.to_path_buf(),
        message: e.to_string().trim_end().to_string(),
    })
}

/// Relative paths in a config file are relative to the file's directory, so a config
/// works from any working directory.
pub(crate) fn resolve_path(file: &Path, path: &Path) -> PathBuf {
    if path.is_absolute() {
        return path.to_path_buf();
    }
    match file.parent() {
        Some(dir) => dir.join(path),
        None => path.to_path_buf(),
    }
}

/// A client certificate from the cluster by CertificateSigningRequest (`crate::csr`):
/// the edge's `[csr]` and the relay's `[relay.csr]`. A key made here, a CSR filed with
/// the Kubernetes credentials the process runs with (in-cluster: its pod's service
/// account token; or KUBECONFIG), the certificate the cloud's signer issues, renewed at
/// about three quarters of its lifetime.
#[derive(Debug, Clone, serde::Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct ClientCsrConfig {
    pub enabled: bool,
    /// Where the key and certificate are kept (mode 0600), so that a restart reuses a
    /// certificate that is still valid. Absent: the process's own default
    /// (`EdgeConfig::CSR_DIR`, `CloudConfig::RELAY_CSR_DIR`).
    pub dir: Option<PathBuf>,
    /// The signer name the cloud signs for (its `csr.signer_name`).
    pub signer_name: String,
    /// The lifetime asked for (expirationSeconds); the cloud may cap it shorter.
    #[serde(with = "humantime_serde")]
    pub(crate) lifetime: Duration,
}

impl Default for ClientCsrConfig {
    fn default() -> Self {
        Self {
            enabled: false,
            dir: None,
            signer_name: DEFAULT_SIGNER_NAME.into(),
            lifetime: Duration::from_secs(3600),
        }
    }
}

/// The shortest expirationSeconds the API server accepts.
pub(crate) const CSR_MIN_LIFETIME: Duration = Duration::from_secs(600);

impl ClientCsrConfig {
    /// The keys of the table `table` (`csr`, `relay.csr`), when enabled.
    pub(crate) fn validate(&self, table: &str, v: &mut Validator<'_>) {
        if let Err(p) = check_signer_name(&self.signer_name) {
            v.problem(format!("{table}.signer_name"), p);
        }
        if self.lifetime < CSR_MIN_LIFETIME {
            v.problem(
                format!("{table}.lifetime"),
                "must be at least 10m (the API server's minimum expirationSeconds); the cloud's csr.max_lifetime may cap it shorter",
            );
        }
        if self.dir.as_ref().is_some_and(|d| d.as_os_str().is_empty()) {
            v.problem(format!("{table}.dir"), "must not be empty");
        }
    }
}

/// Settings for the async runtime.
#[derive(Debug, Clone, serde::Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct RuntimeConfig {
    /// Tokio worker threads: 1 (the default) a single-threaded runtime, 0 one per core, N
    /// that many. One thread measured best (docs/design.md, performance knob 6): every
    /// hop of a proxied byte wakes a task, and on one thread that is a function call,
    /// while across worker threads it is a futex wake and a migration.
    pub worker_threads: usize,
}

impl Default for RuntimeConfig {
    fn default() -> Self {
        Self { worker_threads: 1 }
    }
}

/// HTTP/2 tuning shared by both ends of the tunnel connection. The defaults are the values
/// that measured best here (docs/design.md, performance knobs): larger windows gained nothing.
#[derive(Debug, Clone, serde::Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct TransportConfig {
    /// Flow-control window of one proxied connection: the most bytes buffered for a
    /// client that does not read.
    pub(crate) stream_window: u32,
    /// Largest HTTP/2 frame we accept.
    pub(crate) max_frame_size: u32,
    /// Bytes read from a socket at once; also what HTTP/2 holds unsent per proxied
    /// connection (`io::transport::send_buffer`).
    pub(crate) chunk_size: usize,
    /// Control-stream heartbeat period.
    #[serde(with = "humantime_serde")]
    pub(crate) heartbeat_interval: Duration,
    /// A session with no heartbeat answer for this long is dead.
    #[serde(with = "humantime_serde")]
    pub(crate) heartbeat_timeout: Duration,
    /// Bound on the TLS handshake plus the Hello exchange.
    #[serde(with = "humantime_serde")]
    pub(crate) handshake_timeout: Duration,
    /// Bound on the edge's dial of a target.
    #[serde(with = "humantime_serde")]
    pub(crate) dial_timeout: Duration,
    /// Concurrent proxied connections per edge.
    pub(crate) max_streams_per_edge: u32,
    /// The part of an edge's `max_streams_per_edge` one client may hold through a
    /// replica's entries (`cloud::conn::shares`).
    pub(crate) client_share: f64,
    /// The HTTP/2 connection window the cloud grants an edge's connection: the most
    /// bytes of the edge's answers the cloud holds for clients that do not read.
    pub(crate) max_buffered_per_edge: u32,
    /// Connections each listener (an entry, the edges', the peers', admin) has open at
    /// once; beyond it new ones wait in the kernel's accept queue (`io::accept`).
    pub(crate) max_connections_per_listener: usize,
}

impl Default for TransportConfig {
    fn default() -> Self {
        Self {
            stream_window: 4 << 20,
            max_frame_size: 1 << 20,
            chunk_size: 256 << 10,
            heartbeat_interval: Duration::from_secs(5),
            heartbeat_timeout: Duration::from_secs(15),
            handshake_timeout: Duration::from_secs(10),
            dial_timeout: Duration::from_secs(10),
            max_streams_per_edge: 16384,
            client_share: 0.25,
            // 16 stalled connections' windows: a few clients that do not read stall only
            // themselves, and a hostile edge answering into many holds 64 MiB at most.
            max_buffered_per_edge: 64 << 20,
            max_connections_per_listener: 65536,
        }
    }
}

impl TransportConfig {
    /// Bound on the TLS handshake plus the Hello exchange (the bench's simulated edges
    /// give up on a registration after it, as the edge does).
    pub fn handshake_timeout(&self) -> Duration {
        self.handshake_timeout
    }

    pub(crate) fn validate(&self, v: &mut Validator<'_>) {
        // HTTP/2 limits (RFC 9113 section 6.5.2).
        if !(65_535..=(1 << 31) - 1).contains(&self.stream_window) {
            v.problem(
                "transport.stream_window",
                "must be between 65535 and 2147483647 bytes",
            );
        }
        if !(16_384..=(1 << 24) - 1).contains(&self.max_frame_size) {
            v.problem(
                "transport.max_frame_size",
                "must be between 16384 and 16777215 bytes",
            );
        }
        if !(1024..=16 << 20).contains(&self.chunk_size) {
            v.problem("transport.chunk_size", "must be between 1 KiB and 16 MiB");
        }
        if self.heartbeat_interval.is_zero() {
            v.problem("transport.heartbeat_interval", "must be greater than zero");
        }
        if self.heartbeat_timeout <= self.heartbeat_interval {
            v.problem(
                "transport.heartbeat_timeout",
                "must be longer than transport.heartbeat_interval",
            );
        }
        if self.handshake_timeout.is_zero() {
            v.problem("transport.handshake_timeout", "must be greater than zero");
        }
        if self.dial_timeout.is_zero() {
            v.problem("transport.dial_timeout", "must be greater than zero");
        }
        if self.max_streams_per_edge == 0 {
            v.problem("transport.max_streams_per_edge", "must be at least 1");
        }
        if !(self.client_share > 0.0 && self.client_share <= 1.0) {
            v.problem(
                "transport.client_share",
                "must be a fraction above 0 and at most 1",
            );
        }
        if !(self.stream_window..=(1 << 31) - 1).contains(&self.max_buffered_per_edge) {
            v.problem(
                "transport.max_buffered_per_edge",
                "must be between transport.stream_window and 2147483647 bytes",
            );
        }
        if self.max_connections_per_listener == 0 {
            v.problem(
                "transport.max_connections_per_listener",
                "must be at least 1",
            );
        }
    }
}
