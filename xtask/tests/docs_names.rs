//! What the docs name exists. README.md, docs/*.md and deploy/README.md point readers
//! at files, modules and config keys; a rename that leaves them behind sends the reader
//! to nothing, and nothing else fails. So every name they give in a code span is looked
//! up in the tree, and the relative links are followed:
//!
//! - a repository path (`cloud/edges/registry.rs`, `tunnel-user/src/call/`,
//!   `patches/*.diff`): a file or folder whose path ends so;
//! - a Rust path (`cloud::peer::Peers`, `io::transport::server_handshake`,
//!   `Opener::open`): modules whose files exist, then an item declared in them, then a
//!   member named in a file that declares or implements the item;
//! - a config key (`tunnel.max_edges`, `[redirect] ports`, `[[reverse.forward]]`,
//!   `optimistic_ok = "recent"`, and each key of docs/configuration.md's tables under
//!   its section): a field of the config structs of `tunnel-user/src/config/`, walked
//!   from `CloudConfig` or `EdgeConfig` as serde reads them;
//! - a link (`[text](../deploy/README.md#rotating-the-ca)`): the file, and the heading
//!   its anchor names;
//! - a section cited by its title (`docs/design.md, "Capabilities"`) or a performance
//!   knob by its number (`design.md, knob 11`): a heading that starts so, an item of
//!   design.md's numbered list of knobs. The code, configs and scripts cite them too,
//!   so those are read for the citations alone.
//!
//! Fenced code blocks are left alone: they are shell sessions and file contents, whose
//! paths are the user's. Each failure names the document, the line and what is missing.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

#[test]
fn docs_name_only_what_exists() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("..");
    let tree = Tree::read(&root);
    let config = ConfigKeys::read(&root.join("tunnel-user/src/config"));
    let mut report = String::new();
    for doc in docs(&root) {
        let text = std::fs::read_to_string(&doc).expect("read doc");
        let name = doc
            .strip_prefix(&root)
            .unwrap_or(&doc)
            .display()
            .to_string();
        for problem in check_doc(&doc, &text, &tree, &config) {
            report.push_str(&format!("{name}:{problem}\n"));
        }
    }
    assert!(report.is_empty(), "stale names in the docs:\n{report}");
}

/// The files besides the docs that cite sections of them: sources, configs, manifests
/// and scripts (not fuzz inputs or the patched crates, whose text is not ours).
#[test]
fn code_cites_only_doc_sections_that_exist() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("..");
    let tree = Tree::read(&root);
    let mut report = String::new();
    for path in &tree.paths {
        let cites = ["rs", "toml", "yaml", "sh"]
            .iter()
            .any(|ext| path.ends_with(&format!(".{ext}")));
        let skipped = ["patches/", "fuzz/corpus/", "xtask/tests/docs_names.rs"];
        if !cites || skipped.iter().any(|skip| path.starts_with(skip)) {
            continue;
        }
        let file = root.join(path);
        // Only the comments cite: a string that ends in `.md` is the code's own.
        let marker = if path.ends_with(".rs") { "//" } else { "#" };
        let text: String = std::fs::read_to_string(&file)
            .expect("read file")
            .lines()
            .map(|line| line.split_once(marker).map_or("", |(_, comment)| comment))
            .collect::<Vec<_>>()
            .join("\n");
        for problem in check_citations(&file, &text) {
            report.push_str(&format!("{path}:{problem}\n"));
        }
    }
    assert!(
        report.is_empty(),
        "citations of doc sections that do not exist:\n{report}"
    );
}

/// The planted names a reader could meet are caught: the check is not vacuous.
#[test]
fn stale_names_are_found() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("..");
    let tree = Tree::read(&root);
    let config = ConfigKeys::read(&root.join("tunnel-user/src/config"));
    let doc = root.join("docs/planted.md");
    let text = "`cloud/dial/mod.rs`, `tunnel-user/src/stream/`, `cloud::dial::OpenGuard`,\n\
                `Opener::opened`, `tunnel.max_edgez`, `[redirect] portz`,\n\
                `[[reverse.forwardz]]`, `optimistic_okay = true`, [a](missing.md),\n\
                [b](configuration.md#no-such-heading), design.md, \"No such section\", knob 99.\n\
                \n\
                ## Cloud\n\
                ### `[tunnel]`\n\
                | key | default |\n\
                |---|---|\n\
                | `listen`, `max_edges_per_node` | none |\n";
    let found = check_doc(&doc, text, &tree, &config);
    for stale in [
        "cloud/dial/mod.rs",
        "tunnel-user/src/stream/",
        "cloud::dial::OpenGuard",
        "Opener::opened",
        "tunnel.max_edgez",
        "[redirect] portz",
        "[[reverse.forwardz]]",
        "optimistic_okay",
        "missing.md",
        "#no-such-heading",
        "tunnel.max_edges_per_node",
        "No such section",
        "knob 99",
    ] {
        assert!(
            found.iter().any(|problem| problem.contains(stale)),
            "`{stale}` was not reported; found:\n{}",
            found.join("\n")
        );
    }
    assert_eq!(
        found.len(),
        13,
        "one problem per planted name:\n{}",
        found.join("\n")
    );
}

