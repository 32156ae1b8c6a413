source .gpu/setup.sh > /dev/null 2>&1
cp .gpu/call77.sh $OUT/
mkdir -p /tmp/res
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
python3 -c "import torch; print(torch.__version__, torch.cuda.nccl.version())"
F="--cases layer --hidden 8192 --tokens 8K,16K --repeats 5 --warmup 2 --no-overlap --variants megatron-sp,no-comm,ring,ring-interleaved"
run() { name=$1; shift; env "$@" NCCL_P2P_DISABLE=1 NCCL_DEBUG=INFO NCCL_DEBUG_SUBSYS=INIT timeout 60 torchrun --nproc_per_node 2 bench/layers.py $F --label $name --out /tmp/res/$name.json > /tmp/res/$name.log 2>&1; echo "$name rc=$?"; grep -m2 "via SHM\|via P2P" /tmp/res/$name.log; grep "^| slow" /tmp/res/$name.log | grep -v "link | block"; }
run slow
run slow-ce3 NCCL_SHM_USE_CUDA_MEMCPY=1 NCCL_SHM_MEMCPY_MODE=3
run slow-ce1 NCCL_SHM_USE_CUDA_MEMCPY=1
run slow-ch2 NCCL_MAX_NCHANNELS=2
timeout 170 python3 -m pytest -q -rs tests/test_recompute_block.py > /tmp/res/pytest.txt 2>&1
echo "pytest rc=$?"; tail -3 /tmp/res/pytest.txt
tar czf $OUT/call77.tgz -C /tmp/res .
