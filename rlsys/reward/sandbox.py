"""Run model-written Python against test cases in a contained process; only pass or fail comes back.

Each run starts `python -I -S` (no user site, no site-packages, no PYTHON* variables, stdlib only) in a
new session, through sandbox_child.py, with these layers:

- Namespaces (Linux; as root, or in a user namespace of one's own):
  - network: a new, empty namespace. No connection leaves, not even to 127.0.0.1 of the host.
  - mount: fresh size-limited tmpfs over /tmp, /var/tmp, /dev/shm, the trainer's home and working
    directory and `hide_paths`. The code's workdir, HOME and TMPDIR is the new /tmp; whatever it
    writes there or in the other hidden paths vanishes with the run. The Python installation is
    mounted back read-only where it was hidden; a directory on the way to it that others may not
    enter (root's home holding a pyenv Python, say) is hidden too, so the code's user reaches it.
  - PID: the namespace's init waits for the code's process and then exits, which ends every process
    the code started, even one that left the process group; a fresh /proc shows only these.
- A user without privileges: when rlsys runs as root the code runs as `uid` (nobody), so it cannot
  read or write files that are not world-readable or world-writable, or raise its limits. When rlsys
  runs as another user the code keeps that user's rights on every path that is not hidden.
- Resource limits (setrlimit): CPU seconds, address space, file size, and processes. The process
  limit counts every process of the code's user: per sandbox in a user namespace, but shared by
  all sandboxes running at once when root drops to `uid`.
- A wall-clock timeout, min(max(t_min_s, 1.5 x the slowest passing run so far), t_max_s), after
  which the whole process group is killed.
- The expected outputs never enter the sandbox: it returns the function's results and the trainer
  compares them, so code cannot report success it did not earn, and output is capped by file size.

Not covered: files outside the hidden paths stay readable when world-readable (or, for a non-root
trainer, when the trainer can read them); the kernel's own attack surface; CPU time of many short
processes (each has its own limit, the wall clock bounds the total). Without namespaces only the
limits, the private workdir and the timeout apply, so that mode must be asked for:
reward.sandbox.allow_unsandboxed=true.
"""
from __future__ import annotations

import json
import logging
import os
import signal
import stat
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rlsys.config import SandboxConfig

CHILD_SOURCE = (Path(__file__).parent / "sandbox_child.py").read_text()
SETUP_FAILED = 97  # sandbox_child.py's exit code when the jail cannot be built
TMPFS_FILES = 4  # each private tmpfs holds this many files of the largest size
MAX_OUTPUT = 1 << 20  # bytes of the child's stdout that are read
PROBE = ("def probe():\n    return 1\n", "probe", [([], 1)])
SIGNAL_NAMES = {signal.SIGXCPU: "CPU time limit", signal.SIGKILL: "killed (CPU or memory limit)",
                signal.SIGXFSZ: "file size limit", signal.SIGSEGV: "segmentation fault"}

log = logging.getLogger(__name__)


class SandboxUnavailable(RuntimeError):
    """The sandbox cannot isolate code on this machine and the config does not allow running without."""


@dataclass
class SandboxResult:
    passed: bool
    reason: str  # "passed", or what went wrong: for logs and tests, never shown to the model
    seconds: float


@dataclass
class ScriptResult:
    output: str | None  # what the script printed (cut to max_chars); None when it did not finish
    chars: int  # characters it printed in all
    reason: str  # "ran", or why it did not finish
    seconds: float


class AdaptiveTimeout:
    """min(max(t_min, 1.5 x T_anchor), t_max), T_anchor the slowest passing run so far: room for slow
    correct code once some has been seen, without waiting t_max on every infinite loop."""

    def __init__(self, t_min: float, t_max: float):
        self.t_min, self.t_max, self.anchor = t_min, t_max, 0.0

    def seconds(self) -> float:
        return min(max(self.t_min, 1.5 * self.anchor), self.t_max)

    def observe(self, result: SandboxResult) -> None:
        if result.passed:
            self.anchor = max(self.anchor, result.seconds)


