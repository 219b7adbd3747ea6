#!/usr/bin/env bash
# Create (or refresh) the project venv and install dsv4-tl into it, editable, with test extras.
#
#   bash scripts/setup.sh          # venv at ./.venv (override: DSV4_TL_VENV=path)
#
# torch is installed FIRST and explicitly (DSV4_TL_TORCH, default torch==2.13.0): on the
# project's CPU machines that picks the local CPU wheel; left to tilelang's dependency
# resolution pip would pull PyPI's newest torch with several GB of CUDA packages.
# Re-running is cheap: the install step is skipped while pyproject.toml and this script are
# unchanged (editable install: source edits need no reinstall).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

VENV="${DSV4_TL_VENV:-.venv}"
TORCH_SPEC="${DSV4_TL_TORCH:-torch==2.13.0}"
PY="$VENV/bin/python"

if [ ! -x "$PY" ]; then
    echo "setup: creating $VENV"
    python3 -m venv "$VENV"
fi

stamp="$VENV/.dsv4_tl-setup"
want="$(cat pyproject.toml scripts/setup.sh | sha256sum | cut -d' ' -f1) $TORCH_SPEC"
if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ]; then
    echo "setup: $VENV is up to date"
    exit 0
fi

echo "setup: installing $TORCH_SPEC"
"$PY" -m pip install -q "$TORCH_SPEC"
echo "setup: installing dsv4-tl (editable) with test extras"
"$PY" -m pip install -q -e '.[test]'
# Check the package-dir mapping resolves from the install, not from the working directory.
PY_ABS="$(cd "$VENV" && pwd)/bin/python"
(cd / && "$PY_ABS" -c '
import dsv4_tl, dsv4_tl.tile_kernels, dsv4_tl.schedules, tilelang, torch
print(f"setup: dsv4_tl at {dsv4_tl.__path__[0]}, torch {torch.__version__}, tilelang {tilelang.__version__}")
')
echo "$want" > "$stamp"
