"""experiments/sft_warmstart.py: reproducible from its seed, and its defaults never touch the committed asset."""

import hashlib
import importlib.util
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
ASSET = ROOT / "rlcore" / "assets" / "countdown-tiny"


def _load():
    spec = importlib.util.spec_from_file_location("sft_warmstart", ROOT / "experiments" / "sft_warmstart.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules["sft_warmstart"] = mod  # dataclasses resolve string annotations through sys.modules
    spec.loader.exec_module(mod)
    return mod


def test_default_output_is_not_the_committed_asset():
    mod = _load()
    out = (ROOT / mod.Config().out_dir).resolve()
    assert out != ASSET.resolve() and ASSET.resolve() not in out.parents
    assert mod.Config().threads == 1  # the reproducible setting is the default


def test_two_runs_from_one_seed_give_identical_weights(tmp_path):
    mod = _load()
    digests = []
    for k in range(2):
        cfg = mod.Config(out_dir=str(tmp_path / str(k)), max_steps=6, eval_every=3, dev_size=16, heldout_size=16,
                         batch_size=16)
        mod.main(cfg)
        digests.append(hashlib.sha256((tmp_path / str(k) / "model.safetensors").read_bytes()).hexdigest())
    assert digests[0] == digests[1]