fn docs(root: &Path) -> Vec<PathBuf> {
    let mut docs = vec![root.join("README.md"), root.join("deploy/README.md")];
    let mut in_docs: Vec<PathBuf> = std::fs::read_dir(root.join("docs"))
        .expect("read docs/")
        .map(|entry| entry.expect("docs/ entry").path())
        .filter(|path| path.extension().is_some_and(|ext| ext == "md"))
        .collect();
    in_docs.sort();
    docs.extend(in_docs);
    docs
}

/// Every problem of one document, each as `line: what`.
fn check_doc(doc: &Path, text: &str, tree: &Tree, config: &ConfigKeys) -> Vec<String> {
    let mut problems = Vec::new();
    let mut table = TableSection::default();
    for (line_no, line, spans) in prose_spans(text) {
        let mut say = |what: String| problems.push(format!("{line_no}: {what}"));
        table.heading(line);
        for span in &spans {
            for problem in check_span(span, tree, config) {
                say(problem);
            }
        }
        if let Some(keys) = table.keys(line) {
            for key in keys {
                if !config.exists(&key, table.roots()) {
                    say(format!("`{key}` is no config key"));
                }
            }
        }
        for target in links(line) {
            if let Some(problem) = check_link(doc, &target) {
                say(problem);
            }
        }
    }
    problems.extend(check_citations(doc, text));
    problems
}

/// Sections cited by title after the document's name (`design.md, "Relays"`, also across
/// a line break) and knobs by number (`knob 11`, `knobs 2 and 16`), each as `line: what`.
fn check_citations(file: &Path, text: &str) -> Vec<String> {
    let lines: Vec<&str> = text.lines().collect();
    let mut problems = Vec::new();
    for (i, line) in lines.iter().enumerate() {
        let next = lines.get(i + 1).map_or("", |next| {
            next.trim_start()
                .trim_start_matches(['/', '!', '#'])
                .trim_start()
        });
        let joined = format!("{line} {next}");
        for (doc, title) in titled_citations(&joined, line.len()) {
            if let Some(problem) = check_titled_citation(file, &doc, &title) {
                problems.push(format!("{}: {problem}", i + 1));
            }
        }
        for knob in knob_citations(line) {
            if !design_knobs().contains(&knob) {
                problems.push(format!(
                    "{}: design.md has no performance knob {knob}",
                    i + 1
                ));
            }
        }
    }
    problems
}

/// `(document, title)` of each `doc.md, "Title"`, `doc.md "Title"` or
/// ``doc.md` ("Title"`` whose `.md` lies before `within`.
fn titled_citations(text: &str, within: usize) -> Vec<(String, String)> {
    let mut out = Vec::new();
    for (at, _) in text.match_indices(".md").filter(|(at, _)| *at < within) {
        let start = text[..at]
            .rfind(|c: char| !(c.is_ascii_alphanumeric() || "_-/.".contains(c)))
            .map_or(0, |i| i + 1);
        let rest = text[at + 3..].trim_start_matches(['`', ',', ' ', '(']);
        if let Some(quoted) = rest.strip_prefix('"')
            && let Some((title, _)) = quoted.split_once('"')
        {
            out.push((text[start..at + 3].to_string(), title.to_string()));
        }
    }
    out
}

fn check_titled_citation(file: &Path, doc: &str, title: &str) -> Option<String> {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("..");
    let folder = file.parent().expect("a file's folder");
    let candidates = [
        folder.join(doc),
        root.join(doc),
        root.join("docs").join(doc),
    ];
    let Some(path) = candidates.iter().find(|path| path.is_file()) else {
        return Some(format!("`{doc}`, cited for \"{title}\", is no file"));
    };
    let text = std::fs::read_to_string(path).ok()?;
    let has = sections(&text)
        .iter()
        .any(|section| section.replace('`', "").starts_with(title));
    (!has).then(|| format!("{doc} has no section \"{title}\""))
}

