//! `cargo xtask image`: the OCI image the DaemonSets in deploy/ run, built with no
//! image registry: a static (musl) `tunnel` in a `FROM scratch` image (Containerfile
//! at the root), by podman or else buildah. It lands in the local image store as
//! `tunnel:<version>` and in `target/image/tunnel-<version>.oci.tar` (named
//! `docker.io/library/tunnel:<version>`, the reference `image: tunnel:<version>` means).
//! `--prometheus` builds deploy/monitoring/'s Prometheus the same way, from the host's
//! Debian package.

use std::path::{Path, PathBuf};
use std::process::Command;

use anyhow::{Context as _, bail};

use crate::shipped;

/// Image label naming the git tree the image was built from (tests/image.rs reads it).
const SOURCE_LABEL: &str = "tunnel.source-tree";
const SETUP_HINT: &str = "scripts/setup.sh installs it (rustup target add x86_64-unknown-linux-musl, musl-tools, podman)";

fn run(cmd: &mut Command) -> anyhow::Result<String> {
    let out = cmd
        .output()
        .with_context(|| format!("running {cmd:?} ({SETUP_HINT})"))?;
    if !out.status.success() {
        bail!(
            "{cmd:?} failed ({}): {}{}",
            out.status,
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
    }
    Ok(String::from_utf8_lossy(&out.stdout).into_owned())
}

/// podman if it is installed, else buildah (both from Debian).
fn builder() -> anyhow::Result<&'static str> {
    for tool in ["podman", "buildah"] {
        if Command::new(tool).arg("--version").output().is_ok() {
            return Ok(tool);
        }
    }
    bail!("neither podman nor buildah is installed; {SETUP_HINT}")
}

/// Builds the binary the image holds (shipped.rs); returns its path.
pub fn build_binary(root: &Path) -> anyhow::Result<PathBuf> {
    let status = shipped::cargo_build(env!("CARGO"), root)
        .status()
        .context("running cargo build")?;
    if !status.success() {
        bail!(
            "building tunnel for {} failed ({status}); {SETUP_HINT}",
            shipped::TARGET
        );
    }
    Ok(shipped::bin_dir(root).join("tunnel"))
}

pub fn image(root: &Path) -> anyhow::Result<()> {
    let tool = builder()?;
    let binary = build_binary(root)?;
    // The tag is the version the binary itself reports, so the two cannot differ.
    let reported = run(Command::new(&binary).arg("--version"))?;
    let version = reported
        .trim()
        .strip_prefix("tunnel ")
        .with_context(|| format!("unexpected `tunnel --version` output: {reported:?}"))?
        .to_string();
    let tag = format!("tunnel:{version}");
    let kustomization = std::fs::read_to_string(root.join("deploy/kustomization.yaml"))
        .context("reading deploy/kustomization.yaml")?;
    if !kustomization.contains(&format!("newTag: \"{version}\"")) {
        bail!(
            "deploy/kustomization.yaml does not name {tag}: set images[tunnel].newTag to \"{version}\""
        );
    }

    // The build context holds the binary and nothing else.
    let out_dir = root.join("target/image");
    let context = out_dir.join("context");
    if context.exists() {
        std::fs::remove_dir_all(&context).context("clearing target/image/context")?;
    }
    std::fs::create_dir_all(&context).context("creating target/image/context")?;
    let in_image = context.join("tunnel");
    std::fs::copy(&binary, &in_image).context("copying the binary")?;
    // The release profile keeps line tables for backtraces on the host; the image ships
    // without them (about a tenth of the size).
    run(Command::new("strip").arg(&in_image))?;
    let archive = build(tool, root, &root.join("Containerfile"), &context, &tag)?;
    println!("built {tag} (local image store) and {}", archive.display());
    Ok(())
}

