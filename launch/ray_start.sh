#!/usr/bin/env bash
# Start one node of a sluice Ray cluster (run on every node; SLURM and KubeRay files call it).
#
#   launch/ray_start.sh head                       the head: GCS, dashboard, the driver's node;
#                                                  offers no CPUs or GPUs, so no pool lands on it
#   launch/ray_start.sh gpu     --address H:6379   a GPU node: engines and train ranks
#   launch/ray_start.sh sandbox --address H:6379   a CPU node with the `sandbox` resource:
#                                                  sandbox workers and agent-loop workers
#   launch/ray_start.sh wait    --address H:6379 --nodes N [--timeout S]
#                                                  block until N nodes have joined
#   add --block to keep `ray start` in the foreground (SLURM steps, containers)
#
# Environment: SLUICE_VENV (default .venv; its bin/ray is used when present), RAY_PORT
# (6379), SLUICE_NUM_CPUS (logical CPUs; default the node's cores), SLUICE_NUM_GPUS (gpu
# role; default the GPUs nvidia-smi lists), SLUICE_SANDBOX_RESOURCE (sandbox),
# SLUICE_SANDBOX_SLOTS (1: one sandbox bundle per node, as the recipes plan),
# SLUICE_RAY_DRY_RUN=1 prints the command instead of running it.
#
# Ports are fixed so that firewalls can be opened for them (launch/README.md): 6379 GCS,
# 8265 dashboard, 10001 client, 6380-6383 node manager / object manager / agent / metrics,
# 10002-19999 workers. GPU nodes also need every TCP port open between each other (NCCL,
# torch.distributed rendezvous and the weight group pick ports at run time).
set -euo pipefail

role=${1:-}
shift || true
address="" block="" nodes="" timeout=600
while [ $# -gt 0 ]; do
  case "$1" in
    --address) address=$2; shift 2 ;;
    --block) block="--block"; shift ;;
    --nodes) nodes=$2; shift 2 ;;
    --timeout) timeout=$2; shift 2 ;;
    *) echo "unknown argument $1 (see the header of $0)" >&2; exit 2 ;;
  esac
done

root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
venv=${SLUICE_VENV:-$root/.venv}
ray_bin=ray
python_bin=python3
if [ -x "$venv/bin/ray" ]; then ray_bin="$venv/bin/ray"; python_bin="$venv/bin/python"; fi
port=${RAY_PORT:-6379}
cpus=${SLUICE_NUM_CPUS:-$(nproc)}
resource=${SLUICE_SANDBOX_RESOURCE:-sandbox}
slots=${SLUICE_SANDBOX_SLOTS:-1}
fixed_ports=(--node-manager-port=6380 --object-manager-port=6381
             --dashboard-agent-grpc-port=6382 --metrics-export-port=6383
             --min-worker-port=10002 --max-worker-port=19999)

need_address() {
  [ -n "$address" ] || { echo "$role needs --address HEAD:$port" >&2; exit 2; }
}

case "$role" in
  head)
    cmd=("$ray_bin" start --head --port="$port" --num-cpus=0 --num-gpus=0
         --dashboard-host=0.0.0.0 --dashboard-port=8265 --ray-client-server-port=10001
         "${fixed_ports[@]}") ;;
  gpu)
    need_address
    gpus=${SLUICE_NUM_GPUS:-$(nvidia-smi -L 2>/dev/null | grep -c '^GPU' || true)}
    [ "${gpus:-0}" -ge 1 ] || { echo "no GPU found (nvidia-smi -L); set SLUICE_NUM_GPUS" >&2; exit 2; }
    cmd=("$ray_bin" start --address="$address" --num-cpus="$cpus" --num-gpus="$gpus"
         "${fixed_ports[@]}") ;;
  sandbox)
    need_address
    if ! command -v podman >/dev/null 2>&1 && ! command -v docker >/dev/null 2>&1; then
      echo "warning: no podman or docker on $(hostname): envs.sandbox_backend=container cannot run here" >&2
    fi
    cmd=("$ray_bin" start --address="$address" --num-cpus="$cpus" --num-gpus=0
         --resources="{\"$resource\": $slots}" "${fixed_ports[@]}") ;;
  wait)
    need_address
    [ -n "$nodes" ] || { echo "wait needs --nodes N" >&2; exit 2; }
    cmd=("$python_bin" -c "
import sys, time, ray
ray.init(address='$address', log_to_driver=False)
deadline = time.monotonic() + $timeout
while True:
    alive = sum(1 for n in ray.nodes() if n['Alive'])
    if alive >= $nodes:
        print(f'{alive} nodes joined'); sys.exit(0)
    if time.monotonic() > deadline:
        print(f'only {alive} of $nodes nodes joined within ${timeout}s', file=sys.stderr); sys.exit(1)
    time.sleep(5)
") ;;
  *)
    echo "usage: $0 head|gpu|sandbox|wait [--address HEAD:PORT] [--block] (see the header)" >&2
    exit 2 ;;
esac
[ -n "$block" ] && [ "$role" != wait ] && cmd+=("$block")

if [ "${SLUICE_RAY_DRY_RUN:-0}" = 1 ]; then
  printf '%q ' "${cmd[@]}"; echo
  exit 0
fi
exec "${cmd[@]}"
