//! Config files: `CloudConfig::parse`, `EdgeConfig::parse` and `config::parse_any`
//! (what `tunnel check` runs), each in the native format and SuperEdge's, told apart by
//! the text. Config files are not network input, but they come from ConfigMaps written
//! by people and tools, and a parser that panics takes a whole fleet down.
//!
//! Properties:
//! - every error names the file (the operator must know which one);
//! - a config that parses is valid (validating it again finds nothing), its paths are
//!   resolved against the file's directory, and its summary can be printed;
//! - `parse_any` agrees with the parser of the kind it chose.

use std::path::Path;

use tunnel_user::config::{AnyConfig, CloudConfig, ConfigError, EdgeConfig, parse_any};

const FILE: &str = "/etc/tunnel/fuzz.toml";

/// Input: the file's text (a file that is not UTF-8 cannot be read at all).
pub fn check(data: &[u8]) {
    let Ok(text) = std::str::from_utf8(data) else {
        return;
    };
    let file = Path::new(FILE);
    let cloud = CloudConfig::parse(file, text);
    let edge = EdgeConfig::parse(file, text, Some("edge-from-env".into()));
    let any = parse_any(file, text, Some("edge-from-env".into()));
    for e in [
        cloud.as_ref().err(),
        edge.as_ref().err(),
        any.as_ref().err(),
    ]
    .into_iter()
    .flatten()
    {
        names_file(e);
    }
    if let Ok(c) = &cloud {
        c.validate(file)
            .unwrap_or_else(|e| panic!("a parsed cloud config is invalid: {e}"));
        let t = &c.tunnel;
        let paths = [
            t.cert.as_ref(),
            t.key.as_ref(),
            t.token_file.as_ref(),
            t.client_ca.as_ref(),
            c.peers.ca.as_ref(),
        ];
        for p in paths
            .into_iter()
            .flatten()
            .chain(c.https.iter().flat_map(|h| [&h.cert, &h.key]))
        {
            assert!(
                p.is_absolute(),
                "{} was not resolved against the file's directory",
                p.display()
            );
        }
        let _ = c.summary();
    }
    if let Ok(e) = &edge {
        e.validate(file)
            .unwrap_or_else(|err| panic!("a parsed edge config is invalid: {err}"));
        let cl = &e.cloud;
        let paths = [
            Some(&cl.ca),
            cl.token_file.as_ref(),
            cl.cert.as_ref(),
            cl.key.as_ref(),
        ];
        for p in paths
            .into_iter()
            .flatten()
            .chain(e.https.iter().flat_map(|h| [&h.cert, &h.key]))
        {
            assert!(
                p.is_absolute(),
                "{} was not resolved against the file's directory",
                p.display()
            );
        }
        assert!(
            !e.node().is_empty(),
            "a parsed edge config has a name to register as"
        );
        let _ = e.summary();
    }
    match &any {
        Ok(AnyConfig::Cloud(_)) => assert!(
            cloud.is_ok(),
            "parse_any took a cloud config the cloud parser refuses"
        ),
        Ok(AnyConfig::Edge(_)) => assert!(
            edge.is_ok(),
            "parse_any took an edge config the edge parser refuses"
        ),
        Err(_) => {}
    }
}

fn names_file(e: &ConfigError) {
    let message = e.to_string();
    assert!(
        message.starts_with(FILE),
        "a config error does not name the file: {message}"
    );
}
