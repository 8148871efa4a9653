#!/usr/bin/env bash
# Packaging check: build the wheel, install it into a fresh virtual environment that cannot see
# the source tree, and run the installed `attnflow` command from there.
#
#   scripts/check_package.sh [PYTHON]     (default: .venv/bin/python)
#
# Offline and fast: the wheel is built without build isolation, and the fresh environment reuses
# the dependencies (torch, transformers, the embedded model packages) of PYTHON's environment
# through a .pth file instead of downloading them; attnflow itself comes only from the wheel.
set -euo pipefail
cd "$(dirname "$0")/.."
python=${1:-.venv/bin/python}
work=$(mktemp -d "${TMPDIR:-/tmp}/attnflow-package.XXXXXX")
trap 'rm -rf "$work"' EXIT

"$python" -m pip wheel --quiet --no-deps --no-build-isolation --wheel-dir "$work/dist" .
wheel=$(ls "$work"/dist/attnflow-*.whl)
"$python" -m venv "$work/venv"
site_packages=$("$python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
fresh_site=$("$work/venv/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
# Only the directory is added (its own .pth files, such as an editable attnflow, are not run).
echo "$site_packages" > "$fresh_site/shared-dependencies.pth"
"$work/venv/bin/python" -m pip install --quiet --no-deps --no-index "$wheel"

cd "$work"  # away from the source tree
unset PYTHONPATH
installed=$(venv/bin/python -c 'import attnflow; print(attnflow.__file__)')
case "$installed" in
  "$fresh_site"/*) ;;
  *) echo "check_package: attnflow was imported from $installed, not from the wheel" >&2; exit 1 ;;
esac
venv/bin/attnflow --help > help.txt
grep -q "explain" help.txt
# The embedded classifier with an empty cache: its trained head must come from the wheel (package
# data), and nothing may be trained or cached.
ATTNFLOW_CACHE="$work/cache" venv/bin/attnflow explain "The movie was terrible, but the acting was great." \
  --model minilm-sentiment --device cpu --quiet --out out
for name in explanation.json explanation.html explanation.png; do
  test -s "out/$name" || { echo "check_package: out/$name was not written" >&2; exit 1; }
done
# The flow kernel compiles once and is cached where the installed package can keep it (numba's
# __pycache__ beside the installed module, or the user's cache folder when that is read-only).
compile='from attnflow.methods import flow_kernels; flow_kernels.compile_kernels(); print(flow_kernels.kernels_cached())'
venv/bin/python -c "$compile" > /dev/null
test "$(venv/bin/python -c "$compile" 2>&1)" = "True" || { echo "check_package: the flow kernel was not cached" >&2; exit 1; }
if [ -e "$work/cache/probes" ]; then echo "check_package: a classifier head was trained instead of shipped" >&2; exit 1; fi
echo "package check passed: $(basename "$wheel") installed in a fresh venv runs attnflow --help and attnflow explain (with the shipped classifier head), and caches the flow kernel"
