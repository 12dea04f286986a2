"""Pipeline timeline pictures: measured (``roundpipe timeline``) and predicted
(``roundpipe plan --timeline``), drawn the same way so they compare side by side.

One lane per worker plus one for the CPU optimizer and, for a node of a data-parallel
group, one for the network: its collectives with the other nodes, the hatched part being
the wait for the slowest node to arrive. A task is a box from its start to
its end, coloured by kind (forward blue, tail purple, backward orange) and labelled with
its stage (``F0``, ``T``, ``B1``; ``3:`` prefixes the step when several are drawn). The
hatched part at the box's left is the share of the task that was not compute (waiting
for weights or inputs, transfers: the worker reports how long, not exactly when). White
between boxes is idle time: the bubbles. The optimizer lane shows each layer's (measured)
or stage's (predicted) update. The title carries the bubble fraction.

matplotlib draws with the Agg backend: no display is needed.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

__all__ = ["Box", "draw_timeline", "boxes_from_simulation", "boxes_from_trace", "parse_steps"]

COLOURS = {
    "forward": "#4C72B0",
    "tail": "#8172B3",
    "backward": "#DD8452",
    "optimizer": "#7F7F7F",
    "collective": "#55A868",
}
OPTIMIZER_LANE = "optimizer"
NETWORK_LANE = "network"


@dataclass(frozen=True)
class Box:
    """One drawn interval: a task on a worker lane or an update on the optimizer lane."""

    lane: str
    start: float
    end: float
    kind: str
    """``forward``, ``tail``, ``backward``, ``optimizer`` or ``collective``."""
    label: str
    busy_s: float | None = None
    """Compute seconds inside the box (None: all of it)."""


def parse_steps(text: str) -> tuple[int, int]:
    """``"A:B"`` -> (A, B), inclusive; ``"A"`` -> (A, A). Raises ValueError."""
    parts = text.split(":")
    try:
        if len(parts) == 1:
            a = b = int(parts[0])
        elif len(parts) == 2:
            a, b = int(parts[0]), int(parts[1])
        else:
            raise ValueError
    except ValueError:
        raise ValueError(f"--steps {text!r}: expected A:B (inclusive step numbers) or A") from None
    if a < 1 or b < a:
        raise ValueError(f"--steps {text!r}: expected 1 <= A <= B")
    return a, b


def boxes_from_trace(tasks: Sequence[dict], *, multi_step: bool) -> list[Box]:
    """Boxes of the ``ph: X`` events ``coordinator.timeline.read_trace`` returns."""
    from roundpipe.coordinator.training.timeline import NETWORK_TID, OPTIMIZER_TID

    boxes = []
    for e in tasks:
        start = e["ts"] / 1e6
        end = start + e.get("dur", 0.0) / 1e6
        args = e.get("args", {})
        step = args.get("step")
        if e.get("tid") == OPTIMIZER_TID:
            boxes.append(Box(OPTIMIZER_LANE, start, end, "optimizer", str(step)))
            continue
        if e.get("tid") == NETWORK_TID:  # busy: after every node had arrived
            moving = max(0.0, (end - start) - args.get("wait_s", 0.0))
            boxes.append(Box(NETWORK_LANE, start, end, "collective", e["name"], moving))
            continue
        label = f"{step}:{e['name']}" if multi_step else e["name"]
        boxes.append(
            Box(
                f"worker {args.get('worker', e['tid'] - 1)}",
                start,
                end,
                e.get("cat", "forward"),
                label,
                args.get("compute_s"),
            )
        )
    return boxes


def boxes_from_simulation(sim, iterations: Sequence[int] | None = None) -> list[Box]:
    """Boxes of a ``SimResult`` (one per task: its microbatches merged)."""
    kinds = {"F": "forward", "T": "tail", "B": "backward"}
    tasks: dict[tuple[int, int, int], list] = {}
    for e in sim.events:
        if e.what != "compute" or (iterations is not None and e.iteration not in iterations):
            continue
        tasks.setdefault((e.worker, e.iteration, e.stage), []).append(e)
    multi = iterations is None or len(iterations) > 1
    boxes = []
    for (worker, iteration, _stage), events in tasks.items():
        stage = events[0].label.split("m")[0]  # "F0m3" -> "F0"
        label = f"{iteration}:{stage}" if multi else stage
        busy = sum(e.end - e.start for e in events)
        boxes.append(
            Box(
                f"worker {worker}",
                min(e.start for e in events),
                max(e.end for e in events),
                kinds.get(stage[0], "forward"),
                label,
                busy,
            )
        )
    for e in getattr(sim, "optimizer_events", []):
        if iterations is None or e.iteration in iterations:
            boxes.append(Box(OPTIMIZER_LANE, e.start, e.end, "optimizer", f"{e.iteration}"))
    return boxes


def draw_timeline(
    boxes: Sequence[Box], path: str | Path, *, title: str, lanes: Sequence[str] | None = None
) -> Path:
    """Draw ``boxes`` as a PNG (or any format matplotlib infers from ``path``)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib import patheffects
    from matplotlib.patches import Patch

    if lanes is None:
        shared = (OPTIMIZER_LANE, NETWORK_LANE)
        workers = sorted(
            {b.lane for b in boxes if b.lane not in shared}, key=lambda s: int(s.split()[-1])
        )
        network = [NETWORK_LANE] if any(b.lane == NETWORK_LANE for b in boxes) else []
        lanes = [*workers, OPTIMIZER_LANE, *network]
    row = {lane: i for i, lane in enumerate(lanes)}
    t0 = min((b.start for b in boxes), default=0.0)
    t1 = max((b.end for b in boxes), default=1.0)
    span = max(t1 - t0, 1e-9)
    fig, ax = plt.subplots(figsize=(14, 1.0 + 0.7 * len(lanes)), dpi=110)
    height = 0.7
    for b in boxes:
        if b.lane not in row:
            continue
        y = row[b.lane]
        x, w = b.start - t0, max(b.end - b.start, span * 1e-4)
        colour = COLOURS.get(b.kind, "#55A868")
        ax.broken_barh(
            [(x, w)], (y - height / 2, height), facecolors=colour, edgecolor="white", linewidth=0.6
        )
        if b.busy_s is not None and b.end > b.start:
            idle = max(0.0, (b.end - b.start) - b.busy_s)
            if idle > 0:
                ax.broken_barh(
                    [(x, min(idle, w))],
                    (y - height / 2, height),
                    facecolors="white",
                    alpha=0.55,
                    hatch="///",
                    edgecolor=colour,
                    linewidth=0.0,
                )
        # A label only where it fits: ~0.8% of the axis per character.
        if w / span > 0.008 * (len(b.label) + 1):
            ax.text(
                x + w / 2,
                y,
                b.label,
                ha="center",
                va="center",
                fontsize=8,
                color="white",
                clip_on=True,
                # Outlined, so the label reads on the colour and on the hatching alike.
                path_effects=[patheffects.withStroke(linewidth=1.5, foreground="#222222")],
            )
    ax.set_yticks(range(len(lanes)))
    ax.set_yticklabels(lanes)
    ax.set_ylim(len(lanes) - 0.5, -0.5)
    ax.set_xlim(0, span)
    ax.set_xlabel("seconds")
    ax.grid(axis="x", linestyle=":", alpha=0.5)
    ax.set_title(title, fontsize=10)
    legend = [
        Patch(facecolor=COLOURS["forward"], label="forward"),
        Patch(facecolor=COLOURS["tail"], label="tail (fwd+loss+bwd)"),
        Patch(facecolor=COLOURS["backward"], label="backward"),
        Patch(facecolor=COLOURS["optimizer"], label="optimizer"),
        Patch(facecolor="white", edgecolor="#555555", hatch="///", label="not computing"),
    ]
    if NETWORK_LANE in row:
        legend.insert(4, Patch(facecolor=COLOURS["collective"], label="collective (hatched: wait)"))
    ax.legend(
        handles=legend, loc="center left", bbox_to_anchor=(1.005, 0.5), fontsize=8, frameon=False
    )
    fig.tight_layout()
    out = Path(path)
    fig.savefig(out)
    plt.close(fig)
    return out