/// The numbers in `knob N`, `knobs N and M`, `knobs N, M`.
fn knob_citations(line: &str) -> Vec<u32> {
    let mut out = Vec::new();
    for (at, word) in line.match_indices("knob") {
        let rest = line[at + word.len()..].trim_start_matches('s');
        if !rest.starts_with(' ') {
            continue;
        }
        for part in rest.split(' ').filter(|p| !p.is_empty()) {
            let number = part.trim_end_matches([',', '.', ')', ';', ':']);
            match number.parse() {
                Ok(n) => {
                    out.push(n);
                    // `knob 6), 0 one per core`: the list ends at anything but a comma.
                    if !matches!(&part[number.len()..], "" | ",") {
                        break;
                    }
                }
                Err(_) if part == "and" => {}
                Err(_) => break,
            }
        }
    }
    out
}

/// The numbers of design.md's performance knobs (`11. **Idle memory.**`).
fn design_knobs() -> BTreeSet<u32> {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("..");
    let text = std::fs::read_to_string(root.join("docs/design.md")).expect("read design.md");
    let knobs = text
        .split_once("## Performance knobs")
        .map_or("", |(_, knobs)| knobs);
    knobs
        .lines()
        .take_while(|line| !line.starts_with("## "))
        .filter_map(|line| line.split_once(". **").and_then(|(n, _)| n.parse().ok()))
        .collect()
}

/// The lines outside fenced code blocks, each with its number and the code spans that
/// start on it (a span may run onto the next line, as wrapped prose does; a backtick
/// still open at a blank line was a stray one).
fn prose_spans(text: &str) -> Vec<(usize, &str, Vec<String>)> {
    let mut out: Vec<(usize, &str, Vec<String>)> = Vec::new();
    let mut fenced = false;
    let mut open: Option<(usize, String)> = None;
    for (i, line) in text.lines().enumerate() {
        if line.trim_start().starts_with("```") {
            fenced = !fenced;
            continue;
        }
        if fenced {
            continue;
        }
        if line.trim().is_empty() {
            open = None;
        }
        out.push((i + 1, line, Vec::new()));
        for (j, part) in line.split('`').enumerate() {
            if j > 0 {
                match open.take() {
                    Some((start, span)) => {
                        let at = out.iter_mut().rev().find(|(n, _, _)| *n == start);
                        at.expect("the span's first line").2.push(span);
                        continue;
                    }
                    None => open = Some((i + 1, String::new())),
                }
            }
            if let Some((_, span)) = &mut open {
                if !span.is_empty() {
                    span.push(' ');
                }
                span.push_str(part);
            }
        }
    }
    out
}

/// Every problem of one code span.
fn check_span(span: &str, tree: &Tree, config: &ConfigKeys) -> Vec<String> {
    let span = span.trim();
    // `[section]`, `[[section]]`, `[section] key`, `[section] key = value`.
    if let Some(rest) = span.strip_prefix('[')
        && let Some((section, after)) = rest.trim_start_matches('[').split_once(']')
        && is_key_path(section)
    {
        let after = after.trim_start_matches(']').trim();
        let key = after.split([' ', '=']).next().unwrap_or("");
        let full = if is_key(key) {
            format!("{section}.{key}")
        } else {
            section.to_string()
        };
        if config.exists(&full, Roots::Both) || config.is_superedge(&full) {
            return Vec::new();
        }
        return vec![format!("`{span}` is no config section or key")];
    }
    // `key = value`, as a config file writes it.
    if let Some((key, _)) = span.split_once(" = ")
        && is_key_path(key)
    {
        if config.exists(key, Roots::Both) || config.is_any_field(key) {
            return Vec::new();
        }
        return vec![format!("`{key}` (in `{span}`) is no config key")];
    }
    let mut problems = Vec::new();
    for token in span.split_whitespace() {
        let token = token
            .trim_start_matches(['(', '"', '\''])
            .trim_end_matches([',', ';', ':', ')', '"', '\'', '.']);
        let token = token.strip_suffix("()").unwrap_or(token);
        if token.contains("::") {
            if let Some(problem) = tree.check_rust_path(token) {
                problems.push(problem);
            }
        } else if looks_like_repo_path(token, tree) {
            if !tree.has_path(token) {
                problems.push(format!("`{token}` is no file or folder of the repository"));
            }
        } else if config.is_dotted_key(token)
            && !tree.is_file_name(token)
            && !config.exists(token, Roots::Both)
        {
            problems.push(format!("`{token}` is no config key"));
        }
    }
    problems
}

fn is_key(s: &str) -> bool {
    let mut chars = s.chars();
    chars.next().is_some_and(|c| c.is_ascii_lowercase())
        && chars.all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == '_')
}

fn is_key_path(s: &str) -> bool {
    !s.is_empty() && s.split('.').all(is_key)
}

