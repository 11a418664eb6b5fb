#!/usr/bin/env bash
# Make `prometheus` and `promtool` available for the chart's alert-rule and dashboard tests.
#
# They come from Debian's `prometheus` package (2.42 on bookworm). The tests start their own
# Prometheus on a loopback port with a temporary data directory; the packaged system service is
# never started: a policy-rc.d that denies service starts is put in place for the install when the
# machine has none. Idempotent: nothing happens when both binaries are already on PATH.
set -euo pipefail

if command -v prometheus >/dev/null && command -v promtool >/dev/null; then
    echo "prometheus already installed: $(promtool --version 2>&1 | head -1)"
    exit 0
fi

if [[ "$(id -u)" != 0 ]]; then
    sudo=sudo
    command -v sudo >/dev/null || { echo "fetch_prometheus.sh: run as root or install sudo (apt-get install prometheus)" >&2; exit 1; }
else
    sudo=""
fi

policy=/usr/sbin/policy-rc.d
made_policy=""
if [[ ! -e "$policy" ]]; then
    # 101 = "action forbidden": the package's postinst does not start the system service.
    printf '#!/bin/sh\nexit 101\n' | $sudo tee "$policy" >/dev/null
    $sudo chmod 0755 "$policy"
    made_policy=1
fi
cleanup() { if [[ -n "$made_policy" ]]; then $sudo rm -f "$policy"; fi; }
trap cleanup EXIT

$sudo apt-get update -qq
DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq --no-install-recommends prometheus >/dev/null
echo "prometheus installed: $(promtool --version 2>&1 | head -1)"
