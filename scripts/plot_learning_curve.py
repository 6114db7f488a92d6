#!/usr/bin/env python3
"""The Qwen drafter's learning curve as an SVG: held-out τ (MBPP test 1–8, γ 7, every draft
verified) against block positions trained, on a log axis, one colour per drafter depth, with the
straight line τ = a + b·ln(positions) fitted to the current recipe's points (two draft layers,
on the path to a shipped version, from 6.96 M positions on) and extended to the issue's goal, so
that the next runs' length can be planned from it. No plotting library: the CSV
(docs/training/qwen-learning-curve.csv) is a few rows and the picture a few lines.

Usage: scripts/plot_learning_curve.py [CSV] [OUT.svg]
Prints the fit and the positions it needs for τ 2.5 and 3.0.
"""
import csv
import math
import sys

src = sys.argv[1] if len(sys.argv) > 1 else "docs/training/qwen-learning-curve.csv"
out = sys.argv[2] if len(sys.argv) > 2 else "docs/training/qwen-learning-curve.svg"
rows = [r for r in csv.DictReader(open(src))]
pts = [(float(r["positions_m"]), float(r["tau_mbpp_1_8"]), int(r["layers"]), r["note"]) for r in rows]

# The recipe the next runs continue: two layers, from "more answers" on, branches not shipped left out.
FIT_FROM = 6.96
fit_pts = [(x, t) for x, t, layers, note in pts if layers == 2 and x >= FIT_FROM and "not shipped" not in note]
lx = [math.log(x) for x, _ in fit_pts]
mx, my = sum(lx) / len(lx), sum(t for _, t in fit_pts) / len(fit_pts)
b = sum((u - mx) * (t - my) for u, (_, t) in zip(lx, fit_pts)) / sum((u - mx) ** 2 for u in lx)
a = my - b * mx
worst = max(abs(t - (a + b * math.log(x))) for x, t in fit_pts)
need = {g: math.exp((g - a) / b) for g in (2.5, 3.0)}
print(f"fit over {len(fit_pts)} points from {FIT_FROM} M: tau = {a:.3f} + {b:.3f} ln(positions / 1 M) "
      f"(+{b * math.log(2):.3f} per doubling, largest residual {worst:.3f})")
for g, p in need.items():
    print(f"  tau {g}: {p:.0f} M positions ({p / fit_pts[-1][0]:.1f}x the last point's {fit_pts[-1][0]} M)")

W, H, L, R, T, B = 640, 400, 60, 20, 40, 50
xmin, xmax = 0.2, 10 ** math.ceil(math.log10(need[3.0] * 1.5))
ymin, ymax = 1.0, max(3.1, max(p[1] for p in pts) + 0.1)
X = lambda x: L + (W - L - R) * (math.log10(x) - math.log10(xmin)) / (math.log10(xmax) - math.log10(xmin))
Y = lambda y: H - B - (H - T - B) * (y - ymin) / (ymax - ymin)
colours = {1: "#1f77b4", 2: "#d62728", 3: "#2ca02c", 4: "#9467bd"}
s = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{W}" height="{H}" font-family="sans-serif" font-size="12">',
     f'<rect width="{W}" height="{H}" fill="white"/>',
     f'<text x="{W / 2}" y="20" text-anchor="middle" font-size="14">Qwen2.5-Coder-1.5B DSpark drafter: held-out τ (MBPP 1–8, γ 7) vs training</text>']
for k in range(-1, int(math.log10(xmax)) + 1):
    for m in range(1, 10):
        x = m * 10.0 ** k
        if xmin <= x <= xmax:
            s.append(f'<line x1="{X(x):.1f}" y1="{Y(ymin)}" x2="{X(x):.1f}" y2="{Y(ymax)}" stroke="{"#ddd" if m == 1 else "#f3f3f3"}"/>')
            if m in (1, 3):
                label = f"{x:g}"
                s.append(f'<text x="{X(x):.1f}" y="{H - B + 16}" text-anchor="middle">{label}</text>')
y = ymin
while y <= ymax + 1e-9:
    s.append(f'<line x1="{L}" y1="{Y(y)}" x2="{W - R}" y2="{Y(y)}" stroke="#eee"/>')
    s.append(f'<text x="{L - 6}" y="{Y(y) + 4}" text-anchor="end">{y:.1f}</text>')
    y += 0.5
s.append(f'<line x1="{L}" y1="{Y(3.0)}" x2="{W - R}" y2="{Y(3.0)}" stroke="#888" stroke-dasharray="5,4"/>')
s.append(f'<text x="{L + 6}" y="{Y(3.0) - 5}" fill="#555">issue goal τ 3.0</text>')
s.append(f'<text x="{(L + W - R) / 2}" y="{H - 12}" text-anchor="middle">block positions trained (millions, log scale)</text>')
s.append(f'<text x="16" y="{(T + H - B) / 2}" text-anchor="middle" transform="rotate(-90 16 {(T + H - B) / 2})">τ</text>')
x0, x1 = fit_pts[0][0], min(xmax, need[3.0] * 1.2)
s.append(f'<line x1="{X(x0):.1f}" y1="{Y(a + b * math.log(x0)):.1f}" x2="{X(x1):.1f}" y2="{Y(a + b * math.log(x1)):.1f}" '
         f'stroke="#d62728" stroke-width="1.5" stroke-dasharray="2,3"/>')
s.append(f'<text x="{X(need[3.0]):.1f}" y="{Y(3.0) + 16}" text-anchor="end" fill="#d62728">'
         f'fit: τ = {a:.2f} + {b:.3f}·ln P, τ 3 at ≈ {need[3.0]:.0f} M</text>')
for layers in sorted({p[2] for p in pts}):
    run = [p for p in pts if p[2] == layers]
    c = colours.get(layers, "black")
    s.append('<polyline fill="none" stroke="{}" stroke-width="2" points="{}"/>'.format(
        c, " ".join(f"{X(x):.1f},{Y(t):.1f}" for x, t, _, _ in run)))
    for x, t, _, _ in run:
        s.append(f'<circle cx="{X(x):.1f}" cy="{Y(t):.1f}" r="3.5" fill="{c}"/>')
    s.append(f'<text x="{W - R - 140}" y="{Y(1.25) + 16 * layers}" fill="{c}">{layers} draft layer{"s" if layers > 1 else ""}</text>')
s.append("</svg>")
open(out, "w").write("\n".join(s) + "\n")
print(f"wrote {out}")
