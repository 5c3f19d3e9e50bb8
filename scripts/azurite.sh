#!/usr/bin/env bash
# Install the Azurite blob/table emulator (pinned) into .cache/azurite, once.
# The test suite starts and stops it itself (tests/azurite.py).
set -euo pipefail
cd "$(dirname "$0")/.."
AZURITE_VERSION="${AZURITE_VERSION:-3.35.0}"
prefix=".cache/azurite"
if [ ! -x "$prefix/node_modules/.bin/azurite" ] || \
   ! grep -q "\"version\": \"$AZURITE_VERSION\"" "$prefix/node_modules/azurite/package.json" 2>/dev/null; then
  command -v npm >/dev/null || { echo "azurite: npm is required (apt-get install nodejs npm)" >&2; exit 1; }
  mkdir -p "$prefix"
  npm install --silent --no-audit --no-fund --prefix "$prefix" "azurite@$AZURITE_VERSION"
fi
echo "azurite: $("$prefix/node_modules/.bin/azurite" --version 2>/dev/null || echo installed) in $prefix"
