#!/usr/bin/env bash
# `make interop-deps`: the toolchains `make clients` and tests/interop need, on Debian 12:
# Go (1.19, grpc-go 1.33) and Java (OpenJDK 17, grpc-java 1.41) from apt, everything
# offline afterwards; Node.js + npm from apt if missing, and the Node client's two npm
# packages. Idempotent: installed packages are not fetched again. Needs root (or sudo).
set -euo pipefail
cd "$(dirname "$0")/.."

# Name golang-github-golang-protobuf-1-5-dev explicitly: the transitional
# golang-goprotobuf-dev pulls protobuf 1.3. libgrpc-java does not depend on its
# transport (netty) or on perfmark/gson/guava/protobuf: list them too.
packages="protobuf-compiler
  golang-go golang-google-grpc-dev golang-github-golang-protobuf-1-5-dev
  golang-google-protobuf-dev protoc-gen-go protoc-gen-go-grpc
  default-jdk-headless libgrpc-java protobuf-compiler-grpc-java-plugin libprotobuf-java
  libnetty-java libperfmark-java libgoogle-gson-java libguava-java
  libgeronimo-annotation-1.3-spec-java libjsr305-java liberror-prone-java"
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
    $sudo apt-get update -qq
    $sudo env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends \
        $missing
fi

(cd clients/node && npm install --no-audit --no-fund --ignore-scripts --loglevel=error)
echo "interop-deps: Go $(go env GOVERSION), $(javac -version 2>&1), node $(node --version)"