# --------------------------------------------------------------------------- commands


def measured_title(job: str, steps: tuple[int, int], info: dict[int, dict]) -> str:
    """The measured picture's title: job, steps, mean measured bubble and throughput."""
    bubbles = [i["bubble_fraction"] for i in info.values() if "bubble_fraction" in i]
    rates = [i["tokens_per_s"] for i in info.values() if "tokens_per_s" in i]
    a, b = steps
    parts = [f"{job}: measured, step {a}" if a == b else f"{job}: measured, steps {a}-{b}"]
    if bubbles:
        parts.append(f"bubble fraction {100 * sum(bubbles) / len(bubbles):.1f}%")
    else:
        parts.append("bubble fraction not measured yet")
    if rates:
        parts.append(f"{sum(rates) / len(rates):,.0f} tokens/s")
    return " | ".join(parts)


def picture_path(out: Path) -> Path:
    """The file a picture asked for as ``out`` is written to: matplotlib adds ``.png``
    to a name without a suffix (``-o t`` wrote ``t.png``, and ``-o dir/`` wrote
    ``dir.png`` beside the directory, while the command named ``out``). ValueError for
    a directory."""
    out = Path(out)
    if out.is_dir():
        raise ValueError(
            f"{out} is a directory; name the picture's file, e.g. {out / 'timeline.png'}"
        )
    return out if out.suffix else out.with_name(out.name + ".png")


