"""WAN bandwidth planner: the link speed each method needs to keep a target compute utilization.

Model (closed form; see docs/simulator.md). Per site and direction, a ring all-reduce of B bytes over n
sites moves `2 (n-1)/n * B`. Compute utilization u = compute time / wall time.

* Data-parallel: the gradients (bf16) are reduced every step, overlapped with the backward pass (the last
  `1 - fwd_fraction` of the step). Wall per step = fwd + max(bwd, comm), so comm <= step/u - fwd.
* DiLoCo: the outer gradients are reduced every H steps, overlapped with the last step's backward pass:
  comm <= H step (1/u - 1) + bwd.
* Streaming DiLoCo: one fragment (1/P of the model) every H/P steps: comm <= (H/P) step (1/u - 1) + bwd.
* + overlap: the fragment's transfer may run under tau inner steps (the learner adopts the merged fragment
  tau steps after its snapshot): comm <= (H/P) step (1/u - 1) + tau step, with tau <= H/P.
* + int4/FP4: outer gradients at 4 bits plus one bf16 scale per block (`quant_block` parameters).

Required bandwidth = bits moved / comm budget. Latency is ignored (bandwidth-bound transfers).
"""

from __future__ import annotations

import dataclasses

METHODS = ("dp", "diloco", "streaming", "streaming_overlap", "streaming_overlap_q")
LABELS = {
    "dp": "Data-parallel",
    "diloco": "DiLoCo (H)",
    "streaming": "Streaming DiLoCo (P)",
    "streaming_overlap": "Streaming + overlap (tau)",
    "streaming_overlap_q": "Streaming + overlap + int4/FP4",
}
UTILIZATIONS = (0.5, 0.8, 0.9, 0.95, 0.99)
# Published reference cells (Streaming DiLoCo, Gbit/s: (method, target utilization) -> value), the ones this
# planner holds; compared against, never used in the model. They are for `PUBLISHED_SETTING`.
PUBLISHED_STREAMING = {("dp", 0.95): 268.3, ("streaming_overlap_q", 0.95): 1.4}
# Decoupled DiLoCo: 8 datacenters, data-parallel 198 Gbps -> 0.84 Gbps.
PUBLISHED_8DC = (198.0, 0.84)
PUBLISHED_8DC_SITES = 8


@dataclasses.dataclass(frozen=True)
class BandwidthConfig:
  """Model and schedule. Defaults: the Streaming DiLoCo 10B setting."""

  params: float = 10e9
  bytes_per_param: float = 2.0  # bf16 gradients / outer gradients
  step_s: float = 0.8
  inner_steps: int = 100  # H
  fragments: int = 8  # P
  tau: int = 5  # overlap steps
  sites: int = 2  # workers / datacenters on the WAN ring
  fwd_fraction: float = 1.0 / 3.0  # forward share of a step (backward ~ 2x forward FLOPs)
  quant_bits: int = 4
  quant_block: int = 128  # parameters per bf16 scale

  def validate(self) -> BandwidthConfig:
    """Raise ValueError naming the offending flag."""
    checks = [
        (self.params > 0, f"--params must be > 0, got {self.params}"),
        (self.bytes_per_param > 0, f"--bytes-per-param must be > 0, got {self.bytes_per_param}"),
        (self.step_s > 0, f"--step-s must be > 0, got {self.step_s}"),
        (self.inner_steps >= 1, f"--inner-steps (H) must be >= 1, got {self.inner_steps}"),
        (1 <= self.fragments <= self.inner_steps,
         f"--fragments (P) must be in [1, H={self.inner_steps}], got {self.fragments}"),
        (0 <= self.tau <= self.inner_steps // self.fragments,
         f"--tau must be in [0, H/P={self.inner_steps // self.fragments}], got {self.tau}"),
        (self.sites >= 2, f"--sites must be >= 2 (one site needs no WAN), got {self.sites}"),
        (0 <= self.fwd_fraction < 1, f"--fwd-fraction must be in [0, 1), got {self.fwd_fraction}"),
        (1 <= self.quant_bits <= 16, f"--quant-bits must be in [1, 16], got {self.quant_bits}"),
        (self.quant_block >= 1, f"--quant-block must be >= 1, got {self.quant_block}"),
    ]
    for ok, message in checks:
      if not ok:
        raise ValueError(message)
    return self

  @property
  def ring_factor(self) -> float:
    return 2.0 * (self.sites - 1) / self.sites

  @property
  def quant_bytes_per_param(self) -> float:
    return self.quant_bits / 8.0 + 2.0 / self.quant_block


