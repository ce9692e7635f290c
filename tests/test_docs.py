"""The documents are executable: every shell block of README.md, examples/README.md and
docs/*.md runs, as a reader would run it, and says what the text around it says.

Each document gets a scratch folder laid out like a fresh clone (the repository's tracked files,
``.venv`` standing for this virtual environment, ``.venv/bin`` first on ``PATH``), and its
```bash / ```sh blocks run there in order, one command at a time (``\\``-continued lines
joined), each in its own process group with a timeout that kills the whole group. A new
document under docs/ is picked up without an edit here.

- A block whose first line is ``# doc-test: skip, <reason>`` is not run (multi-node torchrun,
  real GPUs / NPUs, a download, installing packages); pytest's summary (``-ra``) lists each
  one with its reason.
- Files a reader brings (``path/to/hf_model``, a tokenizer in ``tok/``, ``corpus.txt``, ...)
  are made small and offline by ``tests/doc_fixtures.py``; placeholders
  (``outputs/<date>/<time>``, ``outputs/RUN``, ``HF_FOLDER OUT``) are filled from the previous
  commands' outputs by :data:`PLACEHOLDERS`; trainings get the small sizes of :data:`SMALL`,
  and every command prints the line it really ran.
- A command fails the test when it exits non-zero or when its output no longer says what the
  document says (:data:`CHECKS`: the JSON summary line's keys, the files in the run folder,
  the line ldt-convert prints, the plan's train file, the replay's table, ...). The message
  names the document, the block's line and the command.
- A figure a document quotes from a command's output is checked by the document itself: a
  comment line ``# expect: <regex>`` right under a command (several may follow one command)
  states what its output says; the regex is searched (``re.search``, multi-line) in the
  command's stdout followed by its stderr, and the test fails when it is not there. A command
  that ends in ``|| true`` (one whose exit status is not checked: a refusal shown on purpose)
  must have at least one.

A document that needs a new fixture or placeholder adds it to ``doc_fixtures.FIXTURES`` or
``doc_runner.PLACEHOLDERS``; a new kind of claim to check goes in :data:`CHECKS`. How blocks
are found and run is ``tests/doc_runner.py``. The blocks run ahead of their tests, two
documents at a time (``doc_runner.Lanes``; ``LDT_DOC_LANES=1``: one after another), each
document's blocks in order; a test reports its block. On the 2-core machine the 32 blocks took
238 s so (the 2 cores 97% busy), 343 s one document after another.
"""

from __future__ import annotations

import glob
import json
import os
import re
from typing import Callable, Optional

import pytest

from doc_runner import ROOT, Block, Lanes, Scratch, blocks_of, documents, unexpected

BLOCKS = [b for d in documents() for b in blocks_of(d)]


# ---- what the text around a command says --------------------------------------------------
def _json_lines(out: str) -> list[dict]:
    found = []
    for line in out.splitlines():
        if line.startswith("{"):
            try:
                found.append(json.loads(line))
            except ValueError:
                pass
    return found


def _readme_summary_keys() -> list[str]:
    """The keys of the JSON line README.md shows after "ends with one JSON line"."""
    text = open(os.path.join(ROOT, "README.md"), encoding="utf-8").read()
    shown = re.search(r'^\{"steps".*\}$', text, re.M)
    assert shown, "README.md no longer shows ldt-train's JSON summary line"
    return re.findall(r'"(\w+)":', shown.group(0))


RUN_FOLDER = ["config.yaml", ".hydra/config.yaml", ".hydra/overrides.yaml", "metrics.csv",
              "events.out.tfevents.*"]  # README: "The run folder ... holds"
TIMELINE = ["timeline.png", "timeline.json", "action_times.csv"]  # runs on ldt's runtime
LANE_TIMELINE = ["timeline.png", "timeline.json", "lane_times.csv"]  # per-stage DP: per lane


def check_summary(result, scratch: Scratch, *, jobs: int = 1, u_shape: Optional[bool] = None):
    """A training: one JSON line per job with the README's keys; its run folder has the files
    the README lists (the timeline for U-shape runs)."""
    summaries = [s for s in _json_lines(result.stdout) if "run_dir" in s]
    assert len(summaries) == jobs, f"{jobs} JSON summary line(s) expected, got {summaries}"
    for s in summaries:
        shown = _readme_summary_keys()  # train.verify and train.eval_every add their own
        assert set(shown) <= set(s), f"the README's keys {shown}, this run's {list(s)}"
        folder = s["run_dir"]
        timeline = LANE_TIMELINE if _per_stage_dp(_config_of(folder)["cluster"]) else TIMELINE
        for pattern in RUN_FOLDER + (timeline if u_shape else []):
            assert glob.glob(os.path.join(folder, pattern)), f"{folder} has no {pattern}"
        if "parity_max_abs_diff" in s:  # README: train.verify ... the losses must agree
            assert s["parity_max_abs_diff"] < 1e-6, s
    scratch.last_run_dir = summaries[-1]["run_dir"]


