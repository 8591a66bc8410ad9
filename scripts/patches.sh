#!/bin/sh
# Makes the patched crates that Cargo.toml's [patch.crates-io] points at: patches/NAME/
# is the crate as crates.io published it (the version and sha256 in the header of
# patches/NAME.diff), unpacked, with patches/NAME.diff applied. Only the diffs are
# committed; patches/README.md says why each exists.
#
#   scripts/patches.sh          make each tree that is missing, or that the diff has
#                               changed under (a git pull); fail on a tree edited by hand
#   scripts/patches.sh check    change nothing; fail unless each tree is exactly the
#                               published crate + its diff, naming the files that differ
#   scripts/patches.sh diff NAME  write the changes made by hand in patches/NAME/ into
#                               patches/NAME.diff (its header kept)
#
# A shell script, not an xtask command: cargo reads the [patch] paths before it builds
# anything, xtask included, so they must exist before the first cargo command. The
# .crate file comes through cargo (`cargo fetch`), which checks it against the
# crates.io index; the header's sha256 pins it. Needs tar, patch(1), diff, sha256sum.
set -eu
root=$(cd "$(dirname "$0")/.." && pwd)
patches=$root/patches
export PATH="$HOME/.cargo/bin:$PATH"
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT

say() { echo "patches: $*"; }
die() { echo "patches: $*" >&2; exit 1; }

# The header of patches/NAME.diff names what it applies to:
#   Crate: NAME VERSION
#   Sha256: <sha256 of NAME-VERSION.crate>
header_field() { # diff field
    sed -n "s/^$2: *//p" "$1" | head -n 1
}

