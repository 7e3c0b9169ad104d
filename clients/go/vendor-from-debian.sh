#!/usr/bin/env bash
# Re-create clients/go/vendor (and go.mod's requirements) from Debian's packages of the Go
# module's dependencies, with no module proxy: Debian 13 (trixie) ships grpc-go 1.64 as
# source packages (architecture "all", /usr/share/gocode), which are downloaded with apt
# from the mirror the system's bookworm source names and unpacked here, never installed.
# The unpacked trees are served to `go mod tidy` / `go mod vendor` as a file:// module
# proxy, so vendor/modules.txt is what the go command itself writes. Needs Go >= 1.21
# (`make interop-deps` installs Go 1.23 from bookworm-backports).
#
# go.sum is NOT written from these trees: it keeps the public checksums of the upstream
# module versions (what a build with a module proxy verifies). vendor/ is Debian's build
# of these versions, not byte-identical to the upstream zips (Debian leaves some files
# out, e.g. golang.org/x/sys/windows; googleapis/rpc/status is genproto's 2021-07-26
# snapshot; two grpc *.pb.go are regenerated, see below). This script checks that go.sum
# has a line for every module version the build needs.
set -euo pipefail
cd "$(dirname "$0")"
GO=${GO:-/usr/lib/go-1.23/bin/go}

# Debian package (pinned) -> module, version, directory under /usr/share/gocode/src
PACKAGES="golang-google-grpc-dev=1.64.0-7 golang-google-protobuf-dev=1.36.5-1
  golang-golang-x-net-dev=1:0.27.0-2 golang-golang-x-sys-dev=0.22.0-1
  golang-golang-x-text-dev=0.22.0-1
  golang-google-genproto-dev=0.0~git20210726.e7812ac-4
  golang-github-google-go-cmp-dev=0.6.0-1"
MODULES="google.golang.org/grpc v1.64.0 google.golang.org/grpc
google.golang.org/protobuf v1.36.5 google.golang.org/protobuf
golang.org/x/net v0.27.0 golang.org/x/net
golang.org/x/sys v0.22.0 golang.org/x/sys
golang.org/x/text v0.22.0 golang.org/x/text
github.com/google/go-cmp v0.6.0 github.com/google/go-cmp
google.golang.org/genproto/googleapis/rpc v0.0.0-20240318140521-94a12d6c2237 google.golang.org/genproto/googleapis/rpc"
# grpc 1.64 requires this genproto/googleapis/rpc version; Debian's only genproto is the
# 2021-07-26 snapshot of the then single module, with no go.mod for this sub-module: the
# proxy serves this one (upstream's has the same go line and protobuf requirement).
RPC_GO_MOD=$'module google.golang.org/genproto/googleapis/rpc\n\ngo 1.19\n\nrequire google.golang.org/protobuf v1.33.0\n'

work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT

