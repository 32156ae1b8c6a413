"""Write the ready configs of ``configs/`` with the planner: ``python configs/regenerate.py``.

Each ready config is the ``ds_stpar.json`` that ``ds-stpar plan <arguments> --out DIR`` writes
(a DeepSpeed config whose top-level ``"ds_stpar"`` section carries the model, the training
setup and the chosen layout): :func:`plan_config` runs the CLI's own ``plan`` command, so a
config here and a config a user makes with the same arguments are the same file.
:data:`READY` lists them with the arguments, every one spelled out (GPU, GPUs per node,
batch) so that a change of a CLI default does not silently change a config.

``tests/test_configs.py`` re-plans each entry and fails when a committed file differs, i.e.
after any change to the planner, the calibration, the presets or the emitters that moves a
number. Then rerun this script (all files, or the names given) and review the diff::

    python configs/regenerate.py                      # every ready config
    python configs/regenerate.py llama2-7b-8xh100.json

Files of ``configs/`` that are written by hand are listed in :data:`HAND_WRITTEN`.
"""

from __future__ import annotations

import contextlib
import io
import os
import sys
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from ds_stpar import cli
from ds_stpar.config import StparConfig
from ds_stpar.errors import ConfigError, StparError

CONFIGS_DIR = Path(__file__).resolve().parent
PLAN_JSON = "ds_stpar.json"  # the file of `ds-stpar plan --out DIR` copied here
HAND_WRITTEN = ("tiny-cpu.json",)  # the CPU demo of ds_stpar.train, not a planner output


@dataclass(frozen=True)
class ReadyConfig:
    """``configs/<name>`` is ``ds-stpar plan <plan_args> --out DIR``'s ds_stpar.json."""

    name: str
    plan_args: tuple[str, ...]

    def command(self) -> str:
        return "ds-stpar plan " + " ".join(self.plan_args) + " --out DIR"


READY = (
    # GPT-3 paper (Brown et al. 2020, table 2.1) for 1.3B: context 2048, batch 1M tokens.
    ReadyConfig(
        "gpt3-1.3b-2xh100.json",
        ("--model", "gpt3-1.3b", "--gpu", "h100-80g", "--gpus", "2", "--gpus-per-node", "2",
         "--seq-len", "2048", "--global-batch", "512"),
    ),
    # Llama 2 paper (Touvron et al. 2023): context 4096, global batch 4M tokens.
    ReadyConfig(
        "llama2-7b-8xh100.json",
        ("--model", "llama2-7b", "--gpu", "h100-80g", "--gpus", "8", "--gpus-per-node", "8",
         "--seq-len", "4096", "--global-batch-tokens", "4194304"),
    ),
    # 8 nodes of 8; context 8192 and 4M tokens per step, as docs/planner.md's example.
    ReadyConfig(
        "llama3-70b-64xh100.json",
        ("--model", "llama3-70b", "--gpu", "h100-80g", "--gpus", "64", "--gpus-per-node", "8",
         "--seq-len", "8192", "--global-batch-tokens", "4194304"),
    ),
)  # fmt: skip


def plan_config(plan_args: Sequence[str]) -> str:
    """The text of ``ds_stpar.json`` from ``ds-stpar plan <plan_args> --out DIR``.

    Runs the CLI's ``plan`` command itself (parser, search, emitters, atomic writing) into a
    temporary directory; its stdout (the JSON report) is discarded. A planner error is raised
    as the :class:`~ds_stpar.errors.StparError` it is.
    """
    with tempfile.TemporaryDirectory(prefix="ds_stpar-config-") as tmp:
        out = Path(tmp) / "plan"
        args = cli.build_parser().parse_args(["plan", *plan_args, "--out", str(out), "--json"])
        with contextlib.redirect_stdout(io.StringIO()):
            args.func(args)
        return (out / PLAN_JSON).read_text(encoding="utf-8")


def ready(name: str) -> ReadyConfig:
    """The entry of :data:`READY` called ``name``."""
    for entry in READY:
        if entry.name == name:
            return entry
    raise ConfigError(f"{name}: not a ready config; choose from {', '.join(e.name for e in READY)}")


def regenerate(names: Sequence[str] = (), configs_dir: Path = CONFIGS_DIR) -> list[Path]:
    """Re-plan the named ready configs (all if none) and write them into ``configs_dir``.

    Every config is planned before any file is replaced; each file is replaced atomically.
    """
    entries = [ready(name) for name in names] if names else list(READY)
    texts = {entry.name: plan_config(entry.plan_args) for entry in entries}
    written = []
    for name, text in texts.items():
        target = configs_dir / name
        tmp = configs_dir / f".{name}.tmp-{os.getpid()}"
        try:
            tmp.write_text(text, encoding="utf-8")
            os.replace(tmp, target)
        finally:
            tmp.unlink(missing_ok=True)
        written.append(target)
    return written


def main(argv: Sequence[str] | None = None) -> int:
    names = list(sys.argv[1:] if argv is None else argv)
    try:
        for path in regenerate(names):
            home = StparConfig.from_deepspeed_json(str(path)).home
            print(f"wrote {path.name}: {home.short()} ({ready(path.name).command()})")
    except StparError as err:
        print(f"regenerate: error: {err}", file=sys.stderr)
        return err.exit_code
    return 0


if __name__ == "__main__":
    sys.exit(main())
