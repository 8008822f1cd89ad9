"""Errors a user causes and can fix: a config, a data file, a model folder. The `rlsys` command prints
their message alone and exits non-zero; `rlsys --traceback ...` shows the traceback as well."""


class UserError(Exception):
    """The message names what to fix (field, file and line, or sample) and how."""
