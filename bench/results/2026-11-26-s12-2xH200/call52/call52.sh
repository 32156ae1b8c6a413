source .gpu/setup.sh > /dev/null 2>&1
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
cp .gpu/call52.sh $OUT/
mkdir -p /tmp/res
B="--gpus 2 --seq-len 32768 --global-batch-tokens 262144 --tp-modes megatron ring --data .gpu/stdlib.jsonl --tokenizer .gpu/stdlib-bpe32k.json --gpu h100-80g --model bench/models/llama-4b-untied.json --steps 7 --label nvlink"
timeout 540 python3 bench/hotswitch.py $B --plans static,planned --out /tmp/res/nvlink32k > /tmp/res/nvlink32k.out 2>&1
tar czf $OUT/call52.tgz -C /tmp/res .
grep -E "^step" -r /tmp/res --include=*.log | tail -n 20; tail -n 8 /tmp/res/nvlink32k.out
