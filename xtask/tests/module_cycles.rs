//! No import cycles between the modules of `tunnel-user/src`: a file whose module uses a
//! second module (by a `use` or a `crate::`/`super::` path) must not be used back by it,
//! directly or through a chain. A cycle means neither module can be read, changed or
//! tested without the other, so the two are one module in two files, or a type sits in
//! the wrong one.
//!
//! Files are modules (`a/mod.rs` is `a`); code under `#[cfg(test)]` is left out, since a
//! test may use whatever it checks. A use of a module's ancestor (`super::Config` from a
//! child of the module that declares it) is not an edge: a parent owns its children, and
//! what they share is declared in it for them.
//!
//! The same holds between folders: a use from a file of folder `a/` of a file of folder
//! `b/` is an arrow `a/ -> b/`, and the folders' arrows must not loop either, so that the
//! folders stack in floors (`cloud/`'s are listed in `docs/design.md`). A folder's files
//! are those directly in it, its `mod.rs` among them; its subfolders are folders of their
//! own, so a parent whose files use a child that uses the parent's other files back is a
//! loop too (only its `mod.rs`, the ancestor, is exempt, as above). The files directly
//! in `src/` are the crate's top-level modules, each a folder of its own here.
//!
//! And between the crate's top-level modules, each with everything under it (`cloud`,
//! `edge`, `call`, `io`, `config`, `addr`, ...): their arrows must not loop either, and
//! `cloud` and `edge`, the two processes, use nothing of each other. What both need
//! (the call of a proxied connection, I/O, the config, the addresses) lies below both,
//! so either side can be read, changed and tested without the other.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

#[test]
fn no_module_import_cycles() {
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("../tunnel-user/src");
    let graph = ModuleGraph::read(&src);
    let report: String = graph
        .cycles()
        .iter()
        .map(|cycle| format!("import cycle: {}\n", graph.describe(cycle)))
        .collect();
    assert!(report.is_empty(), "\n{report}");
}

#[test]
fn no_folder_import_cycles() {
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("../tunnel-user/src");
    let folders = ModuleGraph::read(&src).folders();
    let report: String = folders
        .cycles()
        .iter()
        .map(|cycle| format!("folder import cycle: {}\n", folders.describe(cycle)))
        .collect();
    assert!(report.is_empty(), "\n{report}");
}

#[test]
fn no_top_level_import_cycles() {
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("../tunnel-user/src");
    let top = ModuleGraph::read(&src).top_level();
    let report: String = top
        .cycles()
        .iter()
        .map(|cycle| format!("top-level import cycle: {}\n", top.describe(cycle)))
        .collect();
    assert!(report.is_empty(), "\n{report}");
}

#[test]
fn cloud_and_edge_use_nothing_of_each_other() {
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("../tunnel-user/src");
    let top = ModuleGraph::read(&src).top_level();
    let report = top.arrows_between("cloud", "edge");
    assert!(
        report.is_empty(),
        "the cloud and the edge use each other (what both need belongs below both, in `call`, `io`, `config` or `addr`):\n{report}"
    );
}

/// Which module uses which, module paths without the leading `crate`.
struct ModuleGraph {
    /// Module -> the modules it uses, each with the paths that use it (for the report).
    uses: Uses,
    /// Module -> the folder its file lies in (`cloud/edges/`; `src/` files: `certs.rs`).
    folder: BTreeMap<String, String>,
}

/// A graph's arrows: node -> the nodes it uses, each with what says so.
type Uses = BTreeMap<String, BTreeMap<String, BTreeSet<String>>>;

