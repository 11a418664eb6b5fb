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

# shellcheck source=apt_install.sh
source "$(dirname "${BASH_SOURCE[0]}")/apt_install.sh"
apt_install prometheus
echo "prometheus installed: $(promtool --version 2>&1 | head -1)"
