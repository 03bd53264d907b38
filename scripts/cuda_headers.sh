#!/usr/bin/env bash
# Put CUDA 13's build headers (cupti.h, cuda.h, crt/) under build/cuda-headers/include, once, for
# the tests that compile the CUPTI injection library against a stand-in libcupti on a machine
# without CUDA (tests/integration/test_gpu_activity_library.py and others): the same headers a
# GPU machine with PyTorch's CUDA 13 wheels has, so a header the build needs and does not find
# fails here and not first on a lent GPU. Headers only: no CUDA library is unpacked, so nothing
# here turns GPU activity on. Sourced by setup.sh; safe to run by hand. Best effort: without the
# package index it says so and the tests that need the headers skip.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
dest=build/cuda-headers
[ -f "$dest/include/crt/host_defines.h" ] && [ -f "$dest/include/cupti.h" ] && exit 0
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
# The versions PyTorch 2.11's CUDA 13.0 wheels pin (cupti 13.0.85 on the H100 the check ran on).
if ! python3 -m pip download -q --no-deps --only-binary=:all: -d "$tmp" \
    nvidia-cuda-cupti==13.0.85 nvidia-cuda-runtime==13.0.96 nvidia-cuda-crt==13.0.88 \
    >"$tmp/log" 2>&1; then
    echo "cuda_headers: could not download the CUDA header wheels (see pip); tests needing them skip" >&2
    exit 0
fi
mkdir -p "$tmp/x" "$dest"
for w in "$tmp"/*.whl; do
    python3 -m zipfile -e "$w" "$tmp/x"
done
rm -rf "$dest/include"
cp -r "$tmp/x/nvidia/cu13/include" "$dest/include"
