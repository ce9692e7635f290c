"""The exception of a user's mistake, below everything that raises it.

:class:`ConfigError` is what every refusal raises (a config, a command-line flag, a file a
user gave, an output that would damage what they have); entry points print its message as
one line and exit 2. ``ldt.config`` re-exports it, so ``from ldt.config import ConfigError``
keeps working; it lives here so that modules below the schema (``ldt.userfiles``) can raise it.
"""


class ConfigError(ValueError):
    """A config that cannot work. The message names the field, the value and the fix."""
