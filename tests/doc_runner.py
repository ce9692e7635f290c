"""How the documents test (``tests/test_docs.py``) finds a document's shell blocks and runs
them as a reader would: the blocks and their ``# expect:`` lines (:func:`blocks_of`), a scratch
folder laid out like a fresh clone (:func:`make_scratch`), what the test adds to a command
(:data:`SMALL`, :data:`PLACEHOLDERS`: :func:`as_run`), one command in its own process group
with a timeout (:func:`run`), a block's commands in order (:func:`run_block`), and the blocks
run ahead of their tests, several documents at a time (:class:`Lanes`). What a command's
output must say is the test's (its ``CHECKS``)."""

from __future__ import annotations

import dataclasses
import glob
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
import traceback
from typing import Callable, Optional

from doc_fixtures import FIXTURES

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SKIP = re.compile(r"^#\s*doc-test:\s*skip\s*,\s*(\S.*)$")
EXPECT = re.compile(r"^#\s*expect:\s?(.*\S)\s*$")
FENCE = re.compile(r"^```(bash|sh|shell)\s*$")
COMMAND_TIMEOUT_S = 300


def documents() -> list[str]:
    """README.md, examples/README.md, then docs/*.md (all of them, sorted)."""
    docs = ["README.md", "examples/README.md"]
    docs += sorted(os.path.relpath(p, ROOT) for p in glob.glob(os.path.join(ROOT, "docs", "*.md")))
    return [d for d in docs if os.path.exists(os.path.join(ROOT, d))]


@dataclasses.dataclass
class Command:
    line: int  # 1-based, of its first line
    text: str  # ``\``-continued lines joined
    expects: list  # regexes of its ``# expect:`` lines, in order


@dataclasses.dataclass
class Block:
    doc: str
    line: int  # of the opening fence, 1-based
    commands: list  # of Command
    skip: Optional[str]

    def __str__(self) -> str:
        return f"{self.doc}:{self.line}"


def blocks_of(doc: str, text: Optional[str] = None) -> list[Block]:
    """The shell blocks of ``doc`` (read from the repository unless ``text`` is given)."""
    if text is None:
        text = open(os.path.join(ROOT, doc), encoding="utf-8").read()
    lines = text.split("\n")
    out, i = [], 0
    while i < len(lines):
        if not FENCE.match(lines[i].strip()):
            i += 1
            continue
        start, body = i + 1, []
        i += 1
        while i < len(lines) and not lines[i].strip().startswith("```"):
            body.append((i + 1, lines[i]))
            i += 1
        i += 1
        first = next((t.strip() for _, t in body if t.strip()), "")
        skip = SKIP.match(first)
        out.append(Block(doc, start, _commands(body), skip.group(1) if skip else None))
    return out


def _commands(body: list) -> list:
    out, pending, at = [], "", None
    for number, text in body:
        expect = EXPECT.match(text.strip()) if not pending else None
        if expect:
            if not out:
                raise ValueError(f"line {number}: '# expect:' before any command")
            re.compile(expect.group(1))  # a bad regex is the document's error, said at collection
            out[-1].expects.append(expect.group(1))
            continue
        if not pending and (not text.strip() or text.strip().startswith("#")):
            continue
        at = at or number
        if text.rstrip().endswith("\\"):
            pending += text.rstrip()[:-1] + " "
            continue
        out.append(Command(at, (pending + text).strip(), []))
        pending, at = "", None
    return out


def unexpected(command: Command, stdout: str, stderr: str) -> list[str]:
    """The ``# expect:`` regexes of ``command`` that its output does not match."""
    output = stdout + "\n" + stderr
    return [e for e in command.expects if not re.search(e, output, re.M)]


# ---- what the test adds: small sizes, placeholders ------------------------------------------
# (pattern in the command, what is appended, why); every one that matches applies, in order
SMALL = [
    (r"^make demo\b", " ARGS='train.steps=5'", "5 of the demo's 50 steps"),
    (r"ldt-audit\b", " --steps 2 --shadow-tokens 512 --clusters 4",
     "2 steps, small shadow runs"),
    (r"ldt-audit\b(?!.*--noise)", " --noise ''",
     "no defended run where the document leaves the default three (its --noise 2 line has one)"),
    (r"ldt-train\b(?!.*(--help|--cfg|train\.steps=[1-5]\b))", " train.steps=5",
     "5 steps: a world's start-up is what the test checks, not the 50 steps"),
    (r"ldt-train\b(?!.*train\.steps=[1-5]\b).*train\.save_every=", " train.save_every=5",
     "its checkpoint at the last of those steps"),
]

