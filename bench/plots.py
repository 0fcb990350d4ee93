"""The report's two plots as PNG files (matplotlib, off-screen)."""

from __future__ import annotations

import math
import os

from .records import Cell, FigureValues
from .systems import NONE

FILES = ("blocking_vs_size.png", "throughput_vs_k.png")
_RATIO_TICKS = (0.25, 0.5, 0.8, 1.0, 1.05, 1.25, 1.5, 2, 3, 5, 10, 20, 50, 100, 200)


def write(results: dict, out: str) -> list[str]:
    """The plots of results.json's ``results`` into ``out``; returns the files written."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figures = {key: FigureValues.from_json(f) for key, f in results["figures"].items()}
    draws = (_blocking_vs_size, _throughput_vs_k if "training" in results["raw"] else None)
    paths = []
    for name, draw in zip(FILES, draws):
        if draw is not None:
            fig = draw(results, figures, plt)
            paths.append(os.path.join(out, name))
            fig.savefig(paths[-1], dpi=110, bbox_inches="tight")
            plt.close(fig)
    return paths


def _style(system: dict, index: int) -> dict:
    """async_ckpt's lines thick and solid, the peers' thin and dashed."""
    ours = system["ours"]
    return {"linewidth": 2.4 if ours else 1.3, "linestyle": "-" if ours else "--",
            "marker": "o" if ours else "s", "markersize": 5 if ours else 3.5,
            "color": f"C{index % 10}"}


def _size(nbytes: float) -> str:
    return f"{nbytes / 1e6:.3g} MB" if nbytes < 1e9 else f"{nbytes / 1e9:.3g} GB"


def _spaced_ticks(low: float, high: float) -> list[float]:
    """The ratio ticks inside [low, high], at least 1/10 of the log range apart."""
    gap = math.log(high / low) / 10
    ticks: list[float] = []
    for tick in _RATIO_TICKS:
        if low <= tick <= high and (not ticks or math.log(tick / ticks[-1]) >= gap):
            ticks.append(tick)
    return ticks


def _legend_below(fig, axes) -> None:
    """One legend for both panels, under them, so that no line is hidden behind it."""
    handles = {}
    for ax in axes:
        for handle, label in zip(*ax.get_legend_handles_labels()):
            handles.setdefault(label, handle)
    fig.legend(list(handles.values()), list(handles), loc="upper center", ncol=3, fontsize=8,
               bbox_to_anchor=(0.5, 0.0), frameon=False)


def _blocking_vs_size(results: dict, figures: dict[str, FigureValues], plt):
    sweep = results["raw"]["sweep"]
    cases = sorted((c for c in sweep if sweep[c]["dtype"] == "fp32"),
                   key=lambda c: sweep[c]["bytes"])
    gb = [sweep[c]["bytes"] / 1e9 for c in cases]
    fig, axes = plt.subplots(1, 2, figsize=(13, 5))
    panels = (("blocking_s", "blocking time per snapshot (s)", "copy_s", "floor: one copy_"),
              ("to_durable_s", "time from snapshot() to durable (s)", "durable_s",
               "floor: fastest durable write"))
    for ax, (key, label, floor_key, floor_label) in zip(axes, panels):
        for index, system in enumerate(results["systems"]):
            values = figures[key].values[system["name"]]
            points = [(x, values[c].median) for x, c in zip(gb, cases)
                      if isinstance(values[c], Cell)]
            if points:
                ax.plot(*zip(*points), label=system["name"], **_style(system, index))
        floors = [results["floors"][c][floor_key]["median"] for c in cases]
        ax.plot(gb, floors, color="black", linestyle=":", linewidth=2, label=floor_label)
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.set_xticks(gb, [_size(sweep[c]["bytes"]) for c in cases])
        ax.minorticks_off()
        ax.set_xlabel("state size (fp32 model + Adam)")
        ax.set_ylabel(label)
        ax.grid(True, which="major", alpha=0.3)
    _legend_below(fig, axes)
    fig.suptitle("Saving a training state: blocking time and time to durable vs state size "
                 "(medians; lower is better)")
    return fig


def _throughput_vs_k(results: dict, figures: dict[str, FigureValues], plt):
    from matplotlib.ticker import FuncFormatter

    figure = figures["throughput_steps_s"]
    ks = [int(c.split("=")[1]) for c in figure.cases]
    fig, axes = plt.subplots(1, 2, figsize=(13, 5))
    none = [figure.values[NONE.name][c].median for c in figure.cases]
    axes[0].plot(ks, none, color="black", linestyle=":", linewidth=2, label=NONE.name)
    axes[1].axhline(1.0, color="black", linestyle=":", linewidth=2)
    for index, system in enumerate(results["systems"]):
        values = figure.values[system["name"]]
        points = [(k, values[c]) for k, c in zip(ks, figure.cases) if isinstance(values[c], Cell)]
        if not points:
            continue
        style = _style(system, index)
        axes[0].plot([k for k, _ in points], [e.median for _, e in points], label=system["name"],
                     **style)
        overhead = figures["step_overhead_pct"].values[system["name"]]
        axes[1].plot([k for k, _ in points], [1 + overhead[f"K={k}"].median / 100
                                              for k, _ in points], label=system["name"], **style)
    axes[0].set_ylabel("training steps/s (higher is better)")
    axes[1].set_ylabel("training time vs no checkpointing (log scale)")
    axes[1].set_yscale("log")
    axes[1].set_yticks(_spaced_ticks(*axes[1].get_ylim()))
    axes[1].yaxis.set_major_formatter(FuncFormatter(lambda y, _: f"{(y - 1) * 100:+.0f}%"))
    axes[1].yaxis.set_minor_formatter(FuncFormatter(lambda y, _: ""))
    axes[1].axhspan(1.01, 1.05, color="green", alpha=0.12, label="the article's 1-5% budget")
    for ax in axes:
        ax.set_xscale("log")
        ax.set_xticks(ks, [str(k) for k in ks])
        ax.minorticks_off() if ax is axes[0] else None
        ax.set_xlabel("snapshot every K steps")
        ax.grid(True, which="major", alpha=0.3)
    _legend_below(fig, axes)
    state = _size(results["raw"]["training"]["state_bytes"])
    fig.suptitle(f"Training loop ({state} state, MLP + AdamW): throughput and overhead vs "
                 "snapshot interval K")
    return fig