/// A path into the repository, as opposed to a host path (`/sys/fs/bpf`), a URL, a
/// Kubernetes name (`node-role.kubernetes.io/edge`) or a program section
/// (`cgroup/connect4`): relative, and naming a folder (`call/`) or a file with an
/// extension the repository's files have. A bare file name counts only for the
/// source and doc files the docs point at (`heap.rs`).
fn looks_like_repo_path(token: &str, tree: &Tree) -> bool {
    let plain = token
        .chars()
        .all(|c| c.is_ascii_alphanumeric() || "_.-/*".contains(c));
    let built = token.split('/').any(|part| part == "target");
    if !plain || token.starts_with(['/', '.', '-']) || built || NOT_OURS.contains(&token) {
        return false;
    }
    let last = token.trim_end_matches('/').rsplit('/').next().unwrap_or("");
    let ext = last.rsplit_once('.').map(|(_, ext)| ext);
    if token.contains('/') {
        token.ends_with('/') || ext.is_some_and(|ext| tree.extensions.contains(ext))
    } else {
        ext.is_some_and(|ext| ["rs", "md", "sh", "proto"].contains(&ext))
    }
}

/// Folders the docs name that are the user's or the host's, not the repository's.
const NOT_OURS: &[&str] = &[
    "certs/",      // where `tunnel certs --out certs` writes
    "my-cluster/", // deploy/README.md's overlay
    "unified/",    // /sys/fs/cgroup/unified/ on hybrid hosts
];

/// The link targets of a line: `[text](target)`, web addresses left out.
fn links(line: &str) -> Vec<String> {
    let mut out = Vec::new();
    let mut rest = line;
    while let Some(at) = rest.find("](") {
        rest = &rest[at + 2..];
        let Some(end) = rest.find(')') else { break };
        let target = &rest[..end];
        if !target.contains("://") && !target.starts_with("mailto:") && !target.contains(' ') {
            out.push(target.to_string());
        }
        rest = &rest[end..];
    }
    out
}

fn check_link(doc: &Path, target: &str) -> Option<String> {
    let (file, anchor) = match target.split_once('#') {
        Some((file, anchor)) => (file, Some(anchor)),
        None => (target, None),
    };
    let path = if file.is_empty() {
        doc.to_path_buf()
    } else {
        doc.parent().expect("doc's folder").join(file)
    };
    if !path.exists() {
        return Some(format!("link `{target}`: no file {file}"));
    }
    let anchor = anchor?;
    let text = std::fs::read_to_string(&path).ok()?;
    let slugs = heading_slugs(&text);
    (!slugs.contains(anchor)).then(|| format!("link `{target}`: {file} has no heading #{anchor}"))
}

/// A document's headings, outside fenced code blocks.
fn headings(text: &str) -> Vec<String> {
    let mut out = Vec::new();
    let mut fenced = false;
    for line in text.lines() {
        if line.trim_start().starts_with("```") {
            fenced = !fenced;
        }
        if let Some(title) = line.strip_prefix('#').filter(|_| !fenced) {
            out.push(title.trim_start_matches('#').trim().to_string());
        }
    }
    out
}

/// A document's headings and the bold titles that open its paragraphs and list items
/// (`**Rotating the CA.**`).
fn sections(text: &str) -> Vec<String> {
    let mut out = headings(text);
    for line in text.lines() {
        let line = line.trim_start().trim_start_matches(['-', ' ']);
        let line = line
            .trim_start_matches(|c: char| c.is_ascii_digit() || c == '.')
            .trim_start();
        if let Some(bold) = line.strip_prefix("**")
            && let Some((title, _)) = bold.split_once("**")
        {
            out.push(title.to_string());
        }
    }
    out
}

/// GitHub's anchors for a document's headings: lower case, punctuation but `-` and `_`
/// dropped, spaces as `-`, a repeated one suffixed `-1`, `-2`, ...
fn heading_slugs(text: &str) -> BTreeSet<String> {
    let mut seen: BTreeMap<String, usize> = BTreeMap::new();
    let mut slugs = BTreeSet::new();
    for title in headings(text) {
        let slug: String = title
            .to_lowercase()
            .chars()
            .filter(|c| c.is_alphanumeric() || *c == '-' || *c == '_' || *c == ' ')
            .map(|c| if c == ' ' { '-' } else { c })
            .collect();
        let n = seen.entry(slug.clone()).or_default();
        slugs.insert(if *n == 0 {
            slug.clone()
        } else {
            format!("{slug}-{n}")
        });
        *n += 1;
    }
    slugs
}

/// The config tables of docs/configuration.md: `| `key`, `key` | ... |` rows under a
/// `## Cloud`, `## Edge` or `## Both` heading and a `### ...[section]...` one.
#[derive(Default)]
struct TableSection {
    roots: Option<Roots>,
    section: Option<String>,
}

