"""Sweeps (naming, validation, skip / resume / failure) and reports (mean ± std against the runs' summaries)."""
import csv
import json
import logging

import numpy as np
import pytest
import yaml

from fedlase.cli import main
from fedlase.config import config_from_dict
from fedlase.engine import run_experiment
from fedlase.errors import UserError
from fedlase.report import make_report
from fedlase.report_runs import find_runs, group_runs
from fedlase.sweep import run_sweep
from fedlase.sweep_plan import plan_sweep, run_name

BASE = {"dataset": "digits", "model": "cnn", "width": 0.25, "system": "{1,1/4}_{2,2}", "participation": 0.5,
        "local_steps": 2, "batch_size": 16, "rounds": 2, "eval_every": 1, "threads": 1, "device": "cpu",
        "checkpoint_every": 1, "analysis": {"ratios": True, "updates": True, "magnitudes": True}}


def write_sweep(tmp_path, **spec):
    path = tmp_path / "sweep.yaml"
    path.write_text(yaml.safe_dump({"base": BASE, "out": str(tmp_path / "out"), **spec}, sort_keys=False))
    return path


def test_run_names_are_readable_safe_and_unique():
    assert run_name({"method": "fiarse", "seed": 0}) == "method=fiarse,seed=0"
    assert run_name({"seed": 1}, "no-log") == "no-log,seed=1"
    assert run_name({"method_args.log": False}) == "method_args.log=false"
    a, b = run_name({"system": "{1,1/4}_{5,5}"}), run_name({"system": "{1,1/4}_{5}_{5}"})
    assert a.startswith("system=1_1_4_5_5~") and "/" not in a and a != b   # lossy: a hash keeps them apart
    assert run_name({"system": "{1,1/4}_{5,5}"}) == a   # deterministic
    assert len(run_name({"x": "y" * 500})) < 140


def test_grid_and_runs_combine(tmp_path):
    path = write_sweep(tmp_path, grid={"seed": [0, 1], "method_args.ste": ["official", "fixed"]},
                       runs=[{"name": "a"}, {"name": "b", "lr": 0.1}])
    out, runs = plan_sweep(path)
    assert len(runs) == 8 and len({r.name for r in runs}) == 8
    r = next(r for r in runs if r.name == "b,seed=1,method_args.ste=fixed")
    assert (r.cfg.lr, r.cfg.seed, r.cfg.method_args) == (0.1, 1, {"ste": "fixed"})
    assert r.cfg.out == str(out / r.name) and r.status == "new"


@pytest.mark.parametrize("spec, needle", [
    ({"grid": {"lr": [0.1, -1]}}, "run lr=-1: lr: must be > 0"),
    ({"grid": {"method_args.ste": ["bogus"]}}, "run method_args.ste=bogus: method_args.ste"),
    ({"runs": [{"name": "x", "analysis.ratio": True}]}, "run x: analysis.ratio"),
    ({"grid": {"seed": 0}}, "grid.seed must be a non-empty list"),
    ({"grid": {"seed": [0]}, "runs": [{"seed": 1}]}, "both set seed"),
])
def test_bad_values_are_one_line_errors_before_anything_runs(tmp_path, capsys, spec, needle):
    path = write_sweep(tmp_path, **spec)
    assert main(["sweep", str(path), "--quiet"]) == 2
    err = capsys.readouterr().err
    assert needle in err and len(err.strip().splitlines()) == 1 and "Traceback" not in err
    assert not (tmp_path / "out").exists()


