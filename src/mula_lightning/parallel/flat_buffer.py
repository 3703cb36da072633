"""Contiguous parameter / gradient buffers split into buckets and per-rank shards (Megatron-style).

One :class:`FlatBuffer` serves one *parameter family* (a set of parameters replicated over the same ranks and
sharded over the same group). Its layout:

* parameters are laid out back to back in the order given (the caller passes them in reverse registration
  order, close to the order in which backward produces their gradients), grouped by optimizer param group so
  that every shard maps to few (start, end, group) segments;
* the buffer is cut into buckets of about ``bucket_numel`` elements at parameter boundaries; each bucket is
  padded to a multiple of the shard-group size ``g`` so that it splits into ``g`` equal shards;
* rank ``i`` of the shard group owns shard ``i`` of every bucket (the element range it reduces, updates and
  broadcasts).

``param.data`` becomes a view into ``params`` (so an all-gather into a bucket refreshes the model in place)
and gradients are accumulated into ``grads`` (a separate buffer, possibly of another dtype) by hooks.
Padding elements stay zero in both buffers. A tensor-parallel parameter (a DTensor) is laid out by its local
shard: the buffer holds what this rank holds, and the DTensor's local tensor becomes the view.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch import nn

from mula_lightning.parallel.params import local_tensor, set_local_storage


@dataclass
class ParamSlot:
    """Where one parameter lives in the flat buffer."""

    name: str
    param: nn.Parameter
    group_index: int
    start: int  # element offset in the flat buffer
    numel: int
    bucket: int

    @property
    def end(self) -> int:
        return self.start + self.numel


@dataclass
class Bucket:
    """A padded range ``[start, start + numel)`` of the flat buffer, split into ``shard_count`` shards."""

    index: int
    start: int
    numel: int  # padded
    shard_count: int
    slots: list[ParamSlot] = field(default_factory=list)
    #: uneven shards (cut at the caller's ``cuts``): shard ``i`` is ``[start + bounds[i], start + bounds[i + 1])``
    bounds: tuple[int, ...] | None = None

    @property
    def shard_numel(self) -> int:
        """Elements of each shard (equal shards only; see :meth:`shard_sizes`)."""
        if self.bounds is not None:
            raise ValueError(f"bucket {self.index} has uneven shards {self.shard_sizes()}: ask shard_range")
        return self.numel // self.shard_count

    def shard_sizes(self) -> list[int]:
        """Elements of every shard, in shard order."""
        return [hi - lo for lo, hi in (self.shard_range(i) for i in range(self.shard_count))]

    def shard_range(self, shard: int) -> tuple[int, int]:
        """Buffer range owned by shard ``shard``."""
        if self.bounds is not None:
            return self.start + self.bounds[shard], self.start + self.bounds[shard + 1]
        lo = self.start + shard * self.shard_numel
        return lo, lo + self.shard_numel


@dataclass
class Segment:
    """Part of a rank's owned elements that belongs to one parameter (for updates and checkpoints).

    Attributes:
        slot: the parameter.
        buffer_start / buffer_end: the range in the flat buffer.
        param_start: offset of ``buffer_start`` inside the flattened parameter.
        local_start: offset inside the rank's concatenated owned elements (the optimizer-state vectors).
    """

    slot: ParamSlot
    buffer_start: int
    buffer_end: int
    param_start: int
    local_start: int

    @property
    def numel(self) -> int:
        return self.buffer_end - self.buffer_start


class FlatBuffer:
    """Flat parameter and gradient storage of one parameter family; see the module docstring.

    Args:
        named_params: (name, parameter, param-group index) in layout order.
        shard_count: size ``g`` of the group the optimizer states are sharded over (1 = replicated).
        shard_index: this rank's index in that group.
        bucket_numel: target elements per bucket (``None``: one bucket).
        grad_dtype: dtype of the gradient accumulation buffer (default: the parameters' dtype).
        align: each bucket is padded to a multiple of ``shard_count * align`` (default 1), e.g. so that shards
            split into whole quantization blocks.
        allocate_grads: allocate ``grads`` (False: an empty tensor, for an owner that accumulates elsewhere and
            should not hold a second full-size buffer even briefly).
        device: where the buffers live when the parameters are on the meta device.
        initial_value: for a meta parameter, its full initial value; it is written straight into the buffer (one
            parameter's value exists at a time besides the buffer) and a new ``nn.Parameter`` viewing the buffer
            takes its place in the slot; :attr:`replaced` maps ``id(old)`` to it, for the owner to swap into modules
            and optimizer param groups.
        cuts: ``shard_count + 1`` non-decreasing element offsets into the parameters' concatenation (layout
            order): shard ``i`` holds ``[cuts[i], cuts[i + 1])`` of it, each bucket its part of that range
            (:attr:`Bucket.bounds`, uneven, possibly empty), nothing padded. The sharded Muon cuts at matrix
            boundaries, its Newton-Schulz iteration needing whole matrices.
        defer_initial_values: with ``initial_value``, leave the new buffer unwritten (allocated with
            ``torch.empty``: on the host its pages are not even touched) for the owner to write only the range it
            keeps with :meth:`fill_initial`, so that a shard owner never holds a whole unit's values.
    """

    def __init__(
        self,
        named_params: list[tuple[str, nn.Parameter, int]],
        shard_count: int,
        shard_index: int,
        bucket_numel: int | None = None,
        grad_dtype: torch.dtype | None = None,
        align: int = 1,
        allocate_grads: bool = True,
        device: torch.device | str | None = None,
        initial_value: Callable[[nn.Parameter], torch.Tensor] | None = None,
        defer_initial_values: bool = False,
        cuts: list[int] | None = None,
    ) -> None:
        if not named_params:
            raise ValueError("a FlatBuffer needs at least one parameter")
        dtypes = {p.dtype for _, p, _ in named_params}
        devices = {p.device for _, p, _ in named_params if not (p.is_meta and initial_value is not None)}
        if device is not None:
            devices.add(torch.device(device))
        if len(dtypes) != 1 or len(devices) != 1:
            raise ValueError(f"a FlatBuffer needs one dtype and device, got dtypes {dtypes} and devices {devices}")
        self.dtype = dtypes.pop()
        self.device = devices.pop()
        self.replaced: dict[int, nn.Parameter] = {}
        self.shard_count = shard_count
        self.shard_index = shard_index
        ordered = sorted(named_params, key=lambda item: item[2])  # stable: keeps the caller's order per group
        self.slots: list[ParamSlot] = []
        self.buckets: list[Bucket] = []
        offset = 0
        current: list[tuple[str, nn.Parameter, int]] = []

        def close_bucket() -> None:
            nonlocal offset
            start = offset
            for name, p, g in current:
                slot = ParamSlot(name, p, g, offset, local_tensor(p).numel(), len(self.buckets))
                self.slots.append(slot)
                offset += slot.numel
            bounds = None
            if cuts is not None:  # unpadded: buffer offsets are the concatenation's
                bounds = tuple(min(max(c, start), offset) - start for c in cuts)
            multiple = 1 if cuts is not None else shard_count * align
            padded = -(-(offset - start) // multiple) * multiple
            bucket = Bucket(len(self.buckets), start, padded, shard_count, self.slots[-len(current) :], bounds)
            self.buckets.append(bucket)
            offset = start + padded
            current.clear()

        if cuts is not None:
            total = sum(local_tensor(p).numel() for _, p, _ in ordered)
            if len(cuts) != shard_count + 1 or cuts[0] != 0 or cuts[-1] != total or list(cuts) != sorted(cuts):
                raise ValueError(
                    f"cuts {list(cuts)[:8]} must be {shard_count + 1} non-decreasing offsets from 0 to the "
                    f"{total} elements"
                )
        running = 0
        for item in ordered:
            current.append(item)
            running += local_tensor(item[1]).numel()
            if bucket_numel is not None and running >= bucket_numel:
                close_bucket()
                running = 0
        if current:
            close_bucket()
        self.numel = offset

        deferred = defer_initial_values and initial_value is not None
        allocate = torch.empty if deferred else torch.zeros
        self.params = allocate(self.numel, dtype=self.dtype, device=self.device)
        #: per slot, the meta parameter whose initial value :meth:`fill_initial` writes (deferred values only)
        self.initial_sources: list[nn.Parameter | None] = []
        self.initial_value = initial_value if deferred else None
        with torch.no_grad():
            for slot in self.slots:
                view = self.params[slot.start : slot.end].view_as(local_tensor(slot.param))
                self.initial_sources.append(slot.param if deferred and slot.param.is_meta else None)
                if slot.param.is_meta and initial_value is not None:
                    if not deferred:
                        view.copy_(initial_value(slot.param))
                    # .data, as for a real parameter below: a Parameter built on the view would share the buffer's
                    # version counter, and the owner's in-place gathers would invalidate tensors autograd saved
                    new = nn.Parameter(view.new_empty(0), requires_grad=slot.param.requires_grad)
                    new.data = view
                    self.replaced[id(slot.param)] = new
                    slot.param = new
                else:
                    view.copy_(local_tensor(slot.param).detach())
                    set_local_storage(slot.param, view)
        # after the parameters moved in (their old storage is freed one by one): the peak is two model-sized buffers,
        # not three
        grad_numel = self.numel if allocate_grads else 0
        self.grads = torch.zeros(grad_numel, dtype=grad_dtype or self.dtype, device=self.device)
        self.segments = self.segments_for(shard_index)
        self.owned_numel = sum(hi - lo for lo, hi in self.owned_ranges())
        self.runs = self._group_runs()

    @torch.no_grad()
    def fill_initial(self, out: torch.Tensor, start: int) -> torch.Tensor:
        """Write buffer elements ``[start, start + out.numel())`` into ``out`` from the deferred initial values
        (padding zero; a parameter that was not on the meta device gives its current values).

        Asks the initializer for every slot in layout order, with an empty range where ``out`` holds nothing of it,
        since an initializer that reads weights is a collective (every rank asks for every parameter in one order).
        An initializer with ``fill_many_`` gets the whole chunk's requests at once (it may order its own work, see
        :meth:`~mula_lightning.parallel.parallelize.ParameterInitializer.fill_many_`). Only padding is zeroed, not
        all of ``out``: fresh memory stays untouched until its values are written.
        """
        if self.initial_value is None:
            raise RuntimeError("fill_initial needs a buffer built with initial_value and defer_initial_values=True")
        stop = start + out.numel()
        requests: list[tuple[nn.Parameter, torch.Tensor, int]] = []
        written = start  # the end of what the slots so far cover: anything between is padding
        for slot, source in zip(self.slots, self.initial_sources):
            s, e = max(start, slot.start), min(stop, slot.end)
            target = out[s - start : e - start] if s < e else out[:0]
            first = s - slot.start if s < e else 0
            if s < e:
                if s > written:
                    out[written - start : s - start].zero_()
                written = e
            if source is None:
                target.copy_(local_tensor(slot.param).detach().reshape(-1)[first : first + target.numel()])
            else:
                requests.append((source, target, first))
        if stop > written:
            out[written - start :].zero_()
        fill_many = getattr(self.initial_value, "fill_many_", None)
        fill = getattr(self.initial_value, "fill_", None)
        if fill_many is not None:
            fill_many(requests)
            return out
        for source, target, first in requests:
            if fill is not None:
                fill(source, target, first)
            else:  # a plain callable: its full value, sliced
                target.copy_(self.initial_value(source).reshape(-1)[first : first + target.numel()])
        return out

    def regroup(self, group_of: dict[int, int]) -> None:
        """Give the slots new param-group indices (``id(parameter) -> index``; others keep theirs) and recompute
        :attr:`runs`. The layout stays as it is (laid out by the groups it was built with, a run may now be cut
        where groups alternate): for an optimizer built after the buffer, from its parameters."""
        for slot in self.slots:
            slot.group_index = group_of.get(id(slot.param), slot.group_index)
        self.runs = self._group_runs()

    def _group_runs(self) -> list[tuple[int, int, int]]:
        """Owned elements as maximal (local_start, local_end, group_index) runs; padding joins its neighbours.

        The optimizer updates run by run, so a shard of one param group is one fused update, not one per tensor.
        """
        runs: list[list[int]] = []
        for seg in self.segments:
            g = seg.slot.group_index
            if runs and runs[-1][2] == g:
                runs[-1][1] = seg.local_start + seg.numel
            else:
                if runs:
                    runs[-1][1] = seg.local_start  # padding between runs goes with the earlier run
                runs.append([seg.local_start if runs else 0, seg.local_start + seg.numel, g])
        if runs:
            runs[-1][1] = self.owned_numel
        return [tuple(r) for r in runs]

    def segments_for(self, shard_index: int) -> list[Segment]:
        """The segments owned by shard ``shard_index`` (every rank can compute every other rank's layout)."""
        segments: list[Segment] = []
        local = 0
        for bucket in self.buckets:
            lo, hi = bucket.shard_range(shard_index)
            for slot in bucket.slots:
                s, e = max(lo, slot.start), min(hi, slot.end)
                if s < e:
                    segments.append(Segment(slot, s, e, s - slot.start, local + (s - lo)))
            local += hi - lo
        return segments

    def owned_ranges(self) -> list[tuple[int, int]]:
        """Buffer ranges this rank owns, one per bucket (padding included)."""
        return [b.shard_range(self.shard_index) for b in self.buckets]

    def owned_places(self) -> list[tuple[int, int, int, int]]:
        """Where each owned run lives: ``(local_start, local_end, buffer_start, group_index)``, the runs of
        :attr:`runs` (coordinates of the concatenated owned elements) cut where the owned elements stop being one
        range of the buffer. With one shard (a replicated family) the owned ranges join into the whole buffer and the
        places are the runs themselves; an update through them needs no concatenated copy of the owned elements."""
        merged: list[list[int]] = []  # [buffer_lo, buffer_hi, local_lo]
        local = 0
        for lo, hi in self.owned_ranges():
            if merged and merged[-1][1] == lo:
                merged[-1][1] = hi
            else:
                merged.append([lo, hi, local])
            local += hi - lo
        places = []
        for run_lo, run_hi, group in self.runs:
            for lo, hi, offset in merged:
                s, e = max(run_lo, offset), min(run_hi, offset + hi - lo)
                if s < e:
                    places.append((s, e, lo + s - offset, group))
        return places

    def gather_owned(self, buffer: torch.Tensor) -> torch.Tensor:
        """This rank's owned elements of ``buffer`` (``params`` or ``grads``) concatenated (a view if one bucket)."""
        ranges = self.owned_ranges()
        if len(ranges) == 1:
            return buffer[ranges[0][0] : ranges[0][1]]
        return torch.cat([buffer[lo:hi] for lo, hi in ranges])

    def gather_owned_into(self, buffer: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        """:meth:`gather_owned` written into ``out`` (any dtype: cast on the way), without a concatenated copy."""
        offset = 0
        for lo, hi in self.owned_ranges():
            out[offset : offset + hi - lo].copy_(buffer[lo:hi])
            offset += hi - lo
        return out

    def scatter_owned(self, buffer: torch.Tensor, values: torch.Tensor) -> None:
        """Write concatenated owned elements back into ``buffer`` (inverse of :meth:`gather_owned`)."""
        offset = 0
        for lo, hi in self.owned_ranges():
            target = buffer[lo:hi]
            if target.data_ptr() != values[offset:].data_ptr():  # a view of itself needs no copy
                target.copy_(values[offset : offset + hi - lo])
            offset += hi - lo
