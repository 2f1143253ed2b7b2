#!/usr/bin/env bash
# Sets up a fresh machine for nodrop: system libraries, a Python 3.12 virtual environment with the
# pinned jax (and its CUDA plugin where there is an NVIDIA GPU), and the package itself with its
# train and test extras at the tested versions (scripts/constraints.txt), built with its C++ tests.
# Safe to re-run: finished steps are skipped, and the C++ build is incremental (build/wheel).
set -euo pipefail
cd "$(dirname "$0")/.."

say() { printf '\033[1m[setup]\033[0m %s\n' "$*"; }
die() { printf '\033[31m[setup] error:\033[0m %s\n' "$*" >&2; exit 1; }

# oneDNN: CPU GEMMs; GoogleTest: C++ tests; OpenMP comes with g++.
SYSTEM_PACKAGES=(g++ cmake ninja-build libdnnl-dev libgtest-dev)
missing=()
for pkg in "${SYSTEM_PACKAGES[@]}"; do
  dpkg -s "$pkg" >/dev/null 2>&1 || missing+=("$pkg")
done
if ((${#missing[@]})); then
  say "installing system packages: ${missing[*]}"
  SUDO=""; [ "$(id -u)" -eq 0 ] || SUDO="sudo"
  $SUDO apt-get update -qq || die "apt-get update failed"
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq "${missing[@]}" >/dev/null \
    || die "apt-get install ${missing[*]} failed"
fi

# jax/jaxlib 0.11.2 (the GPU machine's version) publish wheels for Python >= 3.12 only.
find_python() {
  for candidate in python3.12 python3.13 "${PYENV_ROOT:-$HOME/.pyenv}"/versions/3.12*/bin/python3.12 \
                   "${PYENV_ROOT:-$HOME/.pyenv}"/versions/3.13*/bin/python3.13; do
    if command -v "$candidate" >/dev/null 2>&1 && "$candidate" -c 'import sys; assert sys.version_info >= (3, 12)' 2>/dev/null; then
      command -v "$candidate"; return 0
    fi
  done
  return 1
}

if [ ! -x .venv/bin/python ]; then
  PY=$(find_python) || die "Python 3.12 or newer is needed (jaxlib 0.11.2 has no wheels for older ones)"
  say "creating .venv with $PY"
  "$PY" -m venv .venv
fi

stamp=.venv/.nodrop-deps
if [ ! -f "$stamp" ] || [ pyproject.toml -nt "$stamp" ] || [ scripts/setup.sh -nt "$stamp" ] \
   || [ scripts/constraints.txt -nt "$stamp" ]; then
  say "installing pinned Python dependencies"
  .venv/bin/pip install -q --upgrade pip
  # Build requirements first: the package is built without isolation so its build dir is reused.
  .venv/bin/pip install -q "scikit-build-core==1.1.2" "jax==0.11.2" "jaxlib==0.11.2"
  # CUTLASS/CuTe headers for the CUDA engine; only the headers are used, hence --no-deps.
  .venv/bin/pip install -q --no-deps "nvidia-cutlass==4.2.0.0"
  touch "$stamp"
fi

# JAX's CUDA plugin where JAX should run on an NVIDIA GPU (NODROP_JAX_CUDA=1 or 0 overrides).
bash scripts/jax-plugin.sh .venv

if command -v nvcc >/dev/null 2>&1; then
  say "building and installing nodrop (CPU and CUDA engines, FFI handlers, C++ tests); the CUDA"
  say "engine's CUTLASS kernels take about 35 minutes on 2 cores the first time"
else
  say "building and installing nodrop (CPU engine, FFI handlers, C++ tests); no nvcc: no CUDA engine"
fi
# Editable: the package's Python files are the ones in this folder (so `python -m nodrop`, pytest
# and notebooks in the repository root run them); the built libraries go to site-packages.
.venv/bin/pip install -v --no-build-isolation \
  -C build-dir=build/wheel -C cmake.define.NODROP_BUILD_TESTS=ON \
  -c scripts/constraints.txt -e ".[train,test]" \
  || die "building nodrop failed (see the compiler output above)"
say "ready"
