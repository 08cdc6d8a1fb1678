"""Thermal headroom and utilisation trends per GPU, rack and site.

Per closed feature hop of a GPU (fleetwise.predictors.features):

- `headroom_c`: the thermal limit minus the hop's hottest sample (how close it runs now);
- `headroom_at_tdp_c`: the limit minus the temperature the GPU's 6 h temperature-on-power fit
  gives at full power (`temp_at_tdp_c`): the part of the headroom that does not depend on the
  load it happens to carry, so an idle GPU in a hot aisle shows it too;
- `drift_c_per_day`: how fast the full-power temperature rises (`temp_at_tdp_drift_c_per_h`: the
  6 h fit against the 72 h fit over their lag difference): a cooling fault, a clogged filter or
  a drying thermal interface.

`ThermalHeadroom` turns these into `thermal` predictions per GPU: the chance that the GPU runs
out of headroom at full power within `horizon_h` (the drift carried forward, a normal forecast
error of `sigma_c`), and at least the chance that it has none now; said when it changes band.
They inform (report, dashboards, placement); no command acts on them, so `alert` is false.

`FleetTrends` rolls the hops up per rack and per site by event-time hour: GPUs seen, headroom
(minimum, mean; now and at full power), drift, utilisation, and the least-squares trends of the
hourly means over the last `trend_hours`. A roll-up needs every GPU of its group, so it runs where
all telemetry passes (`fleetwise replay`, `demo`); a stream worker sees its partitions only and
leaves the roll-up to Prometheus (per-GPU gauges, summed by rack and site: docs/predictors.md).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np
from scipy.special import ndtr

from fleetwise.predictors.features import FEATURE_NAMES
from fleetwise.schemas import Prediction, Signal

# "GPU Max Operating Temp" of `nvidia-smi -q` on A100 / H100 SXM (87 C): where the software
# thermal slowdown starts (SwThermal), the same limit the simulator uses (fleetwise/sim/fleet.py).
THERMAL_LIMIT_C = 87.0
_COL = {n: FEATURE_NAMES.index(n) for n in ("temp_max", "temp_at_tdp_c", "temp_at_tdp_drift_c_per_h",
                                           "util_mean", "thermal_duty_6h")}


@dataclass(frozen=True)
class TrendConfig:
    limit_c: float = THERMAL_LIMIT_C
    horizon_h: float = 24.0  # the forecast's reach
    sigma_c: float = 2.0  # forecast error of the full-power temperature (fit and sensor noise)
    # A GPU's thermal predictions: when its chance moves into another band (the first is the
    # floor below which nothing is said), falls ones after `lower_hops` hops, and a heartbeat.
    bands: tuple[float, ...] = (0.2, 0.5, 0.9)
    lower_hops: int = 3
    heartbeat_s: float = 86400.0
    trend_hours: int = 6  # hourly means a group's trend is fitted over
    close_after_s: float = 900.0  # an hour's roll-up closes this long after it ends (hop lateness)


@dataclass
class HopHeadroom:
    """Per-row thermal headroom of closed hops (arrays, one value per row; NaN: not known)."""

    headroom_c: np.ndarray
    headroom_at_tdp_c: np.ndarray
    drift_c_per_day: np.ndarray
    util_pct: np.ndarray
    thermal_duty: np.ndarray
    probability: np.ndarray  # of no headroom at full power within horizon_h


def hop_headroom(features: np.ndarray, config: TrendConfig = TrendConfig()) -> HopHeadroom:
    """Headroom, its drift and the chance it is gone within the horizon, for rows of the full
    FEATURE_NAMES matrix."""
    with np.errstate(invalid="ignore"):
        at_tdp = features[:, _COL["temp_at_tdp_c"]]
        drift_per_h = features[:, _COL["temp_at_tdp_drift_c_per_h"]]
        ahead = config.limit_c - (at_tdp + np.nan_to_num(drift_per_h) * config.horizon_h)
        headroom_now = config.limit_c - features[:, _COL["temp_max"]]
        # A GPU at its limit now has none within the horizon either (a throttled GPU is pinned
        # at its target, so its fit at full power reads low).
        prob = np.fmax(ndtr(-ahead / config.sigma_c), ndtr(-headroom_now / config.sigma_c))
    return HopHeadroom(
        headroom_c=headroom_now,
        headroom_at_tdp_c=config.limit_c - at_tdp,
        drift_c_per_day=drift_per_h * 24.0,
        util_pct=features[:, _COL["util_mean"]],
        thermal_duty=features[:, _COL["thermal_duty_6h"]],
        probability=prob,
    )


def _num(x: float) -> float | None:
    return None if np.isnan(x) else round(float(x), 2)


@dataclass
class _Watch:
    band: int  # the band last emitted (index into TrendConfig.bands, +1; 0: cleared)
    last_ts: float  # event time of the last prediction
    lower: int = 0  # consecutive hops in a lower band since


class ThermalHeadroom:
    """`thermal` predictions per GPU when its chance of running out of headroom changes band
    (`bands`: 0.2, 0.5, 0.9): at once when it rises, after `lower_hops` hops below half the
    band's threshold when it falls (a record under half the lowest clears the GPU), and once per
    `heartbeat_s` while it stays watched. A hot fleet holds many GPUs near their limit for days:
    one record per change says what one per hop would."""

    def __init__(self, config: TrendConfig | None = None) -> None:
        self.config = config or TrendConfig()
        self._watch: dict[tuple[str, int], _Watch] = {}  # (node, gpu) -> what was last said of it

    def process_arrays(
        self, keys: Sequence[tuple[str, int]], ts: np.ndarray, features: np.ndarray,
        job_ranks: Sequence[tuple[str | None, int | None]] | None = None,
    ) -> tuple[list[Prediction], HopHeadroom]:
        """Predictions for closed hops (event-time order per GPU) and every row's headroom."""
        cfg = self.config
        hops = hop_headroom(features, cfg)
        prob = np.nan_to_num(hops.probability)
        band = np.searchsorted(np.asarray(cfg.bands), prob, side="right")
        # A band is left below half its threshold (a chance hovering at 0.2 is said once).
        band_low = np.searchsorted(np.asarray(cfg.bands) / 2.0, prob, side="right")
        out: list[Prediction] = []
        watched = self._watch
        # The rows of GPUs watched already or from this call on (their later rows may fall or clear).
        rows = band > 0
        gpus = set(watched).union(keys[i] for i in np.flatnonzero(rows))
        if gpus:
            rows |= np.fromiter((k in gpus for k in keys), dtype=bool, count=len(keys))
        for i in np.flatnonzero(rows):
            key = keys[i]
            b, t = int(band[i]), float(ts[i])
            w = watched.get(key)
            if w is None:
                if b == 0:
                    continue
                watched[key] = _Watch(b, t)
            elif b > w.band or (b == w.band and t - w.last_ts >= cfg.heartbeat_s):
                w.band, w.last_ts, w.lower = b, t, 0
            elif band_low[i] < w.band:
                w.lower += 1
                if w.lower < cfg.lower_hops:
                    continue
                b = int(band_low[i])  # the band it is in now, by the falling thresholds
                w.band, w.last_ts, w.lower = b, t, 0
                if b == 0:
                    del watched[key]
            else:
                w.lower = 0
                continue
            out.append(self._prediction(key, t, hops, i, job_ranks))
        return out, hops

    def _prediction(self, where: tuple[str, int], t: float, hops: HopHeadroom, i: int,
                    job_ranks: Sequence[tuple[str | None, int | None]] | None) -> Prediction:
        cfg = self.config
        key = f"{where[0]}/{where[1]}"
        job, rank = job_ranks[i] if job_ranks is not None else (None, None)
        p = float(np.nan_to_num(hops.probability[i]))
        drift = _num(hops.drift_c_per_day[i])
        peak = "" if np.isnan(hops.headroom_c[i]) else \
            f" peaked at {cfg.limit_c - hops.headroom_c[i]:.0f} C and"
        at_tdp = "" if np.isnan(hops.headroom_at_tdp_c[i]) else \
            f" would run at {cfg.limit_c - hops.headroom_at_tdp_c[i]:.1f} C at full power,"
        return Prediction(
            id=f"thermal:{key}:{t:.0f}", type="thermal", ts=t, node=where[0], gpu=int(where[1]), job=job,
            rank=rank, probability=round(p, 4), horizon_h=cfg.horizon_h, alert=False,
            signals=[Signal(name="headroom_at_tdp_c", value=_num(hops.headroom_at_tdp_c[i])),
                     Signal(name="drift_c_per_day", value=drift),
                     Signal(name="headroom_c", value=_num(hops.headroom_c[i])),
                     Signal(name="thermal_duty_6h", value=_num(hops.thermal_duty[i]))],
            reason=(f"{key}{peak}{at_tdp} drifting {drift or 0.0:+.2f} C/day (limit {cfg.limit_c:g} C): "
                    f"{p:.0%} chance of no headroom within {cfg.horizon_h:g} h"),
        )

    # -- state (changelogged per GPU like the other processors) ------------------------------
    def keys(self) -> list[str]:
        return [f"{node}/{gpu}" for node, gpu in self._watch]

    @staticmethod
    def _gpu(key: str) -> tuple[str, int]:
        node, _, gpu = key.rpartition("/")
        return node, int(gpu)

    def state(self, key: str) -> dict:
        w = self._watch.get(self._gpu(key))
        return {} if w is None else {"band": w.band, "last_ts": w.last_ts, "lower": w.lower}

    def restore(self, key: str, state: dict) -> None:
        if state:
            self._watch[self._gpu(key)] = _Watch(int(state["band"]), float(state["last_ts"]),
                                                 int(state.get("lower", 0)))

    def forget(self, key: str) -> None:
        self._watch.pop(self._gpu(key), None)


