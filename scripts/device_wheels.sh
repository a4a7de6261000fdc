#!/usr/bin/env bash
# The wheels `scripts/gpu_check.py` needs on a GPU machine that has torch but no package index (the
# project's dependencies that such an image lacks, for its Python), downloaded into .whl/:
#
#     bash scripts/device_wheels.sh            # Python 3.12 wheels (the lent H200's image); PY=3.11 for 3.11
#
# Then, on the GPU machine, in the repository's root (with .whl/ carried there):
#
#     python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl
#     mkdir -p /tmp/ns/murmur && for d in peer dht averaging; do ln -s $PWD/$d /tmp/ns/murmur/$d; done
#     PYTHONPATH=/tmp/site:/tmp/ns python3 scripts/gpu_check.py
#
# Versions are the ones this project's venv resolved (.venv must exist: `make install`). A package
# published only as a source archive is built into a wheel here (all of them are pure Python).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-3.12}
DIST=(hivemind annotated-types base58 blake3 cffi cryptography idna mmh3 morphys multiaddr netaddr
      prefetch_generator protobuf py-cid py-multibase py-multicodec py-multihash pycparser pydantic
      pydantic_core python-baseconv safetensors typing_extensions typing-inspection varint)
mkdir -p .whl
for dist in "${DIST[@]}"; do
    version=$(.venv/bin/python -c "import importlib.metadata as m; print(m.version('$dist'))")
    if ! python3 -m pip download -q --no-deps --only-binary=:all: --python-version "$PY" --implementation cp \
            --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
            --platform manylinux1_x86_64 -d .whl "$dist==$version" 2>/dev/null; then
        python3 -m pip wheel -q --no-deps -w .whl "$dist==$version"
    fi
done
ls .whl
