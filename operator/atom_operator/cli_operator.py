"""Transitional alias: `atom_runtime.cli` still names this module for `atom operator`.

Remove once the dispatcher names `atom_operator.cli.run`.
"""

from atom_operator.cli.run import add_arguments, run  # noqa: F401