impl ModuleGraph {
    fn read(src: &Path) -> Self {
        let files = rust_files(src);
        let modules: BTreeMap<String, PathBuf> = files
            .iter()
            // main.rs is the binary, a crate of its own.
            .filter(|file| !file.ends_with("main.rs"))
            .map(|file| (module_of(src, file), file.clone()))
            .collect();
        let mut test_modules = BTreeSet::new();
        let mut code = BTreeMap::new();
        for (module, file) in &modules {
            let text = std::fs::read_to_string(file).expect("read source");
            let (kept, cfg_test_mods) = strip_test_code(&blank_comments_and_literals(&text));
            for name in cfg_test_mods {
                test_modules.insert(join(module, &name));
            }
            code.insert(module.clone(), kept);
        }
        let known: BTreeSet<&String> = modules
            .keys()
            .filter(|m| {
                !test_modules
                    .iter()
                    .any(|t| *m == t || m.starts_with(&format!("{t}::")))
            })
            .collect();

        let mut uses = Uses::new();
        for module in &known {
            for path in used_paths(&code[*module]) {
                let Some(target) = resolve(module, &path, &known) else {
                    continue;
                };
                if target == **module || is_ancestor(&target, module) {
                    continue;
                }
                uses.entry((*module).clone())
                    .or_default()
                    .entry(target)
                    .or_default()
                    .insert(path.join("::"));
            }
        }
        let folder = modules
            .iter()
            .map(|(module, file)| (module.clone(), folder_of(src, file)))
            .collect();
        Self { uses, folder }
    }

    /// Every strongly connected component of more than one module, its modules sorted.
    fn cycles(&self) -> Vec<Vec<String>> {
        Tarjan::new(&self.uses).run()
    }

    /// The folders' graph: an arrow for each use between modules of two folders, with
    /// the uses that make it (`cloud::edges::csr: crate::cloud::kubernetes::Snapshot`).
    fn folders(&self) -> ModuleGraph {
        self.grouped(|module| Some(self.folder[module].clone()))
    }

    /// The graph of the crate's top-level modules, each with the modules under it
    /// (`cloud::conn::proxy` is `cloud`); the crate root, which declares them, is none.
    fn top_level(&self) -> ModuleGraph {
        self.grouped(|module| {
            let top = module.split("::").next().unwrap_or_default();
            (!top.is_empty()).then(|| top.to_string())
        })
    }

    /// The graph of the groups `group` puts modules in: an arrow for each use between
    /// modules of two groups, with the uses that make it.
    fn grouped(&self, group: impl Fn(&str) -> Option<String>) -> ModuleGraph {
        let mut uses = Uses::new();
        for (module, targets) in &self.uses {
            for (target, paths) in targets {
                let (Some(from), Some(to)) = (group(module), group(target)) else {
                    continue;
                };
                if from != to {
                    let arrow = uses.entry(from).or_default();
                    let arrow = arrow.entry(to).or_default();
                    arrow.extend(paths.iter().map(|path| format!("{module}: {path}")));
                }
            }
        }
        ModuleGraph {
            uses,
            folder: BTreeMap::new(),
        }
    }

    /// The arrows between `a` and `b`, either way, each with the uses that make it.
    fn arrows_between(&self, a: &str, b: &str) -> String {
        [(a, b), (b, a)]
            .into_iter()
            .filter_map(|(from, to)| {
                let paths = self.uses.get(from)?.get(to)?;
                let uses: Vec<&str> = paths.iter().map(String::as_str).collect();
                Some(format!("{from} -> {to}: {}\n", uses.join(", ")))
            })
            .collect()
    }

    /// The cycle's nodes, then each arrow between them with one use that makes it
    /// (`a -> b (by crate::b::f)`), and how many more there are.
    fn describe(&self, cycle: &[String]) -> String {
        let members: BTreeSet<&String> = cycle.iter().collect();
        let mut out = Vec::new();
        for module in cycle {
            for (target, paths) in &self.uses[module] {
                if members.contains(target) {
                    let first = paths.first().expect("an arrow has a use");
                    let more = match paths.len() - 1 {
                        0 => String::new(),
                        n => format!(", and {n} more"),
                    };
                    out.push(format!("{module} -> {target} (by {first}{more})"));
                }
            }
        }
        format!("{}\n    {}", cycle.join(", "), out.join("\n    "))
    }
}

struct Tarjan<'a> {
    graph: &'a Uses,
    index: BTreeMap<&'a str, usize>,
    low: BTreeMap<&'a str, usize>,
    stack: Vec<&'a str>,
    on_stack: BTreeSet<&'a str>,
    components: Vec<Vec<String>>,
}

