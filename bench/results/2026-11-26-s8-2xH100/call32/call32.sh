source .gpu/setup.sh > /dev/null 2>&1
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
cp .gpu/call32.sh $OUT/
timeout 90 python3 bench/lm_head.py --reps 3 > $OUT/lm_head.txt 2>&1; cat $OUT/lm_head.txt
mkdir -p /tmp/res
B="--gpus 2 --seq-len 65536 --global-batch-tokens 524288 --tp-modes megatron ring --data .gpu/stdlib.jsonl --tokenizer .gpu/stdlib-bpe32k.json --gpu h100-80g --model bench/models/llama-4b-untied-64k.json --steps 4 --label slow --plan-args=--nvlink-gbs=21"
NCCL_P2P_DISABLE=1 timeout 470 python3 bench/hotswitch.py $B --plans static --config tp2ring-static=bench/results/2026-11-26-s8-2xGPU/tp2ring-static-64k.json --out /tmp/res/slow64k > /tmp/res/slow64k.out 2>&1
tar czf $OUT/call32.tgz -C /tmp/res .
grep -E "^step|measured" -r /tmp/res --include=*.log --include=*.out | tail -n 20; tail -n 8 /tmp/res/slow64k.out
