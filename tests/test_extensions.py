"""megatron-core's recompute extension (ldt.models.extensions): which runs need it built before
their world forms, and the refusal when a killed build's lock stands in the way. The build
itself runs on megatron-core 0.17+ (.ci/mcore: tests/conftest.py builds it, and
test_seqpar's ldt-train run with selective layernorm recompute builds it before its world)."""

import os
import time

import pytest

from ldt.config import ModelConfig, RecomputeConfig
from ldt.models import extensions
from ldt.patches import versions


class Stage:
    def __init__(self, recompute=None):
        self.recompute = recompute or RecomputeConfig()


def model(granularity=None, modules=None, method=None, num_layers=None):
    return ModelConfig(recompute_granularity=granularity, recompute_modules=modules,
                       recompute_method=method, recompute_num_layers=num_layers)


@pytest.mark.parametrize("m, stages, want", [
    (model(), [Stage(), Stage()], False),
    # megatron's default selective modules: core_attn only (CheckpointFunction, no extension)
    (model("selective"), [Stage()], False),
    (model("selective", ["core_attn", "mlp"]), [Stage()], False),
    (model("selective", ["core_attn", "layernorm"]), [Stage()], True),
    (model(), [Stage({"granularity": "selective", "modules": ["moe_act"]})], True),
    # a stage's own setting replaces the model's: one stage is enough, none is none
    (model(), [Stage(), Stage(RecomputeConfig("selective", modules=["layernorm"]))], True),
    (model("selective", ["layernorm"]), [Stage(RecomputeConfig("none"))], False),
    (model("selective", ["layernorm"]), [Stage(RecomputeConfig("full", "uniform", 1))], False),
    (model("full", method="block", num_layers=1),
     [Stage(), Stage({"granularity": "selective", "modules": ["mla_up_proj"]})], True),
])
def test_needs_build_when_a_stage_recomputes_without_output(m, stages, want):
    assert extensions.needs_build(m, stages) is want


def _lock(root, age_s):
    folder = os.path.join(root, extensions.NAME)
    os.makedirs(folder, exist_ok=True)
    path = os.path.join(folder, "lock")
    open(path, "w").close()
    then = time.time() - age_s
    os.utime(path, (then, then))
    return path


def test_a_killed_builds_lock_is_stale_a_running_ones_is_not(tmp_path, monkeypatch):
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    assert extensions.stale_locks() == []
    path = _lock(str(tmp_path), age_s=30)  # a build under way
    assert extensions.stale_locks() == []
    _lock(str(tmp_path), age_s=extensions.STALE_AFTER_S + 5)
    assert extensions.stale_locks() == [path]


def test_default_root_has_a_folder_per_python_and_device(tmp_path, monkeypatch):
    monkeypatch.delenv("TORCH_EXTENSIONS_DIR", raising=False)
    import torch.utils.cpp_extension as cpp

    monkeypatch.setattr(cpp, "get_default_build_root", lambda: str(tmp_path))
    path = _lock(str(tmp_path / "py312_cu130"), age_s=extensions.STALE_AFTER_S + 5)
    assert extensions.stale_locks() == [path]


def test_a_stale_lock_refuses_in_one_line_naming_the_file(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    monkeypatch.setattr(versions, "holds", lambda change, installed=None: True)
    path = _lock(str(tmp_path), age_s=extensions.STALE_AFTER_S + 5)
    with pytest.raises(extensions.BuildError, match="killed midway") as err:
        extensions.build()
    assert path in str(err.value) and "delete that file" in str(err.value)
    assert "\n" not in str(err.value)
    # ldt-train's step before the world: the message and a failed start, not a traceback
    from ldt.job.prepare import build_extensions

    cfg = type("Cfg", (), {"model": model("selective", ["layernorm"]), "cluster":
                           type("Cluster", (), {"stages": [Stage()]})()})()
    assert build_extensions(cfg) is False
    assert capsys.readouterr().err.strip() == f"ldt: {err.value}"


@pytest.mark.skipif(versions.holds("share_storage_ext"), reason="megatron-core 0.17+ builds")
def test_nothing_to_build_before_megatron_017():
    assert extensions.build() is False


def test_a_failed_build_says_what_to_install(tmp_path, monkeypatch):
    """No compiler: torch's build error becomes one line naming the cause and the fixes."""
    import sys
    import types

    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    monkeypatch.setattr(versions, "holds", lambda change, installed=None: True)

    def no_compiler():
        raise RuntimeError("Error building extension 'share_storage_ext'\nc++: not found")

    import megatron.core.tensor_parallel  # noqa: F401  (the real package, before the stand-in)

    fake = types.ModuleType("megatron.core.tensor_parallel.random")
    fake._get_share_storage = no_compiler
    monkeypatch.setitem(sys.modules, "megatron.core.tensor_parallel.random", fake)
    with pytest.raises(extensions.BuildError) as err:
        extensions.build(say=False)
    message = str(err.value)
    assert "\n" not in message
    assert "RuntimeError: Error building extension 'share_storage_ext'" in message
    assert "install a C++ compiler and ninja" in message and "full recompute" in message


@pytest.mark.timeout(300)
@pytest.mark.skipif(not versions.holds("share_storage_ext"),
                    reason="megatron-core 0.16 builds nothing (.ci/mcore runs this on 0.17+)")
def test_ldt_train_builds_before_its_world_on_a_fresh_machine(tmp_path):
    """The CI failure this guards: on a machine that never built megatron's extension, the
    first selective layernorm recompute compiled it inside a backward, past the neighbours'
    boundary timeout. ldt-train refuses a killed build's lock before any process starts (and
    leaves no run folder, so the same command works once the lock is gone); without it, it
    builds first (said once) and trains."""
    import subprocess
    import sys

    ext = tmp_path / "ext"  # a machine that never built it
    lock = _lock(str(ext), age_s=extensions.STALE_AFTER_S + 5)
    cmd = [sys.executable, "-m", "ldt.job.train", "cluster=cpu_vtp", "model=llama_tiny",
           "train.steps=2", "model.recompute_granularity=selective",
           "model.recompute_modules=[core_attn,layernorm]", f"run_dir={tmp_path / 'run'}"]
    env = dict(os.environ, TORCH_EXTENSIONS_DIR=str(ext))
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 1, (proc.stdout[-2000:], proc.stderr[-2000:])
    assert f"ldt: megatron-core's share_storage_ext build is locked by {lock}," in proc.stderr
    assert "ldt-train: step" not in proc.stdout  # no rank trained
    assert not (tmp_path / "run").exists()  # refused: the run folder it made is gone again
    os.remove(lock)
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, (proc.stdout[-2000:], proc.stderr[-2000:])
    assert proc.stderr.count("ldt: building megatron-core's share_storage_ext") == 1
    assert os.path.exists(ext / extensions.NAME / f"{extensions.NAME}.so")
