source .gpu/setup.sh > /dev/null 2>&1
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
cp .gpu/call38.sh $OUT/
mkdir -p /tmp/res
B="--gpus 2 --seq-len 131072 --global-batch-tokens 524288 --tp-modes megatron ring --data .gpu/stdlib.jsonl --tokenizer .gpu/stdlib-bpe32k.json --gpu h100-80g --model bench/models/llama-4b-untied-128k.json --steps 4 --seed 99 --label slow --plan-args=--nvlink-gbs=21"
NCCL_P2P_DISABLE=1 timeout 575 python3 bench/hotswitch.py $B --plans static,planned --out /tmp/res/slow128k > /tmp/res/slow128k.out 2>&1
tar czf $OUT/call38.tgz -C /tmp/res .
grep -E "^step" -r /tmp/res --include=*.log | tail -n 20; tail -n 8 /tmp/res/slow128k.out
