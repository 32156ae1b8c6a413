source .gpu/setup.sh > /dev/null 2>&1
nvidia-smi --query-gpu=name --format=csv,noheader
mkdir -p /tmp/res
B="--gpus 2 --seq-len 32768 --global-batch-tokens 262144 --tp-modes megatron ring --steps 6 --data .gpu/stdlib.jsonl --tokenizer .gpu/stdlib-bpe32k.json --gpu h100-80g --plans static,planned"
timeout 575 python3 bench/hotswitch.py --model bench/models/llama-4b.json $B --label nvlink --launcher-args "--include localhost:0,1 --master_port 29521" --out /tmp/res/tied-nvlink > /tmp/res/tied-nvlink.out 2>&1 &
NCCL_P2P_DISABLE=1 timeout 575 python3 bench/hotswitch.py --model bench/models/llama-4b-untied.json $B --label slow --plan-args=--nvlink-gbs=21 --launcher-args "--include localhost:2,3 --master_port 29522" --out /tmp/res/untied-slow > /tmp/res/untied-slow.out 2>&1 &
wait
tar czf $OUT/call29.tgz -C /tmp/res .
tail -n 7 /tmp/res/tied-nvlink.out; tail -n 7 /tmp/res/untied-slow.out
