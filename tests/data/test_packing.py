"""Property tests for rlcore.data.packing: exact round trips, positions, boundaries, padding."""

import torch
from hypothesis import given
from hypothesis import strategies as st

from rlcore.data import packing
from rlcore.data.trajectory import concat, make_row


@st.composite
def trajectories(draw, max_rows=5, max_len=9):
    rows = []
    for _ in range(draw(st.integers(1, max_rows))):
        p = draw(st.integers(1, max_len))
        o = draw(st.integers(0, max_len))
        ids = draw(st.lists(st.integers(1, 99), min_size=p + o, max_size=p + o))
        lp = draw(st.lists(st.floats(-5, 0, width=32), min_size=o, max_size=o))
        ver = draw(st.lists(st.integers(0, 4), min_size=o, max_size=o))
        rows.append(make_row(ids[:p], ids[p:], lp, sorted(ver), draw(st.floats(-1, 1, width=32))))
    return concat(rows)


@given(trajectories(), st.sampled_from([None, 1, 4, 16]))
def test_round_trip_exact(traj, mult):
    pk = packing.pack(traj, pad_to_multiple=mult)
    back = packing.unpack(pk)
    assert back.keys() == traj.keys()
    for k in traj:
        assert back[k].dtype == traj[k].dtype
        assert torch.equal(back[k], traj[k]), k


@given(trajectories(), st.sampled_from([None, 3, 8]))
def test_stream_layout(traj, mult):
    pk = packing.pack(traj, pad_to_multiple=mult)
    lengths = traj["attention_mask"].sum(1).tolist()
    t = pk.tokens["input_ids"].shape[0]
    assert pk.cu_seqlens.dtype == torch.int32
    assert int(pk.cu_seqlens[-1]) == t == sum(lengths) + pk.pad
    assert pk.cu_seqlens.shape[0] == len(lengths) + 1 + (1 if pk.pad else 0)
    if mult:
        assert t % mult == 0 and pk.pad < mult
    else:
        assert pk.pad == 0
    # positions restart at every boundary and count up inside a sequence
    for s, e in zip(pk.cu_seqlens[:-1].tolist(), pk.cu_seqlens[1:].tolist()):
        assert torch.equal(pk.position_ids[s:e], torch.arange(e - s))
    assert pk.max_seqlen == max([*lengths, pk.pad])
    # padding is inert: masks False, versions -1
    assert not pk.tokens["attention_mask"][sum(lengths):].any()
    assert not pk.tokens["loss_mask"][sum(lengths):].any()


@given(trajectories())
def test_roll_packed_shifts_within_sequences(traj):
    pk = packing.pack(traj, pad_to_multiple=4)
    x = torch.arange(pk.tokens["input_ids"].shape[0])
    y = packing.roll_packed(x, pk.cu_seqlens, fill=-7)
    for s, e in zip(pk.cu_seqlens[:-1].tolist(), pk.cu_seqlens[1:].tolist()):
        assert torch.equal(y[s : e - 1], x[s + 1 : e])
        assert int(y[e - 1]) == -7


def test_rejects_non_prefix_mask():
    traj = concat([make_row([1, 2], [3], [-0.1], [0], 1.0)])
    traj["attention_mask"] = torch.tensor([[True, False, True]])
    try:
        packing.pack(traj)
    except ValueError as e:
        assert "right-padded" in str(e)
    else:
        raise AssertionError("non-prefix attention_mask must be rejected")
