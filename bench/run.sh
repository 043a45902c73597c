#!/usr/bin/env bash
# onecopy benchmark: bench/run.sh WORKLOAD FS [options]; see bench/README.md.
# The driver is bench/bench.py (python3, standard library only); it creates
# a fresh loop filesystem per tool and removes it (and unmounts) on exit.
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
if [[ $EUID -ne 0 ]]; then
    echo "bench/run.sh: must run as root (loop devices, mount, drop_caches)" >&2
    exit 1
fi
command -v python3 >/dev/null || apt-get install -y python3
exec python3 "$here/bench.py" "$@"
