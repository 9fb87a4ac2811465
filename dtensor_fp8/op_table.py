"""The op tables of the package's tensor subclasses: which function implements which op.

[Note: one op table per subclass, filled in one place]
``QuantizedTensor.__torch_dispatch__`` looks every aten / c10d op up in :data:`QUANTIZED_OPS`,
``QuantizedTransposeView``'s in :data:`TRANSPOSE_VIEW_OPS`; ``QuantizedTensor.__torch_function__``
looks up the few torch functions it takes over before autograd (``F.linear``) in
:data:`QUANTIZED_FUNCTIONS`. Every table is filled by the ``dtensor_fp8.ops`` package, with one
decorator (``@QUANTIZED_OPS.implements([...])``), when ``import dtensor_fp8`` imports it; a second
registration of an op is an error naming the op and both implementations (nothing is silently
overridden, e.g. by another module's import order). The tables live here, below ``tensor.py``,
so that the tensor class imports no module that imports it (no import cycle).
"""

from __future__ import annotations

from typing import Callable


class OpTable:
    """Ops -> implementations for one tensor subclass.

    Args:
        owner: what the table dispatches for (named in error messages).

    Example:
        >>> @QUANTIZED_OPS.implements([torch.ops.aten.clone.default])
        ... def _clone(func, args, kwargs): ...
    """

    def __init__(self, owner: str):
        self.owner = owner
        self._impls: dict = {}
        self._fallback: Callable | None = None

    def set_fallback(self, fn: Callable) -> None:
        """Register ``fn(func, args, kwargs)``, tried for an op without an implementation; it
        returns ``NotImplemented`` to decline (the op then raises). Registered once.

        Raises:
            ValueError: a fallback is already registered.
        """
        if self._fallback is not None:
            raise ValueError(f"dtensor_fp8: {self.owner} already has a fallback ({self._fallback.__qualname__})")
        self._fallback = fn

    def fallback(self, func, args, kwargs):
        """The fallback's result for ``func``, or ``NotImplemented``."""
        return NotImplemented if self._fallback is None else self._fallback(func, args, kwargs)

    def implements(self, ops) -> Callable:
        """Decorator registering ``fn(func, args, kwargs)`` for every op in ``ops``: op overloads or
        packets, or qualified names (``"lib::op"``) for ops of a library that may not be loaded.

        Raises:
            ValueError: an op already has an implementation in this table.
        """
        ops = list(ops)

        def register(fn: Callable) -> Callable:
            for op in ops:  # all checked before any is registered: a refused call changes nothing
                existing = self._impls.get(op)
                if existing is not None:
                    raise ValueError(
                        f"dtensor_fp8: {op} already has an implementation for {self.owner} "
                        f"({existing.__module__}.{existing.__qualname__}); refusing a second one "
                        f"({fn.__module__}.{fn.__qualname__}). Each op is registered once, in dtensor_fp8/ops/."
                    )
            for op in ops:
                self._impls[op] = fn
            return fn

        return register

    def lookup(self, func) -> Callable | None:
        """The implementation of ``func`` (an op overload, its packet, or its qualified name), or ``None``."""
        impl = self._impls.get(func)
        if impl is None and hasattr(func, "overloadpacket"):
            impl = self._impls.get(func.overloadpacket) or self._impls.get(func.name())
        return impl

    def __contains__(self, func) -> bool:
        return self.lookup(func) is not None

    def ops(self) -> list:
        """Every registered op, in registration order."""
        return list(self._impls)


#: aten / c10d ops on a ``QuantizedTensor`` (``__torch_dispatch__``).
QUANTIZED_OPS = OpTable("QuantizedTensor")
#: torch functions a ``QuantizedTensor`` takes over before autograd decomposes them (``__torch_function__``).
QUANTIZED_FUNCTIONS = OpTable("QuantizedTensor (__torch_function__)")
#: aten ops on a ``QuantizedTransposeView`` (``W.t()`` of a quantized weight).
TRANSPOSE_VIEW_OPS = OpTable("QuantizedTransposeView")