impl TableSection {
    fn heading(&mut self, line: &str) {
        if let Some(title) = line.strip_prefix("## ") {
            self.roots = match title.trim() {
                "Cloud" => Some(Roots::Cloud),
                "Edge" => Some(Roots::Edge),
                "Both" => Some(Roots::Both),
                _ => None,
            };
            self.section = None;
        } else if let Some(title) = line.strip_prefix("### ") {
            self.section = match title.trim() {
                "Top level" => Some(String::new()),
                title => title
                    .split('`')
                    .nth(1)
                    .map(|s| s.trim_matches(['[', ']']).to_string())
                    .filter(|s| is_key_path(s)),
            };
        }
    }

    fn roots(&self) -> Roots {
        self.roots.unwrap_or(Roots::Both)
    }

    /// The keys a table row names, as full dotted keys.
    fn keys(&self, line: &str) -> Option<Vec<String>> {
        self.roots?;
        let section = self.section.as_ref()?;
        let cell = line.strip_prefix('|')?.split('|').next()?;
        let keys: Vec<String> = cell
            .split('`')
            .skip(1)
            .step_by(2)
            .filter(|key| key.chars().all(|c| c.is_ascii_alphanumeric() || c == '_'))
            .filter(|key| *key != "key")
            .map(|key| {
                if section.is_empty() {
                    key.to_string()
                } else {
                    format!("{section}.{key}")
                }
            })
            .collect();
        Some(keys)
    }
}

/// The files and folders of the repository, and the Rust items their sources declare.
struct Tree {
    /// Every file and folder, relative to the root, with `/` separators.
    paths: BTreeSet<String>,
    /// The extensions the files have.
    extensions: BTreeSet<String>,
    /// Each Rust source: its module path (with and without its crate's name), its text.
    sources: Vec<Source>,
}

struct Source {
    modules: Vec<Vec<String>>,
    /// What the file declares; for `tunnel.proto`, the messages, enums and services
    /// prost and tonic generate types of.
    declared: BTreeSet<String>,
    /// The modules declared inline (`mod tests { ... }`).
    inline_modules: BTreeSet<String>,
    text: String,
    /// Under `tunnel-user/src`: the code users run, not a test or a tool.
    is_shipped: bool,
    /// The fields of the file's structs.
    fields: BTreeSet<String>,
    /// The types an `impl` block of the file is for.
    implemented: BTreeSet<String>,
    words: BTreeSet<String>,
}

/// Where each crate's modules start, and the name its paths begin with.
const CRATE_ROOTS: &[(&str, &str)] = &[
    ("tunnel-user/src", "tunnel_user"),
    ("tunnel-user/tests", ""),
    ("tunnel-user/benches", ""),
    ("proto/src", "proto"),
    ("tunnel-common/src", "tunnel_common"),
    ("tunnel-ebpf/src", "tunnel_ebpf"),
    ("xtask/src", "xtask"),
    ("xtask/tests", ""),
    ("xtask/bench/src", "bench"),
    ("fuzz-checks/src", "fuzz_checks"),
    ("fuzz/fuzz_targets", ""),
];

impl Tree {
    fn read(root: &Path) -> Self {
        let mut paths = BTreeSet::new();
        let mut extensions = BTreeSet::new();
        walk(root, root, &mut paths);
        for path in &paths {
            if let Some((_, ext)) = path.rsplit('/').next().and_then(|f| f.rsplit_once('.')) {
                extensions.insert(ext.to_string());
            }
        }
        let mut sources = Vec::new();
        for (dir, crate_name) in CRATE_ROOTS {
            let prefix = format!("{dir}/");
            for path in paths
                .iter()
                .filter(|p| p.starts_with(&prefix) && p.ends_with(".rs"))
            {
                let relative = &path[prefix.len()..];
                let mut module: Vec<String> = relative
                    .trim_end_matches(".rs")
                    .split('/')
                    .map(str::to_string)
                    .collect();
                if matches!(
                    module.last().map(String::as_str),
                    Some("mod" | "lib" | "main")
                ) {
                    module.pop();
                }
                let mut modules = vec![module.clone()];
                if !crate_name.is_empty() {
                    let mut named = vec![crate_name.to_string()];
                    named.extend(module);
                    modules.push(named);
                }
                let text = std::fs::read_to_string(root.join(path)).expect("read source");
                sources.push(Source {
                    modules,
                    declared: declared_items(&text),
                    inline_modules: inline_modules(&text),
                    implemented: implemented_types(&text),
                    fields: fields(&text),
                    words: words(&text),
                    text,
                    is_shipped: *dir == "tunnel-user/src",
                });
            }
        }
        let proto = std::fs::read_to_string(root.join("proto/tunnel.proto")).expect("read proto");
        let tokens: Vec<&str> = proto.split_whitespace().collect();
        let declared = tokens
            .windows(2)
            .filter(|pair| matches!(pair[0], "message" | "enum" | "service"))
            .map(|pair| pair[1].to_string())
            .collect();
        sources.push(Source {
            modules: vec![vec!["proto".to_string()]],
            declared,
            inline_modules: BTreeSet::new(),
            implemented: BTreeSet::new(),
            fields: BTreeSet::new(),
            words: words(&proto),
            text: proto,
            is_shipped: false,
        });
        Tree {
            paths,
            extensions,
            sources,
        }
    }

