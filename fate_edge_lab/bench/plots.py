"""The plots: tokens/s against the budget per policy and link, and the per-layer hit rate at the headline budget."""

from __future__ import annotations

from pathlib import Path

from fate_edge_lab.bench.config import ALL_PRESETS, LABELS, headline_budget
from fate_edge_lab.bench.results import find_result


def plots(result: dict, path: Path) -> list[Path]:
    """Tokens/s vs budget per policy per link, and the per-layer decode hit rate at 35%."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        import matplotlib.ticker
    except ImportError:
        print("bench: matplotlib not installed: no plots (pip install matplotlib)", flush=True)
        return []
    cfg, results = result["config"], result["results"]
    budgets = sorted(cfg["budgets"])
    links = [k for k in cfg["links"] if k in result["links"]]
    ok = {r["preset"] for r in results if not r.get("error")}
    presets = [p for p in ALL_PRESETS if p in ok] + sorted(ok - set(ALL_PRESETS))
    lens = [str(n) for n in result["prompts"]["lengths"]]
    colors = {p: f"C{i % 10}" for i, p in enumerate(ALL_PRESETS + sorted(ok - set(ALL_PRESETS)))}
    path.parent.mkdir(parents=True, exist_ok=True)
    fig, axes = plt.subplots(len(links), 2, figsize=(11, 3.6 * len(links)), squeeze=False)
    for row, link in enumerate(links):
        panels = [("decode", "decode tok/s"), (lens[0], f"prefill tok/s ({lens[0]} tokens)")]
        for col, (metric, title) in enumerate(panels):
            ax = axes[row][col]
            for p in presets:
                pts = []
                for b in budgets:
                    r = find_result(results, link, p, b)
                    if r is not None:
                        m = r["median"]
                        pts.append((100 * b, m["decode_tps"] if metric == "decode" else m["prefill_tps"].get(metric)))
                pts = [(x, y) for x, y in pts if y]
                if not pts:
                    continue
                r0 = find_result(results, link, p, budgets[0])
                if r0 is not None and r0["budget_fraction"] is None:
                    ax.axhline(pts[0][1], ls="--", color=colors[p], label=LABELS.get(p, p))
                else:
                    ax.plot(*zip(*pts), marker="o", color=colors[p], label=p)
            ax.set_yscale("log")
            ax.yaxis.set_major_formatter(matplotlib.ticker.FormatStrFormatter("%g"))
            ax.yaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())
            ax.set_xticks([100 * b for b in budgets])
            ax.set_xlabel("expert budget, % of int4 expert bytes")
            ax.set_ylabel(title)
            ax.set_title(result["links"][link]["title"], fontsize=10)
            ax.grid(alpha=0.3, which="both")
        axes[row][1].legend(fontsize=7, loc="best")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    written = [path]

    hb = headline_budget(budgets)
    layers_path = path.with_name(path.stem + "_layers" + path.suffix)
    fig, ax = plt.subplots(figsize=(7, 3.8))
    for p in presets:
        r = find_result(results, links[0], p, hb)
        if r is None or r["budget_fraction"] is None or not r["per_layer"].get("decode"):
            continue  # load-on-demand keeps nothing: 0% everywhere
        per = sorted((int(k), v) for k, v in r["per_layer"]["decode"].items())
        xs = [k for k, _ in per]
        ys = [100 * (c + f) / max(1, c + f + m) for _, (c, f, m) in per]
        ax.plot(xs, ys, marker="o", color=colors[p], label=LABELS.get(p, p))
    ax.set_xlabel("MoE layer")
    ax.set_ylabel("decode hit rate, % (cache + prefetch)")
    ax.set_title(f"Per-layer hit rate at {100 * hb:.0f}% budget, {result['links'][links[0]]['title']}", fontsize=10)
    ax.set_ylim(-3, 103)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(layers_path, dpi=110)
    plt.close(fig)
    return written + [layers_path]
