# Sourced by the fetch_*.sh scripts: `apt_install PACKAGE...` installs Debian packages quietly, as
# root or through sudo, without starting any packaged system service (a policy-rc.d that denies
# service starts is put in place for the install when the machine has none, and removed after).
# shellcheck shell=bash

apt_install() {
    local sudo="" policy=/usr/sbin/policy-rc.d made_policy="" rc=0
    if [[ "$(id -u)" != 0 ]]; then
        command -v sudo >/dev/null || { echo "$(basename "$0"): run as root or install sudo (apt-get install $*)" >&2; return 1; }
        sudo=sudo
    fi
    if [[ ! -e "$policy" ]]; then
        # 101 = "action forbidden": a package's postinst does not start its system service.
        printf '#!/bin/sh\nexit 101\n' | $sudo tee "$policy" >/dev/null
        $sudo chmod 0755 "$policy"
        made_policy=1
    fi
    { $sudo apt-get update -qq &&
        DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq --no-install-recommends "$@" >/dev/null; } || rc=$?
    if [[ -n "$made_policy" ]]; then $sudo rm -f "$policy"; fi
    return "$rc"
}
