// TEMPORARY stand-in until the config branch lands (replaced wholesale on merge).
use std::path::Path;
use subtle::ConstantTimeEq;
#[derive(Debug, thiserror::Error)]
#[error("{0}")]
pub struct AuthError(String);
pub struct TokenFile { tokens: Vec<(String, String)> }
impl TokenFile {
    pub fn load(path: &Path) -> Result<Self, AuthError> {
        let text = std::fs::read_to_string(path).map_err(|e| AuthError(e.to_string()))?;
        Ok(Self { tokens: text.lines().filter_map(|l| l.split_once(':')).map(|(a, b)| (a.trim().to_string(), b.trim().to_string())).collect() })
    }
    pub fn verify(&self, node: &str, token: &str) -> bool {
        let want = self.tokens.iter().find(|(n, _)| n == node).or_else(|| self.tokens.iter().find(|(n, _)| n == "default"));
        want.is_some_and(|(_, t)| !t.is_empty() && bool::from(t.as_bytes().ct_eq(token.as_bytes())))
    }
}
pub fn node_name_from_cert(_der: &[u8]) -> Option<String> { None }
