"""Tools the model calls during a rollout: the call format (format.py), the built-ins (calculator.py, and
python in the code reward's sandbox) and the runtime that runs any call safely (box.py)."""
from rlsys.tools.box import ToolBox, ToolResult
from rlsys.tools.format import (CALL_CLOSE, CALL_OPEN, RESPONSE_CLOSE, RESPONSE_OPEN, ToolCall, ToolCallError,
                                ToolFormat, parse_call, render_response)

__all__ = ["CALL_CLOSE", "CALL_OPEN", "RESPONSE_CLOSE", "RESPONSE_OPEN", "ToolBox", "ToolCall", "ToolCallError",
           "ToolFormat", "ToolResult", "parse_call", "render_response"]