def _config_of(run_dir: str) -> dict:
    import yaml

    return yaml.safe_load(open(os.path.join(run_dir, "config.yaml")))


def check_training(result, scratch: Scratch):
    summaries = [s for s in _json_lines(result.stdout) if "run_dir" in s]
    clusters = [_config_of(s["run_dir"])["cluster"] for s in summaries]
    # a measured timeline: U-shape runs (per-stage DP: one row per lane, docs/vdp.md)
    check_summary(result, scratch, jobs=len(summaries) or 1,
                  u_shape=all(c["u_shape"] for c in clusters))


def _per_stage_dp(cluster: dict) -> bool:
    return len({st.get("dp") or cluster["dp"] for st in cluster["stages"]}) > 1


def check_multirun(result, scratch: Scratch):
    check_summary(result, scratch, jobs=2)
    runs = [s["run_dir"] for s in _json_lines(result.stdout) if "run_dir" in s]
    assert [os.path.basename(r) for r in runs] == ["0", "1"], runs  # README: run_dir/0, /1


def check_run_dir(result, scratch: Scratch):
    check_summary(result, scratch, u_shape=True)
    assert scratch.last_run_dir == os.path.join(scratch.root, "outputs", "first")


def check_import(result, scratch: Scratch):
    """README: writes ckpt/mymodel/conf/model/mymodel.yaml and prints the next line."""
    conf = os.path.join(scratch.root, "ckpt", "mymodel", "conf")
    assert os.path.isfile(os.path.join(conf, "model", "mymodel.yaml"))
    import shlex

    want = shlex.join(["ldt-train", f"hydra.searchpath=[file://{conf}]", "model=mymodel",
                       f"train.load={os.path.join(scratch.root, 'ckpt', 'mymodel')}"])
    assert want in result.stdout, (want, result.stdout)
    assert os.path.isfile(os.path.join(scratch.root, "ckpt", "mymodel", "tokenizer.json"))


def check_export(result, scratch: Scratch, folder: str = "hf_out"):
    """The export is a folder transformers loads, with the tokenizer files."""
    import transformers

    out = os.path.join(scratch.root, folder)
    model = transformers.AutoModelForCausalLM.from_pretrained(out)
    tokenizer = transformers.AutoTokenizer.from_pretrained(out)
    assert type(model).__name__ == "LlamaForCausalLM"
    assert len(tokenizer) == model.config.vocab_size


def check_plan_out(result, scratch: Scratch):
    """README's comment: wrote plans/cluster/mine.yaml and plans/train/mine.yaml."""
    assert "wrote plans/cluster/mine.yaml, plans/train/mine.yaml" in result.stdout, result.stdout
    import yaml

    planned = yaml.safe_load(open(os.path.join(scratch.root, "plans", "train", "mine.yaml")))
    assert {"num_microbatches", "micro_batch_size"} <= set(planned), planned


def check_composed_plan(result, scratch: Scratch):
    import yaml

    cfg = yaml.safe_load(result.stdout)
    planned = yaml.safe_load(open(os.path.join(scratch.root, "plans", "train", "mine.yaml")))
    assert cfg["train"]["num_microbatches"] == planned["num_microbatches"]
    assert cfg["model"]["name"] == "llama_7b"


def check_sim_of_plan(result, scratch: Scratch):
    assert "from plans/train/mine.yaml" in result.stderr, result.stderr


def _planner_doc_line(start: str) -> str:
    """The line of docs/planner.md's example output that starts with ``start``."""
    with open(os.path.join(ROOT, "docs", "planner.md")) as f:
        return next(line.strip() for line in f if line.startswith(start))


def _shown_output(doc: str, command: str) -> list[str]:
    """The lines of the ```text block that follows the shell block holding ``command`` in
    ``doc``: what the page says the command prints."""
    lines = open(os.path.join(ROOT, doc), encoding="utf-8").read().split("\n")
    at = next(i for i, line in enumerate(lines) if line.strip() == command)
    start = next(i for i in range(at, len(lines)) if lines[i].strip() == "```text") + 1
    end = next(i for i in range(start, len(lines)) if lines[i].strip().startswith("```"))
    return [line.rstrip() for line in lines[start:end] if line.strip()]


