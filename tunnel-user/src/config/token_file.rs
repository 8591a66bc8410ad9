//! SuperEdge's token file: which token lets which node register.

use std::collections::HashMap;
use std::fmt;
use std::path::{Path, PathBuf};

use sha2::{Digest, Sha256};
use subtle::{Choice, ConstantTimeEq};
use tracing::warn;

use crate::addr::check_node_name;
use crate::config::CloudConfig;

#[derive(Debug, thiserror::Error)]
pub enum TokenFileError {
    #[error("{file}: cannot read: {source}")]
    Read {
        file: PathBuf,
        source: std::io::Error,
    },
    #[error("{file}:{line}: {problem}")]
    Malformed {
        file: PathBuf,
        line: usize,
        problem: String,
    },
    #[error(
        "{file}:{line}: a `default:` token lets any edge that holds it register as any node, so it is refused while edges can also prove who they are with {stronger}: give each node a line of its own (`tunnel certs --tokens`) and remove the `default` line"
    )]
    DefaultBeside {
        file: PathBuf,
        line: usize,
        /// The other ways in, as the config names them.
        stronger: String,
    },
}

/// The ways besides the token file that a cloud lets edges in (`Beside::of`): beside
/// any of them, or beside per-node lines, a `default:` line is refused. Otherwise an
/// edge that holds the one shared token could register as a node that proves itself
/// better, and take its session.
#[derive(Debug, Clone, Copy, Default)]
pub(crate) struct Beside {
    /// `tunnel.client_ca`: certificates that name their node.
    pub(crate) client_certificates: bool,
    /// `kubernetes.token_review`: service account tokens bound to their node.
    pub(crate) token_review: bool,
}

impl Beside {
    pub(crate) fn of(config: &CloudConfig) -> Self {
        Self {
            client_certificates: config.tunnel.client_ca.is_some(),
            token_review: config.kubernetes.token_review,
        }
    }
}

/// The node name SuperEdge's token file uses for the token of nodes without a line.
const DEFAULT_NODE: &str = "default";

/// SuperEdge's token file: `nodename:token` lines, `default:token` for every node
/// without its own line, blank lines and `#` comments ignored. A `default` line loads
/// only where it is the one way in (`Beside`).
///
/// Only SHA-256 digests of the tokens are kept: comparing fixed-size digests takes
/// the same time whatever the tokens' lengths, so timing tells neither a token's
/// length nor whether a node has a line of its own (its token and the default may
/// differ in length).
pub struct TokenFile {
    file: PathBuf,
    nodes: HashMap<String, [u8; 32]>,
    /// The `default` token's line (for what is said about it) and digest.
    default: Option<(usize, [u8; 32])>,
}

impl TokenFile {
    /// Reads and parses `path`, refusing a `default:` line `beside` other ways in (and
    /// warning about one that is the only way in).
    pub(crate) fn load(path: &Path, beside: Beside) -> Result<Self, TokenFileError> {
        let text = std::fs::read_to_string(path).map_err(|source| TokenFileError::Read {
            file: path.to_path_buf(),
            source,
        })?;
        let tokens = Self::parse(path, &text)?;
        tokens.check_default(beside)?;
        Ok(tokens)
    }

    /// A `default:` line is refused beside any stronger way in: certificates, reviewed
    /// service account tokens, or lines of the nodes' own. Alone, it is what SuperEdge
    /// fleets run with, so it stays, with a warning each time the file is loaded.
    fn check_default(&self, beside: Beside) -> Result<(), TokenFileError> {
        let Some((line, _)) = self.default else {
            return Ok(());
        };
        let mut stronger = Vec::new();
        if beside.client_certificates {
            stronger.push("client certificates (tunnel.client_ca)".to_string());
        }
        if beside.token_review {
            stronger.push("service account tokens (kubernetes.token_review)".to_string());
        }
        if !self.nodes.is_empty() {
            stronger.push(format!(
                "per-node lines in this file ({})",
                self.nodes.len()
            ));
        }
        if stronger.is_empty() {
            warn!(
                file = %self.file.display(),
                line,
                "the token file's `default:` token is the only way edges authenticate: any edge that holds it may register as any node; give each node a line of its own (`tunnel certs --tokens`) or a client certificate"
            );
            return Ok(());
        }
        Err(TokenFileError::DefaultBeside {
            file: self.file.clone(),
            line,
            stronger: stronger.join(", "),
        })
    }