def bits_and_budget(cfg: BandwidthConfig, method: str, utilization: float) -> tuple[float, float]:
  """(bits one site sends per sync, seconds the sync may take) for `method` at `utilization`."""
  if not 0 < utilization <= 1:
    raise ValueError(f"--utilization must be in (0, 1], got {utilization}")
  step, u = cfg.step_s, utilization
  bwd = (1.0 - cfg.fwd_fraction) * step
  full_bits = 8.0 * cfg.ring_factor * cfg.params * cfg.bytes_per_param
  every = cfg.inner_steps / cfg.fragments * step  # streaming: one fragment every H/P steps
  if method == "dp":
    return full_bits, step / u - cfg.fwd_fraction * step
  if method == "diloco":
    return full_bits, cfg.inner_steps * step * (1.0 / u - 1.0) + bwd
  if method == "streaming":
    return full_bits / cfg.fragments, every * (1.0 / u - 1.0) + bwd
  if method in ("streaming_overlap", "streaming_overlap_q"):
    bits = full_bits / cfg.fragments
    if method == "streaming_overlap_q":
      bits *= cfg.quant_bytes_per_param / cfg.bytes_per_param
    # At tau = 0 the transfer can still hide under the snapshot step's backward pass.
    return bits, every * (1.0 / u - 1.0) + max(cfg.tau * step, bwd)
  raise ValueError(f"unknown method {method!r}; expected one of {METHODS}")


def required_gbps(cfg: BandwidthConfig, method: str, utilization: float) -> float:
  """WAN bandwidth (Gbit/s per site and direction) that keeps `utilization` for `method`."""
  bits, budget = bits_and_budget(cfg, method, utilization)
  return bits / budget / 1e9


def utilization_at(cfg: BandwidthConfig, method: str, gbps: float, tol: float = 1e-6) -> float:
  """Inverse of `required_gbps`: the utilization a `gbps` link gives (bisection; the requirement falls
  monotonically as the target utilization falls)."""
  lo, hi = 1e-6, 1.0
  if required_gbps(cfg, method, hi) <= gbps:
    return 1.0
  while hi - lo > tol:
    mid = 0.5 * (lo + hi)
    if required_gbps(cfg, method, mid) <= gbps:
      lo = mid
    else:
      hi = mid
  return lo


# The fields that define the published cells' setting (the others are this model's own assumptions).
_PUBLISHED_FIELDS = ("params", "bytes_per_param", "step_s", "inner_steps", "fragments", "tau", "sites",
                     "quant_bits")


def published_mismatch(cfg: BandwidthConfig) -> str | None:
  """Why `cfg` is not the setting of the published cells (None when it is): they hold for the defaults of
  `BandwidthConfig` (10B params, 0.8 s/step, 2 sites, H=100, P=8, tau=5, 4-bit)."""
  ref = BandwidthConfig()
  diffs = [f"{f}={getattr(cfg, f):g} (published: {getattr(ref, f):g})" for f in _PUBLISHED_FIELDS
           if getattr(cfg, f) != getattr(ref, f)]
  return ", ".join(diffs) or None


def published_cells(cfg: BandwidthConfig) -> list[dict]:
  """Every published cell beside this model's value for it and the difference, in the published setting
  (empty when `cfg` is another setting: then nothing published applies)."""
  if published_mismatch(cfg) is not None:
    return []
  cells = []
  for (method, u), pub in PUBLISHED_STREAMING.items():
    ours = required_gbps(cfg, method, u)
    cells.append({"method": method, "label": LABELS[method], "utilization": u, "ours": ours, "published": pub,
                  "diff_pct": 100.0 * (ours / pub - 1.0)})
  return cells


def table(cfg: BandwidthConfig, utilizations=UTILIZATIONS) -> list[dict]:
  """Rows of required Gbps per method and target utilization."""
  cfg.validate()
  return [{"method": method, "label": LABELS[method],
           "gbps": {f"{u:g}": required_gbps(cfg, method, u) for u in utilizations}} for method in METHODS]


def sites_figure(cfg: BandwidthConfig, utilization: float = 0.95) -> dict:
  """This model over `cfg.sites` sites: data-parallel against Decoupled DiLoCo (streaming + overlap +
  low-bit outer gradients), and the reduction."""
  g = {m: required_gbps(cfg, m, utilization) for m in METHODS}
  return {"sites": cfg.sites, "utilization": utilization, "gbps": g,
          "reduction": g["dp"] / g["streaming_overlap_q"]}


def eight_datacenter_figure(cfg: BandwidthConfig, utilization: float = 0.95,
                            dp_gbps: float = PUBLISHED_8DC[0]) -> dict:
  """The published figure, reproduced: how a data-parallel requirement of `dp_gbps` across 8 sites falls
  under Decoupled DiLoCo. Always 8 sites, as published (whatever `cfg.sites`); the schedule, step time
  and quantization are `cfg`'s.

  The size of the model is not published with the figure, so it is solved for: the parameter count whose
  data-parallel requirement at this step time and utilization is `dp_gbps`. Then the same model under
  streaming + overlap + int4 gives the Decoupled DiLoCo requirement. The ratio between the two does not
  depend on the model size.
  """
  eight = dataclasses.replace(cfg, sites=PUBLISHED_8DC_SITES).validate()
  per_param = required_gbps(dataclasses.replace(eight, params=1.0), "dp", utilization)
  params = dp_gbps / per_param
  sized = dataclasses.replace(eight, params=params)
  ours = {m: required_gbps(sized, m, utilization) for m in METHODS}
  return {
      "sites": PUBLISHED_8DC_SITES, "utilization": utilization, "solved_params": params, "gbps": ours,
      "reduction": ours["dp"] / ours["streaming_overlap_q"],
      "published": {"dp": PUBLISHED_8DC[0], "decoupled": PUBLISHED_8DC[1],
                    "reduction": PUBLISHED_8DC[0] / PUBLISHED_8DC[1]},
  }
