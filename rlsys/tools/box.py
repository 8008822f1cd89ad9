"""The tools of a run (`tools.fns`) and the one call a rollout makes: `ToolBox.run(call_text)`.

Where each tool runs, so that no call can stop the rollout worker that makes it:
- `calculator` runs in the calling thread: its guards (rlsys/tools/calculator.py) bound every call.
- `python` runs the model's code in the code reward's sandbox (rlsys/reward/sandbox.py: namespaces, rlimits,
  a user without rights), a fresh process per call killed at `tools.timeout_s`; what it printed is the answer.
- the user's tools run in child processes (rlsys/tools/user_child.py) of at most `tools.memory_mb`, one per
  conversation, forked from a server that imported them once: what a tool keeps in its globals is that
  conversation's alone, and goes when the conversation ends (`release`). A call past `tools.timeout_s` is
  abandoned by killing its process, which is forked again for the next call; a tool that crashes its process (a
  segfault, os._exit) is a failed call, not a dead worker.
`tools.timeout_s` bounds a call from when it was made (`made_at`): time queued behind busy tool threads counts.
A turn's several calls (tools.max_calls_per_turn) run at once, each within that limit (`run_turn`).
`run` never raises: a malformed call, an unknown tool, an exception, a timeout, a crash, or an answer that is
not a string is a failed ToolResult whose text (`error: ...`) is the tool's answer to the model; the caller
keeps or drops the sample by `tools.on_failure`. Answers over `tools.max_response_chars` are cut with a
marker. A ToolBox pickles as its config and is built again where it lands (a rollout worker), importing the
user's tools there as rlsys/startup.py did.
"""
from __future__ import annotations

import json
import logging
import os
import select
import signal
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from rlsys.config import ToolsConfig
from rlsys.plugins import PluginError, is_spec, load_function
from rlsys.registry import Registry
from rlsys.tools.calculator import CalculatorError, calculator
from rlsys.tools.format import DEFAULT, ToolCallError, ToolFormat
from rlsys.tools.schemas import env_schemas
from rlsys.types import ToolTurn

START_TIMEOUT_S = 60.0  # for a user tools' process to import them, beyond a call's own limit
BATCH_GRACE_S = 0.5  # a process running several calls, each within its limit, replies this much later at most
log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ToolResult:
    name: str  # the tool called, "" when the call could not be read
    text: str  # the answer appended to the conversation: the tool's, or "error: ..." when it failed
    ok: bool
    error: str | None
    elapsed_s: float
    reward: float = 0.0  # an environment's, for this turn
    done: bool = False  # the environment ended the conversation
    action: str | None = None  # an environment's step that it answered: the action, replayed to rebuild it

    @property
    def turn(self) -> ToolTurn:
        """What the conversation's sample records of this call."""
        return ToolTurn(self.name, self.ok, self.error, self.elapsed_s, self.reward, action=self.action,
                        answer=self.text)


RESPOND = "respond"  # the name of an environment's answers to turns without a call (ToolTurn.name)


def conversation_messages(prompt: str, model_turns: list[str], turns: list[ToolTurn]) -> list[dict]:
    """The conversation as chat messages, what an environment's `respond` sees: the prompt as the user's, then each
    model turn's text (`model_turns`, the last the turn being answered) as the assistant's, each followed by the
    answers its calls got (role "tool") or its environment's answer (role "user")."""
    messages, group = [{"role": "user", "content": prompt}], -1
    for t in turns:
        if t.call == 0:
            group += 1
            messages.append({"role": "assistant", "content": model_turns[group] if group < len(model_turns) else ""})
        messages.append({"role": "user" if t.name == RESPOND else "tool", "content": t.answer or ""})
    if group + 1 < len(model_turns):
        messages.append({"role": "assistant", "content": model_turns[group + 1]})
    return messages


def replay_of(turns: list[ToolTurn], messages: list[dict] | None) -> list:
    """What a new instance of the environment is given before the step asked for (user_env): each answered step's
    action, and for each turn its `respond` answered, the messages it saw then ({"messages"})."""
    assistant_at = [i for i, m in enumerate(messages or ()) if m["role"] == "assistant"]
    replay, group = [], -1
    for t in turns:
        group += t.call == 0
        if t.action is not None:
            replay.append(t.action)
        elif t.name == RESPOND and t.ok and group < len(assistant_at):
            replay.append({"messages": messages[:assistant_at[group] + 1]})
    return replay


