"""Why something runs eagerly: the two vocabularies the report, the logs, the stats and the tests read.

* :class:`Rule` (with :class:`Reason`, the record that points at the user's code): why the analysis
  keeps a node or a region out of every graph, decided once per Dynamo graph by the passes
  (passes/classify.py, partition.py) before anything runs. The report's ``reasons`` and
  ``dynamic_reasons`` name these.
* :class:`EagerReason`: why one call of a *static* region (one the analysis graphed) ran eagerly
  at run time, decided per call by the runtime (warm-up, a capture that failed, a graph bound,
  the replay-order rule, ...). ``cgbackend.stats()["eager_calls"]`` counts calls by these names.

A node eager by a Rule is never captured; a static region's call eager by an EagerReason may replay
at the next call. Both keep stable JSON names (their values), which the report, the stats and
the tests read.
"""

from __future__ import annotations

import dataclasses
import enum
from typing import Any

import torch.fx

from .fx_utils import module_path, op_name, source_location

__all__ = ["EagerReason", "RULE_DESCRIPTIONS", "Rule", "Reason", "reason_for"]


class Rule(str, enum.Enum):
    """The rule that made a node (or a region) run eagerly. The value is the stable JSON name."""

    DATA_DEPENDENT_SHAPE = "data_dependent_shape"
    """The node's output size is read from device data (nonzero, where(cond), masked_select, ...)."""
    DEPENDS_ON_DYNAMIC_SHAPE = "depends_on_data_dependent_shape"
    """An input of the node has a data-dependent size."""
    HOST_SYNC = "host_sync"
    """The node copies a device value to the host (.item(), .tolist(), bool(tensor))."""
    DEVICE_MOVE = "device_move"
    """The node moves data between devices (.cpu(), .to(other device))."""
    CPU_TENSOR = "cpu_tensor"
    """The node computes on CPU tensors; a CUDA graph can only replay device work."""
    UNSAFE_TAG = "cudagraph_unsafe"
    """The operator carries torch.Tag.cudagraph_unsafe."""
    USER_MARKED = "user_marked"
    """The user marked the op or module dynamic (mark_dynamic, dynamic_ops, dynamic_modules)."""
    GLOBAL_STATE = "global_state"
    """An autocast / grad-mode switch whose block is cut by eager code: it must run in Python."""
    INPLACE_ON_GRAD = "inplace_on_requires_grad"
    """Training: an in-place write to a tensor that requires grad."""
    TUPLE_ELEMENT = "element_of_eager_tuple"
    """getitem on a tuple made by an eager op: regions pass tensors, not tuples."""
    SMALL_REGION = "small_region"
    """A static region too small to be worth a graph (min_region_ops); folded into eager."""
    COLLECTIVE = "collective"
    """A collective kept eager: host-read sizes, an op not captured, or capture_collectives off
    (passes/collectives.py)."""

    def __str__(self) -> str:  # shows the JSON name in text and f-strings
        return self.value

    @property
    def description(self) -> str:
        """One line for people: what the rule means (the report prints it where the rule first
        appears)."""
        return RULE_DESCRIPTIONS[self]

    @property
    def is_root_cause(self) -> bool:
        """False for rules that only follow from another node's verdict."""
        return self not in (Rule.DEPENDS_ON_DYNAMIC_SHAPE, Rule.TUPLE_ELEMENT)


RULE_DESCRIPTIONS: dict[Rule, str] = {
    Rule.DATA_DEPENDENT_SHAPE: "the op's output size is read from device data (nonzero, where(cond), "
                               "masked_select, ...), so no graph can be recorded for it ahead of the data",
    Rule.DEPENDS_ON_DYNAMIC_SHAPE: "an input of the op has a data-dependent size, so it runs eagerly after "
                                   "the op that made that size",
    Rule.HOST_SYNC: "the op copies a device value to the host (.item(), .tolist(), bool(tensor)); "
                    "a CUDA graph cannot wait for the host",
    Rule.DEVICE_MOVE: "the op moves data between devices (.cpu(), .to(other device))",
    Rule.CPU_TENSOR: "the op computes on CPU tensors; a CUDA graph replays device work only",
    Rule.UNSAFE_TAG: "the operator carries torch.Tag.cudagraph_unsafe",
    Rule.USER_MARKED: "marked dynamic by the user (cgbackend.mark_dynamic, the options dynamic_ops or "
                      "dynamic_modules)",
    Rule.GLOBAL_STATE: "an autocast or grad-mode switch whose block eager code cuts: it must run in Python",
    Rule.INPLACE_ON_GRAD: "training: an in-place write to a tensor that requires grad",
    Rule.TUPLE_ELEMENT: "an element of a tuple an eager op made: regions pass tensors, not tuples",
    Rule.SMALL_REGION: "a static run of ops too small to be worth a graph (fewer estimated kernels than "
                       "the option min_region_ops), folded into the eager code around it",
    Rule.COLLECTIVE: "a collective kept eager between graphs: its sizes are read from the device, or it is not "
                     "a functional all-to-all / all-reduce with sizes fixed by shapes (those are captured)",
}
"""One line per rule for people, read by the text report (reasons as data)."""


@dataclasses.dataclass(frozen=True)
class Reason:
    """One reason, pointing at the user's code."""

    rule: Rule
    node: str
    op: str
    source: str
    code: str
    module_path: str
    detail: str

    def to_dict(self) -> dict[str, Any]:
        return {
            "rule": self.rule.value,
            "node": self.node,
            "op": self.op,
            "source": self.source,
            "code": self.code,
            "module_path": self.module_path,
            "detail": self.detail,
        }


