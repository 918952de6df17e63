"""Built-in tools.

* `python`: runs the model's program in the code sandbox
  (`rlflow.sandbox`: no network, its own processes and scratch
  space, limits on time, CPU and memory) and returns what it printed, its
  errors, and how it ended when that was not well.
"""

from __future__ import annotations

from rlflow.sandbox import Limits, Status, run_python

#: Characters of a program's output shown to the model, at most (the end is cut).
OUTPUT_CHARS = 4000


def python(code: str, *, timeout_s: float = 10.0, memory_bytes: int = 512 << 20, network: bool = False) -> str:
    """What the program `code` prints, run in the sandbox (keyword arguments: its limits, set in the config)."""
    result = run_python(code, limits=Limits(timeout_s=timeout_s, cpu_s=timeout_s, memory_bytes=memory_bytes,
                                            network=network))
    out = result.stdout
    if result.stderr:
        out += ("\n" if out and not out.endswith("\n") else "") + result.stderr
    if result.status is not Status.OK:
        out += ("\n" if out and not out.endswith("\n") else "") + f"[{_ENDED[result.status]}]"
    return out[:OUTPUT_CHARS] + ("\n[output cut]" if len(out) > OUTPUT_CHARS else "") if out else "[no output]"


_ENDED = {
    Status.ERROR: "the program exited with an error",
    Status.CRASHED: "the program crashed",
    Status.TIMEOUT: "the program ran out of time and was stopped",
    Status.CPU_LIMIT: "the program ran out of CPU time and was stopped",
    Status.MEMORY_LIMIT: "the program ran out of memory",
    Status.OUTPUT_LIMIT: "the program wrote too much and was stopped",
}

# The schema the model sees (`rlflow.env.core.tool_schema` reads a tool's `schema` attribute).
setattr(python, "schema", {
    "type": "function",
    "function": {
        "name": "python",
        "description": "Run a Python program (the standard library only, no network) and return what it prints.",
        "parameters": {
            "type": "object",
            "properties": {"code": {"type": "string", "description": "The program; print what you want to see."}},
            "required": ["code"],
        },
    },
})
