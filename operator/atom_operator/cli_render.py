"""Transitional alias: `atom_runtime.cli` still names this module for `atom render`.

Remove once the dispatcher names `atom_operator.cli.render`.
"""

from atom_operator.cli.render import add_arguments, run  # noqa: F401
