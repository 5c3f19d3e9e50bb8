#!/usr/bin/env bash
# Install the Azurite blob/table emulator (pinned) into .cache/azurite, once.
# The test suite starts and stops it itself (tests/azurite.py).
#
# The npm install (about 30 s) is kept once per machine and version in the user's
# cache (${XDG_CACHE_HOME:-~/.cache}/dbtrigger/), which .cache/azurite then links
# to: CI runs on a fresh clone each time. Where that cache cannot be written, it
# installs into .cache/azurite itself.
set -euo pipefail
cd "$(dirname "$0")/.."
AZURITE_VERSION="${AZURITE_VERSION:-3.35.0}"
prefix=".cache/azurite"
shared="${XDG_CACHE_HOME:-$HOME/.cache}/dbtrigger/azurite-$AZURITE_VERSION"

installed() {
  [ -x "$1/node_modules/.bin/azurite" ] &&
    grep -q "\"version\": \"$AZURITE_VERSION\"" "$1/node_modules/azurite/package.json" 2>/dev/null
}

npm_install() {
  command -v npm >/dev/null || { echo "azurite: npm is required (apt-get install nodejs npm)" >&2; exit 1; }
  npm install --silent --no-audit --no-fund --prefix "$1" "azurite@$AZURITE_VERSION"
}

if ! installed "$prefix"; then
  mkdir -p .cache
  rm -rf "$prefix"
  if mkdir -p "$(dirname "$shared")" 2>/dev/null && [ -w "$(dirname "$shared")" ]; then
    if ! installed "$shared"; then
      # Installed beside it, then renamed: two runs at once never see half an install.
      staging="$(mktemp -d "$shared.XXXXXX")"
      npm_install "$staging"
      mv -T "$staging" "$shared" 2>/dev/null || rm -rf "$staging"  # (the other run's stays)
    fi
    ln -s "$shared" "$prefix"
  else
    mkdir -p "$prefix"
    npm_install "$prefix"
  fi
fi
echo "azurite: $("$prefix/node_modules/.bin/azurite" --version 2>/dev/null || echo installed) in $prefix"