    /// Parses the text of `file`. Messages never quote a line: it may hold a token.
    pub fn parse(file: &Path, text: &str) -> Result<Self, TokenFileError> {
        let mut nodes = HashMap::new();
        let mut default = None;
        let mut first_line = HashMap::new();
        for (i, raw) in text.lines().enumerate() {
            let line = i + 1;
            let malformed = |problem: String| TokenFileError::Malformed {
                file: file.to_path_buf(),
                line,
                problem,
            };
            let entry = raw.trim();
            if entry.is_empty() || entry.starts_with('#') {
                continue;
            }
            let Some((node, token)) = entry.split_once(':') else {
                return Err(malformed("expected `nodename:token`".into()));
            };
            let (node, token) = (node.trim(), token.trim());
            // A line written the wrong way round puts the token first: do not echo it.
            if node != DEFAULT_NODE && check_node_name(node).is_err() {
                return Err(malformed("the part before `:` is not a valid node name (lower-case letters, digits, '-' and '.')".into()));
            }
            if token.is_empty() {
                return Err(malformed(format!("empty token for `{node}`")));
            }
            if let Some(earlier) = first_line.insert(node.to_string(), line) {
                return Err(malformed(format!(
                    "`{node}` already has a token on line {earlier}"
                )));
            }
            let digest = digest(token);
            if node == DEFAULT_NODE {
                default = Some((line, digest));
            } else {
                nodes.insert(node.to_string(), digest);
            }
        }
        Ok(Self {
            file: file.to_path_buf(),
            nodes,
            default,
        })
    }

    /// Whether `token` is `node`'s token: the one on the node's own line, else the
    /// default. An empty token never matches.
    pub fn verify(&self, node: &str, token: &str) -> bool {
        // The lookup's timing depends only on the node name, which the edge sent
        // itself; everything that involves a secret runs the same steps every time.
        let expected = self
            .nodes
            .get(node)
            .or(self.default.as_ref().map(|(_, digest)| digest));
        let has_expected = Choice::from(u8::from(expected.is_some()));
        let expected = expected.copied().unwrap_or([0; 32]);
        let non_empty = Choice::from(u8::from(!token.is_empty()));
        (digest(token).ct_eq(&expected) & has_expected & non_empty).into()
    }
}

fn digest(token: &str) -> [u8; 32] {
    Sha256::digest(token.as_bytes()).into()
}

// Names only: the digests are as good as the tokens to anyone who can guess them.
impl fmt::Debug for TokenFile {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let mut nodes: Vec<&str> = self.nodes.keys().map(String::as_str).collect();
        nodes.sort_unstable();
        f.debug_struct("TokenFile")
            .field("file", &self.file)
            .field("nodes", &nodes)
            .field("default", &self.default.is_some())
            .finish()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const FILE: &str = "
# tokens for the edge fleet
edge-a:token-for-a

  edge-b : token-for-b  
default:the-default-token
";

    fn tokens() -> TokenFile {
        TokenFile::parse(Path::new("token"), FILE).expect("valid token file")
    }

    fn malformed(text: &str) -> String {
        match TokenFile::parse(Path::new("/etc/tunnel/token"), text) {
            Err(e @ TokenFileError::Malformed { .. }) => e.to_string(),
            other => panic!("expected a malformed-line error, got {other:?}"),
        }
    }

    #[test]
    fn node_token_matches_only_its_node() {
        let t = tokens();
        assert!(t.verify("edge-a", "token-for-a"));
        assert!(
            t.verify("edge-b", "token-for-b"),
            "spaces around node and token are trimmed"
        );
        assert!(
            !t.verify("edge-b", "token-for-a"),
            "A's token must not open B, which has its own line"
        );
        assert!(!t.verify("edge-a", "token-for-b"));
        assert!(
            !t.verify("edge-a", "the-default-token"),
            "a node with its own line does not take the default"
        );
        assert!(
            !t.verify("edge-a", "token-for-"),
            "a prefix is not the token"
        );
        assert!(!t.verify("edge-a", "token-for-aa"));
    }

    #[test]
    fn default_covers_nodes_without_a_line() {
        let t = tokens();
        assert!(t.verify("edge-c", "the-default-token"));
        assert!(
            !t.verify("edge-c", "token-for-a"),
            "another node's token is not the default"
        );
    }

    #[test]
    fn without_default_unknown_nodes_fail() {
        let t = TokenFile::parse(Path::new("token"), "edge-a:secret\n").expect("valid");
        assert!(t.verify("edge-a", "secret"));
        assert!(!t.verify("edge-c", "secret"));
        assert!(!t.verify("edge-c", ""));
    }

    #[test]
    fn empty_token_never_matches() {
        let t = tokens();
        for node in ["edge-a", "edge-c", "default", ""] {
            assert!(!t.verify(node, ""), "{node}");
        }
        let empty = TokenFile::parse(Path::new("token"), "# nothing yet\n\n").expect("valid");
        assert!(!empty.verify("edge-a", ""));
    }