    /// A path exists when a file or folder's path is it or ends with `/` and it; `*`
    /// stands for any run of characters within a name.
    /// A file's name (`cloud.crt`, `cloud.yaml`) rather than a dotted key: it ends with
    /// an extension, though not one that is also a key (`tunnel.key`, `tunnel.cert`).
    fn is_file_name(&self, token: &str) -> bool {
        let ext = token.rsplit('.').next().unwrap_or("");
        !matches!(ext, "key" | "cert")
            && (self.extensions.contains(ext) || ext == "crt" || ext == "pem")
    }

    fn has_path(&self, token: &str) -> bool {
        let wanted = token.trim_end_matches('/');
        self.paths.iter().any(|path| {
            let parts: Vec<&str> = path.split('/').collect();
            let want: Vec<&str> = wanted.split('/').collect();
            parts.len() >= want.len()
                && parts[parts.len() - want.len()..]
                    .iter()
                    .zip(&want)
                    .all(|(part, want)| glob(want, part))
        })
    }

    /// `None` when the path names something declared, else what is missing. Paths into
    /// other crates (`tokio::time::pause`) are not looked up.
    fn check_rust_path(&self, token: &str) -> Option<String> {
        let segments: Vec<&str> = token
            .split("::")
            .filter(|s| !matches!(*s, "crate" | "self" | "super"))
            .map(|s| s.split('<').next().unwrap_or(s))
            .collect();
        if segments.is_empty() || segments.iter().any(|s| !is_ident(s)) {
            return None;
        }
        let first = segments[0];
        let quoted = format!("\"{token}\"");
        if self
            .sources
            .iter()
            .any(|s| s.is_shipped && s.text.contains(&quoted))
        {
            // A string of the shipped code: a log target (`tunnel::ebpf`).
            return None;
        }
        if is_type_name(first) {
            if !self.sources.iter().any(|s| s.declared.contains(first)) {
                // Not one of ours: another crate's type (`Duration::from_secs`).
                return None;
            }
            return (!self.items_exist(&self.sources.iter().collect::<Vec<_>>(), &segments))
                .then(|| format!("`{token}`: no `{}` in `{first}`", segments[1..].join("::")));
        }
        if !self
            .sources
            .iter()
            .any(|s| s.has_module_ending(&segments[..1]))
        {
            // Not one of ours: another crate's module (`aya::sys::...`, `std::...`).
            return None;
        }
        // Leading modules, then an item, then at most a member of that item.
        let mut longest = 0;
        for take in (1..=segments.len()).rev() {
            let subtree: Vec<&Source> = self
                .sources
                .iter()
                .filter(|s| s.is_within(&segments[..take]))
                .collect();
            if subtree.is_empty() {
                continue;
            }
            longest = longest.max(take);
            if self.items_exist(&subtree, &segments[take..]) {
                return None;
            }
        }
        Some(format!(
            "`{token}`: module `{}` declares no `{}`",
            segments[..longest].join("::"),
            segments[longest..].join("::")
        ))
    }

    /// `items` is empty, or an item declared in one of `sources`, or a type declared
    /// there and a member named in a file that declares or implements it.
    fn items_exist(&self, sources: &[&Source], items: &[&str]) -> bool {
        match items {
            [] => true,
            [module, rest @ ..] if sources.iter().any(|s| s.inline_modules.contains(*module)) => {
                let within: Vec<&Source> = sources
                    .iter()
                    .copied()
                    .filter(|s| s.inline_modules.contains(*module))
                    .collect();
                self.items_exist(&within, rest)
            }
            [item] => sources.iter().any(|s| s.declared.contains(*item)),
            [ty, member] if is_type_name(ty) => {
                sources.iter().any(|s| s.declared.contains(*ty))
                    && self.sources.iter().any(|s| {
                        // A method or constant is declared there; a variant or a field
                        // is named there.
                        let named = if member.starts_with(|c: char| c.is_ascii_lowercase()) {
                            s.declared.contains(*member) || s.fields.contains(*member)
                        } else {
                            s.words.contains(*member)
                        };
                        (s.declared.contains(*ty) || s.implemented.contains(*ty)) && named
                    })
            }
            _ => false,
        }
    }
}

fn is_type_name(s: &str) -> bool {
    s.starts_with(|c: char| c.is_ascii_uppercase()) && s.chars().any(|c| c.is_ascii_lowercase())
}

