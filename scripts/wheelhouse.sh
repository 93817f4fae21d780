#!/usr/bin/env bash
# Fill an offline wheelhouse for the nodes: torch (CPU build here), DeepSpeed built as a wheel,
# your scripts' requirements (dsc_requirements), and everything they need. The nodes then install
# with --no-index --find-links (air-gapped path).
#   scripts/wheelhouse.sh [DIR] [REQUIREMENT ...]     (DIR default: .cache/wheelhouse)
#   REQUIREMENTS_FILE=requirements.txt scripts/wheelhouse.sh DIR
# The pins come from requirements/pins.env; TORCH, DEEPSPEED and PYTHON (the interpreter whose
# platform the wheels are for) override them; TORCH_INDEX adds torch's CUDA-variant index
# (torchvision and torchaudio must come from the same one as torch).
set -euo pipefail
here=$(cd "$(dirname "$0")/.." && pwd)
dir=${1:-$here/.cache/wheelhouse}
reqs=("${@:2}")
[ -n "${REQUIREMENTS_FILE:-}" ] && reqs+=(-r "$REQUIREMENTS_FILE")
. "$here/requirements/pins.env"
torch=${TORCH:-$TORCH_VERSION}
ds=${DEEPSPEED:-$DEEPSPEED_VERSION}
mkdir -p "$dir"
if [ ${#reqs[@]} -eq 0 ] && ls "$dir"/torch-"$torch"*.whl "$dir"/deepspeed-"$ds"-*.whl >/dev/null 2>&1; then
  echo "wheelhouse $dir has torch $torch and deepspeed $ds"; exit 0
fi
py=${PYTHON:-python3}
index=()
[ -n "${TORCH_INDEX:-}" ] && index=(--extra-index-url "$TORCH_INDEX")
# One resolution for everything: the requirements' versions fit the pinned torch and DeepSpeed.
"$py" -m pip download -q --disable-pip-version-check "${index[@]}" -d "$dir" \
  "torch==$torch" "deepspeed==$ds" "${reqs[@]}"
# DeepSpeed ships as an sdist: build it once here into a pure-python wheel (ops JIT-built on nodes).
if [ -f "$dir/deepspeed-$ds.tar.gz" ]; then
  "$py" -m pip wheel -q --disable-pip-version-check --no-deps -w "$dir" "$dir/deepspeed-$ds.tar.gz"
  rm -f "$dir/deepspeed-$ds.tar.gz"
fi
ls "$dir"/torch-"$torch"*.whl "$dir"/deepspeed-"$ds"-*.whl
