# sourced at the start of every GPU call: wheels, paths, NCCL/CUDA settings
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=$PWD:/tmp/site PATH=/tmp/site/bin:$PATH PYTHONUNBUFFERED=1 CUDA_DEVICE_MAX_CONNECTIONS=1
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
nvidia-smi topo -m | head -8
