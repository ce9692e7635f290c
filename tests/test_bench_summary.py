"""Published benchmark figures have one source: the recorded runs in bench/results/.

``make bench`` (bench.run_all) records each bench's JSON line, the latest run; bench/RESULTS.md's
summary table must be exactly what ``python -m bench.summary`` generates from those files, and
every figure a document quotes from a bench (the bench module's ``QUOTES``) must be the one its
latest recorded run gives. No processes: this reads files.
"""

from __future__ import annotations

import json
import os

import pytest

from bench import run_all, summary

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_results_md_summary_is_generated_from_the_recorded_runs():
    text = open(summary.RESULTS_MD, encoding="utf-8").read()
    want = summary.table()
    assert summary.current_summary(text) == want, (
        "bench/RESULTS.md's summary differs from bench/results/*.json: run "
        "`python -m bench.summary --write` (after `make bench`), not an edit by hand")


def test_every_bench_that_documents_quote_has_a_recorded_run():
    missing = summary.unrecorded()
    assert not missing, f"no bench/results/<name>.json for {missing}: make bench ARGS='...'"


def test_an_unrecorded_bench_says_so_in_its_rows_and_its_quotes_are_not_dropped(tmp_path):
    entry = json.load(open(os.path.join(summary.RESULTS, "elastic.json")))
    json.dump(entry, open(tmp_path / "elastic.json", "w"))
    # only elastic recorded: its quotes render, the other quoted benches are named unrecorded
    assert {name for name, _, _ in summary.quotes(str(tmp_path))} == {"elastic"}
    assert "convert" in summary.unrecorded(str(tmp_path))
    assert "elastic" not in summary.unrecorded(str(tmp_path))
    assert "calibration" not in summary.unrecorded(str(tmp_path))  # SUMMARY rows, no QUOTES
    calibration = [r for r in summary.rows(str(tmp_path)) if r[0] == "calibration"]
    assert calibration and all(r[2] == "not recorded: `make bench ARGS=calibration`"
                               and r[4] == "-" for r in calibration)


def test_documents_quote_the_latest_recorded_run():
    stale = summary.stale_quotes()
    assert not stale, ("a document quotes a bench figure its latest recorded run does not "
                       f"give (update the document to the run, see the bench's QUOTES): {stale}")


def test_a_recorded_run_keeps_the_json_line_its_date_commit_and_load(tmp_path):
    load = {"loadavg": [1.5, 1.0, 0.5], "cpus": 2}
    after = {"loadavg": [2.5, 1.2, 0.6], "cpus": 2}
    line = {"bench": "p2p_boundary", "ratios": {"a": 1.01}}
    path = run_all.record("p2p", line, 12.34, load, after, folder=str(tmp_path))
    entry = json.load(open(path))
    assert entry["result"] == line and entry["module"] == "bench.bench_p2p"
    assert entry["recorded"]["seconds"] == 12.3
    assert entry["recorded"]["load"] == {"before": [1.5, 1.0, 0.5], "after": [2.5, 1.2, 0.6],
                                         "cpus": 2}
    assert len(entry["recorded"]["date"]) == 19  # 2026-11-28T01:02:03
    # a skipped run keeps the previous figures
    assert run_all.record("p2p", {"bench": "p2p_boundary", "skipped": "no root"}, 1.0, load,
                          after, folder=str(tmp_path)) is None
    assert json.load(open(path))["result"] == line


def test_a_template_that_does_not_fit_the_json_names_the_bench():
    with pytest.raises(ValueError, match=r"bench_x\.SUMMARY: '\{ratio\[b\]:\.3f\}' does not fit"):
        summary.render("{ratio[b]:.3f}", {"ratio": {"a": 1.0}}, "bench_x.SUMMARY")
    assert summary.render("{ratio[a]:+.1%}", {"ratio": {"a": 0.012}}, "x") == "+1.2%"


def test_a_quote_may_wrap_but_not_change():
    doc = "the run (2026-11-28, load\naverage 2.5 from other work) and 18.1 s"
    assert summary.quoted("2026-11-28, load average 2.5 from", doc)
    assert not summary.quoted("load average 2.6", doc)


def test_the_summary_table_is_replaced_between_its_markers_only():
    text = f"# head\n\n{summary.BEGIN}\nold table\n{summary.END}\n\n## details\nkept\n"
    new = summary.replace_summary(text, f"{summary.BEGIN}\nnew\n{summary.END}")
    assert new == f"# head\n\n{summary.BEGIN}\nnew\n{summary.END}\n\n## details\nkept\n"
    with pytest.raises(ValueError, match="must hold the summary between"):
        summary.replace_summary("no markers", "x")
