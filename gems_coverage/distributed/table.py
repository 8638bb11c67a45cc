"""The distributed result as a table (the JSON is the full record)."""
from __future__ import annotations

import statistics


def format_table(d: dict) -> str:
    from tabulate import tabulate
    lines = [f"distributed  {d['model']} ({d['size']}) {d['strategy']} on {d['world_size']} x {d['device_kind']} "
             f"({d['backend']}), params {d['param_dtype']}, compute {d['compute_dtype']}"
             f"{', activation checkpointing' if d['checkpointing'] else ''}; global batch {d['batch']} x "
             f"{d['seq_len']} tokens, {d['steps']} steps, AdamW lr {d['lr']}, clip {d['clip']}"]
    lines.append(f"data         {d['data']}")
    runs = d["runs"]
    ag = d.get("agreement")
    if ag:
        rows = [[r["step"], f"{r['aten_loss']:.6f}", f"{r['gems_loss']:.6f}", f"{r['rel_err']:.1e}",
                 "ok" if r["ok"] else "FAIL", f"{r['aten_grad_norm']:.4g}", f"{r['gems_grad_norm']:.4g}"]
                for r in ag["steps"]]
        lines += ["", tabulate(rows, headers=["step", "ATen loss", "Gems loss", "rel err", "loss", "ATen |g|",
                                              "Gems |g|"], tablefmt="simple", disable_numparse=True)]
    else:
        for m, r in runs.items():
            lines.append(f"{m} losses  " + " ".join(f"{x:.4f}" for x in r["losses"]))
    lines.append("")
    summ = []
    for m, r in runs.items():
        summ.append([m, "-" if r["tokens_per_s"] is None else f"{r['tokens_per_s']:.1f}",
                     "-" if not r["step_ms"][d["warmup"]:] else f"{statistics.median(r['step_ms'][d['warmup']:]):.2f}",
                     ", ".join(f"{x:.0f}" for x in r["peak_mib"])])
    lines.append(tabulate(summ, headers=["run", "tokens/s", "ms/step (median)", "peak MiB per rank"],
                          tablefmt="simple", disable_numparse=True))
    if d.get("throughput_ratio") is not None:
        lines.append(f"ratio        {d['throughput_ratio']:.3f} (Gems tokens/s / ATen's; > 1: Gems is faster)")
    ops = d.get("ops")
    if ops:
        lines.append(f"ops          step 0, every rank: Gems served {ops['served_compute_ops']} of {ops['compute_ops']} "
                     f"compute ops; collectives: " + (", ".join(f"{c['op']} ({sum(c['calls_per_rank'].values())})"
                                                             for c in ops["collectives"]) or "none seen"))
        if ops["wrapper_ops"]:
            lines.append(f"around       {d['strategy']}'s own ops (its Python code): " + ", ".join(
                f"{o['op']} x{o['calls']} (" + (", ".join(f"inside: {k} {v}" for k, v in o["inner_aten_ops"].items())
                                                if "inner_aten_ops" in o else o["gems"]) + ")"
                for o in ops["wrapper_ops"] if o["category"] != "creation"))
        if ops["gaps"]:
            lines.append("gaps         " + "; ".join(
                f"{o['op']} ({o['gems']}{': ' + ', '.join(o['fallback_reasons']) if o['fallback_reasons'] else ''};"
                f" from {', '.join(sorted(o['origins']))}{', inside ' + o['inside'] if o.get('inside') else ''})"
                for o in ops["gaps"]))
    for f in d.get("faults") or []:
        lines.append(f"fault        rank {f['rank']}: aten::{f['op']} {', '.join(f'{k} x{v}' for k, v in f['reasons'].items())}"
                     f" -> ATen served those calls on that rank; the others went on")
    div = d.get("first_divergence")
    if div:
        lines.append(f"FIRST DIVERGENT OP  aten::{div['op']}  (rank {div['rank']}, {div['phase']}, call #{div['index']})")
        lines.append(f"  inputs  {div['inputs']}")
        lines.append(f"  output  {div['output']}: max abs err {div['max_abs']:.3e} > allowed {div['allowed']:.3e}")
    elif d.get("shadow_ran"):
        lines.append(f"shadow       {d['shadow_calls']} calls compared op by op on every rank: no divergence")
    for n in d["notes"]:
        lines.append(f"note         {n}")
    if ag:
        lines.append(f"verdict      {d['verdict']}: {len(ag['steps']) - ag['failing_steps']}/"
                     f"{len(ag['steps'])} steps' losses agree (max rel err {ag['max_rel_err']:.1e}); "
                     f"grad norms max rel err {ag['grad_norm_max_rel_err']:.1e}")
    return "\n".join(lines) + "\n"