def _closed_parent(path: str) -> str | None:
    """The outermost directory above `path` that users other than its owner may not enter, if any."""
    return next((str(p) for p in reversed(Path(path).parents) if not p.stat().st_mode & stat.S_IXOTH), None)


def _hidden_paths(cfg: SandboxConfig, keep: list[str]) -> list[str]:
    """Existing directories to hide, outermost first, none inside another and never "/". Besides the
    temp dirs, home, working directory and `hide_paths`, a directory that would bar the code's user
    from a `keep` path: hidden, the path is mounted back inside a tmpfs anyone may enter."""
    wanted = ["/tmp", "/var/tmp", "/dev/shm", str(Path.home()), os.getcwd(), *cfg.hide_paths,
              *filter(None, map(_closed_parent, keep))]
    real = sorted({os.path.realpath(os.path.expanduser(p)) for p in wanted}, key=len)
    hidden: list[str] = []
    for path in real:
        if os.path.isdir(path) and path != "/" and not any(path.startswith(h + "/") for h in hidden):
            hidden.append(path)
    return hidden


def _python_paths() -> tuple[str, list[str]]:
    """The real interpreter (not a venv's wrapper: -S needs no venv) and the directories it needs."""
    exe = os.path.realpath(sys.executable)
    dirs = {os.path.dirname(exe), os.path.realpath(sys.base_prefix), os.path.realpath(sys.base_exec_prefix)}
    return exe, sorted(dirs)


class Sandbox:
    """Runs code in the sandbox with an adaptive timeout. `isolation=None` checks whether namespaces
    work here (one short run); False runs without them, which the config must allow. `field` is the config
    section its limits come from, named in its refusal."""

    def __init__(self, cfg: SandboxConfig, isolation: bool | None = None, field: str = "reward.sandbox"):
        self.cfg = cfg
        self.timeout = AdaptiveTimeout(cfg.t_min_s, cfg.t_max_s)
        self.exe, self.keep = _python_paths()  # fixed for the worker's life: not looked up on every run
        self.hide = _hidden_paths(cfg, self.keep)
        self.isolated = True
        why = "isolation turned off by the caller"
        if isolation is None:
            probe = self._run(*PROBE, timeout_s=max(cfg.t_max_s, 10.0))  # not a pass to learn from
            isolation, why = probe.passed, probe.reason
        if not isolation and not cfg.allow_unsandboxed:
            raise SandboxUnavailable(
                f"the sandbox cannot isolate model-written code on this machine ({why}); it needs Linux "
                f"namespaces (root, or unprivileged user namespaces). Set {field}.allow_unsandboxed="
                "true to run it with resource limits only (no network, file or process isolation)")
        if not isolation:
            log.warning("the sandbox runs model-written code WITHOUT isolation (%s): only resource limits "
                        "and a private workdir apply", why)
        self.isolated = isolation

    def run(self, code: str, fn: str, cases: list[tuple[list, Any]],
            timeout_s: float | None = None) -> SandboxResult:
        """Call `fn(*args)` of `code` for each case; passed if every result equals its expected value."""
        result = self._run(code, fn, cases, timeout_s or self.timeout.seconds())
        self.timeout.observe(result)
        return result

    def _run(self, code: str, fn: str, cases: list[tuple[list, Any]], timeout_s: float) -> SandboxResult:
        expected = json.loads(json.dumps([want for _, want in cases]))  # as the results come back
        with tempfile.TemporaryDirectory(prefix="rlsys-sandbox-") as private:
            start = time.monotonic()
            job = {"code": code, "fn": fn, "args": [list(args) for args, _ in cases]}
            rc, out, err = self._start_and_wait(job, private, timeout_s)
            seconds = time.monotonic() - start
        reason = _verdict(rc, out, err, expected, timeout_s)
        return SandboxResult(reason == "passed", reason, seconds)

    def run_script(self, code: str, timeout_s: float, max_chars: int) -> ScriptResult:
        """Run `code` as a script (the python tool): what it printed, its first `max_chars` characters, with
        the exception that ended it as the last line, as Python's REPL shows it."""
        with tempfile.TemporaryDirectory(prefix="rlsys-sandbox-") as private:
            start = time.monotonic()
            rc, out, err = self._start_and_wait({"code": code, "fn": None, "max_chars": max_chars}, private, timeout_s)
            seconds = time.monotonic() - start
        failure = _failure(rc, err, timeout_s)
        if failure:
            return ScriptResult(None, 0, failure, seconds)
        lines = out.strip().splitlines()
        try:
            report = json.loads(lines[-1])
            return ScriptResult(report["stdout"], report["chars"], "ran", seconds)
        except (IndexError, json.JSONDecodeError, KeyError, TypeError):
            return ScriptResult(None, 0, "unreadable output", seconds)

    def _start_and_wait(self, job: dict, private: str, timeout_s: float):
        """(exit code or None on timeout, stdout, stderr tail) of one child."""
        workdir = "/tmp" if self.isolated else private
        spec = {"isolate": self.isolated, "uid": self.cfg.uid, "workdir": workdir, "keep": self.keep,
                "hide": self.hide, "tmpfs_mb": TMPFS_FILES * self.cfg.file_size_mb,
                "limits": {"cpu_s": self.cfg.cpu_s, "memory_mb": self.cfg.memory_mb,
                           "file_size_mb": self.cfg.file_size_mb, "max_processes": self.cfg.max_processes},
                "env": {"PATH": "/usr/local/bin:/usr/bin:/bin", "HOME": workdir, "TMPDIR": workdir,
                        "LANG": "C.UTF-8"}}
        paths = {name: os.path.join(private, name) for name in ("in", "out", "err")}
        Path(paths["in"]).write_text(json.dumps(job))
        with open(paths["in"]) as stdin, open(paths["out"], "w") as stdout, open(paths["err"], "w") as stderr:
            proc = subprocess.Popen([self.exe, "-I", "-S", "-c", CHILD_SOURCE, "launch", json.dumps(spec)],
                                    stdin=stdin, stdout=stdout, stderr=stderr, cwd=private, env=spec["env"],
                                    start_new_session=True)
            try:
                rc = proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                rc = None
            finally:
                _kill_group(proc)
        with open(paths["out"], "rb") as f:
            out = f.read(MAX_OUTPUT).decode(errors="replace")
        with open(paths["err"], "rb") as f:
            f.seek(max(0, os.fstat(f.fileno()).st_size - 2000))
            err = f.read().decode(errors="replace")
        return rc, out, err


