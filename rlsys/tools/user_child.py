"""The process that runs the user's tools, started by rlsys/tools/box.py as `python -m rlsys.tools.user_child`.

Its address space is limited to `tools.memory_mb` before the tools are imported, so a tool that allocates
without bound fails its call (MemoryError) instead of taking the machine's memory from the rollout worker.
A tool may be a function or an `async def` one. One request per line on stdin, {"name", "arguments"}; one reply per line on the stdout it was started with,
{"text", "chars"} or {"error"}. The tools' own prints go to stderr, so they cannot corrupt a reply. A reply's
text is cut to the size limit here, so a flood never crosses the pipe. The first line is {"ready": true}
once every tool is imported (or {"error"} if one fails).
"""
import asyncio
import ctypes
import inspect
import json
import os
import resource
import signal
import sys

from rlsys.plugins import load_function

PR_SET_PDEATHSIG = 1


def serve(specs: dict[str, str], max_chars: int, memory_mb: int) -> None:
    resource.setrlimit(resource.RLIMIT_AS, (memory_mb << 20, memory_mb << 20))
    out = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)
    if sys.platform == "linux":  # die with the rollout worker, even when a tool never returns
        ctypes.CDLL(None).prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    try:
        fns = {name: load_function(spec, "tools.fns") for name, spec in specs.items()}
        reply = {"ready": True}
    except Exception as e:
        fns, reply = {}, {"error": f"importing the tools raised {type(e).__name__}: {e}"}
    out.write(json.dumps(reply) + "\n")
    out.flush()
    for line in sys.stdin:
        request = json.loads(line)
        try:
            value = fns[request["name"]](**request["arguments"])
            if inspect.isawaitable(value):  # an `async def` tool: run to its answer in this process's own loop
                value = asyncio.run(_awaited(value))
            if isinstance(value, str):
                reply = {"text": value[:max_chars], "chars": len(value)}
            else:
                reply = {"error": f"returned {type(value).__name__}, not a string: {repr(value)[:100]}"}
        except Exception as e:
            reply = {"error": f"raised {type(e).__name__}: {str(e)[:300]}"}
        out.write(json.dumps(reply) + "\n")
        out.flush()


async def _awaited(awaitable):
    return await awaitable


if __name__ == "__main__":
    serve(json.loads(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]))
