#!/bin/sh
# Keeps the patched crates that Cargo.toml's [patch.crates-io] points at exactly the
# published crate plus a diff. patches/NAME/ is committed, so that every cargo command
# works on a fresh clone (cargo reads the [patch] paths before it builds anything);
# patches/NAME.diff is what a reviewer reads: what changed and why, and in its header
# the published crate it applies to (version and the .crate file's sha256).
# patches/README.md says why each exists.
#
#   scripts/patches.sh check      change nothing; fail unless each patches/NAME/ is
#                                 exactly the published crate + its diff, naming the
#                                 files that differ (scripts/test.sh runs it)
#   scripts/patches.sh diff NAME  write the changes made by hand in patches/NAME/ into
#                                 patches/NAME.diff (its header kept)
#   scripts/patches.sh make NAME  make patches/NAME/ again from the crate the diff's
#                                 header names and the diff (a new upstream version);
#                                 refuses while patches/NAME/ has changes git does not hold
#
# The .crate file comes through cargo (`cargo fetch`), which checks it against the
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

# Makes the published crate + diff in $work/NAME-VERSION+NAME.diff and prints that path,
# first, so that a caller has it even when a hunk does not apply: the function then
# fails, the tree holds the hunks that did, and $work/rejects the ones that did not.
expected_tree() { # name
    published_crate "$1"
    out=$work/$1-$version+$1.diff
    mkdir -p "$work/unpack-$1"
    tar -xzf "$crate" -C "$work/unpack-$1"
    mv "$work/unpack-$1/$1-$version" "$out"
    echo "$out"
    # No fuzz: a hunk whose context changed (a new upstream version) fails here, with
    # patch's reason, rather than landing somewhere near.
    if ! patch -d "$out" -p1 --quiet --fuzz=0 --forward --no-backup-if-mismatch \
        --reject-format=unified --reject-file="$work/rejects" -i "$diff" >"$work/patch.log" 2>&1; then
        cat "$work/patch.log" "$work/rejects" >&2 2>/dev/null
        echo "patches: patches/$1.diff does not apply to $1 $version as published" >&2
        return 1
    fi
}

# Prints the files in which two trees differ; true when they are the same.
same_tree() { # expected tree
    diff -rq "$1" "$2" >"$work/differ" 2>&1 && return 0
    sed "s|$work/||; s|$root/||g" "$work/differ"
    return 1
}

names() {
    for diff in "$patches"/*.diff; do basename "$diff" .diff; done
}

# Fails unless NAME is one of patches/*.diff.
known_name() { # command name
    [ -n "$2" ] && [ -f "$patches/$2.diff" ] ||
        die "usage: scripts/patches.sh $1 NAME (one of: $(names | tr '\n' ' '))"
}

mode=${1:-}
command -v patch >/dev/null || die "patch(1) is not installed (Debian: apt-get install patch; scripts/setup.sh does)"
case $mode in
check)
    for name in $(names); do
        expected=$(expected_tree "$name") || exit 1
        tree=$patches/$name
        [ -d "$tree" ] || die "patches/$name is missing: git checkout -- patches/$name"
        if ! same_tree "$expected" "$tree" >&2; then
            die "patches/$name is not $(basename "$expected") (the files above differ); 'scripts/patches.sh diff $name' writes the edits into the diff"
        fi
        say "patches/$name is $(basename "$expected")"
    done
    ;;
make)
    name=${2:-}
    known_name make "$name"
    # The tree is replaced whole: nothing in it may be lost that git cannot give back.
    changed=$(git -C "$root" status --porcelain --untracked-files=all --ignored -- "patches/$name/") ||
        die "make needs a git checkout: it replaces patches/$name/ only when git holds everything in it"
    if [ -n "$changed" ]; then
        echo "$changed" >&2
        die "patches/$name/ has changes git does not hold (above): commit them, keep them with 'scripts/patches.sh diff $name', or drop them"
    fi
    tree=$patches/$name
    if expected=$(expected_tree "$name"); then
        rm -rf "$tree"
        mv "$expected" "$tree"
        say "made patches/$name: $(basename "$expected")"
    else
        [ -n "$expected" ] || exit 1
        rm -rf "$tree"
        mv "$expected" "$tree"
        cp "$work/rejects" "$patches/$name.rej"
        die "patches/$name is the new crate with the hunks that applied; redo the ones in patches/$name.rej by hand in patches/$name/, then 'scripts/patches.sh diff $name' and delete patches/$name.rej"
    fi
    ;;
diff)
    name=${2:-}
    known_name diff "$name"
    [ -d "$patches/$name" ] || die "patches/$name is missing: git checkout -- patches/$name"
    published_crate "$name"
    mkdir -p "$work/a"
    tar -xzf "$crate" -C "$work/a" --strip-components=1
    ln -s "$patches/$name" "$work/b"
    # The header is everything above the first file's diff.
    sed '/^diff /,$d' "$diff" >"$work/new.diff"
    status=0
    (cd "$work" && diff -ruN a b/) >"$work/body" || status=$?
    [ $status -le 1 ] || die "diff failed (status $status)"
    # Without the timestamps, so that the diff changes only when the code does.
    sed -E 's/^((---|\+\+\+) [^\t]*)\t.*/\1/; s| b//| b/|g' "$work/body" >>"$work/new.diff"
    mv "$work/new.diff" "$diff"
    say "wrote patches/$name.diff (files changed: $(grep -c "^diff " "$diff"))"
    ;;
*)
    die "usage: scripts/patches.sh check | diff NAME | make NAME"
    ;;
esac
