"""``QuantizedTensor``: a high-precision-looking tensor that holds FP8 planes.

[Note: what a QuantizedTensor is]
A wrapper subclass with the *nominal* dtype (bf16/fp32) and logical shape of the weight it
replaces. It holds the planes its recipe stores (``rowwise`` and/or ``columnwise``, each FP8 data +
``scale_inv`` in the logical orientation, see ``formats/base.py``), optionally a values plane
(``hp_init``: high-precision values of the same elements), and the usages it can serve. It is
storage: what the parameter keeps besides (whether its bytes are still pending, scaling state,
per-gather state, the transpose cache TE's backward GEMM reads, what a cast reads through to) is
its owner record's (``param_state.py``), shared by every tensor derived from it, so an op making a
new tensor hands on planes and nothing else (``tests/test_structure.py`` checks the fields).

A tensor may hold a subset of the planes: FSDP's forward gather produces one with only the rowwise
plane, the backward gather one with only the columnwise plane. Reading a plane the tensor does not
hold raises; it is never recomputed from high precision behind the caller's back.

Every aten op it supports is in the op table (``op_table.py``, filled by ``dtensor_fp8/ops/``);
anything else raises with the fix.
"""

from __future__ import annotations

import hashlib
import math
import operator

import torch
from torch.utils._pytree import tree_map_only

from .fix_hints import MASTER_WEIGHTS, fix_hints
from .formats.base import COLUMNWISE, ROWWISE, USAGES, Recipe, Plane, RecipeError
from .layout import dim_pieces, rows_per_index as layout_rows_per_index
from .op_table import QUANTIZED_FUNCTIONS, QUANTIZED_OPS
from .param_state import FP8ParamState


def one_byte_as_uint8(t: torch.Tensor) -> torch.Tensor:
    """FP8 / E8M0 tensors viewed as their bytes (gloo rejects float8 dtypes; plain torch reads
    uint8 everywhere); wider dtypes (fp32 scales) unchanged."""
    return t.view(torch.uint8) if t.dtype.itemsize == 1 else t


#: The inner-tensor attributes of a :class:`QuantizedTensor`, per stored plane: FP8 data and scale_inv.
PLANE_ATTRS = {usage: (f"{usage}_data", f"{usage}_scale_inv") for usage in USAGES}
#: ``rebuild``'s default for the values plane: the tensor's own (see ``QuantizedTensor.rebuild``).
_SAME_VALUES = object()
#: The four plane fields in :data:`PLANE_ATTRS` order, read in one call (see plane_tensors).
_read_plane_fields = operator.attrgetter(*(a for pair in PLANE_ATTRS.values() for a in pair))


