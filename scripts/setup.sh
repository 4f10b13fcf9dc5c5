#!/usr/bin/env bash
# Sets up Concordia on a fresh Debian machine: the libpmem1 package (when we are
# root and apt is there), a virtual environment in .venv, and the package with the
# extras named in $CONCORDIA_EXTRAS (default: test). Safe to run again.
set -euo pipefail
cd "$(dirname "$0")/.."

# capture the cache first: `ldconfig -p | grep -q` under pipefail fails whenever grep
# exits at its first match before ldconfig has written everything (SIGPIPE)
ld_cache=$(ldconfig -p 2>/dev/null || true)
if ! grep -q 'libpmem\.so\.1' <<<"$ld_cache"; then
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
    echo "setup: installing libpmem1 (Debian) for the persistent-memory path" >&2
    (apt-get install -y -qq libpmem1 >/dev/null 2>&1 \
      || { apt-get update -qq >/dev/null 2>&1 && apt-get install -y -qq libpmem1 >/dev/null 2>&1; }) \
      || echo "setup: libpmem1 could not be installed; logs will use mmap + msync" >&2
  else
    echo "setup: libpmem1 absent and not root; logs will use mmap + msync" >&2
  fi
fi

PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  # Debian splits venv's pip bootstrap into python3-venv
  if ! "$PY" -c 'import ensurepip' >/dev/null 2>&1; then
    if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
      echo "setup: installing python3-venv (Debian) for the virtual environment" >&2
      apt-get install -y -qq python3-venv >/dev/null 2>&1 \
        || { apt-get update -qq >/dev/null 2>&1 && apt-get install -y -qq python3-venv >/dev/null 2>&1; } \
        || { echo "setup: python3-venv could not be installed" >&2; exit 2; }
    else
      echo "setup: $PY has no ensurepip; install python3-venv (Debian) and run again" >&2
      exit 2
    fi
  fi
  "$PY" -m venv .venv
fi
extras=${CONCORDIA_EXTRAS:-test}
stamp=.venv/.concordia-installed-$extras
if [ ! -f "$stamp" ] || [ pyproject.toml -nt "$stamp" ]; then
  .venv/bin/python -m pip install -q --disable-pip-version-check -e ".[$extras]"
  touch "$stamp"
fi
