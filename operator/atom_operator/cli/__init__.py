"""The operator's `atom` subcommands: `atom operator run` (`run.py`) and `atom render`
(`render.py`). Each module has the dispatcher's interface: `add_arguments(parser)` and
`run(args) -> int`."""
