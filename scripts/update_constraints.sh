#!/usr/bin/env bash
# Rewrites constraints.txt: the exact versions that a fresh `pip install -r requirements.txt` (the package
# with its extras: notebooks, test, docs) gives on this machine's Python. Run it, then run CI
# (bash .ci/run) and commit constraints.txt only if CI passes: the file records what CI passed with.
set -euo pipefail
cd "$(dirname "$0")/.."
venv=$(mktemp -d)/venv
python3 -m venv "$venv"
"$venv/bin/pip" install -q -r requirements.txt
py=$("$venv/bin/python" -c 'import sys; print(f"{sys.version_info[0]}.{sys.version_info[1]}")')
{
  echo "# The versions CI last passed with (Python $py, $(date -u +%Y-%m-%d)); made by scripts/update_constraints.sh."
  echo "# The README's commands install with -c constraints.txt, so a new release cannot change what strict"
  echo "# nbval compares overnight. pyproject.toml keeps the lower bounds. The pins apply to Python >= $py;"
  echo "# on older Pythons, pip picks versions within pyproject.toml's bounds (untested)."
  "$venv/bin/pip" freeze --exclude-editable | grep -v '^#' | sed "s/\$/ ; python_version >= \"$py\"/"
} > constraints.txt
rm -rf "$(dirname "$venv")"
echo "constraints.txt: $(grep -vc '^#' constraints.txt) pins"
