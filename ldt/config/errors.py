"""The exception of a user's mistake, below everything that raises it.

:class:`ConfigError` is what every refusal raises (a config, a command-line flag, a file a
user gave, an output that would damage what they have); entry points print its message as
one line and exit 2. ``ldt.config`` re-exports it, so ``from ldt.config import ConfigError``
keeps working; it lives here so that modules below the schema (``ldt.config.userfiles``) can raise it.
"""


EXIT_CONFIG = 2  # a refused config or command line


class ConfigError(ValueError):
    """A config that cannot work. The message names the field, the value and the fix."""

    def one_line(self) -> str:
        """The message as entry points print it: one line (a key or value the user wrote
        may itself hold a newline)."""
        return " ".join(str(self).split())


def one_line(exc: BaseException) -> str:
    """Any refusal's message on one line (a layout error's caret picture left out)."""
    return exc.one_line() if hasattr(exc, "one_line") else " ".join(str(exc).split())


def exception_chain(exc: BaseException):
    """``exc`` and every exception behind it: its cause and context, and the per-rank
    failures a ``torch.distributed.checkpoint`` CheckpointException keeps (a Ctrl-C or a
    full disk inside ``dcp.save`` / ``dcp.load`` arrives wrapped in one), each once."""
    todo, seen = [exc], set()
    while todo:
        e = todo.pop()
        if e is None or id(e) in seen:
            continue
        seen.add(id(e))
        yield e
        todo += [e.__cause__, e.__context__]
        failures = getattr(e, "failures", None)
        if isinstance(failures, dict):
            for failure in failures.values():
                todo.append(failure[0] if isinstance(failure, tuple) else failure)
