# Sourced by the device scripts (scripts/device/dose_device.sh, scripts/device/dose_accuracy_device.sh) from the repository root: the
# Python ($PYTHON, else python3) with transformer_lens and jsonschema (on a lent GPU machine, from the wheels carried
# in .whl), src on PYTHONPATH, one thread per process, the device named in the log; and with DEVICE=cuda NVIDIA MPS
# where it is installed, so that the small kernels of many processes sharing the GPU run side by side rather than
# time-sliced (where it does not start, it is stopped again and the script goes on without).
PY=${PYTHON:-python3}
if ! $PY -c 'import transformer_lens, jsonschema' 2> /dev/null && ls .whl/*.whl > /dev/null 2>&1; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
        || exit 1
    export PYTHONPATH=/tmp/site
fi
export PYTHONPATH=$PWD/src${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1 OMP_NUM_THREADS=1
date -u; nvidia-smi -L 2>/dev/null || echo "no nvidia-smi"
if [ "${DEVICE:-cuda}" = cuda ] && command -v nvidia-cuda-mps-control > /dev/null; then
    export CUDA_MPS_PIPE_DIRECTORY=/tmp/mps CUDA_MPS_LOG_DIRECTORY=/tmp/mps-log
    mkdir -p $CUDA_MPS_PIPE_DIRECTORY $CUDA_MPS_LOG_DIRECTORY
    if nvidia-cuda-mps-control -d && timeout 60 $PY -c 'import torch; torch.ones(1, device="cuda").sum().item()'; then
        echo "MPS on"
    else
        echo quit | nvidia-cuda-mps-control 2>/dev/null; unset CUDA_MPS_PIPE_DIRECTORY CUDA_MPS_LOG_DIRECTORY
        echo "MPS off (it did not start)"
    fi
fi
$PY -c 'import torch, transformer_lens; print("torch", torch.__version__, "cuda", torch.cuda.is_available())' || exit 1
