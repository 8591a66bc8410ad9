//! The core tunnel end to end on loopback with real TLS, driven by real clients: the
//! cloud and its edges in the test's runtime ([`common::inproc`]), or as `tunnel cloud`
//! and `tunnel edge` processes where the process is what is tested (killed, its exit
//! code, a throughput of its own threads) or its wait is a real one.
//!
//! One test binary (one link) with a module per subject: bytes through the tunnel,
//! which edges register and where clients of absent nodes go, the cloud's other entries
//! (forwards, the https module, the unix socket, early bytes), and the process itself.

#![expect(
    clippy::unwrap_used,
    reason = "a panic with its message is how a test reports failure"
)]
#[path = "../common/mod.rs"]
mod common;

mod capacity;
mod data;
mod edges;
mod entries;
mod process;

use std::io::{BufRead, BufReader, Read, Write};
use std::net::{Shutdown, SocketAddr, TcpStream};
use std::process::Command;
use std::time::{Duration, Instant};

use common::config::allow;
use common::inproc::{self, InProcess, Side};
use common::servers::{self, hash_reader, send_pattern};
use common::{EdgeOpts, Proc, Setup, connect_via};
use toml::Table;

const TOKENS: &str = "edge-1:token-one\nedge-2:token-two\n";

fn edge_opts<'a>(node: &'a str, token: &'a str, targets: &[SocketAddr]) -> EdgeOpts<'a> {
    EdgeOpts {
        extra: allow(targets),
        ..EdgeOpts::new(node, token)
    }
}

fn sha2_of(data: &[u8]) -> Vec<u8> {
    use sha2::Digest;
    sha2::Sha256::digest(data).to_vec()
}