def _action(request) -> str | None:
    """An environment step's action (None for a tool's call)."""
    return request.get("step") if isinstance(request, dict) else None


class ToolFailure(Exception):
    """A call that produced no answer; the message says why."""


def _checked(reply: dict) -> dict:
    """A reply of the user's process: itself, or its {"error"} raised as the ToolFailure."""
    if "error" in reply:
        raise ToolFailure(reply["error"])
    return reply


def truncated(text: str, chars: int, limit: int) -> str:
    """`text` (the first of `chars` characters) cut to `limit`, the marker saying how many went."""
    if chars <= limit:
        return text
    marker = f"...[{chars - limit} more characters cut]"
    return text[:max(0, limit - len(marker))] + marker


# Built-in tools: a name, and how to call it with the model's arguments in the box within the seconds left,
# giving (the answer, or its first characters, and its length).
BUILTINS: Registry[Callable[["ToolBox", dict, float], tuple[str, int]]] = Registry("tool")


@BUILTINS.register("calculator")
def _calculator(box: "ToolBox", arguments: dict, timeout_s: float) -> tuple[str, int]:
    try:
        answer = calculator(**arguments)
    except CalculatorError as e:
        raise ToolFailure(str(e)) from None
    return answer, len(answer)


@BUILTINS.register("python")
def _python(box: "ToolBox", arguments: dict, timeout_s: float) -> tuple[str, int]:
    code = arguments.get("code")
    if not isinstance(code, str) or set(arguments) != {"code"}:
        raise ToolFailure('python takes one argument, "code" (a string)')
    result = box.sandbox.run_script(code, timeout_s, box.cfg.max_response_chars)
    if result.output is None:
        raise ToolFailure(f"the code did not finish: {result.reason}")
    return result.output, result.chars


def user_tools(cfg: ToolsConfig) -> dict[str, str]:
    """{tool name: spec} of the user's tools in `tools.fns`, each imported once here to check it (file specs
    made absolute, so a process started elsewhere finds them); a PluginError naming the field otherwise."""
    specs = {}
    for spec in cfg.fns:
        if not is_spec(spec):
            BUILTINS.get(spec)  # UnknownName, with the choices
            continue
        fn = load_function(spec, "tools.fns")
        name = getattr(fn, "__name__", spec.rpartition(":")[2])
        if name in BUILTINS or name in specs:
            raise PluginError(f"tools.fns: {spec!r} is called {name!r}, as another tool is; rename one")
        specs[name] = _absolute(spec)
    return specs


def _absolute(spec: str) -> str:
    """A spec a process started elsewhere finds: a file's path made absolute."""
    module, _, attr = spec.rpartition(":")
    return f"{Path(module).resolve()}:{attr}" if module.endswith(".py") else spec


