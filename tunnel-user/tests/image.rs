//! The container image `cargo xtask image` builds (`tunnel:<crate version>`): it runs,
//! reports this version, and accepts the configs deploy/ ships, with no network. Run
//! by podman; skipped loudly when there is no image or no runtime that can run here.

mod common;

use std::path::Path;
use std::process::Command;

const VERSION: &str = env!("CARGO_PKG_VERSION");

/// Flags every run uses: no network; the OCI runtime runc with rlimits no higher than
/// ours, because a sandboxed host (this one's) may refuse crun's hybrid-cgroup setup
/// and raising rlimits.
fn podman_run() -> Command {
    let mut cmd = Command::new("podman");
    cmd.args(["--runtime", "runc", "run", "--rm", "--network", "none"])
        .args([
            "--ulimit",
            "nofile=1024:1024",
            "--ulimit",
            "nproc=1024:1024",
        ]);
    cmd
}

/// The image's `tunnel` with `args` (and podman flags before the image); output.
fn run_image(podman_flags: &[&str], args: &[&str]) -> std::process::Output {
    podman_run()
        .args(podman_flags)
        .arg(format!("tunnel:{VERSION}"))
        .args(args)
        .output()
        .expect("podman run")
}

#[test]
fn image_runs_the_version_and_checks_the_shipped_configs() {
    let present = Command::new("podman")
        .args(["image", "exists", &format!("tunnel:{VERSION}")])
        .status();
    match present {
        Err(e) => return common::privileged::cannot_run(&format!("podman is not installed: {e}")),
        Ok(s) if !s.success() => {
            return common::privileged::cannot_run(&format!(
                "no image tunnel:{VERSION} in the local store; build it with `cargo xtask image`"
            ));
        }
        Ok(_) => {}
    }
    // An image from other sources would test those: `cargo xtask image` labels it with
    // the git tree it was built from.
    let label = Command::new("podman")
        .args([
            "image",
            "inspect",
            "--format",
            "{{index .Config.Labels \"tunnel.source-tree\"}}",
        ])
        .arg(format!("tunnel:{VERSION}"))
        .output()
        .expect("podman image inspect");
    let built_from = String::from_utf8_lossy(&label.stdout).trim().to_string();
    let tree = Command::new("git")
        .current_dir(env!("CARGO_MANIFEST_DIR"))
        .args(["rev-parse", "HEAD^{tree}"])
        .output()
        .expect("git rev-parse");
    let tree = String::from_utf8_lossy(&tree.stdout).trim().to_string();
    if built_from != tree {
        return common::privileged::cannot_run(&format!(
            "the image tunnel:{VERSION} was built from tree {built_from:?}, the sources are {tree:?} (committed); rebuild it with `cargo xtask image`"
        ));
    }
    let out = run_image(&[], &["--version"]);
    let stderr = String::from_utf8_lossy(&out.stderr);
    if !out.status.success() && (stderr.contains("OCI runtime") || stderr.contains("runc")) {
        return common::privileged::cannot_run(&format!(
            "podman cannot run containers here: {stderr}"
        ));
    }
    assert!(
        out.status.success(),
        "tunnel --version in the image: {stderr}"
    );
    assert_eq!(
        String::from_utf8_lossy(&out.stdout).trim(),
        format!("tunnel {VERSION}")
    );

    let config = Path::new(env!("CARGO_MANIFEST_DIR")).join("../deploy/config");
    let mount = format!("{}:/etc/tunnel/config:ro", config.display());
    for (file, env) in [
        ("cloud.toml", None),
        ("edge.toml", Some("NODE_NAME=edge-1")),
    ] {
        let mut flags = vec!["--volume", &mount];
        if let Some(env) = env {
            flags.extend(["--env", env]);
        }
        let path = format!("/etc/tunnel/config/{file}");
        let out = run_image(&flags, &["check", "--config", &path]);
        assert!(
            out.status.success(),
            "tunnel check {file} in the image: {}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
        let stdout = String::from_utf8_lossy(&out.stdout);
        assert!(stdout.starts_with(&format!("{path}: ok")), "{stdout}");
        eprintln!("image: tunnel check {file}: ok");
    }
    // The archive `cargo xtask image` writes is named as a pod's `image: tunnel:X` means
    // to containerd, so `ctr -n k8s.io images import` needs no renaming.
    let archive = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join(format!("../target/image/tunnel-{VERSION}.oci.tar"));
    let index = Command::new("tar")
        .arg("-xOf")
        .arg(&archive)
        .arg("index.json")
        .output()
        .expect("tar");
    let index = String::from_utf8_lossy(&index.stdout);
    assert!(
        index.contains(&format!(
            "\"org.opencontainers.image.ref.name\":\"docker.io/library/tunnel:{VERSION}\""
        )),
        "{}: {index}",
        archive.display()
    );
    // The image's default user is not root (deploy/cloud.yaml asks for root itself).
    let user = Command::new("podman")
        .args([
            "image",
            "inspect",
            "--format",
            "{{.Config.User}}",
            &format!("tunnel:{VERSION}"),
        ])
        .output()
        .expect("podman image inspect");
    assert_eq!(String::from_utf8_lossy(&user.stdout).trim(), "65532:65532");
}
