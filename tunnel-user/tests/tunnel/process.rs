//! The process itself: a bad config exits 2 naming file and key; the log level changes
//! at runtime, by PUT only; local listeners bound wider are warned about at start.

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
fn the_log_level_takes_put_but_refuses_post_which_a_web_page_can_send() {
    let mut s = Setup::new(TOKENS);
    let _cloud = s.start_cloud(Table::new());
    let url = format!("http://{}/debug/flags/v", s.cloud_admin);
    let level = || {
        let out = Command::new("curl").args(["-sS", &url]).output().unwrap();
        String::from_utf8_lossy(&out.stdout).trim().to_string()
    };
    let before = level();
    // What a cross-origin form sends: a POST with a simple content type.
    let out = Command::new("curl")
        .args(["-sS", "-i", "-X", "POST", &url, "-d", "8"])
        .args(["-H", "Content-Type: application/x-www-form-urlencoded"])
        .output()
        .unwrap();
    let response = String::from_utf8_lossy(&out.stdout).to_ascii_lowercase();
    assert!(
        response.starts_with("http/1.1 405") && response.contains("\r\nallow: get, put\r\n"),
        "{response}"
    );
    assert_eq!(level(), before, "a refused POST changed the level");
    let out = Command::new("curl")
        .args(["-sS", "-X", "PUT", &url, "-d", "8"])
        .output()
        .unwrap();
    assert_eq!(String::from_utf8_lossy(&out.stdout).trim(), "trace");
    assert_eq!(level(), "trace");
}

#[test]
fn connect_and_admin_listeners_beyond_loopback_are_warned_about_at_start() {
    if !common::privileged::is_root() {
        common::privileged::cannot_run(
            "the cloud binds all addresses in a network namespace of its own: needs root",
        );
        return;
    }
    let s = Setup::new(TOKENS);
    // All addresses, in a network namespace nobody else is in: nothing outside reaches
    // these listeners.
    let mut cloud = s.spawn_cloud(
        toml::toml! {
            [connect]
            listen = "0.0.0.0:0"

            [admin]
            listen = "0.0.0.0:0"
        },
        &["unshare", "--net"],
    );
    cloud.wait_ready(Duration::from_secs(10));
    let log = cloud.log_text();
    for key in ["connect.listen", "admin.listen"] {
        let line = log
            .lines()
            .find(|l| l.contains(&format!("{key} listens beyond loopback")))
            .unwrap_or_else(|| panic!("no warning for {key}:\n{log}"));
        assert!(
            line.contains("WARN") && line.contains("addr=0.0.0.0:0"),
            "{line}"
        );
    }
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