def check_shown_output(doc: str, command: str) -> Callable:
    """The page's output block after ``command``, line by line, in what the command printed."""
    def check(result, scratch: Scratch):
        printed = {line.rstrip() for line in result.stdout.splitlines()}
        shown = _shown_output(doc, command)
        assert shown, f"{doc} shows no output block after {command}"
        missing = [line for line in shown if line not in printed]
        assert not missing, f"{doc} shows lines the command no longer prints: {missing}"
    return check


def check_front_pick(result, scratch: Scratch):
    """docs/planner.md's edge_cloud example: its output block is what the command prints, and
    it picks the 10-device plan the text discusses."""
    check_shown_output("docs/planner.md", ".venv/bin/ldt-plan --inventory edge_cloud --model "
                       "qwen2.5_7b --out plans/cluster/qwen.yaml")(result, scratch)
    picked = _planner_doc_line("picked ")
    assert picked.startswith("picked the fastest plan (3 stages on 10 devices"), picked


def check_sim_of_front_pick(result, scratch: Scratch):
    """ldt-sim prices the planned files as ldt-plan did (the page's iteration time)."""
    assert "from plans/train/qwen.yaml" in result.stderr, result.stderr
    planned = re.search(r"iteration [0-9.]+ ms", _planner_doc_line("U-shape: 3 stages")).group(0)
    assert planned in result.stdout, (planned, result.stdout)


def check_replay(result, scratch: Scratch):
    """docs/planner.md shows the replay's table: its first line and row labels."""
    assert re.match(r"runs/demo: \d+ steps after 3 skipped, 3 stages\n", result.stdout), \
        result.stdout
    for label in ("measured schedule span (median)", "simulated, compute only",
                  "simulated, with communication", "least, any order of these ops",
                  "mean ms per action"):
        assert label in result.stdout, label
    assert os.path.getsize(os.path.join(scratch.root, "replay.png")) > 1000


def check_audit(result, scratch: Scratch):
    """docs/privacy.md: OUT/audit.json with these keys."""
    reports = sorted(glob.glob(os.path.join(scratch.root, "outputs", "**", "audit.json"),
                               recursive=True), key=os.path.getmtime)
    assert reports, "no audit.json written"
    report = json.load(open(reports[-1]))
    assert {"crossed", "other_messages", "capture_equals_sent", "losses", "rows"} <= set(report)


def check_torchrun(result, scratch: Scratch):
    """docs/torchrun.md: the 12 lines ldt-train prints (a training like any other); on stderr
    nothing but torchrun's own log lines."""
    check_training(result, scratch)
    assert len(result.stdout.splitlines()) == 12, result.stdout
    torchrun_log = re.compile(r"[IWE]\d{4} [\d:.]+ \d+ \S*torch/distributed/")
    ranks = [x for x in result.stderr.splitlines() if x and not torchrun_log.match(x)]
    assert not ranks, ranks


def check_help(result, scratch: Scratch):
    assert "cluster: " in result.stdout and "model: " in result.stdout, result.stdout[:2000]


def check_no_device(result, scratch: Scratch):
    """make device-check on a machine without a GPU: that, in one line, and nothing run."""
    lines = [x for x in result.stdout.splitlines() if not x.startswith(("bash ", "make"))]
    assert lines == ["device-check: no CUDA device here (python3 sees none through torch); "
                     "nothing to check"], result.stdout
    assert not os.path.exists(os.path.join(scratch.root, "outputs", "device-check"))


