"""A tiny wall-clock step profiler: where does an engine step spend its time?

Enabled by the environment variable `VLITE_PROFILE=1` (read at import) or `enable()`; the `vlite
bench` commands' `--profile` flag does both. The engine wraps each phase of a step in
`section(name)`:

    with profiler.section("schedule"):
        scheduler_output = self.scheduler.schedule()

Disabled, `section()` returns one shared do-nothing context manager (a global lookup and a
function call, well under a microsecond). Enabled, it records the wall time of the block.

Sections nest: time spent in a section inside another ("attention" inside "forward") is counted
for the inner one only, so the table's rows are exclusive times that add up to the time spent
inside top-level sections. Time outside every section (the Python glue between phases) is not
counted; `format_summary(wall_s=...)` shows how much of a measured wall time the rows cover.

Wall time is exact on CPU, where torch runs operations synchronously. On an accelerator, kernels
run asynchronously and a section would need a device synchronize to be meaningful.

Single-threaded by design (the engine step runs on one thread).
"""

from __future__ import annotations

import atexit
import os
import sys
from time import perf_counter
from typing import Any, Optional

ENV_VAR = "VLITE_PROFILE"

# Phases in step order, with the labels the summary table prints. Unknown names are appended.
PHASES: dict[str, str] = {
    "schedule": "scheduling (Scheduler.schedule)",
    "prepare_inputs": "input preparation (_update_states + _prepare_inputs)",
    "attention": "model: attention (paged_attention)",
    "forward": "model: rest of forward (matmuls, norms, rope, logits)",
    "sample": "sampling (sample_tokens)",
    "update_from_output": "update_from_output",
    "output_processing": "output processing (detokenize, RequestOutput)",
}
# The section entered once per engine step that does work: its call count is the step count.
STEP_SECTION = "schedule"


def _env_enabled() -> bool:
    return os.environ.get(ENV_VAR, "").strip().lower() in ("1", "true", "yes", "on")


_enabled = _env_enabled()
# name -> [exclusive seconds, calls]
_totals: dict[str, list] = {}
_stack: list[_Section] = []


class _NullSection:
    __slots__ = ()

    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: Any) -> None:
        return None


_NULL = _NullSection()


class _Section:
    __slots__ = ("name", "start", "child")

    def __init__(self, name: str) -> None:
        self.name = name
        self.child = 0.0
        self.start = 0.0

    def __enter__(self) -> None:
        _stack.append(self)
        self.start = perf_counter()

    def __exit__(self, *exc: Any) -> None:
        elapsed = perf_counter() - self.start
        _stack.pop()
        record = _totals.get(self.name)
        if record is None:
            record = _totals[self.name] = [0.0, 0]
        record[0] += elapsed - self.child
        record[1] += 1
        if _stack:
            _stack[-1].child += elapsed


def section(name: str) -> Any:
    """A context manager timing its block under `name` (a no-op while disabled)."""
    if not _enabled:
        return _NULL
    return _Section(name)


def is_enabled() -> bool:
    return _enabled


def enable(on: bool = True) -> None:
    global _enabled
    _enabled = on


def reset() -> None:
    """Forget everything recorded so far (e.g. after a warmup)."""
    _totals.clear()


def summary() -> dict[str, dict[str, float]]:
    """name -> {"seconds": exclusive wall time, "calls": times entered}, in PHASES order."""
    names = [n for n in PHASES if n in _totals] + [n for n in _totals if n not in PHASES]
    return {n: {"seconds": _totals[n][0], "calls": _totals[n][1]} for n in names}


def num_steps() -> int:
    record = _totals.get(STEP_SECTION)
    return record[1] if record else 0


def format_summary(wall_s: Optional[float] = None) -> str:
    """The summary as a table: total ms, % of the profiled total, ms per step, per phase."""
    data = summary()
    total = sum(d["seconds"] for d in data.values())
    steps = num_steps()
    width = max([len(PHASES.get(n, n)) for n in data] + [len("phase")])
    lines = [f"{'phase':<{width}}  {'total ms':>10}  {'%':>6}  {'ms/step':>8}  {'calls':>7}"]
    for name, d in data.items():
        pct = 100.0 * d["seconds"] / total if total else 0.0
        per_step = 1e3 * d["seconds"] / steps if steps else 0.0
        lines.append(f"{PHASES.get(name, name):<{width}}  {1e3 * d['seconds']:>10.1f}  {pct:>6.1f}  "
                     f"{per_step:>8.3f}  {int(d['calls']):>7}")
    lines.append(f"{'total (profiled)':<{width}}  {1e3 * total:>10.1f}  {100.0 if total else 0.0:>6.1f}  "
                 f"{1e3 * total / steps if steps else 0.0:>8.3f}")
    lines.append(f"engine steps: {steps}")
    if wall_s:
        lines.append(f"wall time: {1e3 * wall_s:.1f} ms; the sections cover {100.0 * total / wall_s:.1f}% of it")
    return "\n".join(lines)


def print_summary(file: Any = None, wall_s: Optional[float] = None, title: str = "vlite step profile") -> None:
    """Print the table (if anything was recorded) and reset, so the exit hook does not print it again."""
    if not _totals:
        return
    out = file if file is not None else sys.stdout
    print(f"\n---- {title} ----", file=out)
    print(format_summary(wall_s), file=out, flush=True)
    reset()


@atexit.register
def _print_at_exit() -> None:
    # Whatever ran with the profiler on and did not print its own summary (e.g. `vlite generate`).
    if _enabled and _totals:
        print_summary(file=sys.stderr)
