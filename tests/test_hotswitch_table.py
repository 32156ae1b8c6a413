"""bench/hotswitch.py's tables: microseconds per token, predicted against measured, and the
speedups over a named baseline, on hand-made metrics whose answer is counted by hand; a plan
file's report as the steps-run prediction reads it."""

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))

import hotswitch  # noqa: E402


def _row(step: int, bucket_s: dict, bucket_tokens: dict) -> dict:
    return {
        "step": step,
        "step_s": sum(bucket_s.values()),
        "switch_s": 0.0,
        "tokens": sum(bucket_tokens.values()),
        "bucket_s": bucket_s,
        "bucket_tokens": bucket_tokens,
        "loss": 1.0,
    }


def test_bucket_table_divides_seconds_by_tokens_over_the_timed_steps() -> None:
    rows = [
        _row(1, {"16": 9.0}, {"16": 1000}),  # the first step warms up: not timed
        _row(2, {"16": 3.0, "32": 4.0}, {"16": 1000, "32": 2000}),
        _row(3, {"16": 2.0}, {"16": 1500}),  # no 32-token rows this step
    ]
    report = {
        "buckets": [
            {"edge": 16, "short": "dp2", "time_s": 1.5, "tokens_per_step": 1000},
            {"edge": 32, "short": "tp2", "time_s": 2.0, "tokens_per_step": 1000},
            {"edge": 64, "short": "tp2 rc", "time_s": 1.0, "tokens_per_step": 10},
        ]
    }
    measured = {"planned": hotswitch.summarize(rows)}
    lines = hotswitch.bucket_table({"planned": report}, measured).splitlines()
    # <=16: (3 + 2) s over (1000 + 1500) tokens = 2000 us; predicted 1.5 s / 1000 = 1500 us
    assert lines[2] == "| planned | <=16 | dp2 | 1,000 | 1,250 | 1500.00 | 2000.00 | -25.0% |"
    # <=32: 4 s over 2000 tokens = 2000 us (a step without the bucket adds nothing to either)
    assert lines[3] == "| planned | <=32 | tp2 | 1,000 | 1,000 | 2000.00 | 2000.00 | +0.0% |"
    # <=64 never ran: no measured figure
    assert lines[4] == "| planned | <=64 | tp2 rc | 10 | n/a | 100000.00 | n/a | n/a |"


def test_table_takes_the_speedups_over_the_named_baseline() -> None:
    # two plans of one call on the same steps: the baseline ran 3000 tokens in (3 + 3) s,
    # the bucketed plan the same tokens in (2 + 2) s: 500 vs 750 tokens/s, 1.5x measured;
    # predicted 6 s vs 5 s, 1.2x; the steps run hold the expected tokens, so also 1.2x
    def report(short: str, step_s: float) -> dict:
        bucket = {"edge": 16, "short": short, "time_s": step_s, "tokens_per_step": 1500}
        return {
            "buckets": [{**bucket, "switch_s": 0.0, "peak_memory_gib": 10.0}],
            "bucketed_step_s": step_s,
            "switch_s": 0.0,
            "update_s": 0.0,
        }

    reports = {"planned": report("tp2", 5.0), "dp2": report("dp2", 6.0)}
    measured = {
        "planned": hotswitch.summarize([_row(s, {"16": 2.0}, {"16": 1500}) for s in (1, 2, 3)]),
        "dp2": hotswitch.summarize([_row(s, {"16": 3.0}, {"16": 1500}) for s in (1, 2, 3)]),
    }
    lines = hotswitch.table("nvlink", "h100-80g", reports, measured, "dp2").splitlines()
    planned = [cell.strip() for cell in lines[3].split("|")]
    assert planned[2] == "planned" and planned[11:14] == ["1.200x", "1.200x", "1.500x"]
    dp2 = [cell.strip() for cell in lines[4].split("|")]
    assert dp2[11:14] == ["1.000x", "1.000x", "1.000x"]


def _written_plan(tmp_path: Path) -> Path:
    """A two-bucket plan of gpt3-125m written by `ds-stpar plan --data --out` (its corpus:
    ``tmp_path / "docs.jsonl"``)."""
    from ds_stpar.cli import main
    from ds_stpar.seqbucket.corpus import write_jsonl

    lengths = [150] * 60 + [800] * 12 + [2000] * 4
    write_jsonl(({"text": "x" * n} for n in lengths), tmp_path / "docs.jsonl")
    argv = ["plan", "--model", "gpt3-125m", "--gpus", "2", "--seq-len", "2048"]
    argv += ["--global-batch", "16", "--data", str(tmp_path / "docs.jsonl")]
    assert main([*argv, "--min-buckets", "2", "--out", str(tmp_path / "plan")]) == 0
    return tmp_path / "plan" / "ds_stpar.json"


def test_a_written_plan_reports_its_buckets_for_the_steps_run_prediction(tmp_path) -> None:
    # a plan file written by `ds-stpar plan --data --out` records each bucket's time and
    # tokens per step and the home's update: fed its own expected tokens, the steps-run
    # prediction is the plan's predicted step (sum of bucket times, switches and update)
    report = hotswitch.config_report(str(_written_plan(tmp_path)))
    assert len(report["buckets"]) == 2
    expected = {str(b["edge"]): b["tokens_per_step"] for b in report["buckets"]}
    run = hotswitch.steps_run_prediction(report, {"bucket_tokens": expected})
    assert run == pytest.approx(report["bucketed_step_s"], rel=1e-9)


def test_a_baseline_that_is_not_a_plan_of_the_call_is_refused_before_any_run(
    tmp_path, capsys
) -> None:
    path = _written_plan(tmp_path)
    argv = ["--plans", "", "--config", f"planned={path}", "--data", str(tmp_path / "docs.jsonl")]
    with pytest.raises(SystemExit) as exit_info:
        hotswitch.main([*argv, "--out", str(tmp_path / "runs")])  # the default: static
    assert exit_info.value.code == 2
    assert "--baseline static: not among the plans ['planned']" in capsys.readouterr().err
    assert not (tmp_path / "runs" / "planned").exists()  # nothing launched
