#!/usr/bin/env bash
# Builds kvpipe's native extension (native/, the `kvpipe_native` module) and installs it into the
# venv given as $1. The wheel is cached outside the clone, keyed by the hash of native/'s sources,
# Cargo.lock and the venv key, so a rebuild happens only when one of them changes; installing a
# cached wheel takes about a second. KVPIPE_NATIVE=0 skips it (the router then uses the Python search).
set -euo pipefail
here=$(cd "$(dirname "$0")/../.." && pwd)
venv=${1:?usage: native.sh VENV}
[ "${KVPIPE_NATIVE:-1}" = 0 ] && exit 0
src="$here/native"
key=$( { cd "$src" && find Cargo.toml Cargo.lock pyproject.toml build.rs kvpipe_native.pyi src -type f | LC_ALL=C sort | xargs sha256sum;
         basename "$venv"; } | sha256sum | cut -c1-16)
# Already installed from these sources: nothing to do (the common case, checked without a lock).
if [ "$(cat "$venv/.kvpipe-native" 2>/dev/null)" = "$key" ]; then exit 0; fi
cache=$(dirname "$venv")
wheels="$cache/native-$key"
exec 8>"$cache/.native.lock"
flock 8
if [ ! -f "$wheels/.kvpipe-complete" ]; then
  if ! command -v cargo >/dev/null 2>&1; then
    echo "kvpipe: cargo not found; the native router search (native/) needs a Rust toolchain:" \
         "install it with rustup or your package manager (e.g. apt-get install cargo)," \
         "or set KVPIPE_NATIVE=0 to run on the Python search" >&2
    exit 1
  fi
  rm -rf "$wheels"
  echo "kvpipe: building the native extension (native/, cached in $wheels)" >&2
  t0=$(date +%s)
  # The cargo target dir sits beside the wheels' cache so later source changes rebuild incrementally.
  CARGO_TARGET_DIR="$cache/native-target" "$venv/bin/maturin" build --release --locked -q \
    --manifest-path "$src/Cargo.toml" -i "$venv/bin/python" -o "$wheels" >&2
  touch "$wheels/.kvpipe-complete"
  echo "kvpipe: native extension built in $(( $(date +%s) - t0 )) s" >&2
fi
"$venv/bin/python" -m pip install -q --no-deps --force-reinstall "$wheels"/kvpipe_native-*.whl >&2
echo "$key" >"$venv/.kvpipe-native"
