//! The edge selector (`kubernetes.edge_selector`): which Nodes are edges. The cloud
//! watches every Node and applies it itself, since a non-edge's addresses count too
//! (an address an edge shares with one is nobody's).

use std::collections::BTreeSet;

use kube::core::{Expression, Selector};

/// Parses a label selector as `kubectl -l` takes it (`key`, `!key`, `key=value`,
/// `key==value`, `key!=value`, `key in (a,b)`, `key notin (a,b)`, joined by commas) into
/// kube's `Selector`, which matches labels (kube parses none from text).
pub(crate) fn edge_selector(text: &str) -> Result<Selector, String> {
    let mut expressions = Vec::new();
    let mut depth = 0usize;
    let mut start = 0;
    let mut parts = Vec::new();
    for (i, c) in text.char_indices() {
        match c {
            '(' => depth += 1,
            ')' => depth = depth.checked_sub(1).ok_or("unbalanced `)`")?,
            ',' if depth == 0 => {
                parts.push(&text[start..i]);
                start = i + 1;
            }
            _ => {}
        }
    }
    if depth != 0 {
        return Err("unbalanced `(`".into());
    }
    parts.push(&text[start..]);
    for part in parts {
        expressions.push(requirement(part.trim())?);
    }
    Ok(expressions.into_iter().collect())
}

/// One requirement of a label selector.
fn requirement(text: &str) -> Result<Expression, String> {
    let key = |k: &str| -> Result<String, String> {
        let k = k.trim();
        let ok = !k.is_empty()
            && k.len() <= 317
            && k.bytes()
                .all(|b| b.is_ascii_alphanumeric() || b"-_./".contains(&b));
        ok.then(|| k.to_string())
            .ok_or_else(|| format!("`{k}` is no label key"))
    };
    let value = |v: &str| -> Result<String, String> {
        let v = v.trim();
        let ok = v.len() <= 63
            && v.bytes()
                .all(|b| b.is_ascii_alphanumeric() || b"-_.".contains(&b));
        ok.then(|| v.to_string())
            .ok_or_else(|| format!("`{v}` is no label value"))
    };
    if let Some(k) = text.strip_prefix('!') {
        return Ok(Expression::DoesNotExist(key(k)?));
    }
    if let Some((k, v)) = text.split_once("!=") {
        return Ok(Expression::NotEqual(key(k)?, value(v)?));
    }
    if let Some((k, v)) = text.split_once("==").or_else(|| text.split_once('=')) {
        return Ok(Expression::Equal(key(k)?, value(v)?));
    }
    if let Some((k, rest)) = text.split_once(char::is_whitespace) {
        let rest = rest.trim_start();
        let (notin, list) = match (rest.strip_prefix("notin"), rest.strip_prefix("in")) {
            (Some(list), _) => (true, list),
            (None, Some(list)) => (false, list),
            (None, None) => return Err(format!("`{text}`: expected `in` or `notin`")),
        };
        let list = list
            .trim()
            .strip_prefix('(')
            .and_then(|l| l.strip_suffix(')'))
            .ok_or_else(|| format!("`{text}`: the values go in parentheses"))?;
        let values = list
            .split(',')
            .map(value)
            .collect::<Result<BTreeSet<_>, _>>()?;
        let k = key(k)?;
        return Ok(if notin {
            Expression::NotIn(k, values)
        } else {
            Expression::In(k, values)
        });
    }
    Ok(Expression::Exists(key(text)?))
}

#[cfg(test)]
mod tests {
    use kube::core::SelectorExt;

    use super::*;

    #[test]
    fn edge_selectors_parse_as_kubectl_takes_them_and_match_labels() {
        let labels = |pairs: &[(&str, &str)]| {
            pairs
                .iter()
                .map(|(k, v)| (k.to_string(), v.to_string()))
                .collect::<std::collections::BTreeMap<_, _>>()
        };
        let edge = labels(&[("node-role.kubernetes.io/edge", ""), ("zone", "a")]);
        let master = labels(&[("node-role.kubernetes.io/control-plane", ""), ("zone", "b")]);
        for (text, on_edge, on_master) in [
            ("node-role.kubernetes.io/edge", true, false),
            ("!node-role.kubernetes.io/edge", false, true),
            ("zone=a", true, false),
            ("zone==b", false, true),
            ("zone!=a", false, true),
            ("zone in (a, c)", true, false),
            ("zone notin (a,c)", false, true),
            ("node-role.kubernetes.io/edge, zone in (a,b)", true, false),
            (
                "zone in (a,b),!node-role.kubernetes.io/control-plane",
                true,
                false,
            ),
        ] {
            let selector = edge_selector(text).unwrap_or_else(|e| panic!("{text}: {e}"));
            assert_eq!(selector.matches(&edge), on_edge, "{text} on the edge");
            assert_eq!(selector.matches(&master), on_master, "{text} on the master");
        }
        for bad in [
            "zone in (a",
            "zone in a",
            "zone)",
            "zone=a b",
            "bad key",
            "zone=",
            "a,,b",
        ] {
            let parsed = edge_selector(bad);
            // `zone=` selects an empty value, which Kubernetes allows.
            if bad == "zone=" {
                assert!(parsed.is_ok(), "{bad}: {parsed:?}");
            } else {
                assert!(parsed.is_err(), "{bad} must not parse: {parsed:?}");
            }
        }
    }
}
