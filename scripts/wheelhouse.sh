#!/usr/bin/env bash
# Fill an offline wheelhouse for the nodes: torch (CPU build here), DeepSpeed built as a wheel,
# and everything they need. The nodes then install with --no-index --find-links (air-gapped path).
#   scripts/wheelhouse.sh [DIR]        (default: .cache/wheelhouse)
# The pins come from requirements/pins.env; TORCH, DEEPSPEED and PY (target Python, e.g. 3.11)
# override them.
set -euo pipefail
here=$(cd "$(dirname "$0")/.." && pwd)
dir=${1:-$here/.cache/wheelhouse}
. "$here/requirements/pins.env"
torch=${TORCH:-$TORCH_VERSION}
ds=${DEEPSPEED:-$DEEPSPEED_VERSION}
mkdir -p "$dir"
if ls "$dir"/torch-"$torch"*.whl "$dir"/deepspeed-"$ds"-*.whl >/dev/null 2>&1; then
  echo "wheelhouse $dir has torch $torch and deepspeed $ds"; exit 0
fi
py=${PYTHON:-python3}
"$py" -m pip download -q --disable-pip-version-check -d "$dir" "torch==$torch" "deepspeed==$ds" 2>&1 \
  | grep -v 'is ignored' || true
# DeepSpeed ships as an sdist: build it once here into a pure-python wheel (ops JIT-built on nodes).
if [ -f "$dir/deepspeed-$ds.tar.gz" ]; then
  "$py" -m pip wheel -q --disable-pip-version-check --no-deps -w "$dir" "$dir/deepspeed-$ds.tar.gz" 2>&1 \
    | grep -v 'is ignored' || true
  rm -f "$dir/deepspeed-$ds.tar.gz"
fi
ls "$dir"/torch-"$torch"*.whl "$dir"/deepspeed-"$ds"-*.whl
