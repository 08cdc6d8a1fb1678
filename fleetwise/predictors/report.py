"""HTML reports of failure predictions: probability and signals around each failure, lead-time CDF.

Plots are matplotlib PNGs embedded as base64, so the report is one self-contained file.
"""

from __future__ import annotations

import base64
import html
import io
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from fleetwise.predictors.features import FEATURE_NAMES

SIGNALS_TO_PLOT = ("temp_residual_6h", "sbe_vol_24h", "sbe_active_6h", "mem_repairs_24h", "nvl_crc_flit_24h",
                   "pcie_replay_24h", "clock_ratio_6h", "thermal_duty_6h")
MAX_FAILURE_PLOTS = 24
WINDOW_BEFORE_H, WINDOW_AFTER_H = 72.0, 6.0


def _png(fig: Any) -> str:
    import matplotlib.pyplot as plt

    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=80, bbox_inches="tight")
    plt.close(fig)
    return base64.b64encode(buf.getvalue()).decode("ascii")


def _get(p: Any, name: str) -> Any:
    return p.get(name) if isinstance(p, Mapping) else getattr(p, name, None)


def lead_time_cdf_png(leads_h: Sequence[float], n_failures: int) -> str:
    """CDF of alert lead times over all failures (failures never caught keep it below 1)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.2))
    if leads_h and n_failures:
        xs = np.sort(np.asarray(leads_h))
        ax.step(xs, np.arange(1, len(xs) + 1) / n_failures, where="post")
    for x, label in ((0.5, "30 min"), (12, "12 h")):
        ax.axvline(x, color="grey", ls=":", lw=1)
        ax.text(x, 0.02, label, fontsize=7, color="grey")
    ax.set_xscale("symlog", linthresh=1)
    ax.set_xlabel("lead time (h)")
    ax.set_ylabel("share of failures caught")
    ax.set_ylim(0, 1)
    ax.set_title("lead-time CDF")
    return _png(fig)


def failure_png(title: str, t_h: np.ndarray, prob: np.ndarray, signals: dict[str, np.ndarray],
                alerts_h: Sequence[float], hi: float | None) -> str:
    """Probability (top) and signals (bottom) against hours relative to the failure."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a1, a2) = plt.subplots(2, 1, figsize=(7, 4), sharex=True)
    a1.plot(t_h, prob, lw=1.2)
    if hi is not None:
        a1.axhline(hi, color="red", ls=":", lw=1)
    for x in alerts_h:
        a1.axvline(x, color="orange", lw=1)
    a1.set_ylim(0, 1.02)
    a1.set_ylabel("p(fail)")
    a1.set_title(title, fontsize=9)
    for name, values in signals.items():
        scale = np.nanmax(np.abs(values)) if np.isfinite(values).any() else 1.0
        if not scale:
            continue
        a2.plot(t_h, values / scale, lw=1, label=f"{name} (max {scale:.3g})")
    a2.set_ylabel("signal / max")
    a2.set_xlabel("hours relative to failure")
    a2.legend(fontsize=6, loc="upper left")
    for ax in (a1, a2):
        ax.axvline(0, color="black", lw=1)
    return _png(fig)


