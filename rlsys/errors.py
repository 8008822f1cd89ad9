"""Errors a user causes and can fix: a config, a data file, a model folder. The `rlsys` command prints
their message alone and exits non-zero; `rlsys --traceback ...` shows the traceback as well. A config's
own ConfigError (rlsys/config.py) is one of them without deriving from UserError: the schema imports
nothing of rlsys (rlsys/cli.py user_error takes both)."""


class UserError(Exception):
    """The message names what to fix (field, file and line, or sample) and how."""


POSITIONALS = {"items": "a config or overrides", "config": "a config"}  # argparse dests without a flag


def flags(dests: set[str]) -> str:
    """Command-line options by their argparse dests, as the user typed them: a message that refuses them names them."""
    return ", ".join(POSITIONALS.get(d) or "--" + d.replace("_", "-") for d in sorted(dests))
