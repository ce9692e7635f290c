"""Property tests of every command (#39): whatever flags and file contents a user gives, the
command succeeds or refuses in one line, and never touches a file it does not declare.

For each tool hypothesis draws a command line (flags from valid, odd and absurd values: zero,
negatives, huge numbers, NaN, words; paths to good inputs, damaged ones, folders, /dev/null,
missing ones; --overwrite or not) and the contents of an input file the command reads. Each
example runs in-process in a fresh copy of a scratch folder and must: exit with 0 or 2; print
no traceback; on a refusal print exactly one line on stderr; leave every file outside the
outputs it declares byte-identical; leave no temporary (``.ldt-tmp-*``, ``.ldt-old-*``,
``.ldt-set-*``) behind. Starting a world (ldt-train, ldt-audit) counts as acceptance and is
replaced by a stub, as is ldt-memory's estimate (its refusals are what is drawn). Few
examples each, derandomized (reproducible in CI); LDT_HYPOTHESIS_EXPLORE=1 explores.
"""

import json
import os
import shutil
import tempfile

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from faults import tree

EXPLORE = bool(os.environ.get("LDT_HYPOTHESIS_EXPLORE"))


def few(n):
    return settings(max_examples=n * (20 if EXPLORE else 1), deadline=None,
                    derandomize=not EXPLORE,
                    suppress_health_check=[HealthCheck.too_slow,
                                           HealthCheck.function_scoped_fixture])


@pytest.fixture(scope="module")
def template(tmp_path_factory, tiny_model_files):
    from tiny_files import _action_times, copy

    root = tmp_path_factory.mktemp("template")
    copy(tiny_model_files, root)
    (root / "run").mkdir()
    _action_times(root / "run" / "action_times.csv")
    (root / "folder").mkdir()
    return root


class _Started(BaseException):
    """A world was about to start: the command accepted its input."""


class World:
    """A fresh copy of the template per example, the working directory inside it."""

    def __init__(self, template, monkeypatch, capsys):
        self.template, self.monkeypatch, self.capsys = template, monkeypatch, capsys

    def run(self, main, argv, outputs, files=None):
        base = tempfile.mkdtemp(prefix="ldt-prop-")
        root = os.path.join(base, "w")
        try:
            shutil.copytree(self.template, root)
            for name, data in (files or {}).items():
                with open(os.path.join(root, name), "wb") as f:
                    f.write(data)
            self.monkeypatch.chdir(root)
            before = tree(root)
            try:
                code = main(list(argv))
            except SystemExit as exc:  # argparse's one line
                code = exc.code
            except _Started:  # a world would start here: the input was accepted
                code = 0
            out, err = self.capsys.readouterr()
            assert "Traceback" not in out + err, (argv, err)
            assert code in (0, 2), (argv, code, err)
            lines = [ln for ln in err.splitlines() if ln.strip()]
            if code == 2:
                assert len(lines) == 1, (argv, err)
            after = tree(root)
            assert not [k for k in after if any(m in k for m in (".ldt-tmp-", ".ldt-old-",
                                                                 ".ldt-set-"))], (argv, after)
            declared = [os.path.normpath(o) for o in outputs if o]

            def kept(t):  # all but the outputs, what is in them, the folders made for them
                return {k: v for k, v in t.items()
                        if not any(k == o or k.startswith(o + os.sep) or k.startswith(o + ".")
                                   or (v == "dir" and o.startswith(k + os.sep)
                                       and k not in before) for o in declared)}
            assert kept(after) == kept(before), (argv, code, err)
            return code
        finally:
            self.monkeypatch.chdir(self.template)
            shutil.rmtree(base, ignore_errors=True)


@pytest.fixture
def world(template, monkeypatch, capsys):
    return World(template, monkeypatch, capsys)


# ---- what a user types -------------------------------------------------------------------
numbers = st.one_of(st.sampled_from(["1", "2", "4"]),  # as often valid as not
                    st.sampled_from(["0", "-1", "7", "64", "100000000000", "nan", "inf", "1e300",
                                     "two", "", "0.5"]))
paths = st.sampled_from(["hf", "ckpt", "corpus.txt", "pair", "pair.bin", "run", "folder",
                         "nowhere", "/dev/null", "input.bin", ".", "folder/sub", "ckpt/stage_0"])
outs = st.sampled_from(["out", "folder", "folder/new", "sub/dir/out", "ckpt", "corpus.txt",
                        "/proc/ldt_out", "out.bin"])
blobs = st.one_of(st.binary(max_size=200), st.text(max_size=200).map(str.encode))


