//! Pre-start and post-start hooks (tke-anp-tunnel's PreStartTunnelAgent and
//! PostStartTunnelAgent): operator commands run at fixed points of the edge's life, e.g.
//! to report a credential to the hub or to prepare local state.
//!
//! Each hook is argv (no shell), runs with stdin closed and its output in the edge's
//! log stream, and gets these environment variables on top of the edge's own:
//!
//! | variable | value |
//! |---|---|
//! | `TUNNEL_HOOK` | `pre_start` or `post_start` |
//! | `TUNNEL_NODE_NAME` | the name the edge registers as (node or cluster name) |
//! | `TUNNEL_IDENTITY` | `node` or `cluster` |
//! | `TUNNEL_CLOUD_ADDRESS` | pre_start: the first cloud address; post_start: the one registered with |
//! | `TUNNEL_CLOUD_ID` | post_start: the cloud replica's name; pre_start: empty |
//! | `TUNNEL_SESSION_STATE` | `starting` (pre_start) or `registered` (post_start) |
//! | `TUNNEL_SESSION_COUNT` | sessions established so far, this one included (0 for pre_start) |

use std::process::Stdio;
use std::sync::Arc;
use std::time::Duration;

use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use tracing::{info, warn};

use crate::config::{EdgeConfig, HookFailure, HooksConfig, Identity};
use crate::ops::metrics::HookLabel;

/// Why a hook failed.
#[derive(Debug, thiserror::Error)]
pub(crate) enum HookError {
    #[error("{hook} hook `{program}` could not start: {source}")]
    Spawn {
        hook: &'static str,
        program: String,
        source: std::io::Error,
    },
    #[error("{hook} hook `{program}` failed: {status}")]
    Failed {
        hook: &'static str,
        program: String,
        status: std::process::ExitStatus,
    },
    #[error("{hook} hook `{program}` did not finish within {timeout:?} and was killed")]
    Timeout {
        hook: &'static str,
        program: String,
        timeout: Duration,
    },
    #[error("{hook} hook `{program}`: waiting for it failed: {source}")]
    Wait {
        hook: &'static str,
        program: String,
        source: std::io::Error,
    },
}

/// The edge's two hooks, with what they are told and where their failures are counted.
pub(crate) struct Hooks {
    config: HooksConfig,
    node: String,
    identity: Identity,
    /// The first cloud address, which `pre_start` is told.
    cloud_address: String,
    failures: Family<HookLabel, Counter>,
    /// Held while a post-start hook runs: at most one runs at a time, so a cloud that
    /// welcomes and drops the edge over and over cannot pile hook processes up.
    post_start_running: tokio::sync::Mutex<()>,
}

impl Hooks {
    pub(crate) fn new(config: &EdgeConfig, failures: Family<HookLabel, Counter>) -> Self {
        Self {
            config: config.hooks.clone(),
            node: config.node().to_string(),
            identity: config.identity,
            cloud_address: config.cloud.address.clone(),
            failures,
            post_start_running: tokio::sync::Mutex::new(()),
        }
    }

    /// Runs the pre-start hook; its failure stops the edge or is logged, as configured.
    pub(crate) async fn pre_start(&self) -> anyhow::Result<()> {
        let c = &self.config;
        let env = HookEnv {
            node: &self.node,
            identity: self.identity,
            cloud_address: &self.cloud_address,
            cloud_id: "",
            state: "starting",
            session_count: 0,
        };
        match run("pre_start", &c.pre_start, &env, c.timeout).await {
            Ok(()) => Ok(()),
            Err(e) => {
                self.failures
                    .get_or_create(&HookLabel { hook: "pre_start" })
                    .inc();
                match c.failure {
                    HookFailure::Abort => Err(anyhow::Error::new(e)
                        .context("pre_start hook failed (hooks.failure = \"abort\")")),
                    HookFailure::Warn => {
                        warn!(error = %e, "pre_start hook failed; starting anyway (hooks.failure = \"warn\")");
                        Ok(())
                    }
                }
            }
        }
    }

    /// Runs the post-start hook beside the session that just registered: the session
    /// must keep answering heartbeats meanwhile, and a failure is only logged. While an
    /// earlier registration's hook still runs, this one is skipped (and logged).
    pub(crate) async fn post_start(
        self: Arc<Self>,
        cloud_address: String,
        cloud_id: String,
        session_count: u64,
    ) {
        let c = &self.config;
        if c.post_start.is_empty() {
            return;
        }
        let Ok(_running) = self.post_start_running.try_lock() else {
            warn!(
                session_count,
                "post_start hook of an earlier registration still running; not starting another for this one"
            );
            return;
        };
        let env = HookEnv {
            node: &self.node,
            identity: self.identity,
            cloud_address: &cloud_address,
            cloud_id: &cloud_id,
            state: "registered",
            session_count,
        };
        if let Err(e) = run("post_start", &c.post_start, &env, c.timeout).await {
            self.failures
                .get_or_create(&HookLabel { hook: "post_start" })
                .inc();
            warn!(error = %e, "post_start hook failed");
        }
    }
}

