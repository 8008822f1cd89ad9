"""The sandbox's own processes, started by rlsys/reward/sandbox.py as `python -I -S -c <this file> ...`.

Standard library only and no rlsys imports: the code runs without site-packages or a view of the repo.
`launch` runs as the trainer's user, builds the jail and sets the limits, then starts this file again
as `run`, which executes the model's code. A jail that cannot be built exits with SETUP_FAILED and
says why on stderr.
"""
import ctypes
import json
import os
import resource
import signal
import sys

SETUP_FAILED = 97
CLONE_NEWNS, CLONE_NEWUSER, CLONE_NEWPID, CLONE_NEWNET = 0x20000, 0x10000000, 0x20000000, 0x40000000
MS_RDONLY, MS_NOSUID, MS_NODEV, MS_NOEXEC, MS_REMOUNT, MS_BIND, MS_REC, MS_PRIVATE = (
    1, 2, 4, 8, 32, 4096, 16384, 1 << 18)
PR_SET_PDEATHSIG = 1

_libc = ctypes.CDLL(None, use_errno=True)
_libc.mount.argtypes = [ctypes.c_char_p, ctypes.c_char_p, ctypes.c_char_p, ctypes.c_ulong, ctypes.c_char_p]


def _check(ret: int, what: str) -> None:
    if ret != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"{what}: {os.strerror(err)}")


def _mount(source, target, fstype, flags, data=None) -> None:
    enc = lambda s: None if s is None else s.encode()  # noqa: E731
    _check(_libc.mount(enc(source), enc(target), enc(fstype), flags, enc(data)), f"mount {target}")


def _die_with_parent() -> None:
    """SIGKILL this process when its parent dies, so a killed trainer leaves no sandbox behind."""
    _check(_libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0), "prctl(PR_SET_PDEATHSIG)")


def _under(path: str, parent: str) -> bool:
    return path == parent or path.startswith(parent.rstrip("/") + "/")


def _enter_namespaces(spec: dict) -> None:
    """New network, mount and PID namespaces (and a user namespace when not root); hide `spec["hide"]`."""
    uid, gid = os.getuid(), os.getgid()
    if uid == 0:
        _check(_libc.unshare(CLONE_NEWNS | CLONE_NEWNET | CLONE_NEWPID), "unshare(mount, net, pid)")
    else:  # an unprivileged user may create namespaces inside a user namespace of its own
        _check(_libc.unshare(CLONE_NEWUSER | CLONE_NEWNS | CLONE_NEWNET | CLONE_NEWPID),
               "unshare(user, mount, net, pid)")
        for name, text in (("setgroups", "deny"), ("uid_map", f"{uid} {uid} 1"), ("gid_map", f"{gid} {gid} 1")):
            with open(f"/proc/self/{name}", "w") as f:
                f.write(text)
    _mount(None, "/", None, MS_REC | MS_PRIVATE)  # nothing mounted here reaches the host
    keep = {path: os.open(path, os.O_PATH) for path in spec["keep"]}  # reachable after hiding
    for path in spec["hide"]:
        _mount("tmpfs", path, "tmpfs", MS_NOSUID | MS_NODEV, f"size={spec['tmpfs_mb']}m,mode=1777")
    for path, fd in keep.items():
        if any(_under(path, hidden) for hidden in spec["hide"]):
            os.makedirs(path, exist_ok=True)
            _mount(f"/proc/self/fd/{fd}", path, None, MS_BIND | MS_REC)
            _mount(None, path, None, MS_REMOUNT | MS_BIND | MS_RDONLY)
        os.close(fd)


def _continue_in_child() -> None:
    """Fork: the parent waits and exits with the child's status (128 + n for signal n); the child goes on."""
    pid = os.fork()
    if pid:
        code = os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])
        os._exit(code if code >= 0 else 128 - code)
    _die_with_parent()


