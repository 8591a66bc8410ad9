#!/usr/bin/env python3
"""How many of the workspace's tests run in process, per test binary (docs/testing.md).

The rule, read from the source (no test runs):
- a test is a function under `#[test]` or `#[tokio::test...]`; `#[ignore]`d ones are
  listed apart, as the suite does not run them; a unit test (a crate's src/) runs in
  process;
- its code is its body plus, transitively, every function of its own binary's files
  (and of tests/k8s/, the Kubernetes harness, for a binary that uses it) it calls by
  name, every function of that name; tests/common/ is not read: it is named by its
  entry points below;
- it runs **tunnel processes** when that code starts the `tunnel` binary: `Proc::start`,
  a `Setup`'s `start_cloud`/`spawn_cloud`/`start_edge`/`start_ready_edge` (a `Setup`
  is held as `s`, or `t.s` beside an in-process cloud), or `common::BIN`;
- else it runs **in process** when it runs the cloud or edge in this process (in its
  runtime, `InProcess`, or on threads of their own, `Threaded`), or calls library code
  only (lib unit tests, configs parsed, the xtask's checks): it starts no process, or
  only third-party clients and targets (curl, openssl, python) beside an in-process
  cloud;
- else it runs **other processes** (podman, cargo, kubectl, ... with no tunnel).

Prints one row per binary (tests, in process, tunnel processes, other processes,
ignored, sleeps in its own files), the totals and the sleeps of the harness
(tests/common/, tests/k8s/); `-v` lists each test's class.
"""

import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
HARNESS = ROOT / "tunnel-user/tests/k8s"
TEST_ATTR = re.compile(r"#\[(?:tokio::)?test\b[^\]]*\]")
FN = re.compile(r"\b(?:async\s+)?fn\s+(\w+)")
TUNNEL = re.compile(
    r"Proc::start|\.(?:start_cloud|spawn_cloud)\(|(?<![\w.])(?:t\.)?s\.start_(?:ready_)?edge\("
    r"|\bcommon::BIN\b|\bBIN\b"
)
INPROC = re.compile(r"\bInProcess::start|\bThreaded::(?:cloud|edge)\b")
OTHER = re.compile(r"Command::new\(|\.command\(|spawn_announcing\(|python_http_server\(")
SLEEP = re.compile(r"\bsleep\(")


def strip_comments(text):
    return "\n".join(re.sub(r"//.*", "", line) for line in text.splitlines())


def body_at(text, start):
    """The text from `start` to the brace closing the first block opened after it."""
    open_at = text.index("{", start)
    depth = 0
    for i in range(open_at, len(text)):
        depth += {"{": 1, "}": -1}.get(text[i], 0)
        if depth == 0:
            return text[start : i + 1]
    return text[start:]


def functions(text):
    """name -> body of every fn in `text`, and the (name, body, ignored) of its tests."""
    fns, tests = {}, []
    for m in FN.finditer(text):
        fns.setdefault(m.group(1), []).append(body_at(text, m.start()))
    for m in TEST_ATTR.finditer(text):
        f = FN.search(text, m.end())
        attrs = text[m.start() : f.start()]
        tests.append((f.group(1), body_at(text, f.start()), "#[ignore" in attrs))
    return fns, tests


def classify(body, fns):
    """The class of a test of `body`, calling the functions `fns` of its binary."""
    code, seen, todo = [], set(), [body]
    while todo:
        b = todo.pop()
        code.append(b)
        for name in re.findall(r"\b(\w+)\s*(?:::<[^>]*>)?\(", b):
            if name in fns and name not in seen:
                seen.add(name)
                todo.extend(fns[name])
    code = "\n".join(code)
    if TUNNEL.search(code):
        return "tunnel"
    if INPROC.search(code) or not OTHER.search(code):
        return "in process"
    return "other"


def harnessed(files):
    """`files` and, when they declare `mod k8s`, the Kubernetes harness."""
    if any(re.search(r"^mod k8s;", f.read_text(), re.M) for f in files):
        files = files + sorted(HARNESS.glob("*.rs"))
    return files


def binaries():
    """(name, files) of each test binary: lib unit tests per crate, then tests/*."""
    for crate in ["tunnel-user", "tunnel-common", "proto", "fuzz-checks", "xtask"]:
        src = ROOT / crate / "src"
        yield f"{crate} (lib/bin unit tests)", sorted(src.rglob("*.rs"))
        tests = ROOT / crate / "tests"
        if not tests.is_dir():
            continue
        for entry in sorted(tests.iterdir()):
            if entry.suffix == ".rs":
                yield f"{crate} --test {entry.stem}", harnessed([entry])
            elif (entry / "main.rs").is_file():
                yield f"{crate} --test {entry.name}", harnessed(sorted(entry.rglob("*.rs")))


def main():
    verbose = "-v" in sys.argv[1:]
    rows, totals = [], [0] * 6
    for name, files in binaries():
        fns, tests, sleeps = {}, [], 0
        for f in files:
            text = strip_comments(f.read_text())
            more_fns, more_tests = functions(text)
            for k, v in more_fns.items():
                fns.setdefault(k, []).extend(v)
            tests += more_tests
            if HARNESS not in f.parents:
                sleeps += len(SLEEP.findall(text))
        if not tests:
            continue
        counts = {"in process": 0, "tunnel": 0, "other": 0, "ignored": 0}
        for test, body, ignored in tests:
            # A unit test runs the library in the test's process, whatever the library
            # itself starts (a hook's `sh`).
            unit = "unit tests" in name
            kind = "ignored" if ignored else "in process" if unit else classify(body, fns)
            counts[kind] += 1
            if verbose:
                print(f"{kind:10} {name}: {test}")
        row = [len(tests) - counts["ignored"], counts["in process"], counts["tunnel"],
               counts["other"], counts["ignored"], sleeps]
        totals = [a + b for a, b in zip(totals, row)]
        rows.append((name, row))
    head = ["tests", "in process", "tunnel procs", "other procs", "ignored", "sleeps"]
    width = max(len(n) for n, _ in rows) + 2
    print(f"{'binary':{width}}" + "".join(f"{h:>14}" for h in head))
    for name, row in rows + [("total", totals)]:
        print(f"{name:{width}}" + "".join(f"{v:>14}" for v in row))
    harness = [*(ROOT / "tunnel-user/tests/common").glob("*.rs"), *HARNESS.glob("*.rs")]
    in_harness = sum(len(SLEEP.findall(strip_comments(f.read_text()))) for f in harness)
    print(f"sleeps in the harness (tests/common/, tests/k8s/): {in_harness}")
    share = 100 * totals[1] / totals[0]
    itests = [r for n, r in rows if "--test" in n]
    iin = sum(r[1] for r in itests)
    iall = sum(r[0] for r in itests)
    print(f"in process: {totals[1]} of {totals[0]} tests ({share:.0f}%); "
          f"of the integration tests (tests/): {iin} of {iall} ({100 * iin / iall:.0f}%)")


if __name__ == "__main__":
    main()