impl Source {
    fn has_module_ending(&self, segments: &[&str]) -> bool {
        self.modules.iter().any(|module| {
            module.len() >= segments.len()
                && module[module.len() - segments.len()..]
                    .iter()
                    .zip(segments)
                    .all(|(a, b)| a == b)
        })
    }

    /// This file is the module whose path ends with `segments`, or lies under it.
    fn is_within(&self, segments: &[&str]) -> bool {
        self.modules.iter().any(|module| {
            (segments.len()..=module.len()).any(|end| {
                module[end - segments.len()..end]
                    .iter()
                    .zip(segments)
                    .all(|(a, b)| a == b)
            })
        })
    }
}

fn is_ident(s: &str) -> bool {
    !s.is_empty()
        && !s.starts_with(|c: char| c.is_ascii_digit())
        && s.chars().all(|c| c.is_ascii_alphanumeric() || c == '_')
}

fn glob(pattern: &str, name: &str) -> bool {
    match pattern.split_once('*') {
        None => pattern == name,
        Some((head, tail)) => {
            name.starts_with(head) && (head.len()..=name.len()).any(|at| glob(tail, &name[at..]))
        }
    }
}

fn walk(root: &Path, dir: &Path, paths: &mut BTreeSet<String>) {
    let Ok(entries) = std::fs::read_dir(dir) else {
        return;
    };
    for entry in entries.flatten() {
        let path = entry.path();
        let name = entry.file_name().to_string_lossy().to_string();
        if name.starts_with('.') || name == "target" {
            continue;
        }
        let relative = path.strip_prefix(root).expect("under root");
        let relative = relative.to_string_lossy().replace('\\', "/");
        let is_dir = entry.file_type().is_ok_and(|t| t.is_dir());
        paths.insert(relative);
        if is_dir {
            walk(root, &path, paths);
        }
    }
}

/// The names a Rust file declares: functions, types, traits, constants, statics,
/// modules, macros, and enum variants and fields (`Start::Answered`).
fn declared_items(text: &str) -> BTreeSet<String> {
    let mut out = BTreeSet::new();
    let tokens: Vec<&str> = text
        .split(|c: char| !(c.is_ascii_alphanumeric() || c == '_' || c == '!'))
        .filter(|t| !t.is_empty())
        .collect();
    for pair in tokens.windows(2) {
        if matches!(
            pair[0],
            "fn" | "struct"
                | "enum"
                | "trait"
                | "type"
                | "const"
                | "static"
                | "mod"
                | "macro_rules!"
        ) {
            out.insert(pair[1].to_string());
        }
    }
    out
}

/// `mod name {`: the modules a file declares inline.
fn inline_modules(text: &str) -> BTreeSet<String> {
    let tokens: Vec<&str> = text.split_whitespace().collect();
    tokens
        .windows(3)
        .filter(|t| t[0] == "mod" && t[2] == "{")
        .map(|t| t[1].to_string())
        .collect()
}

/// The types of `impl Type`, `impl<T> Type<T>` and `impl Trait for Type`.
fn implemented_types(text: &str) -> BTreeSet<String> {
    let tokens: Vec<&str> = text
        .split(|c: char| !(c.is_ascii_alphanumeric() || c == '_'))
        .filter(|t| !t.is_empty())
        .collect();
    let mut out = BTreeSet::new();
    for (i, token) in tokens.iter().enumerate() {
        if *token == "impl" || *token == "for" {
            out.extend(tokens[i + 1..].iter().take(3).map(|t| t.to_string()));
        }
    }
    out
}

/// The fields of the file's structs.
fn fields(text: &str) -> BTreeSet<String> {
    struct_bodies(text)
        .iter()
        .flat_map(|(_, body)| struct_fields(body))
        .map(|(name, _)| name)
        .collect()
}

fn words(text: &str) -> BTreeSet<String> {
    text.split(|c: char| !(c.is_ascii_alphanumeric() || c == '_'))
        .filter(|w| !w.is_empty())
        .map(str::to_string)
        .collect()
}

#[derive(Clone, Copy, Debug)]
enum Roots {
    Cloud,
    Edge,
    Both,
}

/// The config keys serde reads: the fields of the structs in `tunnel-user/src/config/`
/// under their serde names, walked from the two files' roots.
struct ConfigKeys {
    /// Struct name -> its keys, each with the struct it holds when it is a section.
    structs: BTreeMap<String, BTreeMap<String, Option<String>>>,
    /// The words of `config/superedge.rs`.
    superedge: BTreeSet<String>,
}