class QuantizedTensor(torch.Tensor):
    """FP8 planes + recipe, looking like a high-precision tensor of ``dtype`` and ``shape``.

    Build one with :func:`dtensor_fp8.quantize`, or from planes already made with
    :meth:`from_planes`. The constructor takes the inner tensors themselves (``None`` for a plane
    not held), so that torch.compile can build one inside a graph.

    Args:
        rowwise_data, rowwise_scale_inv: the rowwise plane (logical orientation), or ``None``.
        columnwise_data, columnwise_scale_inv: the columnwise plane, or ``None``.
        recipe: the recipe object that made them.
        shape: logical shape.
        dtype: nominal high-precision dtype (what ``dequantize()`` returns by default).
        usages: which usages this tensor can serve; defaults to what the planes allow.
        requires_grad: as for any tensor.
        param_state: the :class:`FP8ParamState` of the parameter these planes belong to (a fresh
            one, holding no state, when omitted).
        hp_init: the values plane: high-precision values of this tensor's elements (its logical
            shape) that the optimizer's masters start from, or whose bytes are still to be made
            (see :attr:`hp_init`).
        phase: where this tensor's first element sits inside its scaling blocks, per dim (a shard
            that starts inside a block: see "block phase" in ``formats/base.py``); ``(0, 0)``
            for a whole weight.

    Example:
        >>> plane = MXFP8().quantize_plane(torch.randn(64, 64), "rowwise")
        >>> q = QuantizedTensor(plane.data, plane.scale_inv, None, None, MXFP8(), (64, 64), torch.float32)
    """

    # [Note: the fields of a QuantizedTensor]
    # These are all of its fields; nothing else is attached to an instance (lifecycle state lives
    # in the parameter's owner record, ``param_state``, see param_state.py).
    # The inner tensors are plain attributes, named by ``__tensor_flatten__``: torch.compile
    # (dynamo, AOTAutograd) takes a QuantizedTensor apart into them and rebuilds it with
    # ``__tensor_unflatten__``; an absent plane is ``None`` and not listed. The recipe, usages and
    # nominal dtype are constant metadata (the flatten context: a compiled graph is specialized on
    # them, and a tensor holding other usages compiles another graph). :meth:`repoint_` is the one
    # way to change what a tensor holds after construction. The transpose cache is not a field: the
    # owner keeps it, keyed on the plane tensors it was built from (see :attr:`transpose_cache`).
    rowwise_data: torch.Tensor | None  #: rowwise plane: FP8 data (M, K)
    rowwise_scale_inv: torch.Tensor | None  #: rowwise plane: its block scales
    columnwise_data: torch.Tensor | None  #: columnwise plane (MXFP8, 1x128 blockwise): FP8 data (M, K)
    columnwise_scale_inv: torch.Tensor | None  #: columnwise plane: its block scales
    _recipe: Recipe  #: the recipe that made the planes
    _usages: tuple[str, ...]  #: usages this tensor serves, in USAGES order
    #: the parameter's owner record (scaling states; see param_state.py), shared by every tensor
    #: derived from the same parameter; eager-side, not flattened (a compiled graph is not
    #: specialized on it)
    _param_state: FP8ParamState
    #: the values plane: high-precision values of the elements (the logical shape), for the masters
    #: to start from or, while the owner's bytes are pending, for the FP8 bytes to be made from;
    #: sliced, padded and moved with the FP8 planes, so FSDP's shard holds its own rows only. Eager-side,
    #: not flattened: compiled code runs on made bytes only. ``None`` when not kept, or once taken.
    hp_init: torch.Tensor | None
    #: where the first element sits inside its scaling blocks, per dim (``formats/base.py``'s note on
    #: block phase), reduced modulo the recipe's block period: nonzero only for a piece that starts
    #: inside a block. Constant metadata (flattened with the recipe).
    _phase: tuple[int, int]

    @staticmethod
    def __new__(cls, rowwise_data, rowwise_scale_inv, columnwise_data, columnwise_scale_inv, recipe, shape, dtype,
                usages=None, requires_grad=False, param_state=None, hp_init=None, phase=(0, 0)):
        some = rowwise_data if rowwise_data is not None else columnwise_data
        if some is None:
            raise RecipeError(f"{recipe.name}: a QuantizedTensor needs at least one plane")
        return torch.Tensor._make_wrapper_subclass(
            cls, torch.Size(shape), dtype=dtype, device=some.device, requires_grad=requires_grad
        )

    def __init__(self, rowwise_data, rowwise_scale_inv, columnwise_data, columnwise_scale_inv, recipe, shape, dtype,
                 usages=None, requires_grad=False, param_state=None, hp_init=None, phase=(0, 0)):
        self._recipe = recipe
        self._phase = None if phase is None else tuple(p % recipe.phase_period(d) for d, p in enumerate(phase))
        self._param_state = FP8ParamState() if param_state is None else param_state
        if hp_init is not None and tuple(hp_init.shape) != tuple(shape):
            raise RecipeError(f"{recipe.name}: hp_init of shape {tuple(hp_init.shape)} for a tensor of shape {tuple(shape)}")
        self.hp_init = hp_init
        planes = {}
        if rowwise_data is not None:
            planes[ROWWISE] = Plane(rowwise_data, rowwise_scale_inv)
        if columnwise_data is not None:
            planes[COLUMNWISE] = Plane(columnwise_data, columnwise_scale_inv)
        self._set_planes(planes, usages)

    @classmethod
    def from_planes(cls, planes: dict[str, Plane], recipe: Recipe, shape, dtype: torch.dtype,
                    usages: tuple[str, ...] | None = None, requires_grad: bool = False, *, param_state: FP8ParamState | None = None,
                    hp_init: torch.Tensor | None = None, phase: tuple[int, int] = (0, 0)) -> "QuantizedTensor":
        """A QuantizedTensor holding ``planes`` (stored planes by usage, logical orientation).

        Args:
            planes: ``{"rowwise": Plane, "columnwise": Plane}``, either or both.
            recipe, shape, dtype, usages, requires_grad, param_state, hp_init: as for the constructor.

        Example:
            >>> q = QuantizedTensor.from_planes({"rowwise": plane}, MXFP8(), (64, 64), torch.float32)
        """
        unknown = set(planes) - set(USAGES)
        if unknown:
            raise RecipeError(f"{recipe.name}: unknown plane(s) {sorted(unknown)}; planes are {USAGES}")
        row, col = planes.get(ROWWISE), planes.get(COLUMNWISE)
        return cls(
            None if row is None else row.data, None if row is None else row.scale_inv,
            None if col is None else col.data, None if col is None else col.scale_inv,
            recipe, shape, dtype, usages, requires_grad, param_state, hp_init, phase,
        )

    def _set_planes(self, planes: dict[str, Plane], usages) -> None:
        recipe = self._recipe
        unknown = set(planes) - set(USAGES)
        if unknown:
            raise RecipeError(f"{recipe.name}: unknown plane(s) {sorted(unknown)}; planes are {USAGES}")
        if usages is None:
            usages = tuple(u for u in USAGES if recipe.stored_usage(u) in planes)
        for u in usages:
            if recipe.stored_usage(u) not in planes:
                raise RecipeError(f"{recipe.name}: usage {u!r} needs the {recipe.stored_usage(u)!r} plane, which is absent")
        for usage, (data_attr, scale_attr) in PLANE_ATTRS.items():
            plane = planes.get(usage)
            setattr(self, data_attr, None if plane is None else plane.data)
            setattr(self, scale_attr, None if plane is None else plane.scale_inv)
        self._usages = tuple(u for u in USAGES if u in usages)

    # ---- accessors --------------------------------------------------------------------------------
    @property
    def recipe(self) -> Recipe:
        return self._recipe

    @property
    def phase(self) -> tuple[int, int]:
        """Where this tensor's first element sits inside its scaling blocks, per dim: ``(0, 0)``
        unless it is a piece starting inside a block (see "block phase" in ``formats/base.py``)."""
        if self._phase is None and not self._place():
            raise RecipeError(
                f"{self._recipe.name}: this FP8 shard of shape {tuple(self.shape)} was cut from a weight by "
                "new_zeros + copy_ (FSDP2's sharding) and its place in the weight is not known yet: its parameter "
                "is not a DTensor its owner record can find. Make FP8 parameters with dtensor_fp8.quantize_module_ "
                "before fully_shard, so the shard knows where its blocks start.")
        return self._phase

    @property
    def placed(self) -> bool:
        """Whether this tensor knows its block phase (``False`` for a shard FSDP2 cut that no read
        has placed yet: see the note below)."""
        return self._phase is not None or self._place()

    # [Note: a shard placed after it is cut]
    # FSDP2 makes a rank's shard with ``full.new_zeros(padded_shard_size)`` and copies the chunk of
    # the full weight in: ``new_zeros`` cannot know which chunk will come, so where the shard starts
    # inside its blocks (its phase) is unknown when its storage is made. Such a tensor is made
    # *unplaced* (``_phase is None``), with room for the scale rows of any phase, and is placed the
    # first time its planes are read, from its owner's layout (``groups.dim_pieces``: where this
    # rank's shard of the DTensor parameter starts), which FSDP2 has made by then.
    def _place(self) -> bool:
        """Place an unplaced tensor (see the note above) from its owner's layout; ``False`` when no
        layout is known yet (FSDP2 is still building the parameter)."""
        layout = self._param_state.current_layout()
        if layout is None:
            return False
        # The layout's dims, not this tensor's: this may be the matrix view (as_matrix) of a weight of
        # more than two dims, whose layout counts dim 0 in indices (for experts: whole experts).
        pieces = [dim_pieces(layout, d)[0] for d in (0, len(layout.shape) - 1)]
        per_index = layout_rows_per_index(layout)
        if (pieces[0][1] - pieces[0][0]) * per_index > self.shape[0] * self.rows_per_index:
            # the layout of a parameter FSDP2 is still sharding (a TP or EP shard's, before fully_shard
            # made its own): this tensor is a piece of that parameter's shard, not yet placed by it
            return False
        # the phase is in the planes' (flattened) rows: an index along dim 0 is rows_per_index rows
        self.place_((pieces[0][0] * per_index, pieces[1][0]))
        return True

    # [Note: tensors of more than two dims]
    # The planes of a tensor of shape (d0, ..., dn) are matrices (d0 * ... * d(n-1), dn): its leading
    # dims flattened into rows, as TE flattens them (a 3-D MoE expert weight [E, out, in], quantized per
    # expert: formats/experts.py). An index along dim 0 is then ``rows_per_index`` plane rows, and the
    # ops that slice, pad, concatenate or allocate along dim 0 (ops/slicing.py) run on the
    # :meth:`as_matrix` view and give the result its leading dims back (:meth:`with_shape`). The
    # block phase is always in plane rows and columns.
    @property
    def rows_per_index(self) -> int:
        """Plane rows per index along dim 0 (1 for a 2-D tensor; ``out`` for an ``[E, out, in]`` one)."""
        return math.prod(self.shape[1:-1])

    def as_matrix(self) -> "QuantizedTensor":
        """This tensor as the 2-D matrix its planes hold (leading dims flattened into rows; see the
        note), over the same planes, values plane and owner; ``self`` when it is 2-D.

        Example:
            >>> q.as_matrix().shape      # q: [8, 256, 512]
            torch.Size([2048, 512])
        """
        if self.dim() == 2:
            return self
        rows = self.shape[0] * self.rows_per_index
        hp = None if self.hp_init is None else self.hp_init.reshape(rows, self.shape[-1])
        return self.rebuild(shape=(rows, self.shape[-1]), hp_init=hp)

    def with_shape(self, shape) -> "QuantizedTensor":
        """This 2-D tensor given the logical ``shape`` whose flattened matrix it is (the inverse of
        :meth:`as_matrix`); ``self`` when ``shape`` is its own.

        Example:
            >>> q.as_matrix().with_shape(q.shape).shape
            torch.Size([8, 256, 512])
        """
        shape = tuple(shape)
        if shape == tuple(self.shape):
            return self
        hp = None if self.hp_init is None else self.hp_init.reshape(shape)
        return self.rebuild(shape=shape, hp_init=hp)

    def place_(self, phase: tuple[int, int]) -> "QuantizedTensor":
        """Give an unplaced tensor (see the note above) its block phase, keeping the scale rows of
        the blocks it then touches; a no-op for a placed one.

        Args:
            phase: where its first element lies in the weight, per dim (or that modulo the blocks).

        Example:
            >>> shard.place_((64, 0))   # rows 64.. of a weight with 128-row blocks
        """
        if self._phase is not None:
            return self
        self._phase = tuple(p % self._recipe.phase_period(d) for d, p in enumerate(phase))
        planes = {}
        for usage, (data_attr, scale_attr) in PLANE_ATTRS.items():
            data = getattr(self, data_attr)
            if data is not None:
                rows, cols = self._recipe.block_shape(usage).grid(tuple(data.shape), self._phase)
                planes[usage] = Plane(data, getattr(self, scale_attr)[:rows, :cols])
        self._set_planes(planes, self._usages)
        return self

    @property
    def usages(self) -> tuple[str, ...]:
        """Usages this tensor can serve (``"rowwise"`` for forward, ``"columnwise"`` for backward)."""
        return self._usages

    @property
    def planes(self) -> dict[str, Plane]:
        """The stored planes by usage (a new dict of :class:`Plane` views of the inner tensors)."""
        if self._phase is None:
            self._place()
        out = {}
        for usage, (data_attr, scale_attr) in PLANE_ATTRS.items():
            data = getattr(self, data_attr)
            if data is not None:
                out[usage] = Plane(data, getattr(self, scale_attr))
        return out

    @property
    def param_state(self) -> FP8ParamState:
        """The owner record of the parameter these planes belong to (scaling states; see
        ``param_state.py``), shared by the shard, the gathered weight and their views."""
        return self._param_state

    @property
    def bytes_pending(self) -> bool:
        """Whether the parameter's FP8 bytes are still to be made from :attr:`hp_init` (a model
        built on the meta device: the user's init writes :attr:`hp_init`;
        ``dtensor_fp8.finish_init_``, which :class:`MasterWeightOptimizer` calls, quantizes it).
        The owner's (``param_state.lifecycle``): one answer for the shard and every tensor
        derived from it. Reading a plane raises until then."""
        return self._param_state.lifecycle.bytes_pending

    def take_hp_init(self) -> torch.Tensor | None:
        """Hand the values plane (:attr:`hp_init`) over (to become a master) and drop this
        tensor's reference.

        Example:
            >>> master = shard.take_hp_init()   # None if it was not kept
        """
        hp, self.hp_init = self.hp_init, None
        return hp

    def plane_tensors(self) -> tuple:
        """The inner tensors, ``(rowwise data, rowwise scale_inv, columnwise data, columnwise
        scale_inv)``, ``None`` where a plane is absent: a cheap identity key for per-gather caches
        (:attr:`planes` builds a dict of views).

        Example:
            >>> q.plane_tensors() == QuantizedTensor.plane_tensors_of(q.planes)
            True
        """
        return _read_plane_fields(self)

    def holds(self, tensors: tuple) -> bool:
        """Whether this tensor's :meth:`plane_tensors` are the very objects in ``tensors`` (an
        earlier ``plane_tensors()``): the check per-gather caches make, since an optimizer step
        rewrites the planes in place and only a replacement (a checkpoint load) makes new ones.

        Args:
            tensors: a tuple from :meth:`plane_tensors` or :meth:`plane_tensors_of`.

        Example:
            >>> kept = q.plane_tensors(); q.holds(kept)
            True
        """
        for mine, kept in zip(_read_plane_fields(self), tensors, strict=True):
            if mine is not kept:
                return False
        return True

    @staticmethod
    def plane_tensors_of(planes: dict[str, Plane]) -> tuple:
        """:meth:`plane_tensors` of a tensor holding ``planes``.

        Args:
            planes: stored planes by usage, as :attr:`planes` gives them.
        """
        out = []
        for usage in PLANE_ATTRS:
            plane = planes.get(usage)
            out += (None, None) if plane is None else (plane.data, plane.scale_inv)
        return tuple(out)

    def plane(self, usage: str) -> Plane:
        """The stored plane that serves ``usage``; raises if this tensor does not hold it.

        Args:
            usage: ``"rowwise"`` or ``"columnwise"``.

        Example:
            >>> q.plane("rowwise").scale_inv.shape   # the rowwise block grid
        """
        self.check_bytes_made()
        if self._phase is None:
            self.phase  # noqa: B018  (places it, or raises with the fix)
        stored = self._recipe.stored_usage(usage)
        data_attr, scale_attr = PLANE_ATTRS[stored]
        data = getattr(self, data_attr)
        if usage not in self._usages or data is None:
            # An FSDP2-gathered weight that a schedule reads in the other direction before FSDP2
            # reshards it gets the plane from its owner (see fsdp.py); anything else raises.
            if self._param_state.gather.complete_(self, usage):
                return self.plane(usage)
            return self._missing_usage(usage)
        return Plane(data, getattr(self, scale_attr))

    def check_bytes_made(self) -> None:
        """Raise, with the fix, if this weight's FP8 bytes are still pending (see :attr:`bytes_pending`)."""
        if self._param_state.lifecycle.bytes_pending:
            raise RecipeError(
                f"{self._recipe.name}: this FP8 weight of shape {tuple(self.shape)} was built on the meta device and "
                "its FP8 bytes are not made yet. After model.to_empty(...) and your init, build the "
                "dtensor_fp8.MasterWeightOptimizer (it takes the init values as masters and quantizes them) or call "
                "dtensor_fp8.finish_init_(model) before the first forward or state_dict()." + fix_hints(MASTER_WEIGHTS))

    def _missing_usage(self, usage: str):
        hint = ""
        if torch.compiler.is_compiling():
            hint = (" Under torch.compile a compiled backward reads the planes its forward saw: with "
                    "fully_shard, compile each block before fully_shard (block.compile()), or mark the "
                    "fully_shard-ed module with dtensor_fp8.gather_both_usages(module).")
        raise RecipeError(
            f"{self._recipe.name}: this QuantizedTensor of shape {tuple(self.shape)} holds usages "
            f"{self._usages}, not {usage!r}. Gather/quantize with {usage} usage enabled "
            "(e.g. quantize(..., columnwise=True)); planes are never rebuilt from high precision implicitly."
            + hint
        )

    def dequantize(self, dtype: torch.dtype | None = None, usage: str | None = None) -> torch.Tensor:
        """High-precision values from one plane (rowwise when held, else columnwise).

        Args:
            dtype: output dtype; defaults to the nominal dtype.
            usage: which plane to read.

        Example:
            >>> w = quantize(torch.randn(64, 64), MXFP8()).dequantize(torch.float32)
        """
        usage = usage or self._usages[0]
        plane = self.plane(usage)
        return self._recipe.dequantize_plane_at(plane, usage, dtype or self.dtype, self._phase).reshape(self.shape)

    def repoint_(self, planes: dict[str, Plane], usages: tuple[str, ...] | None = None) -> "QuantizedTensor":
        """Point this tensor at other planes of the same recipe and logical shape, in place (the one
        way to change what a QuantizedTensor holds: FSDP2 re-uses its unsharded parameter object
        across gathers).

        Args:
            planes: the new planes by usage.
            usages: usages they serve (default: what ``planes`` allow).

        Example:
            >>> unsharded.repoint_(gathered.planes, gathered.usages)
        """
        self._set_planes(planes, usages)
        return self

    # ---- transpose cache ----------------------------------------------------------------------------
    # [Note: the transpose cache lives in the owner]
    # TE's backward GEMM for per-tensor and 128x128 recipes reads a physical (K, M) copy of the
    # shared plane. The parameter's owner record keeps it (``param_state.gather.transpose``) with the
    # plane tensors it was built from; a tensor sees it while it holds those very tensors
    # (:meth:`holds`), so every alias of the gathered weight (FSDP2's ``as_strided`` and
    # ``nn.Parameter``, autocast's cast, a GEMM's transpose view) finds it without any op carrying
    # it, and a tensor re-pointed at other planes (the next gather, a load) does not. It is dropped
    # after its one use (the input-gradient GEMM), when the planes are rewritten in place (``copy_``,
    # a requantization) and at the next gather (``GatherState.start_gather``): it never outlives
    # the unsharded weight it was built for.
    @property
    def transpose_cache(self) -> torch.Tensor | None:
        """TE's transposed ``(K, M)`` copy of the shared plane, if built for the planes this tensor
        holds (see :meth:`create_transpose_cache`)."""
        kept = self._param_state.gather.transpose
        if kept is None or COLUMNWISE not in self._usages or not self.holds(kept[0]):
            return None
        return kept[1]

    def create_transpose_cache(self) -> torch.Tensor | None:
        """Build TE's transposed copy of the shared plane (transpose-derived recipes serving the
        columnwise usage; ``None`` otherwise) and keep it in the owner record; idempotent.

        Example:
            >>> q.create_transpose_cache().shape   # (K, M)
        """
        if not (self._recipe.columnwise_is_transpose and COLUMNWISE in self._usages):
            return None
        cache = self.transpose_cache
        if cache is None:
            cache = self._recipe.transpose_cache(self.plane(COLUMNWISE))  # the shared plane
            self._param_state.gather.transpose = (self.plane_tensors(), cache)
        return cache

    def discard_transpose_cache(self) -> None:
        """Drop the parameter's transpose cache (after its one use, or when the planes change)."""
        gather = self._param_state.gather
        if gather.transpose is not None:  # no write otherwise: compiled code runs this as a no-op
            gather.transpose = None

    def columnwise_matrix(self, dtype: torch.dtype) -> torch.Tensor:
        """Dequantized ``(M, K)`` values as the backward GEMM reads them: from the columnwise
        plane, or for transpose-derived recipes from the transpose cache when it is built, else
        from the shared plane directly (the same values; nothing is built or stored here, so this
        is a pure function of the planes and compiles).

        Args:
            dtype: output dtype.

        Example:
            >>> grad_x = grad_out @ q.columnwise_matrix(grad_out.dtype)
        """
        if self._recipe.columnwise_is_transpose and not any(self.phase):
            plane = self.plane(COLUMNWISE)  # the shared plane; raises if COLUMNWISE is not served
            cache = self.transpose_cache
            data = plane.data if cache is None else cache.t()
            return self._recipe.decode(data, plane.scale_inv, COLUMNWISE, dtype)
        return self.dequantize(dtype, COLUMNWISE)

    # ---- construction helpers -------------------------------------------------------------------
    def rebuild(self, planes: dict[str, Plane] | None = None, *, shape=None, usages=None,
                dtype=None, hp_init=_SAME_VALUES, phase=_SAME_VALUES) -> "QuantizedTensor":
        """A new QuantizedTensor of this recipe and parameter (the same :attr:`param_state`): these
        planes / shape / usages / dtype / values plane (:attr:`hp_init`) unless given. An op that
        changes the shape gives the values plane its new shape, as it does the FP8 planes: keeping
        this tensor's would raise, so no op drops the values by omission.

        Args:
            planes: the FP8 planes by usage (default: this tensor's).
            shape, usages, dtype: of the new tensor (default: this tensor's).
            hp_init: its values plane (default: this tensor's; ``None``: none).
            phase: its block phase (default: this tensor's; ``None``: unplaced, see :meth:`place_`).

        Example:
            >>> q.rebuild(q.planes, dtype=torch.float32)   # same bytes, another nominal dtype
        """
        return QuantizedTensor.from_planes(
            self.planes if planes is None else planes, self._recipe, self.shape if shape is None else shape,
            dtype or self.dtype, self._usages if usages is None else usages,
            param_state=self._param_state, hp_init=self.hp_init if hp_init is _SAME_VALUES else hp_init,
            phase=self._phase if phase is _SAME_VALUES else phase,
        )

    def with_usages(self, *usages: str) -> "QuantizedTensor":
        """A view holding only the planes needed for ``usages`` (no copy): gather this one to move
        only one direction's bytes, e.g. ``q.with_usages("rowwise")`` for forward."""
        for u in usages:
            self.plane(u)
        stored = {self._recipe.stored_usage(u) for u in usages}
        return self.rebuild({k: v for k, v in self.planes.items() if k in stored}, usages=usages)

    def inner_tensors(self) -> list[torch.Tensor]:
        """Every FP8 data and scale tensor this tensor holds."""
        return [getattr(self, name) for name in self.__tensor_flatten__()[0]]

    # ---- torch.compile: the traceable-subclass protocol -----------------------------------------------
    def __tensor_flatten__(self):
        names = [attr for attrs in PLANE_ATTRS.values() for attr in attrs if getattr(self, attr) is not None]
        return names, (self._recipe, self._usages, self.dtype, self._phase)

    @staticmethod
    def __tensor_unflatten__(inner, ctx, outer_size, outer_stride):
        recipe, usages, dtype, phase = ctx
        row, col = PLANE_ATTRS[ROWWISE], PLANE_ATTRS[COLUMNWISE]
        return QuantizedTensor(inner.get(row[0]), inner.get(row[1]), inner.get(col[0]), inner.get(col[1]),
                               recipe, outer_size, dtype, usages, phase=phase)

    def _stable_hash_for_caching(self) -> str:
        """A key for AOTAutograd's compiled-graph cache that is the same in every process (torch 2.13's
        hook; the default also works but warns): the constant metadata and each inner tensor's layout."""
        inner = [(name, tuple(t.shape), tuple(t.stride()), str(t.dtype), t.device.type, t.storage_offset())
                 for name, t in ((n, getattr(self, n)) for n in self.__tensor_flatten__()[0])]
        key = repr((type(self).__qualname__, repr(self._recipe), self._usages, str(self.dtype), tuple(self.shape),
                    self.requires_grad, inner, self._phase))
        return hashlib.blake2b(key.encode(), digest_size=16).hexdigest()

    def __repr__(self) -> str:
        return (
            f"QuantizedTensor(shape={tuple(self.shape)}, dtype={self.dtype}, recipe={self._recipe!r}, "
            f"usages={self._usages}, planes={tuple(self.planes)}"
            + (")" if self._phase == (0, 0) else f", phase={self._phase})")
        )

    # ---- dispatch (the op tables are filled by dtensor_fp8/ops/, see op_table.py) ---------------------
    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        impl = QUANTIZED_FUNCTIONS.lookup(func)
        if impl is not None:
            return impl(*args, **kwargs)
        # No conversion of results to this class: ops that produce plain tensors (GEMMs on the
        # planes, ``view(-1)``'s raw bytes) must stay plain (torch's default would re-wrap them).
        return torch._C._disabled_torch_function_impl(func, types, args, kwargs)

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        impl = QUANTIZED_OPS.lookup(func)
        if impl is None:
            # A meta-built weight whose bytes are pending runs its init's other ops on its values.
            result = QUANTIZED_OPS.fallback(func, args, kwargs)
            if result is not NotImplemented:
                return result
            shapes = tree_map_only(QuantizedTensor, lambda t: f"QuantizedTensor{tuple(t.shape)}", args)
            hint = ""
            if func.__name__.startswith(("_fused_", "_foreach_")):  # a torch optimizer's step on the weight
                hint = (" An optimizer is updating FP8 weights in place: train them through high-precision masters "
                        "with dtensor_fp8.MasterWeightOptimizer(model, torch.optim.AdamW, ...)." + fix_hints(MASTER_WEIGHTS))
            raise NotImplementedError(
                f"dtensor_fp8: {func} is not supported on a QuantizedTensor (args: {shapes}). FP8 weights "
                "are never silently dequantized: call .dequantize() for a high-precision copy, or use "
                "torch.nn.functional.linear, which runs on the FP8 planes." + hint
            )
        return impl(func, args, kwargs)
