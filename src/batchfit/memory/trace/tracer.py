"""The ``Tracer``: a context manager that records a ``MemoryTrace`` while a training step runs.

It watches every storage an op makes through a ``StorageTracker`` (a TorchDispatch mode), gives each
one its role (``Category``: parameter, gradient, activation, optimizer state, temporary) from
autograd's and the optimizer's hooks, and names the module that allocated it, without holding a
tensor or a gradient itself. Building the model on fake tensors and running the steps inside the
tracer is ``trace.py``; the trace it records is the ``MemoryTrace`` below.
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from functools import partial
from typing import Any

import torch
from torch import nn
from torch.utils._pytree import tree_flatten

from ...workload import model_tensors, optimizer_tensors, parameter_attachments, trainable_parameters
from ..categories import Category
from .flops import op_flops
from .tracker import RoleBook, StorageTracker, local_tensor
from .values import active_value_mode

OUTSIDE = "(outside modules)"
CPU_SCRATCH = "cpu scratch of "
"""The label of a CPU kernel's measured scratch, before the op's name (``memory/kernels/cpu_probe.py``)."""
_OP_NAMES: dict[Any, str] = {}
"""``str(op)`` of each op seen, computed once."""
_MODULE_KEY = "batchfit_module"


@dataclass
class MemoryTrace:
    """Births and deaths of every storage of a traced step.

    ``events`` holds one int per event: ``sid`` for an allocation, ``~sid`` (negative) for a free.
    """

    events: list[int] = field(default_factory=list)
    nbytes: dict[int, int] = field(default_factory=dict)
    role: dict[int, Category] = field(default_factory=dict)
    module: dict[int, str] = field(default_factory=dict)
    phases: list[tuple[int, str, int]] = field(default_factory=list)
    """``(event_index, phase, step)``: the phase that starts at that event."""
    op: dict[int, str] = field(default_factory=dict)
    """The op that allocated each storage (``"param"``, ``"batch"``, an aten op, or a scratch label)."""
    notes: list[str] = field(default_factory=list)
    """What the trace had to assume (value reads it could not know, compiled modules run eagerly)."""
    flops: dict[tuple[str, int], int] = field(default_factory=dict)
    """Floating-point operations by ``(phase, step)`` (``memory/trace/flops.py``): what time models start from."""
    rows: dict[int, int] = field(default_factory=dict)
    """Dim-0 length of each storage that FSDP shards by rows: a parameter's, its gradient's, each optimizer state
    of the parameter's shape and what the optimizer step makes in that shape (``memory/synthesis/sharding.py``).
    Buffers, scalar states (Adam's ``step``) and storages shared by several tensors are absent: FSDP keeps them
    whole."""
    grads: list[tuple[int, int | None, bool, str]] = field(default_factory=list)
    """``(event_index, sid, copied, made_in)`` each time backward put a gradient into a parameter's
    ``.grad``: where on the timeline, the gradient's storage (None: not a dense tensor alone in its
    storage), whether autograd copied it into a new storage there rather than keeping the backward op's
    own output, and the module whose backward made it (``module`` names the parameter's). What a second
    micro-batch does differently is decided by these (``memory/synthesis/accumulation.py``)."""
    reductions: dict[int, tuple[Any, int]] = field(default_factory=dict)
    """``sid -> (Reduction, part)`` of each CUDA reduction's staging (part 0) and semaphores (part 1)
    (``memory/kernels/cuda_reduce.py``): sized again from the input's geometry where a trace is predicted at
    another batch size or length, the size not being linear in the batch."""
    paged: set[int] = field(default_factory=set)
    """Storages in CUDA unified memory (paged optimizer states on a GPU, ``memory/kernels/paged.py``): events like
    any other, but outside the caching allocator, so left out of its replay (``allocations``) and of
    ``memory_allocated``'s peak, and counted in ``Estimate.paged_optimizer_bytes`` instead."""

    def carried(self) -> tuple[dict, ...]:
        """The tables keyed by storage whose entries a copy of a storage keeps as they are (the writers of
        ``memory/synthesis`` give a storage they write its template's): role, op, rows, reductions."""
        return self.role, self.op, self.rows, self.reductions

    def allocations(self) -> Iterator[tuple[bool, int, int]]:
        """``(is_alloc, sid, nbytes)`` for each event, the form the allocator simulator replays (paged
        storages, which the allocator never sees, left out)."""
        nbytes, paged = self.nbytes, self.paged
        for e in self.events:
            if e >= 0:
                if e not in paged:
                    yield True, e, nbytes[e]
            elif ~e not in paged:
                yield False, ~e, nbytes[~e]

    def phase_at(self, index: int) -> tuple[str, int]:
        """The phase and step in force at event ``index``."""
        current = ("setup", 0)
        for start, phase, step in self.phases:
            if start > index:
                break
            current = (phase, step)
        return current


@contextlib.contextmanager
def storage_resizes(resized: Callable[[Any, int], None]) -> Iterator[None]:
    """Report every ``UntypedStorage.resize_`` to ``resized(storage, nbytes)`` (install, then restore).

    A resize swaps a storage's memory without making a new storage, so no op output shows it: FSDP2
    frees a unit's unsharded parameters with ``resize_(0)`` and gets them back with ``resize_(n)``.
    """
    cls = torch.UntypedStorage
    own = cls.__dict__.get("resize_")  # torch's is inherited from torch._C.StorageBase
    original = cls.resize_

    def resize_(storage: Any, size: int) -> Any:
        out = original(storage, size)
        resized(storage, storage.nbytes())
        return out

    cls.resize_ = resize_  # type: ignore[method-assign]
    try:
        yield
    finally:
        if own is None:
            del cls.resize_
        else:
            cls.resize_ = own  # type: ignore[method-assign]


_FSDP2_PARAM_GROUP = (
    "torch.distributed.fsdp._fully_shard._fsdp_param_group",  # torch >= 2.6
    "torch.distributed._composable.fsdp._fsdp_param_group",  # torch 2.4, 2.5
)
"""Where FSDP2's unit calls ``foreach_reduce`` (NOTE [ Gradients that are views of a reduce-scatter's output ])."""


class Tracer:
    """Records a ``MemoryTrace`` while a training step runs (a context manager).

    It stacks a ``StorageTracker`` (every op output's storage), autograd's saved-tensor hooks
    (activations), post-accumulate-grad hooks (gradients), an optimizer step hook (optimizer states)
    and a module tracker (which module allocated what). Each install has its restore in ``__exit__``.

    Args:
        model: the (fake) model; its parameters and buffers are registered up front.
        optimizer: the (fake) optimizer whose state tensors are optimizer states.
        kernels: a kernel model; its ``after_op(tracer, func, args, kwargs, new_output_sids)`` runs
            after each op and may call ``tracer.add_scratch`` for memory the kernel allocates inside.
        recorder: told where each event happened and what each op read (``memory/synthesis/depth.py``'s
            ``BlockRecorder``, which finds the repeated blocks in a trace); None records nothing more.
    """

    def __init__(
        self,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        kernels: Any = None,
        recorder: Any = None,
    ) -> None:
        self.trace = MemoryTrace()
        self.model = model
        self.optimizer = optimizer
        self._roles = RoleBook()
        self._phase = "setup"
        self._step = 0
        self._kernels = kernels
        self._next_scratch = -1
        self._stack = contextlib.ExitStack()
        self._tracker = StorageTracker(self._on_alloc, self._on_free, self._after_op)
        self._tracker.on_error = self._on_error
        if kernels is not None and hasattr(kernels, "fix_outputs"):
            self._tracker.fix_outputs = partial(kernels.fix_outputs, self)
        if kernels is not None and hasattr(kernels, "allocation_order"):
            self._tracker.allocation_order = kernels.allocation_order
        self.failed_at: tuple[str, str] | None = None
        """``(module, op)`` of the first op that raised."""
        self._module_stack: list[str] = []
        self._module_names: dict[int, str] = {}
        self._backward_module = OUTSIDE
        self._param_module: dict[int, str] = {}
        self._param_shapes: set[tuple[int, ...]] = set()
        self._watched = getattr(kernels, "watched_ops", None)
        """The ops the kernel model's ``after_op`` acts on (None: all of them)."""
        self._recorder = recorder
        self._reducing: list[dict[int, str]] = []
        """For each ``foreach_reduce`` running: the buffers its gradients are views of, and who made each."""

    # -- hooks ----------------------------------------------------------------------------------
    def _on_error(self, func: Any) -> None:
        if self.failed_at is None:
            self.failed_at = (self._current_module(), str(func))

    def current_module(self) -> str:
        """The module running now (forward or backward), for notes and errors."""
        return self._current_module()

    def _current_module(self) -> str:
        if torch._C._current_autograd_node() is not None:
            return self._backward_module
        return self._module_stack[-1] if self._module_stack else OUTSIDE

    # NOTE [ Which module allocated it, without touching lifetimes ]
    # Forward: global module pre/post hooks keep a stack of module names. Backward: the forward post
    # hook tags each module output's autograd node with the module's name; backward runs a module's
    # nodes right after its output node, so the last tagged node the engine ran names the module of
    # every allocation until the next one. Nothing here holds a tensor or a gradient (autograd hooks
    # on inputs and outputs, as torch's ModTracker uses, keep gradients alive longer than the real
    # step and so change the peak being measured).
    def _pre_forward(self, module: nn.Module, args: Any) -> None:
        self._module_stack.append(self._module_names.get(id(module), type(module).__name__))

    def _post_forward(self, module: nn.Module, args: Any, output: Any) -> None:
        name = self._module_stack.pop() if self._module_stack else OUTSIDE
        for t in tree_flatten(output)[0]:
            node = getattr(t, "grad_fn", None) if isinstance(t, torch.Tensor) else None
            if node is not None and _MODULE_KEY not in node.metadata:  # the innermost module wins
                node.metadata[_MODULE_KEY] = name

    def _note_backward_module(self) -> None:
        node = torch._C._current_autograd_node()
        if node is not None:
            name = node.metadata.get(_MODULE_KEY)
            if name is not None:
                self._backward_module = name

    def _on_alloc(self, sid: int, nbytes: int) -> None:
        node = self._tracker.current_node  # what the tracker read while registering: read it once
        if node is not None:
            name = node.metadata.get(_MODULE_KEY)
            if name is not None:
                self._backward_module = name
            module = self._backward_module
        else:
            module = self._module_stack[-1] if self._module_stack else OUTSIDE
        t = self.trace
        t.events.append(sid)
        t.nbytes[sid] = nbytes
        t.module[sid] = module
        func = self._tracker.current_func
        if func is not None and self._phase != "setup":
            label = _OP_NAMES.get(func)
            if label is None:
                label = _OP_NAMES[func] = str(func)
        else:
            label = self._phase
        t.op[sid] = label
        self._roles.born(sid, Category.BATCH_DATA if self._phase == "batch" else Category.TEMPORARIES)
        if self._recorder is not None:
            self._recorder.event(self)

    def _on_free(self, sid: int) -> None:
        self.trace.events.append(~sid)
        if self._recorder is not None:
            self._recorder.event(self)

    def current_op(self) -> Any:
        """The op whose outputs or scratch are being recorded (None between ops)."""
        return self._tracker.current_func

    def forward_modules(self) -> list[str]:
        """The modules whose forward is running, outermost first (a checkpointed block's recomputation too)."""
        return self._module_stack

    def _after_op(self, func: Any, args: tuple, kwargs: dict, outputs: list, first_new: int) -> None:
        flops = op_flops(func, args, kwargs, self._tracker.current_out)
        if flops:
            key = (self._phase, self._step)
            self.trace.flops[key] = self.trace.flops.get(key, 0) + flops
        watched = self._watched
        if self._kernels is not None and (watched is None or func in watched):
            new_sids = []
            for t in outputs:
                sid = self._tracker.storage_id(t)
                new_sids.append(sid if sid is not None and sid >= first_new else None)
            self._kernels.after_op(self, func, args, kwargs, new_sids)
        if self._phase == "optimizer":
            self._note_optimizer_rows(outputs, first_new)
        if self._recorder is not None:
            self._recorder.after_op(self, func, args, outputs, first_new, flops)

    def _note_optimizer_rows(self, outputs: list, first_new: int) -> None:
        """Rows of what the optimizer step makes in a parameter's shape (NOTE [ The optimizer's temporaries under
        FSDP ] in ``memory/synthesis/sharding.py``)."""
        for t in outputs:
            local = local_tensor(t)
            if tuple(local.shape) in self._param_shapes:
                sid = self._tracker.storage_id(t)
                if sid is not None and sid >= first_new:
                    self._note_rows(t)

    def add_scratch(self, nbytes: int, label: str, *, transient: bool) -> int:
        """Record memory a kernel allocates internally (freed at once when ``transient``)."""
        sid = self._scratch_id()
        t = self.trace
        t.events.append(sid)
        t.nbytes[sid] = nbytes
        t.module[sid] = self._current_module()
        t.op[sid] = label
        self._roles.born(sid, Category.TEMPORARIES)
        if self._recorder is not None:
            self._recorder.event(self)
        if transient:
            t.events.append(~sid)
            if self._recorder is not None:
                self._recorder.event(self)
        return sid

    def sized_by(self, sid: int, reduction: Any, part: int) -> None:
        """Keep what sizes scratch ``sid`` (a CUDA reduction's ``part``, ``MemoryTrace.reductions``)."""
        self.trace.reductions[sid] = (reduction, part)

    def free_scratch(self, sids: Any) -> None:
        """Free scratch ``add_scratch`` recorded as kept (several buffers alive together inside one op)."""
        for sid in sids:
            self.trace.events.append(~sid)
            if self._recorder is not None:  # every event is heard, as add_scratch's are
                self._recorder.event(self)

    @property
    def phase(self) -> str:
        """The phase of the step being traced."""
        return self._phase

    @property
    def step(self) -> int:
        """The step being traced (0: the first)."""
        return self._step

    def _scratch_id(self) -> int:
        # Scratch storages get ids far above any real storage's so the two never collide.
        self._next_scratch += 1
        return (1 << 40) + self._next_scratch

    def _pack(self, t: torch.Tensor) -> torch.Tensor:
        sid = self._tracker.storage_id(t)
        if sid is None and t.untyped_storage().nbytes() > 0:
            # Not an op's output: a Python number autograd keeps as a 0-d tensor (``x * 0.5`` saves
            # 0.5), wrapped by the argument parser before dispatch. It lives until backward.
            sid = self._tracker.register(t)
        self._roles.mark(sid, Category.ACTIVATIONS)
        return t

    @property
    def saved_pack(self) -> Callable[[torch.Tensor], torch.Tensor]:
        """The pack hook the tracer installs (to recognise its own saved-tensor hooks)."""
        return self._pack

    def register_kept(self, t: torch.Tensor) -> None:
        """Count a tensor made outside any op that autograd will keep for backward (an activation)."""
        sid = self._tracker.register(t)
        self._roles.mark(sid, Category.ACTIVATIONS)

    def storage_id(self, t: torch.Tensor) -> int | None:
        """The trace's id of ``t``'s storage (None: not tracked)."""
        return self._tracker.storage_id(t)

    def _grad_hook(self, p: torch.Tensor) -> None:
        if p.grad is not None:
            tracker = self._tracker
            grad = local_tensor(p.grad)  # a DTensor's local shard (NOTE [ Wrapper tensors ])
            sid = tracker.register(grad)
            made_in = self.trace.module.get(sid, OUTSIDE) if sid is not None else OUTSIDE
            if self._reducing and sid is not None:  # a view of FSDP2's reduce-scatter output (NOTE below)
                self._reducing[-1].setdefault(sid, made_in)  # handed over once, when foreach_reduce returns
            else:
                # Copied by AccumulateGrad: the newest storage, made by the node running this hook
                # (NOTE [ Autograd node tokens ] in memory/trace/tracker.py).
                node = torch._C._current_autograd_node()
                copied = (sid == tracker._next_id - 1 and node is not None
                          and tracker._born_in.get(sid) == tracker.node_token(node))
                # Dense and alone in its storage: a gradient kept as a view of a larger backward buffer
                # (a parameter concatenated with activations) frees with the buffer, not at hand-over.
                dense = (
                    sid is not None
                    and grad.layout == torch.strided
                    and grad.untyped_storage().nbytes() == grad.numel() * grad.element_size()
                )
                self.trace.grads.append((len(self.trace.events), sid if dense else None, copied, made_in))
            self._roles.mark(sid, Category.GRADIENTS)
            self._own(sid, p)
            self._note_rows(grad)

    # NOTE [ Gradients that are views of a reduce-scatter's output ]
    # FSDP2 reduce-scatters a unit's gradients into one new buffer (``reduce_output`` in ``foreach_reduce``) and hands
    # each parameter a view of it as its sharded ``.grad``: from then on the buffer is the gradients' storage. In a
    # later micro-batch of the same optimizer step the views are added into the gradients there are, and the new
    # buffer, whose last reference is the function's local, is freed when ``foreach_reduce`` returns (its frame's
    # other locals, the last unsharded gradient among them, before it: they come first in the frame). So the trace
    # hands the buffer over once, where ``foreach_reduce`` returns, as a backward output that becomes a gradient
    # (not copied), instead of one view per parameter: where a later micro-batch frees its own
    # (``memory/synthesis/accumulation.py``), as autograd frees an output that it adds into a ``.grad``.
    def _reduced(self, original: Callable[..., Any]) -> Callable[..., Any]:
        """FSDP2's ``foreach_reduce``, handing over the buffers its gradients are views of when it returns."""

        def foreach_reduce(*args: Any, **kwargs: Any) -> Any:
            self._reducing.append({})
            try:
                out = original(*args, **kwargs)
            finally:
                buffers = self._reducing.pop()
            for sid, made_in in buffers.items():
                self.trace.grads.append((len(self.trace.events), sid, False, made_in))
            return out

        return foreach_reduce

    def _note_rows(self, t: torch.Tensor, like: torch.Tensor | None = None) -> None:
        """Record ``t``'s dim-0 length when its storage holds exactly ``t`` (and ``t`` has ``like``'s shape)."""
        t = local_tensor(t)
        if like is not None:
            like = local_tensor(like)
        if t.dim() == 0 or (like is not None and t.shape != like.shape):
            return
        sid = self._tracker.storage_id(t)
        if sid is not None and t.untyped_storage().nbytes() == t.numel() * t.element_size():
            self.trace.rows[sid] = t.shape[0]

    def _own(self, sid: int | None, p: torch.Tensor) -> None:
        if sid is not None:
            self.trace.module[sid] = self._param_module.get(id(p), OUTSIDE)
            if self._recorder is not None:
                self._recorder.own(sid, p)

    def _step_hook(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        holders: dict[int | None, list[tuple[torch.Tensor, torch.Tensor]]] = {}
        for p, state in optimizer.state.items():
            for value in state.values():
                if isinstance(value, torch.Tensor):
                    sid = self._tracker.register(value)
                    self._roles.mark(sid, Category.OPTIMIZER_STATES)
                    holders.setdefault(sid, []).append((p, value))
        for sid, held in holders.items():
            # A state several parameters hold is none of theirs: bitsandbytes' 8-bit states all point at the
            # optimizer's two quantisation maps (``qmap1``, ``qmap2``), made in its constructor.
            if len(held) == 1:
                p, value = held[0]
                self._own(sid, p)
                self._note_rows(value, like=p)

    def mark(self, phase: str, step: int) -> None:
        """Start ``phase`` of ``step`` on the timeline."""
        self._phase = phase
        self._step = step
        self.trace.phases.append((len(self.trace.events), phase, step))

    # -- context --------------------------------------------------------------------------------
    def __enter__(self) -> Tracer:
        from torch.nn.modules.module import register_module_forward_hook, register_module_forward_pre_hook

        stack = self._stack
        if self._kernels is not None and hasattr(self._kernels, "start"):
            stack.callback(self._kernels.stop)
            self._kernels.start()

        values = active_value_mode()
        if values is not None and values.observer is None:  # one mode for both (see memory/trace/values.py)
            values.observer = self._tracker
            stack.callback(setattr, values, "observer", None)
        else:
            stack.enter_context(self._tracker)
        self.mark("setup", 0)
        mod_names = {}
        root = type(self.model).__name__
        for name, mod in self.model.named_modules():
            mod_names[id(mod)] = f"{root}.{name}" if name else root
        self._module_names = mod_names
        for mod in self.model.modules():
            for p in mod.parameters(recurse=False):
                self._param_module.setdefault(id(p), mod_names[id(mod)])
                for held in parameter_attachments(p):  # a quantised weight's scales: its module's
                    self._param_module.setdefault(id(held), mod_names[id(mod)])
            for b in mod.buffers(recurse=False):
                self._param_module.setdefault(id(b), mod_names[id(mod)])
        for tensor in model_tensors(self.model):
            sid = self._tracker.register(tensor)
            self._roles.mark(sid, Category.PARAMETERS)
            if sid is not None:
                self._roles.born(sid, Category.PARAMETERS)
                self._own(sid, tensor)
        for p in self.model.parameters():
            self._note_rows(p)
        self._param_shapes = {tuple(local_tensor(p).shape) for p in trainable_parameters(self.model) if p.dim() > 0}
        # What the optimizer made in its constructor (Adagrad's sums, bitsandbytes' quantisation maps)
        # is held from the start, as the model's tensors are.
        for tensor in optimizer_tensors(self.optimizer):
            sid = self._tracker.register(tensor)
            self._roles.mark(sid, Category.OPTIMIZER_STATES)
        for p in trainable_parameters(self.model):
            handle = p.register_post_accumulate_grad_hook(self._grad_hook)
            stack.callback(handle.remove)
        handle = self.optimizer.register_step_post_hook(self._step_hook)
        stack.callback(handle.remove)
        stack.enter_context(torch.autograd.graph.saved_tensors_hooks(self._pack, lambda t: t))
        stack.enter_context(storage_resizes(self._tracker.resized))
        for name in _FSDP2_PARAM_GROUP:  # loaded: a model sharded with FSDP2 may be traced
            group = sys.modules.get(name)
            if group is not None and hasattr(group, "foreach_reduce"):
                stack.callback(setattr, group, "foreach_reduce", group.foreach_reduce)
                group.foreach_reduce = self._reduced(group.foreach_reduce)
        stack.callback(register_module_forward_pre_hook(self._pre_forward).remove)
        stack.callback(register_module_forward_hook(self._post_forward, always_call=True).remove)
        return self

    def __exit__(self, *exc: Any) -> None:
        self._stack.close()
        self.trace.role = dict(self._roles.role)
