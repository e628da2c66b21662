#!/usr/bin/env bash
# The test command (README, .ci/run): builds the transformers oracle venv (Python 3.11, CPU torch)
# on first use, regenerates the oracle fixtures, then runs the whole pytest suite with the current
# Python (3.12, m3jax installed). Extra arguments go to pytest. A second oracle venv with torchvision
# (tests/oracle/requirements-vision.txt) writes the image/video processor fixtures, and
# scripts/fetch_cuda_compile_tools.sh the tools tests/pallas/test_compile.py compiles kernels with. pip keeps no
# cache copy of the wheels (--no-cache-dir): on x86_64 the vision venv's torch is a CUDA build of
# several GB, and a CI run once ran out of disk while installing it.
set -euo pipefail
cd "$(dirname "$0")/.."
. scripts/find_python.sh
ORACLE=${M3JAX_ORACLE_VENV:-.venvs/oracle}
if [ ! -x "$ORACLE/bin/python" ] || ! "$ORACLE/bin/python" -c "import torch, transformers" 2>/dev/null; then
  echo "== building the oracle venv in $ORACLE (Python 3.11, torch CPU, transformers)"
  "$(find_python 3.11)" -m venv "$ORACLE"
  "$ORACLE/bin/python" -m pip install -q --upgrade pip
  "$ORACLE/bin/python" -m pip install -q --no-cache-dir -r tests/oracle/requirements.txt
fi
echo "== regenerating oracle fixtures"
"$ORACLE/bin/python" tests/oracle/make_fixtures.py --out tests/fixtures
VISION=${M3JAX_ORACLE_VISION_VENV:-.venvs/oracle-vision}
if [ ! -x "$VISION/bin/python" ] || ! "$VISION/bin/python" -c "import torch, torchvision, transformers, av, PIL" 2>/dev/null; then
  echo "== building the vision oracle venv in $VISION (Python 3.11, torch + torchvision, transformers)"
  "$(find_python 3.11)" -m venv "$VISION"
  "$VISION/bin/python" -m pip install -q --upgrade pip
  "$VISION/bin/python" -m pip install -q --no-cache-dir -r tests/oracle/requirements-vision.txt
fi
echo "== regenerating processor fixtures (transformers' image/video processors)"
"$VISION/bin/python" tests/oracle/make_processor_fixtures.py --out tests/fixtures/processor
echo "== CUDA compile tools for tests/pallas/test_compile.py (the PJRT plugin and ptxas, from PyPI)"
# Without them that test skips and says so; the rest of the suite does not need them.
if ! PYTHON=python scripts/fetch_cuda_compile_tools.sh; then
  echo "   not fetched (see above): tests/pallas/test_compile.py will skip"
fi
echo "== pytest"
# Two pytest workers (pytest-xdist), each taking whole files, so that a file's module fixtures are built
# once: most of the suite is single-threaded Python (Mosaic lowering, interpret mode), so two workers
# finish sooner on CI's two cores (benchmarks/RESULTS.md#suite-time-xdist).
# M3JAX_TEST_WORKERS=0 runs it in this process.
exec python -m pytest -q -n "${M3JAX_TEST_WORKERS:-2}" --dist loadfile "$@"