def backtest_report_html(
    metrics: Mapping[str, Any],
    labels: Sequence[Mapping[str, Any]],
    keys: Sequence[tuple[str, int]],
    ts: np.ndarray,
    probs: np.ndarray,
    features: np.ndarray,
    predictions: Sequence[Any],
) -> str:
    """Backtest report (HTML, plots embedded): metrics table, lead-time CDF, a panel per failure."""
    from fleetwise.predictors.backtest import metrics_rows

    f = metrics.get("failure", metrics)
    rows_by_key: dict[tuple[str, int], list[int]] = {}
    for i, k in enumerate(keys):
        rows_by_key.setdefault((k[0], int(k[1])), []).append(i)
    raises: dict[tuple[str, int], list[float]] = {}
    for p in predictions:
        if _get(p, "type") == "failure" and _get(p, "alert"):
            raises.setdefault((_get(p, "node"), int(_get(p, "gpu"))), []).append(float(_get(p, "ts")))
    cols = {n: FEATURE_NAMES.index(n) for n in SIGNALS_TO_PLOT}
    hi = (metrics.get("policy") or {}).get("hi")
    panels = []
    fails = sorted((lab for lab in labels if lab.get("kind") == "failure"), key=lambda x: x["ts"])
    for lab in fails[:MAX_FAILURE_PLOTS]:
        key = (lab["node"], int(lab["gpu"]))
        idx = np.array(rows_by_key.get(key, []), dtype=np.int64)
        if len(idx) == 0:
            continue
        rel = (ts[idx] - float(lab["ts"])) / 3600.0
        win = (rel >= -WINDOW_BEFORE_H) & (rel <= WINDOW_AFTER_H)
        idx, rel = idx[win], rel[win]
        sig = {n: features[idx, c] for n, c in cols.items() if np.nan_to_num(features[idx, c]).any()}
        alerts = [(t - float(lab["ts"])) / 3600 for t in raises.get(key, [])
                  if -WINDOW_BEFORE_H <= (t - float(lab["ts"])) / 3600 <= WINDOW_AFTER_H]
        pre = lab.get("precursor_start_ts")
        abrupt = lab.get("abrupt") or pre is None
        pre_txt = "abrupt" if abrupt else f"precursor {(lab['ts'] - pre) / 3600:.1f} h"
        title = f"{lab['node']}/{lab['gpu']} {lab.get('class')} ({pre_txt})"
        panels.append((title, failure_png(title, rel, probs[idx], sig, alerts[:1], hi)))
    leads = [r["lead_h"] for r in f.get("failure_rows", []) if r["lead_h"] is not None]
    cdf = lead_time_cdf_png(leads, f.get("failures", 0))
    table = "".join(f"<tr><td>{html.escape(a)}</td><td>{html.escape(b)}</td><td>{html.escape(c)}</td></tr>"
                    for a, b, c in metrics_rows(metrics))
    body = [
        "<html><head><meta charset='utf-8'><title>Fleetwise backtest</title>",
        "<style>body{font-family:sans-serif;margin:2em}td,th{padding:2px 8px;border-bottom:1px solid #ddd}"
        "img{margin:4px}</style></head><body>",
        "<h1>Failure predictor backtest</h1>",
        f"<p>model {html.escape(str((metrics.get('model') or {}).get('version')))}; "
        f"horizon {f.get('horizon_h')} h</p>",
        f"<table><tr><th>metric</th><th>value</th><th>target</th></tr>{table}</table>",
        f"<h2>Lead time</h2><img src='data:image/png;base64,{cdf}'>",
        f"<h2>Around each failure (first {MAX_FAILURE_PLOTS})</h2>",
        "<p>Top: calibrated probability of failing within the horizon; orange: first alert; "
        "black: failure. Bottom: signals scaled to their maximum.</p>",
    ]
    body += [f"<img title='{html.escape(t)}' src='data:image/png;base64,{png}'>" for t, png in panels]
    body.append("</body></html>")
    return "\n".join(body)


