source .gpu/setup.sh > /dev/null 2>&1
nvidia-smi --query-gpu=name --format=csv,noheader
mkdir -p /tmp/res
R=bench/results/2026-11-26-s6-4xH100
B="--gpus 2 --seq-len 32768 --global-batch-tokens 262144 --tp-modes megatron ring --steps 6 --data .gpu/stdlib.jsonl --tokenizer .gpu/stdlib-bpe32k.json --gpu h100-80g --label slow --plans static,planned --plan-args=--nvlink-gbs=21"
export NCCL_P2P_DISABLE=1
timeout 570 python3 bench/hotswitch.py --model bench/models/llama-4b-untied.json $B --config pp1-static=$R/pp1-static-llama-4b-untied/ds_stpar.json --launcher-args "--include localhost:0,1 --master_port 29521" --out /tmp/res/untied-slow > /tmp/res/untied-slow.out 2>&1 &
timeout 570 python3 bench/hotswitch.py --model bench/models/llama-4b.json $B --launcher-args "--include localhost:2,3 --master_port 29522" --out /tmp/res/tied-slow > /tmp/res/tied-slow.out 2>&1 &
wait
tar czf $OUT/call27.tgz -C /tmp/res .
tail -n 7 /tmp/res/untied-slow.out; tail -n 7 /tmp/res/tied-slow.out
