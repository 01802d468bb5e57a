"""The delayed-scaling update (NUMERICS.md §3) in one launch: history roll and new scales.

numerics.delayed_scaling_update runs about fifteen small torch ops per recipe state (amax over
the history, roll, zero, divide, compares, wheres, copies back), and every step updates two
states per module: on an H100 that was ~0.35 ms of host time a Linear step, more than the
GPU needs for a 4096-wide layer. This kernel does the same in place with one launch, the bytes
equal to the reference's:

- amax per slot: the max over the history rows ("max") or row 0 ("most_recent"); the max runs
  on the int32 bits (amaxes are >= 0, and NaN bits order above +inf, so NaN propagates as
  torch.amax's does);
- history: rolled by one row towards the front (row i takes row i + 1, the last row takes row 0),
  then row 0 zeroed;
- scale: fp8_max / amax as one correctly rounded division, divided by 2^margin (exact), an
  infinite result replaced by FLT_MAX, kept unchanged where amax is 0, infinite or NaN.

One program owns a group of slot columns and walks the history in row chunks, first for the
max, then for the roll in ascending order (each chunk reads rows below the ones it writes, none
of which an earlier chunk wrote), so the in-place roll needs no second buffer; barriers between
the reads and writes of a chunk keep the program's threads from overtaking each other (the H100
showed the race for a one-row history before they were there).
"""

from __future__ import annotations

import torch

from .fp8_common import cdiv, float32_value, jit, tl
from .launch import launch

SLOTS_BLOCK = 16
ROWS_BLOCK = 128
FLT_MAX = tl.constexpr(3.4028234663852886e38) if tl is not None else None


@jit
def _delayed_update_kernel(history_ptr, scale_ptr, fp8_max_ptr, rows, slots, margin_factor,
                           MOST_RECENT: tl.constexpr, SLOTS: tl.constexpr,
                           ROWS: tl.constexpr, ROLL: tl.constexpr):
    _update_slots(history_ptr, scale_ptr, fp8_max_ptr, rows, slots, margin_factor,
                  tl.program_id(0), MOST_RECENT, SLOTS, ROWS, ROLL)


@jit
def _delayed_update_many_kernel(base_ptr, offsets_ptr, rows, slots, margin_factor,
                                MOST_RECENT: tl.constexpr, SLOTS: tl.constexpr,
                                ROWS: tl.constexpr, ROLL: tl.constexpr):
    """Many states of one shape at once: program (block, state) reads state's history, scale
    and fp8_max at the element offsets offsets[state, 0:3] from base_ptr (all fp32)."""
    state = tl.program_id(1).to(tl.int64)
    history = base_ptr + tl.load(offsets_ptr + state * 3)
    scale = base_ptr + tl.load(offsets_ptr + state * 3 + 1)
    fp8_max = base_ptr + tl.load(offsets_ptr + state * 3 + 2)
    _update_slots(history, scale, fp8_max, rows, slots, margin_factor, tl.program_id(0),
                  MOST_RECENT, SLOTS, ROWS, ROLL)


@jit
def _update_slots(history_ptr, scale_ptr, fp8_max_ptr, rows, slots, margin_factor, block,
                  MOST_RECENT: tl.constexpr, SLOTS: tl.constexpr, ROWS: tl.constexpr,
                  ROLL: tl.constexpr):
    """Slot block `block` of one state. ROLL: the history has more than one row. A one-row
    history has nothing to roll, and its loop must not be emitted at all: Triton specialises
    `rows` == 1 to a constant, and the resulting zero-trip loop crashed Triton 3.6's coalescing
    pass on sm_90 (H200 run)."""
    slot = block * SLOTS + tl.arange(0, SLOTS)
    slot_ok = slot < slots
    row_zero = tl.load(history_ptr + slot, mask=slot_ok, other=0.0)
    if MOST_RECENT:
        amax = row_zero
    else:
        running = tl.zeros([SLOTS], dtype=tl.int32)
        start = 0
        while start < rows:  # while, not range(): the interpreter takes no runtime range bound
            row = start + tl.arange(0, ROWS)
            mask = (row < rows)[:, None] & slot_ok[None, :]
            values = tl.load(history_ptr + row[:, None] * slots + slot[None, :], mask=mask,
                             other=0.0)
            running = tl.maximum(running, tl.max(values.to(tl.int32, bitcast=True), axis=0))
            start += ROWS
        amax = running.to(tl.float32, bitcast=True)
    # Threads of one program read and write the same rows: every phase ends with a barrier, so
    # no thread stores over a row another has yet to read (nor writes a row twice out of order).
    tl.debug_barrier()
    # roll towards the front: row i <- row i + 1 (ascending chunks; see the module docstring)
    if ROLL:
        start = 0
        while start < rows - 1:
            row = start + tl.arange(0, ROWS)
            mask = (row < rows - 1)[:, None] & slot_ok[None, :]
            values = tl.load(history_ptr + (row[:, None] + 1) * slots + slot[None, :],
                             mask=mask, other=0.0)
            tl.debug_barrier()
            tl.store(history_ptr + row[:, None] * slots + slot[None, :], values, mask=mask)
            tl.debug_barrier()
            start += ROWS
    # the oldest row takes the newest amax, then row 0 starts empty (one row: just empty)
    newest = tl.where(rows > 1, row_zero, 0.0)
    tl.store(history_ptr + (rows - 1) * slots + slot, newest, mask=slot_ok)
    tl.store(history_ptr + slot, tl.zeros([SLOTS], dtype=tl.float32), mask=slot_ok & (rows > 1))
    # new scales
    amax_bits = amax.to(tl.int32, bitcast=True) & 0x7FFFFFFF
    valid = (amax > 0) & (amax_bits < 0x7F800000)
    safe_amax = tl.where(valid, amax, 1.0)
    fp8_max = tl.load(fp8_max_ptr + slot, mask=slot_ok, other=1.0)
    candidate = tl.math.div_rn(tl.math.div_rn(fp8_max, safe_amax),
                               tl.zeros_like(fp8_max) + margin_factor)
    candidate = tl.where(candidate == float("inf"), FLT_MAX, candidate)
    old_scale = tl.load(scale_ptr + slot, mask=slot_ok, other=1.0)
    tl.store(scale_ptr + slot, tl.where(valid, candidate, old_scale), mask=slot_ok)


