//! The shipped examples load and mean what they say; the bases of the other tests are
//! valid.

use super::*;

#[test]
fn every_shipped_example_loads() {
    let mut loaded = Vec::new();
    for entry in std::fs::read_dir(examples()).expect("examples/") {
        let path = entry.expect("entry").path();
        if path.extension().is_none_or(|e| e != "toml") {
            continue;
        }
        let name = path
            .file_name()
            .expect("name")
            .to_string_lossy()
            .into_owned();
        if name.contains("cloud") {
            CloudConfig::load(&path).unwrap_or_else(|e| panic!("{e}"));
        } else if name.contains("edge") {
            EdgeConfig::load(&path, Some("edge-1".into())).unwrap_or_else(|e| panic!("{e}"));
        } else {
            panic!("{name}: neither a cloud nor an edge example; name it so this test loads it");
        }
        loaded.push(name);
    }
    loaded.sort();
    assert_eq!(
        loaded,
        [
            "cloud.toml",
            "edge.toml",
            "relay-cloud.toml",
            "superedge-cloud.toml",
            "superedge-edge.toml"
        ]
    );
}

#[test]
fn examples_mean_what_they_say() {
    let cloud = CloudConfig::load(&examples().join("cloud.toml")).expect("cloud.toml");
    assert_eq!(
        cloud.tunnel.cert,
        Some(examples().join("certs/cloud.crt")),
        "paths are relative to the file"
    );
    assert_eq!(cloud.forwards[0].node.as_deref(), Some("edge-1"));

    let edge =
        EdgeConfig::load(&examples().join("edge.toml"), Some("edge-1".into())).expect("edge.toml");
    assert_eq!(edge.node(), "edge-1", "NODE_NAME fills a missing node_name");
    assert!(
        !edge.allow.any,
        "the native edge only dials allowed targets"
    );

    let se =
        CloudConfig::load(&examples().join("superedge-cloud.toml")).expect("superedge-cloud.toml");
    assert_eq!(se.tunnel.listen.expect("tunnel.listen").port(), 9000);
    assert_eq!(
        se.forwards[0].node, None,
        "SuperEdge forwards go to the first edge connected"
    );
    assert_eq!(se.https[0].listen.port(), 10250);

    let se = EdgeConfig::load(
        &examples().join("superedge-edge.toml"),
        Some("edge-1".into()),
    )
    .expect("superedge-edge.toml");
    assert!(se.allow.any, "a SuperEdge edge dials what the cloud names");
    assert_eq!(se.cloud.address, "localhost:9000");
}

#[test]
fn the_base_configs_are_valid() {
    let tmp = tempfile::tempdir().expect("tempdir");
    CloudConfig::load(&write(tmp.path(), "cloud.toml", CLOUD)).expect("cloud");
    EdgeConfig::load(&write(tmp.path(), "edge.toml", EDGE), Some("edge-1".into())).expect("edge");
}
