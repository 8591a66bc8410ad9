//! The process itself: a bad config exits 2 naming file and key; the log level changes
//! at runtime.

use super::*;

#[test]
fn log_level_changes_at_runtime_superedge_style() {
    let mut s = Setup::new(TOKENS);
    let _cloud = s.start_cloud(Table::new());
    let url = format!("http://{}/debug/flags/v", s.cloud_admin);
    let out = Command::new("curl")
        .args(["-sS", "-X", "PUT", &url, "-d", "8"])
        .output()
        .unwrap();
    assert_eq!(String::from_utf8_lossy(&out.stdout).trim(), "trace");
    let out = Command::new("curl").args(["-sS", &url]).output().unwrap();
    assert_eq!(String::from_utf8_lossy(&out.stdout).trim(), "trace");
    let out = Command::new("curl")
        .args([
            "-sS",
            "-o",
            "/dev/null",
            "-w",
            "%{http_code}",
            "-X",
            "PUT",
            &url,
            "-d",
            "info,[[[",
        ])
        .output()
        .unwrap();
    assert_eq!(String::from_utf8_lossy(&out.stdout), "400");
}

#[test]
fn invalid_config_exits_2_naming_file_and_key() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("cloud.toml");
    std::fs::write(&path, "[tunnel]\nlisten = \"127.0.0.1:1\"\ncert = \"c\"\nkey = \"k\"\ntoken_file = \"t\"\n[[forward]]\nlisten = \"127.0.0.1:2\"\nnode = \"ghost\"\ntarget = \"127.0.0.1:3\"\n").unwrap();
    let mut p = common::Proc::start(
        "bad-config",
        dir.path(),
        &["cloud", "--config", path.to_str().unwrap()],
    );
    assert_eq!(p.wait_exit(Duration::from_secs(10)), Some(2));
    let log = p.log_text();
    assert!(
        log.contains("cloud.toml")
            && log.contains("forward[0].node")
            && log.contains("unknown node `ghost`"),
        "{log}"
    );
}