impl<'a> Tarjan<'a> {
    fn new(graph: &'a Uses) -> Self {
        Self {
            graph,
            index: BTreeMap::new(),
            low: BTreeMap::new(),
            stack: Vec::new(),
            on_stack: BTreeSet::new(),
            components: Vec::new(),
        }
    }

    fn run(mut self) -> Vec<Vec<String>> {
        for module in self.graph.keys() {
            if !self.index.contains_key(module.as_str()) {
                self.visit(module);
            }
        }
        self.components
    }

    fn visit(&mut self, module: &'a str) {
        let n = self.index.len();
        self.index.insert(module, n);
        self.low.insert(module, n);
        self.stack.push(module);
        self.on_stack.insert(module);
        for target in self.graph.get(module).into_iter().flat_map(|t| t.keys()) {
            if !self.index.contains_key(target.as_str()) {
                self.visit(target);
                let low = self.low[module].min(self.low[target.as_str()]);
                self.low.insert(module, low);
            } else if self.on_stack.contains(target.as_str()) {
                let low = self.low[module].min(self.index[target.as_str()]);
                self.low.insert(module, low);
            }
        }
        if self.low[module] == self.index[module] {
            let mut component = Vec::new();
            loop {
                let top = self.stack.pop().expect("module on the stack");
                self.on_stack.remove(top);
                component.push(top.to_string());
                if top == module {
                    break;
                }
            }
            if component.len() > 1 {
                component.sort();
                self.components.push(component);
            }
        }
    }
}

fn rust_files(dir: &Path) -> Vec<PathBuf> {
    let mut files = Vec::new();
    for entry in std::fs::read_dir(dir).expect("read source dir") {
        let path = entry.expect("dir entry").path();
        if path.is_dir() {
            files.extend(rust_files(&path));
        } else if path.extension().is_some_and(|e| e == "rs") {
            files.push(path);
        }
    }
    files.sort();
    files
}

/// `cloud/edges/mod.rs` and `cloud/edges/limit.rs` -> `cloud/edges/`; a file directly in
/// `src/` is a folder of its own (`certs.rs`).
fn folder_of(src: &Path, file: &Path) -> String {
    let relative = file.strip_prefix(src).expect("file under src");
    match relative.parent() {
        Some(dir) if !dir.as_os_str().is_empty() => format!("{}/", dir.display()),
        _ => relative.display().to_string(),
    }
}

/// `cloud/edges/mod.rs` -> `cloud::edges`, `cloud/edges/limit.rs` -> `cloud::edges::limit`,
/// `lib.rs` -> `` (the crate root).
fn module_of(src: &Path, file: &Path) -> String {
    let relative = file
        .strip_prefix(src)
        .expect("file under src")
        .with_extension("");
    let mut parts: Vec<String> = relative
        .components()
        .map(|c| c.as_os_str().to_string_lossy().into_owned())
        .collect();
    if matches!(parts.last().map(String::as_str), Some("mod" | "lib")) {
        parts.pop();
    }
    parts.join("::")
}

fn join(module: &str, name: &str) -> String {
    if module.is_empty() {
        name.to_string()
    } else {
        format!("{module}::{name}")
    }
}

fn parent(module: &str) -> Option<String> {
    if module.is_empty() {
        return None;
    }
    Some(
        module
            .rsplit_once("::")
            .map_or(String::new(), |(p, _)| p.to_string()),
    )
}

fn is_ancestor(ancestor: &str, module: &str) -> bool {
    ancestor.is_empty() || module.starts_with(&format!("{ancestor}::"))
}