# text in a document -> what replaces it (a string, or a function of the scratch's state)
PLACEHOLDERS: dict[str, object] = {
    "outputs/<date>/<time>": lambda s: s.last_run_dir,
    "outputs/RUN": lambda s: s.last_run_dir,
    "import HF_FOLDER OUT": "import path/to/hf_model ckpt/imported",
    "export CHECKPOINT OUT": "export ckpt/imported hf_exported",
}


@dataclasses.dataclass
class Scratch:
    """One document's scratch folder and what its commands left behind."""
    root: str
    last_run_dir: Optional[str] = None


def make_scratch(doc: str, parent: str) -> Scratch:
    root = os.path.join(parent, re.sub(r"[^A-Za-z0-9_.-]", "_", doc))
    for rel in _tracked_files():
        dst = os.path.join(root, rel)
        os.makedirs(os.path.dirname(dst), exist_ok=True)
        shutil.copy2(os.path.join(ROOT, rel), dst)
    # .venv: this environment, already installed; its own stamp, so `make` installs nothing
    venv = os.path.join(root, ".venv")
    os.makedirs(venv)
    for name in os.listdir(sys.prefix):
        if not name.startswith("."):
            os.symlink(os.path.join(sys.prefix, name), os.path.join(venv, name))
    open(os.path.join(venv, ".ldt-installed"), "w").close()
    text = open(os.path.join(ROOT, doc), encoding="utf-8").read()
    for path, make in FIXTURES.items():
        if re.search(r"(?<![\w./-])" + re.escape(path) + ("" if path.endswith("/") else
                                                          r"(?![\w-])"), text):
            make(root)
    return Scratch(root)


def _tracked_files() -> list[str]:
    try:
        out = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True,
                             check=True, timeout=30).stdout.decode()
        return [f for f in out.split("\0") if f and os.path.isfile(os.path.join(ROOT, f))]
    except (OSError, subprocess.SubprocessError):  # not a git checkout: what is not built
        skip = {".git", ".venv", "outputs", "multirun", "__pycache__", ".pytest_cache"}
        found = []
        for folder, dirs, files in os.walk(ROOT):
            dirs[:] = [d for d in dirs if d not in skip and not d.endswith(".egg-info")]
            found += [os.path.relpath(os.path.join(folder, f), ROOT) for f in files]
        return found


def as_run(command: str, scratch: Scratch) -> tuple[str, list[str]]:
    """The command the test runs, and the notes on what it changed."""
    notes = []
    for text, fill in PLACEHOLDERS.items():
        if text in command:
            value = fill(scratch) if callable(fill) else fill
            if value is None:
                raise AssertionError(f"{text} stands for an earlier command's output, and no "
                                     "earlier command of this document made one")
            command = command.replace(text, value)
            notes.append(f"{text} -> {value}")
    code, _, comment = _split_comment(command)
    original = code
    for pattern, extra, why in SMALL:
        if re.search(pattern, original):
            code += extra
            notes.append(f"added{extra} ({why})")
    return code, notes


def _split_comment(command: str) -> tuple[str, str, str]:
    """``code  # comment`` -> (code, '#', comment); a # inside quotes or a word is code."""
    quote = None
    for i, ch in enumerate(command):
        if quote:
            quote = None if ch == quote else quote
        elif ch in "'\"":
            quote = ch
        elif ch == "#" and (i == 0 or command[i - 1] in " \t"):
            return command[:i].rstrip(), "#", command[i + 1:]
    return command, "", ""


def run(command: str, cwd: str, timeout: float = COMMAND_TIMEOUT_S, live: Optional[set] = None):
    """bash -c in its own process group; on a timeout the whole group is killed. ``live``:
    the running commands' process ids, for whoever must stop them early."""
    env = dict(os.environ, PWD=cwd, PATH=os.path.join(cwd, ".venv", "bin") + os.pathsep
               + os.environ.get("PATH", ""))
    env.pop("VIRTUAL_ENV", None)
    proc = subprocess.Popen(["bash", "-o", "pipefail", "-c", command], cwd=cwd, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True, stdin=subprocess.DEVNULL)
    if live is not None:
        live.add(proc.pid)
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        err += f"\n[doc test: killed after {timeout} s]"
    finally:
        try:
            os.killpg(proc.pid, signal.SIGKILL)  # anything the command left running
        except ProcessLookupError:
            pass
        if live is not None:
            live.discard(proc.pid)
    return subprocess.CompletedProcess(command, proc.returncode, out, err)


