#!/usr/bin/env bash
# onnxruntime-gpu to a lent GPU machine in parts (docs/gpu.md). Its wheel (255 MB) is larger than what one
# device call carries (64 MiB), so it travels as an xz archive cut into parts, one part per call, gathered on
# the machine while it stays warm, then unpacked beside the image's CPU onnxruntime.
#
#   here:     bash scripts/ort_gpu_parts.sh prepare            # -> .ortgpu/part-00 ... and SHA256SUMS
#   device:   bash scripts/ort_gpu_parts.sh stash .ortgpu/part-NN   # one call each, `carry` naming the part
#   device:   eval "$(bash scripts/ort_gpu_parts.sh install)"  # last call: PYTHONPATH and LD_LIBRARY_PATH set
set -euo pipefail

VERSION="${ORT_GPU_VERSION:-1.31.1}"   # built for CUDA 13, as the lent machines' PyTorch
DIR="${ORT_GPU_DIR:-.ortgpu}"           # here: git ignores it
GATHER=/tmp/ortgpu                      # on the device machine
SITE=/tmp/ortsite
PART_SIZE=60M                           # the checkout (about 2 MB) rides along in each call

case "${1:-}" in
  prepare)
    mkdir -p "$DIR" && rm -f "$DIR"/part-* "$DIR"/SHA256SUMS
    tmp=$(mktemp -d) && trap 'rm -rf "$tmp"' EXIT
    python -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
      --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 \
      -d "$tmp" "onnxruntime-gpu==$VERSION" >&2
    mkdir "$tmp/site" && (cd "$tmp/site" && python -m zipfile -e "$tmp"/onnxruntime_gpu-*.whl .)
    tar -C "$tmp/site" -cf - . | xz -T0 -9 > "$tmp/ort-gpu.tar.xz"  # 203 MB against the wheel's 244
    (cd "$tmp" && sha256sum ort-gpu.tar.xz) > "$DIR/SHA256SUMS"
    split -b "$PART_SIZE" -d "$tmp/ort-gpu.tar.xz" "$DIR/part-"
    ls -l "$DIR"
    ;;
  stash)
    part="${2:?usage: stash PART}"
    mkdir -p "$GATHER" && cp "$part" "$GATHER/" && cp "$(dirname "$part")/SHA256SUMS" "$GATHER/"
    ls -l "$GATHER"
    ;;
  install)
    (cd "$GATHER" && cat part-* > ort-gpu.tar.xz && sha256sum -c SHA256SUMS >&2)
    rm -rf "$SITE" && mkdir -p "$SITE" && tar -C "$SITE" -xJf "$GATHER/ort-gpu.tar.xz"
    # cuBLAS and cuDNN for CUDA 13 come with the image's PyTorch (its nvidia-* packages)
    libs=$(python3 -c 'import glob, site, os; print(":".join(sorted({os.path.dirname(p) for d in site.getsitepackages() for p in glob.glob(d + "/nvidia/*/lib/*.so*")})))')
    echo "export PYTHONPATH=$SITE\${PYTHONPATH:+:\$PYTHONPATH}"
    echo "export LD_LIBRARY_PATH=$libs\${LD_LIBRARY_PATH:+:\$LD_LIBRARY_PATH}"
    ;;
  *)
    sed -n '2,8p' "$0" >&2
    exit 2
    ;;
esac