def reason_for(node: torch.fx.Node, rule: Rule, detail: str) -> Reason:
    source, code = source_location(node)
    return Reason(rule=rule, node=node.name, op=op_name(node), source=source, code=code,
                  module_path=module_path(node), detail=detail)


class EagerReason:
    """Stable names of the reasons a static region ran eagerly for one call (keys of
    ``stats()["eager_calls"]``), each with a line for people in ``DESCRIPTIONS``."""

    WARMUP = "warmup"
    NO_CUDA = "no_cuda"
    CAPTURE_DISABLED = "capture_disabled"
    CAPTURE_FAILED = "capture_failed"
    HOST_SYNC_SEEN = "host_sync_in_warmup"
    SPLIT_AT_SYNC = "split_at_host_sync"
    GRAPH_LIMIT = "graph_limit"
    CACHE_THRASH = "graph_cache_thrashing"
    SHAPES_VARY = "shapes_vary_every_call"
    PENDING_FORWARDS = "pending_forwards_limit"
    PRODUCER_EAGER = "producer_ran_eagerly"
    REPLAY_ORDER = "replay_order_hazard"
    MODE_CHANGE = "grad_mode_change"
    GRAD_HELD = "gradient_still_held"
    PARAM_MOVED = "param_moved"
    ALIASED_INPUTS = "aliased_inputs"
    INFERENCE_TENSOR = "inference_tensor_input"
    INPUT_VIEW = "input_view_output"
    CALL_RAISED = "call_raised"
    INPUT_LAYOUT = "input_layout"
    ABOVE_MAX_CAPTURE = "above_max_capture_size"
    KEPT_GRAPH = "retained_graph_backward"

    DESCRIPTIONS = {
        WARMUP: "eager warm-up call before capture (option warmup)",
        NO_CUDA: "the region's tensors are not on a CUDA device, nothing can be captured",
        CAPTURE_DISABLED: "capture=False: partitioned but run eagerly",
        CAPTURE_FAILED: "capturing this region failed; it runs eagerly from now on",
        HOST_SYNC_SEEN: "the region synchronized with the host during an eager warm-up call "
                        "(an op the classifier did not know) and the op could not be located or split "
                        "off; the region runs eagerly from now on",
        SPLIT_AT_SYNC: "the region synchronized with the host during warm-up; it was split at that op "
                       "(runtime/syncsplit.py): the op runs eagerly, the parts around it are captured",
        GRAPH_LIMIT: "the region already holds max_graphs_per_region graphs (all in use, or "
                 "graph_cache=\"keep\")",
        CACHE_THRASH: "the region's signatures churned through its graph cache (it evicted twice "
                  "max_graphs_per_region graphs), so it stopped evicting and runs new signatures eagerly",
        SHAPES_VARY: "the region's input shapes changed at every call it could not replay (several in a row, "
                     "none seen before): it stopped capturing a graph per shape and runs its compiled code "
                     "(Inductor's, or eager's kernels where the inner compiler is eager) without a graph; "
                     "graphs it already holds still replay",
    PENDING_FORWARDS: "max_pending_forwards forwards are waiting for their backward",
        PRODUCER_EAGER: "an input usually handed over by the previous graph came from eager code",
        REPLAY_ORDER: "replaying this older graph could overwrite memory a newer graph still needs "
                  "(training, or past the bound on recaptures)",
        MODE_CHANGE: "grad mode differs from the one the graph was traced with",
        GRAD_HELD: "a gradient the previous backward handed out is still referenced (a saved .grad, "
                   "torch.autograd.grad results); this backward runs through the captured forward "
                   "instead of overwriting it",
        PARAM_MOVED: "a parameter's storage was freed or re-allocated since the graph was captured "
                     "(FSDP2 reshards and gathers again); this backward runs through the captured "
                     "forward instead of replaying on the old address (cgbackend.distributed.track_fsdp "
                     "keeps FSDP2's parameters graphed)",
        ALIASED_INPUTS: "two inputs share memory and the region writes one of them in place: separate "
                        "static copies would not see each other's writes (runtime/inputs.py)",
        INFERENCE_TENSOR: "an inference-mode tensor is an input of a training call: eager autograd "
                          "refuses to save it, a static copy would not",
        INPUT_VIEW: "an output is a view of an input, and this call's input strides differ from the "
                    "graph's (a padded graph): the view could not be rebuilt on the caller's tensor",
        CALL_RAISED: "a capture attempt raised, and so did the call run eagerly: the error is the "
                     "call's own (its code or inputs) and reaches the caller; the region captures later",
        INPUT_LAYOUT: "the region's compiled code reads an input broadcast (stride 0 along a dim, as "
                      "Dynamo's example was expanded) and this call's tensor differs along that dim: it "
                      "cannot be copied into the compiled layout (runtime/layouts.py)",
        ABOVE_MAX_CAPTURE: "an inference call of a bucketed region above max_capture_size: the region's "
                           "code ran without a graph (no capture, no graph memory for that size)",
        KEPT_GRAPH: "a backward that keeps the forward's graph (retain_graph=True), or a later one "
                    "through the same forward, where the backward graph writes over what it reads "
                    "(released or loosened saved activations, static inputs, donated buffers): autograd "
                    "through the region's forward computed again on its static inputs, or, for a region "
                    "that cannot compute it again, through the captured forward on this forward's "
                    "saved values",
    }
