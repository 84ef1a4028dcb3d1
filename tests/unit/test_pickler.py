"""What the pickler sends: functions by value keep their file's name (cloudpickle >= 3.1 renames it
"<dynamic-code>") and their source; small tensors travel as their raw bytes, each back as a tensor of its own."""

from __future__ import annotations

import linecache
import pickle
import traceback

import pytest
import torch

from nn_handler.utils._workers import pickler, transport


def _outer():
    def inner(x):
        return [1 / v for v in x]  # a comprehension: code nested twice

    return inner


def test_code_nested_in_a_function_keeps_its_file():
    fn = _outer()
    copy = pickle.loads(pickler.dumps(fn))
    nested = [c for c in copy.__code__.co_consts if hasattr(c, "co_filename")]
    assert copy.__code__.co_filename == __file__ and nested and all(c.co_filename == __file__ for c in nested)
    with pytest.raises(ZeroDivisionError) as info:
        copy([0])
    text = "".join(traceback.format_exception(info.value))
    assert f'File "{__file__}", line {fn.__code__.co_firstlineno + 1}' in text
    assert "return [1 / v for v in x]  # a comprehension" in text


def test_the_source_of_a_file_that_is_not_on_disk_travels_with_the_code(monkeypatch):
    # What a notebook cell is: a file name that linecache knows and the disk does not.
    name = "/no/such/dir/ipykernel_1/cell_7.py"
    source = "def cell(x):\n    return x.missing  # the cell's line\n"
    namespace: dict = {"__name__": "__main__"}
    exec(compile(source, name, "exec"), namespace)
    monkeypatch.setitem(linecache.cache, name, (len(source), None, source.splitlines(True), name))
    data = pickler.dumps(namespace["cell"])
    del linecache.cache[name]  # as in a fresh worker
    copy = pickle.loads(data)
    with pytest.raises(AttributeError) as info:
        copy(1)
    text = "".join(traceback.format_exception(info.value))
    assert f'File "{name}", line 2, in cell\n    return x.missing  # the cell\'s line' in text, text


def test_equal_code_of_two_files_keeps_each_its_own_file():
    # Code objects compare equal whatever their file: each must still travel with its own.
    source = "def same(x):\n    return x\n"
    copies = []
    for name in ("/no/such/a.py", "/no/such/b.py"):
        namespace: dict = {"__name__": "__main__"}
        exec(compile(source, name, "exec"), namespace)
        copies.append(pickle.loads(pickler.dumps(namespace["same"])))
    assert [c.__code__.co_filename for c in copies] == ["/no/such/a.py", "/no/such/b.py"]


def test_a_file_on_disk_is_not_sent_along():
    data = pickler.dumps(_outer())
    assert b"a comprehension: code nested twice" not in data


def test_a_function_pickles_to_the_same_bytes_each_time():
    # The worker's cache names a function's body by the digest of these bytes.
    encoder = transport.Encoder(None, private=True)
    fn = _outer()
    assert encoder.pack_function(fn).digest == encoder.pack_function(fn).digest
    assert pickler.dumps(fn) == pickler.dumps(fn)



# ----------------------------------------------------------------------------- small tensors: raw bytes
DTYPES = [torch.bool, torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64, torch.uint16, torch.uint32,
          torch.uint64, torch.float16, torch.bfloat16, torch.float32, torch.float64, torch.complex32,
          torch.complex64, torch.complex128, torch.float8_e4m3fn, torch.float8_e5m2]
SHAPES = [(), (0,), (1,), (5,), (2, 3), (0, 4), (2, 1, 3)]
# Both ends: what the caller sends (arguments, a map's items) and what a worker sends back (results).
SENDERS = {"arguments": dict(prefix="/dev/shm/nnh-test-args-"), "results": dict(prefix=None, to_cpu=True)}
# A list of one dtype travels as one block of bytes (tensor_bytes.pack_list); in a tuple, one tensor at a time.
CONTAINERS = {"packed": list, "one at a time": tuple}


