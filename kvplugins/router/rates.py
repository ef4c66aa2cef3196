"""What ``kvplugins router --measure-rates`` measures, so its predictions follow the fleet as it is:

* the pool's load rate (``Rates``), from the instances' Prometheus /metrics (our connector's series, docs/vllm.md
  "Metrics"): what it loaded (``vllm:kvplugins_loaded_bytes``) over the time of its load batches
  (``vllm:kvplugins_load_seconds`` sum), summed over the instances, counted from the first scrape of each (a
  counter that goes back, an engine restarted, starts that instance's count again), reported once MIN_LOAD_BYTES
  were seen.
* the prefill side (``Correction``, one per instance): the router's own TTFT measurements against its predictions. vLLM's metrics
  give no busy time (its per-request prefill time counts every request prefilled in the same steps for the whole
  step, so a rate from it reads several times low under load), and the engines' real speed moves with what else
  runs on their CPUs; the ratio measured / predicted over an instance's last requests (an exponentially weighted
  mean, clamped) scales that instance's predictions, so an instance whose queue runs slower than modelled (decode
  steps, batching, HTTP are not in the model) is seen as such, and early rejection tracks what requests actually
  wait.
"""

from __future__ import annotations

import re

MIN_LOAD_BYTES = 8 << 20
SERIES = {"loaded_bytes": "vllm:kvplugins_loaded_bytes_total", "load_s": "vllm:kvplugins_load_seconds_sum"}
ALPHA = 0.1  # weight of the newest request in the correction
MIN_PREDICTED_S = 0.02  # shorter predictions are mostly fixed overhead: they do not teach the correction
SCALE_RANGE = (0.25, 20.0)


def scrape(text: str) -> dict[str, float]:
    """The SERIES' values in a Prometheus text page (summed over their label sets); absent ones are 0."""
    out = dict.fromkeys(SERIES, 0.0)
    for key, name in SERIES.items():
        for m in re.finditer(rf"^{re.escape(name)}(?:{{[^}}]*}})? ([-+\d.eE]+|NaN)$", text, re.M):
            if m.group(1) != "NaN":
                out[key] += float(m.group(1))
    return out


class Rates:
    """Accumulates what each instance's scrapes add; ``load_bytes_s`` once enough was seen."""

    def __init__(self) -> None:
        self._first: dict[str, dict[str, float]] = {}  # url -> its values at the first scrape (or after a restart)
        self._now: dict[str, dict[str, float]] = {}
        self._banked = dict.fromkeys(SERIES, 0.0)  # what restarted instances had added before their restart

    def add(self, url: str, values: dict[str, float]) -> None:
        last = self._now.get(url)
        if last is None or any(values[k] < last[k] for k in SERIES):  # new, or its counters began again
            if last is not None:
                for k in SERIES:
                    self._banked[k] += last[k] - self._first[url][k]
            self._first[url] = dict(values)
        self._now[url] = dict(values)

    def _seen(self, key: str) -> float:
        return self._banked[key] + sum(self._now[u][key] - self._first[u][key] for u in self._now)

    def load_bytes_s(self) -> float | None:
        loaded, seconds = self._seen("loaded_bytes"), self._seen("load_s")
        return loaded / seconds if loaded >= MIN_LOAD_BYTES and seconds > 0 else None


class Correction:
    """measured / predicted TTFT, an exponentially weighted mean over the served requests (1.0 until one was)."""

    def __init__(self) -> None:
        self.scale = 1.0
        self.samples = 0

    def observe(self, predicted_s: float, measured_s: float) -> None:
        if predicted_s < MIN_PREDICTED_S:
            return
        ratio = min(max(measured_s / predicted_s, SCALE_RANGE[0]), SCALE_RANGE[1])
        self.scale = ratio if not self.samples else (1 - ALPHA) * self.scale + ALPHA * ratio
        self.samples += 1
