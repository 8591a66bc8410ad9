//! Configs as data: tables merged key by key, so a key lands in the table it names
//! (text appended to a config would continue whatever table came last).

use std::net::SocketAddr;
use std::path::Path;

use toml::Table;

/// Merges `extra` into `config`: a table key by key (so `[transport]` in `extra` adds to
/// the config's `[transport]`), any other value replaced.
pub fn merge(config: &mut Table, extra: Table) {
    for (key, value) in extra {
        match (config.get_mut(&key), value) {
            (Some(toml::Value::Table(base)), toml::Value::Table(more)) => merge(base, more),
            (_, value) => {
                config.insert(key, value);
            }
        }
    }
}

/// An edge's `[allow]` table with `targets`.
pub fn allow(targets: &[SocketAddr]) -> Table {
    let targets: Vec<String> = targets.iter().map(ToString::to_string).collect();
    toml::toml! { [allow] targets = targets }
}

/// A cloud's node table with `node`, and a `[[forward]]` through it to each of `targets`
/// (`forward[<i>].listen` in the ready file, in this order).
pub fn forwards(node: &str, targets: &[SocketAddr]) -> Table {
    let forward: Vec<Table> = targets
        .iter()
        .map(|target| {
            toml::toml! {
                listen = "127.0.0.1:0"
                node = node
                target = (target.to_string())
            }
        })
        .collect();
    toml::toml! {
        forward = forward

        [[node]]
        name = node
    }
}

/// A cloud with node `edge-1` and an `[[https]]` entry (`https[0].listen` in the ready
/// file) that terminates TLS with `front.crt`, lets in clients with a certificate of the
/// setup's CA (`ca.crt`), and sends each connection to `target` on the node named by the
/// request.
pub fn https_front(target: &str) -> Table {
    toml::toml! {
        [[node]]
        name = "edge-1"

        [[https]]
        listen = "127.0.0.1:0"
        cert = "front.crt"
        key = "front.key"
        client_ca = "ca.crt"
        target = target
    }
}

/// Writes `config` as TOML to `path`.
pub fn write_toml(path: &Path, config: &Table) {
    let text = toml::to_string(config).expect("a config serialises");
    std::fs::write(path, text).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
}

/// `path` as a config value (test paths are UTF-8).
pub fn path_str(path: &Path) -> String {
    path.to_str().expect("utf-8 path").to_owned()
}
