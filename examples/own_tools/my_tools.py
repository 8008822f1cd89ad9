"""A tool of your own: tools.fns=[calculator, examples/own_tools/my_tools.py:convert].

The model calls it by the function's name with JSON arguments, which arrive as keyword arguments:
<tool_call>{"name": "convert", "arguments": {"value": 3, "unit": "mile", "to": "km"}}</tool_call>
It returns the answer as a string; an exception is a failed call whose message the model reads.
"""

TO_METRES = {"m": 1.0, "km": 1000.0, "cm": 0.01, "mile": 1609.344, "ft": 0.3048, "inch": 0.0254}


def convert(value: float, unit: str, to: str) -> str:
    """Convert a length between units (m, km, cm, mile, ft, inch)."""
    for name in (unit, to):
        if name not in TO_METRES:
            raise ValueError(f"unknown unit {name!r}; the units: {', '.join(TO_METRES)}")
    return f"{float(value) * TO_METRES[unit] / TO_METRES[to]:.6g} {to}"
