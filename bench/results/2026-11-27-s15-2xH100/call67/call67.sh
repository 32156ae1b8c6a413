source .gpu/setup.sh > /dev/null 2>&1
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
cp .gpu/call67.sh $OUT/
timeout 200 python3 -m pytest -q -rs tests/test_attention_gpu.py tests/test_recompute_block.py 2>&1 | tail -n 25 | tee $OUT/call67.txt