def trends_html(rows: Sequence[Any]) -> str:
    """Report section: thermal headroom and utilisation per site over time (plots) and each
    rack's latest hour (table), from `FleetTrends` rows (objects or dicts)."""
    if not rows:
        return ""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    t0 = min(float(_get(r, "hour_ts")) for r in rows)
    fig, (ax_h, ax_u) = plt.subplots(1, 2, figsize=(11, 3))
    for site in sorted({_get(r, "name") for r in rows if _get(r, "scope") == "site"}):
        mine = sorted((r for r in rows if _get(r, "scope") == "site" and _get(r, "name") == site),
                      key=lambda r: _get(r, "hour_ts"))
        hours = [(float(_get(r, "hour_ts")) - t0) / 3600 for r in mine]
        line, = ax_h.plot(hours, [_get(r, "headroom_at_tdp_mean_c") for r in mine], label=f"{site} mean")
        ax_h.plot(hours, [_get(r, "headroom_at_tdp_min_c") for r in mine], "--", color=line.get_color(),
                  label=f"{site} least")
        ax_u.plot(hours, [_get(r, "util_mean_pct") for r in mine], label=site)
    ax_h.set_title("thermal headroom at full power (C)", fontsize=9)
    ax_u.set_title("GPU utilisation, mean (%)", fontsize=9)
    for ax in (ax_h, ax_u):
        ax.set_xlabel("hours")
        ax.legend(fontsize=7)
    plot = _png(fig)
    last: dict[str, Any] = {}
    for r in rows:
        if _get(r, "scope") == "rack":
            last[_get(r, "name")] = r  # rows come in event-time order
    cols = ("name", "site", "gpus", "headroom_min_c", "headroom_at_tdp_min_c", "hottest",
            "drift_mean_c_per_day", "headroom_trend_c_per_h", "util_mean_pct", "util_trend_pct_per_h")
    head = ("rack", "site", "GPUs", "headroom now, least (C)", "at full power, least (C)", "hottest",
            "drift (C/day)", "headroom trend (C/h)", "utilisation (%)", "utilisation trend (%/h)")
    table = ["<table border='1' cellpadding='3' style='border-collapse:collapse;font-size:12px'><tr>"
             + "".join(f"<th>{h}</th>" for h in head) + "</tr>"]
    order = sorted(last.values(), key=lambda r: (_get(r, "headroom_at_tdp_min_c") is None,
                                                 _get(r, "headroom_at_tdp_min_c") or 0.0))
    for r in order:
        table.append("<tr>" + "".join(f"<td>{'-' if _get(r, c) is None else _get(r, c)}</td>" for c in cols)
                     + "</tr>")
    table.append("</table>")
    return ("<h2>Thermal headroom and utilisation per site and rack</h2>"
            "<p>Headroom: the thermal limit (87 C) minus the hottest sample of each hour (now) or minus "
            "the temperature each GPU's own fit gives at full power (at full power). Racks by least "
            "headroom at full power, their last hour.</p>"
            f"<img src='data:image/png;base64,{plot}'>" + "\n".join(table))


def replay_report_html(decisions: Sequence[Any], labels: Sequence[Mapping[str, Any]],
                       trends: Sequence[Any] = ()) -> str:
    """Replay report (HTML, plots embedded): failure probability over time per GPU with an alert
    or a labelled failure; thermal headroom and utilisation per site and rack (`trends`)."""
    by_gpu: dict[tuple[str, int], list[tuple[float, float, bool]]] = {}
    for d in decisions:
        if _get(d, "kind") == "prediction" and _get(d, "type") == "failure" and _get(d, "gpu") is not None:
            by_gpu.setdefault((_get(d, "node"), int(_get(d, "gpu"))), []).append(
                (float(_get(d, "ts")), float(_get(d, "probability")), bool(_get(d, "alert"))))
    fails = {(lab["node"], int(lab["gpu"])): float(lab["ts"])
             for lab in labels if lab.get("kind") == "failure"}
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = []
    interesting = sorted(set(by_gpu) | set(fails))[:MAX_FAILURE_PLOTS]
    for key in interesting:
        rows = sorted(by_gpu.get(key, []))
        fig, ax = plt.subplots(figsize=(7, 2.2))
        if rows:
            t = np.array([r[0] for r in rows])
            t0 = fails.get(key, t[-1])
            ax.plot((t - t0) / 3600, [r[1] for r in rows], ".", ms=2)
            alert_t = [(r[0] - t0) / 3600 for r in rows if r[2]]
            if alert_t:
                ax.axvline(alert_t[0], color="orange", lw=1)
        if key in fails:
            ax.axvline(0, color="black", lw=1)
        ax.set_ylim(0, 1.02)
        ax.set_title(f"{key[0]}/{key[1]}" + (" (failed at 0 h)" if key in fails else ""), fontsize=9)
        ax.set_xlabel("hours" + (" relative to failure" if key in fails else " relative to last prediction"))
        panels.append(_png(fig))
    n_alerts = sum(1 for d in decisions if _get(d, "kind") == "prediction" and _get(d, "alert"))
    body = ["<html><head><meta charset='utf-8'><title>Fleetwise replay</title></head>"
            "<body style='font-family:sans-serif'>",
            f"<h1>Replay: failure predictions</h1><p>{len(decisions)} decisions, "
            f"{n_alerts} alert predictions, {len(fails)} labelled failures. Only predictions with p at or "
            "above the watch floor, and alerts, are emitted.</p>"]
    body += [f"<img src='data:image/png;base64,{p}'>" for p in panels]
    body.append(trends_html(trends))
    body.append("</body></html>")
    return "\n".join(body)
