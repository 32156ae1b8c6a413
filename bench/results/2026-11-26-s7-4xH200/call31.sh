source .gpu/setup.sh > /dev/null 2>&1
nvidia-smi --query-gpu=name --format=csv,noheader
B="--gpus 2 --seq-len 65536 --global-batch-tokens 524288 --tp-modes megatron ring --data .gpu/stdlib.jsonl --tokenizer .gpu/stdlib-bpe32k.json --gpu h100-80g --model bench/models/llama-4b-untied-64k.json --steps 4 --label slow --plan-args=--nvlink-gbs=21"
export NCCL_P2P_DISABLE=1
timeout 345 python3 bench/hotswitch.py $B --plans static --launcher-args "--include localhost:0,1 --master_port 29521" --out $OUT/static64k > $OUT/static64k.out 2>&1 &
timeout 345 python3 bench/hotswitch.py $B --plans planned --launcher-args "--include localhost:2,3 --master_port 29522" --out $OUT/planned64k > $OUT/planned64k.out 2>&1 &
wait
tail -n 5 $OUT/static64k.out; tail -n 5 $OUT/planned64k.out