@dataclass
class GroupTrend:
    """One event-time hour of a rack's or a site's GPUs."""

    scope: str  # "rack" | "site"
    name: str
    site: str | None
    hour_ts: float  # start of the hour (Unix seconds)
    gpus: int
    headroom_min_c: float | None
    headroom_mean_c: float | None
    headroom_at_tdp_min_c: float | None
    headroom_at_tdp_mean_c: float | None
    hottest: str | None  # node/gpu with the least headroom at full power
    drift_mean_c_per_day: float | None
    util_mean_pct: float | None
    # Least-squares slopes of the hourly means over the last `trend_hours` (None: under 3 hours).
    headroom_trend_c_per_h: float | None = None
    util_trend_pct_per_h: float | None = None

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass
class _Bucket:
    gpus: set[str] = field(default_factory=set)
    n: int = 0
    head_sum: float = 0.0
    head_min: float = np.inf
    tdp_n: int = 0
    tdp_sum: float = 0.0
    tdp_min: float = np.inf
    hottest: str | None = None
    drift_n: int = 0
    drift_sum: float = 0.0
    util_n: int = 0
    util_sum: float = 0.0


def _slope(values: Sequence[tuple[float, float | None]]) -> float | None:
    """Least-squares slope per hour of (hour_ts, value) pairs; None under 3 known values."""
    pts = [(t / 3600.0, v) for t, v in values if v is not None]
    if len(pts) < 3:
        return None
    t = np.array([p[0] for p in pts])
    v = np.array([p[1] for p in pts])
    t = t - t.mean()
    return round(float((t * (v - v.mean())).sum() / (t * t).sum()), 3)


