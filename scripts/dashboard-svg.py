#!/usr/bin/env python3
"""Draws deploy/monitoring/dashboard.json as an SVG from a running Prometheus: each
panel's queries over the last minutes (/api/v1/query_range) as lines, laid out as
Grafana lays the panels out, with the Python standard library only. docs/operations.md's picture comes from it
(tests/monitoring.rs, the_dashboard_picture, runs it against its Prometheus).

    scripts/dashboard-svg.py http://127.0.0.1:9090 OUT.svg [MINUTES]
"""

import html
import json
import math
import sys
import time
import urllib.parse
import urllib.request
from pathlib import Path

DASHBOARD = Path(__file__).resolve().parent.parent / "deploy/monitoring/dashboard.json"
COLORS = ["#73bf69", "#f2cc0c", "#5794f2", "#ff780a", "#f2495c", "#b877d9", "#8ab8ff", "#fade2a"]
UNIT_X = 40  # pixels per Grafana grid column (24 columns)
UNIT_Y = 30  # pixels per Grafana grid row


def query_range(base, expr, start, end, step):
    q = urllib.parse.urlencode({"query": expr, "start": start, "end": end, "step": step})
    with urllib.request.urlopen(f"{base}/api/v1/query_range?{q}", timeout=10) as r:
        answer = json.load(r)
    if answer["status"] != "success":
        raise SystemExit(f"{expr}: {answer.get('error')}")
    return answer["data"]["result"]


def legend(fmt, labels):
    out = fmt
    for key, value in labels.items():
        out = out.replace("{{" + key + "}}", value)
    return out if "{{" not in out else fmt.split("{{")[0].strip() or "value"


def human(v, unit):
    for size, suffix in ((1e9, "G"), (1e6, "M"), (1e3, "k")):
        if abs(v) >= size:
            return f"{v / size:.1f}{suffix}"
    if unit == "s" and 0 < abs(v) < 1:
        return f"{v * 1000:.1f}ms"
    return f"{v:.2f}".rstrip("0").rstrip(".")


def panel_svg(panel, series, start, end, step):
    g = panel["gridPos"]
    x0, y0 = g["x"] * UNIT_X, g["y"] * UNIT_Y
    w, h = g["w"] * UNIT_X - 8, g["h"] * UNIT_Y - 8
    unit = panel["fieldConfig"]["defaults"].get("unit", "")
    out = [
        f'<g transform="translate({x0 + 4},{y0 + 4})">',
        f'<rect width="{w}" height="{h}" rx="3" fill="#181b1f" stroke="#2c3235"/>',
        f'<text x="8" y="18" class="title">{html.escape(panel["title"])}</text>',
    ]
    px, py, pw, ph = 44, 28, w - 52, h - 60
    points = [float(v) for s in series for _, v in s["values"] if math.isfinite(float(v))]
    top = max(points, default=1) or 1
    out.append(f'<line x1="{px}" y1="{py + ph}" x2="{px + pw}" y2="{py + ph}" class="axis"/>')
    for frac in (0.5, 1.0):
        y = py + ph - frac * ph
        out.append(f'<line x1="{px}" y1="{y}" x2="{px + pw}" y2="{y}" class="grid"/>')
        out.append(f'<text x="{px - 4}" y="{y + 4}" class="tick" text-anchor="end">{human(top * frac, unit)}</text>')
    out.append(f'<text x="{px - 4}" y="{py + ph + 4}" class="tick" text-anchor="end">0</text>')
    if not points:
        out.append(f'<text x="{w / 2}" y="{h / 2}" class="tick" text-anchor="middle">No data</text>')
    for i, s in enumerate(series):
        color = COLORS[i % len(COLORS)]
        # A line per run of samples: where a series is missing (an edge gone), a gap.
        runs, last = [], None
        for t, v in s["values"]:
            v = float(v)
            if not math.isfinite(v):
                continue
            if last is None or t - last > 2 * step:
                runs.append([])
            last = t
            runs[-1].append(f"{px + (t - start) / (end - start) * pw:.1f},{py + ph - v / top * ph:.1f}")
        for run in runs:
            out.append(f'<polyline points="{" ".join(run)}" fill="none" stroke="{color}" stroke-width="1.5"/>')
        lx = 8 + (i % 3) * (w - 16) / 3
        ly = h - 22 + (i // 3) * 12
        if ly < h - 2:
            out.append(f'<rect x="{lx}" y="{ly - 7}" width="10" height="3" fill="{color}"/>')
            out.append(f'<text x="{lx + 14}" y="{ly}" class="legend">{html.escape(s["legend"][:34])}</text>')
    out.append("</g>")
    return out


def main():
    if len(sys.argv) < 3:
        raise SystemExit(__doc__)
    base, out_path = sys.argv[1], Path(sys.argv[2])
    minutes = float(sys.argv[3]) if len(sys.argv) > 3 else 5
    end = time.time()
    start = end - minutes * 60
    step = max(1, int(minutes * 60 / 150))
    dashboard = json.loads(DASHBOARD.read_text())
    parts = []
    bottom = 0
    for panel in dashboard["panels"]:
        series = []
        for target in panel["targets"]:
            # Grafana's $__rate_interval: four steps at least, 30 s at least.
            expr = target["expr"].replace("$__rate_interval", f"{max(30, 4 * step)}s")
            for s in query_range(base, expr, start, end, step):
                s["legend"] = legend(target.get("legendFormat", ""), s["metric"])
                series.append(s)
        parts += panel_svg(panel, series, start, end, step)
        g = panel["gridPos"]
        bottom = max(bottom, (g["y"] + g["h"]) * UNIT_Y)
    width = 24 * UNIT_X
    head = (
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{bottom + 36}" '
        f'viewBox="0 -32 {width} {bottom + 36}" font-family="sans-serif">'
        "<style>.title{fill:#ccccdc;font-size:13px;font-weight:600}.tick{fill:#8e8e8e;font-size:10px}"
        ".legend{fill:#ccccdc;font-size:10px}.axis{stroke:#555}.grid{stroke:#2c3235}"
        "</style>"
        f'<rect x="0" y="-32" width="{width}" height="{bottom + 36}" fill="#111217"/>'
        f'<text x="8" y="-12" class="title">{html.escape(dashboard["title"])}: the last {minutes:g} minutes</text>'
    )
    out_path.write_text(head + "\n".join(parts) + "</svg>\n")
    print(f"wrote {out_path} ({len(dashboard['panels'])} panels)")


if __name__ == "__main__":
    main()