def test_sweep_skips_resumes_and_records_failures(tmp_path, caplog, capsys):
    # a run that fails at run time (more clients than digits has samples) must not stop the others
    path = write_sweep(tmp_path, grid={"seed": [0, 1]},
                       runs=[{"name": "ok"}, {"name": "bad", "system": "{1}_{5000}"}])
    out = tmp_path / "out"
    # an interrupted run: ok,seed=1 stopped after round 1 (checkpoint, no summary)
    run_experiment(config_from_dict({**BASE, "seed": 1, "rounds": 1, "out": str(out / "ok,seed=1")}), progress=False)
    (out / "ok,seed=1" / "summary.json").unlink()
    assert main(["sweep", str(path), "--dry-run"]) == 0
    assert "resume  ok,seed=1" in capsys.readouterr().out

    with caplog.at_level(logging.INFO, logger="fedlase"):
        assert main(["sweep", str(path), "--quiet"]) == 1
    assert "resuming" in caplog.text and "at round 1" in caplog.text
    for seed in (0, 1):
        assert (out / f"ok,seed={seed}" / "summary.json").is_file()
        assert "5000 clients" in (out / f"bad,seed={seed}" / "error.txt").read_text()
    log = [json.loads(ln) for ln in (out / "sweep.jsonl").read_text().splitlines()]
    assert [(e["run"], e["status"]) for e in log] == [("ok,seed=0", "done"), ("ok,seed=1", "done"),
                                                        ("bad,seed=0", "failed"), ("bad,seed=1", "failed")]
    # the resumed run equals one that was never interrupted
    fresh = run_experiment(config_from_dict({**BASE, "seed": 1, "out": str(tmp_path / "fresh")}), progress=False)
    resumed = json.loads((out / "ok,seed=1" / "summary.json").read_text())
    assert resumed["final"]["levels"] == fresh["final"]["levels"]

    # second pass: finished runs are skipped, failed ones retried
    stamp = (out / "ok,seed=0" / "summary.json").stat().st_mtime_ns
    res = run_sweep(path, progress=False)
    assert res["skipped"] == ["ok,seed=0", "ok,seed=1"] and res["done"] == [] and len(res["failed"]) == 2
    assert (out / "ok,seed=0" / "summary.json").stat().st_mtime_ns == stamp

    # a changed base that conflicts with the runs on disk is refused before anything runs
    path.write_text(yaml.safe_dump({"base": {**BASE, "lr": 0.2}, "out": str(out), "grid": {"seed": [0]},
                                     "runs": [{"name": "ok"}]}))
    with pytest.raises(UserError, match="other settings .lr"):
        plan_sweep(path)


def test_report_mean_std_match_the_summaries(tmp_path):
    path = write_sweep(tmp_path, grid={"seed": [0, 1, 2]}, runs=[{"method": "fiarse"}, {"method": "fedavg"}])
    assert run_sweep(path, progress=False)["failed"] == []
    rep = tmp_path / "rep"
    md = make_report([str(tmp_path / "out")], rep).read_text()
    summaries = {}
    for f in sorted((tmp_path / "out").rglob("summary.json")):
        s = json.loads(f.read_text())
        summaries.setdefault(s["config"]["method"], []).append(s["final"])
    rows = list(csv.DictReader(open(rep / "results.csv")))
    assert {r["group"] for r in rows} == {"method=fiarse", "method=fedavg"}
    for method, finals in summaries.items():
        for metric, level, vals in [("global_acc", "1/4", [f["levels"]["1/4"]["global_acc"] for f in finals]),
                                    ("local_worst10", "1", [f["levels"]["1"]["local_worst10"] for f in finals]),
                                    ("local_acc", "all", [f["local_acc"] for f in finals])]:
            row = next(r for r in rows if (r["group"], r["metric"], r["level"]) == (f"method={method}", metric, level))
            assert float(row["mean"]) == pytest.approx(np.mean(vals))
            assert float(row["std"]) == pytest.approx(np.std(vals, ddof=1))
            assert row["n"] == "3"
        g = [f["global_acc"] for f in finals]
        assert f"{100 * np.mean(g):.2f} ± {100 * np.std(g, ddof=1):.2f}" in md
    assert "Worst-10% local accuracy" in md and "Std of local accuracies" in md and "ratio_std" in md
    for png in ("accuracy_global_acc", "accuracy_local_acc", "update_counts", "ratios_method=fiarse",
                "magnitudes_method=fedavg"):
        assert (rep / "plots" / f"{png}.png").stat().st_size > 1000
        assert f"plots/{png}.png" in md
    # --group-by: one group over all six runs
    assert [len(g.runs) for g in group_runs(find_runs([str(tmp_path / "out")]), ["dataset"])] == [6]


