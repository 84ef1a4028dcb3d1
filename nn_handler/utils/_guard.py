"""Debug guard: a ``torch.distributed`` collective inside code that only some ranks run raises at once.

The most common DDP hang: ``dist.all_reduce`` (or a barrier, a broadcast)
inside an ``@on_rank(0)`` function or a ``main_process_first`` block. Only
those ranks reach it, so it waits for ranks that never come. nn_handler's own
collectives refuse there already; with ``NN_HANDLER_DEBUG=1`` or
``on_rank(..., debug=True)`` the user's direct torch calls do too.

How: while the guarded code runs, a profile function (``sys.setprofile``, this
thread only) watches for calls of torch's collective functions. That costs a
little on every Python call, which is why it is a debug option.

Which functions are collectives is read from the installed torch, not kept
by hand here: a function of ``torch.distributed.distributed_c10d`` (or of the
functional collectives) is one when its code calls a ``ProcessGroup`` method
that starts communication (one that returns a ``Work``), or calls the c10d
functional ops, directly or, for a public function, through another
collective (``broadcast_object_list`` through ``broadcast``). A collective is
refused only when a rank of its group (a point-to-point call: its peer) is
not inside the guarded code: ``on_rank([0, 1])`` in a job of two ranks may
``all_reduce`` among them.
"""

from __future__ import annotations

import contextlib
import inspect
import os
import sys
import types
from typing import Collection, Iterator, Mapping

__all__: list[str] = []

# ProcessGroup.monitored_barrier waits for every rank but returns None, not a Work.
_ALSO_WAITS = frozenset({"monitored_barrier"})
_FUNCTIONAL_OPS = frozenset({"_c10d_functional", "_c10d_functional_autograd"})
_codes: dict | None = None


def debug_enabled(environ: Mapping[str, str] | None = None) -> bool:
    """True when ``NN_HANDLER_DEBUG`` is set to something other than ``""``/``0``/``false``."""
    value = (os.environ if environ is None else environ).get("NN_HANDLER_DEBUG", "")
    return value.strip().lower() not in ("", "0", "false", "no", "off")


def _names(code: types.CodeType) -> set[str]:
    """The global and attribute names ``code`` (and the functions nested in it) refers to."""
    names = set(code.co_names)
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            names |= _names(const)
    return names


def _functions(module) -> dict[str, types.FunctionType]:
    found = {}
    for name, obj in vars(module).items():
        fn = inspect.unwrap(obj) if callable(obj) else None  # past torch's logging wrappers
        if isinstance(fn, types.FunctionType) and fn.__module__ == module.__name__:
            found[name] = fn
    return found


def collective_functions() -> dict[str, types.FunctionType]:
    """Every collective function of the installed ``torch.distributed``, by its name there (see the module docstring).

    Example:
        >>> found = collective_functions()
        >>> {"all_reduce", "all_gather_into_tensor", "send", "recv", "broadcast_object_list"} <= set(found)
        True
        >>> "get_rank" in found or "is_initialized" in found
        False
        >>> "_functional_collectives.all_reduce" in found
        True
    """
    import torch.distributed._functional_collectives as functional
    import torch.distributed.distributed_c10d as c10d
    from torch._C._distributed_c10d import ProcessGroup

    starts = {name for name in dir(ProcessGroup) if callable(getattr(ProcessGroup, name, None))
              and "Work" in (getattr(ProcessGroup, name).__doc__ or "").partition("->")[2][:80]} | _ALSO_WAITS
    found: dict[str, types.FunctionType] = {}
    for module, direct, prefix in ((c10d, starts, ""), (functional, _FUNCTIONAL_OPS, "_functional_collectives.")):
        functions = _functions(module)
        names = {name: _names(fn.__code__) for name, fn in functions.items()}
        mine = {name for name in functions if names[name] & direct}
        grew = True
        while grew:  # a public function that calls a collective is one (broadcast_object_list -> broadcast)
            grew = False
            for name in functions:
                if name not in mine and not name.startswith("_") and names[name] & mine:
                    mine.add(name)
                    grew = True
        if module is functional:  # a functional collective names its group; wait_tensor and the like do not
            mine = {name for name in mine if "group" in inspect.signature(functions[name]).parameters}
        found.update({prefix + name: functions[name] for name in mine})
    return found


def _collective_codes() -> dict:
    global _codes
    if _codes is None:
        _codes = {fn.__code__: name for name, fn in collective_functions().items()}
    return _codes


def _group_ranks(group) -> set[int]:
    """The global ranks of ``group`` (``None``: the default group) as a collective's argument names it."""
    import torch.distributed as dist

    if group is None:
        return set(range(dist.get_world_size()))
    if isinstance(group, dist.ProcessGroup):
        return set(dist.get_process_group_ranks(group))
    if isinstance(group, (list, tuple)) and all(isinstance(r, int) for r in group):
        return set(group)
    try:  # a group name, a device mesh: as the functional collectives resolve it
        from torch.distributed._functional_collectives import _resolve_group_name
        from torch.distributed.distributed_c10d import _resolve_process_group

        return set(dist.get_process_group_ranks(_resolve_process_group(_resolve_group_name(group))))
    except Exception:  # noqa: BLE001 - not known: assume every rank takes part
        return set(range(dist.get_world_size()))


def involved_ranks(name: str, args: Mapping) -> set[int]:
    """The global ranks that must call collective ``name`` with arguments ``args`` for it to finish."""
    import torch.distributed as dist

    group = args.get("group")
    if "send" in name or "recv" in name:  # point to point: this rank and its peer
        for peer_key, group_key in (("dst", "group_dst"), ("src", "group_src")):
            peer = args.get(peer_key)
            if peer is None and args.get(group_key) is not None:
                peer = dist.get_global_rank(group or dist.group.WORLD, args[group_key])
            if isinstance(peer, int):
                return {dist.get_rank(), peer}
    if args.get("use_local_synchronization") and args.get("ranks"):  # new_group: only its ranks wait
        return set(args["ranks"])
    return _group_ranks(group)


@contextlib.contextmanager
def no_collectives(where: str, ranks: str, inside: Collection[int] = ()) -> Iterator[None]:
    """Raise ``RuntimeError`` when the block calls a torch collective some of whose ranks are not ``inside`` it.

    This thread only.

    Args:
        where: Names the code, e.g. ``"the on_rank(0) function save"``.
        ranks: Who runs it, e.g. ``"rank 0"``.
        inside: The global ranks that run the block at the same time.
    """
    codes = _collective_codes()
    inside = frozenset(inside)
    previous = sys.getprofile()

    def check(frame, event, arg):
        if event == "call" and frame.f_code in codes:
            name = codes[frame.f_code]
            missing = involved_ranks(name, frame.f_locals) - inside
            if missing:
                sys.setprofile(previous)
                raise RuntimeError(
                    f"torch.distributed.{name} was called inside {where}, which only {ranks} runs: rank"
                    f"{'s' if len(missing) > 1 else ''} {', '.join(map(str, sorted(missing)))} never join this "
                    f"{name}, so it would hang until the process group's timeout. Call it outside, on every rank "
                    f"(to share a value from rank 0, use on_rank(..., broadcast_result=True)). "
                    f"(Raised by the debug guard: NN_HANDLER_DEBUG=1 or on_rank(..., debug=True).)"
                )
        if previous is not None:
            previous(frame, event, arg)

    sys.setprofile(check)
    try:
        yield
    finally:
        sys.setprofile(previous)
