#!/usr/bin/env bash
# The full round again on the variant library, everything packed into one file (the device tool returns only 8 files).
set -u
start=$(date +%s)
mkdir -p /tmp/b && tar -xJf build/gpubin/bins.tar.xz -C /tmp/b
mkdir -p /tmp/r
timeout 560 bash scripts/gpu-check.sh /tmp/r/round /tmp/b/variant > /tmp/r/gpu-check.out 2>&1
echo "gpu-check exit $? after $(( $(date +%s) - start )) s" >> /tmp/r/gpu-check.out
tar -C /tmp/r -czf $OUT/round.tgz . ; cp /tmp/r/gpu-check.out $OUT/
tail -32 /tmp/r/gpu-check.out
