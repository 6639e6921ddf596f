"""`kvpipe plan`: the capacity curve from the saved query `capacity_curve`, grouped and explained.

Pure shaping and formatting over `saved.run_query`; the distances themselves are computed by the
analytics app as it consumes (`restores`), which is also where the method is stated (CAPACITY_METHOD).
"""
from __future__ import annotations

import textwrap
from typing import Any, Mapping

from kvpipe.processors.analytics.restores import CAPACITY_METHOD
from kvpipe.processors.analytics.saved import run_query
from kvpipe.processors.core.texttable import render as table

POINT_FIELDS = ("extra_fraction", "extra_blocks", "cache_blocks", "hits", "hit_fraction", "tokens_saved")


def curves(target: Any, params: Mapping[str, Any]) -> dict:
    """`{"method", "curves": [{node_id, group_kind, medium, capacity, restores, points: [...]}]}`."""
    result = run_query(target, "capacity_curve", params)
    out: dict[tuple, dict] = {}
    for row in result["rows"]:
        r = dict(zip(result["columns"], row))
        key = (r["node_id"], r["group_kind"], r["medium"])
        curve = out.setdefault(key, {"node_id": r["node_id"], "group_kind": r["group_kind"], "medium": r["medium"],
                                     "capacity": r["capacity"], "restores": r["restores"], "points": []})
        curve["points"].append({f: r[f] for f in POINT_FIELDS})
    return {"method": CAPACITY_METHOD, "curves": list(out.values())}


def render(plan: dict) -> str:
    lines = []
    if not plan["curves"]:
        lines.append("No re-stores recorded yet (for this node / group kind): nothing to plan from. The analytics "
                     "app records one each time a block is stored again after its lifetime ended.")
    for c in plan["curves"]:
        lines.append(f"{c['node_id']}  {c['group_kind'] or '(unknown kind)'}  {c['medium']}: observed capacity "
                     f"{c['capacity']} blocks, {c['restores']} re-stores")
        points = [[f"{p['extra_fraction'] * 100:.0f}%", p["extra_blocks"], p["cache_blocks"], p["hits"],
                   f"{p['hit_fraction'] * 100:.1f}%", p["tokens_saved"]] for p in c["points"]]
        lines.append(table(["change", "extra blocks", "cache blocks", "hits", "hit %", "tokens saved"], points,
                           right=range(6)))
        lines.append("")
    lines.append(textwrap.fill(plan["method"], 100))
    return "\n".join(lines)
