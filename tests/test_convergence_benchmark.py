"""``python -m dtensor_fp8.benchmarks convergence`` end to end on the CPU at a tiny size (the real
run, 102 M parameters for 1000 steps, is the GPU's: docs/benchmarks.md), and its text corpus:
the standard library's own sources, split by file."""

from __future__ import annotations

import json
import math

import pytest

from dtensor_fp8.benchmarks import convergence
from dtensor_fp8.benchmarks.text_corpus import SEPARATOR, load_stdlib_corpus, stdlib_files

ROWS = ["bf16", "bf16_seed1", "current", "delayed", "blockwise2d", "mxfp8_emulated"]
STEPS, LAYERS = 12, 2


@pytest.fixture(scope="module")
def report(tmp_path_factory):
    out = tmp_path_factory.mktemp("convergence")
    rc = convergence.main(["--device", "cpu", "--shape", "toy", "--layers", str(LAYERS), "--seq", "32", "--batch", "4",
                           "--steps", str(STEPS), "--lr", "3e-3", "--eval-every", "4", "--eval-windows", "8",
                           "--final-window", "3", "--variants", ",".join(ROWS), "--out", str(out)])
    assert rc == 0
    data = json.loads((out / "convergence.json").read_text())
    data["out"] = out
    return data


def test_every_row_trains_and_its_losses_fall(report):
    rows = {r["variant"]: r for r in report["results"]}
    assert list(rows) == ROWS
    for name, r in rows.items():
        assert r["status"] == "ok", r
        losses = r["train_losses"]
        assert len(losses) == STEPS and r["finite"]
        assert 5.0 < losses[0] < 6.0, (name, losses[0])  # ~ln 256 = 5.55: an untrained model's loss per byte
        assert sum(losses[-3:]) / 3 < sum(losses[:3]) / 3 - 0.5, (name, losses)
        assert r["final_train_loss"] == pytest.approx(sum(losses[-3:]) / 3)
        assert r["eval_steps"] == [4, 8, 12]
        assert r["eval_losses"][-1] < r["eval_losses"][0], (name, r["eval_losses"])
        assert r["held_out_loss"] == r["eval_losses"][-1]
        assert r["held_out_bits_per_byte"] == pytest.approx(r["held_out_loss"] / math.log(2))
    for name in ("current", "delayed", "blockwise2d", "mxfp8_emulated"):
        assert rows[name]["fp8_weights"] == 4 * LAYERS, rows[name]
        assert rows[name]["fp8_gemms_per_step"] == 0  # the CPU runs the emulated linear (no block-scaled kernel)
        # Seed 0 like bf16: the same init and batches, the first loss differing by the weights' FP8 rounding only.
        assert rows[name]["train_losses"][0] == pytest.approx(rows["bf16"]["train_losses"][0], rel=0.01)
    assert rows["bf16_seed1"]["seed"] == 1
    assert rows["bf16_seed1"]["train_losses"] != rows["bf16"]["train_losses"]


def test_the_report_says_what_it_trained_on_and_checks_the_target(report):
    data = report["meta"]["data"]
    assert data["train_files"] > 100 and data["held_out_files"] > 5 and data["train_bytes"] > 1_000_000
    assert report["meta"]["config"]["steps"] == STEPS and report["meta"]["params"] > 0
    target = report["target"]
    assert target["reference"] == "bf16" and target["bf16_seeds"] == 2
    assert target["allowed"] == max(target["bf16_spread"], 0.01 * target["reference_loss"])
    assert set(target["rows"]) == {"current", "delayed", "blockwise2d", "mxfp8_emulated"}
    for name, t in target["rows"].items():  # 12 steps from one init: FP8 rounding moves the loss by ~0.03 %
        assert t["pass"] and abs(t["relative"]) < 0.01, (name, t)
    for name in ROWS:
        assert f"| {name} |" in report["table_markdown"]
    pytest.importorskip("matplotlib")
    assert (report["out"] / "convergence.png").stat().st_size > 10_000


def test_from_json_reprints_and_replots_a_run(report, tmp_path, capsys):
    """A run cut short (the GPU script's time limit) keeps its finished rows in the JSON; --from-json
    prints their table and target and plots them without training."""
    partial = json.loads((report["out"] / "convergence.json").read_text())
    partial["results"] = partial["results"][:3]  # bf16, bf16_seed1, current
    (tmp_path / "partial.json").write_text(json.dumps(partial))
    capsys.readouterr()
    assert convergence.main(["--from-json", str(tmp_path / "partial.json"), "--out", str(tmp_path / "plot")]) == 0
    out = capsys.readouterr().out
    assert "| current |" in out and "| delayed |" not in out
    assert "current                  PASS" in out and "delayed" not in out.split("target:")[1]
    pytest.importorskip("matplotlib")
    assert (tmp_path / "plot" / "convergence.png").is_file()


def test_unknown_rows_are_refused_with_the_choices(capsys):
    with pytest.raises(SystemExit):
        convergence.main(["--device", "cpu", "--variants", "bf16,fp4"])
    err = capsys.readouterr().err
    assert "unknown variant 'fp4'" in err and "bf16_seed<N>" in err and "blockwise2d" in err


def test_the_corpus_is_the_stdlib_split_by_file(tmp_path):
    for rel in ["a.py", "pkg/b.py", "pkg/c.txt", "site-packages/x.py", "test/test_a.py", "pkg/tests/t.py",
                "d.py", "e.py", "f.py", "g.py"]:
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text(f"# {rel}\n")
    assert stdlib_files(tmp_path) == ["a.py", "d.py", "e.py", "f.py", "g.py", "pkg/b.py"]
    corpus = load_stdlib_corpus(tmp_path, held_out_every=2)
    assert corpus.held_out_files == ("a.py", "d.py", "g.py")  # CRC-32 of the path even
    assert set(corpus.train_files).isdisjoint(corpus.held_out_files)
    assert sorted(corpus.train_files + corpus.held_out_files) == stdlib_files(tmp_path)
    assert bytes(corpus.train.tolist()) == b"".join(f"# {f}\n".encode() + SEPARATOR for f in corpus.train_files)
    with pytest.raises(RuntimeError, match="held-out"):
        load_stdlib_corpus(tmp_path, held_out_every=10**9 + 7)  # no path's CRC-32 is a multiple: nothing held out
    real = load_stdlib_corpus()
    assert "os.py" in real.train_files + real.held_out_files
    assert not any(f.startswith(("site-packages/", "test/")) for f in real.train_files + real.held_out_files)
