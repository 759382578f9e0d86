#!/usr/bin/env bash
# The release matrix of `make test`: for each MindSpore release, a virtual environment of its own (made once, kept
# in .venv-ms<release>) and the real-MindSpore contract tests run there against this checkout.
# A release whose wheel cannot be installed here is skipped with the reason; the matrix fails when every
# release was skipped, or when any release's tests failed.
set -uo pipefail
cd "$(dirname "$0")/.."

# release  python-to-build-the-venv-with  extra-pins (measured: 2.0.0 needs numpy<2 and pillow<10; 2.10.0 on Python
# 3.12 under numpy<2 needs scipy<1.18, whose 1.18 wheels need NumPy 2 and break `import mindspore`): 2.10.0 runs
# here on Python 3.12 with NumPy 1, beside the main suite's 3.11 with NumPy 2, so its DataLoader's workers run too
MATRIX=${MS_SHM_MATRIX:-"2.0.0:3.9:numpy<2,pillow<10 2.7.2:3.11:numpy<2 2.8.0:3.11:numpy<2 2.9.0:3.11:numpy<2 2.10.0:3.12:numpy<2,scipy<1.18"}
TESTS=${MS_SHM_MATRIX_TESTS:-"tests/test_fidelity.py tests/test_fidelity_small_shm.py tests/test_releases.py tests/test_loaders_mindspore.py tests/test_codescan.py tests/test_polling.py"}

python_for() {  # the interpreter for a Python version: pyenv's, else one on PATH
  local v=$1 found
  found=$(ls -d "${PYENV_ROOT:-$HOME/.pyenv}"/versions/"$v".*/bin/python"$v" 2>/dev/null | sort -V | tail -n 1)
  [ -n "$found" ] && { echo "$found"; return; }
  command -v "python$v" || true
}

ran=0 skipped=0 failed=0 summary=()
for entry in $MATRIX; do
  IFS=: read -r release pyver pins <<<"$entry"
  venv=".venv-ms$release"
  if [ ! -f "$venv/.installed" ]; then
    py=$(python_for "$pyver")
    if [ -z "$py" ]; then
      summary+=("mindspore==$release: SKIPPED (no Python $pyver here)"); skipped=$((skipped + 1)); continue
    fi
    rm -rf "$venv"
    IFS=, read -ra extra <<<"$pins"
    if ! { "$py" -m venv "$venv" && "$venv/bin/python" -m pip install -q "mindspore==$release" "${extra[@]}" \
             psutil threadpoolctl pytest > "$venv.install.log" 2>&1; }; then
      summary+=("mindspore==$release: SKIPPED (install failed: $(tail -n 1 "$venv.install.log" 2>/dev/null))")
      skipped=$((skipped + 1)); continue
    fi
    touch "$venv/.installed"
  fi
  echo "== mindspore==$release ($("$venv/bin/python" -V 2>&1))"
  # torch is not in these environments (the main suite runs its tests): only MindSpore is required here
  # shellcheck disable=SC2086
  if MS_SHM_REQUIRE_MINDSPORE=1 MS_SHM_REQUIRE_TORCH=0 PYTHONPATH="$PWD" "$venv/bin/python" -m pytest -q -p no:cacheprovider $TESTS; then
    summary+=("mindspore==$release: passed"); ran=$((ran + 1))
  else
    summary+=("mindspore==$release: FAILED"); failed=$((failed + 1))
  fi
done
echo "== release matrix"
printf '  %s\n' "${summary[@]}"
if [ "$failed" -gt 0 ]; then exit 1; fi
if [ "$ran" -eq 0 ]; then echo "no release of the matrix could run its tests: this is not a pass"; exit 1; fi
exit 0