def user_env(cfg: ToolsConfig) -> str | None:
    """The spec of the user's environment class (`tools.env`), imported once here to check it has reset(sample)
    and step(action) or respond(messages); a PluginError naming the field otherwise. The interface, one instance
    per conversation:
    `reset(sample)` before its first step, `sample` being rlsys.types.env_sample of the prompt: {"prompt": its
    text, "answer": its reference answer, "data_source", "uid", "extra_info": the dataset row's} (a request made
    without one gives {"prompt": text} alone); `step(action) -> (observation: str, reward: float, done: bool)`
    with the text between the call tags; `respond(messages) -> (text, reward, done)`, if it has one, answers each
    model turn that ends without a call, as the user (verifiers' env_response, veRL's interaction): `messages` are
    the conversation so far ({"role", "content"}: the prompt's text as the user's, the model's turns, the answers,
    `conversation_messages`), the last the model's turn; `done` ends the conversation there. Any may be `async
    def`. With tools.fns the tools answer the calls and the environment (which then needs respond) the other
    turns. Its class's `tools`, if it has one, are the tools shown the model through the chat template
    (data.chat_template; rlsys/tools/schemas.py env_schemas), beside those of tools.fns.

    An environment's state survives its process: a step past tools.timeout_s kills the process, and a conversation
    cut and resumed (sorted's partial mode, async, eval's pause, a scale-down) continues in a new one, perhaps on
    another worker. Its state is rebuilt by replay, not carried: a new instance is reset with the same sample, then
    stepped with every action the environment answered before and given every messages its respond answered, in
    order (ToolTurn.action and .answer, which travel with the conversation's turns through every cut:
    `replay_of`), before the step asked for. Replay, because an instance's state is
    whatever the user's objects hold (clients, processes, generators) and need not pickle, and a step that timed out
    leaves it unknown in a killed process: the answered actions are the one record every cut keeps. So reset and
    step must give the same answers for the same sample and actions (seed any randomness from the sample, its
    "uid" say); a step that failed (timed out, raised, crashed its process) is not replayed, the model having been
    told it failed; the replay runs within the call's time limit."""
    if cfg.env is None:
        return None
    cls = load_function(cfg.env, "tools.env")
    has = {m for m in ("reset", "step", "respond") if callable(getattr(cls, m, None))}
    if "reset" not in has or not has & {"step", "respond"}:
        raise PluginError(f"tools.env: {cfg.env!r} has no method {'reset' if 'reset' not in has else 'step or respond'}; "
                          "an environment has reset(sample), and step(action) -> (observation, reward, done) to "
                          "answer calls or respond(messages) -> (text, reward, done) to answer the other turns")
    if cfg.fns and "respond" not in has:
        raise PluginError(f"tools.env: {cfg.env!r} has no respond(messages): with tools.fns the tools answer the "
                          "calls, so the environment answers the turns without one; give it respond, or leave "
                          "tools.fns empty for its step to answer the calls")
    env_schemas(cls, cfg.env)  # the tools it shows the model, if it declares some: a malformed list fails here
    return _absolute(cfg.env)


