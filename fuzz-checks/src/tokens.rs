//! SuperEdge's token file: `tunnel_user::config::token_file::TokenFile::parse`, then `verify` with the
//! tokens the file gives.
//!
//! Properties:
//! - every `node:token` line of a file that parses verifies (its node with its token),
//!   a node without a line verifies with the `default` token, and an empty token never
//!   verifies;
//! - an error never quotes a token: its message is one of the fixed texts, naming at
//!   most a node name that passed the node-name check.

use std::path::Path;

use tunnel_user::addr::check_node_name;
use tunnel_user::config::token_file::{TokenFile, TokenFileError};

const FILE: &str = "/etc/tunnel/tokens";

/// Input: the file's text.
pub fn check(data: &[u8]) {
    let Ok(text) = std::str::from_utf8(data) else {
        return;
    };
    match TokenFile::parse(Path::new(FILE), text) {
        Ok(tokens) => check_verifies(&tokens, text),
        Err(TokenFileError::Malformed { line, problem, .. }) => check_message(text, line, &problem),
        Err(e) => panic!("parsing text cannot fail to read: {e}"),
    }
}

/// The entries of the file as written: (node, token), comments and blank lines skipped.
fn entries(text: &str) -> impl Iterator<Item = (&str, &str)> {
    text.lines()
        .map(str::trim)
        .filter(|l| !l.is_empty() && !l.starts_with('#'))
        .filter_map(|l| l.split_once(':'))
        .map(|(n, t)| (n.trim(), t.trim()))
}

fn check_verifies(tokens: &TokenFile, text: &str) {
    let mut default = None;
    for (node, token) in entries(text) {
        assert!(!token.is_empty());
        if node == "default" {
            default = Some(token);
        }
        assert!(
            tokens.verify(node, token),
            "line `{node}:<token>` does not verify"
        );
        assert!(
            !tokens.verify(node, ""),
            "an empty token verified for {node}"
        );
    }
    let unlisted = "node-without-a-line-0";
    if !entries(text).any(|(n, _)| n == unlisted) {
        match default {
            Some(token) => assert!(
                tokens.verify(unlisted, token),
                "the default token does not verify an unlisted node"
            ),
            None => assert!(
                !tokens.verify(unlisted, "x"),
                "an unlisted node verified without a default"
            ),
        }
    }
}

fn check_message(text: &str, line: usize, problem: &str) {
    let raw = text
        .lines()
        .nth(line - 1)
        .expect("the error names a line of the file");
    let entry = raw.trim();
    let node = entry.split_once(':').map(|(n, _)| n.trim());
    let fixed = [
        "expected `nodename:token`".to_string(),
        "the part before `:` is not a valid node name (lower-case letters, digits, '-' and '.')"
            .to_string(),
    ];
    let naming_node = node
        .filter(|n| *n == "default" || check_node_name(n).is_ok())
        .map(|n| {
            [
                format!("empty token for `{n}`"),
                format!("`{n}` already has a token on line "),
            ]
        });
    let ok = fixed.iter().any(|f| problem == f)
        || naming_node.is_some_and(|[empty, dup]| {
            problem == empty
                || problem
                    .strip_prefix(dup.as_str())
                    .is_some_and(|l| l.parse::<usize>().is_ok_and(|l| l < line))
        });
    assert!(
        ok,
        "line {line}: message {problem:?} is not one of the fixed texts"
    );
}
