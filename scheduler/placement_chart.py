"""The placement picture: the cluster's nodes (rows) by GPUs (columns), the job's ranks on them.

Each GPU the job holds shows its global rank and pipeline stage (coloured by stage, so a
cross mapping that puts adjacent stages under different PCIe root complexes is visible);
GPUs other jobs hold are grey, free ones white, cordoned nodes hatched. With no cluster
only the job's nodes and GPUs are drawn.
"""

from __future__ import annotations

from scheduler.cluster import Cluster
from scheduler.placement import CPU_DEVICE, Placement

_STAGE_COLORS = ["#4c9be8", "#f5a142", "#5cc26b", "#d9534f", "#9b7fd1", "#8c6d5a", "#e377c2", "#7f7f7f"]


def placement_png(placement: Placement, cluster: Cluster | None = None, title: str = "") -> bytes:
    """PNG bytes of the placement (see the module docstring)."""
    from matplotlib.patches import Patch, Rectangle

    from infra.charts import figure_png, new_figure

    ours = {a.node: a for a in placement.assignments}
    rows: list[tuple[str, int, set[int], bool, list[int | None]]] = []  # node, GPUs, free, cordoned, RCs
    if cluster is not None:
        for node in cluster.nodes:
            rcs = list(node.pcie_root_complex or [None] * node.gpu_count)
            rows.append((node.name, node.gpu_count, set(node.free_gpus or []), node.cordoned, rcs))
        known = {r[0] for r in rows}
        rows += [(a.node, max(a.gpus) + 1, set(), False, [None] * (max(a.gpus) + 1))
                 for a in placement.assignments if a.node not in known]
    else:
        rows = [(a.node, max(a.gpus) + 1, set(), False, [None] * (max(a.gpus) + 1)) for a in placement.assignments]
    width = max(n for _, n, *_ in rows)
    fig, ax = new_figure((max(4.5, 1.1 * width + 2.2), max(1.6, 0.75 * len(rows) + 1.2)))
    for y, (name, count, free, cordoned, rcs) in enumerate(rows):
        mine = dict(zip(ours[name].gpus, zip(ours[name].ranks, ours[name].stages))) if name in ours else {}
        for gpu in range(count):
            if gpu in mine:
                rank, stage = mine[gpu]
                face, text = _STAGE_COLORS[stage % len(_STAGE_COLORS)], f"r{rank}\nstage {stage}"
            elif gpu in free and not cordoned:
                face, text = "white", "free"
            else:
                face, text = "#d0d0d0", "cordoned" if cordoned else "other job"
            ax.add_patch(Rectangle((gpu, y), 0.94, 0.86, facecolor=face, edgecolor="#444444", lw=0.8,
                                   hatch="//" if cordoned else None))
            ax.text(gpu + 0.47, y + 0.43, text, ha="center", va="center", fontsize=7)
            if gpu < len(rcs) and rcs[gpu] is not None:
                ax.text(gpu + 0.9, y + 0.8, f"rc{rcs[gpu]}", ha="right", va="top", fontsize=5.5, color="#555555")
    ax.set_xlim(-0.1, width)
    ax.set_ylim(len(rows), -0.1)  # first node on top
    ax.set_yticks([y + 0.43 for y in range(len(rows))],
                  [f"{name}{' (cordoned)' if cordoned else ''}" for name, _, _, cordoned, _ in rows], fontsize=8)
    device = "process" if placement.gpu_type == CPU_DEVICE else "GPU"  # CPU "devices" are worker processes
    ax.set_xticks([g + 0.47 for g in range(width)], [f"{device} {g}" for g in range(width)], fontsize=7)
    ax.tick_params(length=0)
    for side in ax.spines.values():
        side.set_visible(False)
    stages = sorted({s for a in placement.assignments for s in a.stages})
    ax.legend(handles=[Patch(facecolor=_STAGE_COLORS[s % len(_STAGE_COLORS)], label=f"stage {s}") for s in stages],
              fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0), borderaxespad=0)
    ax.set_title(title or (f"{placement.job}: {placement.world_size}x {placement.gpu_type} "
                           f"(dp{placement.dp} tp{placement.tp} pp{placement.pp})"), fontsize=10)
    fig.tight_layout()
    return figure_png(fig)


def placement_markdown(placement: Placement, cluster: Cluster | None = None, title: str = "") -> str:
    """Markdown for a Prefect artifact: the picture inline (it renders in the UI), a table of the
    nodes, then the placement as JSON (what the launchers read)."""
    import json

    from infra.charts import markdown_image

    rows = "\n".join(f"| {a.node} | {', '.join(map(str, a.gpus))} | {', '.join(map(str, a.ranks))} | "
                     f"{', '.join(map(str, a.stages))} |" for a in placement.assignments)
    return (f"## Placement: {placement.world_size}x {placement.gpu_type} on {', '.join(placement.nodes)}\n\n"
            f"{markdown_image('placement: nodes x GPUs', placement_png(placement, cluster, title))}\n\n"
            f"| node | GPUs | ranks | stages |\n|---|---|---|---|\n{rows}\n\n"
            f"```json\n{json.dumps(placement.to_dict(), indent=2)}\n```")
