//! How many edges this replica holds at most (`tunnel.max_edges`). A replica past the
//! memory its pod may use is OOM-killed, its edges move to the others, and they pass
//! theirs in turn: a cascade. A replica at its cap refuses new edges instead
//! (REPLICA_FULL), and they register with another replica.
//!
//! Unset, the cap is derived from the cgroup's memory limit less the replica's own
//! needs, as docs/benchmarks.md sizes a replica: 5 MiB idle, 0.76 KiB per node of the
//! node table, and a tenth of the limit kept for handshakes and proxied calls in flight.
//! An edge is counted at 32 KiB: issue 46's bound per idle edge with the kernel's
//! socket memory, which the cgroup's limit counts and the process's RSS leaves out.

use std::path::Path;
use std::sync::Arc;

use crate::cloud::nodes::Nodes;

const IDLE_BYTES: u64 = 5 << 20;
const NODE_BYTES: u64 = 778;
const EDGE_BYTES: u64 = 32 << 10;
/// A replica at or past this share of its cap is near it (the metric, `/readyz`).
const NEAR: f64 = 0.9;

pub(crate) enum EdgeCap {
    /// `tunnel.max_edges`.
    Set(usize),
    /// Derived from the cgroup's memory limit, less the node table as it is now.
    Memory { limit: u64, nodes: Arc<Nodes> },
    /// No memory limit and none set.
    Unlimited,
}

impl EdgeCap {
    /// The configured cap, or one derived from this process's cgroup.
    pub(crate) fn new(max_edges: Option<usize>, nodes: Arc<Nodes>) -> Self {
        match max_edges {
            Some(max) => EdgeCap::Set(max),
            None => {
                match own_memory_max(Path::new("/proc/self/cgroup"), Path::new("/sys/fs/cgroup")) {
                    Some(limit) => EdgeCap::Memory { limit, nodes },
                    None => EdgeCap::Unlimited,
                }
            }
        }
    }

    /// The edges this replica may hold now; None without a cap.
    pub(crate) fn max_edges(&self) -> Option<usize> {
        match self {
            EdgeCap::Set(max) => Some(*max),
            EdgeCap::Memory { limit, nodes } => Some(from_memory(*limit, nodes.get().len())),
            EdgeCap::Unlimited => None,
        }
    }

    /// How full the replica is with `edges` edges, for the metric and `/readyz`.
    pub(crate) fn load(&self, edges: usize) -> Load {
        match self.max_edges() {
            Some(max) if edges >= max => Load::Full { edges, max },
            Some(max) if edges as f64 >= max as f64 * NEAR => Load::Near { edges, max },
            _ => Load::Room,
        }
    }

    /// Where the cap comes from, for the start line.
    pub(crate) fn describe(&self) -> String {
        match self {
            EdgeCap::Set(max) => format!("{max} (tunnel.max_edges)"),
            EdgeCap::Memory { limit, .. } => format!(
                "{} now (from memory.max {} MiB, less the node table)",
                self.max_edges().unwrap_or_default(),
                limit >> 20
            ),
            EdgeCap::Unlimited => "none (no memory.max, no tunnel.max_edges)".into(),
        }
    }
}

#[derive(Debug, PartialEq, Eq)]
pub(crate) enum Load {
    Room,
    Near { edges: usize, max: usize },
    Full { edges: usize, max: usize },
}

impl std::fmt::Display for Load {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Load::Room => f.write_str("ready"),
            Load::Near { edges, max } => {
                write!(
                    f,
                    "ready: near its edge cap, {edges} of {max} edges (tunnel.max_edges)"
                )
            }
            Load::Full { edges, max } => write!(
                f,
                "ready: full, {edges} of {max} edges (tunnel.max_edges): new edges are sent to other replicas"
            ),
        }
    }
}

/// The edges `limit` bytes hold beside the replica's own needs and `nodes` nodes.
fn from_memory(limit: u64, nodes: usize) -> usize {
    let own = IDLE_BYTES + NODE_BYTES * nodes as u64 + limit / 10;
    (limit.saturating_sub(own) / EDGE_BYTES).max(1) as usize
}

