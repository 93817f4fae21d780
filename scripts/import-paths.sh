#!/bin/sh
# The project's own Python import paths under the repository root $1, one a line: the root (train),
# plugins/module_utils (dscplan, the plan), node (dscnode, the node helper) and molecule (cluster,
# the container tier's cluster). setup-control.sh writes them into the control venv's .pth; the GPU
# benchmarks, without that venv, put them on PYTHONPATH (bench/gpu_ansible.sh).
printf '%s\n' "$1" "$1/plugins/module_utils" "$1/node" "$1/molecule"
