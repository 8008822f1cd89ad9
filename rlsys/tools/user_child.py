"""The fork server of the user's tools, started by rlsys/tools/box.py as `python -m rlsys.tools.user_child`.

It limits its address space to `tools.memory_mb` (so a tool that allocates without bound fails its call with a
MemoryError instead of taking the machine's memory from the rollout worker), imports the tools once, then forks
a process per conversation: the fork starts in milliseconds with the tools imported, and whatever a tool keeps
in its globals is that conversation's alone. Each process dies with the server, and the server with the worker.

Control (a SOCK_SEQPACKET socket whose fd is argv[1]): first {"ready": true} (or {"error"} if a tool does not
import); then {"fork": true} with a connected socket's fd attached -> {"pid"}: a process serving the tools on
that socket; {"reap": pid} -> {"status"}: its exit code, once it has died or been killed.
A conversation's process reads one request per line, {"name", "arguments"}, and writes one reply per line,
{"text", "chars"} or {"error"}; with an environment (tools.env), {"step": action, "sample"} -> {"text",
"chars", "reward", "done"}: the conversation's instance, made at its first step in this process, reset(sample)
and replayed ("replay": the actions it stepped and the messages it responded to before: box.py's user_env),
steps; {"respond": messages, "sample", "replay"} -> the same reply: its respond(messages);
{"batch": [requests], "timeout_s"} -> {"replies": [...]}: one model turn's calls, run at once (`_batch`).
The tools' own prints go to stderr, so they cannot corrupt a reply. A reply's text is cut to the size limit
here, so a flood never crosses the socket. A tool, reset or step may be a function or an `async def`.
"""
import asyncio
import contextlib
import ctypes
import inspect
import json
import math
import os
import resource
import signal
import socket
import sys
from concurrent.futures import ThreadPoolExecutor

from rlsys.plugins import load_function

PR_SET_PDEATHSIG = 1


def main(control_fd: int, specs: dict[str, str], env: str | None, max_chars: int, memory_mb: int) -> None:
    resource.setrlimit(resource.RLIMIT_AS, (memory_mb << 20, memory_mb << 20))
    os.dup2(2, 1)  # the tools' prints
    _die_with_parent()
    control = socket.socket(fileno=control_fd)
    try:
        fns = {name: load_function(spec, "tools.fns") for name, spec in specs.items()}
        env_class = load_function(env, "tools.env") if env else None
    except Exception as e:
        control.send(json.dumps({"error": f"importing the tools raised {type(e).__name__}: {e}"}).encode())
        return
    control.send(b'{"ready": true}')
    while True:
        data, fds, _, _ = socket.recv_fds(control, 1 << 16, 1)
        if not data:  # the worker closed it
            return
        request = json.loads(data)
        if "reap" in request:
            _, status = os.waitpid(request["reap"], 0)
            control.send(json.dumps({"status": os.waitstatus_to_exitcode(status)}).encode())
            continue
        pid = os.fork()
        if pid == 0:
            control.close()
            _die_with_parent()
            serve(socket.socket(fileno=fds[0]), fns, env_class, max_chars)
            os._exit(0)
        os.close(fds[0])
        control.send(json.dumps({"pid": pid}).encode())


def serve(conn: socket.socket, fns: dict, env_class, max_chars: int) -> None:
    env = None  # the conversation's environment, made and reset at its first step
    for line in conn.makefile("rb"):
        request = json.loads(line)
        try:
            steps = [r for r in request.get("batch", [request]) if "step" in r or "respond" in r]
            if steps and env is None:
                fresh = env_class()
                _result(fresh.reset(steps[0]["sample"]))
                for past in steps[0].get("replay", ()):  # the state a killed or earlier process had
                    _result(fresh.respond(past["messages"]) if isinstance(past, dict) else fresh.step(past))
                env = fresh  # whole, or made again at the next step
            if "batch" in request:
                reply = {"replies": asyncio.run(_batch(request["batch"], fns, env, max_chars, request["timeout_s"]))}
            elif "step" in request:
                reply = _step_reply(_result(env.step(request["step"])), max_chars)
            elif "respond" in request:
                reply = _step_reply(_result(env.respond(request["respond"])), max_chars, "respond")
            else:
                reply = _tool_reply(_result(fns[request["name"]](**request["arguments"])), max_chars)
        except Exception as e:
            reply = {"error": f"raised {type(e).__name__}: {str(e)[:300]}"}
        conn.sendall((json.dumps(reply) + "\n").encode())


async def _batch(requests: list[dict], fns: dict, env, max_chars: int, timeout_s: float) -> list[dict]:
    """The replies to one turn's calls, run at once, each within timeout_s: `async def` ones awaited together,
    the others on threads of their own; a sync environment's steps one at a time, in call order (one state)."""
    threads = ThreadPoolExecutor(len(requests))  # not the loop's: asyncio.run would wait for a hung call
    env_turn = asyncio.Lock()
    loop = asyncio.get_running_loop()

    async def one(request: dict) -> dict:
        step = "step" in request
        fn = env.step if step else fns[request["name"]]
        args, kwargs = ((request["step"],), {}) if step else ((), request["arguments"])
        if inspect.iscoroutinefunction(fn):
            value = await fn(*args, **kwargs)
        else:
            async with env_turn if step else contextlib.nullcontext():
                value = await _result_async(await loop.run_in_executor(threads, lambda: fn(*args, **kwargs)))
        return _step_reply(value, max_chars) if step else _tool_reply(value, max_chars)

    async def timed(request: dict) -> dict:
        try:
            return await asyncio.wait_for(one(request), timeout_s)
        except TimeoutError:
            return {"error": f"the tool timed out after {timeout_s:.3g}s", "timed_out": True}
        except Exception as e:
            return {"error": f"raised {type(e).__name__}: {str(e)[:300]}"}

    try:
        return await asyncio.gather(*(timed(r) for r in requests))
    finally:
        threads.shutdown(wait=False)


def _tool_reply(value, max_chars: int) -> dict:
    if isinstance(value, str):
        return {"text": value[:max_chars], "chars": len(value)}
    return {"error": f"returned {type(value).__name__}, not a string: {repr(value)[:100]}"}


def _step_reply(out, max_chars: int, method: str = "step") -> dict:
    if not (isinstance(out, tuple) and len(out) == 3 and isinstance(out[0], str)
            and isinstance(out[1], (int, float)) and math.isfinite(out[1]) and isinstance(out[2], bool)):
        return {"error": f"{method} returned {repr(out)[:100]}, not (observation: str, reward: float, done: bool)"}
    return {"text": out[0][:max_chars], "chars": len(out[0]), "reward": float(out[1]), "done": out[2]}


async def _result_async(value):
    """What a sync function returned, awaited if it returned an awaitable."""
    return await value if inspect.isawaitable(value) else value


def _result(value):
    """The value, or what it awaited (`async def`: run to its end in this process's own loop)."""
    return asyncio.run(_awaited(value)) if inspect.isawaitable(value) else value


def _die_with_parent() -> None:
    if sys.platform == "linux":  # even when a tool never returns
        ctypes.CDLL(None).prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)


async def _awaited(awaitable):
    return await awaitable


if __name__ == "__main__":
    main(int(sys.argv[1]), json.loads(sys.argv[2]), json.loads(sys.argv[3]), int(sys.argv[4]), int(sys.argv[5]))