/// The module file a path used from `module` lands in: the longest prefix of the path
/// that names a module. None for paths outside the crate.
fn resolve(module: &str, path: &[String], known: &BTreeSet<&String>) -> Option<String> {
    let mut base = module.to_string();
    let mut rest = path;
    match path.first().map(String::as_str) {
        Some("crate") => {
            base = String::new();
            rest = &path[1..];
        }
        Some("self") => rest = &path[1..],
        Some("super") => {
            while rest.first().is_some_and(|s| s == "super") {
                base = parent(&base)?;
                rest = &rest[1..];
            }
        }
        // A bare first segment is a child module of this one (`use child::Thing`), or a
        // crate or a name in scope, which is not a module of this crate's files.
        Some(first) if known.contains(&join(module, first)) => {}
        _ => return None,
    }
    let mut target = base;
    for segment in rest {
        let next = join(&target, segment);
        if !known.contains(&next) {
            break;
        }
        target = next;
    }
    Some(target)
}

/// The source with comments, string and char literals blanked (newlines kept), so that
/// braces and keywords found afterwards are code.
fn blank_comments_and_literals(text: &str) -> String {
    let chars: Vec<char> = text.chars().collect();
    let mut out = String::with_capacity(text.len());
    let mut i = 0;
    while i < chars.len() {
        let end = if chars[i..].starts_with(&['/', '/']) {
            chars[i..]
                .iter()
                .position(|&c| c == '\n')
                .map_or(chars.len(), |n| i + n)
        } else if chars[i..].starts_with(&['/', '*']) {
            block_comment_end(&chars, i)
        } else if let Some(hashes) = raw_string_start(&chars, i) {
            let open = i + chars[i..].iter().position(|&c| c == '"').expect("quote");
            let closing: Vec<char> = std::iter::once('"')
                .chain(std::iter::repeat_n('#', hashes))
                .collect();
            (open + 1..chars.len())
                .find(|&j| chars[j..].starts_with(&closing))
                .map_or(chars.len(), |j| j + closing.len())
        } else if chars[i] == '"' || (chars[i] == '\'' && is_char_literal(&chars, i)) {
            quoted_end(&chars, i)
        } else {
            out.push(chars[i]);
            i += 1;
            continue;
        };
        out.extend(
            chars[i..end]
                .iter()
                .map(|&c| if c == '\n' { '\n' } else { ' ' }),
        );
        i = end;
    }
    out
}

/// Just past the block comment that starts at `i`, nested ones included.
fn block_comment_end(chars: &[char], mut i: usize) -> usize {
    let mut depth = 0;
    while i < chars.len() {
        if chars[i..].starts_with(&['/', '*']) {
            depth += 1;
            i += 2;
        } else if chars[i..].starts_with(&['*', '/']) {
            depth -= 1;
            i += 2;
            if depth == 0 {
                return i;
            }
        } else {
            i += 1;
        }
    }
    i
}

/// Just past the string or char literal whose opening quote is at `i`.
fn quoted_end(chars: &[char], i: usize) -> usize {
    let quote = chars[i];
    let mut j = i + 1;
    while j < chars.len() && chars[j] != quote {
        j += if chars[j] == '\\' { 2 } else { 1 };
    }
    j + 1
}

/// The number of hashes if a raw (byte) string starts at `i`.
fn raw_string_start(chars: &[char], i: usize) -> Option<usize> {
    if i > 0 && (chars[i - 1].is_alphanumeric() || chars[i - 1] == '_') {
        return None;
    }
    let mut j = i;
    if chars[j] == 'b' {
        j += 1;
    }
    if chars.get(j) != Some(&'r') {
        return None;
    }
    j += 1;
    let hashes = chars[j..].iter().take_while(|&&c| c == '#').count();
    (chars.get(j + hashes) == Some(&'"')).then_some(hashes)
}

/// A quote starts a char literal (`'a'`, `'\n'`, `'\u{1F600}'`), not a lifetime (`'a`).
fn is_char_literal(chars: &[char], i: usize) -> bool {
    match chars.get(i + 1) {
        Some('\\') => true,
        Some(_) => chars.get(i + 2) == Some(&'\''),
        None => false,
    }
}