# key: the (history, scale, fp8_max) addresses of a list of states -> its device offset table
# (and the pinned host copy it came from, alive until the asynchronous copy has run)
_OFFSET_TABLES: dict[tuple[int, ...], tuple[torch.Tensor, torch.Tensor]] = {}


def delayed_scaling_update_many_(
    states: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]],
    *,
    margin: float = 0,
    amax_compute_algo: str = "max",
) -> None:
    """delayed_scaling_update_ on many states in one launch: (amax_history, scale, fp8_max) per
    state, every history of one shape [rows, slots] on one device, no tensor twice.

    Why: autocast updates two states per module and step, one launch each, which at 80 Linears
    cost ~20 ms of host time a step (benchmarks/model_step.py, delayed eager). The offset table
    (each tensor's element offset from the first history) is built once per set of addresses
    and kept on the device: the states are long-lived, so later steps reuse it.
    """
    if not states:
        return
    for history, scale, fp8_max in states:
        _check_state(history, scale, fp8_max, amax_compute_algo)
    rows, slots = states[0][0].shape
    if any(history.shape != (rows, slots) for history, _, _ in states):
        raise ValueError("delayed_scaling_update_many_: every amax_history must have one shape")
    if rows == 0 or slots == 0:
        return
    base = states[0][0]
    key = tuple(t.data_ptr() for state in states for t in state)
    if len(set(key)) != len(key):
        raise ValueError("delayed_scaling_update_many_: a tensor appears twice (the updates "
                         "would race); pass each state once")
    entry = _OFFSET_TABLES.get(key)
    if entry is None:
        if len(_OFFSET_TABLES) > 64:
            _OFFSET_TABLES.clear()
        host = torch.tensor([(address - base.data_ptr()) // 4 for address in key],
                            dtype=torch.int64, device="cpu")  # whatever the default device
        if base.is_cuda:  # no host sync: a pinned copy, sent asynchronously
            host = host.pin_memory()
        entry = _OFFSET_TABLES[key] = (host.to(base.device, non_blocking=True), host)
    table = entry[0]
    launch(_delayed_update_many_kernel, (cdiv(slots, SLOTS_BLOCK), len(states)), base, table,
           rows, slots, float32_value(2.0 ** margin),
           MOST_RECENT=amax_compute_algo == "most_recent", SLOTS=SLOTS_BLOCK, ROWS=ROWS_BLOCK,
           ROLL=rows > 1, num_warps=4)


def _check_state(amax_history: torch.Tensor, scale: torch.Tensor, fp8_max: torch.Tensor,
                 amax_compute_algo: str) -> None:
    if amax_compute_algo not in ("max", "most_recent"):
        raise ValueError(
            f"unknown amax_compute_algo {amax_compute_algo!r}: use 'max' or 'most_recent'"
        )
    if (amax_history.dtype != torch.float32 or amax_history.dim() != 2
            or not amax_history.is_contiguous()):
        raise ValueError("delayed_scaling_update_: amax_history must be a contiguous fp32 "
                         "[history_len, slots] tensor")
    slots = amax_history.shape[1]
    for name, tensor, numel in (("scale", scale, slots), ("fp8_max", fp8_max, slots)):
        if (tensor.dtype != torch.float32 or tensor.numel() != numel
                or not tensor.is_contiguous() or tensor.device != amax_history.device):
            raise ValueError(f"delayed_scaling_update_: {name} must be a contiguous fp32 tensor "
                             f"of {numel} values on the history's device")


def delayed_scaling_update_(
    amax_history: torch.Tensor,
    scale: torch.Tensor,
    fp8_max: torch.Tensor,
    *,
    margin: float = 0,
    amax_compute_algo: str = "max",
) -> None:
    """numerics.delayed_scaling_update applied in place to a state's history [rows, slots] and
    scale [slots] (fp32, contiguous, one device); fp8_max holds one fp32 value per slot."""
    _check_state(amax_history, scale, fp8_max, amax_compute_algo)
    rows, slots = amax_history.shape
    if rows == 0 or slots == 0:
        return
    launch(_delayed_update_kernel, (cdiv(slots, SLOTS_BLOCK),), amax_history, scale, fp8_max,
           rows, slots, float32_value(2.0 ** margin),
           MOST_RECENT=amax_compute_algo == "most_recent", SLOTS=SLOTS_BLOCK, ROWS=ROWS_BLOCK,
           ROLL=rows > 1, num_warps=4)