def run_block(block: Block, scratch: Scratch, say: Callable, checks_for: Callable,
              live: Optional[set] = None) -> Optional[str]:
    """Run ``block``'s commands in ``scratch``, in order, each followed by its checks
    (``checks_for(doc, command)``: functions of its result and scratch that assert what the
    document says); what failed first (None: nothing). ``say``: the log of what ran."""
    for cmd in block.commands:
        line, written = cmd.line, cmd.text
        where = f"{block.doc}:{line} (block at line {block.line}): {written}"
        try:
            command, notes = as_run(written, scratch)
        except AssertionError as exc:
            return f"{where}\n{exc}"
        say(f"{block.doc}:{line}$ {command}" + (f"   [{'; '.join(notes)}]" if notes else ""))
        start = time.monotonic()
        result = run(command, scratch.root, live=live)
        say(f"    exit {result.returncode} in {time.monotonic() - start:.1f} s")
        if result.returncode != 0:
            return (f"{where}\nran: {command}\nexit {result.returncode}\n--- stdout\n"
                    f"{result.stdout[-3000:]}\n--- stderr\n{result.stderr[-3000:]}")
        missing = unexpected(cmd, result.stdout, result.stderr)
        if missing:
            return (f"{where}\nran: {command}\nits output does not match the document's "
                    f"'# expect:' line(s): {missing}\n--- stdout\n{result.stdout[-2000:]}"
                    f"\n--- stderr\n{result.stderr[-2000:]}")
        for check in checks_for(block.doc, written):
            try:
                check(result, scratch)
            except AssertionError as exc:
                return (f"{where}\nran: {command}\nits output no longer says what the "
                        f"document says: {exc}\n--- stdout\n{result.stdout[-2000:]}")
    return None


class Lanes:
    """The selected blocks, run ahead of their tests: ``LDT_DOC_LANES`` documents at a time
    (default 2), each document's blocks in order in its own scratch. One command's world keeps
    the 2 cores ~60% busy (imports, start-up, waits), so two documents at a time take about
    two thirds of the time one after another; a test waits for its block's result. Fixtures
    are made one at a time (some draw from torch's global random state)."""

    def __init__(self, blocks: list[Block], parent: str, lanes: int, checks_for: Callable):
        self._parent, self._closed, self.live = parent, False, set()
        self._checks_for = checks_for
        self._lock, self._making = threading.Lock(), threading.Lock()
        self._docs: dict[str, list[Block]] = {}
        for b in blocks:
            self._docs.setdefault(b.doc, []).append(b)
        self._done = {str(b): threading.Event() for b in blocks}
        self._results: dict[str, tuple[list, Optional[str]]] = {}
        self._threads = [threading.Thread(target=self._lane, daemon=True, name=f"doc-lane-{i}")
                         for i in range(lanes)]
        for t in self._threads:
            t.start()

    def _lane(self) -> None:
        while True:
            with self._lock:
                if self._closed or not self._docs:
                    return
                doc = next(iter(self._docs))
                blocks = self._docs.pop(doc)
            scratch = None
            for b in blocks:
                log: list[str] = []
                try:
                    if self._closed:
                        raise RuntimeError("the documents test stopped before this block ran")
                    if scratch is None:
                        with self._making:
                            scratch = make_scratch(doc, self._parent)
                    failure = run_block(b, scratch, log.append, self._checks_for,
                                        self.live)
                except BaseException:  # noqa: B036 (reported by the block's test)
                    failure = traceback.format_exc()
                self._results[str(b)] = (log, failure)
                self._done[str(b)].set()

    def result(self, block: Block) -> tuple[list, Optional[str]]:
        self._done[str(block)].wait()
        return self._results[str(block)]

    def close(self) -> None:
        """Start nothing more, kill what runs, wait for the lanes."""
        self._closed = True
        for pid in list(self.live):
            try:
                os.killpg(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        for t in self._threads:
            t.join(60)