def flags(options: dict):
    """Some of ``options`` (flag -> strategy of its value, or None for a switch), in any
    order, as argv."""
    return st.lists(st.sampled_from(sorted(options)), unique=True, max_size=len(options)).flatmap(
        lambda chosen: st.tuples(*[st.just([f]) if options[f] is None
                                   else options[f].map(lambda v, f=f: [f, v])
                                   for f in chosen]) if chosen else st.just(()))


def _argv(parts):
    return [x for part in parts for x in part]


# ---- the tools -----------------------------------------------------------------------------
@few(6)
@given(command=st.sampled_from(["import", "export"]), odd=st.one_of(st.none(), paths), out=outs,
       rest=flags({"--seq-length": numbers, "--name": st.sampled_from(["m", "../x", "a b", ""]),
                   "--dtype": st.sampled_from(["float32", "bfloat16", "int8"]),
                   "--overwrite": None}),
       config=st.one_of(st.none(), st.dictionaries(
           st.sampled_from(["num_hidden_layers", "hidden_size", "num_attention_heads",
                            "num_key_value_heads", "vocab_size", "intermediate_size",
                            "tie_word_embeddings", "max_position_embeddings"]),
           st.sampled_from([1, 2, 4, 8, 16, 48, 64, 0, -1, None, True]), max_size=2)))
def test_ldt_convert(world, command, odd, out, rest, config):
    from ldt.tools import convert

    source = odd or {"import": "hf", "export": "ckpt"}[command]  # as often right as odd
    files = {}
    if config is not None:  # hf's config.json edited
        cfg = json.loads((world.template / "hf" / "config.json").read_text())
        files["hf/config.json"] = json.dumps({**cfg, **config}).encode()
    rest = [x for x in _argv(rest) if command == "import" or x in ("--overwrite",)]
    world.run(convert.main, [command, source, out, *rest], [out], files)


@few(8)
@given(source=st.sampled_from(["input.txt", "input.jsonl", "corpus.txt", "folder", "/dev/null",
                               "nowhere"]),
       prefix=st.sampled_from(["out", "pair", "folder/x", "folder", "input", "x.bin", "nodir/x"]),
       content=blobs,
       rest=flags({"--format": st.sampled_from(["auto", "jsonl", "text", "xml"]),
                   "--json-key": st.sampled_from(["text", "", "a b"]),
                   "--text-documents": st.sampled_from(["paragraph", "line", "file", "page"]),
                   "--workers": st.sampled_from(["1", "0", "-3", "x"]),
                   "--tokenizer": st.sampled_from(["bytes", "hf", "/dev/null", "gpt2"]),
                   "--eod-token": st.sampled_from(["</s>", "", "x"]), "--overwrite": None}))
def test_ldt_preprocess(world, source, prefix, content, rest):
    from ldt.tools import preprocess

    world.run(preprocess.main, ["--input", source, "--output-prefix", prefix, "--quiet",
                                *_argv(rest)],
              [prefix + ext for ext in (".bin", ".idx", ".bad_lines.tsv")],
              {"input.txt": content, "input.jsonl": content})


@few(6)
@given(inventory=st.sampled_from(["cpu_local", "edge_cloud", "inv.yaml", "/dev/null", "folder"]),
       model=st.sampled_from(["gpt_tiny", "llama_tiny", "model.yaml", "nosuch"]),
       content=blobs,
       rest=flags({"--mbs": numbers, "--global-batch": numbers, "--max-stages": numbers,
                   "--edge-min-layers": numbers, "--out": outs.map(lambda o: o + ".yaml"),
                   "--trace": outs, "--overwrite": None}))
def test_ldt_plan(world, inventory, model, content, rest):
    from ldt.tools import plan

    argv = ["--inventory", inventory, "--model", model, *_argv(rest)]
    out = argv[argv.index("--out") + 1] if "--out" in argv else None
    train = (os.path.join(os.path.dirname(os.path.dirname(out)), "train",
                          os.path.basename(out)) if out else None)
    world.run(plan.main, argv,
              [out, train, argv[argv.index("--trace") + 1] if "--trace" in argv else None],
              {"inv.yaml": content, "model.yaml": content})


@few(8)
@given(measured=st.booleans(), content=blobs, edit=st.integers(1, 40),
       value=st.sampled_from(["nan", "-1", "inf", "1e308", "x", "", "3"]),
       rest=flags({"-m": numbers, "--mbs": numbers, "--prefetch": numbers, "--skip": numbers,
                   "--kinds": st.sampled_from(["cpu", "cpu,cpu,cpu", ","]),
                   "--cluster": st.sampled_from(["cpu_demo", "cpu_uniform", "inv.yaml"]),
                   "--trace": outs, "--overwrite": None}))
