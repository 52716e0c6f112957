"""The masked lerp kernel (``shardavg.kernels``) run on the CPU by the Triton interpreter: bitwise
ATen's lerp for every dtype pairing, several shadows from one read, and nothing written when the
device flag says no. (On CUDA, compiled: tests_gpu/test_kernels_cuda.py.)

Bitwise equality with torch's CPU lerp relies on ATen's vectorized ``fmadd`` being a fused
multiply-add, as on every x86-64 CPU with AVX2 (torch's default build there) and on ARM."""

from __future__ import annotations

import builtins
import importlib.util
from collections.abc import Iterator

import pytest
import torch

from shardavg import WeightAverager
from shardavg.update import kernels

# numpy, under the interpreter, about infinities and NaN the tests put there on purpose
pytestmark = pytest.mark.filterwarnings("ignore:(overflow|invalid value) encountered:RuntimeWarning:triton.*")

WEIGHTS = (0.001, 0.5, 0.9, 1.0)
SIZES = (1, 1023, 1025, 3000)  # around a program's 1024 elements and not a multiple of it
BITS = {torch.float32: torch.int32, torch.bfloat16: torch.int16, torch.float16: torch.int16}


@pytest.fixture(autouse=True)
def interpreted(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """Triton's interpreter on the CPU, the kernel built afresh for it (and forgotten after)."""
    if importlib.util.find_spec("triton") is None:
        pytest.fail("triton is not installed: it is a test dependency (pip install -e '.[test]'), see pyproject.toml")
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    kernels.reset()
    if not kernels._available("cpu"):  # (not ``usable``: its self-check, ~1 s here, is test_kernel_fallback.py's)
        import triton

        pytest.skip(
            f"Triton {triton.__version__}'s interpreter multiplies then adds where a GPU's fma rounds once, so it "
            "cannot show the kernel's bits on a CPU: pip install 'triton>=3.9' (torch's CUDA wheels pin an older one; "
            "there tests_gpu checks the compiled kernel)"
        )
    yield
    kernels.reset()


def bitwise(got: torch.Tensor, want: torch.Tensor) -> bool:
    """Same dtype and the same bits (``torch.equal`` takes -0.0 for 0.0)."""
    return got.dtype == want.dtype and torch.equal(got.view(BITS[got.dtype]), want.view(BITS[want.dtype]))


def values(numel: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return (torch.randn(numel, generator=generator) * 3).to(dtype)


def weight(value: float, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return torch.tensor([value], dtype=dtype)


OK, NOT_OK = torch.ones((), dtype=torch.bool), torch.zeros((), dtype=torch.bool)


@pytest.mark.parametrize("numel", SIZES)
def test_fp32_is_bitwise_foreach_lerp(numel: int) -> None:
    live = values(numel, torch.float32, 1)
    for w in WEIGHTS:
        shadow = values(numel, torch.float32, 2)
        want = [shadow.clone()]
        torch._foreach_lerp_(want, [live], w)
        kernels.masked_update_([shadow], live, [weight(w)], OK)
        assert bitwise(shadow, want[0]), (numel, w)


@pytest.mark.parametrize("live_dtype", [torch.bfloat16, torch.float16])
def test_half_live_weights_into_fp32_shadows_are_bitwise_the_lerp_toward_their_fp32_value(live_dtype) -> None:
    live = values(3000, live_dtype, 3)
    for w in WEIGHTS:
        shadow = values(3000, torch.float32, 4)
        want = torch.lerp(shadow, live.float(), w)
        kernels.masked_update_([shadow], live, [weight(w)], OK)
        assert bitwise(shadow, want), (live_dtype, w)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_shadows_are_bitwise_torch_lerp_in_their_dtype(dtype) -> None:
    """bf16/fp16 shadows: ATen's lerp computes in fp32 and rounds once to nearest even; a weight
    given in the shadow dtype is read as the fp32 value it holds."""
    live = values(3000, dtype, 5)
    for w in WEIGHTS:
        for w_dtype in (torch.float32, dtype):
            shadow = values(3000, dtype, 6)
            given = weight(w, w_dtype)
            want = torch.lerp(shadow, live, float(given))
            kernels.masked_update_([shadow], live, [given], OK)
            assert bitwise(shadow, want), (dtype, w, w_dtype)


@pytest.mark.parametrize(
    ("live_dtype", "dtype"),
    [(torch.float32, torch.bfloat16), (torch.float32, torch.float16), (torch.float16, torch.bfloat16)],
)
def test_live_weights_into_narrower_shadows_are_the_host_update_bitwise(live_dtype, dtype) -> None:
    """The host path (and AveragedModel) lerps toward the live weights cast to the average's dtype
    first: the kernel rounds them there too, then lerps in fp32 and rounds once."""
    live = values(3000, live_dtype, 7)
    for w in WEIGHTS:
        shadow = values(3000, dtype, 8)
        want = torch.lerp(shadow, live.to(dtype), w)
        kernels.masked_update_([shadow], live, [weight(w)], OK)
        assert bitwise(shadow, want), w


def rounding_cases() -> torch.Tensor:
    """fp32 values at bf16's hard cases: ties to even (down and up), a carry into the exponent,
    overflow to infinity, subnormals, signed zeros; then ordinary values."""
    bits = [0x3F808000, 0x3F818000, 0x3F7FFFFF, 0x7F7FFFFF, 0xFF7FFFFF, 0x00000001, 0x00018000, 0x807FFFFF, 0, 1 << 31]
    special = torch.tensor(bits, dtype=torch.int64).to(torch.int32).view(torch.float32)
    return torch.cat([special, values(2000, torch.float32, 9)])


@pytest.mark.parametrize("pair", [(torch.float32, torch.bfloat16), (torch.float32, torch.float16),
                                  (torch.bfloat16, torch.float32), (torch.float16, torch.bfloat16),
                                  (torch.float32, torch.float32)])  # fmt: skip
def test_a_copy_is_bitwise_a_cast(pair) -> None:
    live_dtype, shadow_dtype = pair
    live = rounding_cases().to(live_dtype)
    shadow = torch.zeros(live.numel(), dtype=shadow_dtype)
    kernels.masked_update_([shadow], live, [None], OK)
    assert bitwise(shadow, live.to(shadow_dtype)), pair


@pytest.mark.parametrize("shadow_dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_non_finite_values_stay_non_finite_where_the_flag_lets_them_through(shadow_dtype) -> None:
    """With the check off the flag is true whatever the live values hold: NaN (any payload, which
    ATen's builds do not agree on) stays NaN, never a rounding carry into a finite value."""
    nans = torch.tensor([0x7FFFFFFF, -1, 0x7FC00000, 0x7F800001], dtype=torch.int64).to(torch.int32)
    live = torch.cat([nans.view(torch.float32), torch.tensor([float("inf"), -float("inf")])])
    for w in (None, weight(0.001), weight(0.9)):
        shadow = torch.ones(live.numel(), dtype=shadow_dtype)
        want = live if w is None else torch.lerp(shadow.float(), live, float(w))  # (inf: inf or NaN)
        kernels.masked_update_([shadow], live, [w], OK)
        assert not shadow.isfinite().any(), (shadow_dtype, w, shadow)
        torch.testing.assert_close(shadow.float(), want.to(shadow_dtype).float(), rtol=0, atol=0, equal_nan=True)


def test_several_shadows_from_one_live_piece_each_with_its_weight() -> None:
    """Six averages (two launches of up to four): lerps, a copy, an fp32 and a bf16 shadow."""
    live = values(2500, torch.bfloat16, 10)
    dtypes = [torch.float32, torch.float32, torch.bfloat16, torch.float32, torch.float32, torch.float32]
    given = [weight(0.001), weight(0.9), weight(0.5), None, weight(1.0), weight(0.25)]
    shadows = [values(2500, dtype, 11 + index) for index, dtype in enumerate(dtypes)]
    wants = []
    for shadow, w in zip(shadows, given):
        if w is None:
            wants.append(live.to(shadow.dtype))
        elif shadow.dtype == torch.float32:
            wants.append(torch.lerp(shadow, live.float(), float(w)))
        else:
            wants.append(torch.lerp(shadow, live, float(w)))
    kernels.masked_update_(shadows, live, given, OK)
    for index, (shadow, want) in enumerate(zip(shadows, wants)):
        assert bitwise(shadow, want), index


def test_empty_pieces_and_no_shadows_do_nothing() -> None:
    kernels.masked_update_([torch.empty(0)], torch.empty(0), [weight(0.5)], OK)
    kernels.masked_update_([], torch.ones(3), [], OK)


@pytest.mark.parametrize("ok", [NOT_OK, torch.zeros(1, dtype=torch.bool)])
def test_a_false_flag_writes_no_byte_of_any_shadow(ok: torch.Tensor) -> None:
    live = values(3000, torch.float32, 20)
    live[::7] = float("nan")
    live[3::11] = float("inf")
    live[5::13] = -float("inf")
    shadows = [values(3000, torch.float32, 21), values(3000, torch.bfloat16, 22), values(3000, torch.float32, 23)]
    before = [shadow.clone() for shadow in shadows]
    kernels.masked_update_(shadows, live, [weight(0.001), weight(0.9), None], ok)
    for index, (shadow, old) in enumerate(zip(shadows, before)):
        assert bitwise(shadow, old), index


def test_pieces_that_do_not_fit_together_are_refused() -> None:
    live, shadow = torch.ones(10), torch.zeros(10)
    with pytest.raises(ValueError, match=r"shadow 0 is torch.float32 of shape \(9,\) on cpu: pass .* of 10 on cpu"):
        kernels.masked_update_([torch.zeros(9)], live, [weight(0.5)], OK)
    with pytest.raises(ValueError, match=r"1 shadows but 2 weights"):
        kernels.masked_update_([shadow], live, [weight(0.5), None], OK)
    with pytest.raises(ValueError, match=r"ok is torch.float32"):
        kernels.masked_update_([shadow], live, [weight(0.5)], torch.ones(()))
    with pytest.raises(ValueError, match=r"live is torch.float64"):
        kernels.masked_update_([shadow], live.double(), [weight(0.5)], OK)
    with pytest.raises(ValueError, match=r"shadow 0 is not contiguous"):
        kernels.masked_update_([torch.zeros(20)[::2]], live, [weight(0.5)], OK)
    assert torch.equal(shadow, torch.zeros(10))


def test_usable_on_the_cpu_only_under_an_exact_interpreter(monkeypatch: pytest.MonkeyPatch) -> None:
    import triton

    monkeypatch.setattr(kernels, "self_check", lambda device: True)  # (what it checks: tests/test_kernel_fallback.py)
    assert kernels.usable(torch.device("cpu"))
    monkeypatch.setattr(triton, "__version__", "3.7.1")  # (torch 2.13's CUDA wheels pin it)
    kernels.reset()
    assert not kernels.usable(torch.device("cpu"))
    monkeypatch.undo()
    monkeypatch.setattr(kernels, "self_check", lambda device: True)
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    kernels.reset()
    assert kernels.usable(torch.device("cpu"))
    assert not kernels.usable(torch.device("cuda"))  # (interpreted, every launch would copy through the host)
    monkeypatch.delenv("TRITON_INTERPRET")
    assert kernels.usable(torch.device("cpu")), "cached per device type until reset()"
    kernels.reset()
    assert not kernels.usable(torch.device("cpu"))
    assert not kernels.usable(torch.device("cuda")) or torch.cuda.is_available()
    kernels.reset()
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    assert kernels.usable(torch.device("cuda"))


def test_a_cpu_run_never_imports_triton(monkeypatch: pytest.MonkeyPatch) -> None:
    """An averager's updates on the CPU do not import Triton (only where the kernel runs)."""
    monkeypatch.delenv("TRITON_INTERPRET")
    kernels.reset()
    imported, real_import = [], builtins.__import__

    def spy(name: str, *args, **kwargs):
        if name.partition(".")[0] == "triton":
            imported.append(name)
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", spy)
    averager = WeightAverager(torch.nn.Linear(4, 4))
    averager.update()
    averager.update()
    assert not kernels.usable(torch.device("cpu"))
    assert imported == [] and averager.num_updates == 2, imported


# The multi-tensor form: one launch for a whole list of pieces (``kernels.plan``, ``masked_update_many_``)

MANY_SIZES = (1, 5, 1023, 1024, 1025, 3000)  # tiny and larger pieces mixed in one launch, around a program's elements
LARGE_SIZES = (*MANY_SIZES[:-1], 70000)  # (the interpreter takes ~5 ms a program: this one where it counts)


def pieces(dtype: torch.dtype, seed: int, sizes: tuple[int, ...] = MANY_SIZES) -> list[torch.Tensor]:
    return [values(numel, dtype, seed * 100 + index) for index, numel in enumerate(sizes)]


class LaunchCounter:
    """Stands in for a Triton kernel: counts the launches (``kernel[grid](...)``) it passes on."""

    def __init__(self, kernel) -> None:
        self.kernel, self.launches = kernel, 0

    def __getitem__(self, grid):
        self.launches += 1
        return self.kernel[grid]


@pytest.fixture
def launches(monkeypatch: pytest.MonkeyPatch) -> LaunchCounter:
    module = kernels._module()
    counter = LaunchCounter(module.masked_lerp_many)
    monkeypatch.setattr(module, "masked_lerp_many", counter)
    return counter


def piece_by_piece(
    shadow_sets: list[list[torch.Tensor]], reads: list[torch.Tensor], given: list[torch.Tensor | None], ok: torch.Tensor
) -> list[list[torch.Tensor]]:
    """What ``masked_update_`` makes of copies of ``shadow_sets``, one launch per piece."""
    wants = [[shadow.clone() for shadow in shadows] for shadows in shadow_sets]
    for position, read in enumerate(reads):
        kernels.masked_update_([shadows[position] for shadows in wants], read, given, ok)
    return wants


def assert_bitwise_sets(got: list[list[torch.Tensor]], want: list[list[torch.Tensor]]) -> None:
    for k, (shadows, wanted) in enumerate(zip(got, want)):
        for position, (shadow, expected) in enumerate(zip(shadows, wanted)):
            assert bitwise(shadow, expected), (k, position, shadow.numel())


@pytest.mark.parametrize("live_dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("shadow_dtype", [torch.float32, torch.bfloat16])
def test_one_launch_over_mixed_pieces_is_bitwise_piece_by_piece(live_dtype, shadow_dtype, launches) -> None:
    """Three averages (two lerps and a copy) of six pieces from 1 to 3,000 elements: one launch,
    the bits of ``masked_update_`` called on each piece."""
    reads = pieces(live_dtype, 1)
    shadow_sets = [pieces(shadow_dtype, 2 + k) for k in range(3)]
    given = [weight(0.001), None, weight(0.9)]
    want = piece_by_piece(shadow_sets, reads, given, OK)
    kernels.masked_update_many_(kernels.plan(reads, shadow_sets), given, OK)
    assert launches.launches == 1
    assert_bitwise_sets(shadow_sets, want)


@pytest.mark.parametrize("averages", [1, 4])
def test_fp32_many_is_bitwise_foreach_lerp(averages: int, launches) -> None:
    reads = pieces(torch.float32, 10, LARGE_SIZES)
    shadow_sets = [pieces(torch.float32, 11 + k, LARGE_SIZES) for k in range(averages)]
    given = [0.001, 0.5, 0.9, 1.0][:averages]
    want = [[shadow.clone() for shadow in shadows] for shadows in shadow_sets]
    for shadows, w in zip(want, given):
        torch._foreach_lerp_(shadows, reads, w)
    kernels.masked_update_many_(kernels.plan(reads, shadow_sets), [weight(w) for w in given], OK)
    assert launches.launches == 1
    assert_bitwise_sets(shadow_sets, want)


def test_more_averages_than_one_launch_holds_take_one_launch_per_four(launches) -> None:
    """Six averages (fp32 and bf16 shadows mixed by average, copies among them): two launches."""
    sizes = (3, 1500, 1)
    reads = pieces(torch.bfloat16, 20, sizes)
    dtypes = [torch.float32, torch.bfloat16, torch.float32, torch.float32, torch.bfloat16, torch.float32]
    shadow_sets = [pieces(dtype, 21 + k, sizes) for k, dtype in enumerate(dtypes)]
    given = [weight(0.001), None, weight(0.5), weight(0.9), None, weight(0.25)]
    want = piece_by_piece(shadow_sets, reads, given, OK)
    kernels.masked_update_many_(kernels.plan(reads, shadow_sets), given, OK)
    assert launches.launches == 2
    assert_bitwise_sets(shadow_sets, want)


@pytest.mark.parametrize("ok", [NOT_OK, torch.zeros(1, dtype=torch.bool)])
def test_a_false_flag_writes_no_byte_of_any_piece(ok: torch.Tensor) -> None:
    reads = pieces(torch.float32, 30)
    for read in reads:
        read[::7] = float("nan")
        read[3::11] = float("inf")
    shadow_sets = [pieces(torch.float32, 31), pieces(torch.bfloat16, 32)]
    before = [[shadow.clone() for shadow in shadows] for shadows in shadow_sets]
    kernels.masked_update_many_(kernels.plan(reads, shadow_sets), [weight(0.001), None], ok)
    assert_bitwise_sets(shadow_sets, before)


def test_a_plan_is_reused_while_the_values_change_in_place(launches) -> None:
    """The tables hold addresses, not values: three updates through one plan, the live pieces
    rewritten in place between them, and one with the flag false, match three per-piece ones."""
    reads = pieces(torch.bfloat16, 40)
    shadow_sets = [pieces(torch.float32, 41), pieces(torch.float32, 42)]
    want = [[shadow.clone() for shadow in shadows] for shadows in shadow_sets]
    given = [weight(0.01), weight(0.3)]
    planned = kernels.plan(reads, shadow_sets)
    for step, ok in enumerate([OK, NOT_OK, OK]):
        for position, read in enumerate(reads):
            read.copy_(values(read.numel(), read.dtype, 50 + step * 10 + position))
        want = piece_by_piece(want, reads, given, ok)
        kernels.masked_update_many_(planned, given, ok)
        assert_bitwise_sets(shadow_sets, want)
    assert launches.launches == 3


def test_a_plan_skips_empty_pieces_and_spends_one_program_per_1024_elements() -> None:
    sizes = (0, 1, 1024, 0, 1025, 5000)
    reads = pieces(torch.float32, 60, sizes)
    shadow_sets = [pieces(torch.float32, 61, sizes)]
    want = piece_by_piece(shadow_sets, reads, [weight(0.5)], OK)
    planned = kernels.plan(reads, shadow_sets)
    assert planned.programs == 1 + 1 + 2 + 5 and len(planned.reads) == 4
    assert planned.piece_of_program.tolist() == [0, 1, 2, 2, 3, 3, 3, 3, 3]
    assert planned.index_in_piece.tolist() == [0, 0, 0, 1, 0, 1, 2, 3, 4]
    assert planned.align == 16 and [id(read) for read in planned.reads] == [id(reads[p]) for p in (1, 2, 4, 5)]
    kernels.masked_update_many_(planned, [weight(0.5)], OK)
    assert_bitwise_sets(shadow_sets, want)
    kernels.masked_update_many_(kernels.plan([torch.empty(0)], [[torch.empty(0)]]), [weight(0.5)], OK)
    kernels.masked_update_many_(kernels.plan([], [[]]), [None], torch.ones((), device="meta", dtype=torch.bool))


def test_pieces_at_any_alignment_are_bitwise_piece_by_piece() -> None:
    """Views one element into their storage: the plan tells the kernel 4 (fp32) or 2 (bf16) bytes."""
    sizes = (5, 1025, 3000)
    reads = [piece[1:] for piece in pieces(torch.float32, 70, tuple(n + 1 for n in sizes))]
    shadow_sets = [[s[1:] for s in pieces(torch.bfloat16, 71, tuple(n + 1 for n in sizes))]]
    want = piece_by_piece(shadow_sets, reads, [weight(0.9)], OK)
    planned = kernels.plan(reads, shadow_sets)
    assert planned.align == 2
    kernels.masked_update_many_(planned, [weight(0.9)], OK)
    assert_bitwise_sets(shadow_sets, want)


def test_pieces_that_do_not_plan_together_are_refused() -> None:
    reads = [torch.ones(10), torch.ones(3)]
    shadows = [torch.zeros(10), torch.zeros(3)]
    mixed = r"^plan: read 1 is torch.bfloat16 of shape \(3,\) on cpu but read 0 is torch.float32 of shape \(10,\)"
    with pytest.raises(ValueError, match=mixed + " on cpu: plan pieces of one dtype and device together$"):
        kernels.plan([reads[0], reads[1].bfloat16()], [shadows])
    longer = r"^plan: shadow 1 of average 0 is torch.float32 of shape \(4,\) on cpu: pass a dense flat view of 3$"
    with pytest.raises(ValueError, match=longer):
        kernels.plan(reads, [[shadows[0], torch.zeros(4)]])
    other = r"^plan: shadow 1 of average 1 is torch.bfloat16 of shape \(3,\) on cpu: pass torch.float32 "
    with pytest.raises(ValueError, match=other + r"\(fp32/bf16/fp16, one dtype per average\) on cpu$"):
        kernels.plan(reads, [shadows, [shadows[0], shadows[1].bfloat16()]])
    with pytest.raises(ValueError, match=r"^plan: shadow 0 of average 0 is .*, not contiguous: pass a dense flat"):
        kernels.plan(reads, [[torch.zeros(20)[::2], shadows[1]]])
    with pytest.raises(ValueError, match=r"^plan: read 0 is torch.float32 of shape \(2, 5\) on cpu: pass flat"):
        kernels.plan([reads[0].view(2, 5)], [[shadows[0]]])
    with pytest.raises(ValueError, match=r"^plan: average 0 has 1 shadows for 2 reads: give one per read$"):
        kernels.plan(reads, [shadows[:1]])
    planned = kernels.plan(reads, [shadows])
    with pytest.raises(ValueError, match=r"^masked_update_many_: 2 weights for a plan of 1 averages: give one per"):
        kernels.masked_update_many_(planned, [weight(0.5), None], OK)
    with pytest.raises(ValueError, match=r"^masked_update_many_: ok is torch.float32 of shape \(\) on cpu: pass one"):
        kernels.masked_update_many_(planned, [weight(0.5)], torch.ones(()))
    with pytest.raises(ValueError, match=r"^masked_update_many_: weight 0 is torch.int64 of shape \(1,\) on cpu"):
        kernels.masked_update_many_(planned, [torch.ones(1, dtype=torch.int64)], OK)
    assert all(torch.equal(shadow, torch.zeros(shadow.numel())) for shadow in shadows)


def test_a_plan_for_a_device_the_kernel_does_not_run_on_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    """Without the interpreter a CPU piece has no kernel to run it (and, interpreted, a CUDA
    address would be read on the host)."""
    monkeypatch.delenv("TRITON_INTERPRET")
    kernels.reset()
    with pytest.raises(ValueError, match=r"^plan: the kernel does not run on cpu here: check kernels.usable\(device\)"):
        kernels.plan([torch.ones(3)], [[torch.zeros(3)]])
