#!/usr/bin/env bash
# Installs JAX's CUDA plugin into the virtual environment VENV (default .venv) where JAX should
# run on an NVIDIA GPU, pinned to pyproject.toml's jaxlib; says what it chose and why.
# nodrop/_gpu.py decides: NODROP_JAX_CUDA=1 installs the plugin, 0 does not, unset or auto
# installs it where `nvidia-smi -L` lists a GPU whose driver runs CUDA 13. Run by scripts/setup.sh.
set -euo pipefail
cd "$(dirname "$0")/.."
venv=${1:-.venv}

say() { printf '\033[1m[setup]\033[0m %s\n' "$*"; }
die() { printf '\033[31m[setup] error:\033[0m %s\n' "$*" >&2; exit 1; }

choice=$("$venv/bin/python" nodrop/_gpu.py pyproject.toml) || die "cannot decide on JAX's CUDA plugin"
{ read -r platform; read -r reason; read -r requirements || true; } <<<"$choice"
if [ "$platform" != cuda ]; then
  say "JAX on the CPU: $reason"
  exit 0
fi
read -r -a plugin <<<"$requirements"
version=${plugin[1]##*==}
installed=$("$venv/bin/python" -c 'import importlib.metadata as m
print(m.version("jax-cuda13-plugin"), m.version("jax-cuda13-pjrt"))' 2>/dev/null || true)
if [ "$installed" = "$version $version" ]; then
  say "JAX on the GPU ($reason): its CUDA plugin $version is installed"
else
  say "JAX on the GPU ($reason): installing its CUDA plugin ${plugin[*]}"
  "$venv/bin/pip" install -q "${plugin[@]}" || die "installing JAX's CUDA plugin failed"
fi
