"""Pipeline schedules: what the cost model, the search, the checks and the runtime know of each one
(its event order for the simulator is in costmodel/schedule_orders.py)."""
from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum
from functools import lru_cache


class Schedule(StrEnum):
    GPIPE = "gpipe"
    ONE_F_ONE_B = "1f1b"
    INTERLEAVED = "interleaved-1f1b"
    ZB_H1 = "zb-h1"
    ZBV = "zbv"
    DUALPIPEV = "dualpipev"

    @property
    def traits(self) -> "ScheduleTraits":
        return SCHEDULE_TRAITS[self]

    @property
    def defers_weight_grad(self) -> bool:
        """Zero-bubble schedules split backward and run the weight-gradient pass later."""
        return self.traits.defers_weight_grad


@dataclass(frozen=True, kw_only=True)
class ScheduleTraits:
    """What the cost model, the search, the checks and the runtime need to know of a pipeline
    schedule: the one place a schedule is described (its event order for the simulator lives in
    costmodel/schedule_orders.py, its torch class is named here)."""

    description: str
    # closed form m·T + (Σf - max f)/v (costmodel.pipeline_closed_form.closed_form_s); None: simulation only
    fill: str | None                 # "stage": f = a rank's micro-batch time; "zero-bubble": F + B - W
    fill_divided_by_vpp: bool = False   # interleaving shrinks the fill by the virtual stages
    min_vpp: int = 1
    max_vpp: int | None = 1          # None: any
    needs_pp: bool = False           # meaningless on one pipeline rank
    micro_batches_multiple_of_pp: bool = False
    # torch 2.13's own rules on the micro-batch count m: Schedule1F1B needs m >= pp stages; the
    # round-based runtime schedules (InterleavedZeroBubble with one stage per rank) need m to be a
    # whole number of rounds of max(1, m // pp) (an interleaved plan's m % pp == 0 implies it)
    micro_batches_at_least_pp: bool = False
    micro_batches_whole_rounds: bool = False
    micro_batches_at_least_stages: bool = False   # m >= pp·vpp (torch's ScheduleDualPipeV)
    v_placement: bool = False        # virtual stages placed down then up the ranks (V), else in a loop
    in_flight: str = "1f1b"          # activations held at the peak: "all" | "1f1b" | "interleaved" | "v" | "dualpipev"
    deferred_chunks_per_rank: int = 0   # weight passes put off at once: (this) · rank + 1 chunks; 0: none
    # torch 2.13's zero-bubble split backward: W passes re-enter selective regions and fail, and
    # under full recomputation the retained graph keeps the rebuilt layers until the weight pass
    # (a 2-stage ZB-H1 run's last stage holds several times the model's count)
    recompute: bool = True
    dominated_by: "Schedule | None" = None   # same time under the model and never less memory
    torch_class: str                 # torch.distributed.pipelining class the runtime runs
    multi_stage: bool = False        # torch's multi-stage API (several stages per rank)

    @property
    def closed_form(self) -> bool:
        return self.fill is not None

    @property
    def defers_weight_grad(self) -> bool:
        """Backward split into input and weight passes, the weight passes run later (zero bubble)."""
        return self.deferred_chunks_per_rank > 0

    def accepts_vpp(self, vpp: int) -> bool:
        return vpp >= self.min_vpp and (self.max_vpp is None or vpp <= self.max_vpp)

    def problems(self, name: str, pp: int, vpp: int, num_micro_batches: int, recomputes: bool, *,
                 torch_pipelining: bool) -> list[str]:
        """Why a plan cannot run this schedule (check_plan's and the search's one rule set). The
        micro-batch count's lower bound is torch's (`torch_pipelining`: our runtime, torchtitan);
        Megatron's and DeepSpeed's own 1F1B run fewer micro-batches than stages
        (FrameworkTraits.own_pipeline_schedules)."""
        out = []
        if self.needs_pp and pp < 2:
            out.append(f"schedule {name} needs pp > 1")
        if not self.accepts_vpp(vpp) and self.max_vpp == 1:
            out.append(f"schedule {name} runs one stage per rank (vpp must be 1)")
        elif not self.accepts_vpp(vpp):
            want = (f"vpp = {self.min_vpp}" if self.min_vpp == self.max_vpp else
                    f"vpp >= {self.min_vpp}" if self.max_vpp is None else f"{self.min_vpp} <= vpp <= {self.max_vpp}")
            out.append(f"schedule {name} needs {want} (virtual stages per rank; got {vpp})")
        if self.micro_batches_multiple_of_pp and pp > 1 and num_micro_batches % pp:
            out.append(f"schedule {name} needs num_micro_batches ({num_micro_batches}) divisible by pp ({pp})")
        if self.micro_batches_at_least_pp and num_micro_batches < pp and torch_pipelining:
            out.append(f"schedule {name} needs at least as many micro-batches as pipeline stages "
                       f"({num_micro_batches} < pp {pp}; torch's Schedule1F1B refuses fewer)")
        if self.micro_batches_at_least_stages and num_micro_batches < pp * vpp:
            out.append(f"schedule {name} needs at least as many micro-batches as virtual stages "
                       f"({num_micro_batches} < pp x vpp = {pp * vpp}; torch's {self.torch_class} refuses fewer)")
        if self.micro_batches_whole_rounds and pp > 1 and num_micro_batches % max(1, num_micro_batches // pp):
            out.append(f"schedule {name} needs num_micro_batches ({num_micro_batches}) in whole rounds of "
                       f"{max(1, num_micro_batches // pp)} (torch's round-based schedules)")
        if recomputes and not self.recompute:
            out.append(f"schedule {name} cannot be combined with recomputation (torch's zero-bubble "
                       "split backward keeps the recomputed layers until the weight pass)")
        return out


SCHEDULE_TRAITS: dict[Schedule, ScheduleTraits] = {
    Schedule.GPIPE: ScheduleTraits(
        description="all forwards, then all backwards (Huang et al. 2019); holds every micro-batch",
        fill="stage", in_flight="all", dominated_by=Schedule.ONE_F_ONE_B, torch_class="ScheduleGPipe"),
    Schedule.ONE_F_ONE_B: ScheduleTraits(
        description="one forward, one backward (PipeDream-Flush, Narayanan et al. 2021)",
        fill="stage", micro_batches_at_least_pp=True, torch_class="Schedule1F1B"),
    Schedule.INTERLEAVED: ScheduleTraits(
        description="1F1B over v virtual stages per rank in a loop (Narayanan et al. SC'21)",
        fill="stage", fill_divided_by_vpp=True, min_vpp=2, max_vpp=None, needs_pp=True,
        micro_batches_multiple_of_pp=True, in_flight="interleaved", torch_class="ScheduleInterleaved1F1B",
        multi_stage=True),
    Schedule.ZB_H1: ScheduleTraits(
        description="zero bubble H1: backward split into input and weight passes, weights later "
                    "(Qi et al. 2024); 1F1B's peak activations plus the deferred passes' inputs",
        fill="zero-bubble", needs_pp=True, deferred_chunks_per_rank=1, micro_batches_whole_rounds=True,
        recompute=False, torch_class="ScheduleInterleavedZeroBubble", multi_stage=True),
    Schedule.ZBV: ScheduleTraits(
        description="zero bubble V: two virtual stages per rank placed in a V (Qi et al. 2024); no "
                    "closed form, priced by the event simulator",
        fill=None, min_vpp=2, max_vpp=2, needs_pp=True, v_placement=True, in_flight="v",
        deferred_chunks_per_rank=2, recompute=False,
        torch_class="ScheduleZBVZeroBubble", multi_stage=True),
    Schedule.DUALPIPEV: ScheduleTraits(
        description="DualPipeV (DeepSeek-V3's DualPipe folded into a V, DeepSeek-AI 2024): two virtual "
                    "stages per rank in a V, m >= 2p, one micro-batch's forward paired with another's "
                    "backward; torch runs each pair one after the other (no compute or all-to-all "
                    "overlap), and so it is priced, by the event simulator (no closed form)",
        fill=None, min_vpp=2, max_vpp=2, needs_pp=True, v_placement=True, in_flight="dualpipev",
        micro_batches_at_least_stages=True, deferred_chunks_per_rank=1, recompute=False,
        torch_class="ScheduleDualPipeV", multi_stage=True),
}


def stage_owner(virtual_stage: int, pp: int, v_placement: bool) -> int:
    """The one placement rule (Plan.stage_rank): virtual stage j on rank j mod pp in a loop, or
    down then up the ranks in a V (ZBV, DualPipeV: rank r holds r and 2pp - 1 - r)."""
    if v_placement:
        return virtual_stage if virtual_stage < pp else 2 * pp - 1 - virtual_stage
    return virtual_stage % pp


@lru_cache(maxsize=4096)
def owned_stages(rank: int, pp: int, vpp: int, v_placement: bool) -> tuple[int, ...]:
    """The virtual stages pipeline rank `rank` holds, in pipeline order (stage_owner's inverse;
    the search asks for the same ranks of the same shapes many times)."""
    return tuple(j for j in range(pp * vpp) if stage_owner(j, pp, v_placement) == rank)


def default_schedule(vpp: int) -> Schedule:
    """What a plan runs when it names no schedule: interleaved 1F1B with virtual stages, else 1F1B."""
    return Schedule.INTERLEAVED if vpp > 1 else Schedule.ONE_F_ONE_B


def interleaved_warmup_chunks(pp: int, vpp: int, rank: int) -> int:
    """Virtual micro-batches pipeline rank `rank` holds in interleaved 1F1B when its first backward
    starts: its warmup forwards, 2(p - r - 1) + (v - 1)p (Narayanan et al. SC'21 Sec. 2.2;
    Megatron-Core's get_num_warmup_microbatches), and the steady state's first forward."""
    return 2 * (pp - rank - 1) + (vpp - 1) * pp + 1
