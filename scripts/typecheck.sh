#!/usr/bin/env bash
# mypy over the installed layout: the top-level folders are `tide.*` packages (pyproject's
# package-dir), which mypy cannot follow through the editable install, so it would take every
# `tide.serving...` import as unknown. A tree of links under build/typecheck gives it that layout.
set -euo pipefail
cd "$(dirname "$0")/.."
MYPY=$(realpath "${MYPY:-.venv/bin/mypy}")
CONFIG=$PWD/pyproject.toml
tree=build/typecheck
rm -rf "$tree" && mkdir -p "$tree/tide"
for f in tide/*; do ln -s "$PWD/$f" "$tree/tide/"; done
for d in serving producers trainers registry infra; do ln -s "$PWD/$d" "$tree/tide/$d"; done
ln -s "$PWD/tests" "$tree/tests"
ln -s "$PWD/scripts" "$tree/scripts"
cd "$tree" && "$MYPY" --config-file "$CONFIG" tide tests scripts