def _filled(dtype: torch.dtype, shape) -> torch.Tensor:
    """Distinct bit patterns in every byte, for every dtype (random bytes viewed as it; a bool is 0 or 1)."""
    size = torch.Size(shape).numel() * dtype.itemsize
    raw = torch.randint(0, 2 if dtype == torch.bool else 256, (size,), dtype=torch.uint8,
                        generator=torch.Generator().manual_seed(size))
    return raw.view(dtype).reshape(shape)


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().reshape(-1).view(torch.uint8)  # compares NaNs and float8 alike


def _round_trip(obj, sender: str, probe: bool = False, packed: bool | None = None):
    encoder = transport.Encoder(**SENDERS[sender])
    data = encoder.probe(obj) if probe else encoder.dumps(obj)[0]
    assert data is not None  # small: no file
    if packed is not None:
        assert (b"rebuild_list" in data) == packed and (b"rebuild_tensor" in data) == (not packed)
    return transport.loads(data)


def _assert_own_tensor(back: torch.Tensor, sent: torch.Tensor) -> None:
    assert type(back) is torch.Tensor and back.dtype == sent.dtype and back.shape == sent.shape
    assert back.is_contiguous() and back.stride() == torch.empty(sent.shape).stride()  # contiguous, as documented
    assert torch.equal(_bits(back), _bits(sent))
    assert back.untyped_storage().nbytes() == back.nbytes  # its own memory, nothing more


@pytest.mark.parametrize("container", CONTAINERS)
@pytest.mark.parametrize("sender", SENDERS)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_a_small_tensor_of_every_dtype_and_shape_comes_back_bit_for_bit(container, sender, dtype):
    sent = CONTAINERS[container](_filled(dtype, shape) for shape in SHAPES)
    for probe in (False, True) if sender == "arguments" else (False,):
        back = _round_trip(sent, sender, probe, packed=container == "packed")
        assert type(back) is type(sent) and len(back) == len(sent)
        for b, s in zip(back, sent):
            _assert_own_tensor(b, s)


@pytest.mark.parametrize("container", CONTAINERS)
@pytest.mark.parametrize("sender", SENDERS)
def test_each_tensor_of_a_chunk_is_its_own_writable_tensor(container, sender):
    sent = CONTAINERS[container]([torch.full((4,), float(i)) for i in range(8)] + [torch.zeros(()), torch.ones(2, 2)])
    back = _round_trip(sent, sender, packed=container == "packed")
    storages = {t.untyped_storage().data_ptr() for t in back}
    assert len(storages) == len(back)  # no two share memory, no view into the message
    for t in back:
        t.add_(1)  # writable, in place
    assert [float(t.sum()) for t in back] == [float(s.sum() + s.numel()) for s in sent]
    assert all(not torch.equal(t, s) for t, s in zip(back, sent))  # the sender's tensors are untouched


@pytest.mark.parametrize("container", CONTAINERS)
@pytest.mark.parametrize("sender", SENDERS)
def test_a_non_contiguous_small_tensor_comes_back_contiguous_with_its_values(container, sender):
    base = torch.arange(60, dtype=torch.float64).reshape(6, 10)
    views = [base.t(), base[1:, 3:], base[:, ::3], base[2, 1:], torch.ones(1, 4, dtype=torch.float64).expand(5, 4),
             base[3, 4], base.flatten()[7:19], base[::2, ::3]]
    mixed = [torch.arange(8.0).to(torch.complex64)[::2], torch.tensor([True, False, True])[1:],
             base.to(torch.bfloat16)[::2, 1::4]]
    for sent, packed in ((views, container == "packed"), (mixed, False)):
        sent = CONTAINERS[container](sent)
        for back, view in zip(_round_trip(sent, sender, packed=packed), sent):
            _assert_own_tensor(back, view)
            assert torch.equal(back, view)