def _mount_proc() -> None:
    """A /proc that shows only this PID namespace (the host's would show the trainer's processes)."""
    try:
        _mount("proc", "/proc", "proc", MS_NOSUID | MS_NODEV | MS_NOEXEC)
    except OSError:  # a user namespace inside a container may not mount proc: hide the host's instead
        _mount("tmpfs", "/proc", "tmpfs", MS_NOSUID | MS_NODEV | MS_NOEXEC, "size=1m")


def _drop_root(uid: int) -> None:
    if os.getuid() == 0:
        os.setgroups([])
        os.setgid(uid)
        os.setuid(uid)
        _die_with_parent()  # a change of user clears the setting


def _set_limits(limits: dict) -> None:
    mb = 1 << 20
    for name, soft, hard in (("RLIMIT_CPU", limits["cpu_s"], limits["cpu_s"] + 1),  # SIGXCPU, then SIGKILL
                             ("RLIMIT_AS", limits["memory_mb"] * mb, limits["memory_mb"] * mb),
                             ("RLIMIT_FSIZE", limits["file_size_mb"] * mb, limits["file_size_mb"] * mb),
                             ("RLIMIT_NPROC", limits["max_processes"], limits["max_processes"]),
                             ("RLIMIT_CORE", 0, 0)):
        resource.setrlimit(getattr(resource, name), (soft, hard))


def launch(spec: dict) -> None:
    try:
        _die_with_parent()
        if spec["isolate"]:
            _enter_namespaces(spec)
            _continue_in_child()  # now the PID namespace's init: when it exits, every process in it dies
            _mount_proc()
            _continue_in_child()  # the code's process: not init, which the kernel shields from signals
            _drop_root(spec["uid"])
        os.chdir(spec["workdir"])
        _set_limits(spec["limits"])
        command = sys.orig_argv[:sys.orig_argv.index("-c") + 2]  # this interpreter and this file
        os.execve(command[0], command + ["run"], spec["env"])  # fails if the code's user cannot run it
    except OSError as e:
        print(f"sandbox setup failed: {e}", file=sys.stderr, flush=True)
        os._exit(SETUP_FAILED)


class _Capped:
    """A stdout that keeps the first `limit` characters and counts the rest."""

    def __init__(self, limit: int):
        self.limit, self.parts, self.kept, self.chars = limit, [], 0, 0

    def write(self, text: str) -> int:
        text = str(text)
        if self.kept < self.limit:
            self.parts.append(text[:self.limit - self.kept])
            self.kept += len(self.parts[-1])
        self.chars += len(text)
        return len(text)

    def flush(self) -> None:
        pass


def run_script(job: dict, out) -> None:
    """Run the code as a script (the python tool) and report what it printed, ended by its exception if any."""
    printed = _Capped(job["max_chars"])
    sys.stdout = printed
    try:
        exec(compile(job["code"], "<tool>", "exec"), {"__name__": "__main__"})
    except BaseException as e:  # noqa: B036 - the model's code failing is its answer
        printed.write(f"{type(e).__name__}: {e}\n")
    out.write(json.dumps({"stdout": "".join(printed.parts), "chars": printed.chars}) + "\n")
    out.flush()
    os._exit(0)


def run() -> None:
    """Run the code and print only the return values: the expected ones never enter the sandbox."""
    job = json.load(sys.stdin)
    out = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)  # the code's prints go to stderr, so stdout carries only the harness's line
    if job["fn"] is None:
        run_script(job, out)
    try:
        namespace = {"__name__": "solution"}
        exec(compile(job["code"], "<solution>", "exec"), namespace)
        fn = namespace[job["fn"]]
        line = json.dumps({"results": [fn(*args) for args in job["args"]]})
    except BaseException as e:  # noqa: B036 - SystemExit and KeyboardInterrupt are the code's failures too
        line = json.dumps({"error": f"{type(e).__name__}: {e}"[:300]})
    out.write(line + "\n")
    out.flush()
    os._exit(0)  # skip any atexit hooks the code registered


if __name__ == "__main__":
    if sys.argv[1] == "launch":
        launch(json.loads(sys.argv[2]))
    else:
        run()