def test_ldt_sim(world, measured, content, edit, value, rest):
    from ldt.tools import sim

    argv = _argv(rest)
    files = {"inv.yaml": content}
    if measured:  # a run's action_times.csv, one field edited
        rows = (world.template / "run" / "action_times.csv").read_text().splitlines()
        fields = rows[edit % len(rows)].split(",")
        fields[edit % len(fields)] = value
        rows[edit % len(rows)] = ",".join(fields)
        files["run/action_times.csv"] = ("\n".join(rows) + "\n").encode()
        argv = ["--measured", "run", *[x for x in argv if x not in ("--cluster", "cpu_demo",
                                                                    "cpu_uniform", "inv.yaml")]]
    else:
        argv = ["--model", "gpt_tiny", "--inventory", "cpu_local", *argv]
        if "--cluster" not in argv:
            argv += ["--cluster", "cpu_demo"]
    world.run(sim.main, argv, [argv[argv.index("--trace") + 1] if "--trace" in argv else None],
              files)


@few(5)
@given(rest=flags({"--clusters": numbers, "--shadow-tokens": numbers, "--steps": numbers,
                   "--noise": st.sampled_from(["1,2", "nan", "-1", "", "loud"]),
                   "--cloud-text": paths, "--checkpoint": paths, "--out": outs,
                   "--json": outs, "--overwrite": None}),
       overrides=st.lists(st.sampled_from(["train.steps=0", "cluster=cpu_uniform",
                                           "train.num_microbatches=2", "model.vocab_size=100"]),
                          max_size=2, unique=True))
def test_ldt_audit(world, monkeypatch, rest, overrides):
    import ldt.launch.local
    from ldt.tools import audit

    def started(*args, **kwargs):
        raise _Started()

    monkeypatch.setattr(ldt.launch.local, "run_local_world", started)
    argv = [*_argv(rest), *overrides]
    out = argv[argv.index("--out") + 1] if "--out" in argv else "outputs/audit"
    world.run(audit.main, argv, [out, argv[argv.index("--json") + 1]
                                 if "--json" in argv else None])


@few(6)
@given(overrides=st.lists(st.sampled_from(
    ["train.steps=0", "train.steps=3", "train.lr=nan", "train.lr=-1", "train.resume=auto",
     "train.resume=run", "train.resume=ckpt", "train.load=ckpt", "train.resume=/dev/null",
     "data.path=corpus.txt", "data.path=folder", "data.blend=pair", "data.blend=corpus.txt",
     "model.seq_length=2147483648", "model.seq_length=0", "train.micro_batch_size=-1",
     "cluster=cpu_uniform", "cluster.layout=Et|tL", "train.save_every=1",
     "train.num_microbatches=1000000000", "data.tokenizer=/dev/null"]),
    max_size=3, unique=True),
    run_dir=st.sampled_from(["r1", "run", "folder", "ckpt", "corpus.txt"]))
def test_ldt_train(world, monkeypatch, overrides, run_dir):
    import ldt.job.train

    monkeypatch.setattr(ldt.job.train, "_launch_local", lambda cfg, topo, priced: 0)
    world.run(ldt.job.train.main, [f"run_dir={run_dir}", *overrides], [run_dir])


@few(4)
@given(overrides=st.lists(st.sampled_from(
    ["train.micro_batch_size=0", "cluster=cpu_uniform", "model.num_layers=-1",
     "train.num_microbatches=2", "cluster.stages.0.memory_gib=0.0001", "nosuch=1"]),
    max_size=2, unique=True))
def test_ldt_memory(world, monkeypatch, overrides):
    import ldt.memory
    from ldt.tools import memory

    def estimate(plain):  # megatron-core's on fake tensors takes seconds: one stage, 1 MiB
        gib = plain["cluster"]["stages"][0].get("memory_gib")
        return [ldt.memory.StageEstimate(
            0, "s", "cpu", 1, 1, [0], "-", "local", 1 << 20, 0, 0, 0, [0], (1,), 0, 0, 0, 0,
            limit=None if gib is None else gib * ldt.memory.GIB)]

    monkeypatch.setattr(ldt.memory, "estimate", estimate)
    world.run(memory.main, overrides, [])


def test_ldt_memory_help_is_its_own():
    """``ldt-memory --help`` printed ldt-train's help (#39)."""
    import contextlib
    import io

    from ldt.tools import memory

    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert memory.main(["--help"]) == 0
    assert out.getvalue().startswith("``ldt-memory") and "ldt-train [FLAGS]" not in out.getvalue()