# Prints the path of NAME-VERSION.crate in cargo's cache whose sha256 is SHA, fetching it
# through cargo if it is not there.
crate_file() { # name version sha
    home=${CARGO_HOME:-$HOME/.cargo}
    for attempt in cached fetched; do
        for file in "$home"/registry/cache/*/"$1-$2.crate"; do
            [ -f "$file" ] || continue
            actual=$(sha256sum "$file" | cut -d' ' -f1)
            if [ "$actual" = "$3" ]; then
                echo "$file"
                return
            fi
            [ $attempt = fetched ] && echo "patches: $file has sha256 $actual; patches/$1.diff pins $3" >&2
        done
        [ $attempt = fetched ] && break
        # A throw-away package that depends on exactly that version. With the workspace's
        # lock file beside it, cargo keeps every other version it pins and downloads
        # only the one crate.
        fetch=$work/fetch-$1
        mkdir -p "$fetch/src"
        : >"$fetch/src/lib.rs"
        printf '[package]\nname = "fetch-%s"\nversion = "0.0.0"\nedition = "2024"\n[dependencies]\n%s = { version = "=%s", default-features = false }\n[workspace]\n' \
            "$1" "$1" "$2" >"$fetch/Cargo.toml"
        cp "$root/Cargo.lock" "$fetch/"
        host=$(rustc -vV | sed -n 's/^host: //p')
        (cd "$fetch" && cargo fetch --quiet --target "$host") ||
            die "cargo could not fetch $1 $2 from crates.io"
    done
    die "no $1-$2.crate with sha256 $3 (the header of patches/$1.diff): if $1 $2 is the version meant, put the sha256 cargo fetched in the header"
}

# Sets $version and $crate (its .crate file) from the header of patches/NAME.diff.
published_crate() { # name
    diff=$patches/$1.diff
    version=$(header_field "$diff" Crate | sed -n "s/^$1 //p")
    sha=$(header_field "$diff" Sha256)
    [ -n "$version" ] && [ -n "$sha" ] ||
        die "patches/$1.diff has no 'Crate: $1 VERSION' or 'Sha256:' line in its header"
    crate=$(crate_file "$1" "$version" "$sha")
}

# Makes the published crate + diff in $work/NAME-VERSION+NAME.diff and prints that path.
expected_tree() { # name
    published_crate "$1"
    out=$work/$1-$version+$1.diff
    mkdir -p "$work/unpack-$1"
    tar -xzf "$crate" -C "$work/unpack-$1"
    mv "$work/unpack-$1/$1-$version" "$out"
    # No fuzz: a hunk whose context changed (a new upstream version) fails here, with
    # patch's reason, rather than landing somewhere near.
    if ! patch -d "$out" -p1 --quiet --fuzz=0 --forward --no-backup-if-mismatch \
        --reject-file="$work/rejects" -i "$diff" >"$work/patch.log" 2>&1; then
        cat "$work/patch.log" "$work/rejects" >&2 2>/dev/null
        die "patches/$1.diff does not apply to $1 $version as published"
    fi
    echo "$out"
}

# The checksums of a tree's files: what scripts/patches.sh made, to tell a tree left as
# it was made (which it may replace) from one edited by hand (which it must not).
as_made() { # tree
    (cd "$1" && find . -type f ! -name .as-made.sha256 -print0 | LC_ALL=C sort -z |
        xargs -0 sha256sum)
}

# Prints the files in which two trees differ; true when they are the same.
same_tree() { # expected tree
    diff -rq -x .as-made.sha256 "$1" "$2" >"$work/differ" 2>&1 && return 0
    sed "s|$work/||; s|$root/||g" "$work/differ"
    return 1
}

names() {
    for diff in "$patches"/*.diff; do basename "$diff" .diff; done
}

mode=${1:-make}
command -v patch >/dev/null || die "patch(1) is not installed (Debian: apt-get install patch; scripts/setup.sh does)"
case $mode in
make)
    for name in $(names); do
        expected=$(expected_tree "$name")
        tree=$patches/$name
        if [ ! -d "$tree" ]; then
            mv "$expected" "$tree"
            as_made "$tree" >"$tree/.as-made.sha256"
            say "made patches/$name: $(basename "$expected")"
        elif same_tree "$expected" "$tree" >/dev/null; then
            # Left alone, so that cargo does not rebuild it and everything above it.
            [ -f "$tree/.as-made.sha256" ] || as_made "$tree" >"$tree/.as-made.sha256"
            say "patches/$name is $(basename "$expected")"
        elif [ -f "$tree/.as-made.sha256" ] && as_made "$tree" | cmp -s - "$tree/.as-made.sha256"; then
            rm -rf "$tree"
            mv "$expected" "$tree"
            as_made "$tree" >"$tree/.as-made.sha256"
            say "made patches/$name again: the diff or the version changed ($(basename "$expected"))"
        elif ! same_tree "$expected" "$tree" | grep -qv "^Only in $(basename "$expected")"; then
            # Files missing, none changed or added: nothing of anyone's is lost. What a
            # git checkout across the commit that stopped committing the trees leaves.
            rm -rf "$tree"
            mv "$expected" "$tree"
            as_made "$tree" >"$tree/.as-made.sha256"
            say "made patches/$name again: files were missing ($(basename "$expected"))"
        else
            same_tree "$expected" "$tree" >&2 || true
            die "patches/$name was edited by hand and is not $(basename "$expected"); keep the edits with 'scripts/patches.sh diff $name', or drop them with 'rm -r patches/$name' and run scripts/patches.sh again"
        fi
    done
    ;;
check)
    for name in $(names); do
        expected=$(expected_tree "$name")
        tree=$patches/$name
        [ -d "$tree" ] || die "patches/$name is missing: run scripts/patches.sh"
        if ! same_tree "$expected" "$tree" >&2; then
            die "patches/$name is not $(basename "$expected") (the files above differ); 'scripts/patches.sh diff $name' writes the edits into the diff"
        fi
        say "patches/$name is $(basename "$expected")"
    done
    ;;
diff)
    name=${2:-}
    [ -n "$name" ] && [ -f "$patches/$name.diff" ] || die "usage: scripts/patches.sh diff NAME (one of: $(names | tr '\n' ' '))"
    [ -d "$patches/$name" ] || die "patches/$name is missing: run scripts/patches.sh"
    published_crate "$name"
    mkdir -p "$work/a"
    tar -xzf "$crate" -C "$work/a" --strip-components=1
    ln -s "$patches/$name" "$work/b"
    # The header is everything above the first file's diff.
    sed '/^diff /,$d' "$diff" >"$work/new.diff"
    status=0
    (cd "$work" && diff -ruN -x .as-made.sha256 a b/) >"$work/body" || status=$?
    [ $status -le 1 ] || die "diff failed (status $status)"
    # Without the timestamps, so that the diff changes only when the code does.
    sed -E 's/^((---|\+\+\+) [^\t]*)\t.*/\1/; s|^diff -ruN -x .as-made.sha256 a/|diff -ruN a/|; s| b//| b/|g' \
        "$work/body" >>"$work/new.diff"
    mv "$work/new.diff" "$diff"
    as_made "$patches/$name" >"$patches/$name/.as-made.sha256"
    say "wrote patches/$name.diff (files changed: $(grep -c "^diff " "$diff"))"
    ;;
*)
    die "unknown command '$mode': scripts/patches.sh [check | diff NAME]"
    ;;
esac
