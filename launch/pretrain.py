"""Train with a ds_stpar plan under DeepSpeed, with sequence-length buckets and hot switching.

    deepspeed [--num_gpus N | --num_nodes M --hostfile H] launch/pretrain.py \\
        --config ds_stpar.json [--data PATH] [--steps N] [--save DIR] [--load DIR] [--out DIR]

``--deepspeed_config`` is an alias of ``--config``; ``--local_rank`` (added by the launcher)
is accepted. See docs/training.md and ``ds_stpar.train``.
"""

import sys

from ds_stpar.train import main

if __name__ == "__main__":
    sys.exit(main(prog="pretrain.py"))
