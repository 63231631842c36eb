"""The suite's plots (matplotlib, Agg backend), drawn from the same results as its report.

suite_latency_cdf.png   end-to-end latency CDF per system at the comparison rate; the curve is a
                        fraction of the jobs submitted, so unfinished jobs keep it below 1
suite_load.png          throughput and P99 latency (with unfinished jobs) against the offered load
suite_burst.png         Conveyor's queue wait (started_at - created_at) by submit time in the burst,
                        per priority class, the burst window shaded
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from bench.processes import say
from bench.report import RESULTS_DIR
from bench.suite_systems import CONVEYOR_1, CONVEYOR_2, NAIVE, RAY, SYSTEMS

COLORS = {NAIVE: "tab:red", RAY: "tab:orange", CONVEYOR_1: "tab:blue", CONVEYOR_2: "tab:green"}


def pyplot() -> Any:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def cdf_points(latencies: list[float], submitted: int) -> tuple[list[float], list[float]]:
    """(sorted latencies, fraction of the submitted jobs done by each): a CDF that ends below 1 when
    jobs never finished."""
    ordered = sorted(latencies)
    return ordered, [(i + 1) / submitted for i in range(len(ordered))] if submitted else []


def latency_cdf(results: dict[str, Any], meta: dict[str, Any], path: Path) -> None:
    plt = pyplot()
    main = str(meta["plan"]["main_rate"])
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for name in SYSTEMS:
        point = ((results["systems"].get(name) or {}).get("points") or {}).get(main)
        if not point:
            continue
        latencies = [j["latency_s"] for j in point["jobs_detail"] if j["status"] == "succeeded"]
        xs, ys = cdf_points(latencies, point["jobs"])
        ax.step(
            xs, ys, where="post", label=f"{name} ({point['ok']}/{point['jobs']} done)", color=COLORS.get(name)
        )
    ax.set_xscale("log")
    ax.set_xlabel("end-to-end latency (s, log scale)")
    ax.set_ylabel("fraction of submitted jobs done")
    ax.set_ylim(0, 1.02)
    ax.set_title(f"Latency CDF at {main} jobs/s ({meta['model']}, {meta['plan']['name']})")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(loc="lower right", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def load_plot(results: dict[str, Any], meta: dict[str, Any], path: Path) -> None:
    plt = pyplot()
    fig, (tput, p99) = plt.subplots(1, 2, figsize=(11, 4.5))
    for name in SYSTEMS:
        points = (results["systems"].get(name) or {}).get("points") or {}
        ordered = sorted(points.values(), key=lambda p: p["offered_tokens_per_s"])
        if not ordered:
            continue
        offered = [p["offered_tokens_per_s"] for p in ordered]
        style = {"marker": "o", "label": name, "color": COLORS.get(name)}
        tput.plot(offered, [p["tokens_per_s"] for p in ordered], **style)
        p99.plot(offered, [p["latency_p99_all_s"] or float("nan") for p in ordered], **style)
    top = max(
        (
            p["offered_tokens_per_s"]
            for s in results["systems"].values()
            for p in (s.get("points") or {}).values()
        ),
        default=1.0,
    )
    tput.plot([0, top], [0, top], linestyle=":", color="grey", label="= offered")
    tput.set_xlabel("offered load (tokens/s asked)")
    tput.set_ylabel("throughput (tokens/s)")
    tput.set_title("Throughput")
    p99.set_xlabel("offered load (tokens/s asked)")
    p99.set_ylabel("P99 end-to-end latency (s), unfinished jobs included")
    p99.set_yscale("log")
    p99.set_title("P99 latency")
    for ax in (tput, p99):
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(f"{meta['model']}, {meta['plan']['name']} plan, {meta['cpus']} cores")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def burst_plot(results: dict[str, Any], meta: dict[str, Any], path: Path) -> None:
    plt = pyplot()
    burst = (results["systems"].get(CONVEYOR_1) or {}).get("burst")
    fig, ax = plt.subplots(figsize=(9, 4.5))
    if burst:
        start, end = burst["window_s"]["burst"]
        ax.axvspan(start, end, color="grey", alpha=0.15, label="burst (normal x10)")
        for cls, color in (("normal", "tab:blue"), ("high", "tab:red")):
            waits = burst[cls]["waits"]
            ax.scatter([a for a, _ in waits], [w * 1000 for _, w in waits], s=14, color=color, label=cls)
        ax.set_yscale("log")
        ax.legend(fontsize=8)
    else:
        ax.text(0.5, 0.5, "burst not measured", ha="center", va="center", transform=ax.transAxes)
    ax.set_xlabel("submit time (s from the start)")
    ax.set_ylabel("queue wait, started_at - created_at (ms)")
    ax.set_title(f"{CONVEYOR_1}: queue wait through a 10x burst ({meta['model']}, {meta['plan']['name']})")
    ax.grid(True, which="both", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_all(results: dict[str, Any], meta: dict[str, Any], directory: Path = RESULTS_DIR) -> None:
    """The three PNGs; a missing matplotlib is reported, not fatal (the tables are written already)."""
    try:
        pyplot()
    except ImportError as exc:
        say(f"no plots: matplotlib is not installed ({exc}); pip install -e '.[bench]'")
        return
    directory.mkdir(parents=True, exist_ok=True)
    for name, draw in (
        ("suite_latency_cdf.png", latency_cdf),
        ("suite_load.png", load_plot),
        ("suite_burst.png", burst_plot),
    ):
        draw(results, meta, directory / name)
    say(f"wrote the plots suite_latency_cdf.png, suite_load.png and suite_burst.png in {directory}")