def test_report_user_errors(tmp_path, capsys):
    assert main(["report", str(tmp_path / "nowhere")]) == 2
    assert main(["report", str(tmp_path)]) == 2
    assert "no finished run" in capsys.readouterr().err
    assert main(["report", str(tmp_path), "--target", "120"]) == 2
    assert "--target takes global accuracies in percent" in capsys.readouterr().err


# =========================================================================== --jobs: runs at once

def _finals(out, name):
    """A run's final metrics and every evaluated round, without the wall-clock times."""
    strip = lambda d: {k: v for k, v in d.items() if not k.endswith("_time")}   # noqa: E731
    summary = json.loads((out / name / "summary.json").read_text())
    rounds = [strip(json.loads(ln)) for ln in (out / name / "metrics.jsonl").read_text().splitlines()]
    return strip(summary["final"]), rounds


def test_jobs_2_runs_at_once_and_equals_jobs_1_bit_for_bit(tmp_path):
    spec = {"base": {**BASE, "analysis": {}}, "grid": {"seed": [0, 1]}}
    for jobs in (1, 2):
        path = tmp_path / f"jobs{jobs}.yaml"
        path.write_text(yaml.safe_dump({**spec, "out": str(tmp_path / f"out{jobs}")}))
        assert main(["sweep", str(path), "--quiet", "--jobs", str(jobs)]) == 0
    one, two = tmp_path / "out1", tmp_path / "out2"
    for name in ("seed=0", "seed=1"):
        assert _finals(one, name) == _finals(two, name)   # == on floats: bit for bit
        assert (two / name / "sweep.log").is_file() and not (one / name / "sweep.log").exists()
    # (whether the two children overlap in time is up to the scheduler: a tiny run can end before the other
    # child has imported torch, so it is not asserted; each ran in its own process, with its own sweep.log)
    log = [json.loads(ln) for ln in (two / "sweep.jsonl").read_text().splitlines()]
    assert sorted((e["run"], e["status"]) for e in log) == [("seed=0", "done"), ("seed=1", "done")]
    # finished runs are skipped by a parallel sweep too
    res = run_sweep(tmp_path / "jobs2.yaml", progress=False, jobs=2)
    assert res == {"done": [], "skipped": ["seed=0", "seed=1"], "failed": []}


