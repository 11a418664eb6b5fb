#!/usr/bin/env bash
# Put a real kube-apiserver at .tools/k8s/kube-apiserver and etcd on PATH, for the tests that verify
# agents' ServiceAccount tokens through the Kubernetes TokenReview API against a real API server
# (tests/security/test_pod_tokens_kube.py; they are skipped, saying why, while either is missing).
#
# No registry reachable from here ships a kube-apiserver binary, but Debian bookworm carries the
# whole Kubernetes source (v1.20.2, vendor/ included) as source package `kubernetes`: this script
# downloads it with apt-get's own configuration (a deb-src twin of the machine's Debian sources, in a
# private apt state directory; the system's apt configuration is not changed), installs Debian's Go,
# rsync, make and etcd-server, and runs the upstream `make WHAT=cmd/kube-apiserver` (it builds and
# runs the code generators; a plain `go build` lacks the generated OpenAPI file).
#
# Cost, measured on a 2-core box: about 4-5 minutes of CPU for the build (cold), ~2.3 GB of build
# tree (kept under KVGRID_K8S_CACHE, default ~/.cache/kvgrid-k8s, so a rebuild is incremental;
# delete it once the binary is in place if the space matters), a 110 MB binary. Idempotent: a
# binary already in place that reports the expected version is kept and nothing is installed.
set -euo pipefail

K8S_DEB_VERSION="1.20.5+really1.20.2-1.1+deb12u1"
WANT="Kubernetes v1.20.2"

root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
dest="$root/.tools/k8s"
bin="$dest/kube-apiserver"
cache="${KVGRID_K8S_CACHE:-$HOME/.cache/kvgrid-k8s}"

if [[ -x "$bin" ]] && [[ "$("$bin" --version 2>/dev/null)" == "$WANT" ]] && command -v etcd >/dev/null; then
    echo "$WANT already at $bin; etcd at $(command -v etcd)"
    exit 0
fi

# etcd-server's postinst would start a system etcd: apt_install denies service starts.
# shellcheck source=apt_install.sh
source "$(dirname "${BASH_SOURCE[0]}")/apt_install.sh"
apt_install golang-go rsync make etcd-server dpkg-dev

src_sources=/etc/apt/sources.list.d/debian.sources
[[ -r "$src_sources" ]] || { echo "fetch_kube_apiserver.sh: $src_sources not found (need the machine's Debian deb822 sources)" >&2; exit 1; }
mkdir -p "$cache/parts" "$cache/lists/partial" "$cache/src" "$cache/home"
sed 's/^Types: deb$/Types: deb-src/' "$src_sources" >"$cache/parts/debian-src.sources"
apt_private=(-o Dir::Etc::SourceList=/dev/null -o "Dir::Etc::SourceParts=$cache/parts" -o "Dir::State::Lists=$cache/lists")
tree="$cache/kubernetes-1.20.2"
if [[ ! -d "$tree" ]]; then
    apt-get "${apt_private[@]}" update -qq
    (cd "$cache/src" && apt-get "${apt_private[@]}" source -qq --download-only "kubernetes=$K8S_DEB_VERSION")
    tar -xzf "$cache/src/kubernetes_1.20.5+really1.20.2.orig.tar.gz" -C "$cache"
    mkdir -p "$tree/.go/src/k8s.io"
    ln -sfn ../../.. "$tree/.go/src/k8s.io/kubernetes"  # GOPATH layout, as debian/rules does
fi
(
    cd "$tree"
    export GOPATH="$tree/.go" GOFLAGS= GOPROXY=off CGO_ENABLED=0 HOME="$cache/home"
    make WHAT=cmd/kube-apiserver
)
mkdir -p "$dest"
install -m 0755 "$tree/_output/bin/kube-apiserver" "$bin.tmp"
mv -f "$bin.tmp" "$bin"
got="$("$bin" --version)"
if [[ "$got" != "$WANT" ]]; then
    echo "fetch_kube_apiserver.sh: expected $WANT, built $got" >&2
    exit 1
fi
echo "$got installed at $bin; etcd $(etcd --version | head -1)"
