#!/usr/bin/env python3
"""The Qwen drafter's learning curve as an SVG: held-out τ (MBPP test 1–8, γ 7, every draft
verified) against block positions trained, one colour per drafter depth. No plotting library:
the CSV (docs/training/qwen-learning-curve.csv) is a few rows and the picture a few lines.

Usage: scripts/plot_learning_curve.py [CSV] [OUT.svg]
"""
import csv
import sys

src = sys.argv[1] if len(sys.argv) > 1 else "docs/training/qwen-learning-curve.csv"
out = sys.argv[2] if len(sys.argv) > 2 else "docs/training/qwen-learning-curve.svg"
rows = [r for r in csv.DictReader(open(src))]
pts = [(float(r["positions_m"]), float(r["tau_mbpp_1_8"]), int(r["layers"])) for r in rows]
W, H, L, R, T, B = 640, 400, 60, 20, 40, 50
xmax = max(p[0] for p in pts) * 1.1
ymin, ymax = 1.0, max(3.1, max(p[1] for p in pts) + 0.1)
X = lambda x: L + (W - L - R) * x / xmax
Y = lambda y: H - B - (H - T - B) * (y - ymin) / (ymax - ymin)
colours = {1: "#1f77b4", 2: "#d62728", 3: "#2ca02c", 4: "#9467bd"}
s = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{W}" height="{H}" font-family="sans-serif" font-size="12">',
     f'<rect width="{W}" height="{H}" fill="white"/>',
     f'<text x="{W / 2}" y="20" text-anchor="middle" font-size="14">Qwen2.5-Coder-1.5B DSpark drafter: held-out τ (MBPP 1–8, γ 7) vs training</text>']
for k in range(0, int(xmax) + 1, 2):
    s.append(f'<line x1="{X(k)}" y1="{Y(ymin)}" x2="{X(k)}" y2="{Y(ymax)}" stroke="#eee"/>')
    s.append(f'<text x="{X(k)}" y="{H - B + 16}" text-anchor="middle">{k}</text>')
y = ymin
while y <= ymax + 1e-9:
    s.append(f'<line x1="{L}" y1="{Y(y)}" x2="{W - R}" y2="{Y(y)}" stroke="#eee"/>')
    s.append(f'<text x="{L - 6}" y="{Y(y) + 4}" text-anchor="end">{y:.1f}</text>')
    y += 0.5
s.append(f'<line x1="{L}" y1="{Y(3.0)}" x2="{W - R}" y2="{Y(3.0)}" stroke="#888" stroke-dasharray="5,4"/>')
s.append(f'<text x="{W - R - 4}" y="{Y(3.0) - 5}" text-anchor="end" fill="#555">issue goal τ 3.0</text>')
s.append(f'<text x="{(L + W - R) / 2}" y="{H - 12}" text-anchor="middle">block positions trained (millions)</text>')
s.append(f'<text x="16" y="{(T + H - B) / 2}" text-anchor="middle" transform="rotate(-90 16 {(T + H - B) / 2})">τ</text>')
for layers in sorted({p[2] for p in pts}):
    run = [p for p in pts if p[2] == layers]
    c = colours.get(layers, "black")
    s.append('<polyline fill="none" stroke="{}" stroke-width="2" points="{}"/>'.format(
        c, " ".join(f"{X(x):.1f},{Y(t):.1f}" for x, t, _ in run)))
    for x, t, _ in run:
        s.append(f'<circle cx="{X(x):.1f}" cy="{Y(t):.1f}" r="3.5" fill="{c}"/>')
    s.append(f'<text x="{W - R - 140}" y="{Y(1.25) + 16 * layers}" fill="{c}">{layers} draft layer{"s" if layers > 1 else ""}</text>')
s.append("</svg>")
open(out, "w").write("\n".join(s) + "\n")
print(f"wrote {out}")
