"""The fake-tensor dispatch cache's key, computed from a memo of layouts, is torch's own key."""

from __future__ import annotations

import torch
from torch._subclasses._fake_tensor_utils import _CacheKeyState
from torch._subclasses.fake_tensor import FakeTensorMode

from batchfit.memory.trace import fastkey
from batchfit.memory.trace.construct import fake_session
from batchfit.memory.trace.values import FakeValueMode


def _keys(mode: FakeTensorMode, args: object) -> tuple[list, list | None]:
    theirs: list = []
    FakeTensorMode._prep_args_for_hash(mode, theirs, args, _CacheKeyState(), [])
    ours: list = []
    return theirs, ours if fastkey.flatten_args(mode, ours, args, _CacheKeyState()) else None


def test_the_installed_torch_gets_the_fast_key_even_when_first_asked_inside_a_traced_op(monkeypatch) -> None:
    # On a torch whose metadata or encoding differs the fast path turns itself off; on this one it is on,
    # also when the check first runs inside a traced step (with batchfit's modes set).
    import batchfit
    from batchfit.memory.cache import no_cache

    monkeypatch.setattr(fastkey, "_MATCHES", None)
    with no_cache():
        batchfit.estimate("mlp", 2, device="A100-80GB")
    assert fastkey._MATCHES is True


def test_every_layout_gets_torchs_own_key_and_layouts_that_differ_get_keys_that_differ() -> None:
    mode = FakeTensorMode()
    with mode:
        x = torch.empty(4, 3, 8, 8)
        tensors = [
            x,
            x.to(memory_format=torch.channels_last),  # same shape, other strides
            x.transpose(2, 3),  # not contiguous in any format
            x[1:],  # a storage offset
            x.view(4, 192),
            torch.empty(4, 3, 8, 8, dtype=torch.bfloat16),
            torch.empty(4, 3, 8, 8, requires_grad=True),
            torch.empty((), dtype=torch.int64),
            torch.empty(0, 5),
            torch.empty(6, 7).t(),
        ]
    fastkey._MEMO.clear()
    seen = set()
    for t in tensors:
        for args in ((t,), (t, 1, [t, 2.0]), {"input": t, "dim": (0, 1), "dtype": torch.float16, "out": None}):
            theirs, ours = _keys(mode, args)
            assert ours == theirs
        seen.add(tuple(_keys(mode, (t,))[1]))  # the second time from the memo
    assert len(seen) == len(tensors)


def test_unusual_arguments_fall_back_to_torchs_method_and_leave_the_key_untouched() -> None:
    mode = FakeTensorMode()
    other = FakeTensorMode()
    with mode:
        x = torch.empty(2, 2)
    with other:
        y = torch.empty(2, 2)
    for args in ((x, torch.ones(2)), (x, y), (x, lambda: 0), (x, [x, object()])):
        result = ["func"]
        assert not fastkey.flatten_args(mode, result, args, _CacheKeyState())
        assert result == ["func"]


def test_batchfits_fake_session_builds_the_same_cache_key_as_torchs_fake_mode() -> None:
    with fake_session() as values:
        mode = torch._C._get_dispatch_mode(torch._C._TorchDispatchModeKey.FAKE)
        assert isinstance(mode, FakeValueMode) and mode.values is values
        a = torch.empty(3, 5, requires_grad=True)
        b = torch.empty(5, 2)
    func = torch.ops.aten.mm.default
    ours = mode._cache_key(_CacheKeyState(), func, (a, b), {})
    fastkey_off = FakeTensorMode._prep_args_for_hash
    theirs: list = []
    fastkey_off(mode, theirs, (a, b), _CacheKeyState(), [])
    assert list(ours.key[-len(theirs) :]) == theirs
