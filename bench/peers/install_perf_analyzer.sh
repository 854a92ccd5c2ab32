#!/usr/bin/env bash
# Installs Triton's perf_analyzer (PyPI `perf-analyzer` 2.60.0) into its own folder, for
# tests/server/test_grpc_perf_analyzer.py and by-hand measurements. Bench-only: nothing
# in bitserve depends on it. About 10 s and 61 MB.
#   bench/peers/install_perf_analyzer.sh [DEST]   (default ~/.cache/bitserve/peers/venv-perf)
# Prints the launcher; `PERF_ANALYZER=<it> make test` then runs the perf_analyzer tests.
# The wheel's binary needs glibc 2.38 and GLIBCXX_3.4.32, newer than Debian 12's, so pip
# offers only a placeholder here: the wheel is fetched for its platform tag, and the binary
# runs under a private glibc and libstdc++ unpacked from Debian 13's packages (nothing is
# installed system-wide; zlib and OpenSSL still come from the system).
set -euo pipefail
VERSION=2.60.0
DEST=${1:-$HOME/.cache/bitserve/peers/venv-perf}
LAUNCHER=$DEST/bin/perf_analyzer
if [[ -f $DEST/.installed ]]; then echo "$LAUNCHER"; exit 0; fi
SITE=$DEST/lib/python3.11/site-packages
test -x "$DEST/bin/python" || python3 -m venv "$DEST"
"$DEST/bin/pip" install -q --no-deps --only-binary=:all: --platform manylinux_2_38_x86_64 \
  --python-version 3.11 --implementation cp --target "$SITE" "perf-analyzer==$VERSION" >&2
rm -rf "$SITE/bin"  # --target's launcher; replaced below
if ! ldd "$SITE/perf_analyzer/bin/perf_analyzer" 2>&1 | grep -q "not found\|GLIBC"; then
  ln -sf "$SITE/perf_analyzer/bin/perf_analyzer" "$LAUNCHER"  # this system's libraries do
else
  apt=$(mktemp -d)
  trap 'rm -rf "$apt"' EXIT
  mkdir -p "$apt/lists/partial" "$apt/cache/archives/partial" "$apt/parts.d" "$apt/debs"
  sed -E 's/^Suites: bookworm bookworm-updates/Suites: trixie/; s/^Suites: bookworm-security/Suites: trixie-security/' \
    /etc/apt/sources.list.d/debian.sources > "$apt/trixie.sources"
  opts=(-o "Dir::Etc::SourceList=$apt/trixie.sources" -o "Dir::Etc::SourceParts=$apt/parts.d"
        -o "Dir::State::Lists=$apt/lists" -o "Dir::Cache=$apt/cache")
  apt-get "${opts[@]}" update >&2
  (cd "$apt/debs" && apt-get "${opts[@]}" download libc6 libstdc++6 libgcc-s1 >&2)
  for deb in "$apt"/debs/*.deb; do dpkg-deb -x "$deb" "$DEST/runtime"; done
  cat > "$LAUNCHER" <<'EOF'
#!/bin/sh
# perf_analyzer under the Debian 13 glibc and libstdc++ in ../runtime
V="$(cd "$(dirname "$0")/.." && pwd)"
RT="$V/runtime/usr/lib/x86_64-linux-gnu"
exec "$RT/ld-linux-x86-64.so.2" --library-path "$RT:/lib/x86_64-linux-gnu:/usr/lib/x86_64-linux-gnu" \
  "$V/lib/python3.11/site-packages/perf_analyzer/bin/perf_analyzer" "$@"
EOF
  chmod +x "$LAUNCHER"
fi
"$LAUNCHER" --version >&2
touch "$DEST/.installed"
echo "$LAUNCHER"