impl ConfigKeys {
    fn read(dir: &Path) -> Self {
        let mut fields: BTreeMap<String, Vec<(String, String)>> = BTreeMap::new();
        let mut files: Vec<PathBuf> = std::fs::read_dir(dir)
            .expect("read config/")
            .map(|entry| entry.expect("config/ entry").path())
            .collect();
        files.sort();
        for file in files {
            let text = std::fs::read_to_string(&file).expect("read config source");
            for (name, body) in struct_bodies(&text) {
                fields.insert(name, struct_fields(&body));
            }
        }
        let names: BTreeSet<String> = fields.keys().cloned().collect();
        let structs = fields
            .into_iter()
            .map(|(name, fields)| {
                let keys = fields
                    .into_iter()
                    .map(|(key, ty)| {
                        let section = words(&ty).into_iter().find(|w| names.contains(w));
                        (key, section)
                    })
                    .collect();
                (name, keys)
            })
            .collect();
        let superedge = words(&std::fs::read_to_string(dir.join("superedge.rs")).expect("read"));
        ConfigKeys { structs, superedge }
    }

    fn exists(&self, key: &str, roots: Roots) -> bool {
        let roots: &[&str] = match roots {
            Roots::Cloud => &["CloudConfig"],
            Roots::Edge => &["EdgeConfig"],
            Roots::Both => &["CloudConfig", "EdgeConfig"],
        };
        roots.iter().any(|root| {
            let mut at = Some(root.to_string());
            for part in key.split('.') {
                let Some(keys) = at.as_ref().and_then(|s| self.structs.get(s)) else {
                    return false;
                };
                let Some(next) = keys.get(part) else {
                    return false;
                };
                at = next.clone();
            }
            true
        })
    }

    /// `a.b` whose first part is a section of either file: a key, not a file name
    /// (`tunnel.proto`) or a sysctl (`net.ipv4.ip_unprivileged_port_start`).
    fn is_dotted_key(&self, token: &str) -> bool {
        let Some((first, _)) = token.split_once('.') else {
            return false;
        };
        is_key_path(token)
            && !token.ends_with(".rs")
            && !token.ends_with(".toml")
            && !token.ends_with(".proto")
            && ["CloudConfig", "EdgeConfig"].iter().any(|root| {
                self.structs[*root]
                    .get(first)
                    .is_some_and(|section| section.is_some())
            })
    }

    /// A section of SuperEdge's files (`[mode.cloud.stream.server]`), which
    /// `config/superedge.rs` reads by name.
    fn is_superedge(&self, key: &str) -> bool {
        key.starts_with("mode.") && key.split('.').all(|part| self.superedge.contains(part))
    }

    fn is_any_field(&self, key: &str) -> bool {
        self.structs.values().any(|keys| keys.contains_key(key))
    }
}

/// `struct Name { ... }` bodies of a file, by name.
fn struct_bodies(text: &str) -> Vec<(String, String)> {
    let mut out = Vec::new();
    let mut rest = text;
    while let Some(at) = rest.find("struct ") {
        rest = &rest[at + "struct ".len()..];
        let name: String = rest
            .chars()
            .take_while(|c| c.is_ascii_alphanumeric() || *c == '_')
            .collect();
        let after = rest[name.len()..].trim_start();
        // Generics or a where clause are not used by the config structs.
        let Some(body) = after.strip_prefix('{') else {
            continue;
        };
        let mut depth = 1;
        let end = body
            .char_indices()
            .find(|(_, c)| {
                match c {
                    '{' => depth += 1,
                    '}' => depth -= 1,
                    _ => {}
                }
                depth == 0
            })
            .map(|(i, _)| i)
            .unwrap_or(body.len());
        out.push((name, body[..end].to_string()));
        rest = &body[end..];
    }
    out
}

/// The fields of a struct body as serde names them (`rename = "..."`), with their types.
fn struct_fields(body: &str) -> Vec<(String, String)> {
    let mut out = Vec::new();
    let mut rename: Option<String> = None;
    for line in body.lines() {
        let line = line.trim();
        if line.starts_with("//") {
            continue;
        }
        if line.starts_with("#[") {
            if let Some(at) = line.find("rename = \"") {
                let name = &line[at + "rename = \"".len()..];
                rename = name.split('"').next().map(str::to_string);
            }
            continue;
        }
        let line = line.strip_prefix("pub").map_or(line, |rest| {
            let rest = rest.trim_start();
            match rest.strip_prefix('(') {
                Some(vis) => vis.split_once(')').map_or(rest, |(_, after)| after),
                None => rest,
            }
        });
        if let Some((name, ty)) = line.trim().split_once(':')
            && is_ident(name.trim())
            && !ty.starts_with(':')
        {
            let name = rename.take().unwrap_or_else(|| name.trim().to_string());
            out.push((name, ty.to_string()));
        }
    }
    out
}
