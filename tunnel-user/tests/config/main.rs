//! Config files as an operator meets them: every shipped example loads, and each kind
//! of mistake is reported with the file, the key and the problem.
//!
//! One test binary (one link) with a module per subject: the shipped examples, mistakes
//! any config can make, the cloud's and the edge's own checks, and SuperEdge configs.

#[path = "../common/mod.rs"]
mod common;

mod cloud;
mod edge;
mod examples;
mod mistakes;
mod superedge;

use std::io;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};

use toml::Table;
use tunnel_user::config::{CloudConfig, EdgeConfig, OptimisticOk};

/// Writes `text` to `dir/name`; returns the path.
fn write(dir: &Path, name: &str, text: &str) -> PathBuf {
    let path = dir.join(name);
    std::fs::write(&path, text).expect("write config");
    path
}

/// `base` (a config's text) with `change` merged in, table by table: each key lands in
/// the table it names.
fn with(base: &str, change: Table) -> String {
    let mut config: Table = toml::from_str(base).expect("the base config parses");
    common::config::merge(&mut config, change);
    toml::to_string(&config).expect("a config serialises")
}

fn examples() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../examples")
}

const CLOUD: &str = r#"
[tunnel]
listen = "0.0.0.0:9000"
cert = "certs/cloud.crt"
key = "certs/cloud.key"
token_file = "certs/tokens"

[[node]]
name = "edge-1"
addresses = ["127.1.0.5"]

[[forward]]
listen = "127.0.0.1:16443"
node = "edge-1"
target = "127.0.0.1:6443"
"#;

const EDGE: &str = r#"
[cloud]
address = "127.0.0.1:9000"
server_name = "tunnel-cloud"
ca = "certs/ca.crt"
token = "secret"
"#;

/// Loads `text` as a cloud config named `name`; the error, checked to name the file.
fn cloud_error(name: &str, text: &str) -> String {
    let tmp = tempfile::tempdir().expect("tempdir");
    let path = write(tmp.path(), name, text);
    let e = CloudConfig::load(&path)
        .expect_err("the config is broken")
        .to_string();
    assert!(
        e.contains(&path.display().to_string()),
        "names the file: {e}"
    );
    e
}

fn edge_error(name: &str, text: &str, node: Option<&str>) -> String {
    let tmp = tempfile::tempdir().expect("tempdir");
    let path = write(tmp.path(), name, text);
    let e = EdgeConfig::load(&path, node.map(str::to_string))
        .expect_err("the config is broken")
        .to_string();
    assert!(
        e.contains(&path.display().to_string()),
        "names the file: {e}"
    );
    e
}

fn assert_mentions(e: &str, parts: &[&str]) {
    for part in parts {
        assert!(e.contains(part), "expected {part:?} in:\n{e}");
    }
}