/// The code without the items under `#[cfg(test)]`, and the names of the `mod` items among
/// them (whose files are test code too).
fn strip_test_code(code: &str) -> (String, Vec<String>) {
    const ATTR: &str = "#[cfg(test)]";
    let mut kept = String::new();
    let mut test_mods = Vec::new();
    let mut rest = code;
    while let Some(at) = rest.find(ATTR) {
        kept.push_str(&rest[..at]);
        let item = &rest[at + ATTR.len()..];
        let end = item_end(item);
        let words: Vec<&str> = item[..end]
            .split(|c: char| !(c.is_alphanumeric() || c == '_'))
            .filter(|w| !w.is_empty())
            .collect();
        if let Some(pos) = words.iter().position(|&w| w == "mod") {
            test_mods.push(words[pos + 1].to_string());
        }
        rest = &item[end..];
    }
    kept.push_str(rest);
    (kept, test_mods)
}

/// Where the item at the start of `item` ends: after its `;` (`mod tests;`, a `use`) or
/// after the brace block it opens.
fn item_end(item: &str) -> usize {
    let is_use = item.trim_start().starts_with("use ") || item.trim_start().starts_with("pub use ");
    let mut depth = 0;
    for (i, c) in item.char_indices() {
        match c {
            ';' if depth == 0 || is_use => return i + 1,
            '{' => depth += 1,
            '}' => {
                depth -= 1;
                if depth == 0 && !is_use {
                    return i + 1;
                }
            }
            _ => {}
        }
    }
    item.len()
}

/// Every path the code uses that can name a module of this crate: those of its `use`
/// trees, expanded, and the `crate::`/`super::`/`self::` paths written inline.
fn used_paths(code: &str) -> Vec<Vec<String>> {
    let tokens = tokenize(code);
    let mut paths = Vec::new();
    let mut i = 0;
    while i < tokens.len() {
        if tokens[i] == "use" {
            let end = i + tokens[i..]
                .iter()
                .position(|t| t == ";")
                .expect("use ends with ;");
            let mut at = i + 1;
            expand_use_tree(&tokens[..end], &mut at, Vec::new(), &mut paths);
            i = end;
        } else if matches!(tokens[i].as_str(), "crate" | "super" | "self")
            && tokens.get(i + 1).is_some_and(|t| t == "::")
            && (i == 0 || !matches!(tokens[i - 1].as_str(), "::" | "in"))
        {
            let mut path = vec![tokens[i].clone()];
            let mut j = i + 1;
            while tokens.get(j).is_some_and(|t| t == "::")
                && tokens.get(j + 1).is_some_and(|t| is_ident(t))
            {
                path.push(tokens[j + 1].clone());
                j += 2;
            }
            paths.push(path);
            i = j;
        } else {
            i += 1;
        }
    }
    paths
}

/// Expands the use tree at `tokens[*at..]` under `prefix`: `a::{b, c::d as e, f::*}` gives
/// `a::b`, `a::c::d`, `a::f`.
fn expand_use_tree(
    tokens: &[String],
    at: &mut usize,
    prefix: Vec<String>,
    out: &mut Vec<Vec<String>>,
) {
    let mut path = prefix;
    if tokens.get(*at).is_some_and(|t| t == "::") {
        // `::name`: another crate, which `resolve` leaves out.
        path.push("::".to_string());
        *at += 1;
    }
    loop {
        match tokens.get(*at).map(String::as_str) {
            Some("{") => {
                *at += 1;
                while tokens.get(*at).is_some_and(|t| t != "}") {
                    expand_use_tree(tokens, at, path.clone(), out);
                    if tokens.get(*at).is_some_and(|t| t == ",") {
                        *at += 1;
                    }
                }
                *at += 1;
                return;
            }
            Some("*") => {
                *at += 1;
                out.push(path);
                return;
            }
            Some(segment) if is_ident(segment) => {
                if segment != "self" || path.is_empty() {
                    path.push(segment.to_string());
                }
                *at += 1;
                if tokens.get(*at).is_some_and(|t| t == "::") {
                    *at += 1;
                    continue;
                }
                if tokens.get(*at).is_some_and(|t| t == "as") {
                    *at += 2;
                }
                out.push(path);
                return;
            }
            _ => return,
        }
    }
}

fn is_ident(token: &str) -> bool {
    token
        .chars()
        .next()
        .is_some_and(|c| c.is_alphabetic() || c == '_')
}

