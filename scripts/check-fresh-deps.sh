#!/usr/bin/env bash
# Proves that scripts/deps.sh repairs a machine whose protoc cannot see the well-known-type
# includes (google/protobuf/*.proto), the state of a fresh Debian machine that has
# protobuf-compiler but not libprotobuf-dev, which it only recommends.
#
#   sudo bash scripts/check-fresh-deps.sh     # needs root and unshare(1); CI runs it
#
# Two cases, each in a private mount namespace so the machine itself is never changed:
#   fresh     /usr/include/google/protobuf is an empty tmpfs and dpkg's database (a copy, also
#             on a tmpfs) does not list libprotobuf-dev: deps.sh must install it
#   deleted   the includes are hidden the same way but dpkg still lists the package: deps.sh
#             must reinstall it
# In each case `deps.sh --check --build` must fail first (the case is reproduced), then
# `deps.sh --build` must succeed, and then protoc must compile nibble's own protos and a file
# importing descriptor.proto and struct.proto.
set -euo pipefail

cd "$(dirname "${BASH_SOURCE[0]}")/.."

if ((EUID != 0)); then
    echo "check-fresh-deps: needs root (it mounts inside a private mount namespace)" >&2
    exit 1
fi
if ! command -v unshare >/dev/null 2>&1; then
    echo "check-fresh-deps: needs unshare (Debian package util-linux)" >&2
    exit 1
fi
# The starting point: a working protoc, so hiding its includes is what breaks it.
bash scripts/deps.sh --build

run_case() {
    local case=$1
    # The body runs as root in its own mount namespace; every mount vanishes with it.
    unshare --mount --propagation private bash -euo pipefail -s "$case" <<'CASE'
case=$1
inc=/usr/include/google/protobuf
mkdir -p "$inc"
mount -t tmpfs nibble-hidden-includes "$inc"
if [[ "$case" == fresh ]]; then
    db=$(mktemp -d)
    mount -t tmpfs nibble-dpkg-copy "$db"
    cp -a /var/lib/dpkg/. "$db/"
    awk 'BEGIN { RS = ""; ORS = "\n\n" } !/^Package: libprotobuf-dev\n/' \
        /var/lib/dpkg/status >"$db/status"
    mount --bind "$db" /var/lib/dpkg
    if dpkg-query -W -f='${Status}' libprotobuf-dev 2>/dev/null | grep -q 'install ok installed'; then
        echo "check-fresh-deps[$case]: could not hide libprotobuf-dev from dpkg" >&2
        exit 1
    fi
fi
if bash scripts/deps.sh --check --build 2>/dev/null; then
    echo "check-fresh-deps[$case]: deps.sh --check passed with the includes hidden" >&2
    exit 1
fi
echo "check-fresh-deps[$case]: reproduced: protoc cannot find google/protobuf/descriptor.proto"
bash scripts/deps.sh --build
bash scripts/deps.sh --check --build
out=$(mktemp -d)
protoc --proto_path=proto --descriptor_set_out="$out/nibble.bin" proto/nibble/v1/*.proto
printf '%s\n' 'syntax = "proto3";' 'import "google/protobuf/descriptor.proto";' \
    'import "google/protobuf/struct.proto";' \
    'message M { google.protobuf.Struct s = 1; google.protobuf.FileDescriptorProto f = 2; }' \
    >"$out/wkt.proto"
protoc --proto_path="$out" --descriptor_set_out="$out/wkt.bin" "$out/wkt.proto"
rm -rf "$out"
echo "check-fresh-deps[$case]: repaired: protoc compiles nibble's protos and the well-known types"
CASE
}

run_case fresh
run_case deleted
echo "check-fresh-deps: 2 passed, 0 failed"