# (document, pattern in the command as written, check); every command must also exit 0
CHECKS: list[tuple[str, str, Callable]] = [
    ("README.md", r"^make demo\b", check_training),
    ("README.md", r"ldt-train --help", check_help),
    ("README.md", r"ldt-train -m ", check_multirun),
    ("README.md", r"ldt-train hydra\.run\.dir=outputs/first", check_run_dir),
    ("README.md", r"ldt-convert import path/to/hf_model ckpt/mymodel", check_import),
    ("README.md", r"ldt-convert export", check_export),
    ("README.md", r"ldt-plan .*--out plans/cluster/mine\.yaml", check_plan_out),
    ("README.md", r"--config-dir plans .*--cfg job", check_composed_plan),
    ("README.md", r"ldt-sim --cluster plans/cluster/mine\.yaml", check_sim_of_plan),
    ("docs/models.md", r"ldt-convert export", lambda r, s: check_export(r, s, "hf_exported")),
    ("docs/planner.md", r"ldt-sim --measured", check_replay),
    ("docs/planner.md", r"ldt-plan .*qwen2\.5_7b --out plans/cluster/qwen\.yaml", check_front_pick),
    ("docs/planner.md", r"ldt-sim --cluster plans/cluster/qwen\.yaml", check_sim_of_front_pick),
    ("docs/planner.md", r"ldt-plan --inventory edge_cloud --model llama_7b --global-batch 64",
     check_shown_output("docs/planner.md", ".venv/bin/ldt-plan --inventory edge_cloud --model "
                        "llama_7b --global-batch 64 --out edge_cloud_plan.yaml")),
    ("docs/memory.md", r"ldt-plan --inventory edge_one_card --model llama3_8b --out",
     check_shown_output("docs/memory.md", ".venv/bin/ldt-plan --inventory edge_one_card "
                        "--model llama3_8b --out plans/cluster/edge8b.yaml")),
    ("docs/privacy.md", r"ldt-audit", check_audit),
    ("docs/torchrun.md", r"torchrun .*-m ldt\.train", check_torchrun),
    ("docs/device_check.md", r"^make device-check\b", check_no_device),
    ("*", r"ldt-train\b(?!.*(--help|--cfg))", check_training),
]


def checks_for(doc: str, command: str) -> list[Callable]:
    found = [c for d, p, c in CHECKS if d == doc and re.search(p, command)]
    return found or [c for d, p, c in CHECKS if d == "*" and re.search(p, command)]



@pytest.fixture(scope="module")
def lanes(request, tmp_path_factory):
    selected = [item.callspec.params["block"] for item in request.session.items
                if getattr(item, "originalname", "") == "test_block_runs_as_documented"]
    ahead = Lanes([b for b in selected if not b.skip], str(tmp_path_factory.mktemp("docs")),
                  int(os.environ.get("LDT_DOC_LANES", "2")), checks_for)
    yield ahead
    ahead.close()


def test_the_documents_have_blocks_and_every_skip_says_why():
    """The collector sees the documents (a parser that finds nothing would pass everything)."""
    docs = {b.doc for b in BLOCKS}
    assert {"README.md", "examples/README.md", "docs/planner.md"} <= docs, docs
    assert sum(b.skip is None for b in BLOCKS) >= 15
    for b in BLOCKS:
        assert b.commands, f"{b}: an empty shell block"
        first = open(os.path.join(ROOT, b.doc)).read().split("\n")[b.line]
        if "doc-test" in first:
            assert b.skip, f"{b}: write the marker as '# doc-test: skip, <reason>'"
        for c in b.commands:
            if not b.skip and re.search(r"\|\|\s*true\s*(#.*)?$", c.text):
                assert c.expects, (f"{b.doc}:{c.line}: '{c.text}' ends in '|| true' and states "
                                   "no '# expect: <regex>' line under it: its output is unchecked")


def test_expect_lines_belong_to_the_command_above_and_are_checked():
    """The ``# expect:`` mechanism itself: parsed onto the right command, and a figure that is
    not in the output is reported (the document's line stays a check, not a comment)."""
    doc = "\n".join([
        "text", "```bash", "echo 'needs 5.87 MiB' \\", "  && echo second || true",
        r"# expect: needs 5\.87 MiB", "# expect: ^second$", "# a plain comment",
        "echo other", "```", "```bash", "# expect: nothing above", "```"])
    with pytest.raises(ValueError, match="line 11: '# expect:' before any command"):
        blocks_of("x.md", doc)
    (block,) = blocks_of("x.md", doc.rsplit("```bash", 1)[0])
    first, other = block.commands
    assert (first.line, first.text) == (3, "echo 'needs 5.87 MiB'    && echo second || true")
    assert first.expects == [r"needs 5\.87 MiB", "^second$"] and other.expects == []
    assert unexpected(first, "needs 5.87 MiB\nsecond\n", "") == []
    assert unexpected(first, "", "needs 5.87 MiB\nsecond") == []  # stderr counts too
    assert unexpected(first, "needs 5.90 MiB\nsecond\n", "") == [r"needs 5\.87 MiB"]


@pytest.mark.timeout(1200)
@pytest.mark.parametrize("block", BLOCKS, ids=str)
def test_block_runs_as_documented(block: Block, lanes):
    if block.skip:
        pytest.skip(f"{block}: {block.skip}")
    log, failure = lanes.result(block)
    print("\n".join(log))
    if failure:
        pytest.fail(failure)