    #[test]
    fn token_may_contain_colons_and_crlf_is_fine() {
        let t =
            TokenFile::parse(Path::new("token"), "edge-a:abc:def\r\ndefault:x\r\n").expect("valid");
        assert!(t.verify("edge-a", "abc:def"));
        assert!(t.verify("edge-z", "x"));
    }

    #[test]
    fn malformed_lines_name_file_and_line() {
        let s = malformed("edge-a:ok\n\nno-colon-here\n");
        assert!(
            s.starts_with("/etc/tunnel/token:3: expected `nodename:token`"),
            "{s}"
        );
        assert!(
            !s.contains("no-colon-here"),
            "a malformed line may be a token and is not echoed: {s}"
        );

        let s = malformed("# c\n:token\n");
        assert!(
            s.starts_with("/etc/tunnel/token:2: ") && s.contains("not a valid node name"),
            "{s}"
        );

        let s = malformed("edge-a:\n");
        assert!(
            s.starts_with("/etc/tunnel/token:1: empty token for `edge-a`"),
            "{s}"
        );

        let s = malformed("Edge_A:token\n");
        assert!(
            s.starts_with("/etc/tunnel/token:1: ") && s.contains("not a valid node name"),
            "{s}"
        );
        assert!(!s.contains("Edge_A"), "{s}");

        let s = malformed("edge-a:one\ndefault:d\nedge-a:two\n");
        assert!(
            s.starts_with("/etc/tunnel/token:3: `edge-a` already has a token on line 1"),
            "{s}"
        );

        let s = malformed("default:one\ndefault:two\n");
        assert!(
            s.starts_with("/etc/tunnel/token:2: `default` already has a token on line 1"),
            "{s}"
        );
    }

    #[test]
    fn debug_shows_names_not_tokens() {
        let s = format!("{:?}", tokens());
        assert!(
            s.contains("edge-a") && s.contains("edge-b") && s.contains("default: true"),
            "{s}"
        );
        for secret in ["token-for-a", "token-for-b", "the-default-token"] {
            assert!(!s.contains(secret), "{s}");
        }
    }

    #[test]
    fn load_reports_the_file() {
        let path = Path::new("/nonexistent/tunnel/token");
        let e = TokenFile::load(path, Beside::default()).expect_err("no such file");
        assert!(matches!(e, TokenFileError::Read { .. }));
        assert!(
            e.to_string()
                .starts_with("/nonexistent/tunnel/token: cannot read"),
            "{e}"
        );
    }

    /// A `default:` line beside any stronger way in fails the load, naming the file, the
    /// line and every other way; alone it loads (and is warned about).
    #[test]
    fn a_default_line_is_refused_beside_a_stronger_way_in() {
        let dir = tempfile::tempdir().expect("dir");
        let path = dir.path().join("tokens");
        let load = |text: &str, beside: Beside| {
            std::fs::write(&path, text).expect("write");
            TokenFile::load(&path, beside)
        };
        let certificates = Beside {
            client_certificates: true,
            token_review: false,
        };
        let review = Beside {
            client_certificates: false,
            token_review: true,
        };
        let only_default = "# the fleet\ndefault:shared\n";
        let alone = load(only_default, Beside::default()).expect("the one way in");
        assert!(alone.verify("any-node", "shared"));

        for (text, beside, named) in [
            (
                only_default,
                certificates,
                "client certificates (tunnel.client_ca)",
            ),
            (
                only_default,
                review,
                "service account tokens (kubernetes.token_review)",
            ),
            (
                "edge-a:own\ndefault:shared\n",
                Beside::default(),
                "per-node lines in this file (1)",
            ),
        ] {
            let e = load(text, beside).expect_err("a default beside a stronger way");
            let said = e.to_string();
            let line = text
                .lines()
                .position(|l| l.starts_with("default"))
                .expect("line")
                + 1;
            assert!(
                said.starts_with(&format!("{}:{line}: a `default:` token", path.display())),
                "{said}"
            );
            assert!(said.contains(named), "{said}");
            assert!(!said.contains("shared"), "the token is not echoed: {said}");
        }
        let e = load(
            "edge-a:own\ndefault:shared\n",
            Beside {
                client_certificates: true,
                token_review: true,
            },
        )
        .expect_err("every way named");
        assert!(
            e.to_string().contains("with client certificates (tunnel.client_ca), service account tokens (kubernetes.token_review), per-node lines in this file (1):"),
            "{e}"
        );
        // Without a default line, nothing changes.
        assert!(load("edge-a:own\n", certificates).is_ok());
    }
}