/// Identifiers, `::`, and single punctuation characters.
fn tokenize(code: &str) -> Vec<String> {
    let chars: Vec<char> = code.chars().collect();
    let mut tokens = Vec::new();
    let mut i = 0;
    while i < chars.len() {
        let c = chars[i];
        if c.is_alphanumeric() || c == '_' {
            let start = i;
            while i < chars.len() && (chars[i].is_alphanumeric() || chars[i] == '_') {
                i += 1;
            }
            tokens.push(chars[start..i].iter().collect());
        } else if c == ':' && chars.get(i + 1) == Some(&':') {
            tokens.push("::".to_string());
            i += 2;
        } else {
            if !c.is_whitespace() {
                tokens.push(c.to_string());
            }
            i += 1;
        }
    }
    tokens
}

/// The check itself: a cycle through a `use` tree, an inline `crate::` path and a chain
/// of three modules is found; uses of an ancestor, of code under `#[cfg(test)]`, in
/// comments and strings, and of other crates are not edges. Between folders: a parent
/// whose file uses a child folder that uses the parent's other file back is a loop
/// (`q/` and `q/r/`, though no module loops), a child's use of its parent's `mod.rs` is
/// not (`p/` and `p/sub/`), and the files directly in `src/` are folders of their own.
/// Between top-level modules, `q`'s loop is inside one, and an arrow one way (`a -> p`)
/// is found by `arrows_between`.
#[test]
fn finds_cycles_and_only_cycles() {
    let src = std::env::temp_dir().join(format!("module_cycles_{}", std::process::id()));
    let files = [
        (
            "lib.rs",
            "pub mod a;\npub mod b;\npub mod c;\npub mod p;\npub mod q;\n",
        ),
        ("a.rs", "use crate::{b::{self, Thing as T}, p};\n"),
        ("b.rs", "fn f() { crate::c::g(); }\n// use crate::a;\n"),
        (
            "c.rs",
            "use super::a::X;\nconst S: &str = \"use crate::b;\";\n",
        ),
        (
            "p/mod.rs",
            "pub mod child;\npub mod sub;\nuse child::Y;\nuse sub::U;\n",
        ),
        (
            "p/child.rs",
            "use super::Z;\nuse std::fmt;\n#[cfg(test)]\nmod tests {\n    use crate::a;\n}\n",
        ),
        ("p/sub/mod.rs", "use super::Z;\n"),
        ("q/mod.rs", "pub mod r;\npub mod s;\npub mod t;\n"),
        ("q/s.rs", "use super::r::V;\n"),
        ("q/t.rs", "pub struct W;\n"),
        ("q/r/mod.rs", "use crate::q::t::W;\n"),
    ];
    for (path, text) in files {
        let path = src.join(path);
        std::fs::create_dir_all(path.parent().expect("parent")).expect("mkdir");
        std::fs::write(path, text).expect("write");
    }
    let graph = ModuleGraph::read(&src);
    std::fs::remove_dir_all(&src).expect("clean up");
    assert_eq!(graph.cycles(), vec![vec!["a", "b", "c"]]);
    let described = graph.describe(&["a".into(), "b".into(), "c".into()]);
    assert!(described.contains("b -> c (by crate::c::g)"), "{described}");

    let folders = graph.folders();
    let mut cycles = folders.cycles();
    cycles.sort();
    assert_eq!(
        cycles,
        vec![vec!["a.rs", "b.rs", "c.rs"], vec!["q/", "q/r/"]]
    );
    let described = folders.describe(&["q/".into(), "q/r/".into()]);
    assert!(
        described.contains("q/ -> q/r/ (by q::s: super::r::V)")
            && described.contains("q/r/ -> q/ (by q::r: crate::q::t::W)"),
        "{described}"
    );

    let top = graph.top_level();
    assert_eq!(top.cycles(), vec![vec!["a", "b", "c"]]);
    assert_eq!(top.arrows_between("p", "a"), "a -> p: a: crate::p\n");
    assert_eq!(top.arrows_between("p", "q"), "");
}
