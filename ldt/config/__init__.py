"""The config layer: the typed schema behind ``conf/``, loading it, the layout grammar,
users' files and the exception of a user's mistake."""

from ldt.config.schema import *  # noqa: F401,F403  (``from ldt.config import LdtConfig``)
