#!/usr/bin/env python3
"""Prints criterion's median (ns) for every benchmark under target/criterion, one per line.

criterion prints the mean's confidence interval on the terminal; the brief's targets are
medians, which criterion keeps in <target>/criterion/<group>/<bench>/new/estimates.json.
Usage: scripts/bench-medians.py [$CARGO_TARGET_DIR (default: target)]
Exits 1 when it finds no estimates (no `cargo bench` ran into that directory), rather than
printing nothing as if that were a result.
"""
import json, os, sys

root = os.path.join(sys.argv[1] if len(sys.argv) > 1 else "target", "criterion")
rows = []
for dirpath, _, files in os.walk(root):
    if "estimates.json" in files and os.path.basename(dirpath) == "new":
        with open(os.path.join(dirpath, "estimates.json")) as f:
            est = json.load(f)
        with open(os.path.join(dirpath, "benchmark.json")) as f:
            name = json.load(f)["full_id"]
        m = est["median"]
        rows.append((name, m["point_estimate"], m["confidence_interval"]["lower_bound"], m["confidence_interval"]["upper_bound"]))
if not rows:
    sys.exit(f"no criterion estimates under {root}: run `cargo bench` first")
for name, med, lo, hi in sorted(rows):
    print(f"{name}\t{med:.1f}\t[{lo:.1f} .. {hi:.1f}]")