def _mean(total: float, n: int) -> float | None:
    return round(float(total) / n, 2) if n else None


class FleetTrends:
    """Hourly roll-ups of closed hops per rack and per site, in event time."""

    def __init__(self, config: TrendConfig | None = None) -> None:
        self.config = config or TrendConfig()
        self._open: dict[tuple[str, str, str | None, float], _Bucket] = {}
        self._history: dict[tuple[str, str], deque[GroupTrend]] = {}
        self._watermark = -np.inf

    def observe(
        self, keys: Sequence[tuple[str, int]], places: Sequence[tuple[str | None, str | None]],
        ts: np.ndarray, hops: HopHeadroom,
    ) -> list[GroupTrend]:
        """Add closed hops (`places`: each row's (rack, site)); returns the hours that closed.

        Summed per (group, hour) in numpy, then added to the open hours (a call holds a few
        hours of a few groups, and thousands of hops)."""
        n = len(keys)
        if n:
            hour = np.floor(np.asarray(ts, dtype=np.float64) / 3600.0) * 3600.0
            names = [f"{node}/{gpu}" for node, gpu in keys]
            for scope, col in (("rack", 0), ("site", 1)):
                group_of: dict[tuple[str, str | None], int] = {}  # (name, site) -> group index
                ids = (-1 if p[col] is None else group_of.setdefault((p[col], p[1]), len(group_of))
                       for p in places)
                gid = np.fromiter(ids, np.int64, n)
                rows = np.flatnonzero(gid >= 0)
                if len(rows) == 0:
                    continue
                buckets, inv = np.unique(np.stack([gid[rows], hour[rows].astype(np.int64)], axis=1), axis=0,
                                         return_inverse=True)
                inv = inv.reshape(-1)
                groups = list(group_of)
                for g, h in buckets.tolist():
                    name, site = groups[g]
                    self._open.setdefault((scope, name, site, float(h)), _Bucket())
                self._add(scope, groups, buckets, inv, rows, names, hops)
            self._watermark = max(self._watermark, float(np.max(ts)))
        return self._close(self._watermark - self.config.close_after_s)

    def _add(self, scope: str, groups: list[tuple[str, str | None]], buckets: np.ndarray, inv: np.ndarray,
             rows: np.ndarray, names: list[str], hops: HopHeadroom) -> None:
        """Fold rows (`inv`: each row's index into `buckets`, (group, hour) pairs) into the open hours."""
        k = len(buckets)

        def count_sum(values: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
            v = values[rows]
            have = ~np.isnan(v)
            return (np.bincount(inv, weights=have, minlength=k),
                    np.bincount(inv, weights=np.where(have, v, 0.0), minlength=k))

        def least(values: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
            """Per bucket the least known value and its row (-1: none known)."""
            v = values[rows]
            order = np.lexsort((np.where(np.isnan(v), np.inf, v), inv))
            first = np.flatnonzero(np.r_[True, np.diff(inv[order]) != 0])
            best = order[first]
            return np.where(np.isnan(v[best]), np.inf, v[best]), np.where(np.isnan(v[best]), -1, rows[best])

        head_n, head_sum = count_sum(hops.headroom_c)
        head_min, _ = least(hops.headroom_c)
        tdp_n, tdp_sum = count_sum(hops.headroom_at_tdp_c)
        tdp_min, tdp_row = least(hops.headroom_at_tdp_c)
        drift_n, drift_sum = count_sum(hops.drift_c_per_day)
        util_n, util_sum = count_sum(hops.util_pct)
        pairs = np.unique(np.stack([inv, rows], axis=1), axis=0)
        members: list[set[str]] = [set() for _ in range(k)]
        for b, row in pairs.tolist():
            members[b].add(names[row])
        for b, (g, h) in enumerate(buckets.tolist()):
            name, site = groups[g]
            bucket = self._open[(scope, name, site, float(h))]
            bucket.gpus |= members[b]
            bucket.n += int(head_n[b])
            bucket.head_sum += float(head_sum[b])
            bucket.head_min = min(bucket.head_min, float(head_min[b]))
            bucket.tdp_n += int(tdp_n[b])
            bucket.tdp_sum += float(tdp_sum[b])
            if tdp_row[b] >= 0 and tdp_min[b] < bucket.tdp_min:
                bucket.tdp_min, bucket.hottest = float(tdp_min[b]), names[tdp_row[b]]
            bucket.drift_n += int(drift_n[b])
            bucket.drift_sum += float(drift_sum[b])
            bucket.util_n += int(util_n[b])
            bucket.util_sum += float(util_sum[b])

    def flush(self) -> list[GroupTrend]:
        """End of input: close every open hour."""
        return self._close(np.inf)

    def _close(self, before: float) -> list[GroupTrend]:
        done = sorted((k for k in self._open if k[3] + 3600.0 <= before), key=lambda k: (k[3], k[0], k[1]))
        out = []
        for key in done:
            scope, name, site, hour = key
            b = self._open.pop(key)
            row = GroupTrend(
                scope=scope, name=name, site=site, hour_ts=hour, gpus=len(b.gpus),
                headroom_min_c=None if b.n == 0 else round(float(b.head_min), 2),
                headroom_mean_c=_mean(b.head_sum, b.n),
                headroom_at_tdp_min_c=None if b.tdp_n == 0 else round(float(b.tdp_min), 2),
                headroom_at_tdp_mean_c=_mean(b.tdp_sum, b.tdp_n), hottest=b.hottest,
                drift_mean_c_per_day=_mean(b.drift_sum, b.drift_n), util_mean_pct=_mean(b.util_sum, b.util_n),
            )
            hist = self._history.setdefault((scope, name), deque(maxlen=self.config.trend_hours))
            hist.append(row)
            row.headroom_trend_c_per_h = _slope([(r.hour_ts, r.headroom_at_tdp_mean_c) for r in hist])
            row.util_trend_pct_per_h = _slope([(r.hour_ts, r.util_mean_pct) for r in hist])
            out.append(row)
        return out
