#!/bin/bash
# lmforge on several nodes under SLURM: one torchrun per node, rendezvous at the first node.
#   sbatch examples/slurm_multinode.sh CONFIG.yaml RUN_DIR [--set section.key=value ...]
# RUN_DIR and the config's data.dir must be on a filesystem every node sees. Resubmitting the same job
# resumes from the newest checkpoint, also with another --nodes (set training.global_batch_size, and
# training.checkpoint_format: dcp so that no rank gathers the whole model).
#SBATCH --job-name=lmforge
#SBATCH --nodes=2
#SBATCH --ntasks-per-node=1          # one torchrun per node; it starts one process per GPU
#SBATCH --gpus-per-node=8
#SBATCH --cpus-per-task=32
#SBATCH --time=24:00:00
#SBATCH --output=%x-%j.out
set -euo pipefail
CONFIG=${1:?usage: sbatch examples/slurm_multinode.sh CONFIG.yaml RUN_DIR [--set k=v ...]}
RUN_DIR=${2:?usage: sbatch examples/slurm_multinode.sh CONFIG.yaml RUN_DIR [--set k=v ...]}
shift 2
HEAD=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)
export OMP_NUM_THREADS=$(( SLURM_CPUS_PER_TASK / SLURM_GPUS_PER_NODE ))
# export NCCL_SOCKET_IFNAME=ib0      # the network interface between nodes, if NCCL picks the wrong one
srun torchrun \
  --nnodes="$SLURM_NNODES" --nproc_per_node="$SLURM_GPUS_PER_NODE" \
  --rdzv_backend=c10d --rdzv_endpoint="$HEAD:29500" --rdzv_id="$SLURM_JOB_ID" \
  -m lmforge.cli train "$CONFIG" --run-dir "$RUN_DIR" --no-progress "$@"