class ToolBox:
    def __init__(self, cfg: ToolsConfig, fmt: ToolFormat = DEFAULT):
        self.cfg, self.fmt = cfg, fmt
        self.user_specs = user_tools(cfg)
        self.env_spec = user_env(cfg)
        self.env_steps = bool(self.env_spec) and not cfg.fns  # the environment answers the calls
        env_class = load_function(cfg.env, "tools.env") if cfg.env else None
        self.env_responds = callable(getattr(env_class, RESPOND, None))  # and the turns without one
        self.names = [n for n in cfg.fns if not is_spec(n)] + list(self.user_specs)
        self._server = (_ToolServer(self.user_specs, self.env_spec, cfg.max_response_chars, cfg.memory_mb)
                        if self.user_specs or self.env_spec else None)
        self._processes: dict[str, _UserToolProcess] = {}  # conversation -> its process of the user's tools
        self._lock = threading.Lock()
        self.sandbox = self._build_sandbox() if "python" in self.names else None
        self.counts = {"calls": 0, "failed": 0, "timed_out": 0, "truncated": 0}

    @classmethod
    def from_config(cls, cfg: ToolsConfig, fmt: ToolFormat = DEFAULT) -> "ToolBox":
        """The tools of `cfg`, each checked (an unknown name or a user tool that does not import fails here,
        naming tools.fns)."""
        return cls(cfg, fmt)

    def __reduce__(self):
        return ToolBox, (self.cfg, self.fmt)

    def _build_sandbox(self):
        """The python tool's sandbox; it probes the machine's namespaces once, and refuses to run without them
        unless tools.sandbox.allow_unsandboxed."""
        from rlsys.reward.sandbox import Sandbox  # imports the reward pool and Ray: only when the tool is used
        return Sandbox(self.cfg.sandbox, field="tools.sandbox")

    def run(self, call_text: str, conversation: str | None = None, made_at: float | None = None,
            sample: dict | None = None, turns: list[ToolTurn] = (), messages: list[dict] | None = None) -> ToolResult:
        """Run the call the model wrote (from the opening tag to the closing one) in `conversation` (None: a
        conversation of this one call): a tool's, or with tools.env a step of the conversation's environment
        (in a new process, reset first with `sample` and replayed to the conversation's `turns` so far, whose
        `messages` (conversation_messages) its respond saw: user_env).
        Blocks until about tools.timeout_s after `made_at` (time.monotonic(); by default now); never raises."""
        start = time.monotonic()
        made_at = start if made_at is None else made_at
        return self._answer(*self._read(call_text, sample, turns, messages), conversation, start, made_at)

    def respond(self, messages: list[dict], conversation: str | None = None, made_at: float | None = None,
                sample: dict | None = None, turns: list[ToolTurn] = ()) -> ToolResult:
        """The environment's answer to a model turn without a call, the last of `messages`: its respond(messages),
        in the conversation's process, as `run` runs a step (name RESPOND). Never raises."""
        start = time.monotonic()
        made_at = start if made_at is None else made_at
        request = {RESPOND: messages, "sample": sample or {}, "replay": replay_of(turns, messages)}
        return self._answer(RESPOND, request, conversation, start, made_at)

    def run_turn(self, turn_text: str, conversation: str | None = None, made_at: float | None = None,
                 sample: dict | None = None, turns: list[ToolTurn] = (),
                 messages: list[dict] | None = None) -> list[ToolResult]:
        """The answers to the calls of one model turn (ToolFormat.split_calls, the first tools.max_calls_per_turn),
        in call order. Several run at once, each within tools.timeout_s of `made_at`: each built-in tool on a
        thread of its own, the user's tools and environment steps together in the conversation's process
        (user_child.py). Never raises."""
        calls = self.fmt.split_calls(turn_text)[:self.cfg.max_calls_per_turn]
        if len(calls) == 1:
            return [self.run(calls[0], conversation, made_at, sample, turns, messages)]
        start = time.monotonic()
        made_at = start if made_at is None else made_at
        read = [self._read(call, sample, turns, messages) for call in calls]
        results: list[ToolResult | None] = [None] * len(calls)
        batched = [i for i, (name, request) in enumerate(read) if self._in_child(name, request)]

        def run_one(i: int) -> None:
            results[i] = self._answer(*read[i], conversation, start, made_at)
        threads = [threading.Thread(target=run_one, args=(i,), name="tool-call") for i in range(len(calls))
                   if i not in batched]
        for t in threads:
            t.start()
        if batched:
            replies = self._batch(conversation, [read[i][1] for i in batched], start, made_at)
            for i, reply in zip(batched, replies):
                results[i] = self._result(read[i][0], start, lambda reply=reply: _checked(reply), _action(read[i][1]))
        for t in threads:
            t.join()
        return results

    def _read(self, call_text: str, sample: dict | None, turns: list[ToolTurn] = (),
              messages: list[dict] | None = None) -> tuple[str, dict | ToolCallError]:
        """(the tool's name, the request for it) of a call the model wrote: a step of the environment with the
        call's text between the tags as its action (and what a new instance replays first: the actions answered
        in `turns`), or a tool's name and arguments; the request is the ToolCallError when the call cannot be
        read."""
        if self.env_steps:
            action = call_text.strip().removeprefix(self.fmt.call_open).removesuffix(self.fmt.call_close).strip()
            return "env", {"step": action, "sample": sample or {}, "replay": replay_of(turns, messages)}
        try:
            call = self.fmt.parse_call(call_text)
        except ToolCallError as e:
            return "", e
        return call.name, {"name": call.name, "arguments": call.arguments}

    def _answer(self, name: str, request, conversation: str | None, start: float, made_at: float) -> ToolResult:
        """The ToolResult of one read call, run within what is left of tools.timeout_s after `made_at`."""
        return self._result(name, start, lambda: self._do(name, request, conversation, self._time_left(start, made_at)),
                            _action(request))

    def _in_child(self, name: str, request) -> bool:
        """Whether the request runs in the conversation's process of the user's code."""
        return isinstance(request, dict) and ("step" in request or RESPOND in request or name in self.user_specs)

    def _do(self, name: str, request, conversation: str | None, timeout_s: float) -> dict:
        """The reply to one request, {"text", "chars"} (and a step's "reward", "done"); raises what failed."""
        if isinstance(request, ToolCallError):
            raise request
        if self._in_child(name, request):
            return self._in_process(conversation, request, timeout_s)
        if name not in self.names:
            raise ToolFailure(f"no tool {name!r}; the tools are: {', '.join(self.names)}")
        text, chars = BUILTINS.get(name)(self, request["arguments"], timeout_s)
        return {"text": text, "chars": chars}

    def _batch(self, conversation: str | None, requests: list[dict], start: float, made_at: float) -> list[dict]:
        """The replies of the conversation's process to several requests run there at once, each within what is
        left of tools.timeout_s (the process's reply awaited a grace beyond); every request's ToolFailure reply
        ({"error"}) if the process gives none. A process left running a call past its limit is killed after."""
        try:
            timeout_s = self._time_left(start, made_at)
            reply = self._in_process(conversation, {"batch": requests, "timeout_s": timeout_s},
                                     timeout_s + BATCH_GRACE_S)
        except ToolFailure as e:
            return [{"error": str(e)}] * len(requests)
        if conversation is not None and any(r.get("timed_out") for r in reply["replies"]):
            self.release(conversation)
        return reply["replies"]

    def _result(self, name: str, start: float, reply: Callable[[], dict], action: str | None = None) -> ToolResult:
        """The ToolResult of a call answered by `reply()`: its text cut to tools.max_response_chars, or the
        failure's reason as the answer; an environment's answered step records its `action`."""
        try:
            r = reply()
            text = r["text"]
            if r["chars"] > self.cfg.max_response_chars:
                text = truncated(text, r["chars"], self.cfg.max_response_chars)
                with self._lock:
                    self.counts["truncated"] += 1
            result = ToolResult(name, text, True, None, time.monotonic() - start, r.get("reward", 0.0),
                                r.get("done", False), action)
        except ToolCallError as e:
            result = self._failed(name, f"the call cannot be read: {e.reason}", start)
        except ToolFailure as e:
            result = self._failed(name, str(e), start)
        except Exception as e:  # a built-in refusing its arguments (CalculatorError, TypeError)
            result = self._failed(name, f"{type(e).__name__}: {e}", start)
        with self._lock:
            self.counts["calls"] += 1
        return result

    def _time_left(self, start: float, made_at: float) -> float:
        """What is left of the call's tools.timeout_s once it got a tool thread; ToolFailure if nothing."""
        left = self.cfg.timeout_s - (start - made_at)
        if left <= 0:
            raise ToolFailure(f"timed out after {self.cfg.timeout_s:g}s waiting for a free tool thread "
                              f"(tools.max_workers={self.cfg.max_workers})")
        return left

    def _in_process(self, conversation: str | None, request: dict, timeout_s: float) -> dict:
        """The reply of the conversation's process of the user's code to `request`."""
        with self._lock:
            child = self._processes.get(conversation) if conversation is not None else None
            if child is None:
                child = _UserToolProcess(self._server)
                if conversation is not None:
                    self._processes[conversation] = child
        try:
            return child.call(request, timeout_s, self.cfg.timeout_s)
        finally:
            if conversation is None:
                child.stop()

    def release(self, conversation: str) -> None:
        """The conversation ended: its process of the user's tools (and what they kept in it) goes."""
        with self._lock:
            child = self._processes.pop(conversation, None)
        if child is not None:
            child.stop()

    def _failed(self, name: str, error: str, start: float) -> ToolResult:
        with self._lock:
            self.counts["failed"] += 1
            self.counts["timed_out"] += "timed out" in error
            n = self.counts["failed"]
        if n <= 10 or n % 100 == 0:
            log.warning("tool call %d failed (%s): %s", n, name or "unreadable", error)
        return ToolResult(name, f"error: {error}", False, error, time.monotonic() - start)

    def close(self) -> None:
        """End the user tools' processes (they also die with this process)."""
        with self._lock:
            children, self._processes = list(self._processes.values()), {}
        for child in children:
            child.stop()
        if self._server is not None:
            self._server.stop()