/// The tightest memory limit on the way from this process's cgroup (named in
/// `proc_cgroup`) up to the root under `root`; None where none is set. cgroup v1's
/// memory controller where it is mounted (a hybrid host), else v2's `memory.max`.
fn own_memory_max(proc_cgroup: &Path, root: &Path) -> Option<u64> {
    let text = std::fs::read_to_string(proc_cgroup).ok()?;
    let v1 = text.lines().find_map(|l| {
        let (_, rest) = l.split_once(':')?;
        let (controllers, path) = rest.split_once(':')?;
        controllers
            .split(',')
            .any(|c| c == "memory")
            .then_some(path)
    });
    let (root, own, file) = match v1 {
        Some(own) => (root.join("memory"), own, "memory.limit_in_bytes"),
        None => (
            root.to_path_buf(),
            text.lines().find_map(|l| l.strip_prefix("0::"))?,
            "memory.max",
        ),
    };
    let mut dir = root.join(own.trim_start_matches('/'));
    let mut tightest: Option<u64> = None;
    loop {
        // v2 writes "max" where there is no limit, v1 a number near 2^63; the root
        // cgroup has no v2 file.
        if let Some(limit) = std::fs::read_to_string(dir.join(file))
            .ok()
            .and_then(|s| s.trim().parse::<u64>().ok())
            .filter(|&l| l < 1 << 60)
        {
            tightest = Some(tightest.map_or(limit, |t| t.min(limit)));
        }
        if dir == root || !dir.pop() || !dir.starts_with(&root) {
            return tightest;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_cap_is_the_memory_left_over_per_edge() {
        // deploy/'s 512 MiB with 100,000 nodes.
        assert_eq!(from_memory(512 << 20, 100_000), 12_211);
        assert_eq!(from_memory(512 << 20, 0), 14_585);
        // A limit too small for the replica itself still takes one edge.
        assert_eq!(from_memory(4 << 20, 0), 1);
    }

    #[test]
    fn the_tightest_memory_max_up_the_tree_counts() {
        let dir = tempfile::tempdir().unwrap();
        let root = dir.path();
        let own = root.join("kubepods/pod1/cloud");
        std::fs::create_dir_all(&own).unwrap();
        std::fs::write(own.join("memory.max"), "max\n").unwrap();
        std::fs::write(root.join("kubepods/pod1/memory.max"), "536870912\n").unwrap();
        std::fs::write(root.join("kubepods/memory.max"), "1073741824\n").unwrap();
        let proc = root.join("cgroup");
        std::fs::write(&proc, "0::/kubepods/pod1/cloud\n").unwrap();
        assert_eq!(own_memory_max(&proc, root), Some(512 << 20));
        std::fs::write(&proc, "0::/\n").unwrap();
        assert_eq!(own_memory_max(&proc, root), None, "the root has no limit");

        // A hybrid host: the memory controller on cgroup v1.
        let own = root.join("memory/sandbox/job");
        std::fs::create_dir_all(&own).unwrap();
        std::fs::write(
            own.join("memory.limit_in_bytes"),
            "9223372036854771712
",
        )
        .unwrap();
        std::fs::write(
            root.join("memory/sandbox/memory.limit_in_bytes"),
            "268435456
",
        )
        .unwrap();
        std::fs::write(
            &proc,
            "4:memory:/sandbox/job
1:cpu:/
0::/
",
        )
        .unwrap();
        assert_eq!(own_memory_max(&proc, root), Some(256 << 20));
    }

    #[test]
    fn near_and_full_are_told_apart() {
        let cap = EdgeCap::Set(10);
        assert_eq!(cap.load(8), Load::Room);
        assert_eq!(cap.load(9), Load::Near { edges: 9, max: 10 });
        assert_eq!(cap.load(10), Load::Full { edges: 10, max: 10 });
        assert!(cap.load(10).to_string().contains("other replicas"));
    }
}
