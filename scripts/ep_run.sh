#!/usr/bin/env bash
# Expert-parallel `nodrop train` on every GPU of one host, or of several hosts, unchanged:
# one process per host, each driving all of its GPUs, on the mesh data=<hosts>,expert=<GPUs per
# host> (the token exchange stays inside a host's NVLink; hosts are data-parallel).
#
#   one host:                   scripts/ep_run.sh --preset mixtral --steps 200
#   SLURM, 4 nodes:             srun --nodes=4 --ntasks-per-node=1 scripts/ep_run.sh --preset ...
#   several hosts, no SLURM:    on host i of N (i = 0 runs the coordinator):
#     JAX_COORDINATOR_ADDRESS=host0:12345 JAX_NUM_PROCESSES=N JAX_PROCESS_ID=i scripts/ep_run.sh ...
#
# Flags after the script's name go to `nodrop train`; a --mesh among them replaces the default.
# Environment: GPUS (GPUs per host; default: nvidia-smi's count), NODROP (the command; default
# .venv/bin/nodrop, else .venv/bin/python -m nodrop), NCCL_NVLS_ENABLE (default 0: NVLink
# multicast off, see docs/scale-out.md).
# Every host needs the same repository, data and --out path (a shared filesystem for --out:
# process 0 writes the run folder, every process writes its shards of the checkpoints).
set -euo pipefail

cd "$(dirname "$0")/.."
if [[ -n ${NODROP:-} ]]; then
    read -ra nodrop <<< "$NODROP"
elif [[ -x .venv/bin/nodrop ]]; then
    nodrop=(.venv/bin/nodrop)
else
    nodrop=(.venv/bin/python -m nodrop)
fi
export NCCL_NVLS_ENABLE=${NCCL_NVLS_ENABLE:-0}

if [[ -z ${GPUS:-} ]]; then
    GPUS=$(nvidia-smi -L 2>/dev/null | grep -c '^GPU ' || true)
fi
if [[ ${GPUS:-0} -lt 1 ]]; then
    echo "ep_run.sh: no GPU found (nvidia-smi -L); set GPUS=N to give the count" >&2
    exit 2
fi

if [[ -n ${SLURM_JOB_ID:-} && ${SLURM_STEP_NUM_TASKS:-${SLURM_NTASKS:-1}} -gt 1 ]]; then
    hosts=${SLURM_STEP_NUM_NODES:-${SLURM_NNODES:-1}}
    tasks=${SLURM_STEP_NUM_TASKS:-$SLURM_NTASKS}
    if [[ $tasks -ne $hosts ]]; then
        echo "ep_run.sh: run one task per node (srun --ntasks-per-node=1), got $tasks tasks" \
             "on $hosts nodes" >&2
        exit 2
    fi
    # JAX's SLURM detection would give each process only the GPU of its local task index.
    export JAX_LOCAL_DEVICE_IDS=${JAX_LOCAL_DEVICE_IDS:-$(seq -s, 0 $((GPUS - 1)))}
else
    hosts=${JAX_NUM_PROCESSES:-1}
fi

exec "${nodrop[@]}" train --mesh "data=$hosts,expert=$GPUS" "$@"