class _ToolServer:
    """The fork server of the user's tools (rlsys/tools/user_child.py), started on first use and again if it dies."""

    def __init__(self, specs: dict[str, str], env: str | None, max_chars: int, memory_mb: int):
        self.args = [json.dumps(specs), json.dumps(env), str(max_chars), str(memory_mb)]
        self.proc: subprocess.Popen | None = None
        self.control: socket.socket | None = None
        self.lock = threading.Lock()

    def fork(self) -> tuple[socket.socket, int]:
        """A new process of the tools: (the socket to talk to it, its pid)."""
        with self.lock:
            if self.proc is None or self.proc.poll() is not None:
                self._start()
            mine, theirs = socket.socketpair()
            try:
                socket.send_fds(self.control, [b'{"fork": true}'], [theirs.fileno()])
                return mine, self._reply()["pid"]
            finally:
                theirs.close()

    def reap(self, pid: int) -> int | None:
        """The exit code of a process that died or was killed (None if the server is gone)."""
        with self.lock:
            if self.proc is None or self.proc.poll() is not None:
                return None
            self.control.send(json.dumps({"reap": pid}).encode())
            return self._reply()["status"]

    def _start(self) -> None:
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(p or os.getcwd() for p in sys.path)}
        self.control, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        self.proc = subprocess.Popen([sys.executable, "-m", "rlsys.tools.user_child", str(theirs.fileno()), *self.args],
                                     pass_fds=[theirs.fileno()], env=env, start_new_session=True)
        theirs.close()
        reply = self._reply()
        if "error" in reply:
            self.stop()
            raise ToolFailure(reply["error"])

    def _reply(self) -> dict:
        if not select.select([self.control], [], [], START_TIMEOUT_S)[0]:
            self.stop()
            raise ToolFailure(f"the user tools' server did not answer in {START_TIMEOUT_S:g}s (it was killed)")
        data = self.control.recv(1 << 16)
        if not data:
            self.stop()
            raise ToolFailure("the user tools' server died")
        return json.loads(data)

    def stop(self) -> None:
        """Kill the server and every process it forked (one process group)."""
        if self.proc is not None:
            try:
                os.killpg(self.proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            self.proc.wait()
            self.proc = None
            self.control.close()


class _UserToolProcess:
    """One conversation's process of the user's tools, forked on first use and again after a timeout or a crash."""

    def __init__(self, server: _ToolServer):
        self.server = server
        self.conn: socket.socket | None = None
        self.pid = 0
        self.buffer = b""

    def call(self, request: dict, timeout_s: float, limit_s: float) -> dict:
        """The reply to `request` (a tool's: the answer's first max_chars characters, its length), within
        `timeout_s`: what is left of the call's `limit_s` after it queued for a tool thread."""
        if self.conn is None:
            self.conn, self.pid = self.server.fork()
            self.buffer = b""
        try:
            self.conn.sendall((json.dumps(request) + "\n").encode())
        except OSError:  # it died between two calls
            raise ToolFailure(self._died()) from None
        reply = self._reply(timeout_s, limit_s)
        if "error" in reply:
            raise ToolFailure(reply["error"])
        return reply

    def _reply(self, timeout_s: float, limit_s: float) -> dict:
        """The next line the process writes, parsed; ToolFailure if it takes over `timeout_s` or dies."""
        deadline = time.monotonic() + timeout_s
        while b"\n" not in self.buffer:
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([self.conn], [], [], left)[0]:
                self.stop()
                queued = limit_s - timeout_s
                queued = f", {queued:.1f}s of it queued for a tool thread" if queued > 0.05 else ""
                raise ToolFailure(f"the tool timed out after {limit_s:g}s{queued} (its process was killed)")
            chunk = self.conn.recv(1 << 16)
            if not chunk:
                raise ToolFailure(self._died())
            self.buffer += chunk
        line, _, self.buffer = self.buffer.partition(b"\n")
        return json.loads(line)

    def _died(self) -> str:
        rc = self.server.reap(self.pid)
        self._close()
        how = "" if rc is None else f" (signal {signal.Signals(-rc).name})" if rc < 0 else f" (exit status {rc})"
        return f"the tool's process died{how}"

    def stop(self) -> None:
        if self.conn is not None:
            try:
                os.kill(self.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            try:
                self.server.reap(self.pid)
            except ToolFailure:  # the server went with it: nothing left to reap
                pass
            self._close()

    def _close(self) -> None:
        self.conn.close()
        self.conn = None
