"""One result row of te_step: a variant at a recipe (``te_step.json``'s ``results`` entries).

Fields left ``None`` are not written to the JSON (a variant that failed has no timings; only
``--gpu-only`` runs have ``gpu_only_ms``, ...), so the JSON keys are those of earlier runs.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from .timing import TIMES


@dataclass
class Row:
    """What te_step measured and observed for one variant at one recipe."""

    # identity
    recipe: str
    variant: str  # JSON name, e.g. "ours_fsdp_bf16_masters"
    key: str  # "a" ... "e"
    status: str | None = None  # "ok", "OOM" or "error"
    error: str | None = None
    traceback: str | None = None
    warning: str | None = None  # "; "-joined: weights not FP8, non-finite loss, ...
    # setup (the variant's notes; see variants.py)
    weights_after_init: dict | None = None
    weights_after_shard: dict | None = None
    weights_in_forward: dict | None = None
    weights_after_steps: dict | None = None
    fp8_weights: str | None = None
    optimizer: str | None = None
    fp8_shards_ok: bool | None = None
    fp8_shards: str | None = None
    requantize_graph: dict | None = None  # {"replays": n, "disabled_reason": str | None}
    setup_s: float | None = None
    variant_wall_s: float | None = None
    # memory, GiB, minus what was allocated before the variant was built
    allocated_before_gib: float | None = None
    after_setup_gib: float | None = None
    warmup_peak_gib: float | None = None
    step_peak_gib: float | None = None  # the peak over the timed steps (the tables' figure)
    variant_peak_gib: float | None = None
    resident_gib: float | None = None
    allocated_after_free_gib: float | None = None
    cleanup_error: str | None = None
    # per-step times of the first timed steps (timing.TIMES), and of the interleaved rounds
    step_ms: list | None = None
    fwd_bwd_ms: list | None = None
    host_ms: list | None = None
    wall_ms: list | None = None
    round_step_ms: list | None = None
    round_fwd_bwd_ms: list | None = None
    round_host_ms: list | None = None
    round_wall_ms: list | None = None
    # medians of the rounds when there were rounds, else of the first timed steps
    median_ms: float | None = None
    min_ms: float | None = None
    median_fwd_bwd_ms: float | None = None
    median_opt_ms: float | None = None
    median_host_ms: float | None = None
    median_wall_ms: float | None = None
    tokens_per_s: float | None = None  # at median_ms (benchmarks/shapes.py)
    mfu: float | None = None  # torchtitan's FLOPs per token over the dense bf16 peak
    gpu_only_ms: list | None = None
    median_gpu_only_ms: float | None = None
    host_split_ms: dict | None = None
    profile: dict | None = None
    host_profile: dict | None = None  # --host-profile: benchmarks/host_profile.py's summary
    # training sanity
    loss_first: float | None = None
    loss_last: float | None = None
    losses_finite: bool | None = None
    extra: dict = field(default_factory=dict)  # notes of a variant not named above

    @property
    def ok(self) -> bool:
        return self.status == "ok"

    def add_warning(self, msg: str) -> None:
        self.warning = msg if not self.warning else f"{self.warning}; {msg}"

    def add_notes(self, notes: dict) -> None:
        """A variant's setup notes, into their fields (unknown ones into :attr:`extra`)."""
        names = {f.name for f in dataclasses.fields(self)}
        for k, v in notes.items():
            if v is None:
                continue
            if k == "warning":
                self.add_warning(v)
            elif k in names:
                setattr(self, k, v)
            else:
                self.extra[k] = v

    def first_times(self) -> dict[str, list]:
        """The lists :func:`timing.timed_steps` appends the first timed steps to."""
        for k in TIMES:
            if getattr(self, k) is None:
                setattr(self, k, [])
        return {k: getattr(self, k) for k in TIMES}

    def round_times(self) -> dict[str, list]:
        """The lists of the interleaved rounds."""
        for k in TIMES:
            if getattr(self, f"round_{k}") is None:
                setattr(self, f"round_{k}", [])
        return {k: getattr(self, f"round_{k}") for k in TIMES}

    def set_medians(self, values: dict[str, float]) -> None:
        for k, v in values.items():
            setattr(self, k, v)

    def to_json(self) -> dict:
        """The JSON entry: every field that was set (``extra`` merged in)."""
        out = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)
               if f.name != "extra" and getattr(self, f.name) is not None}
        out.update(self.extra)
        return out