def test_jobs_split_the_threads_unless_the_sweep_sets_them(tmp_path):
    from fedlase.machine import usable_cpus
    base = {k: v for k, v in BASE.items() if k not in ("threads", "analysis")}
    path = tmp_path / "sweep.yaml"
    path.write_text(yaml.safe_dump({"base": {**base, "rounds": 1}, "out": str(tmp_path / "out"),
                                    "runs": [{"name": "split"}, {"name": "own", "threads": usable_cpus()}]}))
    assert run_sweep(path, progress=False, jobs=2)["failed"] == []
    threads = {n: json.loads((tmp_path / "out" / n / "summary.json").read_text())["config"]["threads"]
               for n in ("split", "own")}
    assert threads == {"split": max(1, usable_cpus() // 2), "own": usable_cpus()}   # own: at most the usable CPUs


def test_jobs_record_failures_and_resume_as_before(tmp_path, monkeypatch):
    path = write_sweep(tmp_path, grid={"seed": [0, 1]},
                       runs=[{"name": "ok"}, {"name": "bad", "system": "{1}_{5000}"}])
    out = tmp_path / "out"
    run_experiment(config_from_dict({**BASE, "seed": 1, "rounds": 1, "out": str(out / "ok,seed=1")}), progress=False)
    (out / "ok,seed=1" / "summary.json").unlink()
    assert main(["sweep", str(path), "--quiet", "--jobs", "2"]) == 1
    for seed in (0, 1):
        assert (out / f"ok,seed={seed}" / "summary.json").is_file()
        assert "5000 clients" in (out / f"bad,seed={seed}" / "error.txt").read_text()
    assert "resuming" in (out / "ok,seed=1" / "sweep.log").read_text()
    log = [json.loads(ln) for ln in (out / "sweep.jsonl").read_text().splitlines()]
    assert sorted((e["run"], e["status"]) for e in log) == [("bad,seed=0", "failed"), ("bad,seed=1", "failed"),
                                                            ("ok,seed=0", "done"), ("ok,seed=1", "done")]
    assert all("5000 clients" in e["error"] for e in log if e["status"] == "failed")
    fresh = run_experiment(config_from_dict({**BASE, "seed": 1, "out": str(tmp_path / "fresh")}), progress=False)
    assert json.loads((out / "ok,seed=1" / "summary.json").read_text())["final"]["levels"] == fresh["final"]["levels"]

    # a run whose process dies without a word (killed, out of memory) is recorded as failed too
    import fedlase.sweep as sweep_mod
    monkeypatch.setattr(sweep_mod, "_CHILD", "import os, signal; os.kill(os.getpid(), signal.SIGKILL)")
    res = run_sweep(path, progress=False, jobs=2)
    assert res["skipped"] == ["ok,seed=0", "ok,seed=1"] and sorted(res["failed"]) == ["bad,seed=0", "bad,seed=1"]
    assert "killed by signal 9" in (out / "bad,seed=0" / "error.txt").read_text()
    last = [json.loads(ln) for ln in (out / "sweep.jsonl").read_text().splitlines()][-2:]
    assert all(e["status"] == "failed" and "killed by signal 9" in e["error"] for e in last)


def _children_of(pid: int) -> list[int]:
    """Live processes started by the sweep with this pid (they carry it in their environment)."""
    import psutil
    found = []
    for proc in psutil.process_iter():
        try:
            if proc.environ().get("FEDLASE_SWEEP_PARENT") == str(pid) and proc.status() != psutil.STATUS_ZOMBIE:
                found.append(proc.pid)
        except (psutil.Error, OSError):
            continue
    return found


def test_ctrl_c_stops_the_children_and_records_nothing(tmp_path):
    import contextlib
    import signal
    import subprocess
    import sys
    import time

    import psutil
    import torch
    # rounds: far more than can finish before the Ctrl-C, however fast the machine
    path = write_sweep(tmp_path, base={**BASE, "analysis": {}, "rounds": 1_000_000, "checkpoint_every": 1},
                       grid={"seed": [0, 1]})
    out = tmp_path / "out"
    # SIGINT back to its default in the sweep: a test run started in the background (`cmd &` in a script)
    # inherits SIGINT ignored, and Python then never turns it into KeyboardInterrupt
    proc = subprocess.Popen([sys.executable, "-m", "fedlase.cli", "sweep", str(path), "--quiet", "--jobs", "2"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    try:
        deadline = time.monotonic() + 120
        while not all((out / f"seed={s}" / "checkpoint.pt").is_file() for s in (0, 1)):   # both runs under way
            assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()
            time.sleep(0.2)
        children = _children_of(proc.pid)
        assert len(children) == 2
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=60)
    finally:   # never leave a million-round sweep behind (its children stop when it goes)
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert proc.returncode == 130 and "interrupted" in err and "Traceback" not in err
    time.sleep(0.5)
    assert _children_of(proc.pid) == []
    for pid in children:   # gone (or a zombie of a dead parent, waiting for init)
        with contextlib.suppress(psutil.NoSuchProcess):
            assert psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    assert not (out / "sweep.jsonl").exists()
    for s in (0, 1):
        run = out / f"seed={s}"
        assert not (run / "summary.json").exists() and not (run / "error.txt").exists()
        torch.load(run / "checkpoint.pt", weights_only=True)   # whole: written atomically
    assert [r.status for r in plan_sweep(path)[1]] == ["resume", "resume"]


@pytest.mark.parametrize("jobs", ["0", "-2"])
def test_bad_jobs_is_a_one_line_error(tmp_path, capsys, jobs):
    path = write_sweep(tmp_path, grid={"seed": [0]})
    assert main(["sweep", str(path), "--quiet", "--jobs", jobs]) == 2
    err = capsys.readouterr().err
    assert "--jobs must be a whole number >= 1" in err and len(err.strip().splitlines()) == 1
    assert not (tmp_path / "out").exists()


def test_paired_t_matches_the_closed_form_and_a_hand_case():
    import math

    from fedlase.report_tables import paired_t
    mean, t, p = paired_t([1.0, 2.0, 3.0])             # n = 3: df = 2, p = 1 - |t| / sqrt(2 + t^2)
    assert mean == 2.0 and math.isclose(t, 2 * math.sqrt(3)) and math.isclose(p, 1 - t / math.sqrt(2 + t * t))
    mean, t, p = paired_t([-1.0, -3.0])                # n = 2: df = 1 (Cauchy), p = 1 - 2 atan(|t|) / pi
    assert mean == -2.0 and math.isclose(t, -2.0) and math.isclose(p, 1 - 2 * math.atan(2.0) / math.pi)
    assert math.isnan(paired_t([1.0, 1.0])[2])                        # no spread: no test


def test_magnitude_table_is_the_rebuttal_layout(tmp_path):
    import numpy as np

    from fedlase.report_runs import Group, Run
    from fedlase.report_tables import magnitude_table
    (tmp_path / "analysis").mkdir()
    layers = np.array(["a.weight", "a.bias", "b.weight", "c.weight", "d.weight"])
    mx, mean = np.arange(10.0).reshape(2, 5), np.arange(10.0).reshape(2, 5) / 10
    np.savez(tmp_path / "analysis" / "magnitudes.npz", layers=layers, rounds=np.array([0, 180]), max=mx, mean=mean)
    header, rows = magnitude_table(Group("fedavg", (), [Run(tmp_path, {"final": {}}, {})]))
    assert header == ["fedavg, round 180", "b", "c"]                 # weights only, first and last left out
    assert rows == [["max |θ|", "7.0000", "8.0000"], ["mean |θ|", "0.7000", "0.8000"]]


def test_curve_table_means_each_round_over_the_runs_that_evaluated_it(tmp_path):
    from fedlase.report_runs import Group, Run
    from fedlase.report_tables import curve_table
    runs = []
    for i, accs in enumerate(([0.5, 0.6, 0.7], [0.7, 0.8])):   # the second run stopped after round 20
        d = tmp_path / str(i)
        d.mkdir()
        (d / "metrics.jsonl").write_text("".join(json.dumps({"round": 10 * (k + 1), "global_acc": a}) + "\n"
                                                 for k, a in enumerate(accs)))
        runs.append(Run(d, {"final": {}}, {}))
    header, rows = curve_table([Group("g", (), runs)])
    assert header == ["group", "runs", "round 10", "round 20", "round 30"]
    assert rows == [["g", "2", "60.0", "70.0", "70.0"]]



def test_equal_time_pairs_by_seed_and_takes_a_given_target(tmp_path):
    """Accuracy at the common budget T, interpolated on each run's own clock, paired by seed; the time to a
    given target accuracy (report --target)."""
    from fedlase.report_clocks import equal_time_table, paired_at_time
    from fedlase.report_runs import Group, Run

    class Clock:   # a run's simulated seconds at the end of round r: r x its round time
        def __init__(self, per_round):
            self.per_round = per_round

        def elapsed(self, rnd):
            return rnd * self.per_round

    groups, clocks = [], {}
    for name, per_round, accs in (("slow", 10.0, ([0.2, 0.4], [0.4, 0.6])),   # two seeds each, rounds 1 and 2
                                  ("fast", 4.0, ([0.5, 0.9, 0.9, 0.9, 0.9], [0.3, 0.5, 0.7, 0.7, 0.7]))):
        g = Group(name, ())
        for seed, curve in enumerate(accs):
            d = tmp_path / f"{name}{seed}"
            d.mkdir()
            (d / "metrics.jsonl").write_text("".join(json.dumps({"round": k + 1, "global_acc": a}) + "\n"
                                                     for k, a in enumerate(curve)))
            r = Run(d, {"final": {"global_acc": curve[-1]}, "rounds": len(curve)}, {"seed": seed})
            g.runs.append(r)
            clocks[id(r)] = {"dense": Clock(per_round), "sparse": Clock(per_round)}
        groups.append(g)
    budgets, header, rows = equal_time_table(groups, clocks, targets=[0.55])
    assert "T = 20 s under the dense charge" in budgets and "A = 55.00%" in budgets
    # at T = 20 s: slow 0.4 / 0.6 (its last round); fast at round 5, 0.9 / 0.7
    assert rows[0][3] == "50.00 ± 14.14" and rows[1][3] == "80.00 ± 14.14"
    # 0.55: slow seed 1 at 10 + 10 x 0.15 / 0.2 = 17.5 s (seed 0 never); fast seed 0 at 4 + 4 x 0.05 / 0.4 =
    # 4.5 s, seed 1 at 8 + 4 x 0.05 / 0.2 = 9 s
    assert rows[0][-1] == "17.5 (1/2)" and rows[1][-1] == "6.75"
    budgets, header, rows = equal_time_table(groups, clocks, targets=[0.55, 0.85])   # a column per target
    assert header[-4:] == ["time to 55%, dense (s)", "time to 55%, sparse (s)", "time to 85%, dense (s)",
                           "time to 85%, sparse (s)"]
    assert rows[1][-4:] == ["6.75", "6.75", "7.5 (1/2)", "7.5 (1/2)"] and rows[0][-1] == "not reached"
    budgets, header, rows = paired_at_time(groups, clocks, "slow")
    assert header[:5] == ["group", "seeds paired", "Δ acc at T, dense", "t", "p"]
    # +50 and +10 points: t = 30 / (28.28 / sqrt 2) = 1.5, p = 1 - 2 atan(1.5) / pi (df = 1)
    assert rows == [["fast", "2", "+30.00", "1.50", "0.374", "+30.00", "1.50", "0.374"]]
    assert paired_at_time(groups, clocks, "nobody") is None

def test_a_key_added_after_a_run_reads_as_its_default(tmp_path):
    from fedlase.report_runs import find_runs, group_runs
    final = {"round": 1, "global_acc": 0.5, "local_acc": 0.5, "levels": {}}
    for seed, extra in ((0, {}), (1, {"word_embeddings": "budget"}), (2, {"word_embeddings": "whole"})):
        d = tmp_path / str(seed)
        d.mkdir()
        (d / "summary.json").write_text(json.dumps({"config": {"method": "fedlase", "seed": seed, **extra},
                                                    "final": final}))
    groups = group_runs(find_runs([str(tmp_path)]))
    assert sorted((g.label, len(g.runs)) for g in groups) == [("word_embeddings=budget", 2),
                                                              ("word_embeddings=whole", 1)]


# ---- one run path: a sweep runs each run on the engine its config names ----------------------------------

@pytest.mark.flower
@pytest.mark.parametrize("jobs", [1, 2])
def test_a_flower_sim_sweep_runs_flower(tmp_path, jobs):
    """In process (jobs=1) and in a child process (--jobs): Flower's app folder is written for the run and
    its summary names the engine that ran; the embedded run next to it has no app folder."""
    pytest.importorskip("flwr")
    path = write_sweep(tmp_path, grid={"engine": ["flower-sim", "embedded"]},
                       runs=[{"name": "r", "rounds": 1, "analysis": {}, "sim_actors": 1}])   # one actor: start-up
    res = run_sweep(path, progress=False, jobs=jobs)
    assert sorted(res["done"]) == ["r,engine=embedded", "r,engine=flower-sim"] and not res["failed"]
    out = tmp_path / "out"
    flower, embedded = out / "r,engine=flower-sim", out / "r,engine=embedded"
    assert (flower / "flower-app" / "pyproject.toml").is_file()
    assert not (embedded / "flower-app").exists()
    for run, engine in ((flower, "flower-sim"), (embedded, "embedded")):
        assert json.loads((run / "summary.json").read_text())["config"]["engine"] == engine
    # the same run on either engine: the same final evaluation
    finals = [json.loads((r / "summary.json").read_text())["final"] for r in (flower, embedded)]
    assert finals[0]["levels"] == finals[1]["levels"]