uri=$(cat /etc/apt/sources.list.d/*.sources 2>/dev/null | awk 'BEGIN {RS = ""}
    /\nSuites:[^\n]* bookworm( |\n|$)/ || /^Suites:[^\n]* bookworm( |\n|$)/ {
        for (i = 1; i <= NF; i++) if ($i == "URIs:") { print $(i + 1); exit } }')
[ -n "$uri" ] || uri=$(awk '$1 == "deb" && $3 == "bookworm" {print $2; exit}' \
    /etc/apt/sources.list 2>/dev/null)
[ -n "$uri" ] || { echo "vendor: no bookworm apt source found" >&2; exit 1; }
mkdir -p "$work/apt/lists/partial" "$work/apt/cache/archives/partial" "$work/debs"
echo "deb $uri trixie main" > "$work/apt/sources.list"
apt=(apt-get -qq -o "Dir::State::Lists=$work/apt/lists" -o "Dir::Cache=$work/apt/cache"
     -o "Dir::Etc::SourceList=$work/apt/sources.list" -o Dir::Etc::SourceParts=/nonexistent
     -o APT::Sandbox::User="$(id -un)")
"${apt[@]}" update
# shellcheck disable=SC2086
(cd "$work/debs" && "${apt[@]}" download $PACKAGES)
for deb in "$work"/debs/*.deb; do dpkg-deb -x "$deb" "$work/root"; done
src=$work/root/usr/share/gocode/src

# Debian regenerates two of grpc's *.pb.go with its protoc-gen-go 1.36, whose code needs
# Go 1.20 (unsafe.StringData) inside a module that declares go 1.19, and imports
# github.com/golang/protobuf's ptypes: module mode refuses them. Regenerate both from the
# .proto files Debian ships (debian/missing-sources) with bookworm's protoc-gen-go 1.28,
# which, like upstream's, imports the well-known types from google.golang.org/protobuf.
protos=$src/google.golang.org/grpc/debian/missing-sources/grpc/grpc-proto/master
mkdir "$work/gen"
protoc -I"$protos" --go_out="$work/gen" grpc/health/v1/health.proto \
    grpc/binlog/v1/binarylog.proto
cp "$work/gen/google.golang.org/grpc/health/grpc_health_v1/health.pb.go" \
    "$src/google.golang.org/grpc/health/grpc_health_v1/"
cp "$work/gen/google.golang.org/grpc/binarylog/grpc_binarylog_v1/binarylog.pb.go" \
    "$src/google.golang.org/grpc/binarylog/grpc_binarylog_v1/"

# a file:// module proxy over the unpacked trees (stub go.mod files for modules that are
# only required, never built: the go command reads no more of them)
python3 - "$src" "$work/proxy" "$RPC_GO_MOD" <<EOF
import json, os, re, sys, zipfile
src, proxy, rpc_go_mod = sys.argv[1:]
modules = [line.split() for line in """$MODULES""".splitlines()]
have = {m for m, _, _ in modules}
stubs = {}
def write(mod, ver, go_mod, tree=None):
    d = os.path.join(proxy, mod, "@v")
    os.makedirs(d, exist_ok=True)
    with open(os.path.join(d, "list"), "a") as f:
        f.write(ver + "\n")
    with open(os.path.join(d, ver + ".info"), "w") as f:
        json.dump({"Version": ver, "Time": "2024-01-01T00:00:00Z"}, f)
    with open(os.path.join(d, ver + ".mod"), "w") as f:
        f.write(go_mod)
    if tree is None:
        return
    with zipfile.ZipFile(os.path.join(d, ver + ".zip"), "w") as z:
        z.writestr(f"{mod}@{ver}/go.mod", go_mod)
        for root, dirs, files in os.walk(tree):
            # nested modules and vendor directories are not part of a module's zip
            dirs[:] = [x for x in dirs if x != "vendor"
                       and not os.path.exists(os.path.join(root, x, "go.mod"))]
            for name in files:
                path = os.path.join(root, name)
                rel = os.path.relpath(path, tree)
                if rel != "go.mod" and os.path.isfile(path) and not os.path.islink(path):
                    z.write(path, f"{mod}@{ver}/{rel}")
for mod, ver, rel in modules:
    tree = os.path.join(src, rel)
    gm = os.path.join(tree, "go.mod")
    go_mod = open(gm).read() if os.path.exists(gm) else rpc_go_mod
    write(mod, ver, go_mod, tree)
    for m, v in re.findall(r"^\s*(?:require\s+)?([\w.\-/]+\.[\w.\-/]+)\s+(v\S+)", go_mod, re.M):
        if m not in have:
            stubs[(m, v)] = f"module {m}\n"
for (m, v), go_mod in stubs.items():
    write(m, v, go_mod)
EOF

mkdir "$work/mod"
cp -r go.mod cmd genservev1 fmaas "$work/mod/"
(
    cd "$work/mod"
    export GOPROXY="file://$work/proxy" GOSUMDB=off GOFLAGS=-mod=mod GOTOOLCHAIN=local \
        GOPATH="$work/gopath" GOCACHE="$work/cache" GOWORK=off
    # -e: Debian's x/sys package leaves out golang.org/x/sys/windows, which grpc imports
    # on Windows only (tidy and vendor consider every platform): reported, not vendored
    "$GO" mod tidy -e 2> "$work/tidy.log" || { cat "$work/tidy.log" >&2; exit 1; }
    "$GO" mod vendor -e 2> "$work/vendor.log" || { cat "$work/vendor.log" >&2; exit 1; }
    grep -h "does not contain package" "$work/tidy.log" "$work/vendor.log" | sort -u \
        | sed 's/^/vendor: not vendored (not in the Debian package): /' >&2 || true
    "$GO" clean -modcache
)
cp "$work/mod/go.mod" go.mod
rm -rf vendor
cp -r "$work/mod/vendor" vendor
# go.sum: the lines `go mod tidy` wrote, each with the upstream checksum the committed
# go.sum holds for it (none may be missing; lines no longer needed are dropped)
if ! awk 'NR == FNR {sum[$1 " " $2] = $3; next}
          ($1 " " $2) in sum {print $1, $2, sum[$1 " " $2]; next}
          {print "vendor: go.sum has no checksum for " $1 " " $2 > "/dev/stderr"; bad = 1}
          END {exit bad}' go.sum "$work/mod/go.sum" > "$work/go.sum"; then
    exit 1
fi
cp "$work/go.sum" go.sum
echo "vendor: clients/go/vendor from Debian's $(echo $PACKAGES | wc -w) packages; go.sum complete"
