source .gpu/setup.sh > /dev/null 2>&1
nvidia-smi --query-gpu=name --format=csv,noheader
mkdir -p /tmp/res
R=bench/results/2026-11-26-s7-4xH200/call28/tied-slow
B="--gpus 2 --seq-len 32768 --global-batch-tokens 262144 --tp-modes megatron ring --data .gpu/stdlib.jsonl --tokenizer .gpu/stdlib-bpe32k.json --gpu h100-80g --plans static,planned --model bench/models/llama-4b.json"
NCCL_P2P_DISABLE=1 timeout 580 python3 bench/hotswitch.py $B --steps 5 --label slow --plan-args=--nvlink-gbs=21 --config tp2ring-static=$R/static/ds_stpar.json --config tp2ring-planned=$R/planned/ds_stpar.json --launcher-args "--include localhost:0,1 --master_port 29521" --out /tmp/res/tied-slow > /tmp/res/tied-slow.out 2>&1 &
timeout 580 python3 bench/hotswitch.py $B --steps 6 --label nvlink --launcher-args "--include localhost:2,3 --master_port 29522" --out /tmp/res/tied-nvlink > /tmp/res/tied-nvlink.out 2>&1 &
wait
tar czf $OUT/call30.tgz -C /tmp/res .
tail -n 8 /tmp/res/tied-slow.out; tail -n 7 /tmp/res/tied-nvlink.out
