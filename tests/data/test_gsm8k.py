"""GSM8K jsonl loading (clear errors on bad rows) and the stateful prompt loader."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from rlcore.data import gsm8k
from rlcore.data.loader import PromptLoader
from rlcore.rollout.rewards.math import gsm8k_reward

GOOD = {"question": "Tom has 3 apples and buys 1,200 more. How many?", "answer": "3+1200=1203\n#### 1,203"}


def test_row_format_and_reward_agree(tmp_path):
    p = tmp_path / "mini.jsonl"
    p.write_text(json.dumps(GOOD) + "\n\n" + json.dumps({**GOOD, "answer": "x\n#### -4"}) + "\n")
    rows = gsm8k.load(p)
    assert [r["answer"] for r in rows] == ["1203", "-4"]
    assert rows[0]["messages"][0]["role"] == "user" and rows[0]["messages"][0]["content"].startswith("Tom has")
    assert gsm8k_reward(rows[0]["solution"], rows[0]) == 1.0


BAD_ROWS = [
    ("{not json", "not valid JSON"),
    ("[1, 2]", "expected a JSON object"),
    (json.dumps({"answer": "#### 1"}), "field 'question'"),
    (json.dumps({"question": "q", "answer": 5}), "field 'answer'"),
    (json.dumps({"question": "q", "answer": "no marker"}), "field 'answer' must end with '####"),
    (json.dumps({"question": "q", "answer": "x ####  "}), "empty final answer"),
    (json.dumps({"question": "q", "answer": "x\n#### banana"}), "non-numeric final answer 'banana'"),
    (json.dumps({"question": "q", "answer": "x\n#### 12 apples"}), "non-numeric final answer"),
]


@given(bad=st.sampled_from(BAD_ROWS), before=st.integers(0, 3))
def test_malformed_row_names_file_line_and_field(tmp_path_factory, bad, before):
    line, message = bad
    p = tmp_path_factory.mktemp("g") / "bad.jsonl"
    p.write_text("".join(json.dumps(GOOD) + "\n" for _ in range(before)) + line + "\n")
    with pytest.raises(ValueError, match=message) as e:
        gsm8k.load(p)
    assert f"bad.jsonl:{before + 1}:" in str(e.value)


def test_non_utf8_file_names_file_and_line(tmp_path):
    p = tmp_path / "latin1.jsonl"
    p.write_bytes((json.dumps(GOOD) + "\n").encode() + json.dumps({**GOOD, "question": "caf\u00e9"}, ensure_ascii=False).encode("latin-1") + b"\n")
    with pytest.raises(ValueError, match=r"latin1\.jsonl:2: not valid UTF-8 \(byte 0xe9") as e:
        gsm8k.load(p)
    assert "re-encode" in str(e.value)


def test_numeric_final_answers_accepted():
    for final, want in [("1,203", "1203"), ("-4", "-4"), ("2.50", "2.50"), ("+7", "+7"), (".5", ".5")]:
        assert gsm8k.parse_row(json.dumps({"question": "q", "answer": f"x\n#### {final}"}))["answer"] == want


def test_missing_file_and_split_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match="does not exist") as e:
        gsm8k.load(tmp_path / "nope.jsonl")
    msg = str(e.value)  # names the flag and both ways to get the data
    assert "--data-dir" in msg and "--data " in msg and "bundled" in msg and "load_dataset('openai/gsm8k'" in msg  # eval.py: --data
    with pytest.raises(ValueError, match="split"):
        gsm8k.load_split("dev")


def test_bundled_data_is_the_default_and_loads_whole(monkeypatch):
    monkeypatch.delenv("RLCORE_GSM8K_DIR", raising=False)
    assert gsm8k._default_dir() == gsm8k.BUNDLED_DIR
    assert gsm8k.BUNDLED_DIR.parent == Path(gsm8k.__file__).resolve().parent  # inside the package
    assert "MIT License" in (gsm8k.BUNDLED_DIR / "LICENSE").read_text()
    sizes = {split: len(gsm8k.load_split(split, root=gsm8k.BUNDLED_DIR)) for split in ("train", "test")}
    assert sizes == {"train": 7473, "test": 1319}
    monkeypatch.setenv("RLCORE_GSM8K_DIR", "/some/where")
    assert gsm8k._default_dir() == Path("/some/where")


def test_package_data_declared_in_pyproject():
    import tomllib

    root = Path(gsm8k.__file__).resolve().parents[2]
    data = tomllib.loads((root / "pyproject.toml").read_text())["tool"]["setuptools"]["package-data"]["rlcore.data"]
    for name in ("train.jsonl", "test.jsonl", "LICENSE"):
        assert any(Path("gsm8k", name).match(pat) for pat in data), name


@given(n=st.integers(1, 9), seed=st.integers(0, 99), epochs=st.integers(1, 3), shuffle=st.booleans())
def test_loader_yields_each_prompt_once_per_epoch(n, seed, epochs, shuffle):
    loader = PromptLoader(list(range(n)), seed=seed, shuffle=shuffle)
    pulled = [next(loader) for _ in range(n * epochs)]
    for e in range(epochs):
        window = pulled[e * n:(e + 1) * n]
        assert sorted(i for i, _ in window) == list(range(n))
        assert all(i == item for i, item in window)
    assert loader.epoch == epochs - 1


@given(n=st.integers(2, 9), seed=st.integers(0, 99), k=st.integers(0, 20), data=st.data())
def test_loader_state_round_trip_and_requeue(n, seed, k, data):
    a = PromptLoader(list(range(n)), seed=seed)
    for _ in range(k):
        next(a)
    back = data.draw(st.lists(st.integers(0, n - 1), max_size=3))
    a.requeue(back)
    b = PromptLoader(list(range(n)), seed=seed + 1)
    b.load_state_dict(a.state_dict())
    seq_a = [next(a)[0] for _ in range(2 * n)]
    seq_b = [next(b)[0] for _ in range(2 * n)]
    assert seq_a == seq_b and seq_a[: len(back)] == back


def test_loader_errors():
    with pytest.raises(ValueError, match="empty"):
        PromptLoader([])
    loader = PromptLoader([1, 2])
    with pytest.raises(IndexError, match="outside"):
        loader.requeue([5])
    with pytest.raises(ValueError, match="same dataset"):
        PromptLoader([1, 2, 3]).load_state_dict(loader.state_dict())