/// What a hook is told about the edge.
pub(crate) struct HookEnv<'a> {
    pub(crate) node: &'a str,
    pub(crate) identity: Identity,
    pub(crate) cloud_address: &'a str,
    pub(crate) cloud_id: &'a str,
    pub(crate) state: &'static str,
    pub(crate) session_count: u64,
}

/// Runs `argv` (a no-op when empty) within `timeout`. An overrunning hook is killed by
/// its PID (SIGKILL through `Child::start_kill`) and reaped before this returns, so no
/// hook outlives its bound.
pub(crate) async fn run(
    hook: &'static str,
    argv: &[String],
    env: &HookEnv<'_>,
    timeout: Duration,
) -> Result<(), HookError> {
    let Some((program, args)) = argv.split_first() else {
        return Ok(());
    };
    let mut child = tokio::process::Command::new(program)
        .args(args)
        .env("TUNNEL_HOOK", hook)
        .env("TUNNEL_NODE_NAME", env.node)
        .env("TUNNEL_IDENTITY", env.identity.as_str())
        .env("TUNNEL_CLOUD_ADDRESS", env.cloud_address)
        .env("TUNNEL_CLOUD_ID", env.cloud_id)
        .env("TUNNEL_SESSION_STATE", env.state)
        .env("TUNNEL_SESSION_COUNT", env.session_count.to_string())
        .stdin(Stdio::null())
        // A dropped future (the edge shutting down mid-hook) must not leave it running.
        .kill_on_drop(true)
        .spawn()
        .map_err(|source| HookError::Spawn { hook, program: program.clone(), source })?;
    let pid = child.id();
    info!(hook, program = %program, pid, "running hook");
    match tokio::time::timeout(timeout, child.wait()).await {
        Ok(Ok(status)) if status.success() => {
            info!(hook, program = %program, pid, "hook succeeded");
            Ok(())
        }
        Ok(Ok(status)) => Err(HookError::Failed {
            hook,
            program: program.clone(),
            status,
        }),
        Ok(Err(source)) => Err(HookError::Wait {
            hook,
            program: program.clone(),
            source,
        }),
        Err(_) => {
            warn!(hook, program = %program, pid, "hook overran its timeout; killing it");
            let _ = child.start_kill();
            // Reap it so no zombie is left; SIGKILL cannot be ignored, so this is quick.
            let _ = child.wait().await;
            Err(HookError::Timeout {
                hook,
                program: program.clone(),
                timeout,
            })
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn env() -> HookEnv<'static> {
        HookEnv {
            node: "edge-1",
            identity: Identity::Node,
            cloud_address: "127.0.0.1:1",
            cloud_id: "",
            state: "starting",
            session_count: 0,
        }
    }

    fn argv(args: &[&str]) -> Vec<String> {
        args.iter().map(|s| s.to_string()).collect()
    }

    #[tokio::test]
    async fn hook_sees_its_environment() {
        let dir = tempfile::tempdir().expect("tempdir");
        let out = dir.path().join("env");
        let script = format!(
            "echo \"$TUNNEL_HOOK $TUNNEL_NODE_NAME $TUNNEL_SESSION_STATE $TUNNEL_SESSION_COUNT\" > {}",
            out.display()
        );
        run(
            "pre_start",
            &argv(&["sh", "-c", &script]),
            &env(),
            Duration::from_secs(10),
        )
        .await
        .expect("hook runs");
        let text = std::fs::read_to_string(&out).expect("hook wrote its env");
        assert_eq!(text.trim(), "pre_start edge-1 starting 0");
    }

    #[tokio::test]
    async fn failing_and_missing_hooks_are_errors() {
        let failed = run(
            "pre_start",
            &argv(&["sh", "-c", "exit 3"]),
            &env(),
            Duration::from_secs(10),
        )
        .await;
        assert!(
            matches!(failed, Err(HookError::Failed { .. })),
            "{failed:?}"
        );
        let missing = run(
            "pre_start",
            &argv(&["/nonexistent/hook"]),
            &env(),
            Duration::from_secs(10),
        )
        .await;
        assert!(
            matches!(missing, Err(HookError::Spawn { .. })),
            "{missing:?}"
        );
        assert!(
            run("pre_start", &[], &env(), Duration::from_secs(1))
                .await
                .is_ok()
        );
    }

    #[tokio::test]
    async fn overrunning_hook_is_killed_at_its_timeout() {
        let started = std::time::Instant::now();
        let r = run(
            "post_start",
            &argv(&["sleep", "30"]),
            &env(),
            Duration::from_millis(300),
        )
        .await;
        assert!(matches!(r, Err(HookError::Timeout { .. })), "{r:?}");
        assert!(
            started.elapsed() < Duration::from_secs(5),
            "took {:?}",
            started.elapsed()
        );
    }
}