def draw_job_timeline(
    output_dir: Path, out: Path, *, job: str, steps: tuple[int, int] | None = None
) -> tuple[Path, tuple[int, int], dict[int, dict]]:
    """Draw the steps ``steps`` (default: the last three recorded) of the trace in a job's
    output directory. Returns (picture, steps drawn, per-step figures). Raises
    FileNotFoundError (no trace) or ValueError (no such steps)."""
    from roundpipe.coordinator.training.timeline import TRACE_DIR, read_trace

    out = picture_path(out)
    directory = Path(output_dir) / TRACE_DIR
    if steps is None:
        recorded = sorted(read_trace(directory, newest_segments=2).steps)
        if not recorded:
            raise ValueError(f"the trace in {directory} holds no complete step yet")
        steps = (max(recorded[0], recorded[-1] - 2), recorded[-1])
    trace = read_trace(directory, steps=range(steps[0], steps[1] + 1))
    if not trace.tasks:
        raise ValueError(f"the trace in {directory} holds no task of steps {steps[0]}-{steps[1]}")
    boxes = boxes_from_trace(trace.tasks, multi_step=steps[1] > steps[0])
    path = draw_timeline(boxes, out, title=measured_title(job, steps, trace.steps))
    return path, steps, trace.steps


def draw_plan_timeline(result, out: Path, *, describe: str) -> Path:
    """Draw a planner result's simulated schedule (``roundpipe plan --timeline``)."""
    sim = result.simulation
    title = (
        f"SIMULATED: {describe} | plan {result.plan} | bubble fraction "
        f"{100 * sim.bubble_fraction:.1f}% (steady state) | {sim.iteration_s:.3g}s per step"
    )
    if not getattr(sim, "optimizer_events", None):
        title += " | optimizer not modelled (--optimizer-rate)"
    lanes = [f"worker {w}" for w in range(sim.num_workers)] + [OPTIMIZER_LANE]
    return draw_timeline(boxes_from_simulation(sim), picture_path(out), title=title, lanes=lanes)