def _kill_group(proc: subprocess.Popen) -> None:
    """Kill whatever is left of the run's process group (in the PID namespace, its init's death
    already ended the rest) and reap the launcher."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    proc.wait()


def _failure(rc: int | None, err: str, timeout_s: float) -> str | None:
    """Why the child did not finish its job (timeout, setup, a limit's signal), or None when it exited 0."""
    if rc is None:
        return f"timed out after {timeout_s:.1f}s"
    if rc == SETUP_FAILED:
        return err.strip().splitlines()[-1] if err.strip() else "sandbox setup failed"
    if rc != 0:
        sig = -rc if rc < 0 else rc - 128 if rc > 128 else 0  # the launcher reports a signal as 128 + n
        if sig in SIGNAL_NAMES:
            return SIGNAL_NAMES[sig]
        return f"exited with {rc}: {err.strip()[-200:]}"
    return None


def _verdict(rc: int | None, out: str, err: str, expected: list, timeout_s: float) -> str:
    """"passed" or what went wrong."""
    failure = _failure(rc, err, timeout_s)
    if failure:
        return failure
    lines = out.strip().splitlines()
    try:
        report = json.loads(lines[-1]) if lines else {"error": "no output"}
    except json.JSONDecodeError:
        return "unreadable output"
    if not isinstance(report, dict) or not isinstance(report.get("results"), list):
        return f"error: {report.get('error') if isinstance(report, dict) else report}"
    for i, (got, want) in enumerate(zip(report["results"], expected)):
        if got != want:
            return f"wrong answer on case {i}"
    return "passed" if len(report["results"]) == len(expected) else "wrong number of results"
