"""SLO attainment against request rate, with the 90% line and the goodput marked."""

from __future__ import annotations

from pathlib import Path

from hydrad.bench.metrics import GOODPUT_ATTAINMENT
from hydrad.bench.runner import BenchResult
from hydrad.errors import ConfigError


def plot_attainment(result: BenchResult, path: str | Path) -> None:
    """Write a PNG; the Agg canvas needs no display and leaves pyplot's global state alone."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    rates = [run.rate for run in result.runs]
    attainment = [100 * run.summary.attainment for run in result.runs]
    per_instance = result.config.instances > 1
    scale = 1 / result.config.instances

    fig = Figure(figsize=(5.5, 3.8), dpi=120)
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    ax.plot([r * scale for r in rates], attainment, marker="o", label=result.model or "server")
    ax.axhline(100 * GOODPUT_ATTAINMENT, color="grey", linestyle="--", linewidth=1, label="90% SLO attainment")
    if result.goodput_total:
        good = result.goodput_total * scale
        ax.axvline(good, color="tab:red", linestyle=":", linewidth=1.2)
        ax.annotate(
            f"goodput {good:.3g} req/s",
            xy=(good, 100 * GOODPUT_ATTAINMENT),
            xytext=(6, -18),
            textcoords="offset points",
            color="tab:red",
        )
    ax.set_xlabel("request rate per instance (req/s)" if per_instance else "request rate (req/s)")
    ax.set_ylabel("SLO attainment (%)")
    ax.set_ylim(0, 105)
    ax.grid(True, alpha=0.3)
    ax.legend(loc="lower left", fontsize="small")
    slo = result.config.slo
    title = f"{Path(result.config.workload).name}: TTFT <= {slo.ttft:g} s, TBT p90 <= {slo.tbt:g} s"
    ax.set_title(title, fontsize="medium")
    fig.tight_layout()
    try:
        fig.savefig(path, format="png")
    except OSError as e:
        raise ConfigError(f"cannot write plot {path}: {e.strerror}") from None
