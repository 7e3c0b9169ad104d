#!/usr/bin/env bash
# `make interop-deps`: the toolchains `make clients` and tests/interop need, on Debian 12:
# Go 1.23 (bookworm-backports: the vendored grpc-go 1.64 needs Go >= 1.21, bookworm's own
# Go is 1.19) with protoc-gen-go/-grpc, Java (OpenJDK 17, grpc-java 1.41, Maven) from apt,
# everything offline afterwards; Node.js + npm from apt if missing, and the Node client's
# two npm packages. Idempotent: installed packages are not fetched again. Needs root (or
# sudo).
set -euo pipefail
cd "$(dirname "$0")/.."

# The Go module's dependencies are vendored (clients/go/vendor): no golang-*-dev package
# is needed to build it. libgrpc-java does not depend on its transport (netty) or on
# perfmark/gson/guava/protobuf: list them too. The Maven plugins are the versions
# clients/java/pom.xml pins; they all land in /usr/share/maven-repo.
packages="protobuf-compiler
  golang-1.23-go protoc-gen-go protoc-gen-go-grpc
  default-jdk-headless maven libgrpc-java protobuf-compiler-grpc-java-plugin libprotobuf-java
  libnetty-java libperfmark-java libgoogle-gson-java libguava-java
  libgeronimo-annotation-1.3-spec-java libjsr305-java liberror-prone-java
  libmaven-compiler-plugin-java libmaven-resources-plugin-java libmaven-jar-plugin-java
  libsurefire-java libexec-maven-plugin-java libbuild-helper-maven-plugin-java
  libmaven-dependency-plugin-java"
command -v npm >/dev/null || packages="$packages nodejs npm"

missing=""
for pkg in $packages; do
    dpkg-query -W -f='${db:Status-Status}' "$pkg" 2>/dev/null | grep -qx installed \
        || missing="$missing $pkg"
done
if [ -n "$missing" ]; then
    sudo=""
    [ "$(id -u)" = 0 ] || sudo=sudo
    echo "interop-deps: apt-get install$missing"
    # golang-1.23-go is in bookworm-backports: add that suite (from the same mirror as the
    # system's bookworm source; backports are never installed unless asked for by name)
    if [ ! -e /etc/apt/sources.list.d/bookworm-backports.sources ] \
        && ! grep -rqs bookworm-backports /etc/apt/sources.list /etc/apt/sources.list.d; then
        uri=$(cat /etc/apt/sources.list.d/*.sources 2>/dev/null | awk 'BEGIN {RS = ""}
            /\nSuites:[^\n]* bookworm( |\n|$)/ || /^Suites:[^\n]* bookworm( |\n|$)/ {
                for (i = 1; i <= NF; i++) if ($i == "URIs:") { print $(i + 1); exit } }')
        [ -n "$uri" ] || uri=$(awk '$1 == "deb" && $3 == "bookworm" {print $2; exit}' \
            /etc/apt/sources.list 2>/dev/null)
        [ -n "$uri" ] || { echo "interop-deps: no bookworm apt source found" >&2; exit 1; }
        printf 'Types: deb\nURIs: %s\nSuites: bookworm-backports\nComponents: main\nSigned-By: %s\n' \
            "$uri" /usr/share/keyrings/debian-archive-keyring.gpg \
            | $sudo tee /etc/apt/sources.list.d/bookworm-backports.sources >/dev/null
    fi
    $sudo apt-get update -qq
    $sudo env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends \
        $missing
fi

(cd clients/node && npm install --no-audit --no-fund --ignore-scripts --loglevel=error)
echo "interop-deps: Go $(/usr/lib/go-1.23/bin/go env GOVERSION), $(javac -version 2>&1), $(MAVEN_OPTS= mvn -B -v 2>/dev/null | sed -n "s/.*\(Apache Maven [0-9.]*\).*/\1/p"), node $(node --version)"