/// Builds `tag` from `containerfile` and `context` with `tool` (labelled with the
/// source tree), and saves it to `target/image/<name>-<version>.oci.tar`; returns the
/// archive's path.
fn build(
    tool: &str,
    root: &Path,
    containerfile: &Path,
    context: &Path,
    tag: &str,
) -> anyhow::Result<PathBuf> {
    let mut build = Command::new(tool);
    match tool {
        "podman" => build.args(["build", "--pull=never"]),
        _ => build.args(["bud", "--pull-never"]),
    };
    // Which sources the image holds, so tests/image.rs can tell a stale image from the
    // current one: the committed tree, marked dirty when tracked files differ from it.
    let tree = run(Command::new("git")
        .current_dir(root)
        .args(["rev-parse", "HEAD^{tree}"]))?;
    let dirty = !run(Command::new("git").current_dir(root).args([
        "status",
        "--porcelain",
        "--untracked-files=no",
    ]))?
    .trim()
    .is_empty();
    let source = format!("{}{}", tree.trim(), if dirty { "-dirty" } else { "" });
    build
        .args(["--label", &format!("{SOURCE_LABEL}={source}")])
        .args(["--tag", tag, "--file"])
        .arg(containerfile)
        .arg(context);
    run(&mut build)?;

    // The archive names the image by its full reference, which is what `image: NAME:X`
    // in a pod means to containerd; `ctr images import` keeps that name.
    let full = format!("docker.io/library/{tag}");
    run(Command::new(tool).args(["tag", tag, &full]))?;
    let archive = root
        .join("target/image")
        .join(format!("{}.oci.tar", tag.replace(':', "-")));
    let _ = std::fs::remove_file(&archive);
    let mut save = Command::new(tool);
    match tool {
        "podman" => save
            .args(["save", "--format", "oci-archive", "--output"])
            .arg(&archive)
            .arg(&full),
        _ => save
            .args(["push", &full])
            .arg(format!("oci-archive:{}:{full}", archive.display())),
    };
    run(&mut save)?;
    Ok(archive)
}

/// Debian's Prometheus, which scripts/setup.sh installs (the `prometheus` package).
const PROMETHEUS: &str = "/usr/bin/prometheus";
/// The name deploy/monitoring/prometheus.yaml runs.
const PROMETHEUS_IMAGE: &str = "tunnel-prometheus";

/// `cargo xtask image --prometheus`: deploy/monitoring/'s Prometheus, built from the
/// host's Debian package with no registry: the binary and the shared libraries it
/// loads (`ldd`), `FROM scratch` (deploy/monitoring/Containerfile), tagged with the
/// version it reports.
pub fn prometheus(root: &Path) -> anyhow::Result<()> {
    let tool = builder()?;
    let reported = run(Command::new(PROMETHEUS).arg("--version")).with_context(|| {
        format!("{PROMETHEUS} (Debian's prometheus; scripts/setup.sh installs it)")
    })?;
    // "prometheus, version 2.42.0+ds (branch: ...": the upstream version, without
    // Debian's "+ds" (sources repacked).
    let version = reported
        .split_whitespace()
        .nth(2)
        .and_then(|v| v.split('+').next())
        .filter(|v| v.chars().next().is_some_and(|c| c.is_ascii_digit()))
        .with_context(|| format!("unexpected `prometheus --version` output: {reported:?}"))?
        .to_string();
    let tag = format!("{PROMETHEUS_IMAGE}:{version}");
    let manifest = std::fs::read_to_string(root.join("deploy/monitoring/kustomization.yaml"))
        .context("reading deploy/monitoring/kustomization.yaml")?;
    if !manifest.contains(&format!("newTag: \"{version}\"")) {
        bail!(
            "deploy/monitoring/kustomization.yaml does not name {tag}: set images[{PROMETHEUS_IMAGE}].newTag to \"{version}\""
        );
    }

    let context = root.join("target/image/prometheus-context");
    if context.exists() {
        std::fs::remove_dir_all(&context).context("clearing target/image/prometheus-context")?;
    }
    let rootfs = context.join("rootfs");
    let mut files = vec![PathBuf::from(PROMETHEUS)];
    // `ldd` lists what the dynamic loader maps: "libc.so.6 => /lib/.../libc.so.6 (0x..)"
    // and the loader itself, "/lib64/ld-linux-x86-64.so.2 (0x..)".
    let libraries = run(Command::new("ldd").arg(PROMETHEUS))?;
    files.extend(
        libraries
            .lines()
            .filter_map(|l| l.split_whitespace().find(|w| w.starts_with('/')))
            .map(PathBuf::from),
    );
    for file in &files {
        let to = rootfs.join(file.strip_prefix("/").unwrap_or(file));
        if let Some(dir) = to.parent() {
            std::fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
        }
        // Through symlinks: the image holds the files themselves.
        std::fs::copy(file, &to).with_context(|| format!("copying {}", file.display()))?;
    }
    std::fs::create_dir_all(rootfs.join("etc")).context("creating etc/")?;
    // Prometheus runs as nobody (Containerfile); Go's os/user reads the name here.
    std::fs::write(
        rootfs.join("etc/passwd"),
        "nobody:x:65534:65534:nobody:/nonexistent:/usr/sbin/nologin\n",
    )
    .context("writing etc/passwd")?;
    let archive = build(
        tool,
        root,
        &root.join("deploy/monitoring/Containerfile"),
        &context,
        &tag,
    )?;
    println!("built {tag} (local image store) and {}", archive.display());
    Ok(())
}