@pytest.mark.parametrize("container", CONTAINERS)
def test_requires_grad_comes_with_an_argument_and_not_with_a_result(container):
    weights = [torch.ones(3, requires_grad=True), torch.zeros((), dtype=torch.float64, requires_grad=True),
               torch.zeros(0, requires_grad=True), torch.ones(4, 2, dtype=torch.complex64).t().requires_grad_()]
    for back, w in zip(_round_trip(CONTAINERS[container](weights), "arguments", packed=False), weights):
        assert back.requires_grad and back.is_leaf and back.grad_fn is None
        _assert_own_tensor(back.detach(), w.detach())
    outputs = CONTAINERS[container](w * 2 for w in weights[:3])  # non-leaves: a worker's results come back detached
    for back, out in zip(_round_trip(outputs, "results", packed=False), outputs):
        assert not back.requires_grad
        _assert_own_tensor(back, out.detach())
    one_of = [torch.ones(2), torch.ones(2, requires_grad=True)]  # one needing grad: none of the list is packed
    assert [t.requires_grad for t in _round_trip(one_of, "arguments", packed=False)] == [False, True]


@pytest.mark.parametrize("sender", SENDERS)
def test_a_list_that_cannot_be_packed_travels_one_tensor_at_a_time_with_nothing_lost(sender):
    t = torch.arange(4.0)
    twice = _round_trip([t, torch.ones(4), t], sender, packed=False)
    assert twice[0] is twice[2] and twice[0] is not twice[1]  # one tensor met twice: one tensor (pickle's memo)
    mixed = _round_trip([torch.ones(2), torch.ones(2, dtype=torch.int32), 3, None], sender, packed=False)
    assert [x.dtype for x in mixed[:2]] == [torch.float32, torch.int32] and mixed[2:] == [3, None]
    sparse = [torch.ones(2).to_sparse(), torch.ones(2)]
    assert [x.layout for x in _round_trip(sparse, sender, packed=False)] == [torch.sparse_coo, torch.strided]


@pytest.mark.parametrize("container", CONTAINERS)
@pytest.mark.parametrize("sender", SENDERS)
def test_a_conjugate_or_negative_bit_comes_back_as_the_values_it_stands_for(container, sender):
    c = torch.tensor([1 + 2j, 3 - 4j])
    for sent, expected in (([c.conj(), c], [[1 - 2j, 3 + 4j], [1 + 2j, 3 - 4j]]),
                           ([c.conj().imag, torch.ones(2)], [[-2.0, 4.0], [1.0, 1.0]])):
        back = _round_trip(CONTAINERS[container](sent), sender)
        assert [x.tolist() for x in back] == expected


def test_a_large_tensor_in_a_list_is_never_packed_even_where_every_tensor_goes_as_bytes():
    big = torch.ones(transport.SHM_THRESHOLD // 4)
    back = _round_trip([torch.ones(2), big], "results", packed=False)  # one copy less than in a block
    assert torch.equal(back[1], big)


def test_a_large_tensor_in_a_list_still_goes_to_shared_memory():
    encoder = transport.Encoder(**SENDERS["arguments"])
    big = torch.ones(transport.SHM_THRESHOLD // 4)
    assert encoder.probe([torch.ones(2), big]) is None  # it needs a file: not bytes in the message
    data, files = encoder.dumps([torch.ones(2), big])
    try:
        small, back = transport.loads(data)
        assert torch.equal(back, big) and torch.equal(small, torch.ones(2))
    finally:
        transport.remove_files(files)


@pytest.mark.parametrize("sender", SENDERS)
def test_a_nested_tensor_travels_as_torch_pickles_it(sender):
    nested = torch.nested.nested_tensor([torch.arange(2.0), torch.arange(3.0)])
    for sent, at in (([nested, torch.ones(2)], 0), ([torch.ones(2), nested], 1), ((nested,), 0)):
        back = _round_trip(sent, sender, packed=False)[at]
        assert back.is_nested and [x.tolist() for x in back.unbind()] == [[0.0, 1.0], [0.0, 1.0, 2.0]]
